"""Hutchinson's trace estimator with seeded Rademacher probes.

For a symmetric ``A`` and probes ``z`` with independent entries ``+1``/``-1`` (equally likely),
``E[z . A z] = trace A``: each probe gives one unbiased sample, and the mean of ``p`` samples has
standard error ``std / sqrt(p)`` (the sample standard deviation, ``p - 1`` in the denominator).
Rademacher probes have the smallest variance among probes with independent, zero-mean, unit-variance
entries: ``Var[z . A z] = 2 (||A||_F^2 - sum_i A_ii^2)``.

Probe ``i`` is drawn, on the CPU, as the ``i``-th draw of a generator seeded with ``seed``, one
probe at a time, so the probes depend on ``seed`` only, not on how many are evaluated together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

QuadraticForms = Callable[[torch.Tensor], torch.Tensor]
"""``(b, *shape) -> (b,)``: ``z . A z`` for each of a batch of probes."""


@dataclass(frozen=True)
class TraceEstimate:
    """A Hutchinson estimate of a trace.

    Attributes:
        estimate: the mean of the samples, an unbiased estimate of the trace.
        standard_error: the standard error of ``estimate``: the samples' standard deviation
            (``probes - 1`` in the denominator) divided by ``sqrt(probes)``.
        samples: ``(probes,)`` float64 tensor, ``z . A z`` for each probe ``z`` in order.
    """

    estimate: float
    standard_error: float
    samples: torch.Tensor

    @property
    def probes(self) -> int:
        """The number of probes."""
        return int(self.samples.numel())


def hutchinson(
    quadratic_forms: QuadraticForms, shape: tuple[int, ...], probes: int, *, seed: int, chunk_size: int,
    dtype: torch.dtype, device: torch.device,
) -> TraceEstimate:
    """Estimates ``trace A`` from ``probes`` (at least 2) Rademacher probes of shape ``shape``,
    evaluated ``chunk_size`` at a time."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for start in range(0, probes, chunk_size):
        count = min(chunk_size, probes - start)
        signs = torch.stack([torch.randint(0, 2, shape, generator=generator, dtype=torch.int8) for _ in range(count)])
        chunk = (2 * signs - 1).to(dtype=dtype, device=device)
        samples.append(quadratic_forms(chunk).detach().double().cpu().reshape(count))
    values = torch.cat(samples)
    standard_error = float(values.std(correction=1)) / probes**0.5
    return TraceEstimate(float(values.mean()), standard_error, values)
