"""What the implementations derive while planning a key, kept in the key's record.

NOTE: [One record per key]
A kernel function keeps everything it learns about a plan key (NOTE: [Plan keys]) in one
:class:`~torchntk._plan.stage.KeyRecord` of its :class:`~torchntk._plan.stage.Planner`: the
facts, the call plans, the memory plans, and what the implementations derive on the way:
implementation 3's probe and checked plan, AUTO's choice, the counted passes and the memory
model's sizes and peaks. The implementations themselves hold no state: each is handed the
call's :class:`Scope` (a view of its key's record) and keeps there what later calls with the
key reuse. So there is one cache, under one key, and dropping a key drops all of it at once;
a module whose structure changed has another key and so plans anew, its implementations
included.

Within a record, an entry is told apart by its kind (``"structured plan"``, ``"auto choice"``,
...), the scope's name (``batch``'s spans plan apart from whole calls, AUTO's choice per block
size) and what a call may change under the same key (:meth:`KernelCall.cache_key`: the
differentiated parameters and their shapes, and how the examples are mapped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable

from .._utils.bounded_cache import BoundedCache

__all__ = ["Scope"]

_MISSING = object()


@dataclass(frozen=True)
class Scope:
    """A view of one key's record for the implementations (NOTE: [One record per key]).

    Args:
        entries: the record's cache of derived entries.
        name: what sets these entries apart from others of the same key and kind.

    Example:
        >>> from torchntk._utils.bounded_cache import BoundedCache
        >>> scope = Scope(BoundedCache(8), "call")
        >>> scope.within("blocks").name
        ('call', 'blocks')
    """

    entries: BoundedCache
    name: Hashable = "call"

    def within(self, part: Hashable) -> "Scope":
        """The scope of entries set apart by ``part`` too (``batch``'s spans, a block size)."""
        return Scope(self.entries, (self.name, part))

    def key(self, kind: str, call: Any, *parts: Hashable) -> tuple:
        """The entry key of ``kind`` for ``call`` (and ``parts``)."""
        return (kind, call.cache_key(self.name), *parts)

    def get(self, kind: str, call: Any, *parts: Hashable, default: Any = None) -> Any:
        return self.entries.get(self.key(kind, call, *parts), default)

    def put(self, kind: str, call: Any, value: Any, *parts: Hashable) -> Any:
        self.entries[self.key(kind, call, *parts)] = value
        return value

    def pop(self, kind: str, call: Any, *parts: Hashable) -> Any:
        return self.entries.pop(self.key(kind, call, *parts), None)


def cached(scope: "Scope | None", kind: str, call: Any, make: Any, *parts: Hashable) -> Any:
    """The entry of ``kind`` for ``call`` in ``scope``, made by ``make()`` and kept when missing;
    with no scope (a call planned alone), ``make()``."""
    if scope is None:
        return make()
    found = scope.get(kind, call, *parts, default=_MISSING)
    if found is _MISSING:
        found = scope.put(kind, call, make(), *parts)
    return found
