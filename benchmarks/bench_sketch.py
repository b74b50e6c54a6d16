#!/usr/bin/env python
"""Sketched NTKs (issue 14): error and time against ``k`` for the three projections.

For each model, the exact traced NTK of ``N`` examples (``x2=None``, ``vmap_axes=0``, float32) by
``torchntk.empirical_ntk_fn`` (``--exact-implementation``, default 1, Jacobian contraction) is the
reference. Then, for every projection (``gaussian``, ``sparse``, ``kronecker``) and every ``k``,
``torchntk.sketched_ntk_fn(model, k, vmap_axes=0, projection=..., seed=s)(x)`` runs for
``--seeds`` seeds. Reported: the median wall time of those calls (features of the ``N`` examples
plus their ``N x N`` contraction), the mean and standard deviation over seeds of the relative
Frobenius error ``||K_sketch - K|| / ||K||``, and what theory predicts for a dense Gaussian sketch
of the gradients, ``sqrt(sum_ij (K_ii K_jj + K_ij^2) / k) / ||K||`` (the traced logits' random signs
add a little to it). Once a call takes longer than
``--budget`` seconds the larger ``k`` of that projection are skipped (marked in the table).

Models (``benchmarks/_models.py``): **resnet**, the small ResNet (19,994 parameters, BatchNorm in
eval mode with non-trivial statistics) on 3x32x32 inputs; **mlp**, the MLP 784-512-512-10
(669,706 parameters), where the Kronecker projection never forms a per-example gradient.

Everything runs in this one process, one call at a time, with ``--threads`` torch threads
(default 1: on a loaded machine, OpenMP threads made small elementwise ops up to 100x slower).
Timings are wall-clock: other load on the machine inflates them (the load average is printed).

Run ``python benchmarks/bench_sketch.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

PROJECTIONS = ("gaussian", "sparse", "kronecker")
INPUT_SHAPES = {"resnet": (3, 32, 32), "mlp": (784,)}


def _arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="resnet,mlp", help="comma-separated: resnet, mlp")
    parser.add_argument("--n", type=int, default=64, help="examples (the kernel is N x N)")
    parser.add_argument("--ks", default="256,512,1024,2048,4096,8192", help="comma-separated sketch sizes")
    parser.add_argument("--projections", default=",".join(PROJECTIONS))
    parser.add_argument("--seeds", type=int, default=3, help="seeds per (projection, k)")
    parser.add_argument("--budget", type=float, default=120.0, help="skip larger k after a call this slow [s]")
    parser.add_argument("--exact-implementation", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--markdown", default=None, help="also write the tables to this file")
    return parser.parse_args(argv)


def _header(args) -> list[str]:
    import torch
    from _common import cpu_description, mem_description

    import torchntk

    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    return [
        f"command : python benchmarks/bench_sketch.py {' '.join(sys.argv[1:])}".rstrip(),
        f"date    : {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
        f"machine : {cpu_description()}, {mem_description()}; {platform.platform()}",
        f"torch   : {torch.__version__} ({torch.get_num_threads()} threads); torchntk {torchntk.__version__}",
        f"load    : 1/5/15-min load average {load} at start (wall-clock timings: other load inflates them)",
    ]


def _model_and_inputs(name: str, n: int):
    import torch
    from _models import build_torch_model

    model = build_torch_model(name)
    generator = torch.Generator().manual_seed(1)
    return model, torch.randn((n,) + INPUT_SHAPES[name], generator=generator)


def _timed(call):
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


def _run_model(name: str, args, ks: list[int], projections: list[str]) -> list[str]:
    import torchntk

    model, x = _model_and_inputs(name, args.n)
    parameters = sum(p.numel() for p in model.parameters())
    exact_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=args.exact_implementation)
    exact_fn(x[:2])  # warm-up
    exact, exact_time = _timed(lambda: exact_fn(x))
    exact = exact.double()
    diagonal = exact.diagonal()
    spread = (diagonal[:, None] * diagonal[None, :] + exact ** 2).sum().sqrt() / exact.norm()
    lines = [
        f"### {name}: {parameters:,} parameters, N = {args.n}, traced logits (10)",
        "",
        f"Exact kernel (implementation {args.exact_implementation}): {exact_time:.2f} s.",
        "",
        "| projection | k | time [s] | rel. Frobenius error (mean +- sd) | Gaussian theory |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for projection in projections:
        torchntk.sketched_ntk_fn(model, ks[0], vmap_axes=0, projection=projection)(x[:2])  # warm-up
        over_budget = False
        for k in ks:
            if over_budget:
                row = (f"| {projection} | {k} | skipped (a smaller k took over {args.budget:.0f} s) | | "
                       f"{spread / math.sqrt(k):.4f} |")
                print(row, flush=True)
                lines.append(row)
                continue
            times, errors = [], []
            for seed in range(args.seeds):
                ntk_fn = torchntk.sketched_ntk_fn(model, k, vmap_axes=0, projection=projection, seed=seed)
                estimate, seconds = _timed(lambda: ntk_fn(x))
                times.append(seconds)
                errors.append(float((estimate.double() - exact).norm() / exact.norm()))
                if seconds > args.budget:
                    over_budget = True
                    break
            deviation = statistics.stdev(errors) if len(errors) > 1 else float("nan")
            row = (f"| {projection} | {k} | {statistics.median(times):.2f} | {statistics.mean(errors):.4f} +- "
                   f"{deviation:.4f} ({len(errors)} seeds) | {spread / math.sqrt(k):.4f} |")
            print(row, flush=True)
            lines.append(row)
    return lines + [""]


def main(argv=None) -> int:
    args = _arguments(argv)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    ks = [int(value) for value in args.ks.split(",")]
    projections = [value for value in args.projections.split(",") if value]
    unknown = sorted(set(projections) - set(PROJECTIONS))
    if unknown:
        raise SystemExit(f"bench_sketch.py: unknown projections {unknown}; expected some of {PROJECTIONS}")
    header = _header(args)
    print("```\n" + "\n".join(header) + "\n```\n", flush=True)
    sections = []
    for name in [value for value in args.models.split(",") if value]:
        sections += _run_model(name, args, ks, projections)
    if args.markdown:
        with open(args.markdown, "w") as handle:
            handle.write("```\n" + "\n".join(header) + "\n```\n\n" + "\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
