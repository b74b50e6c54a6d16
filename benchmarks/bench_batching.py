#!/usr/bin/env python
"""Cost of ``torchntk.batch`` tiling, and Monte Carlo kernel throughput against neural-tangents.

Three parts (``--parts tiling,mc``, or ``--parts disk``):

* **tiling**: ``torchntk.batch(kernel_fn, batch_size=b)`` against the unbatched ``kernel_fn`` for
  a 256 x 256 traced NTK (``trace_axes=(-1,)``, ``vmap_axes=0``, float32, x1 and x2 of 256
  different examples) of the core benchmark's ``mlp`` (implementation 3, structured
  derivatives) and ``cnn`` (implementation 1, Jacobian contraction), at batch sizes 16, 32, 64,
  with one worker (the default device list) and with ``devices=["cpu"] * 2`` (two worker
  threads; with ``batch_size=0`` that is two row slabs). Reported: the median time, its ratio
  to the unbatched kernel function (target: under 1.3x), the peak RSS growth and
  ``max|K_batched - K| / max|K|``. ``--nt-tiling`` adds neural-tangents' ``nt.batch`` on the
  same functions and weights as a reference (slow: see benchmarks/README.md).
* **mc**: Monte Carlo NNGP + NTK (``get=("nngp", "ntk")``) of a one-hidden-layer ReLU MLP in
  NTK parameterisation (``_models.build_ntk_mlp``: 64 -> 512 -> 10, ``W_std=1.5``,
  ``b_std=0.05``, weights and biases N(0, 1) redrawn per sample by ``reset_parameters``),
  ``x1`` (32, 64), ``x2`` (16, 64), 32 samples, ``trace_axes=(-1,)``, ``vmap_axes=0``,
  implementation 1: ``torchntk.monte_carlo_kernel_fn`` (one worker and ``devices=["cpu"] * 2``)
  against ``nt.monte_carlo_kernel_fn`` on ``stax.serial(Dense(512), Relu(), Dense(10))`` with
  the same parameterisation. Throughput = samples / median time of a full call (NT: jitted,
  its first call, with compilation, is the warm-up). The networks differ between the libraries
  (different RNGs), so the estimates are only compared loosely (within 20 %), and both against
  neural-tangents' analytic infinite-width kernels.

* **disk** (issue 14): one call of ``torchntk.batch`` computing the traced NTK (``x2=None``) of
  the MLP 784-512-512-10 for ``--disk-n`` examples (20,000) and of the small ResNet on 3x32x32
  inputs for ``--disk-resnet-n`` (5,000), implementation 3 (MLP) or 1 (ResNet), into a float32 memmap with a
  progress file, or into host memory (``store_on_device=False``). Reported: the wall and CPU
  time, the peak RSS growth and, for the MLP, the ratios to the FLOP bound: the symmetric half's
  multiply-adds at the rate of a 4096 x 4096 float32 matrix product measured before and after the
  call, per second of wall time and per CPU second (the latter is less disturbed by other
  processes on a shared machine: time a thread waits for a core is not counted).

Every configuration runs in its own worker subprocess, one at a time: a warm-up call, then the
median of ``--repeats`` calls. A configuration that raises (e.g. ``torchntk.monte_carlo`` not
importable yet), times out or runs out of memory is reported in the tables, not fatal.

Run ``python benchmarks/bench_batching.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from _common import (
    HERE,
    REPO_ROOT,
    add_common_arguments,
    current_rss_mb,
    fmt_diff,
    hwm_rss_mb,
    import_neural_tangents,
    launch_worker,
    limit_threads,
    parse_list,
    peak_rss_mb,
    rel_diff,
    render,
    reset_peak_rss,
    run_header,
    time_calls,
    worker_entry,
    write_markdown,
)

TILING_MODELS = ("mlp", "cnn")
DEFAULT_IMPLS = {"mlp": "3", "cnn": "1"}
TRACE_AXES = (-1,)
TARGET_RATIO = 1.3          # batched / unbatched
MC_AGREEMENT = 0.20         # max rel diff between the two libraries' MC estimates
MC_GET = ("nngp", "ntk")
MC_SHAPES = ((32, 64), (16, 64))


# ===========================================================================
# Worker side: one configuration per process.
# ===========================================================================

class _Memory:
    """Peak RSS growth of the calls (warm-up included) over the RSS just before them (VmHWM after
    a reset: a worker's ``ru_maxrss`` starts at the driver's peak; else ``ru_maxrss``)."""

    def __init__(self):
        gc.collect()
        self.before = current_rss_mb()
        self.reset = reset_peak_rss()

    def growth(self) -> float:
        return (hwm_rss_mb() if self.reset else peak_rss_mb()) - self.before


def _tiling_inputs(name: str, n: int):
    import _models
    import torch
    shape = _models.MODEL_SPECS[name][2]
    gen = torch.Generator().manual_seed(_models.INPUT_SEED)
    x1 = torch.randn((n,) + shape, generator=gen, dtype=torch.float32)
    x2 = torch.randn((n,) + shape, generator=gen, dtype=torch.float32)
    return x1, x2


def tiling_worker(spec: dict, res: dict) -> None:
    import _models
    import numpy as np

    lib, name, impl, b, workers = (spec["lib"], spec["model"], spec["impl"], spec["batch_size"],
                                   spec["workers"])
    x1_t, x2_t = _tiling_inputs(name, spec["n"])
    res["stage"] = "build"
    if lib == "torchntk":
        import torch

        import torchntk
        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        res["threads"] = torch.get_num_threads()
        model = _models.build_torch_model(name)
        fn = torchntk.empirical_ntk_fn(model, trace_axes=TRACE_AXES, vmap_axes=0,
                                       implementation=impl)
        if b == 0 and workers == 1:
            call_fn = fn                                   # the reference: no batch() at all
        else:
            cache = {} if spec["cache_bytes"] is None else {"cache_bytes": spec["cache_bytes"]}
            call_fn = torchntk.batch(fn, batch_size=b,
                                     devices=["cpu"] * workers if workers > 1 else None, **cache)

        def call():
            return call_fn(x1_t, x2_t)
    else:
        import jax
        import jax.numpy as jnp
        nt = import_neural_tangents()
        model = _models.build_torch_model(name)
        params = _models.jax_params(_models.state_to_numpy(model))
        f = _models.jax_apply_fn(name)
        x1, x2 = jnp.asarray(x1_t.numpy()), jnp.asarray(x2_t.numpy())
        fn = nt.empirical_ntk_fn(f, trace_axes=TRACE_AXES, vmap_axes=0, implementation=impl)
        call_fn = jax.jit(fn) if b == 0 else nt.batch(fn, batch_size=b, device_count=0)

        def call():
            return call_fn(x1, x2, params).block_until_ready()

    res["stage"] = "call"
    mem = _Memory()
    out, first, times = time_calls(call, spec["repeats"])
    res["peak_growth_mb"] = mem.growth()
    kernel = out.detach().cpu().numpy() if lib == "torchntk" else np.asarray(out)
    np.save(spec["kernel_out"], kernel)
    res.update(ok=True, first=first, times=times, median=statistics.median(times),
               shape=list(kernel.shape))


def _torchntk_mc_api():
    """``monte_carlo_kernel_fn`` from the top level, else from ``torchntk.monte_carlo``."""
    import torchntk
    fn = getattr(torchntk, "monte_carlo_kernel_fn", None)
    if fn is not None:
        return fn, "torchntk.monte_carlo_kernel_fn"
    from torchntk.monte_carlo import monte_carlo_kernel_fn  # ImportError is reported as a failure
    return monte_carlo_kernel_fn, "torchntk.monte_carlo.monte_carlo_kernel_fn"


def mc_worker(spec: dict, res: dict) -> None:
    import _models
    import numpy as np

    data = np.load(spec["data"])
    x1_np, x2_np = data["x1"], data["x2"]
    n, impl, workers = spec["n_samples"], spec["impl"], spec["workers"]
    res["stage"] = "build"
    if spec["lib"] == "torchntk":
        import torch
        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        res["threads"] = torch.get_num_threads()
        mc_fn, res["api"] = _torchntk_mc_api()
        model = _models.build_ntk_mlp()
        mc = mc_fn(model, n, seed=0, trace_axes=TRACE_AXES, vmap_axes=0, implementation=impl,
                   devices=["cpu"] * workers if workers > 1 else None)
        x1, x2 = torch.from_numpy(x1_np), torch.from_numpy(x2_np)

        def call():
            return mc(x1, x2, get=MC_GET)

        def to_numpy(k):
            return {g: getattr(k, g).detach().cpu().numpy() for g in MC_GET}
    else:
        import jax
        import jax.numpy as jnp
        import torch
        nt = import_neural_tangents()
        init_fn, apply_fn, kernel_fn = _models.ntk_mlp_stax()
        x1, x2 = jnp.asarray(x1_np), jnp.asarray(x2_np)
        # Same parameterisation?  One NT draw loaded into the torch module must give the same output.
        _, p = init_fn(jax.random.PRNGKey(123), x1.shape)
        model = _models.build_ntk_mlp()
        model.load_state_dict({"0.weight": torch.from_numpy(np.asarray(p[0][0]).T.copy()),
                               "0.bias": torch.from_numpy(np.asarray(p[0][1]).reshape(-1).copy()),
                               "2.weight": torch.from_numpy(np.asarray(p[2][0]).T.copy()),
                               "2.bias": torch.from_numpy(np.asarray(p[2][1]).reshape(-1).copy())})
        with torch.no_grad():
            y_t = model(torch.from_numpy(x1_np)).numpy()
        y_j = np.asarray(apply_fn(p, x1))
        np.testing.assert_allclose(y_t, y_j, rtol=1e-4, atol=1e-4 * float(np.max(np.abs(y_j))),
                                   err_msg="torch NtkDense MLP and stax MLP differ")
        analytic = kernel_fn(x1, x2, MC_GET)
        np.savez(spec["analytic_out"], **{g: np.asarray(getattr(analytic, g)) for g in MC_GET})
        res["api"] = "nt.monte_carlo_kernel_fn"
        mc = nt.monte_carlo_kernel_fn(init_fn, apply_fn, jax.random.PRNGKey(0), n,
                                      trace_axes=TRACE_AXES, vmap_axes=0, implementation=impl)

        def call():
            return jax.block_until_ready(mc(x1, x2, get=MC_GET))

        def to_numpy(k):
            return {g: np.asarray(getattr(k, g)) for g in MC_GET}

    res["stage"] = "call"
    mem = _Memory()
    out, first, times = time_calls(call, spec["repeats"])
    res["peak_growth_mb"] = mem.growth()
    arrays = to_numpy(out)
    for g in MC_GET:
        np.save(spec["kernel_out"][g], arrays[g])
    res.update(ok=True, first=first, times=times, median=statistics.median(times),
               shape=list(arrays["ntk"].shape))


# ===========================================================================
# Kernels on disk (issue 14): one long call per worker.
# ===========================================================================

# Per-example shape and implementation: the ResNet's structured factors take 7.9 MiB per example
# (activations and cotangents of every convolution), its Jacobians 0.76 MiB (20k parameters x 10).
DISK_MODELS = {"mlp": ((784,), 3), "resnet": ((3, 32, 32), 1)}


def _matmul_gflops(repeats: int = 5) -> tuple[float, float]:
    """The rate of a float32 4096 x 4096 matrix product, the machine's practical peak: GFLOP per
    second of wall time and per CPU second (all threads), each the median of ``repeats``."""
    import torch
    a = torch.randn(4096, 4096)
    a @ a
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        a @ a
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    flop = 2 * 4096 ** 3 / 1e9
    return flop / statistics.median(walls), flop / statistics.median(cpus)


def disk_worker(spec: dict, res: dict) -> None:
    """A traced NTK of ``spec["n"]`` examples (x2 None) into a memmap (``target="memmap"``, with a
    progress file) or into host memory (``target="host"``: ``store_on_device=False``)."""
    import _models
    import numpy as np
    import torch

    import torchntk

    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    name, n, target = spec["model"], spec["n"], spec["target"]
    shape, implementation = DISK_MODELS[name]
    model = _models.build_torch_model(name)
    x = torch.randn((n,) + shape, generator=torch.Generator().manual_seed(_models.INPUT_SEED))
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=TRACE_AXES, vmap_axes=0, implementation=implementation)
    batched = torchntk.batch(ntk_fn, spec["batch_size"], store_on_device=target != "host",
                             cache_bytes=spec["cache_bytes"], progress=spec["progress"])
    res["threads"] = torch.get_num_threads()
    res["matmul_before"] = _matmul_gflops()
    mem = _Memory()
    start, cpu = time.perf_counter(), time.process_time()
    if target == "memmap":
        path = os.path.join(spec["scratch"], f"{name}-{n}.npy")
        out = np.lib.format.open_memmap(path, "w+", np.float32, (n, n))
        batched(x, out=out, progress_file=path + ".progress.json")
        del out
    else:
        batched(x)
    res["seconds"], res["cpu_seconds"] = time.perf_counter() - start, time.process_time() - cpu
    res["peak_growth_mb"] = mem.growth()
    res["matmul_after"] = _matmul_gflops()
    res["load"] = os.getloadavg()[0]
    if target == "memmap":
        os.unlink(path)
        os.unlink(path + ".progress.json")
    res.update(ok=True)


def _mlp_flops(n: int) -> float:
    """Multiply-adds of the traced structured NTK of the 784-512-512-10 MLP, symmetric half: per
    pair of examples one Gram entry of each layer's inputs (784, 512, 512) and of the cotangents of
    the two hidden layers' outputs (10 logits x 512; the last layer's are the identity)."""
    return 2 * n * (n + 1) / 2 * (784 + 512 + 512 + 2 * 10 * 512)


def disk_main(args) -> int:
    scratch = args.disk_dir or tempfile.mkdtemp(prefix="bench_disk_")
    rows = []
    for name in parse_list(args.disk_models, set(DISK_MODELS)):
        n = args.disk_n if name == "mlp" else args.disk_resnet_n
        for target in parse_list(args.disk_targets, {"memmap", "host"}):
            spec = {"part": "disk", "model": name, "n": n, "target": target, "batch_size": args.disk_batch_size,
                    "cache_bytes": args.disk_cache_bytes, "threads": args.threads, "progress": args.verbose,
                    "scratch": scratch}
            stem = os.path.join(scratch, f"{name}-{n}-{target}")
            spec["result_out"] = stem + ".result.json"
            res, why = launch_worker(__file__, spec, stem, args.timeout, args.verbose)
            if res is None or not res.get("ok"):
                rows.append([name, str(n), target, "FAILED: " + (why or res.get("error", ""))] + [""] * 7)
                continue
            wall_rate = (res["matmul_before"][0] + res["matmul_after"][0]) / 2
            cpu_rate = (res["matmul_before"][1] + res["matmul_after"][1]) / 2
            if name == "mlp":
                wall_bound, cpu_bound = _mlp_flops(n) / wall_rate / 1e9, _mlp_flops(n) / cpu_rate / 1e9
                bounds = (f"{wall_bound:.1f} s ({res['seconds'] / wall_bound:.2f}x)",
                          f"{cpu_bound:.1f} s ({res['cpu_seconds'] / cpu_bound:.2f}x)")
            else:
                bounds = ("—", "—")
            rows.append([name, str(n), target, str(res["threads"]), f"{res['seconds']:.1f}",
                         f"{res['cpu_seconds']:.1f}",
                         f"{res['peak_growth_mb'] / 1024:.2f}", f"{wall_rate:.0f} / {cpu_rate:.0f}", *bounds,
                         f"{res['load']:.1f}"])
            print(rows[-1], flush=True)
    headers = ["model", "N", "target", "threads", "wall [s]", "CPU [s]", "peak RSS growth [GiB]",
               "matmul GFLOP per s / per CPU s", "FLOP bound, wall (ratio)", "FLOP bound, CPU (ratio)", "load"]
    print(render(headers, rows, False))
    return 0


def worker_main(spec_path: str) -> int:
    def run(spec: dict, res: dict) -> None:
        limit_threads(spec["threads"])
        sys.path.insert(0, HERE)
        sys.path.insert(0, REPO_ROOT)
        {"tiling": tiling_worker, "mc": mc_worker, "disk": disk_worker}[spec["part"]](spec, res)

    return worker_entry(spec_path, run)


# ===========================================================================
# Driver side.
# ===========================================================================

@dataclass
class Run:
    part: str                   # "tiling" or "mc"
    lib: str                    # "torchntk" or "nt"
    model: str
    impl: int
    batch_size: int = 0         # tiling only
    workers: int = 1
    n_samples: int = 0          # mc only
    ok: bool = False
    error: str = ""
    error_type: str = ""
    first: float = math.nan
    times: List[float] = field(default_factory=list)
    median: float = math.nan
    shape: Optional[List[int]] = None
    peak_growth_mb: float = math.nan
    api: str = ""
    outputs: Dict[str, str] = field(default_factory=dict)   # kernel name -> .npy path
    diffs: Dict[str, object] = field(default_factory=dict)  # label -> rel diff (or why not)

    @property
    def lib_name(self) -> str:
        return "neural-tangents" if self.lib == "nt" else "torchntk"

    @property
    def label(self) -> str:
        if self.part == "tiling":
            b = f"batch_size={self.batch_size}" if self.batch_size or self.workers > 1 else "unbatched"
            return f"{self.lib_name} {self.model} impl {self.impl} {b} workers={self.workers}"
        return f"{self.lib_name} MC impl {self.impl} n={self.n_samples} workers={self.workers}"


def run_config(run: Run, tmpdir: str, args, mc_data: str, analytic_path: str) -> None:
    stem = os.path.join(tmpdir, f"{run.part}-{run.lib}-{run.model}-{run.impl}-{run.batch_size}"
                                f"-{run.workers}-{run.n_samples}")
    spec = dict(part=run.part, lib=run.lib, model=run.model, impl=run.impl,
                batch_size=run.batch_size, workers=run.workers, n=args.n,
                n_samples=run.n_samples, threads=args.threads, cache_bytes=args.cache_bytes,
                repeats=args.repeats if run.part == "tiling" else args.mc_repeats,
                result_out=stem + ".json")
    if run.part == "tiling":
        spec["kernel_out"] = stem + ".npy"
    else:
        spec.update(data=mc_data, kernel_out={g: f"{stem}.{g}.npy" for g in MC_GET},
                    analytic_out=analytic_path)
    res, why = launch_worker(__file__, spec, stem, args.timeout, args.verbose)
    if res is None:
        run.error, run.error_type = why, "timeout" if why.startswith("timeout") else "crash"
        return
    run.api = res.get("api", "")
    if not res.get("ok"):
        run.error = f"[{res.get('stage', '?')}] {res.get('error', 'unknown error')}"
        run.error_type = res.get("error_type", "")
        return
    run.ok = True
    for name in ("first", "times", "median", "shape", "peak_growth_mb"):
        setattr(run, name, res[name])
    run.outputs = ({"ntk": spec["kernel_out"]} if run.part == "tiling" else dict(spec["kernel_out"]))


def n_blocks(n: int, b: int, workers: int) -> int:
    if b == 0:
        return 1 if workers == 1 else min(workers, n)
    return math.ceil(n / b) ** 2


def fmt_time(r: Optional[Run]) -> str:
    if r is None:
        return "—"
    if not r.ok:
        return {"ModuleNotFoundError": "unavailable", "ImportError": "unavailable",
                "NotImplementedError": "not impl.", "timeout": "timeout"}.get(r.error_type, "FAILED")
    return f"{r.median:.3f}"


def fmt_d(d) -> str:
    return d if isinstance(d, str) else fmt_diff(d)


def fmt_mb(x: float) -> str:
    return "—" if x is None or math.isnan(x) else f"{x:.0f}"


def rel_fro(a_path: str, b_path: str) -> Tuple[Optional[float], str]:
    """||A - B||_F / ||B||_F with B the reference (MC estimates: the max-entry difference of
    ``rel_diff`` is dominated by the noisiest entry)."""
    import numpy as np
    a, b = np.load(a_path).astype(np.float64), np.load(b_path).astype(np.float64)
    if a.shape != b.shape:
        return None, f"shape mismatch {a.shape} vs {b.shape}"
    den = float(np.linalg.norm(b))
    num = float(np.linalg.norm(a - b))
    return (num / den if den > 0 else num), ""


def prepare_mc_data(tmpdir: str) -> str:
    import numpy as np
    import torch
    gen = torch.Generator().manual_seed(1)
    x1 = torch.randn(MC_SHAPES[0], generator=gen, dtype=torch.float32).numpy()
    x2 = torch.randn(MC_SHAPES[1], generator=gen, dtype=torch.float32).numpy()
    path = os.path.join(tmpdir, "mc_inputs.npz")
    np.savez(path, x1=x1, x2=x2)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Time torchntk.batch tiling against the unbatched kernel function, and "
                    "Monte Carlo kernel throughput against neural-tangents.")
    ap.add_argument("--parts", default="tiling,mc",
                    help="comma list of tiling, mc (default: both), or disk (alone: kernels on disk)")
    ap.add_argument("--disk-models", default="mlp,resnet", help="disk: comma list of mlp, resnet")
    ap.add_argument("--disk-n", type=int, default=20000, help="disk: examples for the mlp (default 20000)")
    ap.add_argument("--disk-resnet-n", type=int, default=5000, help="disk: examples for the resnet (default 5000)")
    ap.add_argument("--disk-targets", default="memmap,host",
                    help="disk: comma list of memmap (out= a np.memmap, with a progress file), host "
                         "(store_on_device=False)")
    ap.add_argument("--disk-batch-size", type=int, default=1000, help="disk: batch_size (default 1000)")
    ap.add_argument("--disk-cache-bytes", type=int, default=2**31, help="disk: cache_bytes (default 2 GiB)")
    ap.add_argument("--disk-dir", default=None, help="disk: folder of the memmaps (default: a new temporary one)")
    ap.add_argument("--models", default=",".join(TILING_MODELS),
                    help="tiling: comma list of mlp, cnn (default: both)")
    ap.add_argument("--mlp-impls", default=DEFAULT_IMPLS["mlp"],
                    help="tiling: implementations for the mlp, comma list of 1,2,3 (default: 3; "
                         "1 needs ~13 GB at 256 x 256)")
    ap.add_argument("--cnn-impls", default=DEFAULT_IMPLS["cnn"],
                    help="tiling: implementations for the cnn, comma list of 1,2,3 (default: 1)")
    ap.add_argument("--batch-sizes", default="16,32,64",
                    help="tiling: batch sizes, comma list (default: 16,32,64)")
    ap.add_argument("--workers", default="1,2",
                    help="tiling: worker counts for torchntk.batch, comma list of 1, 2 (2: "
                         "devices=['cpu'] * 2; also runs batch_size=0, two row slabs). Default: 1,2")
    ap.add_argument("--cache-bytes", type=int, default=None,
                    help="tiling: torchntk.batch's cache_bytes (default: the library's, 1 GiB; 0 "
                         "prepares every block on its own, like nt.batch)")
    ap.add_argument("--n", type=int, default=256, help="tiling: examples in x1 and in x2 (default 256)")
    ap.add_argument("--nt-tiling", action="store_true",
                    help="tiling: also time neural-tangents' nt.batch (jitted, same functions and "
                         "weights) as a reference; slow for the cnn")
    ap.add_argument("--mc-samples", type=int, default=32, help="mc: n_samples (default 32)")
    ap.add_argument("--mc-impls", default="1",
                    help="mc: NTK implementations, both libraries, comma list of 1,2,3 (default: 1)")
    ap.add_argument("--mc-workers", default="1,2",
                    help="mc: torchntk worker counts (2: devices=['cpu'] * 2), comma list (default 1,2)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="tiling: timed calls after the warm-up call; the median is reported "
                         "(default 3)")
    ap.add_argument("--mc-repeats", type=int, default=7,
                    help="mc: timed calls after the warm-up call (default 7: a call takes a second "
                         "or two, and its time varies a lot on a busy machine)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads(N) and pin every worker to N cores (limits "
                         "XLA too). Default: no limit (all cores)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds allowed per configuration, warm-up and compile included (default 600)")
    add_common_arguments(ap)
    args = ap.parse_args(argv)

    if args._worker:
        return worker_main(args._worker)
    if "disk" in args.parts:
        return disk_main(args)

    parts = parse_list(args.parts, {"tiling", "mc"})
    models = parse_list(args.models, set(TILING_MODELS))
    impls = {"mlp": parse_list(args.mlp_impls, {1, 2, 3}, int),
             "cnn": parse_list(args.cnn_impls, {1, 2, 3}, int)}
    batch_sizes = [int(s) for s in args.batch_sizes.split(",") if s.strip()]
    workers = parse_list(args.workers, {1, 2}, int)
    mc_impls = parse_list(args.mc_impls, {1, 2, 3}, int)
    mc_workers = [int(s) for s in args.mc_workers.split(",") if s.strip()]
    if args.repeats < 1 or args.mc_repeats < 1:
        ap.error("--repeats and --mc-repeats must be >= 1")
    if any(b < 1 for b in batch_sizes) or any(w < 1 for w in mc_workers) or args.n < 1:
        ap.error("batch sizes, worker counts and --n must be positive")
    want_nt = not args.no_nt and ("mc" in parts or args.nt_tiling)

    header, use_t, use_nt = run_header("# torchntk batching / Monte Carlo benchmark", args,
                                       not args.no_torchntk, want_nt,
                                       "" if not args.no_nt else " (--no-nt)")
    if "tiling" in parts:
        cache = "library default (1 GiB)" if args.cache_bytes is None else args.cache_bytes
        header.append(f"          (tiling: torchntk.batch cache_bytes={cache})")
    if "mc" in parts:
        header.append(f"          (tiling: {args.repeats} timed calls; Monte Carlo: --mc-repeats "
                      f"{args.mc_repeats} timed calls)")
    print("\n".join(header), flush=True)
    sys.path.insert(0, HERE)
    import _models

    plan: List[Run] = []
    if "tiling" in parts:
        for m in models:
            for i in impls[m]:
                if use_t:
                    plan.append(Run("tiling", "torchntk", m, i, 0, 1))
                    if 2 in workers:
                        plan.append(Run("tiling", "torchntk", m, i, 0, 2))
                    plan += [Run("tiling", "torchntk", m, i, b, w) for w in workers for b in batch_sizes]
                if use_nt and args.nt_tiling:
                    plan += [Run("tiling", "nt", m, i, b, 1) for b in [0] + batch_sizes]
    if "mc" in parts:
        for i in mc_impls:
            if use_t:
                plan += [Run("mc", "torchntk", "ntk_mlp", i, workers=w, n_samples=args.mc_samples)
                         for w in mc_workers]
            if use_nt:
                plan.append(Run("mc", "nt", "ntk_mlp", i, n_samples=args.mc_samples))

    tmpdir = tempfile.mkdtemp(prefix="bench_batching_")
    analytic_path = os.path.join(tmpdir, "analytic.npz")
    t_start = time.perf_counter()
    try:
        mc_data = prepare_mc_data(tmpdir) if "mc" in parts else ""
        for k, run in enumerate(plan, 1):
            print(f"[{k:2d}/{len(plan)}] {run.label} ...", end="", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            run_config(run, tmpdir, args, mc_data, analytic_path)
            wall = time.perf_counter() - t0
            if run.ok:
                print(f" median {run.median:.3f} s (first {run.first:.3f} s, peak RSS growth "
                      f"{fmt_mb(run.peak_growth_mb)} MB, worker {wall:.1f} s)",
                      file=sys.stderr, flush=True)
            else:
                print(f" FAILED: {run.error[:300]}", file=sys.stderr, flush=True)
            gc.collect()
        # Differences: tiling against the same library's unbatched kernel (and torchntk's
        # unbatched against NT's); MC against NT's estimate and the analytic kernels.
        ref = {(r.lib, r.model, r.impl): r for r in plan
               if r.part == "tiling" and r.ok and r.batch_size == 0 and r.workers == 1}
        nt_mc = {r.impl: r for r in plan if r.part == "mc" and r.lib == "nt" and r.ok}
        have_analytic = os.path.exists(analytic_path)
        if have_analytic:
            import numpy as np
            with np.load(analytic_path) as a:
                for g in MC_GET:
                    np.save(os.path.join(tmpdir, f"analytic.{g}.npy"), a[g])
        for r in plan:
            if not r.ok:
                continue
            if r.part == "tiling":
                base = ref.get((r.lib, r.model, r.impl))
                if base is not None and base is not r:
                    d, why = rel_diff(r.outputs["ntk"], base.outputs["ntk"])
                    r.diffs["unbatched"] = why or d
                if r.lib == "torchntk" and base is r and ("nt", r.model, r.impl) in ref:
                    d, why = rel_diff(r.outputs["ntk"], ref[("nt", r.model, r.impl)].outputs["ntk"])
                    r.diffs["NT unbatched"] = why or d
            else:
                for g in MC_GET:
                    refs = []
                    if r.lib == "torchntk" and r.impl in nt_mc:
                        refs.append(("NT", nt_mc[r.impl].outputs[g]))
                    if have_analytic:
                        refs.append(("analytic", os.path.join(tmpdir, f"analytic.{g}.npy")))
                    for label, path in refs:
                        d, why = rel_fro(r.outputs[g], path)
                        r.diffs[f"{g} vs {label}"] = why or d
                        d, why = rel_diff(r.outputs[g], path)
                        r.diffs[f"{g} vs {label} (max)"] = why or d
    finally:
        if not args.keep_tmp:
            import shutil
            shutil.rmtree(tmpdir, ignore_errors=True)
        else:
            print(f"scratch directory kept: {tmpdir}", file=sys.stderr)

    sections = []
    target_lines = []
    # ---- tiling table ------------------------------------------------------
    tiling = [r for r in plan if r.part == "tiling"]
    if tiling:
        ref = {(r.lib, r.model, r.impl): r for r in tiling if r.batch_size == 0 and r.workers == 1}
        hs = ["model", "impl", "library", "batch_size", "workers", "blocks", "median [s]",
              "t / t_unbatched", f"< {TARGET_RATIO}x", "peak RSS growth [MB]",
              "max rel diff vs unbatched"]
        rows = []
        for r in tiling:
            base = ref.get((r.lib, r.model, r.impl))
            unbatched = r.batch_size == 0 and r.workers == 1
            ratio, target = "—", ""
            if unbatched:
                ratio = "1 (reference)"
            elif r.ok and base is not None and base.ok:
                x = r.median / base.median
                ratio = f"{x:.2f}x"
                if r.lib == "torchntk":
                    target = "yes" if x < TARGET_RATIO else "NO"
            diff = r.diffs.get("unbatched") if not unbatched else r.diffs.get("NT unbatched")
            diff_s = "—" if not r.ok or diff is None else (
                fmt_d(diff) + (" (vs NT)" if unbatched else ""))
            rows.append([r.model, str(r.impl), r.lib_name,
                         "— (no batch())" if unbatched else (
                             str(r.batch_size) if r.batch_size else "0 (row slabs)"), str(r.workers),
                         str(n_blocks(args.n, r.batch_size, r.workers)), fmt_time(r), ratio,
                         target, fmt_mb(r.peak_growth_mb) if r.ok else "—", diff_s])
        sections.append((f"Tiling: {args.n} x {args.n} traced NTK, batched / unbatched", hs, rows))
        for (lib, m, i), base in ref.items():
            if lib != "torchntk":
                continue
            batched = [r for r in tiling if r.lib == lib and r.model == m and r.impl == i
                       and r is not base and r.batch_size > 0]
            if not base.ok or not batched:
                continue
            parts_s = []
            for r in batched:
                x = r.median / base.median if r.ok else None
                parts_s.append(f"b={r.batch_size}/w={r.workers}: "
                               + (f"{x:.2f}x" if x is not None else fmt_time(r)))
            met = sum(1 for r in batched if r.ok and r.median / base.median < TARGET_RATIO)
            target_lines.append(f"{m} impl {i}: {met}/{len(batched)} batched configurations under "
                                f"{TARGET_RATIO}x ({'; '.join(parts_s)})")

    # ---- Monte Carlo table ---------------------------------------------------
    mc_runs = [r for r in plan if r.part == "mc"]
    if mc_runs:
        nt_mc = {r.impl: r for r in mc_runs if r.lib == "nt"}
        hs = ["library", "impl", "workers", "n_samples", "first call [s]", "median [s]",
              "samples/s", "throughput / NT", "NNGP vs NT", "NTK vs NT", "NNGP vs analytic",
              "NTK vs analytic", "peak RSS growth [MB]"]
        rows = []
        for r in mc_runs:
            nt_r = nt_mc.get(r.impl)
            rate = r.n_samples / r.median if r.ok and r.median > 0 else None
            rel = "—"
            if r.lib == "torchntk" and rate is not None and nt_r is not None and nt_r.ok:
                rel = f"{rate / (nt_r.n_samples / nt_r.median):.2f}x"
            elif r.lib == "nt" and r.ok:
                rel = "1 (reference)"

            def d(label, r=r):
                v, vmax = r.diffs.get(label), r.diffs.get(label + " (max)")
                if v is None:
                    return "—"
                return fmt_d(v) + ("" if vmax is None else f" (max {fmt_d(vmax)})")

            rows.append([r.lib_name, str(r.impl),
                         str(r.workers) if r.lib == "torchntk" else "1 (jit)", str(r.n_samples),
                         f"{r.first:.3f}" if r.ok else "—", fmt_time(r),
                         f"{rate:.1f}" if rate is not None else "—", rel,
                         d("nngp vs NT"), d("ntk vs NT"), d("nngp vs analytic"),
                         d("ntk vs analytic"), fmt_mb(r.peak_growth_mb) if r.ok else "—"])
        sections.append(("Monte Carlo NNGP + NTK throughput", hs, rows))
        for r in mc_runs:
            if r.lib != "torchntk" or not r.ok:
                continue
            nt_r = nt_mc.get(r.impl)
            parts_s = []
            for g in MC_GET:
                v = r.diffs.get(f"{g} vs NT")
                if v is None or isinstance(v, str):
                    continue
                s_ = (f"{g.upper()} {v:.1e} "
                      f"({'within' if v <= MC_AGREEMENT else 'NOT within'} {MC_AGREEMENT:.0%})")
                a_t = r.diffs.get(f"{g} vs analytic")
                a_n = nt_r.diffs.get(f"{g} vs analytic") if nt_r is not None else None
                if isinstance(a_t, float) and isinstance(a_n, float):
                    s_ += f" [vs analytic: torchntk {a_t:.1e}, NT {a_n:.1e}]"
                parts_s.append(s_)
            if parts_s:
                target_lines.append(
                    f"MC impl {r.impl} workers={r.workers}: ||K - K_NT||_F / ||K_NT||_F: "
                    + "; ".join(parts_s))

    failures = [f"{r.label}: {r.error}" for r in plan if not r.ok]
    detail_headers = ["part", "library", "config", "first call [s]", "median [s]", "all timed [s]",
                      "shape", "api"]
    detail = [[r.part, r.lib_name, r.label.split(" ", 1)[1],
               f"{r.first:.3f}" if r.ok else "—", fmt_time(r),
               " ".join(f"{t:.3f}" for t in r.times) if r.ok else "—",
               "x".join(map(str, r.shape)) if r.shape else "—", r.api or "—"] for r in plan]

    notes = []
    if tiling:
        notes += [
            f"tiling: {args.n} x {args.n} NTK, trace_axes=(-1,) (mean over the 10 logits), "
            "vmap_axes=0, float32; x1, x2 = two different standard-normal batches of "
            f"{args.n} examples with the core benchmark's per-example shapes and the core "
            "benchmark's seeded weights. mlp: implementation 3 (structured derivatives), cnn: "
            "implementation 1 (Jacobian contraction), unless --mlp-impls/--cnn-impls say otherwise.",
            "batched: torchntk.batch(kernel_fn, batch_size=b) (workers=1: default device list, "
            "i.e. the inputs' CPU) or torchntk.batch(kernel_fn, batch_size=b, devices=['cpu']*2) "
            "(workers=2: two threads sharing the torch intra-op pool). batch_size=0 with 2 workers: "
            "two shares. t / t_unbatched: median over the unbatched kernel_fn's median (target "
            f"< {TARGET_RATIO}x). blocks: kernel blocks of batch_size (torchntk groups them into "
            "prepared spans; nt.batch calls the kernel function once per block).",
            "torchntk prepares each example's derivatives (Jacobians or structured factors) about "
            "once, in spans that fit cache_bytes, and keeps prepared x2 spans cached; with "
            "--cache-bytes 0 every span is one block and x2 runs are prepared again for every row "
            "of blocks. nt.batch (--nt-tiling) redoes both runs' per-example work for every block.",
        ]
    if mc_runs:
        m = _models.NTK_MLP
        notes += [
            f"mc: one-hidden-layer ReLU MLP {m['d']}-{m['width']}-{m['k']} in NTK parameterisation "
            f"(W_std={m['W_std']}, b_std={m['b_std']}, weights and biases N(0, 1)); torchntk: "
            "_models.build_ntk_mlp (NtkDense, redrawn per sample by reset_parameters); NT: "
            "stax.serial(Dense, Relu, Dense) (the NT worker checks that one stax draw loaded into "
            f"the torch module gives the same outputs). x1 {MC_SHAPES[0]}, x2 {MC_SHAPES[1]}, "
            f"get={MC_GET}, trace_axes=(-1,), vmap_axes=0, seed/key 0.",
            "samples/s = n_samples / median time of a full call (NT: the warm-up call includes "
            "jit compilation and is excluded; results block_until_ready). workers=2: "
            "devices=['cpu']*2 (torchntk only; NT has one CPU device). The libraries draw different "
            "networks: 'vs NT' and 'vs analytic' (nt.stax kernel_fn, infinite width) are "
            "||K - K_ref||_F / ||K_ref||_F (in brackets max|K - K_ref| / max|K_ref|), a loose "
            f"sanity check (expected within {MC_AGREEMENT:.0%}), not an accuracy measure. The "
            "NNGP estimate is much noisier than the NTK one: a sample's NNGP is the product of "
            "its 10 outputs only (320 products for 32 samples), while its NTK also averages the "
            "first layer's gradients over the 512 hidden units.",
        ]
    notes.append("memory: peak RSS growth of the worker over its RSS just before the first call "
                 "(warm-up included; VmHWM after a reset, else ru_maxrss).")
    notes.append(f"total wall time {time.perf_counter() - t_start:.0f} s"
                 + ("; load average %.2f %.2f %.2f at the end." % os.getloadavg()
                    if hasattr(os, "getloadavg") else "."))

    text = []
    for title, hs, rows in sections:
        text += ["", title + ":", render(hs, rows, False)]
    if target_lines:
        text += ["", "Targets:"] + [f"  - {t}" for t in target_lines]
    text += [""] + notes
    if failures:
        text += ["", "Failures:"] + [f"  - {f}" for f in failures]
    text += ["", "Per-run details:", render(detail_headers, detail, False)]
    print("\n".join(text))

    if args.markdown:
        write_markdown(args.markdown, header, [], sections, target_lines, notes, failures,
                       detail_headers, detail)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"header": header, "notes": notes, "targets": target_lines,
                       "runs": [{k: v for k, v in r.__dict__.items() if k != "outputs"}
                                for r in plan]}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
