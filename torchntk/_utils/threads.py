"""Threads: the one process-wide lock of torchntk (forward-mode automatic differentiation), and
process-wide settings that concurrent computations share (:class:`WhileAnyActive`).

NOTE: [Threads]
Kernel functions, ``batch`` and Monte Carlo may be called from several threads at once. Module
state is never shared between calls (each evaluation runs on a private shell of the module, see
NOTE: [Modules are never mutated] in ``_model/functional.py``), so reverse-mode work runs in parallel. Forward
mode is different: PyTorch keeps the nesting level of dual tensors in process-wide state, and two
threads running ``torch.func.jvp`` at once corrupt each other's tangents (measured: wrong kernels
from implementation 2 in two threads on two different models). Every forward-mode computation of
the library therefore holds :data:`FORWARD_MODE_LOCK`. It is re-entrant, because a batched call
that holds it may call a kernel function that takes it again.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Optional

FORWARD_MODE_LOCK = threading.RLock()
"""Held by every computation that may use forward-mode AD (``torch.func.jvp``, ``jacfwd``)."""


def serialised(thread_safe: bool):
    """A context that holds :data:`FORWARD_MODE_LOCK` unless the work is ``thread_safe``."""
    return contextlib.nullcontext() if thread_safe else FORWARD_MODE_LOCK


class WhileAnyActive:
    """A process-wide change that the first of any number of nested or concurrent users makes and
    the last undoes (a count under a lock): for settings PyTorch or Python keep per process, which
    saving and restoring per thread would let two threads undo for each other."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._undo: Optional[Callable[[], None]] = None

    @contextlib.contextmanager
    def active(self, apply: Callable[[], Callable[[], None]]) -> Iterator[None]:
        """Inside the block the change is in effect: ``apply()`` makes it on the outermost entry
        of all threads and returns what undoes it, called on the last exit."""
        with self._lock:
            if self._depth == 0:
                self._undo = apply()
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    undo, self._undo = self._undo, None
                    undo()
