#!/usr/bin/env python
"""``torchntk.predict.gradient_descent_mse`` against neural-tangents' ``predict.gradient_descent_mse``.

For N training points (default 1000 and 4000) a random positive-definite N x N kernel
(float32, the default dtype of both libraries; the logits traced), targets (N, 10), 100 test
points and 5 times. Timed, each library in a process of its own, one after the other:

* ``first``: a fresh ``predict_fn`` called at the 5 times on train and test points, which
  includes the eigendecomposition (both libraries cache it);
* ``cached``: the same call again (median of ``--repeats``);
* ``infinite``: a fresh ``predict_fn`` at ``t=None``, which includes the Cholesky factorisation.

Both see the same kernel (built from a seeded NumPy generator); the table gives the time ratios
(NT / torchntk, > 1: torchntk faster) and the largest difference between the two predictions
relative to their largest entry.

    python benchmarks/bench_predict.py                      # torchntk only
    /path/to/ntenv/bin/python benchmarks/bench_predict.py   # both (see benchmarks/README.md)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

TIMES = [1.0, 10.0, 100.0, 1000.0, 10000.0]


def problem(n: int):
    generator = np.random.default_rng(n)
    a = generator.standard_normal((n + 100, n + 120)).astype(np.float32) / np.sqrt(n + 120)
    kernel = a @ a.T
    y = generator.standard_normal((n, 10)).astype(np.float32)
    f0 = generator.standard_normal((n, 10)).astype(np.float32) * 0.1
    g0 = generator.standard_normal((100, 10)).astype(np.float32) * 0.1
    return kernel[:n, :n], kernel[n:, :n], y, f0, g0


def worker(library: str, n: int, repeats: int, output: str) -> None:
    k_dd, k_td, y, f0, g0 = problem(n)
    if library == "torchntk":
        import torch

        from torchntk.predict import gradient_descent_mse

        k_dd, k_td, y, f0, g0 = (torch.from_numpy(a) for a in (k_dd, k_td, y, f0, g0))
        times = torch.tensor(TIMES)

        def build():
            return gradient_descent_mse(k_dd, y, learning_rate=1.0)

        def finish(result):
            return result
    else:
        import jax.numpy as jnp
        from _common import import_neural_tangents

        nt = import_neural_tangents()

        k_dd, k_td, y, f0, g0 = (jnp.asarray(a) for a in (k_dd, k_td, y, f0, g0))
        times = jnp.asarray(TIMES)

        def build():
            return nt.predict.gradient_descent_mse(k_dd, y, learning_rate=1.0)

        def finish(result):
            for part in result:
                part.block_until_ready()
            return result

    def timed(call):
        start = time.perf_counter()
        result = finish(call())
        return result, time.perf_counter() - start

    first, cached, infinite = [], [], []
    for _ in range(repeats):
        predict_fn = build()
        result, seconds = timed(lambda: predict_fn(times, f0, g0, k_td))
        first.append(seconds)
        cached.append(timed(lambda: predict_fn(times, f0, g0, k_td))[1])
        converged, seconds = timed(lambda: build()(None, f0, g0, k_td))
        infinite.append(seconds)
    np.savez(output, train=np.asarray(result[0]), test=np.asarray(result[1]), infinite=np.asarray(converged[1]))
    with open(output + ".json", "w") as file:
        json.dump({name: statistics.median(values) for name, values in
                   (("first", first), ("cached", cached), ("infinite", infinite))}, file)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,4000")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-nt", action="store_true")
    parser.add_argument("--_worker", nargs=4, help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments._worker:
        library, n, repeats, output = arguments._worker
        worker(library, int(n), int(repeats), output)
        return 0
    libraries = ["torchntk"]
    if not arguments.no_nt:
        try:
            import jax  # noqa: F401
            libraries.append("nt")
        except ImportError:
            print("neural-tangents: jax is not installed, torchntk only")
    import torch

    print(f"# predict benchmark: {' '.join(sys.argv)}")
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), {os.cpu_count()} cores; float32, "
          f"targets (N, 10), 100 test points, {len(TIMES)} times; median of {arguments.repeats}")
    print("| N | library | first call [s] | cached call [s] | t=None [s] | NT / torchntk (first, cached, t=None) | max rel diff |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for n in (int(s) for s in arguments.sizes.split(",")):
            results = {}
            for library in libraries:
                output = os.path.join(folder, f"{library}-{n}.npz")
                subprocess.run([sys.executable, __file__, "--_worker", library, str(n), str(arguments.repeats), output], check=True)
                with open(output + ".json") as file:
                    results[library] = (json.load(file), np.load(output))
            ours = results["torchntk"][0]
            for library, (times, arrays) in results.items():
                ratio, difference = "—", "—"
                if library == "nt":
                    ratio = ", ".join(f"{times[key] / ours[key]:.2f}x" for key in ("first", "cached", "infinite"))
                    mine = results["torchntk"][1]
                    difference = max(
                        float(np.abs(mine[key] - arrays[key]).max() / np.abs(arrays[key]).max())
                        for key in ("train", "test", "infinite")
                    )
                    difference = f"{difference:.1e}"
                name = "neural-tangents" if library == "nt" else "torchntk"
                print(f"| {n} | {name} | {times['first']:.3f} | {times['cached']:.4f} | {times['infinite']:.3f} | {ratio} | {difference} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
