"""The counted forward pass of one example that AUTO's cost model and the memory model share.

NOTE: [One counting pass]
AUTO (NOTE: [AUTO's cost model] in ``auto.py``) and the memory model (NOTE: [Memory plans] in
``memory.py``) both price a call from what one forward pass of one example does: AUTO from its
ATen calls, FLOPs and the elements its operations write, the memory model from the elements its
operations write (views and the functional model's copies apart), the largest of them and the
parameters used more than once. One pass under :class:`_CountingMode` records all of it, and a
kernel function counts each side once per key (:func:`counter`, kept in the key's record, NOTE:
[One record per key], which AUTO and the memory model share): on an AUTO kernel
function's first call the working-set runs (``_kernel/working_set.py``), the memory plan and
AUTO's choice used to make two such passes, now they make one. The one pass costs what the memory
model's alone did: 0.3, 0.7 and 15 ms on one example of an 8-32-32-4 MLP, the benchmark CNN and
ResNet-18 at 64x64, where the two took 0.5, 1.3 and 27 ms (2-core CPU, one thread, best of 30 to
300). What a first AUTO call costs beyond a warm one is mostly elsewhere (implementation 3's
probe and plan check: about 15 ms on the MLP, 1.5 s on ResNet-18 at N = 4).

The example is the side's first one evaluated as a batch of one without vmap (a whole batch
without ``vmap_axes``); x2 is priced from x1's count when its examples have x1's shapes
(:func:`example_shapes`, the one description of those shapes). A side the pass cannot evaluate
has no count (None): the models then use their lower bounds, and the implementation reports the
model's error.

The pass runs under ``forward_mode_kernels`` (``_model/unfused.py``): attention and recurrent
layers then take the composite paths the differentiated passes take, not the inference fast
paths a no-grad pass would. That context saves and restores process-wide PyTorch flags (the
``nn.MultiheadAttention`` fast path), which is only sound while no other thread sets them in
between, so the pass holds :data:`~torchntk._utils.threads.FORWARD_MODE_LOCK` like every other
user of the context (NOTE: [Threads]). The lock is re-entrant: an AUTO or implementation-2 call
that already holds it pays nothing more; ``auto_choice`` and implementations 1 and 3 take it for
the pass only (a few milliseconds once per key).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .._call.kernel_call import KernelCall
from .._call.per_example import Side
from .._model.aliases import storage_key
from .._model.unfused import forward_mode_kernels
from .._plan.scope import Scope, cached
from .._utils.threads import FORWARD_MODE_LOCK
from .._utils.tree import argument_leaves
from .._utils.values import leaf_key


@dataclass(frozen=True)
class ExampleCount:
    """What one forward pass of one example (of the whole batch without ``vmap_axes``) did.

    Attributes:
        calls: its ATen calls.
        flops: the FLOPs (two per multiply-add) of the calls ``torch.utils.flop_counter`` has
            formulas for: matrix products, convolutions, attention.
        elements: the elements of every result, views and copies included (what AUTO prices).
        view_elements: the part of ``elements`` that views returned.
        written: the elements written by calls that are neither views nor the functional model's
            copies of its inputs and parameters (what the memory model prices: an upper bound of
            what autograd keeps for the backward pass).
        largest: the largest such result, in elements.
        reused: indices of the parameters consumed by more than one such call (autograd sums
            their gradients).
        parameter_outputs: the part of ``written`` that calls consuming a parameter wrote: the
            outputs whose cotangents implementation 3's pass forms for every basis vector.
        derivative_calls: the part of ``calls`` that autograd's engine made for derivatives the
            model takes inside its forward pass (forces, PDE residuals; NOTE: [Derivatives in the
            counted pass]).
    """

    calls: int
    flops: int
    elements: int
    view_elements: int
    written: int
    largest: int
    reused: tuple[int, ...] = ()
    derivative_calls: int = 0
    parameter_outputs: int = 0


class _CountingMode(TorchDispatchMode):
    """Counts what each ATen call does, for both :class:`ExampleCount` readers at once.

    For AUTO: every call, the elements of its results (those of views apart) and the FLOPs of
    those that ``torch.utils.flop_counter`` has formulas for. One mode instead of
    ``FlopCounterMode`` and a second call counter (whose module tracking hooked every module call):
    the pass costs a few microseconds more per ATen call than a plain one, most of it the mode's
    Python dispatch. What each op overload needs is looked up once (:func:`_op_counting`), and
    matrix products and convolutions, the counted ops of most models, are priced from their
    shapes directly: ``flop_counter``'s formulas map every argument through pytree, twice for
    ``addmm``, 20-60 us a call, as much as the rest of the counting of a recurrent layer. The
    arguments and results are walked without pytree (:func:`~torchntk._utils.tree.argument_leaves`),
    whose two walks a call were a third of a counted pass.

    For the memory model: what calls that are neither views nor copies (:data:`_COPIES`) write,
    and which parameters they consume, recognised by storage.
    """

    def __init__(self, params: tuple = ()) -> None:
        """``params``: the tensors whose uses are counted (none by default)."""
        super().__init__()
        self.calls = 0
        self.elements = 0
        self.view_elements = 0
        self.flops = 0
        self.written = 0
        self.largest = 0
        self._storages = {storage_key(param): index for index, param in enumerate(params)}
        self._storages.pop(None, None)
        self.uses = [0] * len(params)
        self.parameter_outputs = 0
        self.derivative_calls = 0
        # a backward pass running before the count (a kernel computed inside a user's backward
        # hook) is not the model's own (NOTE: [Derivatives in the counted pass] in auto.py)
        self._outer_task = torch._C._current_graph_task_id()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.calls += 1
        if torch._C._current_graph_task_id() != self._outer_task:
            self.derivative_calls += 1
        result = func(*args, **kwargs)
        flops, is_view, is_copy = _op_counting(func)
        if flops is not None:
            self.flops += flops(args, kwargs, result)
        if isinstance(result, torch.Tensor):
            sizes = [result.numel()]
        else:
            sizes = [leaf.numel() for leaf in argument_leaves((result,), {}) if isinstance(leaf, torch.Tensor)]
        elements = sum(sizes)
        self.elements += elements
        if is_view:
            self.view_elements += elements
            return result
        if is_copy:
            return result
        if self._storages:
            consumed = False
            for leaf in argument_leaves(args, kwargs):
                if isinstance(leaf, torch.Tensor):
                    index = self._storages.get(storage_key(leaf))
                    if index is not None:
                        self.uses[index] += 1
                        consumed = True
            if consumed:
                self.parameter_outputs += elements
        self.written += elements
        self.largest = max(self.largest, max(sizes, default=0))
        return result

    def count(self) -> ExampleCount:
        reused = tuple(index for index, uses in enumerate(self.uses) if uses > 1)
        return ExampleCount(
            self.calls, self.flops, self.elements, self.view_elements, self.written, self.largest, reused,
            self.derivative_calls, self.parameter_outputs,
        )


_COPIES = frozenset({torch.ops.aten.detach, torch.ops.aten.clone, torch.ops.aten._to_copy, torch.ops.aten.lift_fresh})
"""Copies of parameters and inputs the functional model makes: not the model's activations (the
memory model leaves them out; AUTO's constants were fitted with them in)."""

_OpFlops = Callable[[tuple, dict, Any], int]


def _op_counting(func: Any) -> tuple[Optional[_OpFlops], bool, bool]:
    """How :class:`_CountingMode` counts ``func`` (an ATen op overload): its FLOPs as a function of
    its arguments and result (None: not counted), whether it is a view and whether it is one of
    :data:`_COPIES`. Cached per overload."""
    counting = _OP_COUNTING.get(func)
    if counting is None:
        packet = func._overloadpacket
        flops = _MATRIX_PRODUCT_FLOPS.get(packet)
        if flops is None:
            formula = flop_registry.get(packet)
            if formula is not None:
                flops = functools.partial(_registered_flops, formula)
        counting = _OP_COUNTING[func] = (flops, bool(func.is_view), packet in _COPIES)
    return counting


def _registered_flops(formula: Callable, args: tuple, kwargs: dict, result: Any) -> int:
    return formula(*args, **kwargs, out_val=result)


def _product_flops(first: int, second: int) -> _OpFlops:
    """FLOPs of a (batched) matrix product of ``args[first]`` and ``args[second]``: ``flop_counter``'s
    count (two per multiply-add), from the shapes."""

    def flops(args: tuple, kwargs: dict, result: Any) -> int:
        return 2 * math.prod(args[first].shape) * args[second].shape[-1]

    return flops


def _convolution_flops(args: tuple, kwargs: dict, result: Any) -> int:
    """FLOPs of ``aten.convolution`` (input, weight, bias, stride, padding, dilation, transposed,
    ...): ``flop_counter``'s count, two per multiply-add of every weight entry at every output
    position (input position when transposed), from the shapes."""
    transposed = args[6] if len(args) > 6 else kwargs["transposed"]
    positions = (args[0] if transposed else result).shape[2:]
    return 2 * args[0].shape[0] * math.prod(args[1].shape) * math.prod(positions)


_aten = torch.ops.aten
_MATRIX_PRODUCT_FLOPS: dict[Any, _OpFlops] = {
    _aten.mm: _product_flops(0, 1), _aten.addmm: _product_flops(1, 2),
    _aten.bmm: _product_flops(0, 1), _aten.baddbmm: _product_flops(1, 2),
    # flop_counter's formula maps every argument through pytree: 60 us a convolution, three times
    # the convolution itself on one example of MobileNetV3-small
    _aten.convolution: _convolution_flops,
}
_OP_COUNTING: dict[Any, tuple[Optional[_OpFlops], bool, bool]] = {}


def counted_example(side: Side) -> Side:
    """The part of ``side`` the pass evaluates: its first example as a batch of one when it maps
    more than one, else ``side`` itself."""
    return side.narrow(0, 1) if side.mapped and side.batch_size() > 1 else side


def count_example(side: Side) -> Optional[ExampleCount]:
    """The counted pass of ``side``'s first example (the whole ``side`` when it is not mapped or has
    at most one), or None when the model fails under the counter (NOTE: [One counting pass])."""
    params = side.model.params
    example = counted_example(side).whole_batch()  # narrowed outside the mode: not the model's op
    counter = _CountingMode(params)
    try:
        # The lock: forward_mode_kernels saves and sets process-wide flags (NOTE: [One counting pass]).
        with FORWARD_MODE_LOCK, torch.no_grad(), forward_mode_kernels(bool(side.model.fused)), counter:
            example(params)
    except Exception:  # noqa: BLE001 - an estimate only; the implementation reports the model's error
        return None
    return counter.count()


def example_shapes(side: Side) -> Optional[tuple]:
    """The shapes and dtypes of one example of a mapped side, its other leaves by
    :func:`~torchntk._utils.values.leaf_key` (hashable whatever they are); None for a whole batch or a side without examples."""
    if not side.mapped or side.batch_size() == 0:
        return None
    example = side.narrow(0, 1)
    leaves = list(example.x.leaves) + [leaf for flat in example.kwargs.values() for leaf in flat.leaves]
    return tuple((tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf_key(leaf) for leaf in leaves)


Counter = Callable[[Side], Optional[ExampleCount]]
"""``side -> its count``, for the sides of one call (:func:`counter`)."""

_COUNT = "example count"
"""The kind of a side's count in a key's record (NOTE: [One record per key])."""

_MISSING = object()


def counter(call: KernelCall, scope: Optional[Scope]) -> Counter:
    """``side -> count`` for the sides of ``call``, kept in the key's record (``scope``; None:
    kept for this call only). x2 is priced from x1's count when its examples have x1's shapes.
    Thread-safe: two threads counting the same side at once both count (the same numbers)."""
    within: dict = {}

    def count(side: Side) -> Optional[ExampleCount]:
        shapes = example_shapes(side)
        side_key = ("example", shapes) if shapes is not None else ("side", side.name)
        found = within.get(side_key, _MISSING)
        if found is _MISSING:
            found = within[side_key] = cached(scope, _COUNT, call, lambda: count_example(side), side_key)
        return found

    return count


def uncached(call: KernelCall) -> Counter:
    """``side -> count`` for one call, kept for that call only (x2 priced from x1's count when
    their examples' shapes agree)."""
    return counter(call, None)
