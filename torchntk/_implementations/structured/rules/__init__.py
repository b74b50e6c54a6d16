"""Closed-form derivative rules, one module per family of ops, and the table the recorder uses.

A rule is ``rule(func, args, kwargs, ref_of) -> RuleCall | None``. ``ref_of(value)`` returns the
:class:`~.._roles.ParamRef` of a differentiated parameter (or a view of one) and ``None`` for
anything else. A rule returns ``None`` when it does not apply (a parameter in an argument it has
no formula for, an option that changes the derivative); the recorder then sends the parameters
involved to the Jacobian fallback. Otherwise it computes the op's output itself and describes
each parameter's Jacobian factor as a :class:`~.._roles.Role`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .._roles import RuleCall
from .conv import conv_rule
from .elementwise import add_rule, div_rule, mul_rule, sub_rule
from .embedding import embedding_rule
from .linear import linear_rule
from .matmul import matmul_rule
from .norms import batch_norm_rule, group_norm_rule, layer_norm_rule

Rule = Callable[..., Optional[RuleCall]]

Tensor = torch.Tensor

RULES: dict[Callable, Rule] = {
    torch._C._nn.linear: linear_rule,
    torch.matmul: matmul_rule,
    Tensor.matmul: matmul_rule,
    Tensor.__matmul__: matmul_rule,
    torch.mm: matmul_rule,
    Tensor.mm: matmul_rule,
    torch.conv1d: conv_rule,
    torch.conv2d: conv_rule,
    torch.conv3d: conv_rule,
    F.embedding: embedding_rule,
    F.layer_norm: layer_norm_rule,
    F.group_norm: group_norm_rule,
    F.batch_norm: batch_norm_rule,
    torch.mul: mul_rule,
    Tensor.mul: mul_rule,
    Tensor.__mul__: mul_rule,
    torch.add: add_rule,
    Tensor.add: add_rule,
    Tensor.__add__: add_rule,
    torch.sub: sub_rule,
    Tensor.sub: sub_rule,
    Tensor.__sub__: sub_rule,
    torch.div: div_rule,
    Tensor.div: div_rule,
    Tensor.__truediv__: div_rule,
}
"""Ops with a closed-form rule, keyed by the function object a function mode receives."""
