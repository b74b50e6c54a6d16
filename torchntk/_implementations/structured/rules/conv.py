"""``conv1d``/``conv2d``/``conv3d``: weight and bias, any stride, padding, dilation and groups.

With ``g`` groups, the input patches ``U[b, g, q, d]`` (``q`` runs over the ``C_in / g`` input
channels of the group times the kernel taps, ``d`` over output positions) and
``G[b, g, o, d] = df/dy`` for the group's output channels ``o``:

    J_W[g, o, q] = sum_{b,d} G[b, g, o, d] U[b, g, q, d]        J_b[g, o] = sum_{b,d} G[b, g, o, d]

``J_W1 . J_W2`` can be evaluated by forming ``J`` (per-example weight gradients), through the
patch and ``G`` Grams, or in a mixed order; opt_einsum picks the cheapest for the shapes. String
padding (``'same'``, ``'valid'``) is turned
into explicit zero padding the way PyTorch does it (extra padding at the end); other padding
modes reach the op already padded (``nn.Conv*`` pads with ``F.pad`` first).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .._roles import Role, RuleCall
from ._common import as_tuple, bind
from ._registry import RefOf, rule

_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


@rule(torch.conv1d, torch.conv2d, torch.conv3d)
def conv_rule(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf) -> Optional[RuleCall]:
    """A convolution's weight and bias; declines a parameter as the input."""
    x, weight, bias, stride, padding, dilation, groups = bind(args, kwargs, _NAMES, _DEFAULTS)
    weight_ref, bias_ref = ref_of(weight), ref_of(bias)
    if ref_of(x) is not None:
        return None
    output = func(*args, **kwargs)
    spatial = weight.ndim - 2
    unbatched = x.ndim == spatial + 1
    channels = weight.shape[0]
    kernel = tuple(weight.shape[2:])
    batched_output = output.unsqueeze(0) if unbatched else output
    examples, positions = batched_output.shape[0], math.prod(batched_output.shape[2:])
    y_shape = (examples, groups, channels // groups, positions)

    def build():
        inputs = x.detach().unsqueeze(0) if unbatched else x.detach()
        patches = _patches(inputs, kernel, as_tuple(stride, spatial), padding, as_tuple(dilation, spatial))
        if tuple(patches.shape[2 : 2 + spatial]) != tuple(batched_output.shape[2:]):
            raise AssertionError(
                f"patches {tuple(patches.shape)} do not match the output {tuple(batched_output.shape)}"
            )
        # (b, C_in, *out, *taps) -> (b, g, C_in / g * taps, positions), copied once
        order = (0, 1, *range(2 + spatial, 2 + 2 * spatial), *range(2, 2 + spatial))
        taps = inputs.shape[1] // groups * math.prod(kernel)
        patches = patches.permute(order).reshape(examples, groups, taps, positions)
        roles = []
        if weight_ref is not None:
            roles.append(Role(
                (weight_ref,), "weight", y_shape, "bgod", [(patches, "bgqd")], "goq",
                (groups, channels // groups, taps),
                local=lambda w: func(x, w, bias, stride, padding, dilation, groups), seen=weight,
            ))
        if bias_ref is not None:
            roles.append(Role(
                (bias_ref,), "bias", y_shape, "bgod", [], "go", (groups, channels // groups),
                local=lambda b: func(x, weight, b, stride, padding, dilation, groups), seen=bias,
            ))
        # No joint weight+bias factor: convolutions are usually contracted through J (see
        # _contract.py), where sharing the G-Gram saves nothing, and [U, 1] would cost a copy.
        return roles, None

    return RuleCall(output, build)


def _patches(x, kernel, stride, padding, dilation):
    """``(b, C, *spatial) -> (b, C, *out, *taps)``: every kernel tap's input at every output position."""
    spatial = len(kernel)
    x = F.pad(x, _explicit_padding(padding, kernel, dilation))
    for axis in range(spatial):
        span = dilation[axis] * (kernel[axis] - 1) + 1
        x = x.unfold(2 + axis, span, stride[axis])
    if all(step == 1 for step in dilation):
        return x  # every tap (indexing with steps of one would still cost a view per call)
    taps = (Ellipsis,) + tuple(slice(None, None, step) for step in dilation)
    return x[taps]


def _explicit_padding(padding, kernel, dilation) -> list[int]:
    """``F.pad`` amounts (last axis first) for int, tuple, ``'valid'`` or ``'same'`` padding."""
    spatial = len(kernel)
    if isinstance(padding, str):
        if padding == "valid":
            pairs = [(0, 0)] * spatial
        else:  # "same": the odd one of the total goes at the end, as PyTorch does
            totals = [step * (size - 1) for step, size in zip(dilation, kernel)]
            pairs = [(total // 2, total - total // 2) for total in totals]
    else:
        pairs = [(amount, amount) for amount in as_tuple(padding, spatial)]
    flat: list[int] = []
    for before, after in reversed(pairs):
        flat.extend((before, after))
    return flat
