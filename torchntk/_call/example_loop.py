"""When a kernel function maps its examples with a loop instead of vmap, and the warning it gives.

NOTE: [Switching to example loops]
``vmap_axes`` makes torchntk evaluate the model per example under ``torch.func.vmap``. Some
models cannot run there although their examples are independent: ``nn.LSTM``'s fused kernel has
no batching rule, Hugging Face's padding-mask code branches on tensor values. Such failures raise
a :class:`~torchntk._call.per_example.VmapLimitation` (from the vmap region itself, or from
``VmapAxesCheck`` once it has seen the same examples agree with the batch without vmap). A kernel
function then computes the call again with its examples mapped by a Python loop (NOTE: [Example
loops]) and remembers, per plan key, that vmap failed, so later calls start with the loop.
The loop evaluates the same per-example function, so the ``vmap_axes`` checks still apply to it
(a model that couples examples is still an error). It warns once per kernel function with
:class:`ExampleLoopWarning`, which says what the loop costs.
"""

from __future__ import annotations

import threading
import warnings

from .._utils.checks import user_stacklevel
from .per_example import VmapLimitation, first_line

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

    def switch(self, error: VmapLimitation, where: str) -> None:
        """Warns on the first switch of this kernel function."""
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
