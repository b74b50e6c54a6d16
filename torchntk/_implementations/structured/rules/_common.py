"""Helpers shared by the rules: argument binding, hyper-parameters per axis, operands with a ones column."""

from __future__ import annotations

from typing import Any, Sequence

import torch

_MISSING = object()


def bind(args: tuple, kwargs: dict, names: Sequence[str], defaults: dict[str, Any]) -> list[Any]:
    """The values of ``names`` from a call's positional and keyword arguments.

    Raises:
        TypeError: a required argument is missing (the op itself would raise the same).
    """
    values = []
    for position, name in enumerate(names):
        if position < len(args):
            values.append(args[position])
        elif name in kwargs:
            values.append(kwargs[name])
        elif name in defaults:
            values.append(defaults[name])
        else:
            raise TypeError(f"missing argument {name!r}")
    return values


def as_tuple(value: Any, length: int) -> tuple:
    """Expands an int hyper-parameter (stride, padding, dilation) to one value per spatial axis."""
    if isinstance(value, (tuple, list)):
        return tuple(value) if len(value) == length else tuple(value) * length
    return (value,) * length


def append_ones(inputs: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``[inputs, 1]`` along ``dim``: the operand of a weight and its bias stated together."""
    shape = list(inputs.shape)
    shape[dim] = 1
    return torch.cat([inputs, inputs.new_ones(shape)], dim=dim)
