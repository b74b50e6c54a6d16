#!/usr/bin/env python
"""The GPU measurements of issue 15 that ``python -m torchntk bench`` does not make.

Two parts (``--parts profile,large``), on ``--device`` (default ``cuda``; ``cpu`` runs the same
code with small sizes, which is how it is tested on machines without a GPU):

* **large**: the traced NTK (``trace_axes=(-1,)``, ``x2=None``, float32, ``vmap_axes=0``) of a
  ResNet-18 with 10 logits on 3x32x32 inputs (``torchntk/cli/_models.py: ResNet18``, in eval
  mode) for ``--n`` examples (10,000), computed by ``torchntk.batch(..., store_on_device=False)``
  with ``--batch-size`` and ``--cache-bytes``, implementation ``--implementation`` (3). Reported:
  the wall time of one call after a warm-up call on ``--warmup-n`` examples, the peak device
  memory during the call (``torch.cuda.max_memory_allocated`` less what was allocated before),
  and the throughput in kernel entries per second (``n * n`` entries, of which the symmetric
  half is computed).
* **profile**: ``torch.profiler`` over ``--profile-calls`` calls of implementation 3 on
  ResNet-18 with 8 logits, 3x224x224 inputs, N1 = N2 = 8, the full kernel: the operations with
  the most device time (CPU time on the CPU), the table that says where structured derivatives
  spend their time on a GPU.

Output: markdown on standard output, with the device and the command; the parts in the order
``--parts`` gives, by default the profile first and the large kernel's one-row table last (the GPU
check of the shared folder keeps only the last 25 lines of the log).

Example (the issue's settings; takes minutes on a GPU)::

    python benchmarks/bench_cuda.py --device cuda
    python benchmarks/bench_cuda.py --device cpu --n 64 --warmup-n 8 --profile-n 1   # a smoke test
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchntk  # noqa: E402
from torchntk.cli._models import ResNet18, inputs, seeded  # noqa: E402


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def large(args: argparse.Namespace, device: torch.device) -> list[str]:
    model = seeded(lambda: ResNet18(10))().to(device)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=args.implementation)
    batched = torchntk.batch(ntk_fn, args.batch_size, store_on_device=False, devices=[str(device)],
                             cache_bytes=args.cache_bytes)
    batched(inputs((3, 32, 32), args.warmup_n, torch.float32, device))  # plans, caches, lazy initialisation
    x = inputs((3, 32, 32), args.n, torch.float32, device)
    _synchronize(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    kernel = batched(x)
    _synchronize(device)
    seconds = time.perf_counter() - start
    peak = f"{(torch.cuda.max_memory_allocated(device) - before) / 2**20:.0f}" if device.type == "cuda" else "—"
    finite = bool(torch.isfinite(kernel).all())
    return [
        "## Large kernel: ResNet-18 (10 logits), 3x32x32, traced, x2=None, host memory",
        "",
        f"implementation {args.implementation}, batch_size {args.batch_size}, cache_bytes {args.cache_bytes}, "
        f"warm-up on {args.warmup_n} examples",
        "",
        "| N | kernel | time [s] | peak device memory [MiB] | kernel entries / s | finite |",
        "|---|---|---|---|---|---|",
        f"| {args.n} | {tuple(kernel.shape)} {kernel.device} | {seconds:.2f} | {peak} | {args.n ** 2 / seconds:.3g} "
        f"| {finite} |",
        "",
    ]


def profile(args: argparse.Namespace, device: torch.device) -> list[str]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    model = seeded(lambda: ResNet18(8))().to(device)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=3)
    x = inputs((3, 224, 224), 2 * args.profile_n, torch.float32, device)
    x1, x2 = x[: args.profile_n], x[args.profile_n:]
    ntk_fn(x1, x2)
    _synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profiler(activities=activities) as recorded:
        for _ in range(args.profile_calls):
            ntk_fn(x1, x2)
        _synchronize(device)
    averages = recorded.key_averages()
    key = "self_cpu_time_total"
    if device.type == "cuda":  # PyTorch 2.4 renamed the CUDA times to device times
        key = "self_device_time_total" if hasattr(averages[0], "self_device_time_total") else "self_cuda_time_total"
    table = averages.table(sort_by=key, row_limit=args.profile_rows, max_name_column_width=60)
    return [
        f"## Where structured derivatives spend their time: ResNet-18 (8 logits), 224x224, N1=N2={args.profile_n}, "
        f"full kernel, {args.profile_calls} calls",
        "",
        "```",
        table,
        "```",
        "",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="where to compute (default cuda)")
    parser.add_argument("--parts", default="profile,large",
                        help="comma list of profile, large, printed in this order (default both, the table last)")
    parser.add_argument("--n", type=int, default=10_000, help="examples of the large kernel (default 10000)")
    parser.add_argument("--warmup-n", type=int, default=256, help="examples of its warm-up call (default 256)")
    parser.add_argument("--batch-size", type=int, default=256, help="batch's batch_size (default 256)")
    parser.add_argument("--cache-bytes", type=int, default=torchntk.batching.DEFAULT_CACHE_BYTES,
                        help="batch's cache_bytes (default 1 GiB)")
    parser.add_argument("--implementation", type=int, default=3, help="NTK implementation (default 3)")
    parser.add_argument("--profile-n", type=int, default=8, help="N1 = N2 of the profiled kernel (default 8)")
    parser.add_argument("--profile-calls", type=int, default=5, help="profiled calls (default 5)")
    parser.add_argument("--profile-rows", type=int, default=25, help="operations listed (default 25)")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        "# torchntk on one device: a large kernel and a profile (issue 15)",
        "",
        f"command: python benchmarks/bench_cuda.py {' '.join(sys.argv[1:])}".rstrip(),
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; device: {device} ({name}); "
        f"torch {torch.__version__}, torchntk {torchntk.__version__}",
        "",
    ]
    parts = {"large": large, "profile": profile}
    for part in args.parts.split(","):
        lines += parts[part.strip()](args, device)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
