"""Affine parameters of ``layer_norm``, ``group_norm`` and ``batch_norm``.

Each op is ``y = x_hat * gamma + beta`` with ``x_hat`` the normalised input, which does not
depend on ``gamma`` or ``beta``. With ``y`` viewed as ``(S, C)`` (``C`` the entries ``gamma``
scales, ``S`` everything it is broadcast over):

    J_gamma[c] = sum_s G[s, c] x_hat[s, c]          J_beta[c] = sum_s G[s, c]

``x_hat`` is recomputed by the same op without affine parameters, so eps, running statistics
(``batch_norm`` in eval mode) and batch statistics (training mode, which couples examples; it
is only reached without ``vmap_axes``) are exactly the model's. Together the two use the
operand ``[x_hat, 1]`` stacked on a last axis.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .._roles import Role, RuleCall
from ._common import bind
from ._registry import RefOf, rule

Tensor = torch.Tensor

_AFFINE = ("weight", "bias", "eps")
_AFFINE_DEFAULTS = {"weight": None, "bias": None, "eps": 1e-5}


@rule(F.layer_norm)
def layer_norm_rule(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf) -> Optional[RuleCall]:
    """``F.layer_norm(x, normalized_shape, weight, bias, eps)``: ``y`` viewed as ``(S, C)``."""
    x, shape, weight, bias, eps = bind(args, kwargs, ("input", "normalized_shape", *_AFFINE), _AFFINE_DEFAULTS)
    if ref_of(x) is not None:
        return None
    output = func(*args, **kwargs)
    channels = math.prod(shape) if isinstance(shape, (tuple, list, torch.Size)) else int(shape)
    view = (output.numel() // channels if channels else 0, channels)
    return RuleCall(output, _affine_roles(
        ref_of, weight, bias, view, "sc", lambda: F.layer_norm(x.detach(), shape, None, None, eps),
        lambda w, b: func(x, shape, w, b, eps),
    ))


@rule(F.group_norm)
def group_norm_rule(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf) -> Optional[RuleCall]:
    """``F.group_norm(x, num_groups, weight, bias, eps)``: ``y`` viewed as ``(B, C, D)``."""
    x, groups, weight, bias, eps = bind(args, kwargs, ("input", "num_groups", *_AFFINE), _AFFINE_DEFAULTS)
    if ref_of(x) is not None:
        return None
    output = func(*args, **kwargs)
    return RuleCall(output, _affine_roles(
        ref_of, weight, bias, _channels_view(output), "bcd",
        lambda: F.group_norm(x.detach(), groups, None, None, eps), lambda w, b: func(x, groups, w, b, eps),
    ))


@rule(F.batch_norm)
def batch_norm_rule(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf) -> Optional[RuleCall]:
    """``F.batch_norm`` with running statistics (eval) or batch statistics (training)."""
    names = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps")
    defaults = {"weight": None, "bias": None, "training": False, "momentum": 0.1, "eps": 1e-5}
    x, mean, var, weight, bias, training, momentum, eps = bind(args, kwargs, names, defaults)
    if any(ref_of(value) is not None for value in (x, mean, var)):
        return None
    output = func(*args, **kwargs)

    def normalised():
        # Batch statistics must not update the running ones a second time, so none are passed.
        if training:
            return F.batch_norm(x.detach(), None, None, training=True, momentum=0.0, eps=eps)
        return F.batch_norm(x.detach(), mean, var, training=False, momentum=0.0, eps=eps)

    def local(w, b):
        if training:
            return F.batch_norm(x, None, None, w, b, training=True, momentum=0.0, eps=eps)
        return func(x, mean, var, w, b, False, momentum, eps)

    return RuleCall(output, _affine_roles(ref_of, weight, bias, _channels_view(output), "bcd", normalised, local))


def _channels_view(output: Tensor) -> tuple[int, int, int]:
    """``(B, C, *spatial) -> (B, C, D)``; an unbatched ``(C, *spatial)`` input has ``B = 1``."""
    if output.ndim == 1:
        return (1, output.shape[0], 1)
    return (output.shape[0], output.shape[1], math.prod(output.shape[2:]))


def _affine_roles(
    ref_of: RefOf,
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    view: tuple[int, ...],
    labels: str,
    normalised: Callable[[], Tensor],
    local: Callable[[Optional[Tensor], Optional[Tensor]], Tensor],
) -> Callable[[], tuple[list[Role], Optional[Role]]]:
    """Roles of ``gamma`` (letter ``c`` of ``labels``) and ``beta``; ``y`` viewed as ``view``."""
    weight_ref = ref_of(weight) if weight is not None else None
    bias_ref = ref_of(bias) if bias is not None else None
    channels = view[labels.index("c")]

    def build():
        roles = []
        stacked = None
        if weight_ref is not None:
            x_hat = normalised().reshape(view)
            stacked = torch.stack([x_hat, torch.ones_like(x_hat)], dim=-1) if bias_ref is not None else None
            operand = stacked[..., 0] if stacked is not None else x_hat.clone()
            roles.append(Role(
                (weight_ref,), "weight", view, labels, [(operand, labels)], "c", (channels,),
                local=lambda w: local(w, bias), seen=weight,
            ))
        if bias_ref is not None:
            roles.append(Role(
                (bias_ref,), "bias", view, labels, [], "c", (channels,), local=lambda b: local(weight, b), seen=bias
            ))
        joint = None
        if stacked is not None:
            joint = Role(
                (weight_ref, bias_ref), "weight+bias", view, labels, [(stacked, labels + "r")], "cr", (channels, 2)
            )
        return roles, joint

    return build
