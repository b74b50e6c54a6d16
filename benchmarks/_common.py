"""Helpers shared by the benchmark scripts (``bench_core.py``, ``bench_structured.py``).

Only the standard library is imported at module level: the drivers stay light
and the workers import torch / jax themselves, after :func:`limit_threads`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import types
from typing import List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)


# ===========================================================================
# Worker side.
# ===========================================================================

def limit_threads(threads: Optional[int]) -> None:
    """Must run before torch / jax are imported."""
    if not threads:
        return
    try:
        cpus = sorted(os.sched_getaffinity(0))
        # XLA's CPU thread pool is sized from the affinity mask, so pinning
        # the worker to `threads` cores is how JAX is limited; torch gets
        # set_num_threads as well.
        os.sched_setaffinity(0, cpus[:threads])
    except (AttributeError, OSError):
        pass
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if threads == 1:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=false"
                                   " intra_op_parallelism_threads=1").strip()


def peak_rss_mb() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def time_calls(call, repeats: int, after_warmup=None):
    """Warm-up call (timed separately), then `repeats` timed calls.

    ``after_warmup()``, if given, runs between the warm-up and the timed calls
    (e.g. to reset the RSS high-water mark)."""
    t0 = time.perf_counter()
    out = call()
    first = time.perf_counter() - t0
    if after_warmup is not None:
        after_warmup()
    times = []
    for _ in range(repeats):
        del out
        gc.collect()
        t0 = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - t0)
    return out, first, times


def import_neural_tangents():
    # neural_tangents/__init__ eagerly imports its TensorFlow bridge
    # (neural_tangents.experimental); an empty placeholder module avoids
    # needing TensorFlow.  Nothing here uses the bridge.
    sys.modules.setdefault("neural_tangents.experimental",
                           types.ModuleType("neural_tangents.experimental"))
    import neural_tangents as nt
    return nt

def current_rss_mb() -> float:
    """Resident set size now (VmRSS), or NaN where /proc is unavailable."""
    return _proc_status_mb("VmRSS")


def reset_peak_rss() -> bool:
    """Resets this process's RSS high-water mark (VmHWM) to the current RSS.

    ``ru_maxrss`` cannot measure a worker's own peak reliably: the kernel also
    folds in the peak of the address space replaced at ``exec``, which for a
    worker started by ``subprocess`` is the *driver's* (vfork) -- a worker
    that never grows past the driver's peak would report the driver's.  Writing
    ``5`` to ``/proc/self/clear_refs`` (Linux >= 4.0) resets VmHWM, which then
    tracks this process alone.  Returns whether the reset worked.
    """
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def hwm_rss_mb() -> float:
    """RSS high-water mark (VmHWM) since the last :func:`reset_peak_rss`, or NaN."""
    return _proc_status_mb("VmHWM")


def _proc_status_mb(field: str) -> float:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0  # kB
    except (OSError, ValueError, IndexError):
        pass
    return float("nan")


# ===========================================================================
# Driver side.
# ===========================================================================

def cpu_description() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return f"{model}, {os.cpu_count()} logical cores ({usable} usable by this process)"


def mem_description() -> str:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 1024 ** 2:.1f} GiB RAM"
    except OSError:
        pass
    return "RAM unknown"


def dist_version(name: str) -> Optional[str]:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def probe_nt() -> Tuple[bool, str]:
    """Can jax + neural_tangents be imported (in a fresh process)?"""
    code = ("import sys, types; "
            "sys.modules.setdefault('neural_tangents.experimental', "
            "types.ModuleType('neural_tangents.experimental')); "
            "import jax, neural_tangents; print(jax.__version__)")
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True,
                           text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return False, "import of jax/neural_tangents timed out"
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["?"])[-1]
        return False, last
    return True, ""


def probe_torchntk() -> Tuple[bool, str, str]:
    sys.path.insert(0, REPO_ROOT)
    try:
        import torchntk
    except Exception as exc:
        return False, f"import torchntk failed: {type(exc).__name__}: {exc}", ""
    if not hasattr(torchntk, "empirical_ntk_fn"):
        return False, "torchntk has no empirical_ntk_fn", ""
    return True, "", getattr(torchntk, "__version__", "?")


def prepare_data(name: str, tmpdir: str, n: Optional[int] = None) -> Tuple[str, str]:
    """Build the seeded model + inputs once (``n`` examples per side instead of
    the model's N1, N2 when given); save weights, inputs and the torch forward
    output for the workers.  Returns (path, description)."""
    import numpy as np
    import torch

    sys.path.insert(0, HERE)
    import _models

    model = _models.build_torch_model(name)
    x1, x2 = _models.make_inputs(name, n)
    with torch.no_grad():  # plain forward for the cross-check, no NTK here
        y1 = model(x1).numpy()
    arrays = {"p:" + k: v for k, v in _models.state_to_numpy(model).items()}
    path = os.path.join(tmpdir, f"{name}.npz" if n is None else f"{name}-{n}.npz")
    np.savez(path, x1=x1.numpy(), x2=x2.numpy(), y1=y1, **arrays)
    desc = (f"{_models.MODEL_SPECS[name][3]}; {_models.num_params(model):,} parameters; "
            f"output {tuple(y1.shape)}")
    return path, desc


def launch_worker(script: str, spec: dict, stem: str, timeout: float,
                  verbose: bool = False) -> Tuple[Optional[dict], str]:
    """Runs ``script --_worker SPEC`` in a fresh interpreter; the worker writes
    its result to ``spec["result_out"]`` (a JSON object with an ``ok`` key).

    Returns ``(result, "")`` when the worker wrote a result (``ok`` may be
    false: it raised and reported), else ``(None, why)``: timed out, killed
    (e.g. out of memory) or exited without writing one.
    """
    with open(stem + ".spec.json", "w") as fh:
        json.dump(spec, fh)
    env = dict(os.environ)
    root = spec.get("torchntk_root") or REPO_ROOT  # another checkout's torchntk (before/after tables)
    env["PYTHONPATH"] = os.pathsep.join(
        [root, HERE] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    cmd = [sys.executable, os.path.abspath(script), "--_worker", stem + ".spec.json"]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timeout (> {timeout:g} s incl. warm-up/compile)"
    if not os.path.exists(spec["result_out"]):
        if p.returncode < 0:
            sig = -p.returncode
            why = "killed by SIGKILL (probably out of memory)" if sig == 9 else f"killed by signal {sig}"
        else:
            why = f"worker exited with status {p.returncode}"
        tail = " | ".join(p.stderr.strip().splitlines()[-3:])
        return None, why + (f": {tail}" if tail else "")
    with open(spec["result_out"]) as fh:
        res = json.load(fh)
    if not res.get("ok") and verbose:
        print(res.get("traceback", ""), file=sys.stderr)
    return res, ""


def rel_diff(a_path: str, b_path: str) -> Tuple[Optional[float], str]:
    """max|A - B| / max|B| with B the reference."""
    import numpy as np
    a, b = np.load(a_path), np.load(b_path)
    if a.shape != b.shape:
        return None, f"shape mismatch {a.shape} vs {b.shape}"
    den = float(np.max(np.abs(b)))
    num = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
    return (num / den if den > 0 else num), ""



def fmt_diff(d: Optional[float], ref: str = "") -> str:
    if d is None:
        return ref or "—"
    s = f"{d:.1e}"
    return f"{s} {ref}".strip()


def render(headers: List[str], rows: List[List[str]], markdown: bool) -> str:
    if markdown:
        out = ["| " + " | ".join(headers) + " |",
               "|" + "|".join("---" for _ in headers) + "|"]
        out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
        return "\n".join(out)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "-" * len(line)]
    out += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(out)


def parse_list(s: str, allowed, conv=str):
    items = [conv(x.strip()) for x in s.split(",") if x.strip()]
    for it in items:
        if it not in allowed:
            raise argparse.ArgumentTypeError(f"{it!r} not in {sorted(allowed)}")
    return items



def run_header(title: str, args, want_torchntk: bool, want_nt: bool, nt_skip_reason: str) -> Tuple[List[str], bool, bool]:
    """The lines describing a run (command, machine, versions, load, timing) and whether
    torchntk and neural-tangents are usable."""
    import shlex

    import torch

    header = [
        title,
        f"command : {' '.join(shlex.quote(a) for a in [sys.executable] + sys.argv)}",
        f"date    : {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"machine : {cpu_description()}, {mem_description()}; {platform.platform()}",
        f"python  : {platform.python_version()}",
        f"torch   : {torch.__version__} (default threads {torch.get_num_threads()})",
    ]
    use_t = want_torchntk
    if use_t:
        use_t, why_t, tver = probe_torchntk()
        header.append(f"torchntk: {tver}" if use_t else f"torchntk: unavailable ({why_t})")
    else:
        header.append("torchntk: skipped (--no-torchntk)")
    use_nt = want_nt
    if use_nt:
        use_nt, why_nt = probe_nt()
        vers = ", ".join(f"{n} {dist_version(n)}" for n in ("jax", "jaxlib", "neural-tangents"))
        header.append(f"NT      : {vers}" if use_nt else f"NT      : unavailable ({why_nt})")
    else:
        header.append(f"NT      : skipped{nt_skip_reason}")
    threads = args.threads
    header.append(f"threads : {threads if threads else 'default (all cores)'}"
                  + (f" (torch.set_num_threads + cores pinned for JAX"
                     f"{'; XLA_FLAGS single-threaded Eigen' if threads == 1 else ''})"
                     if threads else ""))
    try:
        header.append("load    : 1/5/15-min load average %.2f %.2f %.2f at start "
                      "(timings are wall-clock: other load on the machine inflates them)"
                      % os.getloadavg())
    except OSError:
        pass
    header.append(f"timing  : 1 warm-up call (NT: includes jit compile), then median of "
                  f"{args.repeats} calls, time.perf_counter; NT results block_until_ready")
    return header, use_t, use_nt


def write_markdown(path: str, header: List[str], intro: List[str], sections, targets: List[str],
                   notes: List[str], failures: List[str], detail_headers: List[str], detail) -> None:
    """The run's tables as Markdown: header, ``intro`` lines, ``(title, headers, rows)`` sections,
    targets, notes, failures and the per-run details folded away."""
    md = ["\n".join(header).replace("# torchntk", "## torchntk", 1).replace("\n", "  \n"), *intro]
    for title, hs, rows in sections:
        md += ["", f"### {title}", "", render(hs, rows, True)]
    if targets:
        md += ["", "### Targets", ""] + [f"- {t}" for t in targets]
    md += ["", *(f"- {n}" for n in notes)]
    if failures:
        md += ["", "**Failures:**", ""] + [f"- {f}" for f in failures]
    md += ["", "<details><summary>Per-run details</summary>", "",
           render(detail_headers, detail, True), "", "</details>", ""]
    with open(path, "w") as fh:
        fh.write("\n".join(md))
    print(f"\nMarkdown written to {path}")


def add_common_arguments(ap: argparse.ArgumentParser) -> None:
    """The output, library-skipping and worker options every benchmark script takes."""
    ap.add_argument("--markdown", metavar="PATH", help="also write the tables as Markdown")
    ap.add_argument("--json", metavar="PATH", help="also write all raw results as JSON")
    ap.add_argument("--no-nt", action="store_true", help="skip neural-tangents")
    ap.add_argument("--no-torchntk", action="store_true", help="skip torchntk")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the worker scratch directory")
    ap.add_argument("-v", "--verbose", action="store_true", help="print worker tracebacks")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)


def worker_entry(spec_path: str, run) -> int:
    """A worker process's whole life: ``run(spec, res)`` fills ``res``; any exception (MemoryError,
    ImportError, ...) is recorded in it instead, with the peak RSS, and ``res`` is written to the
    spec's ``result_out`` for the driver (``launch_worker``)."""
    with open(spec_path) as fh:
        spec = json.load(fh)
    res: dict = {"stage": "start"}
    try:
        run(spec, res)
    except BaseException as exc:  # report everything, NotImplementedError and MemoryError included
        res.update(ok=False, error=f"{type(exc).__name__}: {exc}".strip(),
                   error_type=type(exc).__name__, traceback=traceback.format_exc())
        try:
            res.setdefault("peak_rss_mb", peak_rss_mb())
        except Exception:
            pass
    with open(spec["result_out"], "w") as fh:
        json.dump(res, fh)
    return 0
