"""Kernels assembled from blocks of examples, on one device or several.

NOTE: [Batching]
``batch(kernel_fn, batch_size, ...)`` cuts x1 and x2 along axis 0 into runs of at most
``batch_size`` examples (the last run may be shorter: sizes need not divide ``N1`` or ``N2``) and
computes the kernel of every pair of runs with ``kernel_fn``, writing each block into one
preallocated output per kernel leaf at the place the batch axis takes in the kernel layout:

* batch axis kept (the usual case): block ``(i, j)`` fills rows ``i`` and columns ``j``;
* batch axis diagonal: only blocks ``(i, i)``, written along the single batch axis;
* batch axis traced: only blocks ``(i, i)``, averaged with weights ``len(run_i) / N``.

With ``x2=None`` only blocks with ``i <= j`` are computed; block ``(j, i)`` is block ``(i, j)``
with every x1/x2 axis pair swapped, and diagonal blocks are computed with ``x2=None`` so the
kernel function reuses its x1 work. Blocks are handed to one worker thread per device from a
shared queue; every worker has its own copy of the model (``functional_call`` swaps a module's
tensors while it runs, so threads must never share one). The values do not depend on which
device computes which block.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from tqdm.auto import tqdm

from . import _checks
from ._devices import device_count_argument, devices_argument, resolve
from ._kernel_spec import KernelFnSpec, attach, spec_of
from ._layout import make_layout
from ._tree import Flat, is_all_none
from ._types import PyTree
from .distributed import DEFAULT_TIMEOUT, all_reduce_sum, failure_guard, world

_NOT_SPLIT = ("params", "get")
_FORWARD_MODE_LOCK = threading.Lock()


def batch(
    kernel_fn: Callable[..., PyTree],
    batch_size: int = 0,
    device_count: int = -1,
    store_on_device: bool = True,
    *,
    devices: Optional[list] = None,
    progress: bool = False,
    distributed: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
) -> Callable[..., PyTree]:
    """Returns ``kernel_fn`` computed block by block, on one or several devices.

    Args:
        kernel_fn: a kernel function of this library (from :func:`~torchntk.empirical_ntk_fn`,
            :func:`~torchntk.empirical_nngp_fn` or :func:`~torchntk.empirical_kernel_fn`). Inputs
            are cut along axis 0 of every leaf, so that must be the batch axis of the inputs and
            of the outputs.
        batch_size: at most this many examples of x1 and of x2 per block; ``0`` means one block
            (or one row slab per device when there are several). Need not divide the batch sizes.
            Default: ``0``.
        device_count: ``-1``: every CUDA device (the inputs' device when there is none); ``0``:
            the inputs' device only; ``k``: the first ``k`` CUDA devices. Default: ``-1``.
        store_on_device: keep the result on the first device (``True``) or in host memory
            (``False``, pinned when blocks run on CUDA), also with ``batch_size=0``. Default:
            ``True``.
        devices: an explicit list of devices, e.g. ``["cuda:0", "cuda:1"]``; repeating
            ``"cpu"`` runs several CPU workers (useful to test multi-device code without GPUs).
            Give either this or ``device_count``. Default: ``None``.
        progress: show a progress bar over blocks (tqdm). Default: ``False``.
        distributed: ``"auto"``: when a ``torch.distributed`` process group of several ranks is
            initialised, the blocks are shared out round-robin across the ranks and summed with
            one all-reduce, so every rank returns the whole kernel, bitwise equal to one
            process's; ``"off"``: every rank computes every block. Default: ``"auto"``.
        timeout: seconds a rank waits for the others at the all-reduce before raising (see
            ``torchntk.distributed``). Default: 300.

    Returns:
        A function with ``kernel_fn``'s signature and results. Tensor 2-tuples in keyword
        arguments are cut with x1 and x2 like the inputs; other arguments (``get``, ``params``,
        single tensors) go to every block, copied to each device once per call.

    Raises:
        TypeError: a ``kernel_fn`` not from this library; arguments of the wrong type.
        ValueError: a negative ``batch_size``, a ``device_count`` below -1 or above the CUDA
            devices present, a device that does not exist, both ``devices`` and
            ``device_count``; at call time, input leaves with different batch sizes, a traced or
            diagonal batch axis with x1 and x2 of different sizes, tensor 2-tuples whose halves
            do not match x1 and x2.

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
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral):
        raise TypeError(f"{where}: `batch_size` must be a non-negative int, got {_checks.show(batch_size)}.")
    if batch_size < 0:
        raise ValueError(f"{where}: `batch_size` must be 0 (one block) or positive, got {batch_size}.")
    count = device_count_argument(device_count, where)
    chosen = devices_argument(devices, where)
    if chosen is not None and count != -1:
        raise ValueError(f"{where}: give either `devices` or `device_count`, not both (got {count} and {devices}).")
    if distributed not in ("auto", "off"):
        raise ValueError(f"{where}: `distributed` must be 'auto' or 'off', got {_checks.show(distributed)}.")
    plan = _Settings(
        kernel_fn, spec, int(batch_size), count, chosen,
        _checks.bool_argument(store_on_device, "store_on_device", where),
        _checks.bool_argument(progress, "progress", where),
        distributed == "auto",
        _checks.timeout_argument(timeout, where),
    )

    def batched(x1: PyTree, x2: Optional[PyTree] = None, *args: Any, **kwargs: Any) -> PyTree:
        return _run(plan, x1, x2, args, kwargs)

    batched.__doc__ = kernel_fn.__doc__
    return attach(batched, KernelFnSpec(
        spec.kind, spec.f, spec.trace_axes, spec.diagonal_axes,
        lambda model: batch(
            spec.rebuild(model), batch_size, device_count, store_on_device, devices=devices, progress=progress,
            distributed=distributed, timeout=timeout,
        ),
        spec.thread_safe,
    ))


@dataclass(frozen=True)
class _Settings:
    kernel_fn: Callable[..., PyTree]
    spec: KernelFnSpec
    batch_size: int
    device_count: int
    devices: Optional[tuple[torch.device, ...]]
    store_on_device: bool
    progress: bool
    share_blocks: bool
    timeout: float


def _runs(size: int, length: int) -> list[tuple[int, int]]:
    return [(start, min(length, size - start)) for start in range(0, size, max(length, 1))]


def _batch_size_of(flat: Flat, name: str) -> int:
    sizes = {leaf.shape[0] if isinstance(leaf, torch.Tensor) and leaf.ndim else None for leaf in flat.leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"batch: every leaf of `{name}` must be a tensor with the batch on axis 0 and the same batch "
            f"size, got sizes {sorted(map(str, sizes))}."
        )
    return sizes.pop()


def _run(settings: _Settings, x1: Any, x2: Any, args: tuple, kwargs: dict) -> PyTree:
    flat1 = Flat.of(x1)
    reuse = is_all_none(x2)
    flat2 = flat1 if reuse else Flat.of(x2)
    n1, n2 = _batch_size_of(flat1, "x1"), _batch_size_of(flat2, "x2")
    inputs_device = flat1.leaves[0].device
    devices = resolve(settings.device_count, settings.devices, inputs_device, "batch")
    rows = settings.batch_size or max(1, math.ceil(n1 / len(devices)))
    columns = settings.batch_size or n2
    if n1 == 0 or n2 == 0 or (rows >= n1 and columns >= n2 and len(devices) == 1):
        result = settings.kernel_fn(x1, x2, *args, **kwargs)
        return result if settings.store_on_device else _move(result, torch.device("cpu"))
    job = _Job(settings, flat1, flat2, reuse, n1, n2, rows, columns, devices, args, kwargs)
    return job.run()


class _Job:
    """One call of a batched kernel function: the blocks, the workers and the output."""

    def __init__(self, settings, flat1, flat2, reuse, n1, n2, rows, columns, devices, args, kwargs):
        self.settings, self.flat1, self.flat2, self.reuse = settings, flat1, flat2, reuse
        self.n1, self.n2, self.devices, self.args, self.kwargs = n1, n2, devices, args, kwargs
        self._set_tiling(rows, columns)
        self.outputs: Optional[list[torch.Tensor]] = None
        self.tree: Optional[Flat] = None
        self.kinds: list[str] = []
        self.swaps: list[tuple[int, ...]] = []
        self.lock = threading.Lock()

    def _set_tiling(self, rows: int, columns: int) -> None:
        self.rows, self.columns = _runs(self.n1, rows), _runs(self.n2, columns)
        self.mirrored = self.reuse and rows == columns

    # -- blocks ------------------------------------------------------------------------------------

    def _blocks(self) -> list[tuple[int, int]]:
        if self.kinds and any(kind != "kept" for kind in self.kinds):
            return [(i, i) for i in range(len(self.rows))]
        if self.mirrored:
            return [(i, j) for i in range(len(self.rows)) for j in range(i, len(self.columns))]
        return [(i, j) for i in range(len(self.rows)) for j in range(len(self.columns))]

    def _compute(self, kernel_fn, device: torch.device, args: tuple, i: int, j: int) -> list[torch.Tensor]:
        if self.settings.spec.thread_safe:
            return self._compute_block(kernel_fn, device, args, i, j)
        with _FORWARD_MODE_LOCK:
            return self._compute_block(kernel_fn, device, args, i, j)

    def _compute_block(self, kernel_fn, device: torch.device, args: tuple, i: int, j: int) -> list[torch.Tensor]:
        start1, length1 = self.rows[i]
        start2, length2 = self.columns[j]
        x1 = _slice(self.flat1, start1, length1, device)
        same = self.mirrored and i == j
        x2 = None if same else _slice(self.flat2, start2, length2, device)
        kwargs = {key: self._cut(key, value, (start1, length1), (start2, length2), device) for key, value in self.kwargs.items()}
        result = Flat.of(kernel_fn(x1, x2, *args, **kwargs))
        if self.tree is None:
            with self.lock:
                self.tree = self.tree or result
        return list(result.leaves)

    def _cut(self, key: str, value: Any, run1, run2, device: torch.device) -> Any:
        if key in _NOT_SPLIT or not (isinstance(value, tuple) and len(value) == 2):
            return _move(value, device)
        halves = []
        for half, (start, length), size, name in ((value[0], run1, self.n1, "x1"), (value[1], run2, self.n2, "x2")):
            flat = Flat.of(half)
            if any(isinstance(leaf, torch.Tensor) and (leaf.ndim == 0 or leaf.shape[0] != size) for leaf in flat.leaves):
                raise ValueError(
                    f"batch: keyword argument `{key}` is a 2-tuple, so it is cut like x1 and x2, but a "
                    f"tensor in its {name} half does not have {size} examples on axis 0. Pass a single "
                    f"tensor to give it whole to every block."
                )
            halves.append(_slice(flat, start, length, device))
        return tuple(halves)

    # -- output ------------------------------------------------------------------------------------

    def _allocate(self, leaves: list[torch.Tensor]) -> None:
        spec = self.settings.spec
        device = self.devices[0] if self.settings.store_on_device else torch.device("cpu")
        pin = device.type == "cpu" and any(d.type == "cuda" for d in self.devices)
        self.outputs = []
        for leaf in leaves:
            ndim = (leaf.ndim + 2 * len(spec.trace_axes) + len(spec.diagonal_axes)) // 2
            layout = make_layout(ndim, spec.trace_axes, spec.diagonal_axes, "batch", "the output")
            kind = layout.kind(0)
            self.kinds.append(kind)
            self.swaps.append(layout.swap_permutation())
            rest = tuple(leaf.shape[{"kept": 2, "diagonal": 1, "trace": 0}[kind]:])
            shape = {"kept": (self.n1, self.n2), "diagonal": (self.n1,), "trace": ()}[kind] + rest
            out = torch.zeros(shape, dtype=leaf.dtype, device=device, pin_memory=pin)
            self.outputs.append(out)
        if any(kind != "kept" for kind in self.kinds) and self.n1 != self.n2:
            raise ValueError(
                f"batch: the batch axis is traced or diagonal (trace_axes={spec.trace_axes}, "
                f"diagonal_axes={spec.diagonal_axes}), which pairs example n of x1 with example n of "
                f"x2, but x1 has {self.n1} examples and x2 {self.n2}."
            )

    def _write(self, leaves: list[torch.Tensor], i: int, j: int) -> None:
        start1, length1 = self.rows[i]
        start2, length2 = self.columns[j]
        for out, block, kind, swap in zip(self.outputs, leaves, self.kinds, self.swaps):
            block = block.to(out.device, non_blocking=True)
            if kind == "kept":
                out[start1 : start1 + length1, start2 : start2 + length2] = block
                if self.mirrored and i != j:
                    out[start2 : start2 + length2, start1 : start1 + length1] = block.permute(swap)
            elif kind == "diagonal":
                out[start1 : start1 + length1] = block
            else:
                with self.lock:
                    out += block * (length1 / self.n1)

    # -- scheduling --------------------------------------------------------------------------------

    def run(self) -> PyTree:
        rank, world_size = world() if self.settings.share_blocks else (0, 1)
        guard = failure_guard(timeout=self.settings.timeout) if world_size > 1 else contextlib.nullcontext()
        with guard:  # an exception here reaches the other ranks at their all-reduce
            functions = self._functions()
            first_args = _move(self.args, self.devices[0])
            first = self._compute(functions[0], self.devices[0], first_args, 0, 0)
            self._allocate(first)
            if any(kind != "kept" for kind in self.kinds) and self.rows != self.columns:
                # Blocks must pair run i of x1 with run i of x2: cut both alike and start again.
                self._set_tiling(self.rows[0][1], self.rows[0][1])
                self.mirrored = self.reuse
                first = self._compute(functions[0], self.devices[0], first_args, 0, 0)
            self._run_owned(functions, first, rank, world_size)
        if world_size > 1:  # blocks are disjoint, so the sum over ranks assembles the kernel
            self.outputs = all_reduce_sum(self.outputs, timeout=self.settings.timeout)
        return self.tree.rebuild(self.outputs)

    def _run_owned(self, functions, first, rank: int, world_size: int) -> None:
        blocks = self._blocks()
        owned = [block for index, block in enumerate(blocks) if index % world_size == rank]
        if (0, 0) in owned:
            self._write(first, 0, 0)
        pending = [block for block in owned if block != (0, 0)]
        bar = tqdm(total=len(pending) + 1, initial=1, disable=not self.settings.progress, desc="kernel blocks")
        tasks: queue.SimpleQueue = queue.SimpleQueue()
        for block in pending:
            tasks.put(block)
        failures: list[BaseException] = []
        stop = threading.Event()

        def work(kernel_fn, device: torch.device) -> None:
            try:
                args = _move(self.args, device)
                while not stop.is_set():
                    try:
                        i, j = tasks.get_nowait()
                    except queue.Empty:
                        return
                    self._write(self._compute(kernel_fn, device, args, i, j), i, j)
                    bar.update(1)
            except BaseException as error:  # re-raised in the caller
                failures.append(error)
                stop.set()

        # The calling thread serves the first device: a second thread running torch work next to
        # it doubles the OpenMP thread pools and made small blocks ~40% slower on 2 cores.
        threads = [
            threading.Thread(target=work, args=(function, device), daemon=True)
            for function, device in list(zip(functions, self.devices))[1:]
        ]
        for thread in threads:
            thread.start()
        work(functions[0], self.devices[0])
        for thread in threads:
            thread.join()
        bar.close()
        if failures:
            raise failures[0]

    def _functions(self) -> list[Callable[..., PyTree]]:
        """One kernel function per device: the original for the model's own device, once."""
        spec = self.settings.spec
        home = _model_device(spec)
        functions, used_original = [], False
        for device in self.devices:
            if not used_original and (home is None or home == device):
                functions.append(self.settings.kernel_fn)
                used_original = True
            else:
                functions.append(spec.replicate(device))
        return functions


def _model_device(spec: KernelFnSpec) -> Optional[torch.device]:
    if not isinstance(spec.f, torch.nn.Module):
        return None
    for tensor in list(spec.f.parameters()) + list(spec.f.buffers()):
        return tensor.device
    return None


def _slice(flat: Flat, start: int, length: int, device: torch.device) -> Any:
    return flat.rebuild([leaf.narrow(0, start, length).to(device, non_blocking=True) for leaf in flat.leaves])


def _move(tree: Any, device: torch.device) -> Any:
    flat = Flat.of(tree)
    leaves = [leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf for leaf in flat.leaves]
    return flat.rebuild(leaves)
