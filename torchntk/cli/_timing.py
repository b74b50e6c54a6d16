"""Timing for the command line: a warm-up call, then timed calls, synchronised on CUDA."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


def timed_calls(call: Callable[[], Any], repeats: int, device: torch.device) -> tuple[Any, list[float]]:
    """``(last result, seconds of each of the repeats timed calls)`` after one warm-up call (plans,
    caches and lazy initialisation happen there)."""
    result = call()
    seconds = []
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        result = call()
        _synchronize(device)
        seconds.append(time.perf_counter() - start)
    return result, seconds


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
