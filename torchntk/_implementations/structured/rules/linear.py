"""``F.linear(x, W, b)``: weight and bias.

With ``x`` viewed as ``(S, I)`` (all leading axes flattened into positions ``s``) and ``G = df/dy``
as ``(S, C)``:

    J_W[c, i] = sum_s G[s, c] x[s, i]          J_b[c] = sum_s G[s, c]

so ``J_W1 . J_W2 = sum_{s,t} <x1[s], x2[t]> <G1[s], G2[t]>``; opt_einsum picks between that Gram
order and forming ``J`` first. Weight and bias together are one factor with the operand
``[x, 1]``, so the ``G``-Gram is computed once for both: ``K = GG * (Kx + 1)``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch.nn.functional as F

from .._roles import Role, RuleCall
from ._common import append_ones, bind
from ._registry import RefOf, rule


@rule(F.linear)
def linear_rule(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf) -> Optional[RuleCall]:
    """``F.linear(x, W, b)`` with a 2-D weight; declines a parameter as ``x``."""
    x, weight, bias = bind(args, kwargs, ("input", "weight", "bias"), {"bias": None})
    weight_ref, bias_ref = ref_of(weight), ref_of(bias)
    if ref_of(x) is not None or weight.ndim != 2:
        return None
    output = func(*args, **kwargs)
    channels, features = weight.shape
    positions = output.numel() // channels if channels else 0

    def build():
        inputs = x.detach().reshape(positions, features)
        augmented = None
        if bias is not None:
            augmented = append_ones(inputs)
            inputs = augmented[:, :features]
        else:
            inputs = inputs.clone()
        roles = []
        if weight_ref is not None:
            roles.append(Role(
                (weight_ref,), "weight", (positions, channels), "sc", [(inputs, "si")], "ci", (channels, features),
                local=lambda w: func(x, w, bias), seen=weight,
            ))
        if bias_ref is not None:
            roles.append(Role(
                (bias_ref,), "bias", (positions, channels), "sc", [], "c", (channels,),
                local=lambda b: func(x, weight, b), seen=bias,
            ))
        joint = None
        if weight_ref is not None and bias_ref is not None:
            joint = Role(
                (weight_ref, bias_ref), "weight+bias", (positions, channels), "sc", [(augmented, "si")], "ci",
                (channels, features + 1),
            )
        return roles, joint

    return RuleCall(output, build)

