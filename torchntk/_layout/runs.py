"""Which pairs of runs ``batch`` computes, and which rows of the kernel a process keeps.

NOTE: [Row shards]
Usually every process (rank) of a ``torch.distributed`` job fills the kernel blocks it owns
(round-robin) into a zero kernel, and one all-reduce assembles the whole kernel on every rank.
With ``distributed="shard"`` a rank instead keeps the contiguous rows :func:`shard_rows` gives it
and computes every block of those rows, so nothing of size ``N1 x N2`` exists on any rank and no
collective moves kernel data. The rows depend only on ``N1``, ``batch_size`` and the number of
ranks (never on memory or timing), so a rank can preallocate its part.

With x2 None (a symmetric kernel) the saving of mirror images is confined to a shard: a pair of
runs inside the shard is computed once and mirrored, a pair with one run outside is computed
directly, as its mirror image belongs to another rank. Across ranks this computes up to twice the
symmetric half, the price of needing no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

Run = tuple[int, int]
"""``(start, length)``: consecutive examples of one side."""


def even_length(total: int, longest: int) -> int:
    """The length of runs of equal lengths covering ``total`` items, as few as runs of at most
    ``longest`` make (at least 1): no short remainder after long runs.

    Example:
        >>> even_length(16, 13), even_length(28, 24), even_length(5, 10), even_length(0, 3)
        (8, 14, 5, 1)
    """
    return max(1, math.ceil(total / max(1, math.ceil(total / max(1, longest)))))


def forward_mode_passes(tangents: int, examples: int, per_pass: int) -> tuple[int, Optional[int]]:
    """``(tangents, examples)`` of each forward-mode pass that pushes ``tangents`` tangents through
    ``examples`` examples, where a pass over all the examples may carry ``per_pass`` tangents
    (NOTE: [Forward-mode passes over runs of x1] in ``_implementations/ntk_vector_products.py``).
    Examples None: all of them in every pass.

    The passes keep ``tangents x examples`` at most ``per_pass x examples`` and evaluate the examples'
    primal as few times as that allows: all tangents in every pass over runs of the examples where
    they fit one example at least, otherwise passes over single examples.

    Example:
        >>> forward_mode_passes(8, 16, 10), forward_mode_passes(32, 16, 10), forward_mode_passes(400, 16, 10)
        ((8, None), (32, 4), (134, 1))
    """
    if tangents <= per_pass:
        return tangents, None
    budget = per_pass * max(1, examples)
    if tangents <= budget:
        return tangents, even_length(examples, budget // tangents)
    return even_length(tangents, budget), 1


def runs(size: int, length: Optional[int]) -> list[Run]:
    """Runs of at most ``length`` covering ``range(size)`` (the last may be shorter); one run when
    ``length`` is None or covers everything.

    Example:
        >>> runs(5, 2), runs(5, None), runs(0, 3)
        ([(0, 2), (2, 2), (4, 1)], [(0, 5)], [(0, 0)])
    """
    if length is None or length >= size:
        return [(0, size)]
    return cut(0, size, length)


def shard_rows(n1: int, unit: int, rank: int, world_size: int) -> tuple[int, int]:
    """``(start, stop)``: the x1 examples (kernel rows) that ``rank`` keeps in shard mode.

    Whole multiples of ``unit`` (the batch size, 1 for none; the last unit may be shorter), in
    rank order, as even as possible: the ranks' numbers of units differ by at most one, the first
    ranks taking the extra ones, so the last ranks get none only when there are fewer units than
    ranks.

    Example:
        >>> [shard_rows(10, 3, rank, 2) for rank in range(2)]
        [(0, 6), (6, 10)]
        >>> [shard_rows(15, 1, rank, 6) for rank in range(6)]
        [(0, 3), (3, 6), (6, 9), (9, 11), (11, 13), (13, 15)]
        >>> [shard_rows(2, 1, rank, 3) for rank in range(3)]
        [(0, 1), (1, 2), (2, 2)]
    """
    units = math.ceil(n1 / unit)
    each, extra = divmod(units, world_size)
    first = rank * each + min(rank, extra)  # in units
    count = each + (1 if rank < extra else 0)
    return min(n1, first * unit), min(n1, (first + count) * unit)


def cut(start: int, stop: int, length: int) -> list[Run]:
    """Runs of at most ``length`` covering ``range(start, stop)``; none if it is empty."""
    return [(first, min(length, stop - first)) for first in range(start, stop, max(1, length))]


@dataclass(frozen=True)
class Tiling:
    """The runs of x1 (``rows``) and x2 (``columns``) and, for row run ``s``, ``pairs[s]``: the
    ``(column index, mirror)`` pairs to compute (``mirror``: also write the mirror image)."""

    rows: list[Run]
    columns: list[Run]
    pairs: list[list[tuple[int, bool]]]

    def entries(self, s: int, t: int, mirror: bool, kept: bool) -> int:
        """Kernel entries (pairs of examples) that pair ``(s, t)`` fills."""
        if not kept:
            return self.rows[s][1]
        return self.rows[s][1] * self.columns[t][1] * (2 if mirror else 1)


def tile(
    n1: int, n2: int, rows: tuple[int, int], row_length: int, column_length: int, kind: str, mirrored: bool
) -> Tiling:
    """The pairs of runs that fill kernel rows ``rows = (start, stop)`` of an ``n1 x n2`` kernel.

    Args:
        row_length, column_length: run lengths of x1 and x2 (x2 is cut like x1 when the kernel is
            symmetric or the batch axis is not kept).
        kind: the batch axis's kind (``"kept"``, ``"diagonal"``, ``"trace"``); only kept axes pair
            different runs.
        mirrored: x2 is x1 (pairs below the diagonal are mirror images).

    Example:
        >>> tiling = tile(6, 6, (0, 6), 2, 2, "kept", mirrored=True)
        >>> tiling.pairs[1]
        [(1, False), (2, True)]
        >>> shard = tile(6, 6, (2, 4), 2, 2, "kept", mirrored=True)  # rows 2-3 only
        >>> shard.rows, shard.pairs[0]
        ([(2, 2)], [(0, False), (1, False), (2, False)])
    """
    start, stop = rows
    own = cut(start, stop, row_length)
    if kind != "kept":
        return Tiling(own, own, [[(s, False)] for s in range(len(own))])
    if not mirrored:
        columns = cut(0, n2, column_length)
        return Tiling(own, columns, [[(t, False) for t in range(len(columns))] for _ in own])
    before, after = cut(0, start, row_length), cut(stop, n1, row_length)
    columns = before + own + after
    first, end = len(before), len(before) + len(own)
    pairs = [
        [(t, first <= t < end and t != first + s) for t in range(len(columns)) if not first <= t < first + s]
        for s in range(len(own))
    ]
    return Tiling(own, columns, pairs)
