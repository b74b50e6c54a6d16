"""Where a block of examples goes in a kernel: the one tiler of the library.

NOTE: [Tiles]
Kernels are computed in blocks. The examples of x1 and of x2 are cut into *runs*
(``(start, length)``, see ``runs.py``); a pair of runs gives one *block* per output leaf.
A block lands where the :class:`~torchntk._layout.kernel_layout.KernelLayout` puts the batch axis, by its kind:

* kept: at rows ``run1`` and columns ``run2``; when the kernel is symmetric (x2 None) and only
  the pair ``(run1, run2)`` was computed, its mirror image (every x1/x2 axis pair swapped) goes to
  ``(run2, run1)``;
* diagonal: at entries ``run1`` of the single batch axis (only a run paired with itself exists);
* traced: added into the whole kernel, with a weight when the blocks are means over their runs.

``chunk_size`` (``_call/blocks.assemble``), ``batch`` (``batching/_output.KernelOutput``) and structured
derivatives' symmetric halves (``structured/_contract.py``) all place blocks through
:class:`Placement`.

The words, everywhere in the library: a *run* is consecutive examples of one side; a *block* is
what a pair of runs gives; ``chunk_size`` and ``batch_size`` are the run lengths users choose.
``batch`` prepares a *span* at a time: a run of whole ``batch_size`` runs whose derivatives are
prepared once and contracted with every other span (NOTE: [Spans and blocks] in
``batching/_jobs.py``), so a pair of spans writes many blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from .kernel_layout import KernelLayout
from .runs import Run

_MIRROR_TILE = 512
"""Examples per side of the tiles a mirror image is copied in."""


@dataclass(frozen=True)
class Placement:
    """Where the blocks of one output leaf go, given the batch axis of that leaf.

    Attributes:
        kind: ``"kept"``, ``"diagonal"`` or ``"trace"``: the batch axis's kind in the layout.
        positions: the kernel axes of the batch axis (two when kept: x1 then x2; one when diagonal).
        swap: the permutation exchanging every x1 axis with its x2 axis (for mirror images).

    Example:
        >>> from torchntk._layout.kernel_layout import make_layout
        >>> layout = make_layout(2, (-1,), (), "example", "the output")  # traced logits: (N1, N2)
        >>> placement = Placement.of(layout, 0)
        >>> kernel = torch.zeros(4, 4)
        >>> placement.put(kernel, torch.ones(2, 2), (0, 2), (2, 2), mirror=True)
        >>> kernel.sum().item(), kernel[2:, :2].sum().item()
        (8.0, 4.0)
    """

    kind: str
    positions: tuple[int, ...]
    swap: tuple[int, ...]

    @classmethod
    def of(cls, layout: KernelLayout, batch_axis: int) -> "Placement":
        positions = tuple(layout.kernel_positions(batch_axis))
        return cls(layout.kind(batch_axis), positions, tuple(layout.swap_permutation()))

    def index(self, run1: Run, run2: Run, row_offset: int = 0) -> tuple:
        """The kernel index of the block of ``run1`` x ``run2`` (kept or diagonal batch axes), in a
        kernel holding the x1 examples from ``row_offset`` on (a shard of rows)."""
        index: list[Any] = [slice(None)] * (self.positions[-1] + 1)
        index[self.positions[0]] = slice(run1[0] - row_offset, run1[0] - row_offset + run1[1])
        if len(self.positions) == 2:
            index[self.positions[1]] = slice(run2[0], run2[0] + run2[1])
        return tuple(index)

    def put(
        self, kernel: torch.Tensor, block: torch.Tensor, run1: Run, run2: Run, mirror: bool = False,
        weight: Optional[float] = None, row_offset: int = 0,
    ) -> None:
        """Writes ``block`` (or adds it, weighted, for a traced batch axis) into ``kernel``; with
        ``mirror``, also its mirror image at ``(run2, run1)`` (kept batch axes, ``run1 != run2``).

        ``kernel`` may also be any array supporting slice assignment (a NumPy memmap, a zarr array)
        when ``block`` is a NumPy array; ``row_offset`` is the first x1 example ``kernel`` holds."""
        if self.kind == "trace":
            kernel += block if weight is None else block * weight
            return
        kernel[self.index(run1, run2, row_offset)] = block
        if mirror and self.kind == "kept" and run1 != run2:
            image = block.permute(self.swap) if isinstance(block, torch.Tensor) else block.transpose(self.swap)
            if not isinstance(kernel, (torch.Tensor, np.ndarray)):  # a store: one write, its own chunking
                kernel[self.index(run2, run1, row_offset)] = image
                return
            # A transposed copy walks one side with a large stride; square tiles keep both sides in
            # cache (3x faster for 2000 x 2000 float32 blocks).
            for start2 in range(0, run2[1], _MIRROR_TILE):
                for start1 in range(0, run1[1], _MIRROR_TILE):
                    part2 = (run2[0] + start2, min(_MIRROR_TILE, run2[1] - start2))
                    part1 = (run1[0] + start1, min(_MIRROR_TILE, run1[1] - start1))
                    source = self.index((start2, part2[1]), (start1, part1[1]))
                    kernel[self.index(part2, part1, row_offset)] = image[source]
