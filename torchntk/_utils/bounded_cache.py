"""A dictionary that forgets its oldest entries, for the caches kept by kernel functions."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Hashable


_MISSING = object()


class BoundedCache:
    """At most ``size`` entries; the least recently written or read is dropped first. Thread-safe.

    Example:
        >>> cache = BoundedCache(2)
        >>> cache["a"] = 1; cache["b"] = 2; cache["c"] = 3
        >>> "a" in cache, cache.get("c")
        (False, 3)
    """

    def __init__(self, size: int):
        self._size = size
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            found = self._entries.get(key, _MISSING)
            if found is _MISSING:
                return default
            self._entries.move_to_end(key)
            return found

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._entries

    def __setitem__(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)

    def pop(self, key: Hashable, default: Any = None) -> Any:
        with self._lock:
            return self._entries.pop(key, default)
