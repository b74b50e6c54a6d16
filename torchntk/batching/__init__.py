"""Kernels assembled from blocks of examples, on one device or several.

NOTE: [Batching]
``batch(kernel_fn, batch_size, ...)`` computes ``kernel_fn(x1, x2, ...)`` in blocks of at most
``batch_size`` examples of x1 and x2 (the last block may be shorter: sizes need not divide ``N1``
or ``N2``), writing each block into one preallocated output per kernel leaf (see
``batching/_output.py``). Kernel functions built with ``vmap_axes`` are computed from prepared
spans of examples, which prepares each example's derivatives about once instead of once per
block; others are called once per block (NOTE: [Spans and blocks] in ``batching/_jobs.py``).
Work goes to one worker per device. Workers on the module's own device share the kernel function
(each evaluation runs on a private shell of the module, NOTE: [Threads]); a worker on another
device gets a replica of the module there, made once per batched function, refreshed from the
module at every call, and rebuilt whenever anything but tensor values changed. The values do not depend
on which device computes which block. The output may be the caller's arrays, with a progress record
to resume from (NOTE: [Kernels on disk] in ``batching/_disk.py``), and under ``torch.distributed``
each rank may keep only its rows (NOTE: [Row shards] in ``_layout/runs.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from .._implementations.memory import result_bytes
from .._kernel.block_source import BlockRequest, BlockSource
from .._kernel.kernel_function import KernelFnSpec, KernelFunction, spec_of, sync_replica
from .._kernel.block_source import FORWARD_RUN
from .._memory import NEEDS_BLOCKS, CallerPlan, memory_argument, resolve_budget
from .._model.fingerprint import structure_fingerprint
from .._utils import checks as _checks
from .._utils.threads import serialised
from .._utils.tree import Flat, is_all_none
from .._utils.types import PyTree
from ..distributed import DEFAULT_TIMEOUT, KernelShard, all_reduce_sum, checkpoint, failure_guard, world
from ._devices import asynchronous_copy, device_count_argument, devices_argument, move, pinned, resolve
from ._disk import ProgressRecord, assign_whole, fingerprint, match_out, out_leaves
from ._jobs import SPAN_ENTRIES, Job, by_entries, run_blocks, run_spans
from ._output import batch_axis_kinds
from ._plan import SpanPlan, plan_spans, worker_budget

__all__ = ["batch"]

_NOT_SPLIT = ("params", "get")
DEFAULT_CACHE_BYTES = 2**30
@dataclass(frozen=True)
class _Empty:
    """What the ways of computing return for a side without examples: the kernel function is called."""

    n1: int


def batch(
    kernel_fn: Callable[..., PyTree],
    batch_size: Union[int, str] = "auto",
    device_count: int = -1,
    store_on_device: bool = True,
    *,
    devices: Optional[list] = None,
    progress: bool = False,
    distributed: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    cache_bytes: Optional[int] = None,
    memory: Union[None, int, float, str] = None,
) -> KernelFunction:
    """Returns ``kernel_fn`` computed block by block, on one or several devices.

    Args:
        kernel_fn: a kernel function of this library (from :func:`~torchntk.empirical_ntk_fn`,
            :func:`~torchntk.empirical_nngp_fn` or :func:`~torchntk.empirical_kernel_fn`). Built
            with ``vmap_axes``, the examples are cut along the axes ``vmap_axes`` names and each
            example's derivatives are prepared about once (see ``cache_bytes``); without, the
            kernel function is called per block and inputs are cut along axis 0 of every leaf,
            which must then be the batch axis of the inputs and of the outputs.
        batch_size: ``"auto"``: blocks and cache chosen within ``memory`` (one call of
            ``kernel_fn`` when that fits; NOTE: [Automatic tiling] in ``batching/_plan.py``); an
            int: at most this many examples of x1 and of x2 per block, ``0`` meaning one block
            (or one share per device when there are several). Need not divide the batch sizes.
            With ``vmap_axes`` it is the unit of the tiling: the work runs on spans of whole
            blocks, as many as ``cache_bytes`` allows (``cache_bytes=0``: one block per span).
            Default: ``"auto"``, which never needs a guess: an int that is too large runs out of
            memory, one too small is slow.
        device_count: ``-1``: every CUDA device (the inputs' device when there is none); ``0``:
            the inputs' device only; ``k``: the first ``k`` CUDA devices. Default: ``-1``.
        store_on_device: keep the result on the first device (``True``) or in host memory
            (``False``, pinned when blocks run on CUDA), also with ``batch_size=0``. Default:
            ``True``.
        devices: an explicit list of devices, e.g. ``["cuda:0", "cuda:1"]``; repeating
            ``"cpu"`` runs several CPU workers (useful to test multi-device code without GPUs).
            Give either this or ``device_count``. Default: ``None``.
        progress: show a progress bar (tqdm) counting kernel entries, so its rate is entries per
            second. Default: ``False``.
        distributed: ``"auto"``: when a ``torch.distributed`` process group of several ranks is
            initialised, the work is shared out round-robin across the ranks and summed with one
            all-reduce, so every rank returns the whole kernel, equal to one process's up to
            rounding; ``"shard"``: each rank computes and keeps only its own rows and returns a
            :class:`~torchntk.distributed.KernelShard` (also without a process group: then the
            whole kernel); ``"off"``: every rank computes everything. Default: ``"auto"``.
        timeout: seconds (or a ``datetime.timedelta``) a rank waits for the others at the
            all-reduce before raising (see ``torchntk.distributed``); positive and finite. Default: 300.
        cache_bytes: per worker, the memory for prepared derivatives (Jacobians, structured
            factors) when ``kernel_fn`` has ``vmap_axes``: spans of several blocks are prepared
            at once in half of it, and prepared x2 spans are kept for reuse in the other half.
            ``0`` prepares every block on its own (peak memory set by ``batch_size`` alone, as
            in neural-tangents, but each example's derivatives are recomputed for every block).
            None: 1 GiB with an int ``batch_size``; with ``"auto"``, what the budget leaves (an
            int then caps it). Default: None.
        memory: the memory budget of each device, as for :func:`~torchntk.empirical_ntk_fn`
            (bytes, ``"8GB"``, ``math.inf``, or None: half the available RAM, 80% of a GPU's free
            memory, measured at each call). ``"auto"`` plans within it; the kernel functions
            ``batch`` calls plan within their worker's share of it. Default: None.

    Returns:
        A function with ``kernel_fn``'s signature and results, and two more keyword arguments:
        ``out`` (arrays to write the kernel into, returned filled: a NumPy array or memmap, a
        tensor, a zarr array, one per result leaf in a pytree like the result) and
        ``progress_file`` (a path: record finished blocks there and resume from it; needs
        ``out``), see NOTE: [Kernels on disk] in ``batching/_disk.py``. Tensor 2-tuples in keyword
        arguments are cut with x1 and x2 like the inputs; other arguments (``get``, ``params``,
        single tensors) go to every block, copied to each device once per call.

    Raises:
        TypeError: a ``kernel_fn`` not from this library; arguments of the wrong type; at call
            time, a keyword argument of ``batch`` itself (``progress=True``) that the model does
            not name.
        KernelMemoryError: (a MemoryError) at call time, before the work: the result alone (without
            ``out``) exceeds the budget of the device that keeps it, or one example's spans exceed
            a worker's share; the message says what to do (``out=``, ``memory=``, ...).
        ValueError: a negative ``batch_size`` or ``cache_bytes``, a string ``batch_size`` other than
            ``"auto"``, a ``memory`` that is no amount of memory, a ``device_count`` below -1 or above the CUDA
            devices present, a device that does not exist, both ``devices`` and
            ``device_count``; at call time, input leaves with different batch sizes, a traced or
            diagonal batch axis with x1 and x2 of different sizes, tensor 2-tuples whose halves
            do not match x1 and x2; an ``out`` whose shape, dtype or structure is not the
            kernel's, a ``progress_file`` of another problem or without ``out``, ``out`` under
            ``distributed="auto"`` with several ranks, ``"shard"`` with a traced batch axis.

    Example:
        >>> import torch, torchntk
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
        >>> x1, x2 = torch.randn(7, 3), torch.randn(5, 3)
        >>> batched = torchntk.batch(ntk_fn, batch_size=3, devices=["cpu", "cpu"])
        >>> torch.allclose(batched(x1, x2), ntk_fn(x1, x2), atol=1e-6)
        True
    """
    where = "batch"
    spec = spec_of(kernel_fn)
    if spec is None:
        raise TypeError(
            f"{where}: `kernel_fn` must be a kernel function of torchntk (empirical_ntk_fn, "
            f"empirical_nngp_fn or empirical_kernel_fn), got {_checks.show(kernel_fn)}."
        )
    if isinstance(batch_size, str):
        if batch_size != "auto":
            raise ValueError(
                f"{where}: `batch_size` must be 'auto' or a non-negative int, got {_checks.show(batch_size)}."
            )
    else:
        batch_size = _checks.non_negative_int_argument(batch_size, "batch_size", where, zero_means="one block")
    budget = memory_argument(memory, where)
    if cache_bytes is not None:
        _checks.non_negative_int_argument(cache_bytes, "cache_bytes", where, zero_means="no cache")
    count = device_count_argument(device_count, where)
    chosen = devices_argument(devices, where)
    if chosen is not None and count != -1:
        raise ValueError(f"{where}: give either `devices` or `device_count`, not both (got {count} and {devices}).")
    if distributed not in ("auto", "off", "shard"):
        raise ValueError(f"{where}: `distributed` must be 'auto', 'shard' or 'off', got {_checks.show(distributed)}.")
    plan = _Settings(
        kernel_fn, spec, batch_size if batch_size == "auto" else int(batch_size), count, chosen,
        _checks.bool_argument(store_on_device, "store_on_device", where),
        _checks.bool_argument(progress, "progress", where),
        distributed != "off",
        _checks.timeout_argument(timeout, where),
        cache_bytes if cache_bytes is not None else (None if batch_size == "auto" else DEFAULT_CACHE_BYTES),
        distributed == "shard",
        memory=budget,
    )

    def batched(
        x1: PyTree, x2: Optional[PyTree] = None, *args: Any, out: Any = None, progress_file: Any = None, **kwargs: Any
    ) -> PyTree:
        _refuse_batch_keywords(kwargs, spec.f)
        with plan.lock:  # the replicas serve one call at a time
            return _run(plan, x1, x2, args, kwargs, out, progress_file)

    def rebuild(model: Any) -> KernelFunction:
        return batch(
            spec.rebuild(model), batch_size, device_count, store_on_device, devices=devices, progress=progress,
            distributed=distributed, timeout=timeout, cache_bytes=cache_bytes, memory=memory,
        )

    batched_spec = KernelFnSpec(
        spec.kind, spec.f, spec.trace_axes, spec.diagonal_axes, rebuild, spec.thread_safe, options=spec.options
    )
    result = KernelFunction(batched, batched_spec, kernel_fn.__doc__, kernel_fn.auto_choice)
    result._batch_settings = plan  # for tests (_settings_of)
    return result


_BATCH_KEYWORDS = tuple(inspect.signature(batch).parameters)
"""``batch``'s own arguments: given to the function it returns, they are a mistake, not the model's."""


def _refuse_batch_keywords(kwargs: dict, model: Any) -> None:
    """``TypeError`` for a keyword argument of the batched call that belongs to ``batch(...)``.

    Keyword arguments of the call go to the model, which would fail on ``progress=True`` deep
    inside the first block with a message about ``forward()``; a model that names the keyword
    itself (``forward(self, x, timeout=...)``) still receives it.
    """
    for name in _BATCH_KEYWORDS:
        if name in kwargs and not _names_keyword(model, name):
            raise TypeError(
                f"batch: `{name}` ({_checks.show(kwargs[name])}) is an argument of batch(...), not of the "
                f"batched kernel function it returns (whose keyword arguments go to the model, which takes "
                f"no `{name}`): pass it as torchntk.batch(kernel_fn, ..., {name}=...)."
            )


def _names_keyword(model: Any, name: str) -> bool:
    """Whether ``model`` (its ``forward`` for a module) has a parameter ``name`` it takes by keyword."""
    try:
        signature = inspect.signature(model.forward if isinstance(model, torch.nn.Module) else model)
    except (TypeError, ValueError):  # no signature to read: assume the model does not take it
        return False
    parameter = signature.parameters.get(name)
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return parameter is not None and parameter.kind in keyword


@dataclass
class _Settings:
    kernel_fn: Callable[..., PyTree]
    spec: KernelFnSpec
    batch_size: Union[int, str]  # or "auto" (NOTE: [Automatic tiling])
    device_count: int
    devices: Optional[tuple[torch.device, ...]]
    store_on_device: bool
    progress: bool
    share_blocks: bool
    timeout: float
    cache_bytes: Optional[float]  # None with "auto": what the budget leaves
    shard: bool = False
    memory: Optional[float] = None  # NOTE: [Memory budgets], per device
    replicas: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def auto(self) -> bool:
        return self.batch_size == "auto"

    def functions(self, devices: tuple[torch.device, ...]) -> list[Callable[..., PyTree]]:
        """One kernel function per device: the original on the model's own device (every worker
        there shares it: calls never share module state, NOTE: [Threads]); elsewhere a replica
        per device, refreshed from the module at every call and rebuilt whenever anything but
        tensor values changed (``_model/fingerprint.py``)."""
        home = _model_device(self.spec)
        elsewhere = {device for device in devices if home is not None and home != device}
        fingerprint = structure_fingerprint(self.spec.f) if elsewhere else None
        replicas = {device: self._replica(device, fingerprint) for device in elsewhere}
        return [replicas.get(device, self.kernel_fn) for device in devices]

    def _replica(self, device: torch.device, fingerprint: tuple) -> Callable[..., PyTree]:
        """The replica on ``device``, refreshed, or rebuilt when the module's structure changed."""
        replica, made_from = self.replicas.get(device, (None, None))
        if replica is None or made_from != fingerprint or not sync_replica(self.spec.f, spec_of(replica).f):
            replica = self.spec.replicate(device)
            self.replicas[device] = (replica, fingerprint)
        return replica


def _settings_of(batched: Callable[..., PyTree]) -> _Settings:
    """The settings (and replicas) behind a function returned by :func:`batch` (for tests)."""
    return batched._batch_settings  # type: ignore[attr-defined]


def _batch_size_of(flat: Flat, name: str) -> int:
    sizes = {leaf.shape[0] if isinstance(leaf, torch.Tensor) and leaf.ndim else None for leaf in flat.leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"batch: every leaf of `{name}` must be a tensor with the batch on axis 0 and the same batch "
            f"size, got sizes {sorted(map(str, sizes))}."
        )
    return sizes.pop()


def _run(settings: _Settings, x1: Any, x2: Any, args: tuple, kwargs: dict, out: Any, progress_file: Any) -> PyTree:
    reuse = is_all_none(x2)
    inputs_device = Flat.of(x1).leaves[0].device
    devices = resolve(settings.device_count, settings.devices, inputs_device, "batch")
    rank, world_size = world() if settings.share_blocks else (0, 1)
    if progress_file is not None and out is None:
        raise ValueError(
            f"batch: `progress_file` ({_checks.show(progress_file)}) needs `out`, the arrays the blocks are "
            f"written to and resumed from (e.g. a np.memmap)."
        )
    if out is not None and world_size > 1 and not settings.shard:
        raise ValueError(
            f"batch: `out` under torch.distributed (rank {rank} of {world_size}) needs distributed='shard', "
            f"where each rank writes its own rows (into one shared file, or its own); with "
            f"distributed='auto' the ranks' blocks would only meet in an all-reduce of tensors."
        )
    plain = out is None and not settings.shard
    if plain and settings.batch_size == 0 and len(devices) == 1 and world_size == 1:
        return _finish(settings.kernel_fn(x1, x2, *args, **kwargs), settings.store_on_device)
    if plain and settings.auto and len(devices) == 1 and world_size == 1 and _pairs(x1, x2) <= SPAN_ENTRIES:
        # NOTE: [Automatic tiling], step 1: the whole call where its plan needs no blocks
        whole = _within(settings.kernel_fn, CallerPlan(resolve_budget(settings.memory, devices[0]), chunking=False))
        result = whole(x1, x2, *args, **kwargs)
        if result is not NEEDS_BLOCKS:
            return _finish(result, settings.store_on_device)
        # else planned below, by spans
    record = None
    if progress_file is not None:
        shard = [rank, world_size] if settings.shard else None
        problem = fingerprint(settings.spec, (x1, x2, args, kwargs), settings.batch_size, shard)
        problem["out"] = [[list(leaf.shape), str(leaf.dtype)] for leaf in out_leaves(out)]
        record = ProgressRecord.open(progress_file, problem)
    if any(device.type == "cuda" for device in devices):  # copies to the devices run asynchronously from pinned memory
        x1, x2, args, kwargs = pinned((x1, x2, args, kwargs))
    functions = settings.functions(devices)
    store_device = devices[0] if settings.store_on_device else torch.device("cpu")
    pin = store_device.type == "cpu" and any(device.type == "cuda" for device in devices)
    job = Job(settings.spec, functions, devices, 0 if settings.auto else settings.batch_size, settings.progress,
              store_device, pin, rank, world_size, settings.shard, out, record)
    guard = failure_guard(timeout=settings.timeout) if world_size > 1 else contextlib.nullcontext()
    with guard:  # an exception here reaches the other ranks at their all-reduce (or checkpoint)
        computed = _by_spans(settings, job, x1, x2, args, kwargs)
        if computed is None:
            computed = _by_blocks(settings, job, x1, None if reuse else x2, args, kwargs)
        if isinstance(computed, _Empty):  # nothing to share out
            return _empty(settings, x1, x2, args, kwargs, out, computed.n1)
        tree, output = computed
        for device in devices:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # blocks were copied out asynchronously
        leaves = output.finish()  # flushes `out` and saves the record: inside the guard, it may raise
    if settings.shard:
        if world_size > 1:  # every rank's rows are in place (one shared `out` is complete) when any returns
            checkpoint(timeout=settings.timeout)
        return KernelShard(out if out is not None else tree.rebuild(leaves), *output.rows)
    if out is not None:
        return out
    if world_size > 1:  # blocks are disjoint, so the sum over ranks assembles the kernel
        leaves = all_reduce_sum(leaves, timeout=settings.timeout)
    return tree.rebuild(leaves)


def _pairs(x1: Any, x2: Any) -> int:
    """Pairs of examples, from the leading axis of the first tensor of each input: whether one call
    of the kernel function is worth trying (NOTE: [Automatic tiling], step 1; a guess is enough)."""
    sizes = []
    for x in (x1, x1 if is_all_none(x2) else x2):
        leaves = [leaf for leaf in Flat.of(x).leaves if isinstance(leaf, torch.Tensor) and leaf.ndim]
        sizes.append(leaves[0].shape[0] if leaves else 1)
    return sizes[0] * sizes[1]


def _empty(settings: _Settings, x1: Any, x2: Any, args: tuple, kwargs: dict, out: Any, n1: int) -> PyTree:
    """The kernel function's own (entry-less) kernel, when a side has no examples (whole on every
    rank in shard mode)."""
    result = _finish(settings.kernel_fn(x1, x2, *args, **kwargs), settings.store_on_device)
    if out is not None:
        flat = Flat.of(result)
        for (_, array), leaf in zip(match_out(out, flat), flat.leaves):
            assign_whole(array, leaf)
        result = out
    if settings.shard:
        return KernelShard(result, 0, n1)
    return result


def _finish(result: PyTree, store_on_device: bool) -> PyTree:
    return result if store_on_device else move(result, torch.device("cpu"))


def _by_spans(settings: _Settings, job: Job, x1: Any, x2: Any, args: tuple, kwargs: dict):
    """The kernel from prepared spans; None where the kernel function cannot be split, ``_Empty``
    when a side has no examples."""
    if settings.spec.open_blocks is None:
        return None

    # With "auto" the blocks are not known yet: the forward passes run on FORWARD_RUN examples and
    # AUTO chooses for blocks of as many (NOTE: [Automatic tiling]).
    requested = FORWARD_RUN if settings.auto else (settings.batch_size or None)

    def open_source(function: Callable, device: torch.device):
        moved = move((x1, x2, args, kwargs), device, source_kept=True)  # on the worker's own stream
        return spec_of(function).open_blocks(BlockRequest(requested), moved[0], moved[1], *moved[2], **moved[3])

    first = open_source(job.functions[0], job.devices[0])
    if first is None:
        return None
    if 0 in first.sizes():
        return _Empty(first.sizes()[0])
    planned = None
    if settings.auto:
        plan = _span_plan(settings, job, first)
        job = dataclasses.replace(job, block_size=plan.span)
        planned = (plan.span, plan.cache)
    # a span meeting operations its plan did not foresee is prepared under a plan from every
    # example by the kernel function itself (NOTE: [Plans redone within a call])
    return run_spans(job, first, open_source, settings.cache_bytes or 0, planned)


def _span_plan(settings: _Settings, job: Job, first: BlockSource) -> SpanPlan:
    """NOTE: [Automatic tiling], steps 2 and 3, for ``job``'s workers, the same on every rank."""
    n1, n2 = first.sizes()
    keeps_result = job.out is None
    result = _result_bytes(first, job.rows(n1), n1) if keeps_result else 0.0
    budget = worker_budget(settings.memory, job.devices, result, job.store_device)
    with serialised(first.thread_safe):
        per_example = max(first.prepare(1, (0, 1)).nbytes, first.prepare(2, (0, 1)).nbytes)
    span_memory = first.span_memory or (lambda length: 3.0 * length * per_example)
    workers = len(job.devices) * (1 if job.shard else job.world_size)
    longest = min(max(n1, n2), max(1, math.ceil((job.rows(n1)[1] - job.rows(n1)[0]) / workers)))
    if batch_axis_kinds(first.leaf_layouts(), job.spec.trace_axes, job.spec.diagonal_axes) == "kept":
        longest = min(longest, by_entries(first, n1, n2, 1))
    plan = plan_spans(n1, n2, per_example, span_memory, budget, longest=longest, mirrored=first.reuses_x1,
                      cache_limit=settings.cache_bytes)
    if job.world_size > 1:  # every rank must tile alike: the smallest plan of all
        spans = torch.zeros(job.world_size, dtype=torch.float64)
        caches = torch.zeros(job.world_size, dtype=torch.float64)
        spans[job.rank], caches[job.rank] = plan.span, plan.cache
        spans, caches = all_reduce_sum((spans, caches), timeout=settings.timeout)
        plan = dataclasses.replace(plan, span=int(spans.min()), cache=float(caches.min()))
    return plan


def _result_bytes(source: BlockSource, rows: tuple[int, int], n1: int) -> float:
    """The bytes of the result ``batch`` allocates: every leaf, this rank's rows of it in shard mode."""
    call = source.call
    total = 0.0
    for name in source.names:
        groups = call.kernels_of(name)
        dtypes = call.dtypes if name == "ntk" else call.output_dtypes
        total += result_bytes(call.kernel_shapes(), dtypes, groups)
    return total * (rows[1] - rows[0]) / max(1, n1)


def _by_blocks(settings: _Settings, job: Job, x1: Any, x2: Any, args: tuple, kwargs: dict):
    """The kernel from one kernel-function call per block, or ``_Empty`` when a side is empty."""
    flat1 = Flat.of(x1)
    flat2 = flat1 if x2 is None else Flat.of(x2)
    n1, n2 = _batch_size_of(flat1, "x1"), _batch_size_of(flat2, "x2")
    if n1 == 0 or n2 == 0:
        return _Empty(n1)
    # Moved here, in the calling thread, on the streams every worker's stream starts after.
    moved_args = {device: move(args, device, source_kept=True) for device in set(job.devices)}

    # NOTE: [Automatic tiling], step 4: one share of the rows per worker, planned by the kernel function
    shares = None
    if settings.auto:
        shares = {device: resolve_budget(settings.memory, device) / job.devices.count(device) for device in job.devices}

    def compute(function: Callable, device: torch.device, run1, run2) -> PyTree:
        one = _slice(flat1, *run1, device)
        two = None if run2 is None else _slice(flat2, *run2, device)
        cut = {key: _cut(key, value, run1, run2 or run1, n1, n2, device) for key, value in kwargs.items()}
        if shares is not None:
            function = _within(function, CallerPlan(shares[device]))
        return function(one, two, *moved_args[device], **cut)  # takes the forward-mode lock itself

    return run_blocks(job, n1, n2, x2 is None, compute)


def _within(function: Callable[..., PyTree], caller: CallerPlan) -> Callable[..., Any]:
    """``function`` planning within ``caller``'s budget (NOTE: [Budgets of callers]); a kernel
    function that plans no memory (``spec.within`` None) as it is: it never needs blocks."""
    within = spec_of(function).within
    return function if within is None else within(caller)


def _cut(key: str, value: Any, run1, run2, n1: int, n2: int, device: torch.device) -> Any:
    """A keyword argument for one block: tensor 2-tuples are cut like x1 and x2."""
    if key in _NOT_SPLIT or not (isinstance(value, tuple) and len(value) == 2):
        return move(value, device, source_kept=True)
    halves = []
    for half, (start, length), size, name in ((value[0], run1, n1, "x1"), (value[1], run2, n2, "x2")):
        flat = Flat.of(half)
        if any(isinstance(leaf, torch.Tensor) and (leaf.ndim == 0 or leaf.shape[0] != size) for leaf in flat.leaves):
            raise ValueError(
                f"batch: keyword argument `{key}` is a 2-tuple, so it is cut like x1 and x2, but a "
                f"tensor in its {name} half does not have {size} examples on axis 0. Pass a single "
                f"tensor to give it whole to every block."
            )
        halves.append(_slice(flat, start, length, device))
    return tuple(halves)


def _model_device(spec: KernelFnSpec) -> Optional[torch.device]:
    if not isinstance(spec.f, torch.nn.Module):
        return None
    for tensor in list(spec.f.parameters()) + list(spec.f.buffers()):
        return tensor.device
    return None


def _slice(flat: Flat, start: int, length: int, device: torch.device) -> Any:
    # The inputs are the caller's or their pinned copies, which nothing writes to during the call.
    return flat.rebuild([
        leaf.narrow(0, start, length).to(device, non_blocking=asynchronous_copy(leaf.device, device, source_kept=True))
        for leaf in flat.leaves
    ])

