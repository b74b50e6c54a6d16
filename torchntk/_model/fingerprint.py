"""What a module is, apart from the values of its parameters and buffers.

A replica of a module on another device (``batch``, Monte Carlo) is refreshed by copying tensor
values, ``requires_grad`` flags and train/eval modes (``_kernel/kernel_function.sync_replica``); it is only
valid while everything else about the module is unchanged: the module tree, the classes, plain
attributes (``m.scale = 3.0``), hooks, parametrizations, parameter and buffer names, shapes and
dtypes. :func:`structure_fingerprint` describes all of that as a comparable value, so a replica is
rebuilt whenever it changes.

It runs on every call, over attributes of any kind (e3nn's ``Irreps`` is a tuple subclass whose
``len`` raises), so it never runs their code: values of the exact built-in types (numbers, strings,
dtypes, devices) count by value, exact lists, tuples, dicts and sets entry by entry (bounded in
length, depth and entries), tensors by identity, shape and in-place version, and any other object,
subclasses of the built-in containers included, by type and identity (a list or dict subclass also
by the length its built-in base reads). Replacing such an attribute changes the fingerprint;
changing it in place, beyond that length, does not.
"""

from __future__ import annotations

import collections
from typing import Any, Optional

import torch
from torch import nn

from .._utils.values import PLAIN

_TENSOR_TABLES = ("_parameters", "_buffers")
_SYNCED = ("training",)
"""Attributes that a refresh copies, so they need no rebuild."""
_LONG = 64
"""Containers longer than this are described by identity and length, not entry by entry."""


def structure_fingerprint(module: nn.Module, modes: Optional[list] = None) -> tuple:
    """A comparable description of ``module`` without what a replica refresh copies.

    Two calls give equal results exactly when nothing but parameter and buffer values,
    ``requires_grad`` flags and train/eval modes changed in between (plain tensor attributes count
    by identity and in-place version). ``modes``: a list to append every submodule's ``training``
    flag to, in the same walk (a plan key holds both).

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
    # the exact-type fast paths, inline here and at the top of _describe.
    entries = []
    for path, sub in module.named_modules(remove_duplicate=False):
        state = []
        for key, value in sub.__dict__.items():
            if key in _SYNCED:
                continue
            kind = type(value)
            if kind in PLAIN:  # _describe's first two branches, inline: most attributes take them
                state.append((key, (kind, value)))
            elif kind in _CONTAINERS and not value:  # hook tables, and parameter tables when empty
                state.append((key, (kind, ())))
            elif key in _TENSOR_TABLES:
                state.append((key, tuple((name, _tensor_slot(tensor)) for name, tensor in value.items())))
            elif key == "_modules":
                state.append((key, tuple((name, None if child is None else id(child)) for name, child in value.items())))
            else:
                state.append((key, _describe(value, 0, None)))
        entries.append((path, type(sub), id(sub), tuple(state)))
        if modes is not None:
            modes.append(sub.training)
    return tuple(entries)


def _tensor_slot(tensor: Any) -> Any:
    if tensor is None:
        return None
    return (type(tensor), id(tensor), tuple(tensor.shape), tensor.dtype, tensor.device)


_CONTAINERS = frozenset({list, tuple, dict, set, frozenset, collections.OrderedDict})
"""The exact container types described entry by entry. Subclasses (a namedtuple, e3nn's ``Irreps``,
a ``defaultdict``) may override ``len``, ``iter`` or ``==`` with code that raises or takes long,
so they are described like any other object (:func:`_opaque`)."""
_SIZED = (list, dict, set, frozenset, tuple)
"""The built-in bases whose C-level ``__len__`` reads a subclass's length without its code."""
_DEPTH = 3
"""Containers nested this deep are described by identity and length, not entry by entry."""
_ENTRIES = 1024
"""The most entries one attribute is described by; containers past it by identity and length."""


def _describe(value: Any, depth: int, budget: Optional[list]) -> Any:
    kind = type(value)
    if kind in PLAIN:
        return (kind, value)
    if kind in _CONTAINERS:
        # ``not``, ``len`` and iteration of the exact built-in types run no user code.
        if not value:  # hook tables (at any depth: filling one changes its description)
            return (kind, ())
        if depth >= _DEPTH or len(value) > _LONG:
            return (kind, id(value), len(value))
        flat = (kind is tuple or kind is list) and all(type(item) in PLAIN for item in value)
        if not flat or budget is not None:  # kernel sizes, strides, paddings need no budget
            if budget is None:
                budget = [_ENTRIES]
            budget[0] -= len(value)
            if budget[0] < 0:
                return (kind, id(value), len(value))
        if flat:  # as the general branch below describes them
            return (kind, tuple(((int, index), (type(item), item)) for index, item in enumerate(value)))
        if kind is set or kind is frozenset:  # no order: a set of descriptions (all hashable)
            return (kind, frozenset(_describe(item, depth + 1, budget) for item in value))
        items = value.items() if kind is dict or kind is collections.OrderedDict else enumerate(value)
        return (kind, tuple((_describe(k, depth + 1, budget), _describe(v, depth + 1, budget)) for k, v in items))
    if issubclass(kind, torch.Tensor):
        return ("tensor", id(value), value._version, tuple(value.shape), value.dtype, value.device)
    return _opaque(value, kind)


def _opaque(value: Any, kind: type) -> tuple:
    """Any other object by type and identity; a subclass of a built-in container also by the
    length its built-in base reads (an ``append`` to a list subclass changes it)."""
    for base in _SIZED:
        if issubclass(kind, base):
            return (kind, id(value), base.__len__(value))
    return (kind, id(value))
