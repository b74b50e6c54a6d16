"""Memory budgets, the refusal of kernels that do not fit, and out-of-memory errors at the kernel
boundary (NOTE: [Memory budgets], NOTE: [Out of memory at the kernel boundary]).

The memory *model* (what a call of each implementation holds at its peak) and the plans made
with it live beside the implementations, in ``_implementations/memory.py`` (NOTE: [Memory plans]);
this folder has what every layer needs: ``batch``, the kernel functions and the implementations.
"""

from .budget import (
    CPU_FRACTION,
    CUDA_FRACTION,
    NEEDS_BLOCKS,
    CallerPlan,
    available_bytes,
    default_budget,
    format_bytes,
    memory_argument,
    resolve_budget,
)
from .errors import KernelMemoryError, MemoryPlanWarning, is_allocation_failure, out_of_memory_boundary, release_memory

__all__ = [
    "CPU_FRACTION", "CUDA_FRACTION", "NEEDS_BLOCKS", "CallerPlan", "available_bytes",
    "default_budget", "format_bytes", "memory_argument",
    "resolve_budget", "KernelMemoryError", "MemoryPlanWarning", "is_allocation_failure", "out_of_memory_boundary",
    "release_memory",
]
