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

NOTE: [Convolutions through derivatives]
A model that differentiates through a convolution with respect to its input (a force field of a
convolutional energy, a PINN on a grid) consumes the weight again in the input gradient
``dL/dx = conv_transpose(g, W)`` of ``convolution_backward``. A traced graph (NOTE: [Unrolled
derivatives] in ``_unrolled.py``) calls :func:`convolution_input_gradient` there instead, whose
rule states that use's factor: with ``V[b, c_out, k, l] = sum_j g[b, c_out, j] [l = j s - p + k d]``
(the output gradient each input position ``l`` receives through tap ``k``; computed exactly as
one transposed convolution of ``g`` with one-hot kernels) and ``G[b, g, i, l] = df/d(dL/dx)``,

    J_W[g, o, i, k] = sum_{b,l} G[b, g, i, l] V[b, g, o, k, l]

In a traced graph the forward convolution (``aten.convolution``) states the weight in the same
axes ``(g, o, i, *kernel)``, ``q`` split (the patches viewed so), so that the forward use and the
input-gradient uses of one weight pair by einsum and merge by kind. ``torch.conv2d`` and the like
keep ``q``: its pairs' contraction steps flatten one letter fewer.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function_variadic

from .._roles import Role, RuleCall
from ._common import as_tuple, bind
from ._registry import RefOf, rule

_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_KERNEL_LETTERS = "kmn"  # one per spatial axis of the kernel
_DEFAULTS = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


@rule(torch.conv1d, torch.conv2d, torch.conv3d)
def conv_rule(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf) -> Optional[RuleCall]:
    """A convolution's weight and bias; declines a parameter as the input."""
    return _convolution(func, args, kwargs, ref_of, by_axis=False)


def _convolution(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf, by_axis: bool) -> Optional[RuleCall]:
    """:func:`conv_rule`; ``by_axis``: the weight stated in its own axes ``(g, o, i, *kernel)``, as
    the input gradient states it (NOTE: [Convolutions through derivatives]), rather than
    ``(g, o, q)`` with ``q`` the input channels and taps together, as ``torch.conv2d`` keeps it."""
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
        per_group = inputs.shape[1] // groups
        taps = per_group * math.prod(kernel)
        patches = patches.permute(order).reshape(examples, groups, taps, positions)
        roles = []
        if weight_ref is not None:
            labels, shape = "q", (taps,)
            if by_axis:
                labels, shape = "i" + _KERNEL_LETTERS[:spatial], (per_group, *kernel)
                patches = patches.view(examples, groups, *shape, positions)
            roles.append(Role(
                (weight_ref,), "weight", y_shape, "bgod", [(patches, f"bg{labels}d")], f"go{labels}",
                (groups, channels // groups, *shape),
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


def convolution_input_gradient(
    grad_output: torch.Tensor, weight: torch.Tensor, input_shape: list, stride: list, padding: list,
    dilation: list, groups: int,
) -> torch.Tensor:
    """``dL/dx`` of ``y = conv(x, weight)`` for ``g = dL/dy``: ``convolution_backward``'s first output,
    a transposed convolution to ``input_shape`` (NOTE: [Convolutions through derivatives]).
    Overridable like ``torch.nn.functional``'s functions, so that a function mode sees it whole."""
    if has_torch_function_variadic(grad_output, weight):
        return handle_torch_function(
            convolution_input_gradient, (grad_output, weight), grad_output, weight, input_shape, stride, padding,
            dilation, groups,
        )
    return torch.ops.aten.convolution.default(
        grad_output, weight, None, stride, padding, dilation, True,
        _output_padding(grad_output.shape[2:], input_shape[2:], weight.shape[2:], stride, padding, dilation), groups,
    )


def _output_padding(out: tuple, size: tuple, kernel: tuple, stride: list, padding: list, dilation: list) -> list:
    """The ``output_padding`` that makes a transposed convolution of ``out`` positions give ``size``."""
    return [
        length - ((positions - 1) * step - 2 * pad + spacing * (taps - 1) + 1)
        for positions, length, taps, step, pad, spacing in zip(out, size, kernel, stride, padding, dilation)
    ]


@rule(convolution_input_gradient)
def input_gradient_rule(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf) -> Optional[RuleCall]:
    """The weight of :func:`convolution_input_gradient`; declines a parameter as the output gradient."""
    names = ("grad_output", "weight", "input_shape", "stride", "padding", "dilation", "groups")
    g, weight, input_shape, stride, padding, dilation, groups = bind(args, kwargs, names, {})
    weight_ref = ref_of(weight)
    spatial = weight.ndim - 2
    if weight_ref is None or ref_of(g) is not None or g.ndim != spatial + 2:
        return None
    output = func(*args, **kwargs)
    examples, channels, kernel = g.shape[0], weight.shape[0], tuple(weight.shape[2:])
    per_group, positions = weight.shape[1], math.prod(output.shape[2:])
    y_shape = (examples, groups, per_group, positions)

    def build():
        taps = math.prod(kernel)
        # one transposed convolution of every output-gradient channel with one one-hot kernel per tap
        one_hot = torch.eye(taps, dtype=g.dtype, device=g.device).view(1, taps, *kernel).expand(channels, taps, *kernel)
        received = torch.ops.aten.convolution.default(
            g.detach(), one_hot, None, stride, padding, dilation, True,
            _output_padding(g.shape[2:], input_shape[2:], kernel, stride, padding, dilation), channels,
        )
        received = received.reshape(examples, groups, channels // groups, *kernel, positions)
        letters = _KERNEL_LETTERS[:spatial]
        role = Role(
            (weight_ref,), "weight", y_shape, "bgid", [(received, f"bgo{letters}d")], f"goi{letters}",
            (groups, channels // groups, per_group, *kernel),
            local=lambda w: func(g, w, input_shape, stride, padding, dilation, groups), seen=weight,
        )
        return [role], None

    return RuleCall(output, build)


@rule(torch.ops.aten.convolution.default)
def aten_convolution_rule(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf) -> Optional[RuleCall]:
    """The ATen convolution of a traced graph (NOTE: [Unrolled derivatives]), not transposed: the
    rule above, called through a function of its signature; declines a transposed convolution."""
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "transposed", "output_padding", "groups")
    x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = bind(args, kwargs, names, {})
    if transposed:
        return None

    def convolution(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):  # noqa: A002
        return func(input, weight, bias, stride, padding, dilation, False, output_padding, groups)

    return _convolution(convolution, (x, weight, bias, stride, padding, dilation, groups), {}, ref_of, by_axis=True)


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
