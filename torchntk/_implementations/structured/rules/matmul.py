"""``x @ W`` and ``W @ x`` (``torch.matmul``, ``Tensor.matmul``, ``mm``) with a 1-D or 2-D parameter.

Parameter on the right, ``y[s, j] = sum_i x[s, i] W[i, j]`` (leading axes of ``x`` flattened into
``s``): ``J_W[i, j] = sum_s x[s, i] G[s, j]``, the linear-layer rule with the weight transposed. A
1-D ``w`` drops ``j``. Parameter on the left, ``y[s, c, k] = sum_i W[c, i] x[s, i, k]``:
``J_W[c, i] = sum_{s,k} G[s, c, k] x[s, i, k]``. A parameter with more axes (a batched product)
or on both sides goes to the Jacobian fallback.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .._roles import ParamRef, Role, RuleCall
from ._common import bind
from ._registry import RefOf, rule

Tensor = torch.Tensor


@rule(torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.mm, Tensor.mm)
def matmul_rule(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf) -> Optional[RuleCall]:
    """A product with the parameter on exactly one side."""
    left, right = bind(args, kwargs, ("input", "other"), {})
    left_ref, right_ref = ref_of(left), ref_of(right)
    if (left_ref is None) == (right_ref is None):
        return None
    output = func(*args, **kwargs)
    if right_ref is not None:
        return _parameter_on_the_right(func, left, right, right_ref, output)
    return _parameter_on_the_left(func, left, right, left_ref, output)


def _parameter_on_the_right(
    func: Callable, x: Tensor, weight: Tensor, ref: ParamRef, output: Tensor
) -> Optional[RuleCall]:
    if weight.ndim not in (1, 2) or x.ndim < 1:
        return None
    features = weight.shape[0]
    positions = x.numel() // features if features else 0

    def build():
        inputs = x.detach().reshape(positions, features).clone()
        local = lambda w: func(x, w)  # noqa: E731
        if weight.ndim == 1:
            role = Role(
                (ref,), "matmul operand", (positions,), "s", [(inputs, "si")], "i", (features,),
                local=local, seen=weight,
            )
            return [role], None
        columns = weight.shape[1]
        role = Role(
            (ref,), "matmul operand", (positions, columns), "sj", [(inputs, "si")], "ij", (features, columns),
            local=local, seen=weight,
        )
        return [role], None

    return RuleCall(output, build)


def _parameter_on_the_left(
    func: Callable, weight: Tensor, x: Tensor, ref: ParamRef, output: Tensor
) -> Optional[RuleCall]:
    if weight.ndim != 2 or x.ndim < 1:
        return None
    rows, features = weight.shape

    def build():
        local = lambda w: func(w, x)  # noqa: E731
        if x.ndim == 1:
            inputs = x.detach().clone()
            role = Role(
                (ref,), "matmul operand", (rows,), "c", [(inputs, "i")], "ci", (rows, features),
                local=local, seen=weight,
            )
            return [role], None
        columns = x.shape[-1]
        positions = x.numel() // (features * columns) if features * columns else 0
        inputs = x.detach().reshape(positions, features, columns).clone()
        role = Role(
            (ref,), "matmul operand", (positions, rows, columns), "sck", [(inputs, "sik")], "ci", (rows, features),
            local=local, seen=weight,
        )
        return [role], None

    return RuleCall(output, build)
