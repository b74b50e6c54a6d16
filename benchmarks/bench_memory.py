#!/usr/bin/env python
"""Kernels planned within a memory budget (issue 27): ``batch_size="auto"`` against hand-tuned ones.

For the MLP 784-512-512-10 and the CNN 3 x [Conv2d 3x3, 32 channels] of ``docs/benchmarks.md``, the
traced NTK (``trace_axes=(-1,)``, ``vmap_axes=0``, x2 None, float32, AUTO: ``implementation=0``) of
N examples is computed by ``torchntk.batch`` with

* ``batch_size="auto"`` and the default budget (half the available RAM), and with ``memory="2GB"``;
* every hand-tuned ``batch_size`` of ``--batch-sizes`` with the default cache (1 GiB) and no budget
  (``memory=math.inf``): what a user who guessed would run.

Reported per run: the wall time of one call (after a warm-up call on 64 examples, so that imports
are done; the call includes AUTO's choice and the plan for its shapes), the growth of the peak
resident memory over the call (``tests/_memory_grid.py`` says how it is measured: a child process
per run with ``MALLOC_MMAP_THRESHOLD_=65536``, ``malloc_trim``, ``VmHWM`` reset), the budget, the
span and cache the plan chose, the time over the best hand-tuned run's and whether the peak stayed
under the budget. Targets (issue 27): the automatic plan within 1.2x of the best hand-tuned time,
and never over the budget (with the measured slack of ``docs/batching.md``).

    python benchmarks/bench_memory.py                     # MLP N = 1000, 5000, 10000; CNN N = 1000, 2000
    python benchmarks/bench_memory.py --large             # adds MLP N = 20000 and CNN N = 5000
    python benchmarks/bench_memory.py --models mlp --mlp-sizes 2000 --batch-sizes 256,1024

The default run takes about 20 minutes on a 2-core CPU; ``--large`` about an hour more. On a shared
machine ``--repeats 2`` (the faster of two runs, each in its own process) steadies the ratios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, REPO_ROOT)

from _common import cpu_description, mem_description  # noqa: E402

MODELS = {"mlp": "mlp784", "cnn": "cnn"}  # tests/_memory_grid.build names
CNN_SCALE = 2  # 32 channels: the benchmark CNN


def worker(request: dict) -> dict:
    """One run, in this (child) process: see the module docstring."""
    import gc
    import math

    import torch

    import torchntk
    from tests import _memory_grid as grid
    from torchntk import batching

    torch.set_num_threads(request["threads"])
    model, shape = grid.build(MODELS[request["model"]], CNN_SCALE if request["model"] == "cnn" else 1)
    x = torch.randn(request["n"], *shape, generator=torch.Generator().manual_seed(1))
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=0)
    mode = request["mode"]
    plans = []
    original = batching.plan_spans

    def recorded(*args, **kwargs):
        plans.append(original(*args, **kwargs))
        return plans[-1]

    batching.plan_spans = recorded
    if mode == "auto":
        batched = torchntk.batch(ntk_fn, memory=request.get("memory"))
    else:
        batched = torchntk.batch(ntk_fn, batch_size=int(mode), memory=math.inf)
    batched(x[:64])
    plans.clear()
    gc.collect()
    grid._trim()
    base = grid._status("VmRSS")
    grid._reset_peak()
    start = time.perf_counter()
    kernel = batched(x)
    seconds = time.perf_counter() - start
    peak = grid._status("VmHWM") - base
    budget = torchntk._memory.resolve_budget(
        torchntk._memory.memory_argument(request.get("memory"), "bench_memory"), torch.device("cpu"))
    plan = plans[-1] if plans else None
    return {
        **request, "seconds": seconds, "peak": float(peak), "budget": budget if mode == "auto" else None,
        "span": None if plan is None else plan.span, "cache": None if plan is None else plan.cache,
        "pick": int(ntk_fn.auto_choice(x[:64]).implementation), "shape": list(kernel.shape),
    }


def run(request: dict, timeout: float) -> dict:
    environment = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(request["threads"]))
    environment["PYTHONPATH"] = os.pathsep.join([REPO_ROOT] + environment.get("PYTHONPATH", "").split(os.pathsep))
    try:
        done = subprocess.run([sys.executable, __file__, "--worker"], input=json.dumps(request), capture_output=True,
                              text=True, timeout=timeout, env=environment, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        return {**request, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {**request, "error": last[:160]}
    return json.loads(lines[-1])


def table(rows: list[dict]) -> str:
    """The Markdown table. "/ best hand-tuned": the time over the fastest hand-tuned run whose peak
    stayed within the row's budget (for hand-tuned rows, over the fastest hand-tuned run)."""
    lines = [
        "| model | N | run | time (s) | peak (GB) | budget (GB) | span / cache limit | / best hand-tuned | "
        "within budget |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_case: dict = {}
    for row in rows:
        by_case.setdefault((row["model"], row["n"]), []).append(row)
    for (model, n), case in by_case.items():
        tuned = [row for row in case if row["mode"] != "auto" and "error" not in row]
        for row in case:
            limit = row.get("budget") or float("inf")
            fitting = [other["seconds"] for other in tuned if other["peak"] <= limit]
            best = min(fitting) if fitting else float("nan")
            name = f"auto, {row['memory'] or 'default'}" if row["mode"] == "auto" else f"batch_size={row['mode']}"
            if "error" in row:
                lines.append(f"| {model} | {n} | {name} | {row['error']} | | | | | |")
                continue
            budget = "" if row["budget"] is None else f"{row['budget'] / 1e9:.2f}"
            plan = "" if row["span"] is None else f"{row['span']} / {row['cache'] / 1e9:.2f} GB"
            if row["mode"] == "auto" and row["span"] is None:
                plan = "one call"
            within = "" if row["budget"] is None else ("yes" if row["peak"] <= row["budget"] else "NO")
            lines.append(
                f"| {model} | {n} | {name} | {row['seconds']:.1f} | {row['peak'] / 1e9:.2f} | {budget} | {plan} | "
                f"{row['seconds'] / best:.2f} | {within} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--mlp-sizes", default="1000,5000,10000")
    parser.add_argument("--cnn-sizes", default="1000,2000")
    parser.add_argument("--large", action="store_true", help="add MLP N = 20000 and CNN N = 5000")
    parser.add_argument("--batch-sizes", default="256,1024,4096", help="the hand-tuned batch sizes")
    parser.add_argument("--budgets", default="default,2GB", help="budgets of the automatic plan")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per run (default 1: on a shared 2-core machine two spinning OpenMP "
                             "threads made the same kernel 2-6x slower from run to run)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each configuration (each in its own process); the fastest is reported")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    arguments = parser.parse_args()
    if arguments.worker:
        print(json.dumps(worker(json.loads(sys.stdin.read()))), flush=True)
        return
    sizes = {"mlp": [int(n) for n in arguments.mlp_sizes.split(",") if n],
             "cnn": [int(n) for n in arguments.cnn_sizes.split(",") if n]}
    if arguments.large:
        sizes["mlp"].append(20000)
        sizes["cnn"].append(5000)
    budgets = [None if budget == "default" else budget for budget in arguments.budgets.split(",")]
    header = [
        f"command : python benchmarks/bench_memory.py {' '.join(sys.argv[1:])}".rstrip(),
        f"date    : {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"machine : {cpu_description()}, {mem_description()}; {platform.platform()}",
        f"threads : {arguments.threads}",
    ]
    print("\n".join(header), flush=True)
    rows = []
    for model in arguments.models.split(","):
        for n in sizes[model]:
            requests = [dict(model=model, n=n, mode="auto", memory=budget) for budget in budgets]
            requests += [dict(model=model, n=n, mode=size, memory=None) for size in arguments.batch_sizes.split(",")]
            for request in requests:
                request["threads"] = arguments.threads
                runs = [run(request, arguments.timeout) for _ in range(max(1, arguments.repeats))]
                finished = [row for row in runs if "error" not in row]
                row = min(finished, key=lambda row: row["seconds"]) if finished else runs[-1]
                rows.append(row)
                shown = row.get("error") or f"{row['seconds']:.1f} s, peak {row['peak'] / 1e9:.2f} GB"
                print(f"{model} N={n} {request['mode']} {request['memory'] or ''}: {shown}", flush=True)
    text = table(rows)
    print(text)
    if arguments.markdown:
        with open(arguments.markdown, "w") as file:
            file.write("```\n" + "\n".join(header) + "\n```\n\n" + text + "\n")
        with open(os.path.splitext(arguments.markdown)[0] + ".json", "w") as file:
            json.dump(rows, file)


if __name__ == "__main__":
    main()
