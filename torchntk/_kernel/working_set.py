"""How many examples one run of a per-example pass holds, so that memory does not grow with N.

NOTE: [Working-set runs]
Implementations 1 and 3 evaluate the model per example under ``vmap``: one batched pass whose
saved activations, kept for the backward passes, grow with the examples of the pass. For a
base-size transformer that is about 30 MB per 32-token example, so N = 64 took 2 GB beside a
kernel of a few kilobytes, while the Jacobians or factors these passes produce for LoRA or
BitFit parameters are a small fraction of that. Without a ``chunk_size``, such a kernel function
therefore cuts a pass whose activations would exceed :data:`WORKING_SET_BYTES` into runs of
examples (the activations are the memory model's count of one example, ``memory.kept_sizes``,
made once per key and shared with the memory plans), and prepares each run once and
keeps what it prepared (``BlockPlan.keep_prepared``): memory is then the prepared data of all
examples, as without runs, plus one run's activations. Runs of a few hundred token rows keep the
matrix products about as efficient as one pass of all examples (runs of 8 RoBERTa examples took
4% longer than one pass of 16 on this project's CPU). A ``chunk_size`` given by the user instead
bounds the prepared data as well, preparing x1's runs again for every run of x2.
"""

from __future__ import annotations

from typing import Optional

WORKING_SET_BYTES = 512 * 2**20
"""The activations one run of a per-example pass may hold."""


def working_set_run_length(examples: int, written_per_example: float, element: int) -> Optional[int]:
    """Examples per run for a mapped side of ``examples`` examples, each writing
    ``written_per_example`` elements of ``element`` bytes in its forward pass (the memory model's
    count, made once per key), or None when one pass of all of them stays within
    :data:`WORKING_SET_BYTES`."""
    per_example = written_per_example * element
    if examples <= 1 or not per_example or per_example * examples <= WORKING_SET_BYTES:
        return None
    return max(1, int(WORKING_SET_BYTES // per_example))
