#!/usr/bin/env python
"""Per-call host work of a warm kernel call: ATen calls, copies, views and host time, torchntk
against the PyTorch NTK tutorial.

What a GPU's host side pays for each kernel call is one dispatch per ATen call plus the Python
around them. For each row (float32, ``vmap_axes=0``, default checks, eager, x1 and x2 two different
batches of N examples) and each of torchntk's implementations 1, 2, 3 and 0 (AUTO, its pick shown)
and the tutorial (``torchntk.cli._tutorial.tutorial_ntk_fn``: the torch.func tutorial's
``vmap(jacrev)`` Jacobians and one einsum per parameter), this measures, per WARM call (after the
first call, with its plans and checks, and a further warm-up call):

* **ATen calls**: every ``func`` that reaches :class:`AtenCounter`, a
  ``torch.utils._python_dispatch.TorchDispatchMode`` subclass, during one call, counted per
  overload packet (``aten.mm``, ``aten.view``, ...). The mode sits below autograd and the
  torch.func transforms, so it sees the operations that actually run: a batched rule's
  decomposition, the backward pass's operations, the views vmap makes. Among them:

  - **copies**: the packets of :data:`COPY_OPS` (``aten::copy_``, ``aten::clone``,
    ``aten::_to_copy``, ...: what ``.contiguous()``, ``.to()``, ``.clone()`` and ``reshape`` of a
    non-viewable tensor run);
  - **views**: the packets of :data:`VIEW_OPS` (``aten::view``, ``aten::permute``,
    ``aten::expand``, ...: operations that make a new tensor header over the same memory, or
    reorder its strides, and compute nothing).

  The counts are exact (the same call always runs the same operations); the mode makes the call
  slower, so it is never active while timing.
* **Python calls**: the function calls of one warm call, Python's and built-ins' (``cProfile``'s
  count, :func:`count_python`): the host work that the ATen count misses (module walks, function
  modes, pytrees), exact like it, so a change shows on a noisy machine too.
* **host ms**: the median wall time of warm calls (``--rounds`` rounds of
  ``torchntk.cli._timing.timed_calls``, the implementations in turn: one warm-up call, then
  ``--repeats`` timed calls, or ``--slow-repeats`` where the first call took over ``--slow-call``
  seconds) with ``torch.set_num_threads(1)`` (``--threads``), without the dispatch mode. On a CPU
  this includes the arithmetic; on the small rows it is mostly host work.
* with ``--profile``, **Python ms**: the time of one warm call outside ATen operations, estimated
  with ``torch.profiler``: the wall time of the profiled call minus the summed durations of the
  outermost ``aten::`` events (an ``aten::`` event whose ancestors include no ``aten::`` event:
  ``aten::linear`` counts, the ``aten::addmm`` inside it does not). The profiler's own per-event
  cost falls partly on each side, so this is an estimate. Shown as "outside of wall" ms.

Each implementation's kernel is checked against the tutorial's (``max|K - K_tut| / max|K_tut|``)
so that the rows compare equal work.

Rows (``--rows``, default all):

* ``mlp``: MLP 784-512-512-10 (``torchntk/cli/_models.py: BENCH_MODELS["mlp"]``), N = 16, traced
  (``trace_axes=(-1,)``, the default);
* ``cnn``: the bench CNN, 3x[Conv2d 3x3 32ch + ReLU] -> Linear(8192, 10) on 3x16x16, N = 16, traced;
* ``fcn``: FCN 3072-2048x3-8 (the "FCN" of the GPU tables, ``BENCH_MODELS["fcn"]``), N = 16, full
  kernel (``trace_axes=()``);
* ``resnet18``: ``torchvision.models.resnet18(num_classes=8)`` in eval mode, 3x224x224, N = 8, full
  (``--quick``: 3x64x64 inputs). torchvision is imported through ``tests/zoo.py``; on a machine
  whose torchvision wheel does not match its torch (PyPI's CUDA build beside a CPU torch) set
  ``TORCHNTK_TEST_STUB_TORCHVISION_OPS=1`` as the tests do;
* ``lora``: a BERT-base-size ``BertForSequenceClassification`` (12 layers, hidden 768, 12 heads,
  intermediate 3072, vocabulary 8000, 2 labels, random weights; ``--quick``: 2 layers) with peft's
  LoRA (r = 8, alpha 16, on the attention's query and value, ``init_lora_weights=False``), as
  ``benchmarks/bench_workloads.py`` builds it: peft freezes the base model, so torchntk
  differentiates the adapters only (294,912 parameters). N = 8 sequences of 32 token ids
  ``(N, 32)`` int64, no attention mask (no padding: transformers' SDPA mask builder tests
  ``mask.all()``, data-dependent control flow that the tutorial's ``vmap`` over examples cannot
  run), the 2 logits out; full kernel. Its tutorial row is the same recipe over the same
  (trainable) parameters, the frozen ones passed as constants (``tutorial_ntk_fn`` differentiates the trainable parameters only).
  Skipped, saying why, where transformers or peft do not import;
* ``tiny``: MLP 8-32-32-4, N = 2, AUTO only, traced, against the tutorial: a call that is nothing
  but host work. Timed in ``--tiny-rounds`` rounds alternating the two, ``--tiny-repeats`` calls
  each, median over all; the target is torchntk / tutorial <= 0.8.

Output: a header (command, date, machine, torch, the path ``torchntk`` was imported from, threads,
load average), the Markdown table (model, implementation, ATen calls, copies, views, Python calls, host ms,
ATen calls / tutorial's, host ms / tutorial's, relative difference from the tutorial's kernel), the
tiny row's table, and the ``--top`` most frequent ATen packets of AUTO's pick and of the tutorial
per row. ``--markdown FILE`` writes the same.

    python benchmarks/bench_overhead.py                          # all rows: about 25 min on 2 cores
    python benchmarks/bench_overhead.py --rows mlp,cnn,tiny --repeats 9
    TORCHNTK_TEST_STUB_TORCHVISION_OPS=1 python benchmarks/bench_overhead.py --quick --profile
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_overhead.py   # another torchntk
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import os
import platform
import pstats
import shlex
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
# appended, not prepended: a torchntk on PYTHONPATH (another checkout, for before/after tables)
# wins over this one; the repository root is there for ``tests.zoo`` and an uninstalled torchntk
sys.path.append(REPO_ROOT)

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import torchntk  # noqa: E402
from _common import cpu_description, mem_description, render  # noqa: E402
from torchntk.cli._models import BENCH_MODELS, inputs, seeded  # noqa: E402
from torchntk.cli._timing import timed_calls  # noqa: E402
from torchntk.cli._tutorial import tutorial_ntk_fn  # noqa: E402

# ===========================================================================
# Counting.
# ===========================================================================

COPY_OPS = frozenset({
    "aten::copy_", "aten::copy", "aten::clone", "aten::_to_copy", "aten::_copy_from",
    "aten::_copy_from_and_resize", "aten::lift_fresh_copy", "aten::contiguous",
})
"""Operations that copy memory and compute nothing (``aten::contiguous`` itself never reaches the
mode: ``.contiguous()`` of a non-contiguous tensor runs ``aten::clone``). ``aten::_lazy_clone``, a
copy-on-write clone that copies nothing until it is written (torchntk's private copies of the
module's tensors), is not one: it appears in the ``--top`` lists."""

VIEW_OPS = frozenset({
    "aten::view", "aten::_unsafe_view", "aten::_reshape_alias", "aten::reshape", "aten::view_as",
    "aten::permute", "aten::transpose", "aten::t", "aten::movedim", "aten::swapaxes",
    "aten::expand", "aten::expand_as", "aten::unsqueeze", "aten::squeeze", "aten::flatten",
    "aten::unflatten", "aten::select", "aten::slice", "aten::narrow", "aten::as_strided",
    "aten::alias", "aten::detach", "aten::unfold", "aten::diagonal", "aten::split",
    "aten::split_with_sizes", "aten::unbind", "aten::chunk",
})
"""Views and reorderings: a new header (shape, strides, offset) over the same memory, no
arithmetic. Composite ones (``reshape``, ``flatten``, ``movedim``, ...) mostly decompose before
the mode sees them and are listed for completeness; ``aten::reshape`` of a tensor that cannot be
viewed shows up as ``aten::clone`` (a copy) and ``aten::_unsafe_view``."""


class AtenCounter(TorchDispatchMode):
    """Counts every operation that reaches it, per overload packet (``aten::mm`` for
    ``aten.mm.default`` and ``aten.mm.out`` alike), and runs it unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket._qualified_op_name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def calls(self) -> int:
        return sum(self.ops.values())

    @property
    def copies(self) -> int:
        return sum(n for name, n in self.ops.items() if name in COPY_OPS)

    @property
    def views(self) -> int:
        return sum(n for name, n in self.ops.items() if name in VIEW_OPS)


def count_python(call: Callable[[], Any]) -> int:
    """The Python and built-in function calls of one ``call()``, as ``cProfile`` counts them."""
    profile = cProfile.Profile()
    profile.enable()
    try:
        call()
    finally:
        profile.disable()
    return pstats.Stats(profile).total_calls


def count_aten(call: Callable[[], Any]) -> AtenCounter:
    """The ATen calls of one ``call()``."""
    counter = AtenCounter()
    with counter:
        call()
    return counter


def python_outside_aten(call: Callable[[], Any], device: torch.device) -> tuple[float, float]:
    """``(wall seconds, seconds outside the outermost aten:: events)`` of one profiled ``call()``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as recorded:
        _synchronize(device)
        start = time.perf_counter()
        call()
        _synchronize(device)
        wall = time.perf_counter() - start
    inside_us = 0.0
    for event in recorded.events():
        if not event.name.startswith("aten::"):
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("aten::"):
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            inside_us += event.time_range.elapsed_us()
    return wall, max(0.0, wall - inside_us * 1e-6)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ===========================================================================
# Rows.
# ===========================================================================

@dataclass
class Row:
    """A model, its inputs and its kernel layout."""

    name: str
    description: str
    model: nn.Module
    x1: torch.Tensor
    x2: torch.Tensor
    traced: bool
    tutorial: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    implementations: tuple = (1, 2, 3, 0)


@dataclass
class Result:
    label: str
    kernel: Optional[torch.Tensor] = None
    counter: Optional[AtenCounter] = None
    python_calls: Optional[int] = None
    seconds: list = field(default_factory=list)
    python: Optional[tuple] = None
    pick: Optional[int] = None
    repeats: int = 0
    error: str = ""


def bench_row(name: str, n: int, quick: bool, device: torch.device) -> Row:
    """The model and inputs of the row ``name`` (module docstring)."""
    if name in ("mlp", "cnn", "fcn"):
        choice = BENCH_MODELS[name]
        model = choice.build().to(device)
        x = inputs(choice.input_shape, 2 * n, torch.float32, device)
        traced = name != "fcn"
        return Row(name, f"{choice.description}, N = {n}, {'traced' if traced else 'full'}", model,
                   x[:n], x[n:], traced, tutorial_ntk_fn(model, traced))
    if name == "tiny":
        from torchntk.cli._models import mlp

        model = seeded(lambda: mlp(8, 32, 2, 4))().to(device)
        x = inputs((8,), 2 * n, torch.float32, device)
        return Row(name, f"MLP 8-32-32-4, N = {n}, traced", model, x[:n], x[n:], True,
                   tutorial_ntk_fn(model, True), (0,))
    if name == "resnet18":
        from tests import zoo

        torchvision = zoo.import_torchvision()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = torchvision.models.resnet18(num_classes=8).eval().to(device)
        side = 64 if quick else 224
        x = inputs((3, side, side), 2 * n, torch.float32, device)
        return Row(name, f"torchvision ResNet-18, 8 logits, {side}x{side}, N = {n}, full", model, x[:n], x[n:],
                   False, tutorial_ntk_fn(model, False))
    if name == "lora":
        model, x = bert_lora(2 if quick else 12, 2 * n, device)
        count = sum(p.numel() for p in model.parameters() if p.requires_grad)
        layers = 2 if quick else 12
        return Row(name, f"BERT-base-size ({layers} layers) + LoRA r=8 (q, v; {count:,} parameters), "
                   f"{TOKENS} tokens, N = {n}, full", model, x[:n], x[n:], False,
                   tutorial_ntk_fn(model, False))
    raise ValueError(name)


TOKENS = 32


class _Logits(nn.Module):
    """A sequence classifier on token ids ``(N, T)``, the logits out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits


def bert_lora(layers: int, n: int, device: torch.device) -> tuple[nn.Module, torch.Tensor]:
    from tests import zoo

    transformers = zoo.import_transformers()
    peft = zoo.import_peft()
    vocab = 8000
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=vocab, hidden_size=768, num_hidden_layers=layers, num_attention_heads=12,
            intermediate_size=3072, max_position_embeddings=TOKENS, num_labels=2,
        )
        base = transformers.BertForSequenceClassification(config).eval()
        lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["query", "value"],
                               init_lora_weights=False)
        model = _Logits(peft.get_peft_model(base, lora).eval()).eval().to(device)
    generator = torch.Generator().manual_seed(1)
    return model, torch.randint(3, vocab, (n, TOKENS), generator=generator).to(device)


# ===========================================================================
# Measuring.
# ===========================================================================

def measure_row(row: Row, repeats: int, rounds: int, profile: bool, device: torch.device,
                slow_call: float = float("inf"), slow_repeats: int = 2) -> dict:
    """Each implementation and the tutorial: first call (its kernel kept for the comparison), then
    ``rounds`` rounds of ``timed_calls`` (the implementations in turn: a change of the machine's
    load falls on all of them alike; ``slow_repeats`` timed calls instead of ``repeats`` where the
    first call took over ``slow_call`` seconds), then one counted call and, with ``profile``, one
    profiled call."""
    calls: dict = {}
    results: dict = {}
    trace_axes = (-1,) if row.traced else ()

    def first(label: str, make: Callable[[], Callable[[], Any]]) -> None:
        result = results[label]
        try:
            call = make()
            start = time.perf_counter()
            result.kernel = call()  # plans, checks, caches
            _synchronize(device)
            result.repeats = slow_repeats if time.perf_counter() - start > slow_call else repeats
            calls[label] = call
        except Exception as error:  # noqa: BLE001 - reported in the table
            result.error = f"{type(error).__name__}: {' '.join(str(error).split())[:160]}"
            traceback.print_exc()

    for implementation in row.implementations:
        label = str(implementation) if implementation else "AUTO"
        results[label] = Result(label)

        def make(implementation: int = implementation, result: Result = results[label]) -> Callable[[], Any]:
            ntk_fn = torchntk.empirical_ntk_fn(row.model, trace_axes, vmap_axes=0, implementation=implementation)
            if implementation == 0:
                result.pick = int(ntk_fn.auto_choice(row.x1, row.x2).implementation)
            return lambda: ntk_fn(row.x1, row.x2)

        first(label, make)
    results["tutorial"] = Result("tutorial")
    first("tutorial", lambda: lambda: row.tutorial(row.x1, row.x2))
    for _ in range(rounds):
        for label, call in calls.items():
            results[label].seconds += timed_calls(call, results[label].repeats, device)[1]
    for label, call in calls.items():
        results[label].counter = count_aten(call)
        results[label].python_calls = count_python(call)
        if profile:
            results[label].python = python_outside_aten(call, device)
    return results


def relative_difference(kernel: Optional[torch.Tensor], reference: Optional[torch.Tensor]) -> str:
    if kernel is None or reference is None:
        return "—"
    if kernel.shape != reference.shape:
        return f"shape {tuple(kernel.shape)} vs {tuple(reference.shape)}"
    scale = reference.abs().max().double()
    return f"{float((kernel.double() - reference.double()).abs().max() / scale):.1e}"


def table_rows(row: Row, results: dict, profile: bool) -> list[list[str]]:
    tutorial = results["tutorial"]
    base_calls = tutorial.counter.calls if tutorial.counter else None
    base_ms = statistics.median(tutorial.seconds) * 1e3 if tutorial.seconds else None
    out = []
    for label, result in results.items():
        shown = label if result.pick is None else f"AUTO (picks {result.pick})"
        if result.error:
            failed = [row.name, shown, "—", "—", "—", "—", "—", "—", "—", result.error, "0"]
            out.append(failed + (["—"] if profile else []))
            continue
        counter = result.counter
        ms = statistics.median(result.seconds) * 1e3
        cells = [
            row.name, shown, f"{counter.calls}", f"{counter.copies}", f"{counter.views}", f"{result.python_calls}",
            _ms(ms),
            f"{counter.calls / base_calls:.2f}" if base_calls else "—",
            f"{ms / base_ms:.2f}" if base_ms else "—",
            "reference" if label == "tutorial" else relative_difference(result.kernel, tutorial.kernel),
            f"{len(result.seconds)}",
        ]
        if profile:
            wall, outside = result.python
            cells.append(f"{_ms(outside * 1e3)} of {_ms(wall * 1e3)}")
        out.append(cells)
    return out


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def top_ops(row: Row, results: dict, top: int) -> list[str]:
    lines = []
    for label, result in results.items():
        if result.counter is None or not (label == "tutorial" or result.pick is not None):
            continue
        shown = "tutorial" if label == "tutorial" else f"AUTO (picks {result.pick})"
        listed = ", ".join(f"`{name.removeprefix('aten::')}` {n}" for name, n in result.counter.ops.most_common(top))
        lines.append(f"- {row.name}, {shown}: {listed}")
    return lines


HEADERS = ["model", "implementation", "ATen calls", "copies", "views", "Python calls", "host ms",
           "ATen calls / tutorial", "host ms / tutorial", "max rel. diff from tutorial", "timed calls"]


def header_lines(args: argparse.Namespace) -> list[str]:
    try:
        load = "%.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        load = "?"
    return [
        "# torchntk: per-call host work of a warm kernel call (bench_overhead.py)",
        "",
        f"command : {' '.join(shlex.quote(a) for a in ['python'] + sys.argv)}",
        f"date    : {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"machine : {cpu_description()}, {mem_description()}; {platform.platform()}",
        f"torch   : {torch.__version__}; {args.threads} thread(s) (torch.set_num_threads); device {args.device}",
        f"torchntk: {getattr(torchntk, '__version__', '?')} from {torchntk.__file__}",
        f"load    : 1/5/15-min load average {load} at start (host times are wall-clock; ATen counts are exact)",
        f"timing  : first call, then {args.rounds} round(s) of timed_calls (1 warm-up + {args.repeats} timed "
        f"calls, {args.slow_repeats} where the first call took over {args.slow_call:g} s), median; then one "
        f"counted call",
    ]


PLANNING_MODELS = "resnet18,mobilenet_v3_small,bert,gpt2,lstm,multihead_attention"


def planning_rows(names: list[str], kernel: tuple) -> list[list[str]]:
    """What a new key costs AUTO (``--planning``): on each real-model case of ``tests/zoo.py``
    (3 and 2 examples), in a process that has computed other kernels, a new AUTO kernel
    function's first call against its warm calls (median of 5), split into the first call's
    preparation (its ``vmap_axes`` checks and counted pass), AUTO's ``choose`` (the cost model and
    its probes, timed inside ``auto_choice``) and the rest."""
    from unittest import mock

    from tests import zoo
    from torchntk._implementations import auto as auto_module

    torchntk.empirical_ntk_fn(nn.Linear(3, 2), vmap_axes=0)(torch.randn(4, 3))
    found = []
    for name in names:
        case = {**zoo.FAST, **zoo.SLOW}[name]()
        spent: list[float] = []
        original = auto_module.choose

        def timed_choose(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent.append(time.perf_counter() - start)

        def fresh() -> Callable:
            return torchntk.empirical_ntk_fn(case.module, trace_axes=kernel, vmap_axes=case.vmap_axes,
                                             implementation=0, output_fn=case.output_fn)

        ntk_fn = fresh()
        with mock.patch.object(auto_module, "choose", timed_choose):
            start = time.perf_counter()
            ntk_fn(case.x1, case.x2, **case.kwargs)
            first = time.perf_counter() - start
        warm = []
        for _ in range(5):
            start = time.perf_counter()
            ntk_fn(case.x1, case.x2, **case.kwargs)
            warm.append(time.perf_counter() - start)
        steady = statistics.median(warm)
        choice = sum(spent)
        picked = int(ntk_fn.auto_choice(case.x1, case.x2, **case.kwargs).implementation)
        found.append([name, str(picked), _ms(steady * 1e3), _ms(first * 1e3), f"{(first - steady) / steady:.2f}",
                      _ms(choice * 1e3), f"{choice / steady:.3f}"])
        print(" | ".join(found[-1]), flush=True)
    return found


PLANNING_HEADERS = ["model", "AUTO picks", "warm ms", "first call ms", "(first - warm) / warm", "choose ms",
                    "choose / warm"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="mlp,cnn,fcn,resnet18,lora,tiny",
                        help="comma list of mlp, cnn, fcn, resnet18, lora, tiny (default all)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per round (default 7)")
    parser.add_argument("--slow-call", type=float, default=5.0,
                        help="seconds of a first call over which --slow-repeats apply (default 5)")
    parser.add_argument("--slow-repeats", type=int, default=2,
                        help="timed calls per round of a slow implementation (default 2)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of timed calls per implementation (default 1)")
    parser.add_argument("--tiny-repeats", type=int, default=50,
                        help="the tiny row's timed calls per round (default 50)")
    parser.add_argument("--tiny-rounds", type=int, default=10, help="the tiny row's rounds (default 10)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--device", default="cpu", help="where to compute (default cpu)")
    parser.add_argument("--quick", action="store_true",
                        help="resnet18 on 3x64x64 inputs, the LoRA BERT with 2 layers, 3 timed calls")
    parser.add_argument("--profile", action="store_true",
                        help="also the time outside ATen operations of one call (torch.profiler)")
    parser.add_argument("--top", type=int, default=10, help="ATen packets listed per row (default 10)")
    parser.add_argument("--markdown", metavar="FILE", help="also write the tables as Markdown")
    parser.add_argument("--planning", metavar="MODELS", nargs="?", const=PLANNING_MODELS,
                        help=f"also what a new key costs AUTO on these zoo models (default {PLANNING_MODELS})")
    args = parser.parse_args()
    rows = [name.strip() for name in args.rows.split(",") if name.strip()]
    known = ("mlp", "cnn", "fcn", "resnet18", "lora", "tiny")
    unknown = [name for name in rows if name not in known]
    if unknown:
        parser.error(f"--rows: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    if args.quick:
        args.repeats = min(args.repeats, 3)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning)  # PyTorch's vmap performance notes
    device = torch.device(args.device)

    lines = header_lines(args)
    print("\n".join(lines), flush=True)
    table, skipped, tops, tiny = [], [], [], []
    sizes = {"mlp": 16, "cnn": 16, "fcn": 16, "resnet18": 8, "lora": 8, "tiny": 2}
    for name in rows:
        try:
            row = bench_row(name, sizes[name], args.quick, device)
        except ImportError as error:
            skipped.append(f"- {name}: skipped ({' '.join(str(error).split())})")
            print(skipped[-1], flush=True)
            continue
        if name == "tiny":
            results = measure_row(row, args.tiny_repeats, args.tiny_rounds, args.profile, device)
        else:
            results = measure_row(row, args.repeats, args.rounds, args.profile, device, args.slow_call,
                                  min(args.slow_repeats, args.repeats))
        measured = table_rows(row, results, args.profile)
        (tiny if name == "tiny" else table).extend(measured)
        tops += top_ops(row, results, args.top)
        print(f"\n{row.description}", flush=True)
        print(render(HEADERS + (["Python ms outside ATen"] if args.profile else []), measured, True), flush=True)
        del row, results
        gc.collect()

    headers = HEADERS + (["Python ms outside ATen"] if args.profile else [])
    out = ["", "## Warm calls", ""]
    out += [render(headers, table, True)] if table else ["(no rows)"]
    if tiny:
        ratio = tiny[0][HEADERS.index("host ms / tutorial")]
        out += ["", "## The tiny row: MLP 8-32-32-4, N = 2, AUTO against the tutorial", "",
                render(headers, tiny, True), "",
                f"torchntk / tutorial host time: {ratio} (target <= 0.8)"]
    if args.planning:
        planning = planning_rows([name.strip() for name in args.planning.split(",") if name.strip()], ())
        out += ["", "## A new key: AUTO's first call against its warm calls (full kernels, 3 and 2 examples)", "",
                render(PLANNING_HEADERS, planning, True)]
    out += ["", "## Most frequent ATen packets per warm call", "", *tops]
    if skipped:
        out += ["", "## Skipped", "", *skipped]
    out += ["", "copies: " + ", ".join(f"`{name}`" for name in sorted(COPY_OPS)), "",
            "views: " + ", ".join(f"`{name}`" for name in sorted(VIEW_OPS))]
    print("\n".join(out), flush=True)
    if args.markdown:
        with open(args.markdown, "w") as written:
            written.write("\n".join(lines).replace("\n", "  \n") + "\n" + "\n".join(out) + "\n")
        print(f"\nMarkdown written to {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
