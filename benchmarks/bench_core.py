#!/usr/bin/env python
"""Side-by-side timing of torchntk and neural-tangents empirical NTKs.

Times torchntk's implementation 1 (Jacobian contraction) and 2 (NTK-vector
products) on an MLP and a small CNN, and -- when ``jax`` and
``neural_tangents`` import -- the very same functions with the very same
weights in neural-tangents (jitted; compilation happens in the untimed
warm-up call).  neural-tangents' implementation 3 (structured derivatives)
and the PyTorch NTK tutorial's ``torch.func`` Jacobian contraction are timed
as extra references.

Every (library, model, kernel, implementation) configuration runs in its own
worker subprocess, one after the other: memory is returned between runs, and
a configuration that is too slow (``--timeout``), runs out of memory or
crashes is reported in the table instead of ending the benchmark.

Run ``python benchmarks/bench_core.py --help`` for the options.
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
    fmt_diff,
    import_neural_tangents,
    launch_worker,
    limit_threads,
    parse_list,
    peak_rss_mb,
    prepare_data,
    rel_diff,
    render,
    run_header,
    time_calls,
    worker_entry,
)

KERNELS = {"full": (), "traced": (-1,)}
LIB_LABELS = {"torchntk": "torchntk", "nt": "neural-tangents",
              "tutorial": "torch.func tutorial (Jacobian contraction)"}


# ===========================================================================
# Worker side: one configuration per process.
# ===========================================================================

def _tutorial_ntk(model, x1, x2, trace: bool):
    """The PyTorch NTK tutorial's baseline: per-example Jacobians with
    vmap(jacrev), then one einsum per parameter tensor, summed."""
    import torch
    from torch.func import functional_call, jacrev, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}

    def f_one(p, x):
        return functional_call(model, p, (x.unsqueeze(0),)).squeeze(0)

    jac1 = vmap(jacrev(f_one), (None, 0))(params, x1)
    jac2 = vmap(jacrev(f_one), (None, 0))(params, x2)
    expr = "Naf,Maf->NM" if trace else "Naf,Mbf->NMab"
    parts = [torch.einsum(expr, jac1[k].flatten(2), jac2[k].flatten(2)) for k in jac1]
    out = torch.stack(parts).sum(0)
    if trace:
        # neural-tangents' traced kernels are the *mean* over the traced
        # output axis (trace / size); match that so the kernels compare.
        out = out / next(iter(jac1.values())).shape[1]
    return out


def run_worker(spec: dict) -> dict:
    limit_threads(spec["threads"])
    import numpy as np

    sys.path.insert(0, HERE)
    sys.path.insert(0, REPO_ROOT)
    import _models

    lib, name, kernel, impl = spec["lib"], spec["model"], spec["kernel"], spec["impl"]
    trace_axes = KERNELS[kernel]
    data = np.load(spec["data"])
    state = {k[len("p:"):]: data[k] for k in data.files if k.startswith("p:")}
    x1_np, x2_np, y1_ref = data["x1"], data["x2"], data["y1"]
    res: dict = {}

    if lib in ("torchntk", "tutorial"):
        import torch
        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        res["threads"] = torch.get_num_threads()
        model = _models.build_torch_model(name)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        model.eval()
        x1, x2 = torch.from_numpy(x1_np), torch.from_numpy(x2_np)
        if lib == "torchntk":
            import torchntk
            res["version"] = getattr(torchntk, "__version__", "?")
            fn = torchntk.empirical_ntk_fn(model, trace_axes=trace_axes, vmap_axes=0,
                                           implementation=impl)
            call = lambda: fn(x1, x2)  # noqa: E731
        else:
            call = lambda: _tutorial_ntk(model, x1, x2, trace=bool(trace_axes))  # noqa: E731
        out, first, times = time_calls(call, spec["repeats"])
        kernel_np = out.detach().cpu().numpy()

    elif lib == "nt":
        import jax
        import jax.numpy as jnp
        nt = import_neural_tangents()
        res["version"] = f"jax {jax.__version__}"
        params = _models.jax_params(state)
        f = _models.jax_apply_fn(name)
        x1, x2 = jnp.asarray(x1_np), jnp.asarray(x2_np)
        y1 = np.asarray(jax.jit(f)(params, x1))
        scale = float(np.max(np.abs(y1_ref)))
        # Same function on both sides?  (atol keeps near-zero entries sane.)
        np.testing.assert_allclose(y1, y1_ref, rtol=1e-4, atol=1e-4 * scale,
                                   err_msg="JAX and torch forward outputs differ")
        fn = jax.jit(nt.empirical_ntk_fn(f, trace_axes=trace_axes, vmap_axes=0,
                                         implementation=impl))
        call = lambda: fn(x1, x2, params).block_until_ready()  # noqa: E731
        out, first, times = time_calls(call, spec["repeats"])
        kernel_np = np.asarray(out)
    else:
        raise ValueError(lib)

    np.save(spec["kernel_out"], kernel_np)
    res.update(ok=True, first=first, times=times, median=statistics.median(times),
               shape=list(kernel_np.shape), peak_rss_mb=peak_rss_mb())
    return res


def worker_main(spec_path: str) -> int:
    return worker_entry(spec_path, lambda spec, res: res.update(run_worker(spec)))


# ===========================================================================
# Driver side.
# ===========================================================================

@dataclass
class Run:
    lib: str
    model: str
    kernel: str
    impl: int
    ok: bool = False
    error: str = ""
    first: float = math.nan
    times: List[float] = field(default_factory=list)
    median: float = math.nan
    peak_rss_mb: float = math.nan
    shape: Optional[List[int]] = None
    kernel_path: str = ""
    diff: Optional[float] = None   # max|K - K_ref| / max|K_ref|
    diff_ref: str = ""

    @property
    def key(self) -> Tuple[str, str, str, int]:
        return (self.lib, self.model, self.kernel, self.impl)


def run_config(run: Run, data_path: str, tmpdir: str, args) -> Run:
    stem = os.path.join(tmpdir, f"{run.lib}-{run.model}-{run.kernel}-{run.impl}")
    spec = dict(lib=run.lib, model=run.model, kernel=run.kernel, impl=run.impl,
                repeats=args.repeats, threads=args.threads, data=data_path,
                kernel_out=stem + ".npy", result_out=stem + ".json")
    res, why = launch_worker(__file__, spec, stem, args.timeout, args.verbose)
    if res is None:
        run.error = why
        return run
    if not res.get("ok"):
        run.error = res.get("error", "unknown error")
        run.peak_rss_mb = res.get("peak_rss_mb", math.nan)
        return run
    run.ok = True
    run.first, run.times, run.median = res["first"], res["times"], res["median"]
    run.peak_rss_mb, run.shape = res["peak_rss_mb"], res["shape"]
    run.kernel_path = spec["kernel_out"]
    return run


def fmt_time(r: Optional[Run]) -> str:
    if r is None:
        return "—"
    if not r.ok:
        return "FAILED"
    return f"{r.median:.3f}"




def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Time torchntk vs neural-tangents empirical NTK "
                    "(implementations 1 and 2) on an MLP and a CNN.")
    ap.add_argument("--models", default="mlp,cnn", help="comma list of mlp,cnn (default: both)")
    ap.add_argument("--kernels", default="full,traced",
                    help="comma list of full (trace_axes=()), traced (trace_axes=(-1,))")
    ap.add_argument("--impls", default="1,2", help="torchntk/NT implementations to compare (1,2)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed calls after the warm-up call; the median is reported (default 3)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads(N) and pin every worker (torch and JAX) to "
                         "N cores, which is what limits XLA's thread pool; N=1 also sets "
                         "XLA_FLAGS to single-threaded Eigen. Default: no limit (all cores)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds allowed per configuration, warm-up and compile included "
                         "(default 300)")
    ap.add_argument("--no-nt3", action="store_true",
                    help="skip the neural-tangents implementation 3 reference rows")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the torch.func tutorial baseline (Jacobian contraction)")
    add_common_arguments(ap)
    args = ap.parse_args(argv)

    if args._worker:
        return worker_main(args._worker)

    models = parse_list(args.models, {"mlp", "cnn"})
    kernels = parse_list(args.kernels, set(KERNELS))
    impls = parse_list(args.impls, {1, 2}, int)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    # ---- header ---------------------------------------------------------
    header, use_t, use_nt = run_header("# torchntk vs neural-tangents: empirical NTK benchmark", args, not args.no_torchntk, not args.no_nt, " (--no-nt)")
    print("\n".join(header), flush=True)

    # ---- plan -----------------------------------------------------------
    plan: List[Run] = []
    for m in models:
        for k in kernels:
            for i in impls:
                if use_t:
                    plan.append(Run("torchntk", m, k, i))
                if use_nt:
                    plan.append(Run("nt", m, k, i))
            if use_nt and not args.no_nt3:
                plan.append(Run("nt", m, k, 3))
            if not args.no_baseline:
                plan.append(Run("tutorial", m, k, 1))

    tmpdir = tempfile.mkdtemp(prefix="bench_ntk_")
    results: Dict[Tuple[str, str, str, int], Run] = {}
    model_desc: Dict[str, str] = {}
    t_start = time.perf_counter()
    try:
        data = {}
        for m in models:
            data[m], model_desc[m] = prepare_data(m, tmpdir)
            print(f"model {m}: {model_desc[m]}", flush=True)
        for n, run in enumerate(plan, 1):
            label = f"[{n:2d}/{len(plan)}] {run.lib:8s} {run.model} {run.kernel:6s} impl={run.impl}"
            print(label + " ...", end="", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            run_config(run, data[run.model], tmpdir, args)
            wall = time.perf_counter() - t0
            if run.ok:
                print(f" median {run.median:.3f} s (first call {run.first:.3f} s, "
                      f"peak RSS {run.peak_rss_mb:.0f} MB, worker {wall:.1f} s)",
                      file=sys.stderr, flush=True)
            else:
                print(f" FAILED: {run.error}", file=sys.stderr, flush=True)
            results[run.key] = run
            gc.collect()

        # ---- kernel differences ------------------------------------------
        for run in plan:
            if not run.ok:
                continue
            ref = None
            if run.lib == "torchntk":
                ref, run.diff_ref = results.get(("nt", run.model, run.kernel, run.impl)), ""
            elif run.lib == "nt" and run.impl == 3:
                ref = results.get(("torchntk", run.model, run.kernel, 1))
                run.diff_ref = "(vs torchntk 1)"
                if ref is None or not ref.ok:
                    ref = results.get(("nt", run.model, run.kernel, 1))
                    run.diff_ref = "(vs NT 1)"
            elif run.lib == "tutorial":
                ref = results.get(("nt", run.model, run.kernel, 1))
                run.diff_ref = "(vs NT 1)"
                if ref is None or not ref.ok:
                    ref = results.get(("torchntk", run.model, run.kernel, 1))
                    run.diff_ref = "(vs torchntk 1)"
            if ref is not None and ref.ok:
                run.diff, why = rel_diff(run.kernel_path, ref.kernel_path)
                if why:
                    run.diff_ref = why
            else:
                run.diff_ref = ""
    finally:
        if not args.keep_tmp:
            import shutil
            shutil.rmtree(tmpdir, ignore_errors=True)
        else:
            print(f"scratch directory kept: {tmpdir}", file=sys.stderr)

    # ---- tables -----------------------------------------------------------
    headers = ["model", "kernel", "impl", "torchntk [s]", "NT [s]", "NT/torchntk",
               "max rel diff", "tutorial [s]"]
    rows = []
    failures = []
    for m in models:
        for k in kernels:
            kname = "full" if k == "full" else "traced"
            tut = results.get(("tutorial", m, k, 1))
            for i in impls:
                t = results.get(("torchntk", m, k, i))
                n = results.get(("nt", m, k, i))
                ratio = (f"{n.median / t.median:.2f}x"
                         if t is not None and n is not None and t.ok and n.ok else "—")
                diff = fmt_diff(t.diff, t.diff_ref) if t is not None and t.ok else "—"
                rows.append([m, kname, str(i), fmt_time(t), fmt_time(n), ratio, diff,
                             fmt_time(tut) if i == 1 else ""])
            n3 = results.get(("nt", m, k, 3))
            if n3 is not None:
                rows.append([m, kname, "3 (NT only)", "—", fmt_time(n3), "—",
                             fmt_diff(n3.diff, n3.diff_ref) if n3.ok else "—", ""])
    for r in plan:
        if not r.ok:
            failures.append(f"{LIB_LABELS[r.lib]} {r.model} {r.kernel} impl {r.impl}: {r.error}")

    detail_headers = ["library", "model", "kernel", "impl", "first call [s]",
                      "median [s]", "min [s]", "all timed [s]", "peak RSS [MB]", "shape",
                      "max rel diff"]
    detail = []
    for r in plan:
        detail.append([
            LIB_LABELS[r.lib] if r.lib != "tutorial" else "torch.func tutorial",
            r.model, r.kernel, str(r.impl),
            f"{r.first:.3f}" if r.ok else "—",
            f"{r.median:.3f}" if r.ok else "FAILED",
            f"{min(r.times):.3f}" if r.ok else "—",
            " ".join(f"{t:.3f}" for t in r.times) if r.ok else "—",
            f"{r.peak_rss_mb:.0f}" if not math.isnan(r.peak_rss_mb) else "—",
            "x".join(map(str, r.shape)) if r.shape else "—",
            fmt_diff(r.diff, r.diff_ref) if r.ok else "—",
        ])

    notes = [
        "kernel: full = trace_axes=(), output (N1, N2, 10, 10); traced = trace_axes=(-1,), "
        "output (N1, N2). vmap_axes=0 in both libraries.",
        "impl: 1 = Jacobian contraction, 2 = NTK-vector products, 3 = NT structured "
        "derivatives (reference only).",
        "NT/torchntk > 1 means torchntk is faster. max rel diff = max|K_torchntk - K_NT| / "
        "max|K_NT| for the same implementation (impl-3 rows: NT 3 against the reference named).",
        "tutorial = PyTorch NTK tutorial's torch.func Jacobian contraction "
        "(vmap(jacrev) per example + einsum per parameter), shown on impl-1 rows.",
        f"total wall time {time.perf_counter() - t_start:.0f} s"
        + ("; load average %.2f %.2f %.2f at the end." % os.getloadavg()
           if hasattr(os, "getloadavg") else "."),
    ]

    text = [render(headers, rows, False), "", *notes]
    if failures:
        text += ["", "Failures:"] + [f"  - {f}" for f in failures]
    text += ["", "Per-run details:", render(detail_headers, detail, False)]
    print("\n" + "\n".join(text))

    if args.markdown:
        md = ["\n".join(header).replace("# torchntk", "## torchntk", 1).replace("\n", "  \n"),
              "", *(f"- {m}: {d}" for m, d in model_desc.items()), "",
              render(headers, rows, True), "", *(f"- {n}" for n in notes)]
        if failures:
            md += ["", "**Failures:**", ""] + [f"- {f}" for f in failures]
        md += ["", "<details><summary>Per-run details</summary>", "",
               render(detail_headers, detail, True), "", "</details>", ""]
        with open(args.markdown, "w") as fh:
            fh.write("\n".join(md))
        print(f"\nMarkdown written to {args.markdown}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"header": header, "models": model_desc,
                       "runs": [{k: v for k, v in r.__dict__.items() if k != "kernel_path"}
                                for r in plan]}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
