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

Implementation 3's pass holds more than the activations: its backward pass forms, for every
basis vector (``O`` per example), the cotangent of every output of an operation that consumes a
parameter (``G``, NOTE: [df/dy by perturbed passes] in ``structured/_side.py``), all at once. Its
runs count those too (the counted pass's ``parameter_outputs``, ``O`` times), and AUTO's pick
runs with the runs of the implementation it picked. On a RoBERTa-base-size model with BitFit (16
examples of 32 tokens, two label logits) the activations alone, 29 MB per example, fitted in
one pass, whose peak was 1,423 MB; with the 26 MB per example of ``G`` counted, two runs of 8
took 738 MB (``docs/benchmarks.md``).

Implementation 2 keeps x1 whole and pushes x2's parameter-space vectors through forward-mode
passes over all of it, several vectors (tangents) a pass under ``vmap``: every activation the pass
holds is then held once per tangent as well. :func:`forward_mode_tangents` bounds the tangents of
one pass so that they too stay within :data:`WORKING_SET_BYTES`, priced as the memory model prices
a forward-mode pass (``FORWARD_LIVE`` activations of the largest size per example and tangent,
NOTE: [Memory plans] in ``_implementations/memory.py``), plus the largest parameter's tangent,
which batched convolutions and matrix products copy once per tangent. Measured on a
RoBERTa-base-size LoRA model (16 examples of 32 tokens, whose LM head's logits, 1 MB per example,
are its largest activation): up to 24 tangents a pass (two passes of 14) held about 87 MB each
and took the process to 1,449-1,588 MB above its start; at most 10 (the bound) took it to
798-916 MB, and the call was faster (fewer pages to fault in). Where the bound applies, a pass
carries all tangents of a run of x2 over runs of x1 instead (NOTE: [Forward-mode passes over runs
of x1] in ``_implementations/ntk_vector_products.py``). Models with small activations (the
benchmark MLP and CNN, ResNet-18 at 32x32) keep 24 tangents a pass over all of x1.

On the CPU a second bound applies where the working set leaves 24 tangents a pass: the pass's
largest activation (tangents times x1's examples) stays within :data:`FRESH_PAGES_BYTES`. glibc's
malloc maps every allocation of 32 MiB or more on its own and unmaps it when it is freed, so each
such tensor of every pass comes as fresh pages that the kernel faults in and zeroes, which can
cost several times an elementwise step's arithmetic (on CI's 2-core CPU a fresh 42 MiB tensor took
39 ms to allocate and fill, an in-place add of the same size 9 ms). Fewer tangents a pass also put the passes over runs
of x1, whose primal is evaluated once per run of x2 instead of once per 24 tangents. Measured on
the grid CNN at scale 2 (32 channels of 16x16, 64 examples, full kernel, one thread), 20
tangents a pass over all of x1 (40 MiB activations) took 31-38 s a warm call, 12 a pass 16-19 s,
and glibc kept from unmapping (``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` set high)
14 s (``docs/benchmarks.md``). Where the working set already bounds the passes, this bound does not
lower them further: fewer tangents there make x2's runs shorter and evaluate x1's primal more
often (a RoBERTa-base-size head set at N = 16: 5.3 s with 10 tangents a pass, 8.9 s with 1). On
CUDA the caching allocator keeps freed blocks, and the bound does not apply.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .._implementations.memory import FORWARD_LIVE
from .._layout.runs import even_length

WORKING_SET_BYTES = 512 * 2**20
"""The activations one run of a per-example pass may hold."""
FRESH_PAGES_BYTES = 24 * 2**20
"""On the CPU, the largest activation of one of implementation 2's forward-mode passes (all its
tangents and examples): below glibc's largest threshold for mapping an allocation on its own (32
MiB), so that malloc reuses the memory of the pass before (NOTE: [Working-set runs])."""


def working_set_run_length(examples: int, written_per_example: float, element: int) -> Optional[int]:
    """Examples per run for a mapped side of ``examples`` examples, each writing
    ``written_per_example`` elements of ``element`` bytes in its forward pass (the memory model's
    count, made once per key), or None when one pass of all of them stays within
    :data:`WORKING_SET_BYTES`. The runs are as few as that bound allows and of equal lengths: 16
    examples of which 13 fit make two runs of 8, not 13 and 3 (the same passes, a smaller peak).

    Example:
        >>> working_set_run_length(16, WORKING_SET_BYTES // 13, 1), working_set_run_length(16, 1.0, 4)
        (8, None)
    """
    per_example = written_per_example * element
    if examples <= 1 or not per_example or per_example * examples <= WORKING_SET_BYTES:
        return None
    return even_length(examples, int(WORKING_SET_BYTES // per_example))


def forward_mode_tangents(
    examples: int, largest_per_example: float, largest_parameter: float, element: int, at_most: int,
    device: torch.device,
) -> Optional[int]:
    """Tangents per forward-mode pass of implementation 2 over ``examples`` examples (the whole x1
    batch; 1 without ``vmap_axes``, whose count is the whole batch's), each with a largest
    activation of ``largest_per_example`` elements, the largest parameter ``largest_parameter``
    elements: at most ``at_most``, and as many as keep the pass within :data:`WORKING_SET_BYTES`
    (at least one). None when ``at_most`` already does, except on the CPU where ``at_most``
    tangents would make the pass's largest activation exceed :data:`FRESH_PAGES_BYTES`: then as
    many as stay within that (NOTE: [Working-set runs]).

    Example:
        >>> cpu, cuda = torch.device("cpu"), torch.device("cuda")
        >>> forward_mode_tangents(64, 8192, 9216, 4, 24, cpu), forward_mode_tangents(64, 8192, 9216, 4, 24, cuda)
        (12, None)
    """
    activation = element * max(1, examples) * largest_per_example
    fitting = WORKING_SET_BYTES / (FORWARD_LIVE * activation + element * largest_parameter)
    if fitting < at_most:
        return max(1, math.floor(fitting))
    if device.type == "cpu" and activation * at_most > FRESH_PAGES_BYTES:
        return max(1, math.floor(FRESH_PAGES_BYTES / activation))
    return None
