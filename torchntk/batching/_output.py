"""The result of a batched kernel call, preallocated or given (``out``), written block by block.

Each result leaf has a :class:`~torchntk._layout.kernel_layout.KernelLayout` and a batch axis (``out_axes``);
a block of examples ``run1 x run2`` lands where NOTE: [Tiles] (``_layout/tiles.py``) says; a traced
block is a mean over its examples, added with weight ``len(run1) / N``. A worker's blocks come
through its lane (NOTE: [Worker streams] in ``batching/_streams.py``): into a result on a CUDA device on
the result stream, into host memory after an asynchronous copy.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Optional, Sequence

import numpy as np
import torch

from .._layout.kernel_layout import KernelLayout
from .._layout.tiles import Placement
from .._memory import KernelMemoryError, format_bytes, is_allocation_failure
from ._devices import asynchronous_copy
from ._disk import ProgressRecord, as_numpy, assign_whole, check_out_leaf, checksum, flush
from ._streams import Lane


def batch_axis_kinds(leaf_layouts: Sequence[tuple[KernelLayout, int]], trace_axes, diagonal_axes) -> str:
    """``"kept"``, ``"diagonal"`` or ``"trace"``: where the batch axis of every leaf goes.

    Raises:
        ValueError: leaves that disagree (a batch axis traced for one leaf and kept for another).
    """
    kinds = {layout.kind(axis) for layout, axis in leaf_layouts}
    if len(kinds) > 1:
        raise ValueError(
            f"batch: the output leaves put their batch axes in different places of the kernel layout "
            f"({sorted(kinds)} with trace_axes={trace_axes}, diagonal_axes={diagonal_axes}); batch "
            f"needs one kind for all leaves. Compute these leaves with separate kernel functions."
        )
    return kinds.pop()


def moved(block: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``block`` on ``device``; the CPU copies that place blocks read it at once, so only a copy
    between accelerators may return early (:func:`asynchronous_copy`)."""
    return block.to(device, non_blocking=asynchronous_copy(block.device, device))


def _allocated(shape: list[int], dtype: torch.dtype, device: torch.device, pin_memory: bool) -> torch.Tensor:
    """The zeroed result tensor of one leaf; an allocator's failure (a batch size given by the user
    plans no budget) becomes a :class:`~torchntk._memory.KernelMemoryError` with the ways out."""
    failure = None
    try:
        return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin_memory)
    except (RuntimeError, MemoryError) as error:
        if not is_allocation_failure(error):
            raise
        failure = f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
    needed = float(np.prod(shape, dtype=np.float64)) * dtype.itemsize
    raise KernelMemoryError(
        f"batch: the kernel's result of shape {tuple(shape)} ({format_bytes(needed)}, {dtype}) could not be "
        f"allocated on {device}. Write it to disk block by block with out=np.lib.format.open_memmap(...) (each "
        f"worker then holds only its blocks), trace more output axes, or keep fewer outputs or examples. "
        f"PyTorch said: {failure}",
        needed, kernel_alone=True,
    )


class KernelOutput:
    """Where the blocks go: one preallocated tensor per result leaf on ``device``, or the caller's
    arrays (``out``, NOTE: [Kernels on disk] in ``batching/_disk.py``); ``write`` puts blocks in place.

    Args:
        first_block, leaf_layouts: a block of the result (for shapes and dtypes) and every leaf's
            layout and batch axis.
        device, pin_memory: where the result tensors are allocated, and whether they are pinned
            (host memory for blocks from CUDA).
        stream: on a CUDA ``device``, the result stream (NOTE: [Worker streams]), which the
            tensors are allocated on: the calling thread's current stream of ``device``.
        rows: the x1 examples kept, ``(start, stop)`` (NOTE: [Row shards]); ``None``: all.
        out: ``(path, array)`` per leaf from :func:`~torchntk.batching._disk.match_out`, or ``None``.
            Arrays have the whole kernel's shape even when only ``rows`` are written.
        record: the progress record to tell of every block written (``out`` only).

    Raises:
        ValueError: an ``out`` leaf of the wrong shape or dtype; a ``record`` for a traced batch
            axis; an ``out`` that does not hold what ``record`` lists.
    """

    def __init__(
        self, first_block: Sequence[torch.Tensor], leaf_layouts: Sequence[tuple[KernelLayout, int]],
        n1: int, n2: int, device: torch.device, pin_memory: bool, stream: Optional[torch.cuda.Stream],
        rows: Optional[tuple[int, int]] = None, out: Optional[list] = None, record: Optional[ProgressRecord] = None,
    ):
        self.n1 = n1
        self.rows = rows or (0, n1)
        self.tensors: list[torch.Tensor] = []
        self.targets: list[Any] = []
        self._placements: list[Placement] = []
        self._lock = threading.Lock()
        self._out = out
        self._record = record
        self._row_offset = 0 if out is not None else self.rows[0]
        for index, (leaf, (layout, axis)) in enumerate(zip(first_block, leaf_layouts)):
            placement = Placement.of(layout, axis)
            shape = list(leaf.shape)
            for position, size in zip(placement.positions, (n1, n2)):
                shape[position] = size
            if placement.kind == "trace" and record is not None:
                raise ValueError(
                    "batch: `progress_file` needs a kernel with the batch axis kept or diagonal; with the "
                    f"batch axis traced (trace_axes={layout.trace_axes}) every block adds into the whole "
                    "kernel, which is small: compute it without `progress_file`."
                )
            if out is not None:
                check_out_leaf(out[index][1], shape, leaf.dtype, out[index][0])
            if out is None or placement.kind == "trace":
                if out is None and placement.kind != "trace":
                    shape[placement.positions[0]] = self.rows[1] - self.rows[0]
                with _on(stream):  # the allocator's record of the stream that uses the memory
                    tensor = _allocated(shape, leaf.dtype, device, pin_memory)
                self.tensors.append(tensor)
                self.targets.append(tensor)
            else:
                self.tensors.append(None)
                self.targets.append(out[index][1])
            self._placements.append(placement)
        if record is not None and record.done:
            record.verify(self._read_back)

    @property
    def arrays(self) -> list[Any]:
        return [] if self._out is None else [array for _, array in self._out]

    def write(
        self, leaves: Sequence[torch.Tensor], run1: tuple[int, int], run2: tuple[int, int], mirror: bool,
        lane: Optional[Lane] = None,
    ) -> None:
        """Writes the block of x1 examples ``run1`` and x2 examples ``run2`` (and its mirror image);
        a traced block is a mean over ``run1``, added with weight ``len(run1) / N1``.

        ``lane``: the worker's lane, from whose stream ``leaves`` come; ``None``: the calling
        thread's current streams, written at once. Through a CUDA lane, blocks for host memory
        are written once their copy has arrived (NOTE: [Worker streams])."""
        if lane is None:
            self._write_now(leaves, run1, run2, mirror, None)
            return
        staged = [
            block if _on_device(target) else lane.to_host(block) for target, block in zip(self.targets, leaves)
        ]
        lane.then(lambda: self._write_now(staged, run1, run2, mirror, lane))

    def _write_now(self, leaves: Sequence[torch.Tensor], run1: tuple[int, int], run2: tuple[int, int], mirror: bool,
                   lane: Optional[Lane]) -> None:
        checksums = []
        device_blocks = [block for target, block in zip(self.targets, leaves) if _on_device(target)]
        handing_over = lane.handing_over(device_blocks) if lane is not None and device_blocks else None
        with handing_over or contextlib.nullcontext():
            for target, block, placement in zip(self.targets, leaves, self._placements):
                if placement.kind == "trace":
                    with self._lock:  # blocks of several workers add into one tensor
                        placement.put(target, moved(block, target.device), run1, run2, weight=run1[1] / self.n1)
                    continue
                checksums.append(self._put(target, block, placement, run1, run2, mirror))
        if self._record is not None:
            self._record.completed(run1, run2, checksums, self.arrays)

    def _put(self, target: Any, block: torch.Tensor, placement: Placement, run1, run2, mirror: bool) -> Optional[int]:
        """Puts one kept or diagonal block in place; its checksum when a progress record is kept."""
        if isinstance(target, torch.Tensor):
            placement.put(target, moved(block, target.device), run1, run2, mirror=mirror, row_offset=self._row_offset)
            data = None
        else:
            data = as_numpy(block)
            with self._lock:  # blocks of two workers may share a chunk of a chunked store
                placement.put(target, data, run1, run2, mirror=mirror, row_offset=self._row_offset)
        if self._record is None:
            return None
        return checksum(as_numpy(block) if data is None else data)

    def finish(self) -> list[Any]:  # after every lane's writes (``serve`` ends with them)
        """The result's leaves: the kernel tensors, or ``out``'s arrays with every block in place."""
        if self._out is None:
            return self.tensors
        for index, placement in enumerate(self._placements):
            if placement.kind == "trace":
                assign_whole(self._out[index][1], self.tensors[index])
        flush(self.arrays)
        if self._record is not None:
            self._record.finish(self.arrays)
        return self.arrays

    def _read_back(self, run1: tuple[int, int], run2: tuple[int, int]) -> list[int]:
        sums = []
        for target, placement in zip(self.targets, self._placements):
            block = target[placement.index(run1, run2, self._row_offset)]
            sums.append(checksum(as_numpy(block) if isinstance(block, torch.Tensor) else np.asarray(block)))
        return sums


def _on_device(target: Any) -> bool:
    """Whether ``target`` (a result tensor or an ``out`` array) lives on a CUDA device."""
    return isinstance(target, torch.Tensor) and target.device.type == "cuda"


def _on(stream: Optional[torch.cuda.Stream]):
    """``torch.cuda.stream(stream)``, or nothing for ``None``."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
