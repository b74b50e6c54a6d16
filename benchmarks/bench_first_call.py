#!/usr/bin/env python
"""The first kernel call with default arguments, against a warm call and the torch.func tutorial.

Most users compute one kernel of one data set once: ``torchntk.empirical_ntk_fn(model)(x)``. What
they feel is that first call: the planning of its key (the ``vmap_axes`` trial and its checks,
AUTO's choice, the memory plan) and the kernel. For each row this runs, each side in a fresh
process after the same warm-up of torch itself (a ``vmap(jacrev)`` of a small network, a
convolution and an LSTM, so that neither side pays for PyTorch's lazy initialisation):

Each side runs in ``--trials`` fresh processes (median of their times).

* **torchntk**: ``empirical_ntk_fn(model)`` with default arguments (only ``output_fn`` where the
  model returns more than logits), ``ntk_fn(x)``: the first call, then ``--repeats`` warm calls
  (median);
* **tutorial**: the torch.func tutorial's Jacobian contraction (``vmap(jacrev)`` of one example and
  one einsum per parameter, ``torchntk.cli._tutorial``'s recipe generalised to keyword arguments),
  ``ntk(x, x)`` as its users call it for one data set; where vmap cannot run the model (a
  Hugging Face attention mask, an LSTM's fused kernel) a Python loop of ``jacrev`` over the
  examples, as users then write it. A failed vmap attempt is not timed.

Printed: the table of first-call and warm times and the ratios the issue's targets name
(torchntk first / torchntk warm, torchntk first / tutorial first), the first call of a kernel
function built again for the same model after those calls (the one-liner run again: it shares the
first one's plans), against the warm call, and with ``--profile`` the
first call of each row timed by stage (:data:`STAGES`: torchntk's stage functions wrapped with
a timer in a third process; stages nest, so the shares do not add up). With ``--choice``, what
AUTO's choice adds to a first call: AUTO's first call against the first call of a kernel function
built with the implementation AUTO picked (``implementation=K``), in alternating fresh processes
(:func:`choice_trials`), the difference against the pick's warm call.

Rows (``--rows``): ``mlp`` MLP 784-512-512-10, N = 64; ``cnn`` 3x[conv 3x3 32ch + ReLU] on
3x16x16, 10 logits, N = 16; ``resnet18`` torchvision ResNet-18 with 10 logits, N = 8, 3x32x32,
eval mode; ``mobilenet`` torchvision MobileNetV3-small with 10 logits, N = 8, 3x32x32, eval mode;
``bert`` Hugging Face BertForSequenceClassification (2 layers, hidden 64, 2 heads, 2 labels), N = 8
sequences of 16 tokens with a padded ``attention_mask``, ``output_fn`` the logits; ``lstm`` an
LSTM classifier (8 features, hidden 32, 10 logits from the last step), N = 16 sequences of 12 steps.
All float32, default threads (``--threads`` to pin them). torchvision rows need a torchvision that
imports beside torch (``TORCHNTK_TEST_STUB_TORCHVISION_OPS=1`` as in the tests where its ops do
not load), the ``bert`` row transformers; a row whose library does not import is reported as such.

    python benchmarks/bench_first_call.py                       # every row, about 8 minutes on 2 cores
    python benchmarks/bench_first_call.py --rows mlp,resnet18 --profile
    python benchmarks/bench_first_call.py --choice --trials 5      # and what AUTO's choice adds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROWS = ("mlp", "cnn", "resnet18", "mobilenet", "bert", "lstm")

STAGES = {
    "vmap_axes trial": ("torchntk._kernel.preparation", None, "trial"),
    "output check": ("torchntk._call.vmap_check", "VmapAxesCheck", "outputs"),
    "derivative check": ("torchntk._call.vmap_check", "VmapAxesCheck", "derivatives"),
    "AUTO's choice": ("torchntk._implementations.auto", None, "choose"),
    "3's plan": ("torchntk._implementations.structured", "StructuredDerivatives", "plan"),
    "memory plan": ("torchntk._implementations", None, "memory_plan"),
    "kernel 1/2": ("torchntk._implementations", "_Stateless", "kernels"),
    "kernel 3": ("torchntk._implementations.structured", "StructuredDerivatives", "kernels"),
}
"""Stage label -> ``(module, class or None, function)`` whose outermost calls are the stage. Stages
nest (the trial holds the checks; the memory plan holds AUTO's choice, which holds 3's plan)."""


SLOW_CALL = 2.0
"""Seconds above which a first call is followed by one warm call instead of ``--repeats``."""


# -- models -------------------------------------------------------------------------------------------


def _seeded(build: Callable[[], Any]) -> Any:
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build()


def build_row(name: str) -> tuple[Any, Any, dict, Optional[Callable]]:
    """``(model, x, kwargs, output_fn)`` of a row, seeded."""
    import torch
    from torch import nn

    generator = torch.Generator().manual_seed(1)
    if name == "mlp":
        model = _seeded(lambda: nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                                              nn.Linear(512, 10)))
        return model.eval(), torch.randn(64, 784, generator=generator), {}, None
    if name == "cnn":
        def cnn() -> nn.Module:
            layers: list = []
            for cin in (3, 32, 32):
                layers += [nn.Conv2d(cin, 32, 3, padding=1), nn.ReLU()]
            return nn.Sequential(*layers, nn.Flatten(), nn.Linear(32 * 16 * 16, 10))
        return _seeded(cnn).eval(), torch.randn(16, 3, 16, 16, generator=generator), {}, None
    if name in ("resnet18", "mobilenet"):
        from tests import zoo

        models = zoo.import_torchvision().models
        build = models.resnet18 if name == "resnet18" else models.mobilenet_v3_small
        model = _seeded(lambda: build(num_classes=10))
        return model.eval(), torch.randn(8, 3, 32, 32, generator=generator), {}, None
    if name == "bert":
        from tests import zoo

        transformers = zoo.import_transformers()
        config = transformers.BertConfig(
            vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
            max_position_embeddings=32, num_labels=2,
        )
        model = _seeded(lambda: transformers.BertForSequenceClassification(config)).eval()
        ids = torch.randint(0, 100, (8, 16), generator=generator)
        mask = torch.ones(8, 16, dtype=torch.long)
        mask[::2, 11:] = 0  # every other sequence padded
        return model, ids, {"attention_mask": mask}, lambda output: output.logits
    if name == "lstm":
        class LstmClassifier(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lstm = nn.LSTM(8, 32, batch_first=True)
                self.head = nn.Linear(32, 10)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.head(self.lstm(x)[0][:, -1])

        return _seeded(LstmClassifier).eval(), torch.randn(16, 12, 8, generator=generator), {}, None
    raise ValueError(f"unknown row {name!r}; rows: {', '.join(ROWS)}")


# -- the two sides ------------------------------------------------------------------------------------


def warm_up_torch() -> None:
    """The same for both sides: PyTorch's lazy initialisation of vmap, jacrev, convolutions, RNNs."""
    import torch
    from torch import nn
    from torch.func import functional_call, jacrev, vmap

    for model, x in (
        (nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)), torch.randn(4, 6)),
        (nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(12, 2)), torch.randn(4, 2, 4, 4)),
    ):
        params = {name: p.detach() for name, p in model.named_parameters()}
        one = lambda p, example: functional_call(model, p, (example[None],))[0]  # noqa: E731
        vmap(jacrev(one), (None, 0))(params, x)
    rnn = nn.LSTM(3, 4, batch_first=True)
    rnn(torch.randn(2, 5, 3))[0].sum().backward()
    torch.einsum("naf,maf->nm", torch.randn(3, 2, 4), torch.randn(3, 2, 4))


def tutorial_ntk(model: Any, kwargs: dict, output_fn: Optional[Callable], loop: bool) -> Callable:
    """The torch.func tutorial's Jacobian contraction (traced logits), per-example keyword
    arguments mapped with the examples; ``loop``: a Python loop of ``jacrev`` instead of vmap."""
    import torch
    from torch.func import functional_call, jacrev, vmap

    params = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    constants = {name: p.detach() for name, p in model.named_parameters() if not p.requires_grad}
    constants.update(model.named_buffers())
    names = tuple(kwargs)

    def one_example(parameters: dict, x: torch.Tensor, *values: torch.Tensor) -> torch.Tensor:
        batch_kwargs = {name: value[None] for name, value in zip(names, values)}
        output = functional_call(model, (parameters, constants), (x[None],), batch_kwargs)
        return (output if output_fn is None else output_fn(output))[0]

    def jacobians(x: torch.Tensor) -> list:
        values = tuple(kwargs.values())
        if loop:
            per_example = [jacrev(one_example)(params, x[i], *(v[i] for v in values)) for i in range(x.shape[0])]
            return [torch.stack([j[name] for j in per_example]).flatten(2) for name in params]
        mapped = vmap(jacrev(one_example), (None, 0) + (0,) * len(values))(params, x, *values)
        return [j.flatten(2) for j in mapped.values()]

    def ntk(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        jacobian1, jacobian2 = jacobians(x1), jacobians(x2)
        kernel = torch.stack([torch.einsum("naf,maf->nm", j1, j2) for j1, j2 in zip(jacobian1, jacobian2)]).sum(0)
        return kernel / jacobian1[0].shape[1]

    return ntk


def worker(row: str, side: str, repeats: int, profile: bool) -> dict:
    """One side of one row in this (fresh) process."""
    import warnings

    import torch

    warnings.simplefilter("ignore")
    warm_up_torch()
    try:
        model, x, kwargs, output_fn = build_row(row)
    except Exception as error:  # noqa: BLE001 - a library that does not import
        return {"row": row, "side": side, "error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
    result: dict[str, Any] = {"row": row, "side": side}
    if side.startswith("torchntk"):
        import torchntk

        # "torchntk:K": implementation K named instead of AUTO's default (the choice's own cost)
        named = {"implementation": int(side.partition(":")[2])} if ":" in side else {}
        ntk_fn = torchntk.empirical_ntk_fn(model, output_fn=output_fn, **named)
        call = lambda: ntk_fn(x, **kwargs)  # noqa: E731
    else:
        try:
            tutorial_ntk(model, kwargs, output_fn, loop=False)(x, x)
            loop = False
        except Exception:  # noqa: BLE001 - vmap cannot run the model: users loop (not timed)
            loop = True
        # the attempt above ran the model: a fresh model object keeps the first call honest
        model, x, kwargs, output_fn = build_row(row)
        ntk = tutorial_ntk(model, kwargs, output_fn, loop)
        result["loop"] = loop
        call = lambda: ntk(x, x)  # noqa: E731
    stages = StageTimes() if profile and side == "torchntk" else None
    start = time.perf_counter()
    kernel = call()
    result["first"] = time.perf_counter() - start
    if stages is not None:
        result["stages"] = {label: spent / result["first"] for label, spent in stages.spent.items()}
    times = []
    for _ in range(repeats if result["first"] < SLOW_CALL else 1):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    result["warm"] = statistics.median(times)
    result["shape"] = list(kernel.shape)
    if side == "torchntk":  # AUTO's: what it picked, and the one-liner built again
        choice = ntk_fn.auto_choice(x, **kwargs)
        result["pick"] = int(choice.implementation)
        result["vmap_axes"] = choice.vmap_axes is not None
        # NOTE: [Plans shared by kernel functions]: the same one-liner written again
        rebuilt = torchntk.empirical_ntk_fn(model, output_fn=output_fn)
        start = time.perf_counter()
        rebuilt(x, **kwargs)
        result["rebuilt"] = time.perf_counter() - start
    return result


class StageTimes:
    """Wall time of each of :data:`STAGES`, summed over its outermost calls (wrapped functions:
    no profiler, so Python-heavy and BLAS-heavy stages are timed alike)."""

    def __init__(self) -> None:
        import functools
        import importlib

        self.spent = {label: 0.0 for label in STAGES}
        depth = {label: 0 for label in STAGES}
        for label, (module_name, class_name, function) in STAGES.items():
            owner = importlib.import_module(module_name)
            if class_name is not None:
                owner = getattr(owner, class_name)
            original = getattr(owner, function)

            def timed(*args, __original=original, __label=label, **kwargs):
                depth[__label] += 1
                start = time.perf_counter()
                try:
                    return __original(*args, **kwargs)
                finally:
                    depth[__label] -= 1
                    if depth[__label] == 0:
                        self.spent[__label] += time.perf_counter() - start

            setattr(owner, function, functools.wraps(original)(timed))
            if class_name is None:  # also where it was imported by name
                for module in list(sys.modules.values()):
                    if getattr(module, "__name__", "").startswith("torchntk") and getattr(module, function, None) is original:
                        setattr(module, function, getattr(owner, function))


def run_trials(row: str, side: str, repeats: int, threads: Optional[int], trials: int) -> dict:
    """:func:`run_side` ``trials`` times, alternating nothing else: the median first and warm times
    (a fresh process's first call varies by a third from run to run on a shared 2-core machine)."""
    results = [run_side(row, side, repeats, False, threads) for _ in range(trials)]
    failed = [result for result in results if "error" in result]
    if failed:
        return failed[0]
    merged = dict(results[0])
    for field in ("first", "warm", "rebuilt"):
        if field in merged:
            merged[field] = statistics.median(result[field] for result in results)
    return merged


def choice_trials(row: str, pick: int, repeats: int, threads: Optional[int], trials: int) -> dict:
    """AUTO's first call against the first call of the implementation it picks, named (``pick``),
    fresh processes alternating: the medians of both, and of the differences of each pair, which
    is what the choice adds to a first call (the count and pricing of every candidate, the probes
    of those that lose; the plan of the one picked is the named implementation's first call too)."""
    pairs = [
        (run_side(row, "torchntk", repeats, False, threads), run_side(row, f"torchntk:{pick}", repeats, False, threads))
        for _ in range(trials)
    ]
    failed = [result for pair in pairs for result in pair if "error" in result]
    if failed:
        return failed[0]
    return {
        "auto": statistics.median(auto["first"] for auto, _ in pairs),
        "named": statistics.median(named["first"] for _, named in pairs),
        "difference": statistics.median(auto["first"] - named["first"] for auto, named in pairs),
        "warm": statistics.median(named["warm"] for _, named in pairs),
    }


def run_side(row: str, side: str, repeats: int, profile: bool, threads: Optional[int]) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--worker", row, side, "--repeats", str(repeats)]
    if profile:
        command.append("--profile")
    environment = dict(os.environ)
    if threads is not None:
        environment["OMP_NUM_THREADS"] = str(threads)
    done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"row": row, "side": side, "error": tail}
    return json.loads(lines[-1])


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--repeats", type=int, default=5, help="warm calls per side (median)")
    parser.add_argument("--profile", action="store_true", help="profile torchntk's first call by stage")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the workers")
    parser.add_argument("--trials", type=int, default=3, help="fresh processes per side and row (median)")
    parser.add_argument("--choice", action="store_true",
                        help="also time AUTO's first call against that of the implementation it picks")
    parser.add_argument("--worker", nargs=2, metavar=("ROW", "SIDE"), help=argparse.SUPPRESS)
    arguments = parser.parse_args(argv)
    if arguments.worker:
        print(json.dumps(worker(*arguments.worker, arguments.repeats, arguments.profile)))
        return
    import platform

    import torch

    rows = [row.strip() for row in arguments.rows.split(",") if row.strip()]
    print(f"# bench_first_call: {' '.join(sys.argv)}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M')}, {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print()
    print("| row | torchntk first (s) | torchntk warm (s) | tutorial first (s) | tutorial warm (s) | first / warm | "
          "first / tutorial's first | AUTO's pick | axes found | tutorial | rebuilt's first / warm |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    profiles, choices = {}, {}
    for row in rows:
        ours = run_trials(row, "torchntk", arguments.repeats, arguments.threads, arguments.trials)
        theirs = run_trials(row, "tutorial", arguments.repeats, arguments.threads, arguments.trials)
        if "error" in ours or "error" in theirs:
            print(f"| {row} | {ours.get('error') or theirs.get('error')} ||||||||||")
            continue
        print(
            f"| {row} | {ours['first']:.3f} | {ours['warm']:.3f} | {theirs['first']:.3f} | {theirs['warm']:.3f} | "
            f"{ours['first'] / ours['warm']:.2f} | {ours['first'] / theirs['first']:.2f} | {ours['pick']} | "
            f"{'yes' if ours['vmap_axes'] else 'no'} | {'loop' if theirs['loop'] else 'vmap'} | "
            f"{ours['rebuilt'] / ours['warm']:.2f} |"
        )
        if arguments.profile:
            profiles[row] = run_side(row, "torchntk", 1, True, arguments.threads)
        if arguments.choice:
            choices[row] = ours["pick"], choice_trials(
                row, ours["pick"], arguments.repeats, arguments.threads, arguments.trials
            )
    if choices:
        print()
        print("| row | AUTO's pick | AUTO's first (s) | the pick's first, named (s) | the choice: difference (s) | "
              "the pick's warm (s) | difference / warm |")
        print("|---|---|---|---|---|---|---|")
        for row, (pick, result) in choices.items():
            if "error" in result:
                print(f"| {row} | {pick} | {result['error']} |||||")
                continue
            print(
                f"| {row} | {pick} | {result['auto']:.3f} | {result['named']:.3f} | {result['difference']:.4f} | "
                f"{result['warm']:.3f} | {result['difference'] / result['warm']:.2f} |"
            )
    if profiles:
        print()
        labels = list(STAGES)
        print("| row (profiled first call, s) | " + " | ".join(labels) + " |")
        print("|---|" + "---|" * len(labels))
        for row, result in profiles.items():
            if "error" in result:
                print(f"| {row} | {result['error']} |")
                continue
            shares = " | ".join(f"{100 * result['stages'][label]:.0f}%" for label in labels)
            print(f"| {row} ({result['first']:.3f}) | {shares} |")


if __name__ == "__main__":
    main()
