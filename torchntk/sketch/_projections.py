"""Seeded random projections for sketched kernels, generated piece by piece and never whole.

NOTE: [Sketch streams]
A sketch multiplies per-example derivatives by a random ``(P, k)`` matrix, ``P`` the number of
differentiated parameter entries. That matrix is never materialised: it is cut into *tiles* of at
most ``ROWS`` entries of one parameter tensor (flattened) by ``COLUMNS`` sketch columns, and every
tile is drawn from its own ``torch.Generator`` seeded with

    ``numpy.random.SeedSequence([seed, kind, hash(parameter name), row block, column block])``

(the first 64-bit word of its state; the name is hashed with BLAKE2b), on CPU, in float32, and then
cast and moved to where the derivatives are. So a tile depends only on the user's ``seed``, the
parameter's name and shape and its position, never on the batch size, the chunking of the
examples, the device, the dtype of the model or which other parameters are differentiated.
Column blocks are always drawn ``COLUMNS`` wide and cut to ``k``: the first ``k`` columns of a
Gaussian sketch with ``k' > k`` columns are those of the sketch with ``k`` columns.

The same construction gives the random signs that fold traced output axes into the sketch
(``trace_signs``), and the two Gaussian factors of a Kronecker-structured projection.
"""

from __future__ import annotations

import hashlib
from typing import Iterator

import numpy as np
import torch

ROWS = 1 << 16
"""Parameter entries per tile: a ``ROWS x COLUMNS`` float32 tile is 32 MB."""

COLUMNS = 128
"""Sketch columns per tile (a fixed width, so that feature ``j`` never depends on ``k``)."""

_KINDS = {"gaussian": 1, "sparse-bucket": 2, "sparse-sign": 3, "trace-sign": 4, "kronecker-out": 5, "kronecker-in": 6}


def stream_seed(seed: int, kind: str, name: str, *positions: int) -> int:
    """The seed of one tile (NOTE: [Sketch streams]).

    Example:
        >>> stream_seed(0, "gaussian", "0.weight", 0, 1) == stream_seed(0, "gaussian", "0.weight", 0, 1)
        True
        >>> stream_seed(0, "gaussian", "0.weight", 0, 1) != stream_seed(1, "gaussian", "0.weight", 0, 1)
        True
    """
    name_word = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    entropy = [seed, _KINDS[kind], name_word, *positions]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0])


def _generator(seed: int, kind: str, name: str, *positions: int) -> torch.Generator:
    return torch.Generator("cpu").manual_seed(stream_seed(seed, kind, name, *positions))


def column_blocks(k: int) -> Iterator[tuple[int, int, int]]:
    """``(block, start, width)`` of the column blocks covering ``range(k)``; the last may be narrower."""
    for block, start in enumerate(range(0, k, COLUMNS)):
        yield block, start, min(COLUMNS, k - start)


def row_blocks(numel: int) -> Iterator[tuple[int, int, int]]:
    """``(block, start, length)`` of the row blocks covering a flattened parameter of ``numel`` entries."""
    for block, start in enumerate(range(0, numel, ROWS)):
        yield block, start, min(ROWS, numel - start)


def gaussian_tile(seed: int, name: str, row_block: int, rows: int, column_block: int, width: int,
                  like: torch.Tensor) -> torch.Tensor:
    """Standard normal ``(rows, width)`` tile: rows ``row_block * ROWS ...`` of a parameter, columns
    ``column_block * COLUMNS ...`` of the sketch, in the dtype and on the device of ``like``."""
    generator = _generator(seed, "gaussian", name, row_block, column_block)
    tile = torch.randn((rows, COLUMNS), generator=generator)
    return tile[:, :width].to(device=like.device, dtype=like.dtype)


def sparse_hash(seed: int, name: str, row_block: int, rows: int, k: int, traced: int,
                like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(buckets, signs)`` of a CountSketch for ``rows`` entries of a parameter, as the derivative of
    traced output coordinate ``traced``: each entry goes to one of ``k`` columns (int64 indices,
    uniform) with a random sign (``like``'s dtype, +-1)."""
    buckets = torch.randint(0, k, (rows,), generator=_generator(seed, "sparse-bucket", name, row_block, k, traced))
    bits = torch.randint(0, 2, (rows,), generator=_generator(seed, "sparse-sign", name, row_block, k, traced),
                         dtype=torch.float32)
    return buckets.to(like.device), (2 * bits - 1).to(device=like.device, dtype=like.dtype)


def trace_signs(seed: int, traced: int, column_block: int, width: int, like: torch.Tensor) -> torch.Tensor:
    """Random signs ``(traced, width)`` that combine ``traced`` output coordinates into each feature."""
    generator = _generator(seed, "trace-sign", "", traced, column_block)
    bits = torch.randint(0, 2, (traced, COLUMNS), generator=generator, dtype=torch.float32)[:, :width]
    return (2 * bits - 1).to(device=like.device, dtype=like.dtype)


def kronecker_factors(seed: int, name: str, out_size: int, in_size: int, column_block: int, width: int,
                      like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard normal ``(out_size, width)`` and ``(in_size, width)`` factors of a Kronecker projection."""
    out_factor = torch.randn((out_size, COLUMNS), generator=_generator(seed, "kronecker-out", name, column_block))
    in_factor = torch.randn((in_size, COLUMNS), generator=_generator(seed, "kronecker-in", name, column_block))
    return tuple(factor[:, :width].to(device=like.device, dtype=like.dtype) for factor in (out_factor, in_factor))
