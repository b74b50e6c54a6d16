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
import dataclasses
import weakref
from typing import Any, Optional

import torch
from torch import nn

from .._utils.values import PLAIN

_TENSOR_TABLES = ("_parameters", "_buffers")
_SYNCED = ("training",)
"""Attributes that a refresh copies, so they need no rebuild."""
_LONG = 64
"""Containers longer than this are described by identity and length, not entry by entry."""


def structure_fingerprint(
    module: nn.Module, modes: Optional[list] = None, memo: Optional["FingerprintMemo"] = None
) -> tuple:
    """A comparable description of ``module`` without what a replica refresh copies.

    Two calls give equal results exactly when nothing but parameter and buffer values,
    ``requires_grad`` flags and train/eval modes changed in between (plain tensor attributes count
    by identity and in-place version). ``modes``: a list to append every submodule's ``training``
    flag to, in the same walk (a plan key holds both). ``memo``: the last walk of ``module``, kept
    by its caller; a walk that finds nothing changed since returns the same tuple, without
    describing the module again (NOTE: [Unchanged modules]).

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
    if memo is not None:
        last = memo.last
        if last is not None and last.module() is module:  # (a memo follows one module at a time)
            seen: list[bool] = []
            if _unchanged(last.modules, seen):
                if modes is not None:
                    modes.extend(seen)
                return last.fingerprint
    entries = []
    walked: Optional[list] = [] if memo is not None else None
    for path, sub in module.named_modules(remove_duplicate=False):
        state = []
        # what _unchanged reads again (filled only with a memo): see NOTE: [Unchanged modules]
        kept, empties, tables, recheck = [], [], [], []
        for key, value in sub.__dict__.items():
            if key in _SYNCED:
                continue
            kind = type(value)
            if kind in PLAIN:  # _describe's first two branches, inline: most attributes take them
                state.append((key, (kind, value)))  # which the memo's fingerprint then holds
            elif kind in _CONTAINERS and not value:  # hook tables, and parameter tables when empty
                state.append((key, (kind, ())))
                empties.append(value)
            elif key in _TENSOR_TABLES:
                described = _tensor_table(value)
                state.append((key, described))
                tables.append((key, _tensor_table, described))
            elif key == "_modules":
                described = _module_table(value)
                state.append((key, described))
                tables.append((key, _module_table, described))
            else:
                described = _describe(value, 0, None)
                state.append((key, described))
                if kind is tuple or kind is frozenset:
                    if _plain_only(described):
                        kept.append(value)  # immutable, plain entries: the same object is the same description
                    else:
                        recheck.append((key, described))
                elif kind in _CONTAINERS or issubclass(kind, torch.Tensor) or issubclass(kind, _SIZED):
                    recheck.append((key, described))  # may change in place
                # any other object is described by type and identity, which the ids and types compare
        entries.append((path, type(sub), id(sub), tuple(state)))
        if modes is not None:
            modes.append(sub.training)
        if walked is not None:
            values = sub.__dict__.values()
            walked.append(_Walked(
                _weak(sub), type(sub), tuple(sub.__dict__), tuple(map(id, values)), tuple(map(type, values)),
                tuple(kept), tuple(empties), tuple(tables), tuple(recheck),
            ))
    fingerprint = tuple(entries)
    if memo is not None:
        walk = _LastWalk(_weak(module), tuple(walked), fingerprint, hashed(fingerprint))
        memo.last = walk if all(one.module is not None for one in walk.modules) and walk.module is not None else None
    return fingerprint


def _weak(module: nn.Module) -> Optional[weakref.ref]:
    try:
        return weakref.ref(module)
    except TypeError:  # a module class without weak references: walked in full every time
        return None


# NOTE: [Unchanged modules]
# A kernel call's plan key holds its module's structure fingerprint, so every call walks the module
# and describes about 1,400 attributes on a ResNet-18 (1.3 ms a call on a 2-core CPU, as much as a
# small model's whole warm call), and hashes the result. A kernel function keeps its last walk (a
# ``FingerprintMemo``) and first asks whether anything changed since, cheaply: every submodule
# walked still alive and of its class, with the same attribute names holding objects of the same
# identities and types, its empty containers (hook tables) still empty, its parameter, buffer and
# child tables still described alike, and the values whose description can change in place
# (tensors by version, mutable containers, subclasses of the built-in ones, tuples holding any of
# them) described alike again. Values described by value are immutable (``PLAIN``, tuples of
# them) and the memo holds them, so an identity cannot pass to another value; any other object is
# described by type and identity, as the full walk does. Only when all of it holds is the last
# fingerprint returned, the same tuple with its hash, so plan keys hash and compare it by
# identity; anything else walks the module in full, as without a memo (a ``train()``/``eval()``
# switch too: the flags are among the identities compared). The walk's submodules come from their
# parents' ``_modules`` tables, which are compared, so the last walk's order is the tree's. The
# memo holds the modules weakly and no tensor, parameter or submodule at all: a replaced head is
# freed at once. It belongs to whoever holds the module (a kernel function, its captured graphs).


class FingerprintMemo:
    """The last walk of :func:`structure_fingerprint` over one module (NOTE: [Unchanged modules]).
    Thread-safe: a walk is replaced whole, never changed."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: Optional[_LastWalk] = None

    def hash_of(self, fingerprint: tuple) -> int:
        """``hash(fingerprint)``, without hashing it again where it is the last walk's."""
        last = self.last
        return last.hash if last is not None and last.fingerprint is fingerprint else hash(fingerprint)

    def hashed(self, fingerprint: tuple) -> "HashedFingerprint":
        """``fingerprint`` as a part of a key that hashes it once (:class:`HashedFingerprint`): the
        last walk's own where it is that walk's, so keys compare it by identity."""
        last = self.last
        return last.hashed if last is not None and last.fingerprint is fingerprint else hashed(fingerprint)


def hashed(fingerprint: tuple) -> "HashedFingerprint":
    """``fingerprint`` hashed once, for a key (:class:`HashedFingerprint`)."""
    return HashedFingerprint(fingerprint, hash(fingerprint))


class HashedFingerprint:
    """A structure fingerprint as a part of a dictionary key: hashed once (a deep tuple hashes its
    entries anew every time), compared by identity first."""

    __slots__ = ("fingerprint", "_hash")

    def __init__(self, fingerprint: tuple, hash_: int):
        self.fingerprint = fingerprint
        self._hash = hash_

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HashedFingerprint) and (
            self.fingerprint is other.fingerprint or (self._hash == other._hash and self.fingerprint == other.fingerprint)
        )


@dataclasses.dataclass(frozen=True)
class _Walked:
    """One submodule as the last walk saw it (NOTE: [Unchanged modules])."""

    module: Optional[weakref.ref]
    kind: type
    keys: tuple
    ids: tuple
    types: tuple
    kept: tuple  # tuples described by value: held, so that their identities are not reused (the
    # fingerprint holds the plain values themselves)
    empties: tuple
    tables: tuple
    recheck: tuple


@dataclasses.dataclass(frozen=True)
class _LastWalk:
    module: Optional[weakref.ref]
    modules: tuple[_Walked, ...]
    fingerprint: tuple
    hashed: HashedFingerprint

    @property
    def hash(self) -> int:
        return hash(self.hashed)


def _unchanged(walked: tuple[_Walked, ...], modes: list) -> bool:
    """Whether every submodule of the last walk is as it was (NOTE: [Unchanged modules]); appends
    their ``training`` flags to ``modes`` on the way."""
    for one in walked:
        sub = one.module()
        if sub is None or type(sub) is not one.kind:
            return False
        state = sub.__dict__
        if (
            tuple(state) != one.keys or tuple(map(id, state.values())) != one.ids
            or tuple(map(type, state.values())) != one.types or any(one.empties)
        ):
            return False
        for key, describe, described in one.tables:
            if describe(state[key]) != described:
                return False
        for key, described in one.recheck:
            if _describe(state[key], 0, None) != described:
                return False
        modes.append(sub.training)
    return True


def _plain_only(described: Any) -> bool:
    """Whether a description holds no description of a mutable object (a tuple's entries)."""
    if type(described) is not tuple or len(described) != 2 or described[0] not in (tuple, frozenset):
        return False  # a tuple past the limits, by identity and length: immutable, but rare; read again
    return all(type(entry) is tuple and entry[1][0] in PLAIN for entry in described[1]) if described[0] is tuple \
        else all(type(entry) is tuple and entry[0] in PLAIN for entry in described[1])


def _tensor_table(table: dict) -> tuple:
    return tuple((name, _tensor_slot(tensor)) for name, tensor in table.items())


def _module_table(table: dict) -> tuple:
    return tuple((name, None if child is None else id(child)) for name, child in table.items())


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
