#!/usr/bin/env python
"""The one-liner on a torchvision classifier as constructed (training mode, 1000 logits): AUTO's
plan, its estimated and measured peak, and the time of the call.

In training mode BatchNorm's batch statistics couple the examples, so nothing maps them and the
whole batch is differentiated at once; implementation 1 then runs over runs of the traced logits
(NOTE: [Runs of traced outputs] in ``torchntk/_implementations/jacobian_contraction.py``).

    python benchmarks/bench_training_mode.py                      # ResNet-18, 8 images 3x32x32
    python benchmarks/bench_training_mode.py --n 2 --classes 12 --memory 600MB   # seconds
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import torchntk  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18", help="a torchvision.models constructor")
    parser.add_argument("--n", type=int, default=8, help="images")
    parser.add_argument("--size", type=int, default=32, help="image height and width")
    parser.add_argument("--classes", type=int, default=1000, help="logits")
    parser.add_argument("--memory", default=None, help="memory= of the kernel function (default: its default)")
    parser.add_argument("--implementation", type=int, default=0, help="0: AUTO (the default)")
    args = parser.parse_args()

    from tests import zoo  # torchvision as the tests import it (its operators stubbed where CI asks)

    torchvision = zoo.import_torchvision()
    torch.manual_seed(0)
    model = getattr(torchvision.models, args.model)(weights=None, num_classes=args.classes)  # training mode
    x = torch.randn(args.n, 3, args.size, args.size)
    print(f"`python {' '.join(sys.argv)}`, {datetime.date.today()}, {platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, torchvision {torchvision.__version__}, {torch.get_num_threads()} threads")
    ntk_fn = torchntk.empirical_ntk_fn(model, implementation=args.implementation, memory=args.memory)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        choice = ntk_fn.auto_choice(x)
        chosen = time.perf_counter() - start
        start = time.perf_counter()
        kernel = ntk_fn(x)
        seconds = time.perf_counter() - start
    estimate = choice.estimates.get(choice.implementation)  # none for an implementation given
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes
    eigenvalues = torch.linalg.eigvalsh(kernel.double())
    print()
    print("| | value |")
    print("|---|---|")
    chunk = "" if estimate is None else f"`chunk_size={choice.chunk_size}`, "
    print(f"| the plan (first call's planning) | {chosen:.1f} s: implementation {int(choice.implementation)}, "
          f"{chunk}`vmap_axes` {choice.vmap_axes} ({choice.vmap_axes_reason}) |")
    if estimate is not None:  # otherwise the MemoryPlanWarning below states the plan's peak
        print(f"| planned peak (memory model) | {estimate.memory_bytes / 1e6:,.0f} MB |")
    print(f"| measured peak resident set of the process | {peak / 1e6:,.0f} MB |")
    print(f"| time of the call | {seconds:.0f} s |")
    print(f"| kernel | {' x '.join(map(str, kernel.shape))}, eigenvalues {eigenvalues.min():.3g} to "
          f"{eigenvalues.max():.3g} |")
    for message in dict.fromkeys(f"{type(warning.message).__name__}: {warning.message}" for warning in caught):
        print(f"- {message}")


if __name__ == "__main__":
    main()
