"""Descriptions of values that users hand over, made without running their code.

Keys, fingerprints and messages describe arguments and module attributes of any kind: an e3nn
``Irreps`` (a tuple subclass whose ``len`` raises), a graph batch, a config object. Calling
``len``, ``iter``, ``repr``, ``==`` or ``hash`` on such a value runs the user's code, which may
raise or take long, so only values of the exact built-in types in :data:`PLAIN` are described by
value; anything else is described by its type and identity.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device})
"""Exact types whose values are compared, hashed and shown by their built-in methods alone."""


class Identity:
    """A key part that equals another exactly when both describe the same live object.

    Keys live in caches longer than the arguments they describe, and ``id`` alone is reused by
    the next object allocated at the freed address: a key holding the bare ``id`` of a graph batch
    that is gone would match the next batch of another shape. This one holds a weak reference
    where the type allows it (a dead one equals nothing) and the object itself otherwise.

    Example:
        >>> class Config:
        ...     pass
        >>> first = Config()
        >>> Identity(first) == Identity(first), Identity(first) == Identity(Config())
        (True, False)
    """

    __slots__ = ("_id", "_get", "kind")

    def __init__(self, value: Any):
        self._id = id(value)
        self.kind = type(value)
        try:
            self._get = weakref.ref(value)
        except TypeError:  # tuples, ints and their subclasses take no weak references
            self._get = lambda: value

    def __hash__(self) -> int:
        return self._id

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Identity) or other._id != self._id:
            return False
        mine = self._get()
        return mine is not None and mine is other._get()

    def __repr__(self) -> str:
        return f"<{self.kind.__qualname__} at {self._id:#x}>"


def leaf_key(leaf: Any) -> Any:
    """A hashable description of a non-tensor leaf of an argument, for cache keys: plain values by
    value, anything else by :class:`Identity` (a new object is a new key, never a wrong hit)."""
    kind = type(leaf)
    if kind in PLAIN:
        return (kind, leaf)
    return (kind, Identity(leaf))


def safe_repr(value: Any, limit: int = 80) -> str:
    """``repr(value)`` shortened to ``limit`` characters, for messages; where the value's own
    ``repr`` raises, its type and address instead (a message must not fail on the value it shows)."""
    try:
        text = repr(value)
        if type(text) is not str:  # a __repr__ returning a str subclass runs more user code
            raise TypeError
    except Exception:  # noqa: BLE001 - any failure of user code: describe it without its help
        text = f"<{type(value).__qualname__} object at {id(value):#x}>"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text
