"""Kernels and targets as matrices: how ``torchntk.predict`` reads the kernels of this library.

NOTE: [Kernels as matrices]
For targets ``y`` of shape ``(N, *rest)`` and ``trace_axes`` ``T`` (axes of ``y``), a kernel on
train and test points has one pair of axes per *non-traced* axis of ``y``, in order, test size
first: ``(N_test, N_train)`` for ``y`` of shape ``(N, O)`` with ``T = (-1,)``, and
``(N_test, N_train, O, O)`` with ``T = ()``. That is the layout of this library's kernel
functions with the same ``trace_axes`` (and no ``diagonal_axes``). Such a kernel is read as the
matrix whose rows are the test points' non-traced coordinates and whose columns are the
training points'. A traced axis is assumed to carry ``K (x) I``: every traced coordinate (e.g.
every logit) evolves independently with the same kernel. That is exact in the infinite-width
limit and an approximation for a finite network, whose exact linearised dynamics need
``trace_axes=()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .._layout.kernel_layout import canonical_axes, paired_matrix
from .._utils.checks import axes_argument, finite_tensor_argument, show


@dataclass(frozen=True)
class TargetLayout:
    """Where the traced and the kernel's axes of ``y_train`` are.

    Attributes:
        shape: ``y_train.shape``.
        traced: the traced axes, non-negative and sorted.
        kept: the other axes, in order (the kernel has a pair of axes for each).
    """

    shape: tuple[int, ...]
    traced: tuple[int, ...]
    kept: tuple[int, ...]

    @classmethod
    def of(cls, y_train: Any, trace_axes: Any, where: str) -> "TargetLayout":
        """Raises TypeError for ``y_train`` other than a tensor with a batch axis, ValueError for
        bad ``trace_axes``."""
        if not isinstance(y_train, torch.Tensor) or y_train.ndim == 0:
            raise TypeError(f"{where}: `y_train` must be a tensor with a batch axis, got {show(y_train)}.")
        finite_tensor_argument(y_train, "y_train", where)
        axes = axes_argument(trace_axes, "trace_axes", where)
        ndim = y_train.ndim
        traced = canonical_axes(axes, ndim, "trace_axes", where, f"`y_train` of shape {tuple(y_train.shape)}")
        if 0 in traced:
            raise ValueError(f"{where}: `trace_axes` {axes} traces the batch axis 0 of `y_train`; the kernel must keep it.")
        return cls(tuple(y_train.shape), traced, tuple(a for a in range(ndim) if a not in traced))

    @property
    def kept_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[a] for a in self.kept)

    @property
    def traced_shape(self) -> tuple[int, ...]:
        return tuple(self.shape[a] for a in self.traced)

    @property
    def rows(self) -> int:
        return math.prod(self.kept_shape)

    @property
    def columns(self) -> int:
        return math.prod(self.traced_shape)

    def test_kept_shape(self, n_test: int) -> tuple[int, ...]:
        return (n_test,) + self.kept_shape[1:]

    def flatten(self, values: torch.Tensor) -> torch.Tensor:
        """``(*shape with any batch size) -> (kept coordinates, traced coordinates)``."""
        moved = values.movedim(self.traced, tuple(range(values.ndim - len(self.traced), values.ndim)))
        return moved.reshape(-1, self.columns)

    def unflatten(self, values: torch.Tensor, n: int, lead: tuple[int, ...] = ()) -> torch.Tensor:
        """``(*lead, kept coordinates of n points, traced coordinates) -> (*lead, *shape with batch n)``."""
        shaped = values.reshape(*lead, *self.test_kept_shape(n), *self.traced_shape)
        ndim = len(lead) + len(self.shape)
        last = tuple(range(ndim - len(self.traced), ndim))
        return shaped.movedim(last, tuple(len(lead) + a for a in self.traced))

    def matrix(self, kernel: Any, name: str, n_rows: int, n_columns: int, where: str) -> torch.Tensor:
        """The kernel as a ``(rows, columns)`` matrix (NOTE: [Kernels as matrices]).

        Raises:
            TypeError: not a tensor.
            ValueError: a shape other than the pairs of axes the targets call for; NaN or infinite
                entries (every prediction would be NaN).
        """
        if not isinstance(kernel, torch.Tensor):
            raise TypeError(f"{where}: `{name}` must be a tensor, got {show(kernel)}.")
        finite_tensor_argument(kernel, name, where)
        rows, columns = self.test_kept_shape(n_rows), self.test_kept_shape(n_columns)
        expected = tuple(size for pair in zip(rows, columns) for size in pair)
        if tuple(kernel.shape) != expected:
            raise ValueError(
                f"{where}: `{name}` has shape {tuple(kernel.shape)}, but targets of shape {self.shape} with "
                f"trace_axes={self.traced} call for {expected} (a pair of axes per untraced axis, "
                f"{n_rows} x {n_columns} points). Compute it with the same trace_axes and no diagonal_axes."
            )
        return paired_matrix(kernel)

    def kernel(self, matrix: torch.Tensor, n: int, lead: tuple[int, ...] = ()) -> torch.Tensor:
        """``(*lead, rows, rows)`` of ``n`` points -> the kernel layout ``(*lead, n, n, a, a, ...)``."""
        kept = self.test_kept_shape(n)
        shaped = matrix.reshape(*lead, *kept, *kept)
        pairs = len(kept)
        base = len(lead)
        order = [base + i for pair in zip(range(pairs), range(pairs, 2 * pairs)) for i in pair]
        return shaped.permute(*range(base), *order)


def as_tensor(value: Any, like: torch.Tensor, name: str, where: str) -> torch.Tensor:
    """A finite number or tensor as a tensor with ``like``'s dtype and device.

    Raises:
        TypeError: neither a tensor nor a real number.
        ValueError: NaN or infinite entries.
    """
    if isinstance(value, torch.Tensor):
        converted = value.to(dtype=like.dtype, device=like.device)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        converted = torch.tensor(float(value), dtype=like.dtype, device=like.device)
    else:
        raise TypeError(f"{where}: `{name}` must be a tensor or a number, got {show(value)}.")
    finite_tensor_argument(converted, name, where)
    return converted


def broadcast(value: torch.Tensor, shape: tuple[int, ...], name: str, where: str) -> torch.Tensor:
    try:
        return torch.broadcast_to(value, shape)
    except RuntimeError:
        raise ValueError(f"{where}: `{name}` of shape {tuple(value.shape)} does not broadcast to {shape}.") from None
