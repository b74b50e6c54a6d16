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

NOTE: [Thread-local state]
State kept per thread (``threading.local``) is state that a caller cannot hand down as an
argument, because PyTorch or the user's model stands between the two ends, and that must not
leak into computations of other threads:

* code PyTorch calls back: the recorder and the model wrappers read, from inside a function
  mode's ``__torch_function__``, a module's ``forward`` or a stand-in set on a module attribute,
  which parameters the levels of the model's own derivatives wrapped (``_ALIASES`` in
  ``_model/inner_derivatives.py``), how deep this thread's evaluations are (``wrappers.py``) and
  whether this thread is tracing a captured graph (``_utils/capturing.py``);
* one private shell of a module per thread (``_private_evaluation`` in ``_model/functional.py``):
  ``functional_call`` swaps tensors into the shell while the model runs;
* context managers the user enters, like PyTorch's own (``torchntk.precision``,
  ``_utils/precision.py``);
* scopes that span a call's stages through the implementation table, which hands down a
  prepared call and nothing else: which models built inside a first call's preparation are
  watched for aliased parameters (``alias_checks``, ``_model/aliases.py``), the example-loop
  switches a ``vmap_axes`` trial collects before it decides (``ExampleLoops.held``,
  ``_call/example_loop.py``), and the last price of implementation 3, which AUTO computes and
  the memory model then asks of the same call and plan (``structured_cost``,
  ``_implementations/structured/_cost.py``; weak references, so nothing outlives the call).
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
