"""Whether this thread is capturing a kernel call into a graph, and the reads that stay outside it.

The flag is set by ``compile=``'s capture (``_kernel/captured.py``, NOTE: [Captured kernels]) and
read by structured derivatives' parameter positions (``_implementations/structured/_roles.py``)
and traced derivatives (``_unrolled.py``, which refuse a capture); it lives down here so that
neither layer imports the other.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from torch.utils._python_dispatch import _disable_current_modes

class CaptureRefused(Exception):
    """The computation cannot be replayed from a graph; the message says which operation and why."""


_CAPTURING = threading.local()  # NOTE: [Thread-local state] in _utils/threads.py


@contextlib.contextmanager
def capturing() -> Iterator[None]:
    """This thread is tracing a kernel call into a graph while the context is open."""
    _CAPTURING.active = True
    try:
        yield
    finally:
        _CAPTURING.active = False


def is_capturing() -> bool:
    """Whether this thread is inside :func:`capturing`."""
    return bool(getattr(_CAPTURING, "active", False))


@contextlib.contextmanager
def structural() -> Iterator[None]:
    """Marks torchntk's own reads of tensors that hold only positions derived from shapes (the
    parameter indices of ``_roles.ParamRef``): a graph may fix what they decide, so while capturing
    they run outside the tracer, on the real tensors.

    Those indices come from view operations applied to parameter positions (``_views.py``); the one
    view that could make them depend on data, indexing with a tensor (``W[ids]``), runs
    ``aten.index``, which the capture's value-dependence mode refuses before any index is read.
    """
    if not getattr(_CAPTURING, "active", False):
        yield
        return
    with _disable_current_modes():
        yield
