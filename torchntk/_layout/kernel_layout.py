"""The kernel layout: the one place that knows how output axes become kernel axes.

NOTE: [Kernel layout]
For one output leaf with ``f(x1).shape = (s1_0, ..., s1_{d-1})`` and ``f(x2)`` of the same ndim,
the kernel walks the output axes in order and, for axis ``i``:

* ``i`` in ``trace_axes``: emits nothing; the pair is contracted and the result divided by the
  axis size (the trace is a *mean* over traced coordinates);
* ``i`` in ``diagonal_axes``: emits one axis (only equal indices of x1 and x2 are kept);
* otherwise: emits two adjacent axes, the x1 one first: ``(s1_i, s2_i)``.

So a ``(N, C, H, W)`` output with ``trace_axes=(1,)`` and ``diagonal_axes=()`` gives a
``(N1, N2, H1, H2, W1, W2)`` kernel. Jacobian contraction, NTK-vector products and NNGP all ask a
:class:`KernelLayout` for einsum subscripts instead of deriving the layout themselves.
"""

from __future__ import annotations

import functools
import math
import string
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .._utils.precision import accumulation_dtype

_LETTERS = string.ascii_letters
_MAX_NDIM = (len(_LETTERS) - 4) // 2


@dataclass(frozen=True)
class KernelLayout:
    """Canonical trace and diagonal axes for output leaves of one ndim.

    Attributes:
        ndim: number of axes of the output leaf (batch axis included).
        trace_axes: sorted, non-negative, unique traced axes.
        diagonal_axes: sorted, non-negative, unique diagonal axes, disjoint from ``trace_axes``.
    """

    ndim: int
    trace_axes: tuple[int, ...]
    diagonal_axes: tuple[int, ...]

    def kind(self, axis: int) -> str:
        """``"trace"``, ``"diagonal"`` or ``"kept"`` for a non-negative output axis."""
        if axis in self.trace_axes:
            return "trace"
        if axis in self.diagonal_axes:
            return "diagonal"
        return "kept"

    def kernel_shape(self, shape1: Sequence[int], shape2: Sequence[int]) -> tuple[int, ...]:
        shape: list[int] = []
        for axis in range(self.ndim):
            kind = self.kind(axis)
            if kind == "diagonal":
                shape.append(shape1[axis])
            elif kind == "kept":
                shape.extend((shape1[axis], shape2[axis]))
        return tuple(shape)

    def trace_size(self, shape1: Sequence[int]) -> int:
        """The number of traced coordinates, which the contracted sum is divided by."""
        return math.prod(shape1[axis] for axis in self.trace_axes)

    def run_axis(self, shape: Sequence[int]) -> Optional[int]:
        """The traced axis of an output of ``shape`` that runs of outputs are cut along (NOTE: [Runs
        of traced outputs] in ``_implementations/jacobian_contraction.py``): the longest, if longer
        than 1; None where nothing is traced.

        Example:
            >>> KernelLayout(3, (1, 2), ()).run_axis((8, 3, 1000)), KernelLayout(2, (), ()).run_axis((8, 10))
            (2, None)
        """
        longest = max(self.trace_axes, key=lambda axis: shape[axis], default=None)
        return longest if longest is not None and shape[longest] > 1 else None

    def kernel_positions(self, axis: int) -> tuple[int, ...]:
        """Positions in the kernel of output axis ``axis``: two if kept, one if diagonal, none if traced."""
        position = 0
        for other in range(self.ndim):
            kind = self.kind(other)
            width = {"trace": 0, "diagonal": 1, "kept": 2}[kind]
            if other == axis:
                return tuple(range(position, position + width))
            position += width
        raise AssertionError(f"axis {axis} outside 0..{self.ndim - 1}")

    def swap_permutation(self) -> tuple[int, ...]:
        """The permutation of kernel axes that turns ``K(x1, x2)`` into ``K(x2, x1)``."""
        permutation: list[int] = []
        position = 0
        for axis in range(self.ndim):
            kind = self.kind(axis)
            if kind == "diagonal":
                permutation.append(position)
                position += 1
            elif kind == "kept":
                permutation.extend((position + 1, position))
                position += 2
        return tuple(permutation)

    @functools.cached_property
    def _letters(self) -> tuple[str, str, str]:
        """Subscripts of the x1 operand, the x2 operand and the kernel (output axes only)."""
        first, second, result = [], [], []
        letters = iter(_LETTERS[2:])
        for axis in range(self.ndim):
            kind = self.kind(axis)
            if kind in ("trace", "diagonal"):
                shared = next(letters)
                first.append(shared)
                second.append(shared)
                if kind == "diagonal":
                    result.append(shared)
            else:
                one, two = next(letters), next(letters)
                first.append(one)
                second.append(two)
                result.extend((one, two))
        return "".join(first), "".join(second), "".join(result)

    @functools.cached_property
    def _matmul_plan(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Operand permutation ``(diagonal, kept, traced, parameter)`` and the result permutation.

        The contraction is one (batched) matrix product: rows are the kept x1 coordinates,
        columns the kept x2 coordinates, the shared dimension the traced coordinates times the
        parameter entries, and the batch the diagonal coordinates. ``torch.einsum`` reaches the
        same product but may copy the (large) operands with unfavourable strides first; here an
        operand is only copied when its axes are not already in this order.
        """
        kept = tuple(axis for axis in range(self.ndim) if self.kind(axis) == "kept")
        operand = self.diagonal_axes + kept + self.trace_axes + (self.ndim,)
        n_diagonal, n_kept = len(self.diagonal_axes), len(kept)
        result: list[int] = []
        for axis in range(self.ndim):
            if axis in self.diagonal_axes:
                result.append(self.diagonal_axes.index(axis))
            elif axis in kept:
                index = kept.index(axis)
                result.extend((n_diagonal + index, n_diagonal + n_kept + index))
        return operand, tuple(result)

    def contract(self, first: torch.Tensor, second: torch.Tensor, *, wide: bool = False) -> torch.Tensor:
        """Contracts ``first[out1..., p]`` with ``second[out2..., p]`` into the (unnormalised) kernel.

        Both operands carry the output axes followed by one axis of contracted "parameter"
        entries (size 1 for NNGP). The result is not divided by :meth:`trace_size`. Long
        contractions of float32 (or narrower) operands are summed in float64 (NOTE: [Accurate
        contraction]); passing the same tensor twice gives an exactly symmetric product.

        Args:
            first: ``(*out1, p)``.
            second: ``(*out2, p)``, the traced and diagonal axes of the same sizes as in ``first``.
            wide: return the kernel in :func:`accumulation_dtype` (float64 for float32 operands)
                instead of the operands' dtype, so that a caller summing several contractions
                rounds once, at the end. Default False.

        Returns:
            The kernel in the layout's axis order (see NOTE: [Kernel layout]).
        """
        symmetric = first is second
        if first.dtype != second.dtype:
            dtype = torch.promote_types(first.dtype, second.dtype)
            first, second = first.to(dtype), second.to(dtype)
        operand, result = self._matmul_plan
        n_diagonal = len(self.diagonal_axes)
        n_kept = self.ndim - n_diagonal - len(self.trace_axes)
        first, second = first.permute(operand), second.permute(operand)
        diagonal_shape = first.shape[:n_diagonal]
        rows = first.shape[n_diagonal : n_diagonal + n_kept]
        columns = second.shape[n_diagonal : n_diagonal + n_kept]
        batch = math.prod(diagonal_shape)
        contracted = math.prod(first.shape[n_diagonal + n_kept :])
        left = first.reshape(batch, math.prod(rows), contracted)
        right = left if symmetric else second.reshape(batch, math.prod(columns), contracted)
        summing = accumulation_dtype(left.dtype, left.device)
        block = CONTRACTION_BLOCKS.get(left.device.type, CONTRACTION_BLOCKS["cuda"])
        if left.dtype in (torch.float64, torch.complex128) or contracted <= block:
            product = _product(left, right)
            if wide:
                product = product.to(summing)
        else:
            product = _blocked_product(left, right, summing, block)
            if not wide:
                product = product.to(left.dtype)
        return product.reshape((*diagonal_shape, *rows, *columns)).permute(result)

    def from_full(self, full: torch.Tensor) -> torch.Tensor:
        """Extracts the layout from an unzipped kernel of shape ``shape1 + shape2`` (unnormalised)."""
        one, two, result = self._letters
        return torch.einsum(f"{one}{two}->{result}", full)


# NOTE: [Accurate contraction]
# A float32 matrix product accumulates every entry in float32 along its inner dimension, whose
# length here is the traced coordinates times a parameter tensor's size: 24M for a 3x3x512x512
# convolution with 10 traced logits, where the single product was off by 2e-3 relative to the
# largest entry (a ResNet-18's traced kernel: 7e-5), while implementations 2 and 3 reach 1e-7.
# So a longer inner dimension is cut into blocks of CONTRACTION_BLOCK terms; the BLAS forms each
# block's product in the operands' dtype, and the partial products are summed in float64
# (accumulation_dtype) one group at a time, so memory stays one float64 kernel plus one group
# of partials. Where rows x columns is small, one batched product forms several blocks'
# partials at once (up to _PARTIALS_PER_CALL entries): one call per block would cost more in
# call overhead than the multiply-adds. Float64 operands keep the single product.
# Block length, measured on a 2-core CPU (benchmarks/bench_accuracy.py): the error of the
# wide convolution's traced kernel was 9e-8 for blocks of 512 to 8192, 4e-7 for 32768 and
# 2.5e-6 for 131072 (float32 rounding of the result alone: 6e-8); single-threaded, 2048, 8192
# and no blocks ran equally fast (within 3%), but with two threads on a loaded machine every
# call waits for a descheduled thread, and 2048 took twice as long as no blocks where 8192
# took 1.3 times as long. Hence 8192.
# On CUDA (an H100, cuBLAS, TF32 off) blocks of 8192 were not enough: two long contractions of
# tests/test_accuracy.py were off by 1.5e-6 and 5.7e-7 (CPU: under 4e-7). Both fit a block
# error of sqrt(block) * eps, as of one running float32 sum per output entry: a contraction of L
# terms in blocks of b is then off by about eps * b / sqrt(L) relative (1.55e-6 predicted for the
# first, with b = 8192 and L = 1e5). Blocks of 1024 bring that to 2e-7 (not yet run on a GPU); on a
# GPU a block's product is a launch of a few microseconds, and small kernels group several
# blocks per call, so the extra calls cost little.
CONTRACTION_BLOCKS = {"cpu": 8192, "cuda": 1024}
"""Inner-dimension block length per device type (other accelerators take CUDA's)."""
_PARTIALS_PER_CALL = 2**18


def _product(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``left @ right^T`` per batch entry, in one product; symmetric when ``right is left``."""
    if right is left:
        return _gram(left)
    if left.shape[0] == 1 and left.shape[1] * right.shape[1] >= _MATRIX_PRODUCT_ENTRIES:
        return (left[0] @ right[0].T).unsqueeze(0)
    return torch.bmm(left, right.transpose(1, 2))


_MATRIX_PRODUCT_ENTRIES = 2**16
"""Result entries from which a product of one batch entry runs as a matrix product rather than a
batched one: on a 2-core CPU (one thread), a 1000 x 1000 result from 8192 inner entries took 166 ms
as ``mm`` and 200 ms as ``bmm``; up to 160 x 160 both took the same, and ``bmm`` is two ATen calls
where ``mm`` of the batch entry is five (the host's work on every call of a small kernel)."""


def _blocked_product(left: torch.Tensor, right: torch.Tensor, summing: torch.dtype, block: int) -> torch.Tensor:
    """``left @ right^T`` (``(batch, rows, p) x (batch, columns, p)``) summed over blocks of
    ``block`` inner entries in ``summing`` (NOTE: [Accurate contraction]); exactly symmetric when
    ``right is left``."""
    batch, rows, length = left.shape
    columns = right.shape[1]
    total = None
    # Grouping blocks into one call needs the blocks of a batch entry as a batch of their own.
    per_call = max(1, _PARTIALS_PER_CALL // (rows * columns)) if batch == 1 else 1
    for start, count, width in _block_groups(length, per_call, block):
        left_blocks = _blocks(left, start, count, width)
        right_blocks = left_blocks if right is left else _blocks(right, start, count, width)
        partials = _product(left_blocks, right_blocks)
        partial = partials.to(summing) if count == 1 else partials.sum(0, keepdim=True, dtype=summing)
        total = partial if total is None else total.add_(partial)
    if right is left:
        # Each partial is symmetric up to the BLAS's rounding; the float64 mean of the two
        # triangles is symmetric exactly, as the kernel of x with itself must be.
        total = (total + total.transpose(1, 2)) * 0.5
    return total


def _block_groups(length: int, per_call: int, block: int):
    """``(start, count, width)``: ``count`` adjacent blocks of ``width`` entries from ``start``,
    covering ``0..length``; only the last block may be shorter than ``block``."""
    whole, tail = divmod(length, block)
    start = 0
    while whole:
        count = min(per_call, whole)
        yield start, count, block
        start += count * block
        whole -= count
    if tail:
        yield start, 1, tail


def _blocks(matrix: torch.Tensor, start: int, count: int, width: int) -> torch.Tensor:
    """``count`` blocks of ``width`` inner entries from ``start``: ``(batch, rows, width)`` for one
    block, else ``(count, rows, width)`` of the single batch entry (a view, never a copy)."""
    if count == 1:
        return matrix[:, :, start : start + width]
    return matrix[0, :, start : start + count * width].unflatten(-1, (count, width)).transpose(0, 1)


_GRAM_BLOCK_ROWS = 128


def _gram(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix @ matrix^T`` (batched) from the blocks on and above the diagonal only.

    With ``k`` row blocks this does ``(k + 1) / (2 k)`` of the multiply-adds of the plain product,
    which matters when x2 is None and the contraction dominates. Blocks stay large enough
    (``_GRAM_BLOCK_ROWS``) for the matrix product to run at full speed.
    """
    rows = matrix.shape[1]
    blocks = min(4, rows // _GRAM_BLOCK_ROWS)
    if blocks <= 1:
        return torch.bmm(matrix, matrix.transpose(1, 2))
    bounds = [rows * index // blocks for index in range(blocks + 1)]
    result = matrix.new_empty(matrix.shape[0], rows, rows)
    for i in range(blocks):
        rows_i = slice(bounds[i], bounds[i + 1])
        for j in range(i, blocks):
            rows_j = slice(bounds[j], bounds[j + 1])
            block = torch.bmm(matrix[:, rows_i], matrix[:, rows_j].transpose(1, 2))
            result[:, rows_i, rows_j] = block
            if i != j:
                result[:, rows_j, rows_i] = block.transpose(1, 2)
    return result


@functools.lru_cache(maxsize=256)
def make_layout(
    ndim: int, trace_axes: tuple[int, ...], diagonal_axes: tuple[int, ...], where: str, leaf: str
) -> KernelLayout:
    """Canonicalises raw axes for an output leaf of ``ndim`` axes.

    Raises:
        ValueError: an axis out of ``-ndim..ndim-1``, an axis listed twice (also as ``-1`` and
            ``ndim-1``), or an axis both traced and diagonal.
    """
    if ndim > _MAX_NDIM:
        raise ValueError(f"{where}: {leaf} has {ndim} axes; at most {_MAX_NDIM} are supported.")
    traced = canonical_axes(trace_axes, ndim, "trace_axes", where, leaf)
    diagonal = canonical_axes(diagonal_axes, ndim, "diagonal_axes", where, leaf)
    overlap = sorted(set(traced) & set(diagonal))
    if overlap:
        raise ValueError(
            f"{where}: `trace_axes`={trace_axes} and `diagonal_axes`={diagonal_axes} both contain "
            f"axis {overlap[0]} of {leaf} ({ndim} axes); an axis is either traced or diagonal."
        )
    return KernelLayout(ndim, traced, diagonal)


def canonical_axes(axes: tuple[int, ...], ndim: int, name: str, where: str, leaf: str) -> tuple[int, ...]:
    """``axes`` of an array of ``ndim`` axes as sorted non-negative axes; ``name`` and ``leaf``
    name the argument and the array in the errors.

    Raises:
        ValueError: an axis out of range, or one axis listed twice (also as ``-1`` and ``ndim-1``).
    """
    canonical = []
    for axis in axes:
        if not -ndim <= axis < ndim:
            hint = " Scalar outputs need `trace_axes=()`." if ndim == 0 else ""
            raise ValueError(
                f"{where}: `{name}`={axes} has axis {axis}, out of range for {leaf} with {ndim} "
                f"axes (expected -{ndim}..{ndim - 1}).{hint}"
            )
        canonical.append(axis % ndim)
    if len(set(canonical)) != len(canonical):
        raise ValueError(
            f"{where}: `{name}`={axes} names the same axis of {leaf} ({ndim} axes) twice; "
            f"list each axis once."
        )
    return tuple(sorted(canonical))


def check_shapes(
    layout: KernelLayout, shape1: Sequence[int], shape2: Sequence[int], where: str, leaf: str
) -> None:
    """Raises ValueError if traced or diagonal axes differ in size between x1 and x2."""
    for axis in layout.trace_axes + layout.diagonal_axes:
        if shape1[axis] != shape2[axis]:
            kind = "traced" if axis in layout.trace_axes else "diagonal"
            hint = ""
            if layout.ndim == 1 and kind == "traced":  # NOTE: [Output notices]: most likely one entry per example
                hint = (
                    " An output of shape (N,) has its examples on its only axis, which `trace_axes` names: "
                    "pass trace_axes=() for the (N1, N2) kernel, or keep a trailing output axis (shape "
                    "(N, 1): no .squeeze(-1))."
                )
            raise ValueError(
                f"{where}: {leaf} has {kind} axis {axis} of size {shape1[axis]} for x1 but "
                f"{shape2[axis]} for x2 (shapes {tuple(shape1)} and {tuple(shape2)}); traced and "
                f"diagonal axes must have equal sizes.{hint}"
            )


def paired_matrix(kernel: torch.Tensor) -> torch.Tensor:
    """A kernel whose axes come in (x1, x2) pairs, e.g. ``(N1, N2, O1, O2)``, as the matrix
    ``(N1 O1, N2 O2)``: rows are x1's coordinates, columns x2's. That is the layout of kernels
    with only kept axes (NOTE: [Kernel layout])."""
    pairs = kernel.ndim // 2
    rows, columns = math.prod(kernel.shape[0::2]), math.prod(kernel.shape[1::2])
    return kernel.permute(*range(0, 2 * pairs, 2), *range(1, 2 * pairs, 2)).reshape(rows, columns)

