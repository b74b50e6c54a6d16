"""The layout contraction of the reference kernels of :mod:`torchntk.testing`: one einsum per leaf.

Part of the oracle: it shares no code with the library's layout code (``torchntk/_layout/kernel_layout.py``), so
that a mistake there cannot hide in both. The layout rule it implements is the one in the
docstring of ``torchntk/testing/__init__.py``.
"""

from __future__ import annotations

import string
from typing import Sequence, Union

import torch
from torch import Tensor

Axes = Union[int, Sequence[int]]
"""An output axis or a sequence of output axes; negative axes count from the end of each leaf."""


def _canonical_axes(axes: Axes, ndim: int, argument: str) -> list[int]:
    """Non-negative, deduplicated, sorted axes (the user's order and repeats are irrelevant)."""
    axes = [axes] if isinstance(axes, int) else list(axes)
    for axis in axes:
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"reference kernels: `{argument}` contains axis {axis}, out of range for an "
                f"output leaf with {ndim} dimensions."
            )
    return sorted({axis % ndim for axis in axes})


def contract(a1: Tensor, a2: Tensor, trace_axes: Axes, diagonal_axes: Axes) -> Tensor:
    """Kernel of one output leaf from ``a1: (*s1, P)`` and ``a2: (*s2, P)``.

    The last axis (parameters θ, or a dummy size-1 axis for the NNGP) is always summed. Output
    axis ``i`` gets letter ``x_i`` in ``a1`` and ``y_i`` in ``a2``: traced axes use one shared
    letter that the result omits, diagonal axes a shared letter the result keeps once, and the
    others distinct letters ``x_i y_i`` placed next to each other in the result.

    Raises:
        ValueError: the leaves' ndims differ, an axis is out of range or both traced and
            diagonal, or a traced or diagonal axis has different sizes in ``a1`` and ``a2``.
    """
    if a1.ndim != a2.ndim:
        raise ValueError(
            "reference kernels: f(x1) and f(x2) leaves must have the same number of dimensions, "
            f"got shapes {tuple(a1.shape[:-1])} and {tuple(a2.shape[:-1])}."
        )
    ndim = a1.ndim - 1
    traced = _canonical_axes(trace_axes, ndim, "trace_axes")
    diagonal = _canonical_axes(diagonal_axes, ndim, "diagonal_axes")
    if set(traced) & set(diagonal):
        raise ValueError(
            f"reference kernels: axes {sorted(set(traced) & set(diagonal))} are both traced and "
            "diagonal; `trace_axes` and `diagonal_axes` must be disjoint."
        )
    for axis in traced + diagonal:
        if a1.shape[axis] != a2.shape[axis]:
            raise ValueError(
                f"reference kernels: traced or diagonal axis {axis} has size {a1.shape[axis]} in "
                f"f(x1) but {a2.shape[axis]} in f(x2); these sizes must match."
            )

    letters = iter(string.ascii_letters)
    theta = next(letters)
    lhs, rhs, result = [], [], []
    for axis in range(ndim):
        x_letter = next(letters)
        if axis in traced:
            lhs.append(x_letter)
            rhs.append(x_letter)
        elif axis in diagonal:
            lhs.append(x_letter)
            rhs.append(x_letter)
            result.append(x_letter)
        else:
            y_letter = next(letters)
            lhs.append(x_letter)
            rhs.append(y_letter)
            result += [x_letter, y_letter]
    equation = f"{''.join(lhs)}{theta},{''.join(rhs)}{theta}->{''.join(result)}"
    traced_size = 1
    for axis in traced:
        traced_size *= a1.shape[axis]
    return torch.einsum(equation, a1, a2) / traced_size

