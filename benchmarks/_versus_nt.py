"""``bench_structured.py --versus-nt``: implementation 3 against neural-tangents' (issue 16).

For every model (default ``mlp``, ``wide``, ``cnn``), kernel (traced ``trace_axes=(-1,)`` and
full), N (N1 = N2 = N, x2 given) it runs, ``--rounds`` times in turn, one torchntk worker
(implementation 3) and one neural-tangents worker (implementation 3, jitted) per JAX weight
layout: ``in-out`` (``h @ W``, what neural-tangents' structured derivatives analyse best) and
``out-in`` (``h @ W.T``, torch's layout; skipped where the Jacobian neural-tangents then forms
exceeds ``--max-jacobian`` elements). Every worker is its own process: a warm-up call (with XLA's
compilation), then ``--repeats`` timed calls; the table gives the median over all rounds' timed
calls, the ratio torchntk / neural-tangents (in-out) and the largest kernel difference; with
``--floor``, also each row's floor (``bench_structured.floor_kernel``) and both libraries over it.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import tempfile
import time

from _common import parse_list, prepare_data, rel_diff, render, run_header

MODELS = ("mlp", "wide", "cnn")
KERNELS = ("traced", "full")
OUTPUTS = 10  # logits of every benchmark model


def versus_nt(args, run_config_spec) -> int:
    import _models

    models = parse_list(args.models or ",".join(MODELS), set(_models.JAX_MODELS))
    kernels = parse_list(args.kernels or ",".join(KERNELS), set(KERNELS))
    sizes = [int(size) for size in (args.sizes or "16,64,256").split(",") if size.strip()]
    layouts = parse_list(args.jax_layouts, set(_models.JAX_LAYOUTS))
    header, use_t, use_nt = run_header("# torchntk implementation 3 against neural-tangents' (issue 16)",
                                       args, not args.no_torchntk, not args.no_nt, "")
    print("\n".join(header), flush=True)
    tmpdir = tempfile.mkdtemp(prefix="bench_versus_nt_")
    rows, failures = [], []
    started = time.perf_counter()
    try:
        gemm = _gemm_line(args, run_config_spec, tmpdir, use_t, use_nt)
        header.append(gemm)
        print(gemm, flush=True)
        for model in models:
            parameters = _models.num_params(_models.build_torch_model(model))
            for n in sizes:
                data, _ = prepare_data(model, tmpdir, n)
                for kernel in kernels:
                    runs = [("torchntk", None)] if use_t else []
                    if getattr(args, "floor", False):
                        runs.append(("floor", None))
                    if use_nt:
                        runs += [("nt", layout) for layout in layouts
                                 if layout == "in-out" or n * OUTPUTS * parameters <= args.max_jacobian]
                    times = {run: [] for run in runs}
                    kernels_out = {}
                    for round_ in range(args.rounds):
                        for lib, layout in runs:
                            stem = os.path.join(tmpdir, f"{lib}-{layout}-{model}-{n}-{kernel}-{round_}")
                            spec = dict(lib=lib, model=model, kernel=kernel, x2="given", impl=3, data=data,
                                        layout=layout or "in-out", torchntk_root=args.torchntk_root)
                            result, why = run_config_spec(spec, stem, args)
                            label = f"{lib} {layout or ''} {model} N={n} {kernel} round {round_ + 1}"
                            if result is None or not result.get("ok"):
                                why = why or f"[{result.get('stage')}] {result.get('error', '')}"[:300]
                                failures.append(f"{label}: {why}")
                                print(f"{label}: FAILED {why[:200]}", file=sys.stderr, flush=True)
                                continue
                            times[lib, layout] += result["times"]
                            kernels_out[lib, layout] = stem + ".npy"
                            print(f"{label}: median {statistics.median(result['times']) * 1e3:.1f} ms",
                                  file=sys.stderr, flush=True)
                    rows.append(_row(model, n, kernel, layouts, times, kernels_out, getattr(args, "floor", False)))
    finally:
        if not args.keep_tmp:
            import shutil
            shutil.rmtree(tmpdir, ignore_errors=True)
    headers = ["model", "N", "kernel", "torchntk 3 [ms]"] + [f"NT 3 {layout} [ms]" for layout in layouts] + [
        "torchntk / NT in-out", "max rel diff vs NT"]
    if getattr(args, "floor", False):
        headers += ["floor [ms]", "torchntk / floor", "NT in-out / floor", "floor's rel diff"]
    text = render(headers, rows, False)
    ratios = [float(row[4 + len(layouts)]) for row in rows if _is_number(row[4 + len(layouts)])]
    notes = [
        f"x2 given, vmap_axes=0, float32; median over {args.rounds} rounds x {args.repeats} timed calls, "
        f"each library in its own worker process, alternating; total {time.perf_counter() - started:.0f} s",
        "NT out-in: dense weights in torch's (out, in) layout, used as h @ W.T",
    ]
    if ratios:
        notes.append(f"geometric mean of torchntk / NT in-out: {math.exp(statistics.mean(map(math.log, ratios))):.2f}")
    print(text)
    print("\n".join(notes))
    if failures:
        print("Failures:\n" + "\n".join(f"  - {failure}" for failure in failures))
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write("\n".join(header) + "\n\n" + render(headers, rows, True) + "\n\n"
                     + "\n".join(f"- {note}" for note in notes) + "\n")
            if failures:
                fh.write("\nFailures:\n\n" + "\n".join(f"- {failure}" for failure in failures) + "\n")
    return 0


def _gemm_line(args, run_config_spec, tmpdir: str, use_t: bool, use_nt: bool) -> str:
    """How fast each library multiplies matrices on this machine: the rows' floors are made of
    such products, so the ratios of two machines differ by as much as their BLAS libraries do
    (torch's MKL on an AMD EPYC ran at half of XLA's speed)."""
    from bench_structured import GEMM_SHAPE

    m, k, n = GEMM_SHAPE
    speeds = {}
    for engine, wanted in (("torch", use_t), ("jax", use_nt)):
        if not wanted:
            continue
        spec = dict(lib="gemm", model="mlp", kernel="traced", x2="given", impl=3, data="", layout=engine,
                    torchntk_root=args.torchntk_root)
        result, why = run_config_spec(spec, os.path.join(tmpdir, f"gemm-{engine}"), args)
        if result is None or not result.get("ok"):
            speeds[engine] = f"failed ({why or result.get('error', '')})"[:120]
        else:
            speeds[engine] = f"{2 * m * k * n / statistics.median(result['times']) / 1e9:.0f} GFLOP/s"
    measured = ", ".join(f"{engine} {speed}" for engine, speed in speeds.items()) or "not run"
    return f"GEMM    : float32 ({m} x {k}) @ ({k} x {n}), median of each library's worker: {measured}"


def _row(model, n, kernel, layouts, times, kernels_out, floor=False) -> list:
    def median(key) -> str:
        return f"{statistics.median(times[key]) * 1e3:.1f}" if times.get(key) else "—"

    ours = times.get(("torchntk", None))
    theirs = times.get(("nt", "in-out"))
    ratio = f"{statistics.median(ours) / statistics.median(theirs):.2f}" if ours and theirs else "—"
    difference = "—"
    if ("torchntk", None) in kernels_out and ("nt", "in-out") in kernels_out:
        value, why = rel_diff(kernels_out["torchntk", None], kernels_out["nt", "in-out"])
        difference = why or f"{value:.1e}"
    row = [model, str(n), kernel, median(("torchntk", None))] + [median(("nt", layout)) for layout in layouts] + [
        ratio, difference]
    if floor:
        bottom = times.get(("floor", None))

        def over_floor(key) -> str:
            if not (times.get(key) and bottom):
                return "—"
            return f"{statistics.median(times[key]) / statistics.median(bottom):.2f}"

        checked = "—"
        if ("floor", None) in kernels_out and ("torchntk", None) in kernels_out:
            value, why = rel_diff(kernels_out["floor", None], kernels_out["torchntk", None])
            checked = why or f"{value:.1e}"
        row += [median(("floor", None)), over_floor(("torchntk", None)), over_floor(("nt", "in-out")), checked]
    return row


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
