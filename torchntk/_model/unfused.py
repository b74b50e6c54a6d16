"""Pure-PyTorch forms of the fused kernels that ``torch.func`` cannot transform.

NOTE: [Unfused kernels]
A few modules reach PyTorch through one fused kernel that has a derivative for reverse mode only:

* ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN`` call ``torch._VF.lstm`` / ``gru`` / ``rnn_tanh`` /
  ``rnn_relu``: no ``vmap`` batching rule ("Batching rule not implemented for aten::lstm"), no
  forward-mode derivative for float32 ``nn.LSTM`` on CPU (``mkldnn_rnn_layer``), and to the
  structured-derivatives recorder one opaque op, so every recurrent weight went to its Jacobian
  fallback;
* ``torch.nn.utils.parametrizations.weight_norm`` and the old ``torch.nn.utils.weight_norm`` call
  ``torch._weight_norm``, which dispatches to ``_weight_norm_interface``: no forward-mode derivative.

The functions here compute the same thing from ops every transform handles (the same outputs up to
float rounding), following PyTorch's documented equations and parameter layout. Every product with
a recurrent weight is an ``F.linear`` call (the input sequence projected by one call per layer and
direction, the hidden state by one call per time step), so the structured recorder states each
through its linear rule. :class:`Unfused` substitutes them while it is active;
:func:`forward_mode_kernels` is the context torchntk puts around its forward-mode passes, which
also keeps ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` off their fused fast paths
and attention on its composite MATH kernel. The fused kernels stay wherever they work: a
decomposition runs one Python step per time step, and a function mode costs Python time on every
op, so callers enable :class:`Unfused` only for models :func:`fused_layers` names.

A call the decompositions do not cover (a packed sequence, dropout between layers in training
mode, shapes the fused kernel would reject) returns ``NotImplemented`` from the decomposition and
runs the fused kernel, which computes it or raises its own error.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.utils.weight_norm import WeightNorm
from torch.overrides import TorchFunctionMode

from .._utils.threads import WhileAnyActive

# ---------------------------------------------------------------------------------------------
# Recurrent layers
# ---------------------------------------------------------------------------------------------

_RNN_ARGUMENTS = (
    "input", "hx", "params", "has_biases", "num_layers", "dropout", "train", "bidirectional", "batch_first",
)
"""The non-packed call form shared by ``torch._VF.lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu``."""

_PACKED_ARGUMENTS = frozenset({"data", "batch_sizes"})

State = tuple[Tensor, ...]
"""``(h,)`` for GRU and RNN, ``(h, c)`` for LSTM: per layer and direction, ``(batch, size)`` each."""

Cell = Callable[[Tensor, State, Tensor, Optional[Tensor], Optional[Tensor]], State]
"""``cell(projected_input_t, state, w_hh, b_hh, w_hr) -> next state``."""


def _lstm_cell(x_t: Tensor, state: State, w_hh: Tensor, b_hh: Optional[Tensor], w_hr: Optional[Tensor]) -> State:
    h, c = state
    input_gate, forget_gate, cell_gate, output_gate = (x_t + F.linear(h, w_hh, b_hh)).chunk(4, dim=-1)
    c = torch.sigmoid(forget_gate) * c + torch.sigmoid(input_gate) * torch.tanh(cell_gate)
    h = torch.sigmoid(output_gate) * torch.tanh(c)
    if w_hr is not None:
        h = F.linear(h, w_hr)
    return h, c


def _gru_cell(x_t: Tensor, state: State, w_hh: Tensor, b_hh: Optional[Tensor], w_hr: Optional[Tensor]) -> State:
    (h,) = state
    x_reset, x_update, x_new = x_t.chunk(3, dim=-1)
    h_reset, h_update, h_new = F.linear(h, w_hh, b_hh).chunk(3, dim=-1)
    reset = torch.sigmoid(x_reset + h_reset)
    update = torch.sigmoid(x_update + h_update)
    # b_hn sits inside the reset gate's product, as PyTorch's GRU equations state
    new = torch.tanh(x_new + reset * h_new)
    return (new + update * (h - new),)


def _tanh_cell(x_t: Tensor, state: State, w_hh: Tensor, b_hh: Optional[Tensor], w_hr: Optional[Tensor]) -> State:
    return (torch.tanh(x_t + F.linear(state[0], w_hh, b_hh)),)


def _relu_cell(x_t: Tensor, state: State, w_hh: Tensor, b_hh: Optional[Tensor], w_hr: Optional[Tensor]) -> State:
    return (torch.relu(x_t + F.linear(state[0], w_hh, b_hh)),)


def _bound(args: tuple, kwargs: dict, names: Sequence[str]) -> Optional[list]:
    """``args`` and ``kwargs`` as one positional list in ``names`` order; None for other call forms."""
    if len(args) > len(names) or set(kwargs) - set(names[len(args):]):
        return None
    values = list(args) + [kwargs.get(name, _MISSING) for name in names[len(args):]]
    return None if any(value is _MISSING for value in values) else values


_MISSING = object()


def _decompose(cell: Cell, gates: int, args: tuple, kwargs: dict, *, lstm: bool) -> Any:
    if _PACKED_ARGUMENTS & set(kwargs) or (len(args) > 3 and isinstance(args[3], (list, tuple))):
        return NotImplemented  # a PackedSequence: (data, batch_sizes, hx, params, ...)
    bound = _bound(args, kwargs, _RNN_ARGUMENTS)
    if bound is None:
        return NotImplemented
    return _run_layers(cell, gates, lstm, *bound)


def _run_layers(
    cell: Cell, gates: int, lstm: bool, input: Tensor, hx: Any, params: Sequence[Tensor], has_biases: bool,
    num_layers: int, dropout: float, train: bool, bidirectional: bool, batch_first: bool,
) -> Any:
    """The stacked, possibly bidirectional recurrence, time-major inside.

    Shapes (``D`` directions, ``L`` layers, ``H`` hidden size, ``R`` the proj_size or ``H``):
    ``input`` ``(T, B, F)`` (``(B, T, F)`` when ``batch_first``); ``hx`` ``(L * D, B, R)`` (and, for
    LSTM, ``(L * D, B, H)`` for ``c``). Returns ``(output, h_n)`` or, for LSTM, ``(output, h_n, c_n)``,
    with ``output`` ``(T, B, D * R)`` (batch first when asked).

    Returns ``NotImplemented`` for calls to leave to the fused kernel: dropout between layers in
    training mode (random, and drawn by the kernel's own generator calls), and any layout the fused
    kernel would reject or that this code does not know.
    """
    if lstm != isinstance(hx, (tuple, list)):
        return NotImplemented
    states = tuple(hx) if lstm else (hx,)
    directions = 2 if bidirectional else 1
    units = num_layers * directions
    tensors = (input, *states, *params)
    if (
        not all(isinstance(tensor, Tensor) for tensor in tensors) or len(states) != (2 if lstm else 1) or units <= 0
        or input.dim() != 3 or not input.is_floating_point() or any(state.dim() != 3 for state in states)
        or any(tensor.dtype != input.dtype for tensor in tensors)
    ):
        return NotImplemented
    if train and dropout > 0 and num_layers > 1:
        return NotImplemented
    per_unit, remainder = divmod(len(params), units)
    plain = 4 if has_biases else 2
    projected = lstm and per_unit == plain + 1
    if remainder or per_unit != plain + projected:
        return NotImplemented
    sequence = input.transpose(0, 1) if batch_first else input
    steps, batch = sequence.shape[:2]
    w_hh = params[1]  # (gates * H, R)
    sizes = (w_hh.shape[-1], w_hh.shape[0] // gates)[: len(states)]
    if (
        steps == 0 or sequence.shape[-1] != params[0].shape[-1]
        or any(state.shape != (units, batch, size) for state, size in zip(states, sizes))
    ):
        return NotImplemented

    layer_input = sequence
    finals: list[list[Tensor]] = [[] for _ in states]
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            unit = layer * directions + direction
            weights = list(params[unit * per_unit : (unit + 1) * per_unit])
            w_ih, w_hh = weights[0], weights[1]
            b_ih, b_hh = (weights[2], weights[3]) if has_biases else (None, None)
            w_hr = weights[-1] if projected else None
            # one product for the whole sequence: the structured recorder sees one use of w_ih per
            # layer and direction, and the BLAS one large matrix product instead of T small ones
            inputs = F.linear(layer_input, w_ih, b_ih)
            state = tuple(state[unit] for state in states)
            per_step: list[Optional[Tensor]] = [None] * steps
            order = range(steps) if direction == 0 else range(steps - 1, -1, -1)
            for t in order:
                state = cell(inputs[t], state, w_hh, b_hh, w_hr)
                per_step[t] = state[0]
            outputs.append(torch.stack(per_step))
            for final, value in zip(finals, state):
                final.append(value)
        layer_input = outputs[0] if directions == 1 else torch.cat(outputs, dim=-1)
    output = layer_input.transpose(0, 1) if batch_first else layer_input
    return (output, *(torch.stack(final) for final in finals))


def lstm(*args: Any, **kwargs: Any) -> Any:
    """``torch._VF.lstm(input, (h_0, c_0), params, has_biases, num_layers, dropout, train,
    bidirectional, batch_first) -> (output, h_n, c_n)``; proj_size is read from the number of
    ``params`` per layer and direction (``w_hr`` last). See :func:`_run_layers` for the shapes and
    the calls left to the fused kernel (``NotImplemented``), the packed form among them."""
    return _decompose(_lstm_cell, 4, args, kwargs, lstm=True)


def gru(*args: Any, **kwargs: Any) -> Any:
    """``torch._VF.gru(input, h_0, params, ...) -> (output, h_n)``, otherwise as :func:`lstm`."""
    return _decompose(_gru_cell, 3, args, kwargs, lstm=False)


def rnn_tanh(*args: Any, **kwargs: Any) -> Any:
    """``torch._VF.rnn_tanh(input, h_0, params, ...) -> (output, h_n)``, otherwise as :func:`lstm`."""
    return _decompose(_tanh_cell, 1, args, kwargs, lstm=False)


def rnn_relu(*args: Any, **kwargs: Any) -> Any:
    """``torch._VF.rnn_relu(input, h_0, params, ...) -> (output, h_n)``, otherwise as :func:`lstm`."""
    return _decompose(_relu_cell, 1, args, kwargs, lstm=False)


# ---------------------------------------------------------------------------------------------
# Weight normalisation
# ---------------------------------------------------------------------------------------------


def weight_norm(*args: Any, **kwargs: Any) -> Any:
    """``torch._weight_norm(v, g, dim=0) = v * (g / ||v||)``, the norm taken over every axis but ``dim``.

    ``dim=-1`` (what ``weight_norm(dim=None)`` passes) takes the norm of the whole tensor, as
    ``torch.norm_except_dim`` does; other negative values count from the end. ``g`` broadcasts
    against the norm (shape ``(1, .., v.shape[dim], .., 1)``, or a scalar for the whole tensor).

    Returns:
        A tensor shaped like ``v``; ``NotImplemented`` (the fused op then runs) for a 0-d ``v``, a
        ``dim`` out of range, or an unknown call form.
    """
    if len(args) < 3 and "dim" not in kwargs:
        kwargs = {**kwargs, "dim": 0}
    bound = _bound(args, kwargs, ("v", "g", "dim"))
    if bound is None:
        return NotImplemented
    v, g, dim = bound
    if not isinstance(v, Tensor) or v.dim() == 0 or not isinstance(dim, int) or not -v.dim() <= dim < v.dim():
        return NotImplemented
    if dim == -1:
        norm = torch.linalg.vector_norm(v)
    elif v.dim() == 1:
        norm = v.abs()  # vector_norm reads an empty ``dim`` as "every axis"
    else:
        dim %= v.dim()
        norm = torch.linalg.vector_norm(v, dim=[axis for axis in range(v.dim()) if axis != dim], keepdim=True)
    return v * (g / norm)


# ---------------------------------------------------------------------------------------------
# The mode, the layers that need it, and the forward-mode context
# ---------------------------------------------------------------------------------------------

RECURRENT: dict[Callable, Callable[..., Any]] = {
    torch._VF.lstm: lstm,
    torch._VF.gru: gru,
    torch._VF.rnn_tanh: rnn_tanh,
    torch._VF.rnn_relu: rnn_relu,
}
"""Fused recurrent kernel -> its decomposition (``NotImplemented`` for calls it leaves alone)."""

DECOMPOSITIONS: dict[Callable, Callable[..., Any]] = {**RECURRENT, torch._weight_norm: weight_norm}
"""Every fused kernel :class:`Unfused` replaces -> its decomposition."""


class Unfused(TorchFunctionMode):
    """While active, the kernels of :data:`DECOMPOSITIONS` run as their decompositions.

    Every other call runs untouched. The decomposition's own ops run with this mode paused (as any
    function mode is while it handles a call) and reach the modes outside it, if any.

    Example:
        >>> import torch
        >>> lstm = torch.nn.LSTM(3, 5)
        >>> x = torch.randn(4, 2, 3)
        >>> with Unfused():
        ...     y, _ = lstm(x)
        >>> torch.allclose(y, lstm(x)[0], atol=1e-6)
        True
    """

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        decomposition = DECOMPOSITIONS.get(func)
        if decomposition is not None:
            result = decomposition(*args, **kwargs)
            if result is not NotImplemented:
                return result
        return func(*args, **kwargs)


_NO_CUDNN = WhileAnyActive()


def recurrent_layers_without_cudnn() -> contextlib.AbstractContextManager:
    """cuDNN off inside the block, for evaluations of models with CUDA recurrent layers.

    An ``nn.LSTM`` / ``GRU`` / ``RNN`` on CUDA re-packs its weights for cuDNN
    (``flatten_parameters``) whenever they are other tensors than last time, which they are
    under ``functional_call``, and reads their ``data_ptr()`` to do so: the tensors of a
    ``torch.func`` transform have no storage, so every kernel of such a model failed there
    ("Cannot access data pointer of Tensor that doesn't have storage"), and cuDNN's recurrent
    backward pass also refuses eval mode. With cuDNN off the layer skips the re-packing and runs
    PyTorch's own CUDA kernels, which have both derivatives. The switch is process-wide in
    PyTorch, so convolutions anywhere meanwhile run without cuDNN too (slower, not different);
    the first of nested or concurrent blocks makes it and the last restores it.
    """
    return _NO_CUDNN.active(_disable_cudnn)


def _disable_cudnn() -> Callable[[], None]:
    enabled = torch.backends.cudnn.enabled
    torch.backends.cudnn.enabled = False

    def restore() -> None:
        torch.backends.cudnn.enabled = enabled

    return restore


_MATH_ATTENTION = WhileAnyActive()


def math_attention() -> contextlib.AbstractContextManager:
    """``scaled_dot_product_attention`` on its composite MATH kernel inside the block.

    Needed where its fused kernels cannot go: forward mode and double backward (they have no such
    derivatives), and, on CUDA, passes mapped by ``vmap``. The fused CUDA kernels (flash,
    memory-efficient, cuDNN) have no batching rules, so ``vmap`` runs them once per example slice,
    and a backward pass taken outside the ``vmap`` (a ``vjp`` of a mapped function) hands the
    memory-efficient kernel's backward a slice of its stacked log-sum-exp, which it rejects ("LSE
    is not correctly aligned"). The MATH kernel is batched products that every transform handles;
    the fused CPU kernel takes the slices, so mapped CPU passes keep it.

    PyTorch keeps the choice per process: the first of any number of nested or concurrent blocks
    (``batch``'s workers are threads) makes it and the last one restores what was there, so that
    two threads cannot undo it for each other. Meanwhile every thread's attention uses MATH, which
    changes its speed and rounding, not its result.
    """
    return _MATH_ATTENTION.active(_enter_math_attention)


def _enter_math_attention() -> Callable[[], None]:
    context = sdpa_kernel([SDPBackend.MATH])
    context.__enter__()
    return lambda: context.__exit__(None, None, None)


def fused_layers(module: nn.Module, named: Optional[Iterable[tuple[str, nn.Module]]] = None) -> tuple[str, ...]:
    """The paths (``named_modules`` names; ``""`` is ``module`` itself) of the submodules that call
    a kernel of :data:`DECOMPOSITIONS`.

    These are ``nn.RNNBase`` instances (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``), modules with a
    ``weight_norm`` parametrization and modules with an old-style ``weight_norm`` pre-forward
    hook. A model calling the kernels some other way (``torch._weight_norm`` in its own
    ``forward``, a function ``f(params, x)``) is not found; its fused kernels then stay fused.
    """
    paths = []
    for path, sub in module.named_modules():
        if isinstance(sub, nn.RNNBase) or _has_weight_norm(sub):
            paths.append(path)
    return tuple(paths)


_WEIGHT_NORM_PARAMETRIZATION: Optional[type] = getattr(torch.nn.utils.parametrizations, "_WeightNorm", None)


def _has_weight_norm(module: nn.Module) -> bool:
    if any(isinstance(hook, WeightNorm) for hook in module._forward_pre_hooks.values()):
        return True
    parametrizations = getattr(module, "parametrizations", None)
    if _WEIGHT_NORM_PARAMETRIZATION is None or not isinstance(parametrizations, nn.ModuleDict):
        return False
    return any(
        isinstance(parametrization, _WEIGHT_NORM_PARAMETRIZATION)
        for chain in parametrizations.values()
        for parametrization in chain
    )


@contextlib.contextmanager
def forward_mode_kernels(unfuse: bool) -> Iterator[None]:
    """The context of torchntk's forward-mode passes: kernels that have forward-mode derivatives.

    * with ``unfuse``, :class:`Unfused` (for models :func:`fused_layers` names);
    * ``torch.backends.mha.set_fastpath_enabled(False)``: in eval mode ``nn.MultiheadAttention``
      and ``nn.TransformerEncoderLayer`` otherwise call ``_native_multi_head_attention`` /
      ``_transformer_encoder_layer_fwd``, which have none;
    * :func:`math_attention`: the fused attention kernels have none.

    The mode acts on the current thread only, but both flags are process-wide in PyTorch: while the
    context is active, attention run by another thread also takes the composite path, which changes
    its speed and rounding, not its result. Both are put back when the context ends, also when the
    body raises; contexts nest (torchntk holds ``FORWARD_MODE_LOCK`` around them, and
    :func:`math_attention` counts its users across threads).

    Args:
        unfuse: whether to run the kernels of :data:`DECOMPOSITIONS` as their decompositions.
    """
    get_fastpath = getattr(torch.backends.mha, "get_fastpath_enabled", None)
    set_fastpath = getattr(torch.backends.mha, "set_fastpath_enabled", None)
    fastpath = get_fastpath() if get_fastpath is not None else None
    with contextlib.ExitStack() as stack:
        if set_fastpath is not None:
            set_fastpath(False)
            stack.callback(set_fastpath, fastpath)
        stack.enter_context(math_attention())
        if unfuse:
            stack.enter_context(Unfused())
        yield
