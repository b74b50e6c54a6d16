"""``batch_size="auto"``: the spans and cache of ``batch`` chosen within the memory budget.

NOTE: [Automatic tiling]
With ``batch_size="auto"`` (the default) ``batch`` plans its tiling from the memory budget of each
device (``memory=``, NOTE: [Memory budgets]) instead of taking a block size:

1. with one device, no ``out`` and at most :data:`~torchntk.batching._jobs.SPAN_ENTRIES` pairs of
   examples (one pair of spans' worth), the kernel function is first called whole, planning
   within the budget itself but told not to cut the call into blocks (NOTE: [Budgets of
   callers]); when it fits, that is the result, exactly as ``batch_size=0`` gives it. Larger
   kernels go by spans even when one call would fit: on the MLP 784-512-512-10 at N = 10,000 one
   call of structured derivatives took 58 s and 1.4 GB, spans of 256 examples 31 s and 1.0 GB;
2. otherwise (several workers or ranks, ``out=``, or a call that would need blocks) every device's
   budget is shared: the result, when it is kept on that device, comes off first, then the rest
   is split between the device's workers (``devices=["cuda:0"] * 2`` halves it);
3. with ``vmap_axes`` the span length ``L`` (examples of x1 and of x2 per span, and the unit of the
   tiling) and the cache are chosen by :func:`plan_spans`: a worker holds the memory model's peak
   of preparing and contracting two spans of ``L`` (``BlockSource.span_memory``), plus the prepared
   x2 spans it caches. Of the span lengths that fit (powers of two up to the longest useful one,
   :data:`~torchntk.batching._jobs.SPAN_ENTRIES` entries per pair, and a share per worker), the
   one that prepares the fewest examples in all (x1 once, x2 once if cached, again per row of
   spans if not), counting each pair of spans as :data:`PAIR_EXAMPLES` plus twice the span more,
   wins: on the benchmark MLP and CNN fewer, longer spans were faster as long as x2 stayed cached;
4. without ``vmap_axes`` each worker calls the kernel function on one share of the rows
   (``batch_size=0``'s blocks) within its part of the budget, and the kernel function plans its
   own blocks there.

A kernel that does not fit (the result alone, without ``out=``, or one example's spans) is refused
before it is computed with a :class:`~torchntk._memory.KernelMemoryError`. Spans depend on the
budget, so a resumed run (``progress_file``) reuses the recorded blocks only if it plans the same
spans; an int ``batch_size`` makes a resume independent of the memory free at the time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .._implementations.memory import PLANNED_SLACK
from .._memory import KernelMemoryError, available_bytes, format_bytes, resolve_budget

PAIR_EXAMPLES = 64.0
"""What a pair of spans costs beyond its preparations and contraction, in examples prepared: a
contraction's dispatch and its result's write (spans of 256 instead of 1024 examples cost 16 s
more for 725 more pairs on the MLP 784-512-512-10 at N = 10,000, about 50 examples' preparation
each). A pair also forms again what it contracts through (structured derivatives' convolution
Jacobians: twice the span), counted as ``2 * span`` more."""


@dataclass(frozen=True)
class SpanPlan:
    """The tiling :func:`plan_spans` chose.

    Attributes:
        span: examples per span of x1 and x2, also the tiling's unit (``batch_size``).
        cache: bytes of prepared spans each worker keeps.
        peak: the modelled peak of one worker, in bytes.
        budget: each worker's budget, in bytes.
    """

    span: int
    cache: float
    peak: float
    budget: float


def worker_budget(
    memory: Optional[float], devices: Sequence[torch.device], result_bytes: float, store_device: torch.device,
) -> float:
    """Each worker's share of its device's budget, the smallest over the devices (NOTE: [Automatic
    tiling]); ``result_bytes``: the result kept on ``store_device`` (0 with ``out=``).

    Raises:
        KernelMemoryError: the result alone exceeds the budget of the device it is kept on.
    """
    shares = []
    for device in dict.fromkeys(devices):
        budget = resolve_budget(memory, device)
        if device == store_device:
            budget -= result_bytes
        shares.append(budget / sum(1 for other in devices if other == device))
    if store_device not in devices and result_bytes > resolve_budget(memory, store_device):
        shares.append(-1.0)
    if min(shares) <= 0:
        budget = resolve_budget(memory, store_device)
        free = available_bytes(store_device)
        factor, slack = PLANNED_SLACK
        # more memory is a way out only where the device has it free (NOTE: [Memory plans])
        more = (
            ", or allow more memory (memory=...)" if result_bytes * factor + slack < free
            else f" ({store_device} has {format_bytes(free)} free, too little to hold it, whatever memory= says)"
        )
        raise KernelMemoryError(
            f"batch: the kernel alone takes {format_bytes(result_bytes)} on {store_device}, more than (or all of) the "
            f"memory budget of {format_bytes(budget)}. Write it to disk block by block with "
            f"out=np.lib.format.open_memmap(...) (each worker then holds only its spans), trace more output axes, "
            f"or keep fewer outputs or examples{more}.",
            result_bytes, budget, kernel_alone=True,
        )
    return min(shares)


def plan_spans(
    n1: int, n2: int, per_example: float, span_memory: Callable[[int], float], budget: float, *, longest: int,
    mirrored: bool, cache_limit: Optional[float] = None,
) -> SpanPlan:
    """The span length and cache of NOTE: [Automatic tiling], step 3.

    Args:
        n1, n2: examples of x1 and x2.
        per_example: bytes one example's prepared derivatives take (measured on one example).
        span_memory: ``L -> bytes`` of preparing and contracting two spans of ``L`` examples.
        budget: one worker's budget in bytes.
        longest: the longest span worth considering (entries per pair, a share per worker).
        mirrored: x2 is None (spans of x1 serve as spans of x2).
        cache_limit: at most this many bytes of cache (the caller's ``cache_bytes``), or None.

    Raises:
        KernelMemoryError: not even spans of one example fit.

    Example:
        >>> plan = plan_spans(100, 100, 1e6, lambda length: 4e6 * length, 250e6, longest=100, mirrored=False)
        >>> plan.span, plan.cache >= 100 * 1e6       # every x2 span cached: each example prepared once
        (32, True)
    """
    longest = max(1, min(longest, max(n1, n2)))
    candidates = sorted({longest} | {2**k for k in range(64) if 2**k < longest}, reverse=True)
    best: Optional[tuple[float, int, float, float]] = None
    for span in candidates:
        work = span_memory(span)
        if work > budget:
            continue
        room = budget - work
        if cache_limit is not None:
            room = min(room, cache_limit)
        rows, columns = math.ceil(n1 / span), math.ceil(n2 / span)
        kept = columns if per_example <= 0 or room >= n2 * per_example else int(room // (span * per_example))
        again = columns - kept
        if mirrored:
            preparations = rows + again * (rows - 1) / 2
            pairs = rows * (rows + 1) / 2
        else:
            preparations = rows + columns + (rows - 1) * again
            pairs = rows * columns
        score = preparations * span + (PAIR_EXAMPLES + 2 * span) * pairs
        if best is None or score < best[0]:
            best = (score, span, room, work)
    if best is None:
        raise KernelMemoryError(
            f"batch: preparing and contracting spans of one example needs about {format_bytes(span_memory(1))}, more "
            f"than each worker's memory budget of {format_bytes(budget)}. Allow more memory (memory=...), use fewer "
            f"workers per device, another implementation, or fewer parameters (params=...) or outputs.",
            span_memory(1), budget,
        )
    _, span, room, work = best
    return SpanPlan(span, room, work + room, budget)
