"""The preallocated result of a batched kernel call, written block by block.

Each result leaf has a :class:`~torchntk._layout.KernelLayout` and a batch axis (``out_axes``);
the batch axis's kind in the layout says where a block of examples ``run1 x run2`` lands:

* kept: rows ``run1`` and columns ``run2`` (and the swapped block at ``run2 x run1`` when the
  kernel is symmetric and only one of the two was computed);
* diagonal: entries ``run1`` of the single batch axis (only pairs of a run with itself exist);
* traced: the block is a mean over its examples, added with weight ``len(run1) / N``.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch

from ._blocks import index
from ._layout import KernelLayout


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
        self._places = []
        self._lock = threading.Lock()
        for leaf, (layout, axis) in zip(first_block, leaf_layouts):
            kind, positions = layout.kind(axis), layout.kernel_positions(axis)
            shape = list(leaf.shape)
            for position, size in zip(positions, (n1, n2)):
                shape[position] = size
            tensor = torch.zeros(shape, dtype=leaf.dtype, device=device, pin_memory=pin_memory)
            self.tensors.append(tensor)
            self._places.append((kind, positions, layout.swap_permutation()))

    def write(self, leaves: Sequence[torch.Tensor], run1: tuple[int, int], run2: tuple[int, int], mirror: bool) -> None:
        """Writes the block of x1 examples ``run1`` and x2 examples ``run2`` (and its mirror image)."""
        for tensor, block, (kind, positions, swap) in zip(self.tensors, leaves, self._places):
            block = block.to(tensor.device, non_blocking=True)
            if kind == "trace":
                with self._lock:
                    tensor += block * (run1[1] / self.n1)
                continue
            tensor[index(positions, run1, run2)] = block
            if mirror and kind == "kept":
                tensor[index(positions, run2, run1)] = block.permute(swap)
