"""The preallocated result of a batched kernel call, written block by block.

Each result leaf has a :class:`~torchntk._layout.KernelLayout` and a batch axis (``out_axes``);
a block of examples ``run1 x run2`` lands where NOTE: [Tiles] (``_tiles.py``) says; a traced
block is a mean over its examples, added with weight ``len(run1) / N``.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from ._layout import KernelLayout
from ._tiles import Placement


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


class KernelOutput:
    """One preallocated tensor per result leaf on ``device``; ``write`` puts blocks in place."""

    def __init__(
        self, first_block: Sequence[torch.Tensor], leaf_layouts: Sequence[tuple[KernelLayout, int]],
        n1: int, n2: int, device: torch.device, pin_memory: bool,
    ):
        self.n1 = n1
        self.tensors: list[torch.Tensor] = []
        self._placements: list[Placement] = []
        self._lock = threading.Lock()
        for leaf, (layout, axis) in zip(first_block, leaf_layouts):
            positions = layout.kernel_positions(axis)
            shape = list(leaf.shape)
            for position, size in zip(positions, (n1, n2)):
                shape[position] = size
            tensor = torch.zeros(shape, dtype=leaf.dtype, device=device, pin_memory=pin_memory)
            self.tensors.append(tensor)
            self._placements.append(Placement.of(layout, axis))

    def write(self, leaves: Sequence[torch.Tensor], run1: tuple[int, int], run2: tuple[int, int], mirror: bool) -> None:
        """Writes the block of x1 examples ``run1`` and x2 examples ``run2`` (and its mirror image);
        a traced block is a mean over ``run1``, added with weight ``len(run1) / N1``."""
        for tensor, block, placement in zip(self.tensors, leaves, self._placements):
            block = block.to(tensor.device, non_blocking=True)
            if placement.kind == "trace":
                with self._lock:  # blocks of several workers add into one tensor
                    placement.put(tensor, block, run1, run2, weight=run1[1] / self.n1)
                continue
            placement.put(tensor, block, run1, run2, mirror=mirror)
