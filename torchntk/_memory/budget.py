"""The memory a kernel call may use: the ``memory=`` argument, and the default budget.

NOTE: [Memory budgets]
A budget is a number of bytes one kernel call (or, in ``batch``, one device) may hold at its peak,
beyond what existed before the call (the model, the inputs). ``memory=`` takes it as an int or
float of bytes, a string with a unit (``"8GB"``, ``"512 MiB"``, ``"1.5e9"``), ``math.inf`` (plan
nothing: never chunk, never refuse) or None, the default: a fraction of the memory free on the
device *at the time of the call*:

* CUDA: ``CUDA_FRACTION`` (0.8) of ``torch.cuda.mem_get_info``'s free bytes plus what PyTorch's
  caching allocator has reserved but not allocated (free to PyTorch, not to the driver);
* CPU: ``CPU_FRACTION`` (0.5) of the kernel's ``MemAvailable`` (``/proc/meminfo``), or of the
  physical memory where that cannot be read (not Linux).

Why these fractions: the memory model is an estimate (docs/batching.md, "Memory plans", gives its
measured factor, at most 1.5 above or below the measured peak on the test grid), other processes
share a CPU's memory, and the CPU fraction leaves room for the copies Python and the allocator keep
(freed memory that ``malloc`` holds on to). A GPU is usually the process's own, and its allocator's
cache is counted as free, hence the larger fraction there.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

CPU_FRACTION = 0.5
"""The default budget on the CPU: this fraction of the available memory (NOTE: [Memory budgets])."""
CUDA_FRACTION = 0.8
"""The default budget on a CUDA device: this fraction of its free memory (NOTE: [Memory budgets])."""

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_AMOUNT = re.compile(r"^\s*(?P<number>[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?P<unit>[a-z]*)\s*$")


def memory_argument(value: Any, where: str, name: str = "memory") -> Optional[float]:
    """``value`` as a budget in bytes, or None for the default (NOTE: [Memory budgets]).

    Args:
        value: None; an int or float of bytes (``math.inf``: no limit); a string such as ``"8GB"``,
            ``"512MiB"``, ``"2e9"`` or ``"unlimited"``. Decimal units (kB, MB, GB, TB) are powers of
            1000, binary ones (KiB, MiB, GiB, TiB, or K, M, G, T alone) powers of 1024; case is ignored.
        where, name: the function and argument, for messages.

    Raises:
        TypeError: neither None, a number nor a string (bools included).
        ValueError: not positive, NaN, or a string that is no amount of memory.

    Example:
        >>> memory_argument("8GB", "f"), memory_argument("1.5 GiB", "f"), memory_argument(None, "f")
        (8000000000.0, 1610612736.0, None)
        >>> memory_argument("lots", "f")
        Traceback (most recent call last):
        ValueError: f: `memory` must be a number of bytes or a string such as '8GB' or '512MiB', got 'lots' (str).
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("inf", "unlimited"):
            return math.inf
        found = _AMOUNT.match(text)
        if found is None or found["unit"] not in _UNITS:
            raise ValueError(
                f"{where}: `{name}` must be a number of bytes or a string such as '8GB' or '512MiB', "
                f"got {_show(value)}."
            )
        amount = float(found["number"]) * _UNITS[found["unit"]]
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{where}: `{name}` must be None, a number of bytes or a string such as '8GB', got {_show(value)}."
        )
    else:
        amount = float(value)
    if not amount > 0:  # also NaN
        raise ValueError(f"{where}: `{name}` must be a positive amount of memory, got {_show(value)}.")
    return amount


def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def available_bytes(device: torch.device) -> float:
    """What ``device`` has free now: for CUDA, the driver's free bytes plus the caching allocator's
    unused reserve; for the CPU, ``MemAvailable`` (or the physical memory). ``inf`` if unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return float(free + max(0, cached))
    if device.type != "cpu":
        return math.inf  # no way to ask (mps, xla): plan nothing there
    return _cpu_available()


_READ_EVERY = 0.05
"""Seconds a reading of the CPU's available memory is reused: kernel calls of a few milliseconds in
a loop would otherwise spend a tenth of their time reading ``/proc/meminfo``."""
_LAST_READING: list = [-math.inf, math.inf]


def _cpu_available() -> float:
    now = time.monotonic()
    if now - _LAST_READING[0] < _READ_EVERY:
        return _LAST_READING[1]
    _LAST_READING[:] = [now, _read_cpu_available()]
    return _LAST_READING[1]


def _read_cpu_available() -> float:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return math.inf


def default_budget(device: torch.device) -> float:
    """The budget of a call that gives no ``memory=``: a fraction of what ``device`` has free."""
    fraction = CUDA_FRACTION if device.type == "cuda" else CPU_FRACTION
    return fraction * available_bytes(device)


def resolve_budget(memory: Optional[float], device: torch.device, caller: Optional["CallerPlan"] = None) -> float:
    """The budget in bytes: ``memory`` as given, or the default for ``device`` now; at most the
    budget of ``caller`` (NOTE: [Budgets of callers])."""
    own = default_budget(device) if memory is None else memory
    return own if caller is None else min(own, caller.budget)


# NOTE: [Budgets of callers]
# ``batch`` shares a device's budget between its workers and plans its own blocks. The kernel
# function it calls (once per block without vmap_axes, or once in all when the whole call fits)
# must then plan within the worker's share, not the whole device's. ``batch`` says so explicitly:
# a kernel function's ``KernelFnSpec.within(caller)`` is the same kernel function planning within
# ``caller.budget`` (``resolve_budget`` takes the smaller of it and the kernel function's own
# ``memory``). ``chunking=False`` asks the planning stage whether the call fits whole: where its
# memory plan would cut the call into blocks (or does not fit at all), the kernel function
# computes nothing and returns :data:`NEEDS_BLOCKS`, so that ``batch`` computes it by spans (whose
# prepared derivatives are cached) rather than by ``chunk_size`` (which prepares x1's runs again
# for every run of x2). No thread-local state and no exception carry the request: a kernel
# function called any other way plans within its own budget.


@dataclass(frozen=True)
class CallerPlan:
    """The budget a caller gives one kernel call (NOTE: [Budgets of callers]).

    Attributes:
        budget: bytes the call may plan for, at most.
        chunking: whether the call may cut itself into blocks to fit (else it returns
            :data:`NEEDS_BLOCKS`).
    """

    budget: float
    chunking: bool = True


class _NeedsBlocks:
    """The type of :data:`NEEDS_BLOCKS`."""

    def __repr__(self) -> str:
        return "NEEDS_BLOCKS"


NEEDS_BLOCKS = _NeedsBlocks()
"""What a kernel call planned with ``CallerPlan(..., chunking=False)`` returns, having computed
nothing, when it would need blocks to fit its budget (NOTE: [Budgets of callers])."""


def format_bytes(amount: float) -> str:
    """``"1.5 GB"``: bytes in decimal units, three significant digits.

    Example:
        >>> format_bytes(209715200000), format_bytes(64e6), format_bytes(1.5e9), format_bytes(512)
        ('210 GB', '64 MB', '1.5 GB', '512 B')
    """
    if not math.isfinite(amount):
        return "unlimited"
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if amount >= size:
            return f"{amount / size:.3g} {unit}"
    return f"{int(amount)} B"
