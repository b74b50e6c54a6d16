#!/usr/bin/env python
"""The GPU measurements that ``python -m torchntk bench`` does not make.

Five parts (``--parts``, default ``large,profile``; ``memory``, ``compile`` and ``auto`` on request), on
``--device`` (default ``cuda``; ``cpu`` runs the same code with small sizes, which is how it is
tested on machines without a GPU):

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
* **memory**: the memory model's predicted peak of a call against the growth of
  ``torch.cuda.max_memory_allocated`` over it (``tests/_memory_grid.py``: ``measure_cuda``; on the
  CPU its child-process measurement), for the grid of ``docs/benchmarks.md`` ("Memory plans:
  predicted and measured peaks", ``--memory-grid full``, with the zoo of docs/real_models.md where
  its libraries import) or of the fast tests (``fast``), and planned calls within 64 MB and 16 MB
  budgets. Each row says whether it is within the documented factor (or budget).
* **compile**: ``compile=--compile-backend`` (inductor) against eager on the MLP at N = 16
  (traced), the FCN 3072-2048x3-8 at N = 16 and ResNet-18 (8 logits, 224x224) at N = 8 (full
  kernels), implementation 3, x1 and x2 different (``--compile-models`` picks; the CPU smoke test
  uses small sizes): the eager median, the first compiled call (eager call, trace and
  compilation), the replay median, whether a graph was kept, and the replay's largest difference
  from the eager kernel relative to its largest entry; on CUDA with inductor, whose replays are CUDA
  graphs, also the replay median of inductor's default mode (the same kernels, launched one by one).
* **auto**: implementations 1, 2 and 3 timed (median of 3 after a warm-up call) on the MLP and CNN
  at N = 8, 16, 32 (traced), the FCN at N = 16 and ResNet-18 at N = 8 (full), x1 and x2 different,
  beside the implementation AUTO picks for the same call (``auto_choice``): how well AUTO's
  price of an operation call on the device (``_OP_CALL_FLOPS`` in
  ``torchntk/_implementations/auto.py``) picks there.

Output: markdown on standard output, with the device and the command, the parts in the order
``--parts`` gives. Where the environment names a folder ``OUT`` (the device tool's), every part is
also appended to ``$OUT/bench_cuda.md`` as soon as it is done, so that a part cut short by a time
limit leaves the earlier ones: the shared GPU check gives this script 120 s and keeps only the last
25 lines of its log, and the two default parts took 118 s on an H100. The large kernel comes first,
as the measurement that part of the check has yet to record.

Example (the issue's settings; takes minutes on a GPU)::

    python benchmarks/bench_cuda.py --device cuda
    python benchmarks/bench_cuda.py --device cuda --parts memory,compile
    python benchmarks/bench_cuda.py --device cpu --n 64 --warmup-n 8 --profile-n 1   # a smoke test
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchntk  # noqa: E402
from torchntk.cli._models import ResNet18, inputs, seeded  # noqa: E402
from torchntk.cli._timing import timed_calls  # noqa: E402


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


def _memory_configs(grid_name: str) -> tuple[list[dict], list[str]]:
    """The configurations of the memory part, and a line for each part of the grid left out."""
    from tests import _memory_grid as grid

    if grid_name == "fast":
        return [*grid.FAST_GRID, *grid.GIGABYTE[:2], *grid.BATCHED], []
    configs, left_out = [*grid.FULL_GRID, *grid.GIGABYTE, *grid.BATCHED], []
    try:
        from tests import zoo

        zoo_cases = [*zoo.FAST, *zoo.SLOW]
    except Exception as error:  # noqa: BLE001 - the zoo is optional here
        return configs, [f"the zoo of docs/real_models.md: not importable ({type(error).__name__}: {error})"]
    for name in zoo_cases:
        cnn = name in ("resnet18", "mobilenet_v3_small", "efficientnet_b0")
        for implementation in (1, 3) if cnn else (1, 2, 3):  # 2 on the CNNs takes minutes (docs/benchmarks.md)
            configs.append({"model": f"zoo:{name}", "n1": 16, "n2": 16, "implementation": implementation,
                            "trace_axes": (-1,), "memory": "inf"})
    return configs, left_out


def _measure_rows(configs: list[dict], device: torch.device) -> list[dict]:
    """Each configuration measured on ``device``; a failure (a library the zoo lacks, an error) is
    a row with its ``error``, so that one configuration cannot lose the table."""
    from tests import _memory_grid as grid

    if device.type != "cuda":  # the CPU's peak needs a process of its own (tests/_memory_grid.py)
        return grid.run_grid(configs, timeout=1800)
    rows = []
    for config in configs:
        try:
            rows.append(grid.measure_cuda(config, device))
        except Exception as error:  # noqa: BLE001 - recorded in the table
            rows.append(dict(config, error=f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"))
            torch.cuda.empty_cache()
        _progress(rows[-1])
    return rows


def _progress(row: object) -> None:
    """A row on standard error as soon as it is measured: a part cut short by a time limit still
    leaves its rows in the log."""
    print(f"bench_cuda: {row}", file=sys.stderr, flush=True)


def memory(args: argparse.Namespace, device: torch.device) -> list[str]:
    from tests import _memory_grid as grid
    from torchntk._memory import memory_argument

    configs, left_out = _memory_configs(args.memory_grid)
    start = time.perf_counter()
    rows = _measure_rows(configs, device)
    seconds = time.perf_counter() - start
    factor, slack = grid.PREDICTION_FACTOR, grid.PREDICTION_SLACK / 1e6
    budget_factor, budget_slack = grid.BUDGET_SLACK
    lines = [
        f"## Memory plans: predicted against measured peaks ({args.memory_grid} grid, {len(rows)} calls, "
        f"{seconds:.0f} s)",
        "",
        "measured: " + ("growth of torch.cuda.max_memory_allocated over the second call"
                        if device.type == "cuda" else "growth of the peak resident set (tests/_memory_grid.py)")
        + f"; ok: predicted within {factor:g}x either way or within {slack:g} MB (unlimited budget), "
        f"or measured under {budget_factor:g} x budget + {budget_slack / 1e6:g} MB (a planned call)",
        *(f"left out: {line}" for line in left_out),
        "",
        "| model | impl | kernel | n1 | x2 | budget | chunk_size | predicted (MB) | measured (MB) "
        "| predicted / measured | time [s] | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    failed = []
    for row in rows:
        kernel = "traced" if tuple(row["trace_axes"]) else "full"
        head = (f"| {row['model']} | {row['implementation']} | {kernel} | {row['n1']} | {row['n2']} "
                f"| {row['memory']}{' (batch)' if row.get('batch') else ''}")
        if "error" in row:
            lines.append(f"{head} | — | — | — | — | — | {row['error']} |")
            failed.append(row)
            continue
        predicted, measured = row.get("predicted"), row["measured"]
        if row.get("batch") or not math.isinf(memory_argument(row["memory"], "bench_cuda")):
            ok = grid.within_budget(row)
        else:
            ok = not grid.prediction_errors([row])
        ratio = f"{predicted / measured:.2f}" if predicted and measured > 0 else "—"
        shown = f"{predicted / 1e6:.1f}" if predicted is not None else "—"
        lines.append(f"{head} | {row.get('chunk_size')} | {shown} | {measured / 1e6:.1f} | {ratio} "
                     f"| {row['seconds']:.3f} | {'yes' if ok else 'NO'} |")
        if not ok:
            failed.append(row)
    lines += ["", f"{len(rows) - len(failed)} of {len(rows)} rows ok; not ok: "
              + (", ".join(f"{row['model']} impl {row['implementation']}" for row in failed) or "none"), ""]
    return lines


def auto_picks(args: argparse.Namespace, device: torch.device) -> list[str]:
    from torchntk.cli._models import BENCH_MODELS

    small = device.type != "cuda"
    configs = [("mlp", n, (-1,)) for n in (8, 16, 32)] + [("cnn", n, (-1,)) for n in (8, 16, 32)]
    configs += [("fcn", 16, ()), ("resnet18", 8, ())]
    if small:  # the CPU smoke test
        configs = [("mlp", 4, (-1,)), ("cnn", 4, (-1,))]
    lines = [
        "## AUTO's pick against the fastest implementation, timed in the same run",
        "",
        "| model | N | kernel | impl 1 [ms] | impl 2 [ms] | impl 3 [ms] | AUTO picks | fastest | pick / fastest |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, n, trace_axes in configs:
        choice = BENCH_MODELS[name]
        try:
            model = choice.build().to(device)
            x = inputs(choice.input_shape, 2 * n, torch.float32, device)
            x1, x2 = x[:n], x[n:]
            times = {}
            for implementation in (1, 2, 3):
                ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=trace_axes, vmap_axes=0,
                                                   implementation=implementation)
                times[implementation] = _timed(lambda: ntk_fn(x1, x2), device, 1 if small else 3)
            automatic = torchntk.empirical_ntk_fn(model, trace_axes=trace_axes, vmap_axes=0, implementation=0)
            pick = int(automatic.auto_choice(x1, x2).implementation)
            fastest = min(times, key=times.get)
            lines.append(
                f"| {name} | {n} | {'traced' if trace_axes else 'full'} | "
                + " | ".join(f"{times[i] * 1e3:.1f}" for i in (1, 2, 3))
                + f" | {pick} | {fastest} | {times[pick] / times[fastest]:.2f} |"
            )
            _progress(lines[-1])
        except Exception as error:  # noqa: BLE001 - recorded in the table
            lines.append(f"| {name} | {n} | — | — | — | — | — | — | {type(error).__name__}: {error} |")
            traceback.print_exc()
    return [*lines, ""]


def compiled(args: argparse.Namespace, device: torch.device) -> list[str]:
    from torchntk.cli._models import BENCH_MODELS

    small = device.type != "cuda"  # the CPU smoke test: small models, few calls
    settings = {"mlp": (16, (-1,)), "fcn": (16, ()), "resnet18": (8, ())}
    lines = [
        f"## Captured kernels: compile={args.compile_backend!r} against eager, implementation 3, x1 and x2 different",
        "",
        "| model | N | kernel | eager [ms] | first compiled call [s] | replay [ms] | eager / replay | graph kept "
        "| replay vs eager (rel. to max) | replay without CUDA graphs [ms] | warnings |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    # inductor replays CUDA graphs on CUDA (NOTE: [CUDA graph replays]); its default mode, timed beside
    # them, is the same compiled kernels launched one by one
    plain_mode = device.type == "cuda" and args.compile_backend == "inductor"
    for name in args.compile_models.split(","):
        n, trace_axes = settings[name]
        choice = BENCH_MODELS[name]
        if small:
            n = 2
        try:
            model = choice.build().to(device)
            x = inputs(choice.input_shape if not (small and name == "resnet18") else (3, 32, 32), 2 * n,
                       torch.float32, device)
            x1, x2 = x[:n], x[n:]
            eager_fn = torchntk.empirical_ntk_fn(model, trace_axes=trace_axes, vmap_axes=0, implementation=3)
            eager = _timed(lambda: eager_fn(x1, x2), device, 2 if small else 5)
            fast = torchntk.empirical_ntk_fn(model, trace_axes=trace_axes, vmap_axes=0, implementation=3,
                                             compile=args.compile_backend)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                start = time.perf_counter()
                fast(x1, x2)
                _synchronize(device)
                first = time.perf_counter() - start
                replay = _timed(lambda: fast(x1, x2), device, 2 if small else 10)
            reference, again = eager_fn(x1, x2), fast(x1, x2)
            difference = float((again - reference).abs().max() / reference.abs().max())
            plain = "—"
            if plain_mode:
                plain_fn = torchntk.empirical_ntk_fn(model, trace_axes=trace_axes, vmap_axes=0, implementation=3,
                                                     compile={"backend": "inductor", "mode": "default"})
                plain_fn(x1, x2)
                plain = f"{_timed(lambda: plain_fn(x1, x2), device, 10) * 1e3:.2f}"
            kept = not any("computed eagerly" in str(warning.message) for warning in caught)  # captured.py's refusal
            said = "; ".join(sorted({str(warning.message)[:100] for warning in caught
                                     if not issubclass(warning.category, (DeprecationWarning, FutureWarning))}))
            lines.append(
                f"| {name} | {n} | {'traced' if trace_axes else 'full'} | {eager * 1e3:.2f} | {first:.1f} "
                f"| {replay * 1e3:.2f} | {eager / replay:.2f}x | {kept} | {difference:.1e} | {plain} | {said or 'none'} |"
            )
            _progress(lines[-1])
        except Exception as error:  # noqa: BLE001 - recorded in the table
            lines.append(f"| {name} | {n} | — | — | — | — | — | — | — | — | {type(error).__name__}: {error} |")
            traceback.print_exc()
    return [*lines, ""]


def _timed(call, device: torch.device, repeats: int) -> float:
    """The median wall time of ``repeats`` synchronised calls, after a warm-up call."""
    return statistics.median(timed_calls(call, repeats, device)[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="where to compute (default cuda)")
    parser.add_argument("--parts", default="large,profile",
                        help="comma list of profile, large, memory, compile, auto, run and printed in this "
                             "order (default large,profile)")
    parser.add_argument("--n", type=int, default=10_000, help="examples of the large kernel (default 10000)")
    parser.add_argument("--warmup-n", type=int, default=256, help="examples of its warm-up call (default 256)")
    parser.add_argument("--batch-size", type=int, default=256, help="batch's batch_size (default 256)")
    parser.add_argument("--cache-bytes", type=int, default=torchntk.batching.DEFAULT_CACHE_BYTES,
                        help="batch's cache_bytes (default 1 GiB)")
    parser.add_argument("--implementation", type=int, default=3, help="NTK implementation (default 3)")
    parser.add_argument("--profile-n", type=int, default=8, help="N1 = N2 of the profiled kernel (default 8)")
    parser.add_argument("--profile-calls", type=int, default=5, help="profiled calls (default 5)")
    parser.add_argument("--profile-rows", type=int, default=25, help="operations listed (default 25)")
    parser.add_argument("--memory-grid", choices=("full", "fast"), default="full",
                        help="the memory part's grid: docs/benchmarks.md's with the zoo (full, default) or the "
                             "fast tests' (fast)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="the compile part's torch.compile backend (default inductor, which is compile=True)")
    parser.add_argument("--compile-models", default="mlp,fcn,resnet18",
                        help="the compile part's models, from mlp, fcn, resnet18 (default all three)")
    args = parser.parse_args()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        "# torchntk on one device: what python -m torchntk bench does not measure",
        "",
        f"command: python benchmarks/bench_cuda.py {' '.join(sys.argv[1:])}".rstrip(),
        f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; device: {device} ({name}); "
        f"torch {torch.__version__}, torchntk {torchntk.__version__}",
        "",
    ]
    parts = {"large": large, "profile": profile, "memory": memory, "compile": compiled, "auto": auto_picks}
    wanted = [part.strip() for part in args.parts.split(",")]
    unknown = [part for part in wanted if part not in parts]
    if unknown:
        parser.error(f"--parts: unknown part(s) {', '.join(unknown)}; choose from {', '.join(parts)}")
    report = None
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        report = os.path.join(os.environ["OUT"], "bench_cuda.md")

    def emit(text: list[str]) -> None:
        print("\n".join(text), flush=True)
        if report is not None:
            with open(report, "a") as written:
                written.write("\n".join(text) + "\n")

    emit(lines)
    for part in wanted:
        emit(parts[part](args, device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
