"""What a module is, apart from the values of its parameters and buffers.

A replica of a module on another device (``batch``, Monte Carlo) is refreshed by copying tensor
values, ``requires_grad`` flags and train/eval modes (``_kernel/kernel_function.sync_replica``); it is only
valid while everything else about the module is unchanged: the module tree, the classes, plain
attributes (``m.scale = 3.0``), hooks, parametrizations, parameter and buffer names, shapes and
dtypes. :func:`structure_fingerprint` describes all of that as a comparable value, so a replica is
rebuilt whenever it changes.
"""

from __future__ import annotations

import collections
import numbers
from typing import Any

import torch
from torch import nn

_TENSOR_TABLES = ("_parameters", "_buffers")
_SYNCED = ("training",)
"""Attributes that a refresh copies, so they need no rebuild."""
_LONG = 64
"""Containers longer than this are described by identity and length, not entry by entry."""


def structure_fingerprint(module: nn.Module) -> tuple:
    """A comparable description of ``module`` without what a replica refresh copies.

    Two calls give equal results exactly when nothing but parameter and buffer values,
    ``requires_grad`` flags and train/eval modes changed in between (plain tensor attributes count
    by identity and in-place version).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 2)
        >>> before = structure_fingerprint(model)
        >>> with torch.no_grad():
        ...     _ = model.weight.add_(1.0)
        >>> structure_fingerprint(model) == before
        True
        >>> model.scale = 3.0
        >>> structure_fingerprint(model) == before
        False
    """
    # Every eager kernel call and every replay of a captured graph computes this (the 68 modules of
    # a ResNet-18 hold about 1,400 attributes, mostly empty hook tables), so the common values take
    # the exact-type fast paths at the top of _describe.
    entries = []
    for path, sub in module.named_modules(remove_duplicate=False):
        state = []
        for key, value in sub.__dict__.items():
            if key in _SYNCED:
                continue
            if key in _TENSOR_TABLES:
                state.append((key, tuple((name, _tensor_slot(tensor)) for name, tensor in value.items())))
            elif key == "_modules":
                state.append((key, tuple((name, None if child is None else id(child)) for name, child in value.items())))
            else:
                state.append((key, _describe(value, depth=0)))
        entries.append((path, type(sub), id(sub), tuple(state)))
    return tuple(entries)


def _tensor_slot(tensor: Any) -> Any:
    if tensor is None:
        return None
    return (type(tensor), id(tensor), tuple(tensor.shape), tensor.dtype, tensor.device)


_PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device})
"""Exact types described by value, checked before the ``isinstance`` tests (which also take
subclasses and other numbers, at several times the cost)."""
_CONTAINERS = frozenset({list, tuple, dict, set, frozenset, collections.OrderedDict})
"""Exact container types whose empty instances are described at once (hook tables); tuples and lists
of :data:`_PLAIN` values are too."""


def _describe(value: Any, depth: int) -> Any:
    kind = type(value)
    if kind in _PLAIN:
        return (kind, value)
    if kind in _CONTAINERS and not value and depth < 3:
        return (kind, ())
    if (kind is tuple or kind is list) and depth < 3 and len(value) <= _LONG and all(
        type(item) in _PLAIN for item in value
    ):  # kernel sizes, strides, paddings: as the general branch below describes them
        return (kind, tuple(((int, index), (type(item), item)) for index, item in enumerate(value)))
    if value is None or isinstance(value, (bool, str, bytes, numbers.Number, torch.dtype, torch.device)):
        return (type(value), value)
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version, tuple(value.shape), value.dtype, value.device)
    if isinstance(value, (list, tuple, dict, set, frozenset)) and depth < 3 and len(value) <= _LONG:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        if isinstance(value, (set, frozenset)):
            items = enumerate(sorted(value, key=repr))
        return (type(value), tuple((_describe(k, depth + 1), _describe(v, depth + 1)) for k, v in items))
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return (type(value), id(value), len(value))
    return (type(value), id(value))
