"""When a kernel function maps its examples with a loop instead of vmap, and the warning it gives.

NOTE: [Switching to example loops]
``vmap_axes`` makes torchntk evaluate the model per example under ``torch.func.vmap``. Some
models cannot run there although their examples are independent: ``nn.LSTM``'s fused kernel has
no batching rule, Hugging Face's padding-mask code branches on tensor values. Such failures raise
a :class:`~torchntk._call.per_example.VmapLimitation` (from the vmap region itself, or from
``VmapAxesCheck`` once it has seen the same examples agree with the batch without vmap). A kernel
function then computes the call again with its examples mapped by a Python loop (NOTE: [Example
loops]) and remembers, per plan key, that vmap failed, so later calls start with the loop
(``looped_where_vmap_fails`` in ``_kernel/execution.py``, for a first call's checks and for the
implementations' passes alike).
The loop evaluates the same per-example function, so the ``vmap_axes`` checks still apply to it
(a model that couples examples is still an error). It warns once per kernel function with
:class:`ExampleLoopWarning`, which says what the loop costs.

NOTE: [Loop or whole batches]
Where the axes were found (``vmap_axes="auto"``, NOTE: [Found vmap_axes]) rather than given, the
loop is a choice, not a necessity: the examples are independent, so the same kernel comes from
whole batches too (``vmap_axes=None``), at O(N^2) work against the loop's O(N) Python-bound
passes. On force fields (torchani, MACE: ``nonzero`` and ``scatter_add_`` in neighbour lists)
whole batches were 2.5-6x faster than the loop at N = 32. So a key's first call, where vmap fails
on the found axes, also prepares the call on whole batches and prices both with AUTO's cost
model (NOTE: [AUTO's cost model]; each with the implementation that would run: AUTO's pick, or
the one given), the loop's price raised by :data:`LOOP_EXAMPLE_FLOPS` per example, and
keeps the cheaper; ``auto_choice(...).vmap_axes_reason`` says which and why. The warning is given
only where the loop is kept. Where either cannot be priced, the loop stays, as with axes the user
gave: those are never replaced.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Iterator

from .._utils.checks import user_stacklevel
from .per_example import VmapLimitation, first_line

LOOP_EXAMPLE_FLOPS = 5e7
"""What a loop adds per example (of x1, and of x2 where it is not x1) beyond the ATen calls AUTO's
cost model counts, in its FLOP equivalents (NOTE: [Loop or whole batches]): each example enters
the transforms, the pytree code and the model's Python anew. Fitted on the neighbour-list energy
of ``tests/test_loop_or_whole_batches.py`` (hidden width 16, default implementation, one thread,
the 2-core CPU of docs/benchmarks.md, 2026-11-28): at the rate whole batches ran at against their
estimate, the loop cost 3.6e7 (32 molecules of 8 atoms), 8.7e7 (32 of 16) and 1.5e8 (64 of 8)
FLOP equivalents per example more than its estimate (loop 39-77 ms, whole batches 9-20 ms);
the lower end keeps the loop wherever whole batches are not clearly cheaper."""


class ExampleLoopWarning(UserWarning):
    """torchntk evaluates the examples of ``vmap_axes`` one at a time, as vmap cannot run the model.

    Silence it with ``warnings.filterwarnings("ignore", category=torchntk.ExampleLoopWarning)``.
    """


class ExampleLoops:
    """A kernel function's warning that its examples are mapped by a loop, given once; which keys
    need the loop is a fact of their plans (NOTE: [The planning stage] in ``_plan/plan.py``)."""

    def __init__(self) -> None:
        self._warned = False
        self._lock = threading.Lock()
        self._held = threading.local()  # NOTE: [Thread-local state] in _utils/threads.py

    @contextlib.contextmanager
    def held(self) -> Iterator[list]:
        """Within, this thread's switches are collected in the list yielded instead of warned:
        the caller decides whether the loop is used (NOTE: [Loop or whole batches])."""
        outer = getattr(self._held, "errors", None)
        self._held.errors = errors = []
        try:
            yield errors
        finally:
            self._held.errors = outer

    def switch(self, error: VmapLimitation, where: str) -> None:
        """Warns on the first switch of this kernel function (outside :meth:`held`)."""
        errors = getattr(self._held, "errors", None)
        if errors is not None:
            errors.append(error)
            return
        with self._lock:
            if self._warned:
                return
            self._warned = True
        warnings.warn(
            f"{where}: torch.func.vmap cannot evaluate this model per example ({first_line(_root(error))}), so "
            f"the examples of `vmap_axes` are evaluated one at a time in a Python loop. The kernel is the "
            f"same; every pass over the examples costs one model call per example instead of one batched "
            f"call (for small models about N times the time vmap would take). vmap_axes=None evaluates "
            f"whole batches instead (O(N^2) work rather than O(N)). Shown once per kernel function.",
            ExampleLoopWarning,
            stacklevel=user_stacklevel(),
        )


def _root(error: BaseException) -> BaseException:
    """PyTorch's own error behind torchntk's explanations of it."""
    while True:
        behind = getattr(error, "original", None) or error.__cause__
        if behind is None:
            return error
        error = behind


def vmap_failure(error: BaseException) -> str:
    """The first line of PyTorch's own error behind ``error``, for messages."""
    return first_line(_root(error))
