#!/usr/bin/env python
"""Every implementation and AUTO's choice on the real-model zoo of ``tests/zoo.py``.

For each model (torchvision ResNet-18, MobileNetV3-small, EfficientNet-B0 and a small ViT, a timm
ViT, Hugging Face BERT and GPT-2 with padding masks, nn.TransformerEncoder, nn.MultiheadAttention,
nn.LSTM, nn.GRU, a weight-norm MLP, a tied autoencoder, a hooked MLP), with ``N1`` and ``N2``
examples (x2 given), its ``vmap_axes`` and the full or traced kernel, this times implementations 1,
2 and 3 (a first call, then the median of ``--repeats`` calls), and AUTO: what it picks, the picked
implementation's time over the fastest one's, and what the choice costs (``choice_cost``: the
time of AUTO's ``choose`` on a new kernel function, less implementation 3's plan (its probe and
check) when 3 is picked and computes with it; median of ``--repeats``), also as a fraction of the
picked implementation's steady time. A configuration that raises is reported, not fatal.

    python benchmarks/bench_zoo.py                       # all models, full and traced kernels
    python benchmarks/bench_zoo.py --models lstm bert --kernels full --n1 16 --n2 16

The models need torchvision, timm and transformers (docs/real_models.md says how to install them).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchntk  # noqa: E402
from tests import zoo  # noqa: E402
from torchntk._implementations import auto as auto_module  # noqa: E402
from torchntk._implementations.auto import choose  # noqa: E402
from torchntk._implementations.structured import _contract  # noqa: E402

KERNELS = {"full": (), "traced": (-1,)}


def resized(case: zoo.Case, n1: int, n2: int) -> zoo.Case:
    """The case with ``n1`` and ``n2`` fresh examples of the same kind (token ids stay in range)."""

    def fresh(x: torch.Tensor, n: int) -> torch.Tensor:
        if x.is_floating_point():
            return torch.randn(n, *x.shape[1:], dtype=x.dtype)
        return torch.randint(0, int(x.max()) + 1, (n, *x.shape[1:]), dtype=x.dtype)

    def mask(n: int, like: torch.Tensor) -> torch.Tensor:
        made = torch.ones(n, *like.shape[1:], dtype=like.dtype)
        made[::2, like.shape[1] * 2 // 3:] = 0  # every other sequence padded
        return made

    kwargs = {key: (mask(n1, pair[0]), mask(n2, pair[1])) for key, pair in case.kwargs.items()}
    return case._replace(x1=fresh(case.x1, n1), x2=fresh(case.x2, n2), kwargs=kwargs)


def timed(call, repeats: int) -> tuple[float, float]:
    """``(first call, median of the next repeats)`` in seconds."""
    start = time.perf_counter()
    call()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times) if times else float("nan")


def cold(call) -> float:
    """The time of ``call`` with the contraction planners' caches emptied, as in a new process."""
    for cache in (_contract.pair_cost, _contract._expression, _contract._path):
        cache.cache_clear()
    return timed(call, 0)[0]


def choice_cost(case: zoo.Case, trace_axes: tuple, repeats: int) -> float:
    """What choosing adds, once per input shapes: the time AUTO's ``choose`` takes in ``auto_choice``
    on a new AUTO kernel function, planners' caches emptied, less the time it spends making
    implementation 3's plan (probe and check) when it picks 3 (the kernel then computes with that plan, as a kernel
    function of implementation 3 would). The median of ``repeats`` such choices."""
    spent: list[float] = []

    def timed_choose(call, plans, *args, **kwargs):
        planning = [0.0]

        def timed(make):
            def run():
                start = time.perf_counter()
                try:
                    return make()
                finally:
                    planning[0] += time.perf_counter() - start

            return run

        start = time.perf_counter()
        timed_plans = auto_module.StructuredPlans(
            timed(plans.unchecked), timed(plans.checked), timed(plans.layout_reason)
        )
        choice = choose(call, timed_plans, *args, **kwargs)
        reused = planning[0] if choice.implementation == torchntk.NtkImplementation.STRUCTURED_DERIVATIVES else 0.0
        spent.append(time.perf_counter() - start - reused)
        return choice

    with mock.patch.object(auto_module, "choose", timed_choose):
        for _ in range(max(repeats, 1)):
            ntk_fn = torchntk.empirical_ntk_fn(
                case.module, trace_axes=trace_axes, vmap_axes=case.vmap_axes, implementation=0,
                output_fn=case.output_fn,
            )
            cold(lambda: ntk_fn.auto_choice(case.x1, case.x2, **case.kwargs))
    return statistics.median(spent)


def measure(case: zoo.Case, trace_axes: tuple, repeats: int) -> dict:
    """Steady times of 1, 2, 3, AUTO's pick and what the choice costs (:func:`choice_cost`)."""
    row: dict = {}

    def builder(implementation: int):
        return torchntk.empirical_ntk_fn(
            case.module, trace_axes=trace_axes, vmap_axes=case.vmap_axes, implementation=implementation,
            output_fn=case.output_fn,
        )

    for implementation in (1, 2, 3):
        ntk_fn = builder(implementation)
        try:
            row[implementation] = timed(lambda: ntk_fn(case.x1, case.x2, **case.kwargs), repeats)[1]
        except Exception as error:  # noqa: BLE001 - reported in the table
            row[implementation] = f"{type(error).__name__}: {str(error).splitlines()[0][:60]}"
    auto = builder(0)
    row["picked"] = int(auto.auto_choice(case.x1, case.x2, **case.kwargs).implementation)
    row["choice_s"] = choice_cost(case, trace_axes, repeats)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=sorted({**zoo.FAST, **zoo.SLOW}))
    parser.add_argument("--kernels", nargs="*", default=list(KERNELS), choices=list(KERNELS))
    parser.add_argument("--n1", type=int, default=16)
    parser.add_argument("--n2", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    builders = {**zoo.FAST, **zoo.SLOW}
    warm_up = zoo.hooks()  # one-time costs of a process (imports, first kernels) stay out of the table
    for implementation in (0, 1, 2, 3):
        torchntk.empirical_ntk_fn(warm_up.module, vmap_axes=0, implementation=implementation)(warm_up.x1, warm_up.x2)
    print(f"N1={args.n1} N2={args.n2} threads={args.threads} repeats={args.repeats} torch {torch.__version__}")
    print(
        "| model | kernel | impl 1 (s) | impl 2 (s) | impl 3 (s) | AUTO picks | picked / fastest | choice (ms) "
        "| choice / picked |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        torch.manual_seed(0)
        case = resized(builders[name](), args.n1, args.n2)
        for kernel in args.kernels:
            row = measure(case, KERNELS[kernel], args.repeats)
            times = {k: row[k] for k in (1, 2, 3) if isinstance(row[k], float)}
            fastest = min(times.values()) if times else float("nan")
            picked = times.get(row["picked"], float("nan"))
            cells = [f"{row[k]:.3f}" if isinstance(row[k], float) else row[k] for k in (1, 2, 3)]
            print(
                f"| {name} | {kernel} | {' | '.join(cells)} | {row['picked']} | {picked / fastest:.2f} | "
                f"{row['choice_s'] * 1e3:.1f} | {row['choice_s'] / picked:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
