"""The one process-wide lock of torchntk: forward-mode automatic differentiation.

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

FORWARD_MODE_LOCK = threading.RLock()
"""Held by every computation that may use forward-mode AD (``torch.func.jvp``, ``jacfwd``)."""


def serialised(thread_safe: bool):
    """A context that holds :data:`FORWARD_MODE_LOCK` unless the work is ``thread_safe``."""
    return contextlib.nullcontext() if thread_safe else FORWARD_MODE_LOCK
