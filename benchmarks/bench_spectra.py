#!/usr/bin/env python
"""Top-k NTK eigenvalues by Lanczos over NTK-vector products, against ``eigh`` of the built kernel.

The model is the benchmark MLP (784-512-512-10, ReLU, PyTorch's default initialisation from
``torch.manual_seed(0)``), float32, on ``N`` standard-normal inputs; the kernel is the traced one
(``trace_axes=(-1,)``, ``(N, N)``), and with ``--full-n`` also the full one at a smaller N
(``trace_axes=()``, ``(N O, N O)``).

* ``build + eigh``: ``empirical_ntk_fn(model, vmap_axes=0, implementation=AUTO)(x)`` (AUTO picks
  structured derivatives here), then ``torch.linalg.eigh`` of the float32 kernel. The reference
  eigenvalues are ``eigvalsh`` of that kernel in float64.
* ``ntk_eigenpairs``: the top ``k`` eigenpairs, one row per block size: wall time, kernel-vector
  products, NTK-vector products (``O`` per kernel-vector product for the traced kernel), the largest
  relative eigenvalue error against the reference, the largest ``||K v - lambda v|| / lambda``.
* ``ntk_trace_estimate``: Hutchinson with ``--probes`` probes: time, relative error of the estimate
  against the reference trace, and the relative standard error it reports.

Every timing is the median of ``--repeats`` runs, the configurations interleaved (one run of each,
then the next round), so that the load of a shared machine spreads over all of them.

    python benchmarks/bench_spectra.py                       # N = 1000, k = 10
    python benchmarks/bench_spectra.py --n 2000 --full-n 200 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

import torchntk


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(784, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    ).eval()


def timed(call):
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


def run(n: int, trace_axes: tuple, k: int, block_sizes: list, probes: int, repeats: int) -> list:
    model = mlp()
    x = torch.randn(n, 784, generator=torch.Generator().manual_seed(1))
    outputs = 10
    per_product = outputs if trace_axes else 1
    kernel_fn = torchntk.empirical_ntk_fn(
        model, trace_axes=trace_axes, vmap_axes=0, implementation=torchntk.NtkImplementation.AUTO
    )

    def build_and_eigh():
        kernel = kernel_fn(x)
        matrix = kernel if trace_axes else kernel.permute(0, 2, 1, 3).reshape(n * outputs, n * outputs)
        built = time.perf_counter()
        torch.linalg.eigh(matrix)
        return matrix, built

    configurations = {"build + eigh": None, **{f"ntk_eigenpairs, block {b}": b for b in block_sizes}, "trace": "trace"}
    times: dict = {name: [] for name in configurations}
    results: dict = {}
    for _ in range(repeats):
        for name, setting in configurations.items():
            if setting is None:
                start = time.perf_counter()
                (matrix, built), seconds = timed(build_and_eigh)
                times[name].append(seconds)
                results[name] = (matrix, built - start)
            elif setting == "trace":
                results[name], seconds = timed(lambda: torchntk.ntk_trace_estimate(
                    model, x, probes=probes, trace_axes=trace_axes))
                times[name].append(seconds)
            else:
                results[name], seconds = timed(lambda: torchntk.ntk_eigenpairs(
                    model, x, k, trace_axes=trace_axes, block_size=setting))
                times[name].append(seconds)

    matrix, build_seconds = results["build + eigh"]
    reference = torch.linalg.eigvalsh(matrix.double()).flip(0)
    exact_trace = float(torch.trace(matrix.double()))
    rows = [(
        "build + eigh", statistics.median(times["build + eigh"]), f"build {build_seconds:.1f} s (last run)",
        "none (kernel built)", "0 (reference)", "",
    )]
    for name, setting in configurations.items():
        if setting is None or setting == "trace":
            continue
        pairs = results[name]
        error = float(((pairs.eigenvalues.double() - reference[:k]).abs() / reference[:k]).max())
        residual = float((pairs.residuals / pairs.eigenvalues.abs()).max())
        rows.append((
            name, statistics.median(times[name]), f"{pairs.products} products, converged={pairs.converged}",
            str(pairs.products * per_product), f"{error:.1e}", f"{residual:.1e}",
        ))
    estimate = results["trace"]
    rows.append((
        f"ntk_trace_estimate, {probes} probes", statistics.median(times["trace"]),
        f"standard error {estimate.standard_error / exact_trace:.1%} of the trace", str(probes),
        f"{abs(estimate.estimate - exact_trace) / exact_trace:.1e} (trace)", "",
    ))
    print(f"\nMLP 784-512-512-10, N={n}, trace_axes={trace_axes}, kernel {tuple(matrix.shape)}, k={k}; "
          f"reference top eigenvalues {[round(v, 1) for v in reference[:k].tolist()]}")
    print("| method | median time (s) | notes | NTK-vector products | max rel. eigenvalue error | max residual / λ |")
    print("|---|---|---|---|---|---|")
    for name, seconds, notes, products, error, residual in rows:
        print(f"| {name} | {seconds:.1f} | {notes} | {products} | {error} | {residual} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="*", default=[1000], help="examples for the traced kernel")
    parser.add_argument("--full-n", type=int, nargs="*", default=[], help="examples for the full kernel")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--probes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, Python {platform.python_version()}")
    for n in args.n:
        run(n, (-1,), args.k, args.block_sizes, args.probes, args.repeats)
    for n in args.full_n:
        run(n, (), args.k, args.block_sizes, args.probes, args.repeats)


if __name__ == "__main__":
    main()
