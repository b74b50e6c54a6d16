"""The two ways ``batch`` computes a kernel: prepared spans, or one kernel-function call per block.

NOTE: [Spans and blocks]
With ``vmap_axes`` (see NOTE: [Prepared spans]) :func:`run_spans` cuts x1 and x2 into *spans*:
whole multiples of ``batch_size`` examples, as long as a span's prepared data (Jacobians,
structured factors) fits in half of ``cache_bytes``, and x1 spans no longer than needed to give
every worker (all devices of all ranks) a share. A task is one x1 span: it is prepared once and
contracted with every x2 span, whose prepared data stays cached on its worker while the other
half of ``cache_bytes`` lasts (later spans are prepared again per task). With ``cache_bytes=0``
every span is one block and nothing is cached, so memory is bounded by ``batch_size`` alone, as
in neural-tangents. Spans depend on ``batch_size``, ``cache_bytes``, the shapes and the number of
workers, never on timing, so repeated runs are bitwise identical.

Without ``vmap_axes`` a kernel function cannot be split, so :func:`run_blocks` calls it on every
block of at most ``batch_size`` examples of x1 and x2 (inputs cut along axis 0).

With x2 None only pairs on and above the diagonal are computed and mirrored; with the batch axis
traced or diagonal only pairs of a span (or block) with itself exist.
"""

from __future__ import annotations

import functools
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from ._batch_output import KernelOutput, batch_axis_kinds
from ._batch_workers import serve
from ._block_source import BlockSource, Prepared
from ._call import runs
from ._kernel_function import KernelFnSpec
from ._layout import make_layout
from ._threads import serialised
from ._tree import Flat
from .distributed import owned_blocks

Run = tuple[int, int]


@dataclass(frozen=True)
class Job:
    """What both ways share: the kernel function per device, the tiling and where results go."""

    spec: KernelFnSpec
    functions: Sequence[Callable[..., Any]]
    devices: Sequence[torch.device]
    block_size: int
    progress: bool
    store_device: torch.device
    pin_memory: bool
    rank: int
    world_size: int

    def check_pairs(self, kind: str, n1: int, n2: int) -> None:
        if kind != "kept" and n1 != n2:
            raise ValueError(
                f"batch: the batch axis is traced or diagonal (trace_axes={self.spec.trace_axes}, "
                f"diagonal_axes={self.spec.diagonal_axes}), which pairs example n of x1 with example n "
                f"of x2, but x1 has {n1} examples and x2 {n2}."
            )

    def owned(self, tasks: list) -> list:
        """This rank's share of the tasks (round-robin over ranks)."""
        owns = owned_blocks(self.rank, self.world_size)
        return [task for index, task in enumerate(tasks) if owns(index)]


# -- prepared spans ------------------------------------------------------------------------------


class _SpanWorker:
    """A device's :class:`BlockSource` and its cache of prepared spans (``room`` bytes left).

    The source is opened by ``open_source`` on first use, in the worker's own thread (opening
    runs the model's forward passes for the checks).
    """

    def __init__(self, open_source: Callable[[], BlockSource], room: float):
        self._open_source = open_source
        self._source: Optional[BlockSource] = None
        self.cache: dict[tuple[int, int], Prepared] = {}
        self.room = room

    @property
    def source(self) -> BlockSource:
        if self._source is None:
            self._source = self._open_source()
        return self._source

    def prepared(self, side: int, index: int, span: Run, keep: bool) -> Prepared:
        key = (1 if self.source.reuses_prepared() else side, index)
        if key in self.cache:
            return self.cache[key]
        with serialised(self.source.thread_safe):
            prepared = self.source.prepare(side, span)
        if keep and prepared.nbytes <= self.room:
            self.cache[key] = prepared
            self.room -= prepared.nbytes
        return prepared


def run_spans(
    job: Job, first: BlockSource, open_source: Callable[[Callable, torch.device], BlockSource], cache_bytes: float
) -> tuple[Flat, KernelOutput]:
    """Computes the kernel from prepared spans; ``first`` is the first device's source.

    Returns the result's tree and the filled output (this rank's blocks only).
    """
    n1, n2 = first.sizes()
    unit = job.block_size or 1
    with serialised(first.thread_safe):
        probe = first.prepare(1, (0, min(unit, n1)))
    per_example = probe.nbytes / max(1, probe.run[1])
    half = cache_bytes / 2
    by_memory = max(unit, int(half // per_example) // unit * unit) if per_example else math.inf
    share = math.ceil(math.ceil(n1 / (len(job.devices) * job.world_size)) / unit) * unit
    kind = batch_axis_kinds(first.leaf_layouts(), job.spec.trace_axes, job.spec.diagonal_axes)
    job.check_pairs(kind, n1, n2)
    mirrored = first.reuses_x1
    spans1 = runs(n1, min(by_memory, share))
    same_spans = mirrored or kind != "kept"
    spans2 = spans1 if same_spans else runs(n2, min(by_memory, math.ceil(n2 / unit) * unit))

    def partners(s: int) -> range:
        if kind != "kept":
            return range(s, s + 1)
        return range(s, len(spans2)) if mirrored else range(len(spans2))

    workers = [_SpanWorker(lambda: first, half)]
    workers += [
        _SpanWorker(functools.partial(open_source, function, device), half)
        for function, device in zip(job.functions[1:], job.devices[1:])
    ]
    if probe.run == spans1[0]:
        workers[0].cache[(1, 0)] = probe
        workers[0].room -= probe.nbytes
    state: dict[str, Any] = {}
    lock = threading.Lock()

    def write(source: BlockSource, result: Flat, s: int, t: int) -> None:
        with lock:
            if "output" not in state:
                state["tree"] = result
                state["output"] = KernelOutput(result.leaves, source.leaf_layouts(), n1, n2, job.store_device, job.pin_memory)
        state["output"].write(result.leaves, spans1[s], spans2[t], mirror=mirrored and t != s)

    def handle(worker: _SpanWorker, s: int) -> int:
        source = worker.source
        one = worker.prepared(1, s, spans1[s], keep=source.reuses_prepared())
        for t in partners(s):
            two = one if (same_spans and t == s and source.reuses_prepared()) else worker.prepared(2, t, spans2[t], keep=True)
            with serialised(source.thread_safe):
                result = Flat.of(source.contract(one, two))
            write(source, result, s, t)
        return len(partners(s))

    tasks = job.owned(list(range(len(spans1))))
    serve(workers, tasks, handle, progress=job.progress, total=sum(len(partners(s)) for s in tasks), description="kernel blocks")
    if "output" not in state:  # this rank owns no span: it contributes zeros of the right shapes
        with serialised(first.thread_safe):
            two = probe if first.reuses_prepared() else first.prepare(2, (0, min(unit, n2)))
            result = Flat.of(first.contract(probe, two))
        return result, KernelOutput(result.leaves, first.leaf_layouts(), n1, n2, job.store_device, job.pin_memory)
    return state["tree"], state["output"]


# -- one kernel-function call per block ----------------------------------------------------------


def run_blocks(
    job: Job, n1: int, n2: int, mirrored: bool, compute: Callable[[Callable, torch.device, Run, Optional[Run]], Any]
) -> tuple[Flat, KernelOutput]:
    """Computes the kernel with ``compute(function, device, run1, run2)`` per block (``run2=None``:
    the x1 run with itself, x2 None). Returns the result's tree and the filled output."""
    rows = runs(n1, job.block_size or max(1, math.ceil(n1 / (len(job.devices) * job.world_size))))
    columns = runs(n2, job.block_size or n2)
    first = Flat.of(compute(job.functions[0], job.devices[0], rows[0], None if mirrored else columns[0]))
    layouts = [(_layout(job.spec, leaf), 0) for leaf in first.leaves]
    kind = batch_axis_kinds(layouts, job.spec.trace_axes, job.spec.diagonal_axes)
    job.check_pairs(kind, n1, n2)
    first_is_block = mirrored or kind == "kept" or columns[0] == rows[0]
    if mirrored or kind != "kept":
        columns = rows
    if kind != "kept":
        blocks = [(i, i) for i in range(len(rows))]
    else:
        blocks = [(i, j) for i in range(len(rows)) for j in range(i if mirrored else 0, len(columns))]
    owned = job.owned(blocks)
    output = KernelOutput(first.leaves, layouts, n1, n2, job.store_device, job.pin_memory)
    if (0, 0) in owned and first_is_block:
        output.write(first.leaves, rows[0], columns[0], mirror=False)
        owned.remove((0, 0))

    def handle(worker: tuple, block: tuple[int, int]) -> int:
        function, device = worker
        i, j = block
        result = Flat.of(compute(function, device, rows[i], None if (mirrored and i == j) else columns[j]))
        output.write(result.leaves, rows[i], columns[j], mirror=mirrored and i != j)
        return 1

    serve(list(zip(job.functions, job.devices)), owned, handle, progress=job.progress, total=len(owned), description="kernel blocks")
    return first, output


def _layout(spec: KernelFnSpec, leaf: torch.Tensor):
    """The layout of a result leaf of ``leaf.ndim`` axes (the output has fewer, see the layout note)."""
    ndim = (leaf.ndim + 2 * len(spec.trace_axes) + len(spec.diagonal_axes)) // 2
    return make_layout(ndim, spec.trace_axes, spec.diagonal_axes, "batch", "the output")
