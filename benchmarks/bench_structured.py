#!/usr/bin/env python
"""Structured derivatives (implementation 3) and AUTO (0) against the other
implementations, and against neural-tangents' implementation 3.

Models (see ``_models.py``): ``mlp`` (784-512-512-10, N1=N2=64, full kernel,
with x2 given and with x2=None), ``cnn`` (3 x 32-channel 3x3 convs on 16x16x3,
N=16, full kernel), ``resnet`` (two basic blocks, 16-32 channels, BatchNorm in
eval mode, N=16, full kernel) and ``transformer`` (token + position embedding,
pre-LN MultiheadAttention + MLP block, mean over the tokens, vocabulary-sized
head; length 16, vocab 50, d_model 64, N=16; kernel traced over the vocabulary
axis, i.e. ``trace_axes=(-1,)``, shape ``(N1, N2)``).

For every (model, kernel, x2) it times torchntk's implementations 1, 2, 3 and
0 (AUTO; its pick is read from ``ntk_fn.auto_choice``) and, for ``mlp`` and
``cnn``, neural-tangents' implementation 3 (jitted, ``vmap_axes=0``, same
weights).  Each (library, model, kernel, x2, implementation) runs in its own
worker subprocess, one at a time: timings are a warm-up call then the median
of ``--repeats`` calls; memory is the growth of the worker's peak RSS over its
RSS just before the first kernel call.  A configuration that raises (e.g.
``NotImplementedError`` for an implementation that is not there yet), times
out or runs out of memory is reported in the tables, not fatal.

``--versus-nt`` makes the issue-16 table instead (``_versus_nt.py``): implementation 3
against neural-tangents' per model (``mlp``, ``wide``, ``cnn``), kernel, N and JAX weight
layout, the libraries alternating in their own processes.

Run ``python benchmarks/bench_structured.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import contextlib
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
    prepare_data,
    rel_diff,
    render,
    reset_peak_rss,
    run_header,
    time_calls,
    worker_entry,
    write_markdown,
)

MODELS = ("mlp", "cnn", "resnet", "transformer", "wide")
DEFAULT_MODELS = ("mlp", "cnn", "resnet", "transformer")
# Kernel each model is measured with unless --kernels says otherwise.
DEFAULT_KERNEL = {"mlp": "full", "cnn": "full", "resnet": "full", "transformer": "traced", "wide": "traced"}
KERNELS = {"full": (), "traced": (-1,)}
# x2 variants each model is measured with unless --x2 says otherwise.
DEFAULT_X2 = {"mlp": ("given", "none"), "cnn": ("given",), "resnet": ("given",), "wide": ("given",),
              "transformer": ("given",)}
IMPL_ORDER = (1, 2, 3, 0)
IMPL_NAMES = {0: "AUTO", 1: "Jacobian contraction", 2: "NTK-vector products",
              3: "structured derivatives"}
# Issue targets, checked where they apply: (model, min t1/t3, must beat NT 3).
TARGETS = {"mlp": (100.0, True), "cnn": (None, True)}

Key = Tuple[str, str, str, str, int]   # lib, model, kernel, x2, impl


# ===========================================================================
# Worker side: one configuration per process.
# ===========================================================================

def _attention_context(model, native_attention: bool):
    """``nn.MultiheadAttention`` in eval mode takes PyTorch's fused fast path
    (``aten::_native_multi_head_attention``) and, on CPU, a flash-attention
    ``scaled_dot_product_attention`` kernel; neither has a forward-mode
    derivative, so NTK-vector products fail on them.  Unless
    ``native_attention``, switch the fast path off and make SDPA use its
    composite "math" kernel for the whole worker (same function, every
    implementation sees the same ops)."""
    stack = contextlib.ExitStack()
    if native_attention:
        return stack
    import torch
    if not any(isinstance(m, torch.nn.MultiheadAttention) for m in model.modules()):
        return stack
    if hasattr(torch.backends, "mha") and hasattr(torch.backends.mha, "set_fastpath_enabled"):
        torch.backends.mha.set_fastpath_enabled(False)
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        stack.enter_context(sdpa_kernel(SDPBackend.MATH))
    except ImportError:
        pass
    return stack


class _Memory:
    """Peak RSS growth of the kernel calls over the RSS just before them.

    The peak is VmHWM after resetting it (see ``_common.reset_peak_rss``: a
    worker's ``ru_maxrss`` starts at the driver's peak); where that reset is
    not possible, ``ru_maxrss``."""

    def __init__(self):
        gc.collect()
        self.before = current_rss_mb()
        self.reset = reset_peak_rss()
        self.maxrss_before = peak_rss_mb()
        self.warmup_peak: Optional[float] = None

    def peak(self) -> float:
        return hwm_rss_mb() if self.reset else peak_rss_mb()

    def mark_warmup(self) -> None:
        """Peak of the warm-up call; then restart the high-water mark so that
        the timed calls are measured on their own (NT: without compilation)."""
        self.warmup_peak = self.peak()
        if self.reset:
            reset_peak_rss()

    def result(self) -> dict:
        timed_peak = self.peak()
        warm = timed_peak if self.warmup_peak is None else self.warmup_peak
        total_peak = max(warm, timed_peak) if self.reset else timed_peak
        return dict(rss_before_mb=self.before,
                    peak_growth_mb=total_peak - self.before,
                    timed_growth_mb=(timed_peak - self.before) if self.reset else math.nan,
                    peak_source="VmHWM" if self.reset else "ru_maxrss",
                    ru_maxrss_mb=peak_rss_mb(), ru_maxrss_before_mb=self.maxrss_before)


def run_worker(spec: dict, res: dict) -> dict:
    """Fills and returns ``res``; ``res["stage"]`` says how far it got."""
    limit_threads(spec["threads"])
    import numpy as np

    sys.path.insert(0, HERE)
    sys.path.insert(0, spec.get("torchntk_root") or REPO_ROOT)
    import _models

    lib, name, impl = spec["lib"], spec["model"], spec["impl"]
    if lib == "gemm":  # no model: the machine's matrix products (``--versus-nt``'s GEMM line)
        res["stage"] = "call"
        return _finished(spec, res, *_gemm_times(spec))
    trace_axes = tuple(spec["trace_axes"])
    x2_given = spec["x2"] == "given"
    data = np.load(spec["data"])
    state = {k[len("p:"):]: data[k] for k in data.files if k.startswith("p:")}
    x1_np, x2_np, y1_ref = data["x1"], data["x2"], data["y1"]
    res["stage"] = "setup"

    if lib == "torchntk":
        import torch

        import torchntk
        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        res["threads"] = torch.get_num_threads()
        res["version"] = getattr(torchntk, "__version__", "?")
        model = _models.build_torch_model(name)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        model.eval()
        x1 = torch.from_numpy(x1_np)
        x2 = torch.from_numpy(x2_np) if x2_given else None
        with _attention_context(model, spec["native_attention"]):
            res["stage"] = "build"
            fn = torchntk.empirical_ntk_fn(model, trace_axes=trace_axes, vmap_axes=0,
                                           implementation=impl)
            if impl == 0:
                res["stage"] = "auto_choice"
                try:
                    t0 = time.perf_counter()
                    choice = fn.auto_choice(x1, x2)
                    res["auto_choice_s"] = time.perf_counter() - t0
                    res["auto_pick"] = int(choice.implementation)
                    res["auto_pick_name"] = getattr(choice.implementation, "name", "?")
                    res["auto_choice_repr"] = repr(choice)[:500]
                except Exception as exc:  # report, but still time AUTO itself
                    res["auto_error"] = f"{type(exc).__name__}: {exc}".strip()[:500]
            res["stage"] = "call"
            mem = _Memory()
            out, first, times = time_calls(lambda: fn(x1, x2), spec["repeats"],
                                           after_warmup=mem.mark_warmup)
            res.update(mem.result())
        kernel_np = out.detach().cpu().numpy()

    elif lib == "floor":
        import torch
        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        model = _models.build_torch_model(name)
        model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        model.eval()
        x1 = torch.from_numpy(x1_np)
        x2 = torch.from_numpy(x2_np) if x2_given else x1
        res["stage"] = "call"
        mem = _Memory()
        out, first, times = time_calls(lambda: floor_kernel(model, x1, x2, trace_axes), spec["repeats"],
                                       after_warmup=mem.mark_warmup)
        res.update(mem.result())
        kernel_np = out.detach().cpu().numpy()

    elif lib == "nt":
        import jax
        import jax.numpy as jnp
        nt = import_neural_tangents()
        res["version"] = f"jax {jax.__version__}"
        layout = spec.get("layout", "in-out")
        params = _models.jax_params(state, layout)
        f = _models.jax_apply_fn(name, layout)
        x1 = jnp.asarray(x1_np)
        x2 = jnp.asarray(x2_np) if x2_given else None
        y1 = np.asarray(jax.jit(f)(params, x1))
        scale = float(np.max(np.abs(y1_ref)))
        # Same function on both sides?  (atol keeps near-zero entries sane.)
        np.testing.assert_allclose(y1, y1_ref, rtol=1e-4, atol=1e-4 * scale,
                                   err_msg="JAX and torch forward outputs differ")
        res["stage"] = "build"
        fn = jax.jit(nt.empirical_ntk_fn(f, trace_axes=trace_axes, vmap_axes=0,
                                         implementation=impl))
        res["stage"] = "call"
        mem = _Memory()
        out, first, times = time_calls(lambda: fn(x1, x2, params).block_until_ready(),
                                       spec["repeats"], after_warmup=mem.mark_warmup)
        res.update(mem.result())
        kernel_np = np.asarray(out)
    else:
        raise ValueError(lib)
    return _finished(spec, res, kernel_np, first, times)


def _finished(spec: dict, res: dict, kernel_np, first: float, times: list) -> dict:
    """``res`` of a worker that ran: its timings, and its result saved for the driver's comparisons."""
    import numpy as np

    np.save(spec["kernel_out"], kernel_np)
    res.update(ok=True, first=first, times=times, median=statistics.median(times), shape=list(kernel_np.shape))
    return res


GEMM_SHAPE = (640, 2048, 2048)
"""``(m, k, n)`` of the matrix product ``--versus-nt`` times in each library: the wide MLP's
largest (its sweeps through a 2048-wide layer at N = 32), the kind of product the rows' floors
are made of."""


def _gemm_times(spec: dict):
    """A float32 ``(m, k) @ (k, n)`` product of :data:`GEMM_SHAPE` timed in ``spec["layout"]``'s
    library (``torch``: ``torch.mm``, the BLAS torch was built with; ``jax``: a jitted ``@``)."""
    import numpy as np

    m, k, n = GEMM_SHAPE
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((k, n), dtype=np.float32)
    if spec["layout"] == "torch":
        import torch
        if spec["threads"]:
            torch.set_num_threads(spec["threads"])
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        out, first, times = time_calls(lambda: torch.mm(ta, tb), spec["repeats"])
        return out[:1, :1].numpy(), first, times
    import jax
    import jax.numpy as jnp

    ja, jb = jnp.asarray(a), jnp.asarray(b)
    product = jax.jit(lambda one, two: one @ two)
    out, first, times = time_calls(lambda: product(ja, jb).block_until_ready(), spec["repeats"])
    return np.asarray(out[:1, :1]), first, times


def floor_kernel(model, x1, x2, trace_axes):
    """The floor of a structured NTK of ``model`` (``--versus-nt --floor``), the arithmetic that
    implementation 3 of torchntk and of neural-tangents make at least, written by hand: one forward
    pass of x1 and x2 as one batch; the backward sweeps of every logit to the outputs of the linear
    and convolution layers (``G``, all logits at once as one batched backward pass); for a linear
    layer the product of its inputs' Gram and ``G``'s Gram, for a convolution the Gram of its
    weight's Jacobians, formed per example and logit from ``G`` and the input's patches (the
    cheapest way: pairs of positions across examples cost far more), and ``G``'s sums for the
    biases. Convolutions without groups or string padding only."""
    import torch
    from torch import nn
    from torch.nn import functional

    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    inputs, outputs = [], []

    def keep(module, args, output):
        inputs.append(args[0])
        outputs.append(output)

    hooks = [layer.register_forward_hook(keep) for layer in layers]
    try:
        x = torch.cat([x1, x2])
        y = model(x)
    finally:
        for hook in hooks:
            hook.remove()
    n1, o = x1.shape[0], y.shape[-1]
    basis = torch.eye(o, dtype=y.dtype).unsqueeze(1).expand(o, *y.shape)
    sweeps = torch.autograd.grad(y, outputs, basis, is_grads_batched=True)  # each (O, N1 + N2, ...)
    traced = tuple(trace_axes) == (-1,)

    def gram(one, two):  # (O, N1, width), (O, N2, width)
        return torch.einsum("oaw,obw->ab", one, two) if traced else torch.einsum("oaw,pbw->abop", one, two)

    kernel = torch.zeros((n1, x2.shape[0]) if traced else (n1, x2.shape[0], o, o))
    for layer, h, g in zip(layers, inputs, sweeps):
        if isinstance(layer, nn.Conv2d):
            if layer.groups != 1 or isinstance(layer.padding, str):
                raise NotImplementedError(f"floor_kernel: {layer}")
            patches = functional.unfold(h, layer.kernel_size, layer.dilation, layer.padding, layer.stride)
            g = g.flatten(3)  # (O, N, C_out, positions)
            jacobians = torch.einsum("onpl,nkl->onpk", g, patches).flatten(2)
            kernel += gram(jacobians[:, :n1], jacobians[:, n1:])
            if layer.bias is not None:
                g = g.sum(-1)
                kernel += gram(g[:, :n1], g[:, n1:])
            continue
        grams = gram(g[:, :n1], g[:, n1:])
        products = h[:n1] @ h[n1:].T
        kernel += grams * (products if traced else products[:, :, None, None])
        if layer.bias is not None:
            kernel += grams
    return kernel / o if traced else kernel  # a traced axis is averaged, as in neural-tangents


def worker_main(spec_path: str) -> int:
    return worker_entry(spec_path, run_worker)


# ===========================================================================
# Driver side.
# ===========================================================================

@dataclass
class Run:
    lib: str
    model: str
    kernel: str
    x2: str
    impl: int
    ok: bool = False
    error: str = ""
    error_type: str = ""
    first: float = math.nan
    times: List[float] = field(default_factory=list)
    median: float = math.nan
    shape: Optional[List[int]] = None
    rss_before_mb: float = math.nan
    peak_growth_mb: float = math.nan
    timed_growth_mb: float = math.nan
    peak_source: str = ""
    auto_pick: Optional[int] = None
    auto_pick_name: str = ""
    auto_choice_s: float = math.nan
    auto_error: str = ""
    kernel_path: str = ""
    diffs: Dict[str, object] = field(default_factory=dict)  # ref label -> rel diff (or why not)

    @property
    def key(self) -> Key:
        return (self.lib, self.model, self.kernel, self.x2, self.impl)

    @property
    def label(self) -> str:
        lib = "NT" if self.lib == "nt" else "torchntk"
        return f"{lib} {self.model} {self.kernel} x2={self.x2} impl {self.impl}"


def run_config_spec(spec: dict, stem: str, args) -> Tuple[Optional[dict], str]:
    """Runs one worker for ``spec`` (``lib``, ``model``, ``kernel``, ``x2``, ``impl``, ``data``
    and optionally ``layout``, ``torchntk_root``); returns ``launch_worker``'s result."""
    spec = dict(spec, trace_axes=list(KERNELS[spec["kernel"]]), repeats=args.repeats,
                threads=args.threads, native_attention=getattr(args, "native_attention", False),
                kernel_out=stem + ".npy", result_out=stem + ".json")
    return launch_worker(__file__, spec, stem, args.timeout, args.verbose)


def run_config(run: Run, data_path: str, tmpdir: str, args) -> Run:
    stem = os.path.join(tmpdir, f"{run.lib}-{run.model}-{run.kernel}-{run.x2}-{run.impl}")
    spec = dict(lib=run.lib, model=run.model, kernel=run.kernel, x2=run.x2, impl=run.impl,
                data=data_path, torchntk_root=args.torchntk_root)
    res, why = run_config_spec(spec, stem, args)
    spec["kernel_out"] = stem + ".npy"
    if res is None:
        run.error, run.error_type = why, "timeout" if why.startswith("timeout") else "crash"
        return run
    for name in ("auto_pick", "auto_pick_name", "auto_choice_s", "auto_error"):
        if name in res:
            setattr(run, name, res[name])
    if not res.get("ok"):
        run.error = f"[{res.get('stage', '?')}] {res.get('error', 'unknown error')}"
        run.error_type = res.get("error_type", "")
        return run
    run.ok = True
    for name in ("first", "times", "median", "shape", "rss_before_mb", "peak_growth_mb",
                 "timed_growth_mb", "peak_source"):
        setattr(run, name, res[name])
    run.kernel_path = spec["kernel_out"]
    return run


def fmt_time(r: Optional[Run]) -> str:
    if r is None:
        return "—"
    if not r.ok:
        return "not impl." if r.error_type == "NotImplementedError" else "FAILED"
    return f"{r.median:.3f}"


def fmt_d(d) -> str:
    return d if isinstance(d, str) else fmt_diff(d)


def fmt_mb(x: float) -> str:
    return "—" if x is None or math.isnan(x) else f"{x:.0f}"


def speedup(slow: Optional[Run], fast: Optional[Run]) -> Optional[float]:
    """t_slow / t_fast (> 1: `fast` is faster), or None if either is missing."""
    if slow is None or fast is None or not slow.ok or not fast.ok or fast.median <= 0:
        return None
    return slow.median / fast.median


def fmt_ratio(x: Optional[float]) -> str:
    if x is None:
        return "—"
    return f"{x:.0f}x" if x >= 100 else f"{x:.2f}x"


def build_plan(models, kernels_opt, x2_opt, impls, use_t, nt_impls) -> List[Run]:
    plan: List[Run] = []
    import _models
    for m in models:
        kernels = [DEFAULT_KERNEL[m]] if kernels_opt is None else kernels_opt
        x2s = DEFAULT_X2[m] if x2_opt is None else x2_opt
        for k in kernels:
            for x2 in x2s:
                if use_t:
                    plan += [Run("torchntk", m, k, x2, i) for i in IMPL_ORDER if i in impls]
                if m in _models.JAX_MODELS:
                    plan += [Run("nt", m, k, x2, i) for i in nt_impls]
    return plan


def compute_diffs(plan: List[Run], results: Dict[Key, Run]) -> None:
    """torchntk k != 1 and NT runs against torchntk 1; torchntk 3 also against NT 3."""
    for run in plan:
        if not run.ok:
            continue
        refs = []
        if not (run.lib == "torchntk" and run.impl == 1):
            refs.append(("torchntk 1", ("torchntk", run.model, run.kernel, run.x2, 1)))
        if run.lib == "torchntk" and run.impl == 3:
            refs.append(("NT 3", ("nt", run.model, run.kernel, run.x2, 3)))
        if run.lib == "nt" and run.impl != 3:
            refs.append(("NT 3", ("nt", run.model, run.kernel, run.x2, 3)))
        for label, key in refs:
            ref = results.get(key)
            if ref is not None and ref.ok:
                d, why = rel_diff(run.kernel_path, ref.kernel_path)
                run.diffs[label] = why or d   # why: e.g. a shape mismatch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Time torchntk's structured derivatives (3) and AUTO (0) against "
                    "implementations 1 and 2 and neural-tangents' implementation 3.")
    ap.add_argument("--models", default=None,
                    help=f"comma list of {','.join(MODELS)} (default: {','.join(DEFAULT_MODELS)}; "
                         f"with --versus-nt: mlp,wide,cnn)")
    ap.add_argument("--impls", default="1,2,3,0",
                    help="torchntk implementations to run, comma list of 0,1,2,3 "
                         "(default: all; 0 = AUTO)")
    ap.add_argument("--nt-impls", default="3",
                    help="neural-tangents implementations run on mlp and cnn, comma list "
                         "of 1,2,3 (default: 3)")
    ap.add_argument("--kernels", default=None,
                    help="comma list of full (trace_axes=()), traced (trace_axes=(-1,)) for "
                         "every model. Default: full for mlp, cnn, resnet; traced (over "
                         "the vocabulary) for transformer")
    ap.add_argument("--x2", default=None,
                    help="comma list of given, none (x2=None) for every model. Default: "
                         "given and none for mlp, given for the others")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed calls after the warm-up call; the median is reported (default 5)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads(N) and pin every worker to N cores (limits "
                         "XLA too). Default: no limit (all cores)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds allowed per configuration, warm-up and compile included "
                         "(default 600)")
    ap.add_argument("--native-attention", action="store_true",
                    help="leave nn.MultiheadAttention's fused fast path and the default SDPA "
                         "kernel on (neither supports forward-mode AD); default: fast path off, "
                         "SDPA math kernel, in the transformer's workers")
    ap.add_argument("--floor", action="store_true",
                    help="with --versus-nt: also time each row's floor (the forward pass, the backward "
                         "sweeps to the layers' outputs and, for MLPs, the Grams, written by hand)")
    ap.add_argument("--versus-nt", action="store_true",
                    help="the issue-16 table instead: implementation 3 against neural-tangents' 3 "
                         "per model, kernel, N and JAX weight layout, x2 given, the libraries "
                         "alternating in their own processes for --rounds rounds")
    ap.add_argument("--sizes", default=None,
                    help="--versus-nt: comma list of N (N1 = N2 = N; default 16,64,256)")
    ap.add_argument("--jax-layouts", default="in-out,out-in",
                    help="--versus-nt: dense weight layouts of the JAX twins, comma list of "
                         "in-out (h @ W, W stored (in, out)) and out-in (h @ W.T, torch's layout); "
                         "default both")
    ap.add_argument("--rounds", type=int, default=2,
                    help="--versus-nt: rounds of (torchntk, NT) workers; the median is over all "
                         "timed calls of all rounds (default 2)")
    ap.add_argument("--max-jacobian", type=float, default=5e8,
                    help="--versus-nt: skip the out-in layout where N * outputs * parameters (the "
                         "Jacobian NT then forms) exceeds this many elements (default 5e8)")
    ap.add_argument("--torchntk-root", default=None,
                    help="import torchntk from this checkout in the torchntk workers (for "
                         "before/after tables); default: this repository")
    add_common_arguments(ap)
    args = ap.parse_args(argv)

    if args._worker:
        return worker_main(args._worker)
    if args.versus_nt:
        from _versus_nt import versus_nt
        return versus_nt(args, run_config_spec)

    models = parse_list(args.models or ",".join(DEFAULT_MODELS), set(MODELS))
    impls = parse_list(args.impls, {0, 1, 2, 3}, int)
    nt_impls = parse_list(args.nt_impls, {1, 2, 3}, int)
    kernels_opt = parse_list(args.kernels, set(KERNELS)) if args.kernels else None
    x2_opt = parse_list(args.x2, {"given", "none"}) if args.x2 else None
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")

    # ---- header ---------------------------------------------------------
    header, use_t, use_nt = run_header("# torchntk structured derivatives / AUTO benchmark", args, not args.no_torchntk, not args.no_nt and bool(nt_impls), "")
    print("\n".join(header), flush=True)

    sys.path.insert(0, HERE)
    plan = build_plan(models, kernels_opt, x2_opt, impls, use_t, nt_impls if use_nt else [])

    tmpdir = tempfile.mkdtemp(prefix="bench_structured_")
    results: Dict[Key, Run] = {}
    model_desc: Dict[str, str] = {}
    t_start = time.perf_counter()
    try:
        data = {}
        for m in models:
            data[m], model_desc[m] = prepare_data(m, tmpdir)
            print(f"model {m}: {model_desc[m]}", flush=True)
        for n, run in enumerate(plan, 1):
            print(f"[{n:2d}/{len(plan)}] {run.label} ...", end="", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            run_config(run, data[run.model], tmpdir, args)
            wall = time.perf_counter() - t0
            if run.ok:
                pick = f", AUTO picks {run.auto_pick}" if run.auto_pick is not None else ""
                print(f" median {run.median:.3f} s (first {run.first:.3f} s, peak RSS growth "
                      f"{fmt_mb(run.peak_growth_mb)} MB{pick}, worker {wall:.1f} s)",
                      file=sys.stderr, flush=True)
            else:
                print(f" FAILED: {run.error[:200]}", file=sys.stderr, flush=True)
            results[run.key] = run
            gc.collect()
        compute_diffs(plan, results)
    finally:
        if not args.keep_tmp:
            import shutil
            shutil.rmtree(tmpdir, ignore_errors=True)
        else:
            print(f"scratch directory kept: {tmpdir}", file=sys.stderr)

    # ---- tables -----------------------------------------------------------
    groups: List[Tuple[str, str, str]] = []
    for r in plan:
        g = (r.model, r.kernel, r.x2)
        if g not in groups:
            groups.append(g)

    def get(lib, g, impl) -> Optional[Run]:
        return results.get((lib, *g, impl))

    # Timings.
    time_headers = ["model", "kernel", "x2", "impl 1 [s]", "impl 2 [s]", "impl 3 [s]",
                    "NT 3 [s]", "t1/t3", "t2/t3", "tNT3/t3", "max rel diff 3 vs 1",
                    "max rel diff 3 vs NT 3"]
    time_rows = []
    for g in groups:
        t1, t2, t3, n3 = (get("torchntk", g, 1), get("torchntk", g, 2), get("torchntk", g, 3),
                          get("nt", g, 3))
        d31 = fmt_d(t3.diffs.get("torchntk 1")) if t3 is not None and t3.ok else "—"
        d3n = fmt_d(t3.diffs.get("NT 3")) if t3 is not None and t3.ok else "—"
        time_rows.append([*g, fmt_time(t1), fmt_time(t2), fmt_time(t3), fmt_time(n3),
                          fmt_ratio(speedup(t1, t3)), fmt_ratio(speedup(t2, t3)),
                          fmt_ratio(speedup(n3, t3)), d31, d3n])

    # AUTO.
    auto_headers = ["model", "kernel", "x2", "AUTO pick", "fastest of 1/2/3",
                    "t_pick/t_fastest", "AUTO call [s]", "t_AUTO/t_fastest", "auto_choice [s]"]
    auto_rows = []
    for g in groups:
        a = get("torchntk", g, 0)
        if a is None:
            continue
        measured = [r for r in (get("torchntk", g, i) for i in (1, 2, 3)) if r is not None and r.ok]
        best = min(measured, key=lambda r: r.median) if measured else None
        missing = [str(i) for i in (1, 2, 3)
                   if not any(r.impl == i for r in measured)]
        best_s = (f"{best.impl} ({best.median:.3f} s)" if best else "—") + (
            f" [no {','.join(missing)}]" if best and missing else "")
        if a.auto_pick is not None:
            pick = str(a.auto_pick) + (f" ({a.auto_pick_name})" if a.auto_pick_name else "")
        elif a.auto_error or a.error:
            pick = "not impl." if "NotImplementedError" in (a.auto_error or a.error) else "FAILED"
        else:
            pick = "—"
        picked = get("torchntk", g, a.auto_pick) if a.auto_pick is not None else None
        auto_rows.append([*g, pick, best_s, fmt_ratio(speedup(picked, best)),
                          fmt_time(a), fmt_ratio(speedup(a, best)),
                          f"{a.auto_choice_s:.4f}" if not math.isnan(a.auto_choice_s) else "—"])

    # Memory.
    mem_headers = ["model", "kernel", "x2", "impl 1 [MB]", "impl 2 [MB]", "impl 3 [MB]",
                   "AUTO [MB]", "NT 3 [MB]", "NT 3, timed calls only [MB]", "impl 1 / impl 3"]
    mem_rows = []

    def mem(r: Optional[Run]) -> str:
        if r is None:
            return "—"
        return fmt_mb(r.peak_growth_mb) if r.ok else fmt_time(r)

    for g in groups:
        t1, t3, n3 = get("torchntk", g, 1), get("torchntk", g, 3), get("nt", g, 3)
        ratio = "—"
        if t1 is not None and t3 is not None and t1.ok and t3.ok and t3.peak_growth_mb > 0:
            ratio = f"{t1.peak_growth_mb / t3.peak_growth_mb:.1f}x"
        mem_rows.append([*g, mem(t1), mem(get("torchntk", g, 2)), mem(t3),
                         mem(get("torchntk", g, 0)), mem(n3),
                         fmt_mb(n3.timed_growth_mb) if n3 is not None and n3.ok else "—", ratio])

    # Targets.
    target_lines = []
    for g in groups:
        m = g[0]
        if m not in TARGETS:
            continue
        min_speedup, beat_nt = TARGETS[m]
        t1, t3, n3 = get("torchntk", g, 1), get("torchntk", g, 3), get("nt", g, 3)
        if t3 is None or not t3.ok:
            why = "not run" if t3 is None else (
                "not implemented" if t3.error_type == "NotImplementedError" else "failed")
            target_lines.append(f"{' '.join(g)}: impl 3 {why}; targets not measured")
            continue
        parts = []
        if min_speedup is not None:
            s = speedup(t1, t3)
            parts.append(f"t1/t3 = {fmt_ratio(s)} (target >= {min_speedup:.0f}x: "
                         f"{'met' if s is not None and s >= min_speedup else 'NOT met' if s is not None else 'no impl 1'})")
        if beat_nt:
            s = speedup(n3, t3)
            parts.append(f"tNT3/t3 = {fmt_ratio(s)} (target > 1: "
                         f"{'met' if s is not None and s > 1 else 'NOT met' if s is not None else 'no NT 3'})")
        target_lines.append(f"{' '.join(g)}: " + "; ".join(parts))

    failures = [f"{r.label}: {r.error}" for r in plan if not r.ok]
    failures += [f"{r.label}: auto_choice: {r.auto_error}" for r in plan if r.auto_error]

    detail_headers = ["library", "model", "kernel", "x2", "impl", "first call [s]", "median [s]",
                      "min [s]", "all timed [s]", "RSS before [MB]", "peak growth [MB]",
                      "timed-calls growth [MB]", "shape", "max rel diff"]
    detail = []
    for r in plan:
        diffs = ", ".join(f"{fmt_d(d)} vs {k}" for k, d in r.diffs.items()) or "—"
        detail.append([
            "neural-tangents" if r.lib == "nt" else "torchntk", r.model, r.kernel, r.x2,
            str(r.impl) + (f" (picks {r.auto_pick})" if r.auto_pick is not None else ""),
            f"{r.first:.3f}" if r.ok else "—",
            f"{r.median:.3f}" if r.ok else fmt_time(r),
            f"{min(r.times):.3f}" if r.ok else "—",
            " ".join(f"{t:.3f}" for t in r.times) if r.ok else "—",
            fmt_mb(r.rss_before_mb), fmt_mb(r.peak_growth_mb), fmt_mb(r.timed_growth_mb),
            "x".join(map(str, r.shape)) if r.shape else "—",
            diffs if r.ok else "—",
        ])

    sources = sorted({r.peak_source for r in plan if r.ok and r.peak_source})
    notes = [
        "kernel: full = trace_axes=(), (N1, N2, out, out); traced = trace_axes=(-1,) (mean over "
        "the last output axis, as in neural-tangents): for the transformer (N1, N2), "
        "traced over the vocabulary. vmap_axes=0 everywhere. x2: given = two different "
        "batches; none = x2=None (kernel of x1 with itself).",
        "impl: 1 = Jacobian contraction, 2 = NTK-vector products, 3 = structured derivatives, "
        "0 = AUTO. NT 3 = neural-tangents' structured derivatives, jitted, same weights.",
        "t1/t3, t2/t3, tNT3/t3: median time of the other implementation over torchntk impl 3's "
        "(> 1 means impl 3 is faster). max rel diff = max|K - K_ref| / max|K_ref|.",
        "AUTO: pick = ntk_fn.auto_choice(x1, x2).implementation; t_pick/t_fastest compares "
        "the separately timed runs of the picked and the fastest implementation (1.00x = AUTO "
        "picked the fastest); t_AUTO/t_fastest times implementation=0 itself.",
        "memory: peak RSS growth of the worker over its RSS just before the first kernel call, "
        f"warm-up and timed calls included (peak from {', '.join(sources) or '—'}; VmHWM is "
        "reset first because a worker's ru_maxrss starts at the driver's peak). NT's warm-up "
        "includes XLA compilation: the 'timed calls only' column leaves it out.",
        f"total wall time {time.perf_counter() - t_start:.0f} s"
        + ("; load average %.2f %.2f %.2f at the end." % os.getloadavg()
           if hasattr(os, "getloadavg") else "."),
    ]

    if "transformer" in models:
        notes.insert(-1, "transformer: nn.MultiheadAttention's fused eval fast path is switched "
                     "off and SDPA uses its math kernel in the workers (neither fused kernel "
                     "has forward-mode AD)"
                     + (" -- NOT in this run (--native-attention)." if args.native_attention
                        else "."))

    sections = [("Timings", time_headers, time_rows)]
    if auto_rows:
        sections.append(("AUTO (implementation 0)", auto_headers, auto_rows))
    sections.append(("Peak RSS growth", mem_headers, mem_rows))

    text = []
    for title, hs, rows in sections:
        text += ["", title + ":", render(hs, rows, False)]
    if target_lines:
        text += ["", "Targets:"] + [f"  - {t}" for t in target_lines]
    text += ["", *notes]
    if failures:
        text += ["", "Failures:"] + [f"  - {f}" for f in failures]
    text += ["", "Per-run details:", render(detail_headers, detail, False)]
    print("\n".join(text))

    if args.markdown:
        write_markdown(args.markdown, header, ["", *(f"- {m}: {d}" for m, d in model_desc.items())], sections, target_lines, notes, failures,
                       detail_headers, detail)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"header": header, "models": model_desc, "notes": notes,
                       "targets": target_lines,
                       "runs": [{k: v for k, v in r.__dict__.items() if k != "kernel_path"}
                                for r in plan]}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
