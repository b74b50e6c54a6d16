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
from typing import Sequence

import torch

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

    def contract(self, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """Contracts ``first[out1..., p]`` with ``second[out2..., p]`` into the (unnormalised) kernel.

        Both operands carry the output axes followed by one axis of contracted "parameter"
        entries (size 1 for NNGP). The result is not divided by :meth:`trace_size`.
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
        right = second.reshape(batch, math.prod(columns), contracted)
        if symmetric:
            product = _gram(left)
        elif batch == 1:
            product = (left[0] @ right[0].T).unsqueeze(0)
        else:
            product = torch.bmm(left, right.transpose(1, 2))
        return product.reshape((*diagonal_shape, *rows, *columns)).permute(result)

    def from_full(self, full: torch.Tensor) -> torch.Tensor:
        """Extracts the layout from an unzipped kernel of shape ``shape1 + shape2`` (unnormalised)."""
        one, two, result = self._letters
        return torch.einsum(f"{one}{two}->{result}", full)


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
    traced = _canonical(trace_axes, ndim, "trace_axes", where, leaf)
    diagonal = _canonical(diagonal_axes, ndim, "diagonal_axes", where, leaf)
    overlap = sorted(set(traced) & set(diagonal))
    if overlap:
        raise ValueError(
            f"{where}: `trace_axes`={trace_axes} and `diagonal_axes`={diagonal_axes} both contain "
            f"axis {overlap[0]} of {leaf} ({ndim} axes); an axis is either traced or diagonal."
        )
    return KernelLayout(ndim, traced, diagonal)


def _canonical(axes: tuple[int, ...], ndim: int, name: str, where: str, leaf: str) -> tuple[int, ...]:
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
            raise ValueError(
                f"{where}: {leaf} has {kind} axis {axis} of size {shape1[axis]} for x1 but "
                f"{shape2[axis]} for x2 (shapes {tuple(shape1)} and {tuple(shape2)}); traced and "
                f"diagonal axes must have equal sizes."
            )


def paired_matrix(kernel: torch.Tensor) -> torch.Tensor:
    """A kernel whose axes come in (x1, x2) pairs, e.g. ``(N1, N2, O1, O2)``, as the matrix
    ``(N1 O1, N2 O2)``: rows are x1's coordinates, columns x2's. That is the layout of kernels
    with only kept axes (NOTE: [Kernel layout])."""
    pairs = kernel.ndim // 2
    rows, columns = math.prod(kernel.shape[0::2]), math.prod(kernel.shape[1::2])
    return kernel.permute(*range(0, 2 * pairs, 2), *range(1, 2 * pairs, 2)).reshape(rows, columns)

