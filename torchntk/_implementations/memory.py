"""The memory model: the peak bytes of one kernel call, per implementation, layout and ``chunk_size``.

NOTE: [Memory plans]
Every NTK call is planned within its budget (NOTE: [Memory budgets] in ``_memory/budget.py``)
after its validation (one forward pass per side, which the budget does not plan) and before any
derivative is taken:

1. the result alone, every output leaf's kernel (``N1 N2 O1 O2`` entries for a full kernel,
   times the parameter groups), must fit, or the call is refused at once with a
   :class:`~torchntk._memory.KernelMemoryError` naming the bytes, the budget and the ways out;
2. the implementation's peak at the ``chunk_size`` given (None: its default) is estimated by the
   model below; if it exceeds the budget, the largest ``chunk_size`` whose peak fits is used (with
   ``vmap_axes``: examples per run, the runs then balanced; without: vectors differentiated at
   once), and :class:`~torchntk._memory.MemoryPlanWarning` says so once per kernel function;
   when none fits, the call is refused, naming the smallest plan's peak;
3. AUTO (``_implementations/auto.py``) prices every candidate's plan this way, the chunked ones
   with the extra derivative passes their blocks cost, and picks the cheapest plan that fits.

The model. Sizes come from the call (``N`` examples per side, ``O`` output entries per example,
``P`` parameter entries, the kernel's entries, the dtypes) and from one counted forward pass of
one example, the one AUTO prices from too (NOTE: [One counting pass] in ``counting.py``, once per
input shapes): ``A``, the elements its operations write (what autograd keeps for the backward
pass, an upper bound), ``A_max``, the largest of them, and the parameters used more than once
(whose gradients autograd sums). Without ``vmap_axes`` the whole batch is one example and ``O``
counts all its output entries. A run of ``n`` examples then holds, in bytes (``e``: the element
size):

* its Jacobians (implementation 1; implementation 2's x2 vectors): ``n O P e``, plus for each
  parameter used more than once a second copy of its part (the sum autograd forms), and a second
  copy of everything when examples are mapped by a loop (the per-example results are stacked);
  without ``vmap_axes``, with a ``chunk_size`` and a traced output axis, implementation 1 holds
  one run of its coordinates instead of ``O`` (NOTE: [Runs of traced outputs] in
  ``jacobian_contraction.py``), each side's forward pass kept for the run's backward passes;
* a reverse sweep: ``n A e`` kept for the backward pass and ``BACKWARD_LIVE n V A_max e`` for the
  ``V`` cotangents pushed at once (``O``; without ``vmap_axes``, ``chunk_size`` of them); without
  a ``chunk_size``, implementations 1 and 3 sweep the examples of one working-set run at a time
  (NOTE: [Working-set runs]), so ``n`` is at most that run's length;
* structured derivatives' factors and pair intermediates: ``e`` times
  ``structured._cost.StructuredCost.held_elements`` of the call narrowed to a run of each side
  (with x2 None too: a block off the diagonal holds two runs' factors and Jacobians), the largest
  pair intermediate counted ``INTERMEDIATE_COPIES`` times, plus the sweep (over both sides'
  examples when one pass serves both);
* NTK-vector products' forward-mode pass over all of x1 with ``t`` tangents (at most 24, fewer
  where NOTE: [Working-set runs] bounds them):
  ``FORWARD_LIVE (1 + t) N1 A_max e``, and its columns, ``2`` copies of ``N1 n O1 O2`` entries
  (the full block, then reduced to the layout);
* a block's contraction: ``CONTRACTION_BYTES`` per entry of the block (the float64 sums of NOTE:
  [Accurate contraction] and the product);

and the call holds the preallocated kernel when it is assembled from several blocks. The peak is
the largest of: preparing x2's run; preparing x1's run while x2's is held; contracting both. The
validation before (the forward passes and checks, on runs of at most ``VALIDATION_RUN``
examples) is modelled as ``VALIDATION_LIVE n A_max e`` plus the outputs, and reported with the
rest; it is not planned. The constants were fitted on the grid of ``tests/test_memory.py`` (an
MLP, a CNN, a transformer block and an LSTM, every
implementation, traced and full kernels, x2 given and None; measured as the growth of the
process's peak resident memory); ``docs/batching.md`` ("Memory plans") records predicted against
measured peaks.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

import torch

from .._call.kernel_call import KernelCall
from .._plan.scope import Scope, cached
from .._layout.runs import even_length, forward_mode_passes, runs
from .._layout.tiles import Placement
from .._memory import KernelMemoryError, MemoryPlanWarning, available_bytes, format_bytes
from .._utils.checks import user_stacklevel
from .._utils.types import NtkImplementation
from .counting import Counter, ExampleCount, counter, example_shapes, uncached
from .ntk_vector_products import default_run_length
from .structured._cost import structured_cost

_JACOBIAN = NtkImplementation.JACOBIAN_CONTRACTION
_PRODUCTS = NtkImplementation.NTK_VECTOR_PRODUCTS
_STRUCTURED = NtkImplementation.STRUCTURED_DERIVATIVES

BACKWARD_LIVE = 3.0
"""Activation-sized tensors per cotangent a backward pass holds at once (the gradient arriving, the
one leaving, an operation's temporary)."""
FORWARD_LIVE = 3.0
"""Activation-sized tensors a pass without a tape holds at once (input, output, a temporary)."""
VALIDATION_LIVE = 4.0
"""Activation-sized tensors per example of the validation's forward passes (whole batch and per
example, compared)."""
VALIDATION_RUN = 1024
"""Examples per forward pass of a kernel call's validation when its budget is planned: the passes
over the whole batch then hold at most this many examples' activations."""
CONTRACTION_BYTES = 20
"""Bytes per entry of a block's contraction: a float64 sum, a float64 term and the product."""
INTERMEDIATE_COPIES = 1.5
"""Structured derivatives' largest pair intermediate counts this many times (the einsum's operands
of the next step are permuted copies of it, part of the time)."""
TANGENTS_AT_ONCE = 24
"""NTK-vector products push at most this many tangents through one forward-mode pass
(``ntk_vector_products.TANGENTS_PER_PASS``)."""


# -- what one forward pass of one example writes -------------------------------------------------


@dataclass(frozen=True)
class Activations:
    """One counted forward pass (of one example when mapped, else of the whole batch).

    Attributes:
        written: elements written by operations that are neither views nor the functional
            model's copies of its inputs and parameters.
        largest: the largest such result, in elements.
        reused: indices of the parameters consumed by more than one operation.
        parameter_outputs: the part of ``written`` that operations consuming a parameter wrote.
    """

    written: float
    largest: float
    reused: tuple[int, ...] = ()
    parameter_outputs: float = 0.0


def activations_of(count: Optional[ExampleCount]) -> Optional[Activations]:
    """The :class:`Activations` of a counted pass (NOTE: [One counting pass]), or None without a
    count (the model then uses the outputs' sizes alone)."""
    if count is None:
        return None
    return Activations(float(count.written), float(count.largest), count.reused, float(count.parameter_outputs))


# -- the sizes of a call ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _SideSizes:
    examples: int  # N (1 for a whole batch)
    outputs: float  # O: output entries per example (all of them for a whole batch)
    activations: Activations
    loop: bool
    # Without vmap_axes, per output leaf: its entries and those of one coordinate of the axis its
    # runs are cut along (NOTE: [Runs of traced outputs]; all its entries where nothing is traced).
    leaf_runs: tuple[tuple[float, float], ...] = ()

    def run_entries(self, chunk: float) -> float:
        """Output entries whose Jacobian one run holds with ``chunk_size=chunk``, cut in runs of
        traced outputs (NOTE: [Runs of traced outputs]): at least one coordinate of the leaf's axis."""
        return max(min(entries, max(unit, unit * (chunk // unit))) for entries, unit in self.leaf_runs)


@dataclass(frozen=True)
class CallSizes:
    """What the model needs of one call, measured once per key (:func:`kept_sizes`)."""

    mapped: bool
    reuses_x1: bool
    element: int
    params: int
    param_sizes: tuple[int, ...]
    side1: _SideSizes
    side2: _SideSizes
    kinds: tuple[str, ...]  # per kernel leaf: "kept", "diagonal", "trace" (the batch axis), or "whole"
    output_runs: bool  # unmapped with a traced output axis: a chunk_size cuts runs of it (implementation 1)
    kernel_entries: tuple[float, ...]  # per kernel leaf, all groups
    kernel_bytes: tuple[int, ...]  # bytes per kernel entry per leaf
    output_bytes: float  # the whole-batch outputs the call holds

    def block_entries(self, n1: int, n2: int) -> float:
        """Kernel entries of the block of ``n1`` x1 and ``n2`` x2 examples."""
        total = 0.0
        big1, big2 = self.side1.examples, self.side2.examples
        for kind, entries in zip(self.kinds, self.kernel_entries):
            if kind == "kept":
                total += entries * n1 * n2 / max(1, big1 * big2)
            elif kind == "diagonal":
                total += entries * min(n1, n2) / max(1, big1)
            else:
                total += entries
        return total

    @property
    def result_bytes(self) -> float:
        return sum(entries * size for entries, size in zip(self.kernel_entries, self.kernel_bytes))

    def cut(self, implementation: NtkImplementation) -> bool:
        """Whether ``chunk_size`` cuts x1 too (NTK-vector products keep x1 whole unless its batch
        axis is traced or diagonal)."""
        return implementation != _PRODUCTS or any(kind in ("diagonal", "trace") for kind in self.kinds)


def call_sizes(call: KernelCall, bound: Optional[Activations] = None, count: Optional[Counter] = None) -> CallSizes:
    """The sizes of ``call``: each side's counted forward pass (``count``, by default made for this
    call alone; x2 shares x1's when its examples have x1's shapes, NOTE: [One counting pass]), or
    ``bound``'s activations for every side (an upper bound known without counting)."""
    params = call.model.params
    element = max(params[0].element_size(), max(output.element_size() for output in call.outputs1))
    mapped = call.side1.mapped
    if bound is None and count is None:
        count = uncached(call)
    sides = []
    pairs = [(call.side1, call.outputs1)] + ([(call.side2, call.outputs2)] if call.side2 is not None else [])
    axes = [layout.run_axis(output.shape) for layout, output in zip(call.layouts, call.outputs1)]
    for side, outputs in pairs:
        examples = side.batch_size() if mapped else 1
        activations = bound if bound is not None else activations_of(count(side))
        entries = sum(output.numel() for output in outputs)
        per_example = entries / max(1, examples)
        if activations is None:  # the counter failed: the outputs are the only sizes known
            activations = Activations(per_example, per_example)
        leaf_runs = tuple(
            (float(output.numel()), float(output.numel() // (1 if axis is None else output.shape[axis])))
            for output, axis in zip(outputs, axes)
        )
        sides.append(_SideSizes(examples, per_example, activations, bool(side.loop), leaf_runs))
    if len(sides) == 1:
        sides.append(sides[0])
    groups = len(call.groups) if call.groups is not None else 1
    kinds, entries, sizes = [], [], []
    for shape, layout, output, dtype in zip(call.kernel_shapes(), call.layouts, call.outputs1, call.dtypes):
        kinds.append(Placement.of(layout, call.side1.out_axes[len(kinds)]).kind if mapped else "whole")
        entries.append(float(math.prod(shape)) * groups)
        sizes.append(dtype.itemsize)
    output_bytes = sum(o.numel() * o.element_size() for o in call.outputs1)
    if call.side2 is not None:
        output_bytes += sum(o.numel() * o.element_size() for o in call.outputs2)
    return CallSizes(
        mapped, call.side2 is None, element, sum(p.numel() for p in params), tuple(p.numel() for p in params),
        sides[0], sides[1], tuple(kinds), not mapped and any(axis is not None for axis in axes), tuple(entries),
        tuple(sizes), float(output_bytes),
    )


# -- the peaks -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Peak:
    """A modelled peak, in bytes, and its parts (for messages and ``docs/batching.md``)."""

    total: float
    result: float  # the kernel preallocated for assembling blocks (0 for one block)
    derivatives: float  # the largest phase of preparing and contracting runs
    validation: float  # the forward passes and checks before the plan

    @property
    def planned(self) -> float:
        """What the plan controls: the peak after validation."""
        return self.result + self.derivatives


StructuredMemory = Callable[[int, int], float]
"""``(n1, n2) -> elements`` of structured derivatives' factors and intermediates for runs of those
lengths (``StructuredCost.memory_elements`` of the narrowed call)."""


def peak_bytes(
    sizes: CallSizes, implementation: NtkImplementation, chunk: Optional[int],
    structured: Optional[StructuredMemory] = None, default_run: Optional[int] = None, cut: bool = False,
    working_runs: Optional[int] = None, tangents: Optional[int] = None,
) -> Peak:
    """The modelled peak of a call of ``implementation`` with ``chunk_size=chunk`` (NOTE: [Memory plans]).

    ``structured``: implementation 3's factor memory (required for it); ``default_run``: the run
    length implementation 2 uses when ``chunk`` is None; ``cut``: runs of ``chunk`` examples on
    both sides whatever the implementation (``batch``'s spans); ``working_runs``: the examples per
    per-example pass of implementations 1 and 3 when ``chunk`` is None (NOTE: [Working-set runs]),
    which bounds the activations held while all examples' Jacobians or factors are kept;
    ``tangents``: implementation 2's tangents per forward-mode pass when bounded
    (``KernelCall.tangents_per_pass``; None: :data:`TANGENTS_AT_ONCE`).
    """
    e = sizes.element
    one, two = sizes.side1, sizes.side2
    validation = sizes.output_bytes + VALIDATION_LIVE * e * max(
        min(one.examples, VALIDATION_RUN) * one.activations.largest,
        min(two.examples, VALIDATION_RUN) * two.activations.largest,
    )
    if sizes.mapped:
        n2 = min(two.examples, chunk or (default_run if implementation == _PRODUCTS else None) or two.examples)
        n1 = min(one.examples, chunk or one.examples) if cut or sizes.cut(implementation) else one.examples
        vectors1, vectors2 = one.outputs, two.outputs
        assembled = n1 < one.examples or n2 < two.examples
    else:
        n1 = n2 = 1
        vectors1 = min(one.outputs, chunk or one.outputs)
        vectors2 = min(two.outputs, chunk or two.outputs)
        assembled = False
    result = sizes.result_bytes if assembled else 0.0
    block = CONTRACTION_BYTES * sizes.block_entries(n1, n2)
    shared = sizes.reuses_x1 and n1 >= one.examples  # one run prepared once serves both sides

    def sweep(side: _SideSizes, n: int, vectors: float) -> float:
        if chunk is None and working_runs is not None and implementation != _PRODUCTS:
            n = min(n, working_runs)
        return e * n * (side.activations.written + BACKWARD_LIVE * vectors * side.activations.largest)

    def jacobians(side: _SideSizes, n: int) -> float:
        reused = sum(sizes.param_sizes[index] for index in side.activations.reused)
        held = e * n * side.outputs * (sizes.params + reused)
        return 2 * held if side.loop else held

    if implementation == _JACOBIAN and sizes.output_runs and chunk is not None:
        # NOTE: [Runs of traced outputs]: both sides' forward passes are kept for the runs' backward
        # passes; each side holds one run's Jacobian.
        def run_jacobians(side: _SideSizes) -> float:
            reused = sum(sizes.param_sizes[index] for index in side.activations.reused)
            return e * side.run_entries(chunk) * (sizes.params + reused)

        def live(side: _SideSizes) -> float:
            return e * BACKWARD_LIVE * min(chunk, side.run_entries(chunk)) * side.activations.largest

        tapes = e * (one.activations.written + (0 if sizes.reuses_x1 else two.activations.written))
        held2 = run_jacobians(two)
        held = held2 + (0 if sizes.reuses_x1 else run_jacobians(one))
        derivatives = tapes + max(held2 + live(two), held + live(one), held + block)
    elif implementation == _JACOBIAN:
        held2 = jacobians(two, n2)
        phases = [held2 + sweep(two, n2, vectors2)]
        if not shared:
            phases.append(held2 + jacobians(one, n1) + sweep(one, n1, vectors1))
        phases.append(held2 + (0 if shared else jacobians(one, n1)) + block)
        derivatives = max(phases)
    elif implementation == _STRUCTURED:
        if structured is None:
            raise ValueError("the memory of structured derivatives needs their factor sizes")
        factors = e * structured(n1, n2)
        passes = n1 + n2 if not (sizes.reuses_x1 or assembled) else max(n1, n2)  # one pass for both sides
        side = one if one.activations.written >= two.activations.written else two
        derivatives = factors + block + sweep(side, passes, max(vectors1, vectors2))
    elif implementation == _PRODUCTS:
        # x2's vectors are formed, then pushed through forward-mode passes over all of x1, each
        # giving full columns before the layout reduces them.
        vectors = e * n2 * two.outputs * sizes.params
        columns = n2 * vectors2 if sizes.mapped else vectors2
        examples = n1
        if tangents is not None and sizes.mapped:  # NOTE: [Forward-mode passes over runs of x1]
            tangents, examples = forward_mode_passes(int(columns), n1, tangents)
            examples = examples or n1
        tangents = min(tangents or TANGENTS_AT_ONCE, columns)
        forward = FORWARD_LIVE * e * (1 + tangents) * examples * one.activations.largest
        products = 2 * sizes.kernel_bytes[0] * columns * n1 * one.outputs
        derivatives = vectors + max(sweep(two, n2, vectors2), forward + products)
    else:
        raise ValueError(f"no memory model for implementation {implementation!r}")
    planned = result + derivatives
    return Peak(max(planned, validation), result, derivatives, validation)


# -- plans ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    """How one call runs within its budget.

    Attributes:
        implementation: the implementation that computes it.
        chunk_size: the ``chunk_size`` it runs with (the caller's, or one chosen to fit).
        peak: the modelled peak of that plan (None when nothing was planned: an unlimited budget).
        budget: the budget in bytes (``inf``: nothing was planned).
        replaced: when the plan chose ``chunk_size``, the modelled peak of the call as given.
    """

    implementation: NtkImplementation
    chunk_size: Optional[int]
    peak: Optional[Peak]
    budget: float
    replaced: Optional[Peak] = None

    @property
    def chosen(self) -> bool:
        """Whether the plan chose ``chunk_size`` (the caller's did not fit)."""
        return self.replaced is not None

    def describe(self) -> str:
        """``implementation 1 (chunk_size=512; an estimated peak of 1.2 GB, budget 2 GB)``."""
        chunk = f"chunk_size={self.chunk_size}" if self.chunk_size is not None else "no chunk_size"
        estimate = "" if self.peak is None else f"; an estimated peak of {format_bytes(self.peak.total)}"
        return f"implementation {int(self.implementation)} ({chunk}{estimate}, budget {format_bytes(self.budget)})"


def largest_chunk(total: int, fits: Callable[[int], bool]) -> Optional[int]:
    """The largest ``c`` in ``1..total`` with ``fits(c)`` (``fits`` monotone), balanced: as many runs
    as ``c`` makes, their lengths as equal as they can be. None when even 1 does not fit.

    Example:
        >>> largest_chunk(100, lambda c: c <= 40), largest_chunk(100, lambda c: c <= 0)
        (34, None)
    """
    if not fits(1):
        return None
    low, high = 1, max(1, total)
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return even_length(total, low)


def run_count(sizes: CallSizes, implementation: NtkImplementation, chunk: Optional[int]) -> tuple[int, int]:
    """How many runs of x1 and of x2 ``chunk`` makes (1 and 1 without ``vmap_axes``)."""
    if not sizes.mapped or chunk is None:
        return 1, 1
    first = len(runs(sizes.side1.examples, chunk)) if sizes.cut(implementation) else 1
    return first, len(runs(sizes.side2.examples, chunk))


def result_bytes(shapes: Any, dtypes: Any, groups: int = 1) -> float:
    """The bytes of an NTK: one kernel of each shape and dtype per output leaf, per parameter group."""
    return float(sum(math.prod(shape) * dtype.itemsize * groups for shape, dtype in zip(shapes, dtypes)))


def result_refusal(call: KernelCall, budget: float) -> Optional[KernelMemoryError]:
    """The error for a call whose result alone exceeds ``budget``, or None (computes nothing)."""
    groups = len(call.groups) if call.groups is not None else 1
    examples = None
    if call.side1.mapped:
        examples = (call.side1.batch_size(), (call.side2 or call.side1).batch_size())
    return kernel_refusal(
        call.kernel_shapes(), call.dtypes, groups, budget, call.where, call.outputs1[0].device, examples
    )


def kernel_refusal(
    shapes: Any, dtypes: Any, groups: int, budget: float, where: str, device: Optional[torch.device] = None,
    examples: Optional[tuple[int, int]] = None,
) -> Optional[KernelMemoryError]:
    """The error for kernels of these shapes and dtypes (per group) that alone exceed ``budget``, or
    None. ``device``: where the kernel would be held (what it has free decides whether more memory
    is a way out); ``examples``: ``(N1, N2)`` when ``vmap_axes`` maps them (the advice then says
    what the smallest layout would take)."""
    needed = result_bytes(shapes, dtypes, groups)
    if needed <= budget:
        return None
    described = ", ".join("x".join(map(str, shape)) for shape in shapes)
    per_group = f" for each of {groups} parameter groups" if groups > 1 else ""
    names = ", ".join(sorted({str(dtype).replace("torch.", "") for dtype in dtypes}))
    advice = result_advice(needed, dtypes, groups, device, examples)
    return KernelMemoryError(
        f"{where}: the kernel alone takes {format_bytes(needed)} (shape {described}{per_group}, {names}), more "
        f"than the memory budget of {format_bytes(budget)}. {advice}",
        needed, budget, kernel_alone=True,
    )


SUGGESTED_HEADROOM = 1.5
"""A budget suggested for a kernel that alone exceeds its budget: this many times the kernel, room
for the blocks of derivatives the plan then cuts around it."""
PLANNED_SLACK = (1.4, 16e6)
"""A planned call's measured peak stays under ``1.4 * budget + 16 MB`` (docs/batching.md, "The
memory model, and how it was checked"): a suggested budget must leave that much free."""


def result_advice(
    needed: float, dtypes: Any, groups: int, device: Optional[torch.device], examples: Optional[tuple[int, int]],
) -> str:
    """The ways out for a kernel of ``needed`` bytes that alone exceeds its budget (NOTE: [Memory
    plans]): a larger ``memory=`` only where ``device`` has it free, slack included; otherwise
    writing the kernel to disk and smaller layouts, with nothing suggesting memory the device lacks."""
    free = available_bytes(device) if device is not None else math.inf
    suggested = _round_up(SUGGESTED_HEADROOM * needed)
    disk = (
        f"write it to disk block by block with torchntk.batch(kernel_fn)(x1, x2, "
        f"out=np.lib.format.open_memmap(path, mode='w+', dtype=..., shape=...)) ({format_bytes(needed)} of disk)"
    )
    layout = "trace more output axes (trace_axes: a full kernel holds O1 x O2 entries per pair of examples); "
    if examples is not None:
        smallest = float(examples[0] * examples[1] * sum(dtype.itemsize for dtype in dtypes) * groups)
        layout = "" if needed <= smallest else (
            f"trace more output axes (trace_axes: the kernel holds {round(needed / smallest):,} entries per pair of "
            f"examples; with every output axis traced but the examples', it takes {format_bytes(smallest)}); "
        )
    fewer = "keep fewer outputs (output_fn=...) or examples"
    if not math.isfinite(free):
        return f"Ways out: {disk}; {layout}{fewer}; or allow more memory (memory=...)."
    factor, slack = PLANNED_SLACK
    if suggested * factor + slack <= free:
        return (
            f"Ways out: allow more memory (memory='{format_bytes(suggested).replace(' ', '')}'; the kernel's device, "
            f"{device}, has {format_bytes(free)} free); {disk}; {layout}or {fewer}."
        )
    return (
        f"The kernel's device, {device}, has {format_bytes(free)} free, too little to hold it, so a larger memory= "
        f"is no way out. Ways out: {disk}; {layout}or {fewer}."
    )


def _round_up(amount: float) -> float:
    """``amount`` rounded up to two significant digits (a budget to type: 24 GB, 1.6 GB).

    Example:
        >>> _round_up(2.31e9), _round_up(1.5e6)
        (2400000000.0, 1500000.0)
    """
    if not 0 < amount < math.inf:
        return amount
    scale = 10.0 ** (math.floor(math.log10(amount)) - 1)
    return math.ceil(round(amount / scale, 6)) * scale


PLAN_ADVICE = (
    "Ways out: allow more memory (memory=...); another implementation (3 holds no per-parameter Jacobians; 0 picks "
    "the fastest that fits); fewer parameters (params=...) or outputs (trace_axes, output_fn); or "
    "torchntk.batch(kernel_fn, batch_size='auto'), which also cuts x1 and can write the kernel to disk (out=...)."
)


def plan_advice(sizes: CallSizes, implementation: NtkImplementation) -> str:
    """What to do about a call none of whose plans fit: :data:`PLAN_ADVICE`, led by what this call lacks."""
    if not sizes.mapped:
        return "Pass vmap_axes if the examples are independent: blocks of examples then bound the memory. " + (
            PLAN_ADVICE
        )
    if implementation == _PRODUCTS and not sizes.cut(implementation):
        return (
            "Implementation 2 pushes all of x1 through each forward-mode pass (chunk_size cuts x2 only). " + PLAN_ADVICE
        )
    return PLAN_ADVICE


OUT_OF_MEMORY_ADVICE = (
    "The plan is an estimate and other processes take memory too: pass a smaller memory= (the plan then cuts the "
    "work into smaller blocks) or chunk_size, or compute the kernel with torchntk.batch(kernel_fn, out=...)."
)


def plan_refusal(
    peak: Peak, sizes: CallSizes, implementation: NtkImplementation, budget: float, where: str
) -> KernelMemoryError:
    """The error for a call whose smallest plan (``peak``) exceeds ``budget``."""
    smallest = "one example per block" if sizes.mapped else "one output entry differentiated at a time"
    return KernelMemoryError(
        f"{where}: implementation {int(implementation)} needs about {format_bytes(peak.planned)} even with "
        f"{smallest} (the kernel {format_bytes(peak.result)}, the derivatives {format_bytes(peak.derivatives)}), "
        f"more than the memory budget of {format_bytes(budget)}. {plan_advice(sizes, implementation)}",
        peak.planned, budget,
    )


_SIZES, _PEAK = "memory sizes", "memory peak"
"""The kinds of what the memory model keeps in a key's record (NOTE: [One record per key])."""


def kept_sizes(call: KernelCall, scope: Optional[Scope]) -> CallSizes:
    """The call's :class:`CallSizes`, measured once per key (``scope``; None: for this call alone)."""
    return cached(scope, _SIZES, call, lambda: call_sizes(call, count=counter(call, scope)))


def bounded_peak(
    call: KernelCall, implementation: NtkImplementation, written: float, structured_plan: Any = None,
) -> Optional[Peak]:
    """An upper bound of :func:`modelled_peak` for the call as given, without the counted pass: every
    example writing at most ``written`` elements (all of them one tensor) and every parameter
    used twice. None where the bound cannot be made (x2's examples shaped unlike x1's, no
    ``written``). AUTO takes it for a candidate that fits its budget even so."""
    if not written > 0 or (call.side2 is not None and example_shapes(call.side1) != example_shapes(call.side2)):
        return None
    activations = Activations(written, written, tuple(range(len(call.model.params))))
    structured = None if structured_plan is None else structured_memory(call, structured_plan)
    default_run = default_run_length(call) if implementation == _PRODUCTS else None
    sizes = call_sizes(call, bound=activations)
    return peak_bytes(sizes, implementation, call.chunk_size, structured, default_run,
                      working_runs=call.working_runs if call.chunk_size is None else None,
                      tangents=call.tangents_per_pass)


def modelled_peak(
    call: KernelCall, scope: Optional[Scope], implementation: NtkImplementation, chunk: Optional[int],
    structured_plan: Any = None, cut: bool = False,
) -> Peak:
    """The modelled peak of ``call`` run by ``implementation`` with ``chunk_size=chunk``, kept in
    the key's record (``scope``); ``structured_plan``: implementation 3's plan (required for it);
    ``cut``: see :func:`peak_bytes`."""
    working_runs = call.working_runs if chunk is None and not cut else None

    def made() -> Peak:
        structured = None if structured_plan is None else structured_memory(call, structured_plan)
        default_run = default_run_length(call) if implementation == _PRODUCTS else None
        return peak_bytes(
            kept_sizes(call, scope), implementation, chunk, structured, default_run, cut, working_runs,
            call.tangents_per_pass)

    # a plan is kept in the same record as long as the peaks priced from it: its identity names it
    parts = (implementation, chunk, id(structured_plan), cut, working_runs, call.tangents_per_pass)
    return cached(scope, _PEAK, call, made, *parts)


def fitted_plan(
    call: KernelCall, scope: Optional[Scope], implementation: NtkImplementation, budget: float,
    structured_plan: Any = None,
) -> MemoryPlan:
    """The plan of ``call`` with ``implementation`` within ``budget`` bytes: its ``chunk_size``
    if that fits, else the largest that does.

    Raises:
        KernelMemoryError: the result alone, or the smallest plan, exceeds the budget.
    """
    if not math.isfinite(budget):
        return MemoryPlan(implementation, call.chunk_size, None, budget)
    refusal = result_refusal(call, budget)
    if refusal is not None:
        raise refusal
    sizes = kept_sizes(call, scope)

    def peak(chunk: Optional[int]) -> Peak:
        return modelled_peak(call, scope, implementation, chunk, structured_plan)

    given = peak(call.chunk_size)
    if given.planned <= budget:
        return MemoryPlan(implementation, call.chunk_size, given, budget)
    total = chunk_limit(sizes)
    limit = min(total, call.chunk_size) if call.chunk_size is not None else total
    chosen = largest_chunk(limit, lambda chunk: peak(chunk).planned <= budget)
    if chosen is None:
        raise plan_refusal(peak(1), sizes, implementation, budget, call.where)
    return MemoryPlan(implementation, chosen, peak(chosen), budget, replaced=given)


def warn_chosen_chunk(plan: MemoryPlan, call: KernelCall) -> None:
    """The :class:`MemoryPlanWarning` of a ``chunk_size`` the plan chose (the kernel function gives
    it once)."""
    unit = "examples of x1 and x2 per block" if call.side1.mapped else "output entries differentiated at once"
    given = "no chunk_size" if call.chunk_size is None else f"chunk_size={call.chunk_size}"
    warnings.warn(
        f"{call.where}: with {given}, implementation {int(plan.implementation)} would need about "
        f"{format_bytes(plan.replaced.planned)}, more than the memory budget of {format_bytes(plan.budget)}; "
        f"computing it with chunk_size={plan.chunk_size} ({unit}, an estimated peak of "
        f"{format_bytes(plan.peak.total if plan.peak else math.nan)}) instead. Pass chunk_size or memory= to "
        f"choose yourself. Shown once per kernel function.",
        MemoryPlanWarning,
        stacklevel=user_stacklevel(),
    )


def chunk_limit(sizes: CallSizes) -> int:
    """The largest ``chunk_size`` that means anything: all examples of the larger side, or all
    output entries without ``vmap_axes``."""
    if sizes.mapped:
        return max(sizes.side1.examples, sizes.side2.examples)
    return int(max(sizes.side1.outputs, sizes.side2.outputs))


def structured_memory(call: KernelCall, plan: Any) -> StructuredMemory:
    """Implementation 3's factor and intermediate elements for runs of ``n1`` and ``n2`` examples,
    priced on the call narrowed to them (``structured._cost``), each size once."""
    found: dict[tuple[int, int], float] = {}
    n1 = call.side1.batch_size() if call.side1.mapped else 1
    n2 = n1 if call.side2 is None else (call.side2.batch_size() if call.side2.mapped else 1)

    def elements(length1: int, length2: int) -> float:
        if (length1, length2) not in found:
            narrowed = call
            if call.side1.mapped and (length1 < n1 or length2 < n2):
                # two runs of x1 each (x2 None): the blocks off the diagonal hold both sides'
                # factors and Jacobians, which one run paired with itself holds once
                narrowed = call.narrow((0, length1), (0, length2))
            cost = structured_cost(narrowed, plan)
            # An einsum step's operands are often reshaped copies: the largest intermediate counts more.
            found[length1, length2] = cost.held_elements + (INTERMEDIATE_COPIES - 1) * cost.largest_elements
        return found[length1, length2]

    return elements



def with_chunk(call: KernelCall, plan: MemoryPlan) -> KernelCall:
    """``call`` running with the plan's ``chunk_size``."""
    return call if plan.chunk_size == call.chunk_size else replace(call, chunk_size=plan.chunk_size)
