"""The two ways ``batch`` computes a kernel: prepared spans, or one kernel-function call per block.

NOTE: [Spans and blocks]
With ``vmap_axes`` (see NOTE: [Prepared spans]) :func:`run_spans` cuts x1 and x2 into *spans*:
whole multiples of ``batch_size`` examples, as long as a span's prepared data (Jacobians,
structured factors) fits in half of ``cache_bytes``, with a pair of spans holding at most
:data:`SPAN_ENTRIES` kernel entries, and x1 spans no longer than needed to give every worker (all
devices of all ranks, or of a rank's rows in shard mode) a share. A task is one x1 span: it is prepared once and
contracted with every x2 span, whose prepared data stays cached on its worker while the other
half of ``cache_bytes`` lasts (later spans are prepared again per task). With ``cache_bytes=0``
every span is one block and nothing is cached, so memory is bounded by ``batch_size`` alone, as
in neural-tangents. Spans depend on ``batch_size``, ``cache_bytes``, the shapes and the number of
workers, never on timing, so repeated runs are bitwise identical.

Without ``vmap_axes`` a kernel function cannot be split, so :func:`run_blocks` calls it on every
block of at most ``batch_size`` examples of x1 and x2 (inputs cut along axis 0).

With x2 None only pairs on and above the diagonal are computed and mirrored; with the batch axis
traced or diagonal only pairs of a span (or block) with itself exist (``_layout/runs.tile``).
Pairs already in a progress record are skipped (NOTE: [Kernels on disk]).
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch

from .._kernel.block_source import BlockSource, Prepared
from .._kernel.kernel_function import KernelFnSpec
from .._layout.kernel_layout import make_layout
from .._layout.runs import Run, Tiling, shard_rows, tile
from .._utils.threads import serialised
from .._utils.tree import Flat
from ..distributed import owned_blocks
from ._disk import ProgressRecord, match_out
from ._output import KernelOutput, batch_axis_kinds
from ._streams import Lane
from ._workers import serve


@dataclass(frozen=True)
class Job:
    """What both ways share: the kernel function per device, the tiling and where results go.

    ``shard``: keep only this rank's rows (NOTE: [Row shards] in ``_layout/runs.py``); ``out`` and
    ``record``: the caller's arrays and the progress record (NOTE: [Kernels on disk]). ``lanes``:
    each worker's stream (NOTE: [Worker streams]), made with the job, in the calling thread.
    """

    spec: KernelFnSpec
    functions: Sequence[Callable[..., Any]]
    devices: Sequence[torch.device]
    block_size: int
    progress: bool
    store_device: torch.device
    pin_memory: bool
    rank: int
    world_size: int
    shard: bool = False
    out: Any = None
    record: Optional[ProgressRecord] = None
    lanes: tuple[Lane, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lanes", tuple(Lane(device, self.store_device) for device in self.devices))

    def check_pairs(self, kind: str, n1: int, n2: int) -> None:
        if kind != "kept" and n1 != n2:
            raise ValueError(
                f"batch: the batch axis is traced or diagonal (trace_axes={self.spec.trace_axes}, "
                f"diagonal_axes={self.spec.diagonal_axes}), which pairs example n of x1 with example n "
                f"of x2, but x1 has {n1} examples and x2 {n2}."
            )
        if kind == "trace" and self.shard:
            raise ValueError(
                f"batch: distributed='shard' keeps rows of the kernel, but the batch axis is traced "
                f"(trace_axes={self.spec.trace_axes}), so the kernel has none: use distributed='auto'."
            )

    def rows(self, n1: int) -> tuple[int, int]:
        """The x1 examples whose rows this rank keeps: all, or its shard."""
        return shard_rows(n1, self.block_size or 1, self.rank, self.world_size) if self.shard else (0, n1)

    def share(self, rows: tuple[int, int]) -> int:
        """Examples per x1 span or block for every worker to get a share (of all ranks, or of the shard)."""
        ranks = 1 if self.shard else self.world_size
        return max(1, math.ceil((rows[1] - rows[0]) / (len(self.devices) * ranks)))

    def owned(self, tasks: list) -> list:
        """This rank's share of the tasks (round-robin over ranks; in shard mode all of its rows')."""
        if self.shard:
            return list(tasks)
        owns = owned_blocks(self.rank, self.world_size)
        return [task for index, task in enumerate(tasks) if owns(index)]

    def done(self, run1: Run, run2: Run) -> bool:
        """Whether the progress record has the block already."""
        return self.record is not None and (tuple(run1), tuple(run2)) in self.record.done

    def output(self, result: Flat, layouts: Sequence, n1: int, n2: int) -> KernelOutput:
        out = None if self.out is None else match_out(self.out, result)
        rows = self.rows(n1)
        return KernelOutput(result.leaves, layouts, n1, n2, self.store_device, self.pin_memory,
                            self.lanes[0].result_stream, rows, out, self.record)


def _pending_pairs(job: Job, tiling: Tiling, s: int) -> list[tuple[int, bool]]:
    return [(t, mirror) for t, mirror in tiling.pairs[s] if not job.done(tiling.rows[s], tiling.columns[t])]


def _progress(job: Job, tiling: Tiling, tasks: list[int], kept: bool) -> tuple[int, int]:
    """Kernel entries in ``tasks``: in all, and already recorded."""
    total = initial = 0
    for s in tasks:
        for t, mirror in tiling.pairs[s]:
            entries = tiling.entries(s, t, mirror, kept)
            total += entries
            initial += entries if job.done(tiling.rows[s], tiling.columns[t]) else 0
    return total, initial


# -- prepared spans ------------------------------------------------------------------------------


class _SpanWorker:
    """A device's :class:`BlockSource` and its cache of prepared spans (``room`` bytes left).

    The source is opened by ``open_source`` on first use, in the worker's own thread (opening
    runs the model's forward passes for the checks).
    """

    def __init__(self, open_source: Callable[[], BlockSource], room: float):
        self._open_source = open_source
        self._source: Optional[BlockSource] = None
        self.cache: dict[tuple[int, Run], Prepared] = {}
        self.room = room

    @property
    def source(self) -> BlockSource:
        if self._source is None:
            self._source = self._open_source()
        return self._source

    def prepared(self, side: int, span: Run, keep: bool) -> Prepared:
        key = (1 if self.source.reuses_prepared() else side, span)
        if key in self.cache:
            return self.cache[key]
        with serialised(self.source.thread_safe):
            prepared = self.source.prepare(side, span)
        if keep and prepared.nbytes <= self.room:
            self.cache[key] = prepared
            self.room -= prepared.nbytes
        return prepared


SPAN_ENTRIES = 2**22
"""Kernel entries (summed over leaves and kernels) a pair of spans may hold: 16 MiB per float32
kernel, and square spans of 2048 examples for a kernel with one entry per pair of examples (its
Gram matrices are then large enough to run at the matrix-product peak)."""


def by_entries(source: BlockSource, n1: int, n2: int, unit: int) -> float:
    """The longest span (whole units) whose square pair holds at most :data:`SPAN_ENTRIES` entries.

    A pair's block and the contraction's intermediates grow with the square of the span, and a
    symmetric kernel computes ``1/2 + 1/(4k)`` of the whole with ``k`` spans (a diagonal pair costs
    3/4 of a block, NOTE: [Pair contraction]), so spans far longer than this cost memory and
    symmetry for no speed: the contractions are large matrix products well before.
    """
    per_pair = sum(math.prod(shape) for shape in source.call.kernel_shapes()) / max(1, n1 * n2)
    per_pair *= len(source.leaf_layouts()) / max(1, len(source.call.layouts))  # kernels per output
    return max(unit, int(math.sqrt(SPAN_ENTRIES / max(per_pair, 1e-12))) // unit * unit)


def run_spans(
    job: Job, first: BlockSource, open_source: Callable[[Callable, torch.device], BlockSource], cache_bytes: float,
    planned: Optional[tuple[int, float]] = None,
) -> tuple[Flat, KernelOutput]:
    """Computes the kernel from prepared spans; ``first`` is the first device's source.

    ``planned``: ``(span, cache)`` from NOTE: [Automatic tiling]: spans of at most ``span``
    examples (the unit, ``job.block_size``) and ``cache`` bytes of prepared spans per worker,
    instead of spans and cache from ``cache_bytes``.

    Returns the result's tree and the filled output (this rank's blocks only).
    """
    n1, n2 = first.sizes()
    unit = job.block_size or 1
    # The probe measures the prepared bytes per example. It is kept only when it is the first
    # span, so it is one example unless x1 is one unit (then it is that unit's span): a probe of a
    # whole unit beside longer spans was prepared for nothing (a unit of 32 base-size transformer
    # examples is seconds).
    with serialised(first.thread_safe):
        probe = first.prepare(1, (0, n1 if n1 <= unit else 1))
    per_example = probe.nbytes / max(1, probe.run[1])
    half = cache_bytes / 2
    by_memory = max(unit, int(half // per_example) // unit * unit) if per_example else math.inf
    if planned is not None:
        by_memory, half = planned
    kind = batch_axis_kinds(first.leaf_layouts(), job.spec.trace_axes, job.spec.diagonal_axes)
    job.check_pairs(kind, n1, n2)
    mirrored = first.reuses_x1
    rows = job.rows(n1)
    share = math.ceil(job.share(rows) / unit) * unit
    entry_limit = by_entries(first, n1, n2, unit) if kind == "kept" else math.inf
    length2 = min(by_memory, entry_limit, math.ceil(n2 / unit) * unit)
    tiling = tile(n1, n2, rows, min(by_memory, entry_limit, share), length2, kind, mirrored)
    same_spans = mirrored or kind != "kept"

    workers = [_SpanWorker(lambda: first, half)]
    workers += [
        _SpanWorker(functools.partial(open_source, function, device), half)
        for function, device in zip(job.functions[1:], job.devices[1:])
    ]
    if tiling.rows and probe.run == tiling.rows[0]:
        workers[0].cache[(1, probe.run)] = probe
        workers[0].room -= probe.nbytes
    owned = job.owned(list(range(len(tiling.rows))))
    tasks = [s for s in owned if _pending_pairs(job, tiling, s)]
    state: dict[str, Any] = {}
    lock = threading.Lock()
    if job.out is not None or not tasks:  # `out` checked (and a record verified) before the work
        with serialised(first.thread_safe):
            two = probe if first.reuses_prepared() else first.prepare(2, (0, 1))  # the result's structure only
            result = Flat.of(first.contract(probe, two))
        state["tree"], state["output"] = result, job.output(result, first.leaf_layouts(), n1, n2)

    def write(source: BlockSource, lane: Lane, result: Flat, s: int, t: int, mirror: bool) -> None:
        with lock:
            if "output" not in state:
                state["tree"] = result
                state["output"] = job.output(result, source.leaf_layouts(), n1, n2)
        state["output"].write(result.leaves, tiling.rows[s], tiling.columns[t], mirror=mirror, lane=lane)

    def handle(worker: _SpanWorker, lane: Lane, s: int, advance: Callable[[int], Any]) -> None:
        source = worker.source
        span = tiling.rows[s]
        one = worker.prepared(1, span, keep=source.reuses_prepared())
        for t, mirror in _pending_pairs(job, tiling, s):
            column = tiling.columns[t]
            same = same_spans and column == span and source.reuses_prepared()
            two = one if same else worker.prepared(2, column, keep=True)
            with serialised(source.thread_safe):
                result = Flat.of(source.contract(one, two))
            write(source, lane, result, s, t, mirror)
            advance(tiling.entries(s, t, mirror, kind == "kept"))

    total, initial = _progress(job, tiling, owned, kind == "kept")
    serve(workers, tasks, handle, lanes=job.lanes, progress=job.progress, total=total, initial=initial,
          description="kernel blocks")
    return state["tree"], state["output"]


# -- one kernel-function call per block ----------------------------------------------------------


def run_blocks(
    job: Job, n1: int, n2: int, mirrored: bool, compute: Callable[[Callable, torch.device, Run, Optional[Run]], Any]
) -> tuple[Flat, KernelOutput]:
    """Computes the kernel with ``compute(function, device, run1, run2)`` per block (``run2=None``:
    the x1 run with itself, x2 None). Returns the result's tree and the filled output."""
    rows = job.rows(n1)
    length1 = job.block_size or job.share(rows)
    probe1 = (rows[0], min(length1, rows[1] - rows[0])) if rows[1] > rows[0] else (0, min(length1, n1))
    # A traced or diagonal batch axis pairs equal runs only, and its kind is not known yet.
    probe2 = None if mirrored else probe1 if n1 == n2 else (0, min(job.block_size or n2, n2))
    first = Flat.of(compute(job.functions[0], job.devices[0], probe1, probe2))
    layouts = [(_layout(job.spec, leaf), 0) for leaf in first.leaves]
    kind = batch_axis_kinds(layouts, job.spec.trace_axes, job.spec.diagonal_axes)
    job.check_pairs(kind, n1, n2)
    tiling = tile(n1, n2, rows, length1, job.block_size or n2, kind, mirrored)
    blocks = job.owned([(s, t, mirror) for s in range(len(tiling.rows)) for t, mirror in tiling.pairs[s]])
    output = job.output(first, layouts, n1, n2)
    total = sum(tiling.entries(s, t, mirror, kind == "kept") for s, t, mirror in blocks)
    pending = [block for block in blocks if not job.done(tiling.rows[block[0]], tiling.columns[block[1]])]
    initial = total - sum(tiling.entries(s, t, mirror, kind == "kept") for s, t, mirror in pending)
    probe_column = probe1 if probe2 is None else probe2
    for index, (s, t, mirror) in enumerate(pending):
        if tiling.rows[s] == probe1 and tiling.columns[t] == probe_column:  # the probe is one of this rank's blocks
            output.write(first.leaves, probe1, probe_column, mirror=mirror)
            initial += tiling.entries(s, t, mirror, kind == "kept")
            del pending[index]
            break

    def handle(worker: tuple, lane: Lane, block: tuple[int, int, bool], advance: Callable[[int], Any]) -> None:
        function, device = worker
        s, t, mirror = block
        row, column = tiling.rows[s], tiling.columns[t]
        result = Flat.of(compute(function, device, row, None if (mirrored and row == column) else column))
        output.write(result.leaves, row, column, mirror=mirror, lane=lane)
        advance(tiling.entries(s, t, mirror, kind == "kept"))

    serve(list(zip(job.functions, job.devices)), pending, handle, lanes=job.lanes, progress=job.progress,
          total=total, initial=initial, description="kernel blocks")
    return first, output


def _layout(spec: KernelFnSpec, leaf: torch.Tensor):
    """The layout of a result leaf of ``leaf.ndim`` axes (the output has fewer, see the layout note)."""
    ndim = (leaf.ndim + 2 * len(spec.trace_axes) + len(spec.diagonal_axes)) // 2
    return make_layout(ndim, spec.trace_axes, spec.diagonal_axes, "batch", "the output")
