"""What a kernel call says about memory: the refusal, the notice of a plan, and real out-of-memory errors.

NOTE: [Out of memory at the kernel boundary]
A kernel is planned within its budget before anything large is allocated (NOTE: [Memory plans] in
``_implementations/memory.py``), but the plan is an estimate, and other processes take memory too.
An allocator error that still happens inside the computation (``torch.OutOfMemoryError`` on CUDA,
the CPU allocator's "can't allocate memory" RuntimeError, Python's MemoryError) is caught where the
kernel function hands over to its implementation, and re-raised as a :class:`KernelMemoryError`
that names the plan attempted and the ways out. The original error is not chained: its traceback
holds the frames, and so the tensors, of the failed computation; they are released first, then
the CUDA caching allocator's cache (``torch.cuda.empty_cache``), so that the process can go on
with a smaller plan instead of with a fragmented, full device. PyTorch's message is quoted.
"""

from __future__ import annotations

import gc
from typing import Callable, Optional, TypeVar

import torch


T = TypeVar("T")


class KernelMemoryError(MemoryError):
    """A kernel that does not fit in its memory budget, refused before it is computed, or a
    computation that ran out of memory anyway (then the plan it attempted is named).

    Catch it as ``torchntk.KernelMemoryError`` or as any ``MemoryError``.

    Attributes:
        needed_bytes: the estimated peak of the smallest plan (or of the result alone), in bytes;
            None when an allocation failed during the computation.
        budget_bytes: the budget it was measured against, in bytes; after an allocation failure,
            the budget the failed plan was made within.
        kernel_alone: whether the kernel itself (the result) exceeds the budget, which no plan of
            the computation can change (``batch(..., out=...)`` writes it to disk instead).
    """

    def __init__(
        self, message: str, needed_bytes: Optional[float] = None, budget_bytes: Optional[float] = None,
        kernel_alone: bool = False,
    ):
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.budget_bytes = budget_bytes
        self.kernel_alone = kernel_alone


class MemoryPlanWarning(UserWarning):
    """torchntk computes a kernel in blocks (an automatic ``chunk_size``) to stay within its memory
    budget; the message says which blocks and why. Shown once per kernel function.

    Silence it with ``warnings.filterwarnings("ignore", category=torchntk.MemoryPlanWarning)``, or
    choose ``chunk_size``/``memory`` yourself.
    """


def is_allocation_failure(error: BaseException) -> bool:
    """Whether ``error`` is an allocator's: CUDA's OutOfMemoryError, the CPU allocator's
    RuntimeError ("can't allocate memory"), Python's MemoryError (not our own refusals)."""
    if isinstance(error, KernelMemoryError):
        return False
    if isinstance(error, MemoryError) or isinstance(error, getattr(torch, "OutOfMemoryError", ())):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text)


def release_memory(device: torch.device) -> None:
    """Frees what the failed computation left: unreachable tensors, then the CUDA cache of ``device``."""
    gc.collect()
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()


def out_of_memory_boundary(
    compute: Callable[[], T], where: str, attempted: Callable[[], str], advice: str, device: torch.device,
    budget: Callable[[], Optional[float]] = lambda: None,
) -> T:
    """``compute()``, its allocation failures re-raised as a :class:`KernelMemoryError` (NOTE: [Out of
    memory at the kernel boundary]); ``attempted()`` describes the plan, ``advice`` the ways out,
    ``budget()`` is the budget in bytes it was planned within (the error's ``budget_bytes``).

    A function, not a context manager: ``__exit__`` runs while the error is still being handled,
    with its traceback (and the failed computation's tensors) alive.
    """
    said: Optional[str] = None
    try:
        return compute()
    except BaseException as error:  # noqa: BLE001 - only allocation failures are handled
        if not is_allocation_failure(error):
            raise
        said = f"{type(error).__name__}: {' '.join(str(error).split())[:400]}"
    # Out of the except clause: the failed computation's frames and tensors are unreachable now.
    release_memory(device)
    raise KernelMemoryError(
        f"{where}: ran out of memory computing the kernel with {attempted()}. {advice} PyTorch said: {said}",
        budget_bytes=budget(),
    )
