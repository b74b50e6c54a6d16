#!/usr/bin/env python
"""Float32 accuracy and speed of implementation 1's blocked float64 accumulation.

Implementation 1 (Jacobian contraction) sums, for float32 Jacobians, each long contraction in
blocks whose partial products are added in float64, and the per-parameter terms in float64
(NOTE: [Accurate contraction] in ``torchntk/_layout/kernel_layout.py``). This script measures what that costs
and buys, per model and kernel, against a float64 reference:

* ``1 blocked``: implementation 1 as it is;
* ``1 single``: implementation 1 with the accumulation switched off (``accumulation_dtype``
  patched to return the operands' dtype and no blocks: one float32 product per parameter
  tensor, terms summed in float32), i.e. the library before the change;
* ``2`` and ``3``: NTK-vector products and structured derivatives, for reference.

The two variants of implementation 1 run in one worker in alternating calls, so that load from
other processes slows both alike (their peak RSS is the worker's, shared).

The reference is implementation 2 on a float64 copy of the model and inputs (its float64 error,
about 1e-15, is far below the float32 errors measured). Error: ``max|K - K64| / max|K64|``.

Models (float32, eval mode, seeded):

- **mlp**: 784-512-512-10 ReLU (``torchntk.cli._models``), x1, x2 of 64 examples;
- **cnn**: 3x[Conv2d 3x3 32ch + ReLU] -> Linear(8192, 10), NCHW (16, 3, 16, 16);
- **wideconv**: Conv2d(8, 512, 3) + ReLU, Conv2d(512, 512, 3) + ReLU (2.4M weights), mean
  over 4x4 pixels, Linear(512, 10); 8 examples;
- **resnet18**: torchvision's ResNet-18 layout built by hand (torchvision is not a dependency):
  7x7/2 stem + max pool, basic blocks [2, 2, 2, 2] of 64..512 channels, 10 classes, 11.2M
  parameters, BatchNorm in eval mode with non-trivial statistics; (4, 3, 32, 32), ``x2=None``
  (Jacobians of 11M parameters times 40 outputs take 1.8 GB in float32).

Kernels: ``full`` (``trace_axes=()``) and ``traced`` (``trace_axes=(-1,)``), ``vmap_axes=0``.
Every configuration runs in its own worker process (``_common.launch_worker``): a warm-up call,
then the median of ``--repeats`` calls; failures (e.g. ``NotImplementedError``, out of memory)
are reported in the table.

Run ``python benchmarks/bench_accuracy.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from typing import List, Tuple

from _common import (
    HERE,
    REPO_ROOT,
    add_common_arguments,
    fmt_diff,
    launch_worker,
    limit_threads,
    parse_list,
    peak_rss_mb,
    rel_diff,
    render,
    run_header,
    time_calls,
    worker_entry,
)

MODELS = ("mlp", "cnn", "wideconv", "resnet18")
KERNELS = {"full": (), "traced": (-1,)}
VARIANTS = ("1 blocked", "1 single", "2", "3")  # both 1s come from one worker, timed alternately
DEFAULT_KERNELS = {"mlp": "full,traced", "cnn": "full,traced", "wideconv": "full,traced", "resnet18": "traced"}
SEED = 0


# ===========================================================================
# Models (built identically in every worker from the seed).
# ===========================================================================

def _wideconv():
    import torch
    from torch import nn

    class WideConvolution(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(8, 512, 3, padding=1)
            self.wide = nn.Conv2d(512, 512, 3, padding=1)
            self.head = nn.Linear(512, 10)

        def forward(self, x):
            hidden = torch.relu(self.wide(torch.relu(self.stem(x))))
            return self.head(hidden.mean((2, 3)))

    return WideConvolution()


def _resnet18():
    import torch
    from torch import nn

    sys.path.insert(0, HERE)
    from _models import BasicBlock, _randomise_norms

    class ResNet18(nn.Module):
        def __init__(self, classes: int = 10):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(64),
                                      nn.ReLU(), nn.MaxPool2d(3, stride=2, padding=1))
            stages, channels = [], 64
            for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
                stages += [BasicBlock(channels, width, stride), BasicBlock(width, width)]
                channels = width
            self.stages = nn.Sequential(*stages)
            self.fc = nn.Linear(512, classes)

        def forward(self, x):
            return self.fc(torch.flatten(torch.mean(self.stages(self.stem(x)), (2, 3)), 1))

    model = ResNet18()
    _randomise_norms(model)
    return model


def build(name: str):
    """``(model, x1, x2)`` in float32; ``x2`` is None for the models run with ``x2=None``."""
    import torch

    from torchntk.cli._models import BENCH_MODELS

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        if name in BENCH_MODELS:
            choice = BENCH_MODELS[name]
            model, shape, n = choice.build(), choice.input_shape, {"mlp": 64, "cnn": 16}[name]
        elif name == "wideconv":
            model, shape, n = _wideconv(), (8, 4, 4), 8
        else:
            model, shape, n = _resnet18(), (3, 32, 32), 4
        x1, x2 = torch.randn(n, *shape), torch.randn(n, *shape)
    return model.float().eval(), x1, (None if name == "resnet18" else x2)


def describe(name: str) -> str:
    model, x1, x2 = build(name)
    parameters = sum(p.numel() for p in model.parameters())
    largest = max(p.numel() for p in model.parameters())
    return (f"{name}: {parameters:,} parameters (largest tensor {largest:,}); x1 {tuple(x1.shape)}, "
            f"x2 {'None' if x2 is None else tuple(x2.shape)}")


# ===========================================================================
# Worker side: one configuration per process.
# ===========================================================================

def _accumulation(on: bool) -> None:
    """``on=False``: implementation 1 as it was, one float32 product per parameter, float32 sums."""
    import torchntk._call.blocks
    import torchntk._layout.kernel_layout

    layout = torchntk._layout.kernel_layout
    if not hasattr(layout, "_bench_original"):
        layout._bench_original = (layout.accumulation_dtype, dict(layout.CONTRACTION_BLOCKS))
    dtype, blocks = layout._bench_original
    if not on:
        dtype, blocks = (lambda dtype, device: dtype), dict.fromkeys(blocks, sys.maxsize)
    layout.accumulation_dtype = torchntk._call.blocks.accumulation_dtype = dtype
    layout.CONTRACTION_BLOCKS.update(blocks)


def _interleaved(fn, repeats: int) -> dict:
    """Times implementation 1 with and without the accumulation in alternating calls, so that
    other load on the machine slows both alike. Returns ``{variant: (kernel, first, times)}``."""
    import gc
    import time

    kernels, firsts, times = {}, {}, {variant: [] for variant in ("1 blocked", "1 single")}
    for index in range(repeats + 1):
        for variant in ("1 blocked", "1 single") if index % 2 == 0 else ("1 single", "1 blocked"):
            _accumulation(variant == "1 blocked")
            kernels.pop(variant, None)
            gc.collect()
            start = time.perf_counter()
            kernels[variant] = fn()
            elapsed = time.perf_counter() - start
            if index:
                times[variant].append(elapsed)
            else:
                firsts[variant] = elapsed  # the warm-up call
    return {variant: (kernels[variant], firsts[variant], times[variant]) for variant in times}


def run_worker(spec: dict, res: dict) -> None:
    limit_threads(spec["threads"])
    import numpy as np
    import torch

    sys.path.insert(0, REPO_ROOT)
    import torchntk

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    res["threads"] = torch.get_num_threads()
    model, x1, x2 = build(spec["model"])
    variant = spec["variant"]
    if variant == "reference":
        model, x1 = model.double(), x1.double()
        x2 = None if x2 is None else x2.double()
        implementation = 2
    else:
        implementation = int(variant)
    fn = torchntk.empirical_ntk_fn(model, trace_axes=KERNELS[spec["kernel"]], vmap_axes=0,
                                   implementation=implementation)
    res["stage"] = "kernel"
    if variant == "1":
        runs = _interleaved(lambda: fn(x1, x2), spec["repeats"])
    else:
        runs = {variant: time_calls(lambda: fn(x1, x2), 0 if variant == "reference" else spec["repeats"])}
    res.update(ok=True, peak_rss_mb=peak_rss_mb(), variants={})
    for name, (out, first, times) in runs.items():
        path = f"{spec['kernel_out']}.{name.replace(' ', '_')}.npy"
        np.save(path, out.detach().double().numpy())
        res["variants"][name] = {"first_s": first, "times": times, "median_s": statistics.median(times or [first]),
                                 "dtype": str(out.dtype), "kernel_out": path}


def worker_main(spec_path: str) -> int:
    return worker_entry(spec_path, run_worker)


# ===========================================================================
# Driver.
# ===========================================================================

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Float32 error and time of implementation 1 with and without "
                                             "its blocked float64 accumulation, against 2 and 3.")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--kernels", default=None,
                    help="comma list of full, traced (default: both; resnet18 traced only)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="comma list of '1 blocked', '1 single', 2, 3 (default: all)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls after the warm-up (default 3)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per worker (default: all cores)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration (default 900)")
    add_common_arguments(ap)
    args = ap.parse_args(argv)
    if args._worker:
        return worker_main(args._worker)
    models = parse_list(args.models, set(MODELS))
    variants = parse_list(args.variants, set(VARIANTS))
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    header, use_t, _ = run_header("# torchntk float32 accuracy benchmark", args, True, False, " (torch only)")
    if not use_t:
        print("\n".join(header))
        return 1
    sys.path.insert(0, REPO_ROOT)
    header += ["models  : " + line for line in map(describe, models)]
    header.append("error   : max|K - K64| / max|K64|, K64 = implementation 2 on a float64 copy")
    print("\n".join(header), flush=True)

    rows: List[List[str]] = []
    results: List[dict] = []
    failures: List[str] = []
    workers = sorted({"1" if variant.startswith("1") else variant for variant in variants})
    with tempfile.TemporaryDirectory(prefix="bench_accuracy_") as tmp:
        for name in models:
            kernels = parse_list(args.kernels or DEFAULT_KERNELS[name], set(KERNELS))
            for kernel in kernels:
                reference, why = _launch(args, tmp, name, kernel, "reference")
                if reference is None or not reference.get("ok"):
                    failures.append(f"{name} {kernel} reference: {why or reference.get('error')}")
                    continue
                reference_path = reference["variants"]["reference"]["kernel_out"]
                for worker in workers:
                    shown_before = len(rows)
                    res, why = _launch(args, tmp, name, kernel, worker)
                    results.append({"model": name, "kernel": kernel, "worker": worker, **(res or {"why": why})})
                    if res is None or not res.get("ok"):
                        reason = why or res.get("error_type", "failed")
                        failures.append(f"{name} {kernel} {worker}: {why or res.get('error')}")
                        shown = [v for v in variants if v.startswith(worker)]
                        rows += [[name, kernel, variant, reason, "—", "—"] for variant in shown]
                    else:
                        for variant, run in res["variants"].items():
                            if variant not in variants:
                                continue
                            diff, _ = rel_diff(run["kernel_out"], reference_path)
                            run["error"] = diff
                            rows.append([name, kernel, variant, f"{run['median_s']:.3f}", fmt_diff(diff),
                                         f"{res['peak_rss_mb']:.0f}"])
                    lines = render(HEADERS, rows, False).splitlines()[2:]
                    print("\n".join(lines[shown_before:]), flush=True)

    table = render(HEADERS, rows, False)
    print("\n" + table)
    if failures:
        print("\nFailures:\n" + "\n".join(f"- {f}" for f in failures))
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write("\n".join(["  \n".join(header), "", render(HEADERS, rows, True), ""]
                               + [f"- {f}" for f in failures]) + "\n")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


HEADERS = ["model", "kernel", "implementation", "median s", "error vs float64", "peak RSS MB"]


def _launch(args, tmp: str, name: str, kernel: str, variant: str) -> Tuple[dict, str]:
    stem = os.path.join(tmp, f"{name}-{kernel}-{variant.replace(' ', '_')}")
    spec = {"model": name, "kernel": kernel, "variant": variant, "repeats": args.repeats,
            "threads": args.threads, "result_out": stem + ".json", "kernel_out": stem + ".npy"}
    res, why = launch_worker(__file__, spec, stem, args.timeout, args.verbose)
    return res, why


if __name__ == "__main__":
    sys.exit(main())
