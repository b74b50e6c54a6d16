"""Layer inputs and output cotangents of ``F.linear`` and ``F.conv2d`` weights, for Kronecker sketches.

NOTE: [Kronecker capture]
For a weight ``W`` used as ``y = F.linear(x, W)`` or ``y = F.conv2d(x, W, ...)``, the derivative of
an output entry ``f_t`` is ``dF_t/dW = sum_s g_{t,s} (x) x_s``: the output cotangent
``g_{t,s} = df_t/dy_s`` at position ``s`` (a token, a pixel) times the layer input there (the patch
of ``x`` under the kernel, for a convolution). A Kronecker projection only needs ``g`` and ``x``.

:class:`Taps` is a ``TorchFunctionMode`` that recognises the chosen weights by identity (the
tensors handed to the model are the ones the ops receive, as in the structured recorder of
implementation 3, whose API this module does not depend on). For every linear or conv2d call with
such a weight as its ``weight`` argument it keeps the input (cloned, so that later in-place writes
cannot change it) and adds a zero *tap* to the output; the reverse-mode Jacobian with respect to
the taps is ``g``. Any other call that receives a chosen weight and returns a floating-point tensor
(a transpose, an ``F.embedding``, an in-place write) marks the weight *unruled*: its projection then
comes from its per-example gradient like every other parameter's. A probe pass finds the unruled
weights and the tap shapes; the computing pass checks that it meets the same calls.

A function mode does not see uses hidden from it (TorchScript, ``torch._C.DisableTorchFunction``,
C++ extensions), which would silently drop their share of the gradient. So :func:`verify` checks, on
the probe, for a random output cotangent ``v``, that the weight's gradient ``J^T v`` from autograd
equals the sum over the captured calls of the op-local gradients ``dy/dW^T (J_y^T v)``; a weight that
fails is projected from its per-example gradient instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.func import vjp
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .._call.per_example import Side
from .._model.inner_derivatives import parameter_behind


@dataclass(frozen=True)
class TapCall:
    """One captured call: which parameter, the op, and the op's options.

    Attributes:
        param: index of the weight among the model's parameters.
        op: ``"linear"`` or ``"conv2d"``.
        options: for conv2d, ``(stride, padding, dilation, groups)`` as the call passed them.
        output_shape: the shape of the call's output (per example under vmap).
        input_shape: the shape of its input.
    """

    param: int
    op: str
    options: tuple
    output_shape: tuple[int, ...]
    input_shape: tuple[int, ...]


_CONV2D_DEFAULTS = (None, 1, 0, 1, 1)  # bias, stride, padding, dilation, groups
_CONV2D_NAMES = ("bias", "stride", "padding", "dilation", "groups")


def _bind(func: Callable, args: tuple, kwargs: dict) -> Optional[tuple[str, Any, Any, tuple]]:
    """``(op, input, weight, options)`` of a linear or conv2d call, None for any other call."""
    if func is F.linear:
        values = list(args) + [kwargs.get(name) for name in ("input", "weight", "bias")[len(args):]]
        if len(values) < 2 or set(kwargs) - {"input", "weight", "bias"}:
            return None
        return "linear", values[0], values[1], ()
    if func is F.conv2d:
        positional = list(args)
        if len(positional) < 2:
            positional += [kwargs.get(name) for name in ("input", "weight")[len(positional):]]
        options = []
        for position, (name, default) in enumerate(zip(_CONV2D_NAMES, _CONV2D_DEFAULTS), start=2):
            options.append(positional[position] if position < len(positional) else kwargs.get(name, default))
        return "conv2d", positional[0], positional[1], tuple(options[1:])
    return None


class Taps(TorchFunctionMode):
    """Captures the inputs of linear/conv2d calls on ``weights`` and adds ``taps[i]`` to the ``i``-th output.

    Args:
        params: all parameter tensors handed to the model, by position.
        weights: positions in ``params`` of the weights to capture.
        taps: zero tensors to add to the outputs (the computing pass), or None (the probe).
    """

    def __init__(self, params: tuple[torch.Tensor, ...], weights: frozenset[int], taps: Optional[tuple] = None):
        super().__init__()
        self._positions = {id(params[index]): index for index in weights}
        self._params = params
        self._taps = taps
        self.calls: list[TapCall] = []
        self.inputs: list[torch.Tensor] = []
        self.unruled: set[int] = set()
        self._level: Optional[int] = None

    def __enter__(self) -> "Taps":
        self._level = _current_level()  # the level the model is evaluated at
        return super().__enter__()

    def _position(self, value: Any) -> Optional[int]:
        if not isinstance(value, torch.Tensor):
            return None
        position = self._positions.get(id(value))
        if position is None:  # a parameter wrapped for a model's own level is the parameter behind it
            behind = parameter_behind(value)
            value = behind if behind is not None else value
            position = self._positions.get(id(value))
        return position if position is not None and self._params[position] is value else None

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        positions = (self._position(leaf) for leaf in pytree.tree_leaves((args, kwargs)))
        found = {position for position in positions if position is not None}
        if not found:
            return func(*args, **kwargs)
        if _current_level() != self._level:
            # inside a derivative the model takes, as in implementation 3's recorder (NOTE: [Transforms
            # inside the model]): a captured input would escape its level, and the backward passes
            # of that derivative use the weight unseen
            self.unruled |= found
            return func(*args, **kwargs)
        bound = _bind(func, args, kwargs)
        if bound is not None:
            op, x, weight, options = bound
            position = self._position(weight)
            others = found - {position}
            if position is not None and not others and self._position(x) is None and not x.is_complex():
                return self._capture(func, args, kwargs, op, x, position, options)
        result = func(*args, **kwargs)
        if any(isinstance(leaf, torch.Tensor) and leaf.is_floating_point() for leaf in pytree.tree_leaves(result)):
            self.unruled |= found
        return result

    def _capture(self, func, args, kwargs, op, x, position, options) -> torch.Tensor:
        output = func(*args, **kwargs)
        index = len(self.calls)
        self.calls.append(TapCall(position, op, options, tuple(output.shape), tuple(x.shape)))
        self.inputs.append(x.clone())
        if self._taps is None:
            return output
        if index >= len(self._taps) or self._taps[index].shape != output.shape:
            raise CaptureMismatch(
                "the model's linear/conv2d calls differ between two evaluations on the same inputs "
                "(its forward pass must be deterministic for projection='kronecker')"
            )
        return output + self._taps[index]


_current_level = torch._C._functorch.maybe_current_level


class CaptureMismatch(RuntimeError):
    """The computing pass met other linear/conv2d calls than the probe."""


_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}


def verify(probe: Side, params: tuple[torch.Tensor, ...], weights: frozenset[int], calls: tuple[TapCall, ...],
           cotangents: tuple[torch.Tensor, ...], cotangent_dims: tuple) -> frozenset[int]:
    """The weights whose captured calls do not account for their whole gradient on ``probe``.

    ``cotangents`` has one tensor per output leaf, shaped like the probe's per-example output (with
    a leading example axis of size 1, mapped by ``cotangent_dims``, when the probe is mapped).
    """
    positions = tuple(sorted(weights))
    taps = tuple(torch.zeros(call.output_shape, dtype=params[call.param].dtype, device=params[call.param].device)
                 for call in calls)

    def per_example(x_leaves, kwarg_leaves, example_cotangents):
        def forward(values, tap_values):
            full = list(params)
            for position, value in zip(positions, values):
                full[position] = value
            mode = Taps(tuple(full), weights, tap_values)
            with mode:
                outputs = probe.evaluate(tuple(full), x_leaves, kwarg_leaves)
            return outputs, tuple(mode.inputs)

        _, pullback, inputs = vjp(forward, tuple(params[position] for position in positions), taps, has_aux=True)
        whole, tap_gradients = pullback(tuple(example_cotangents))
        local = []
        for call, gradient, layer_input in zip(calls, tap_gradients, inputs):
            op = _local_op(call, layer_input)
            local.append(vjp(op, params[call.param])[1](gradient)[0])
        return whole, tuple(local)

    whole, local = probe.per_example(per_example, (cotangents,), (cotangent_dims,))
    failing = set()
    for position, gradient in zip(positions, whole):
        captured = sum(part for call, part in zip(calls, local) if call.param == position)
        scale = gradient.abs().max() + captured.abs().max()
        tolerance = _TOLERANCE.get(gradient.dtype, 1e-2) * max(float(scale), 1e-30)
        if not (gradient - captured).abs().max() <= tolerance:
            failing.add(position)
    return frozenset(failing)


def _local_op(call: TapCall, layer_input: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    if call.op == "linear":
        return lambda weight: F.linear(layer_input, weight)
    return lambda weight: F.conv2d(layer_input, weight, None, *call.options)
