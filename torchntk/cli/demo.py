"""``python -m torchntk``: the empirical NTK of a model with every implementation, checked and timed.

With no arguments it runs a small MLP and a small CNN on synthetic data (nothing is downloaded),
computes each one's NTK with implementations 1, 2 and 3, checks that they agree, asks AUTO which
it would pick, prints a table and writes, per model, a PNG with the kernel as a heatmap and its
eigenvalue spectrum (when matplotlib is installed: ``pip install 'torchntk[plot]'``), plus the
table as ``results.md``, into the output folder. The exit status is 1 when two implementations
disagree (beyond 1e-4 relative in float32, 1e-9 in float64).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from tqdm.auto import tqdm

import torchntk

from . import _arguments
from ._arguments import markdown_table, text_table
from ._figures import kernel_figure
from ._models import DEMO_MODELS, ModelChoice, UsageError, inputs, user_model
from ._timing import timed_calls

IMPLEMENTATION_NAMES = {
    1: "Jacobian contraction",
    2: "NTK-vector products",
    3: "structured derivatives",
}


@dataclass
class Row:
    model: str
    implementation: int
    shape: tuple[int, ...]
    seconds: float
    difference: float
    agrees: bool


def parser() -> argparse.ArgumentParser:
    parser = _arguments.Parser(
        prog="torchntk",
        description=(
            "Compute the empirical NTK of a model with every implementation, check that they agree, "
            "time them, and plot the kernel and its spectrum. Exit status: 0, or 1 when implementations "
            "disagree, 2 for bad arguments. `torchntk bench --help` describes the benchmarks."
        ),
    )
    parser.add_argument("--model", action="append", metavar="NAME",
                        help="'mlp', 'cnn' or 'module:callable' (a function returning an nn.Module, "
                             "imported from the current directory or sys.path); repeatable. "
                             "Default: mlp and cnn")
    parser.add_argument("--input-shape", type=_arguments.shape, metavar="D,...",
                        help="shape of one input example, e.g. 3,32,32 (default: the built-in model's; "
                             "required for module:callable)")
    parser.add_argument("--n", type=_arguments.positive_int, default=16, help="number of examples (default 16)")
    parser.add_argument("--trace-axes", type=_arguments.axes, default=(-1,), metavar="AXES",
                        help="output axes to trace, comma-separated, or 'none' for the full kernel (default -1)")
    parser.add_argument("--implementation", default="all", choices=["all", "1", "2", "3"],
                        help="which NTK implementation to run (default: all; AUTO's choice is always reported)")
    parser.add_argument("--vmap-axes", type=_arguments.optional_int, default=0, metavar="AXIS",
                        help="batch axis of inputs and outputs, or 'none' if the model couples examples (default 0)")
    parser.add_argument("--device", type=_arguments.device, default=torch.device("cpu"),
                        help="e.g. cpu, cuda, cuda:1 (default cpu)")
    parser.add_argument("--float64", action="store_true", help="compute in float64 (default float32)")
    parser.add_argument("--repeats", type=_arguments.positive_int, default=1,
                        help="timed calls per implementation after a warm-up call; the fastest is reported (default 1)")
    parser.add_argument("--output", type=Path, default=Path("torchntk-demo"),
                        help="folder for the figures and results.md (default ./torchntk-demo)")
    parser.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                        help="progress bar on standard error (default: auto, shown in a terminal)")
    return parser


def main(argv: list[str]) -> int:
    arguments = parser().parse_args(argv)
    choices = _models(arguments.model or ["mlp", "cnn"], arguments.input_shape)
    implementations = [1, 2, 3] if arguments.implementation == "all" else [int(arguments.implementation)]
    dtype = torch.float64 if arguments.float64 else torch.float32
    arguments.output.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    notes: list[str] = []
    progress = {"auto": None, "on": False, "off": True}[arguments.progress]
    steps = tqdm(total=len(choices) * (len(implementations) + 1), disable=progress, desc="torchntk", leave=False)
    for choice in choices:
        model = choice.build().to(device=arguments.device, dtype=dtype)
        x = inputs(choice.input_shape, arguments.n, dtype, arguments.device)
        kernels = {}
        for implementation in implementations:
            steps.set_postfix_str(f"{choice.name}, implementation {implementation}")
            ntk_fn = torchntk.empirical_ntk_fn(
                model, trace_axes=arguments.trace_axes, vmap_axes=arguments.vmap_axes, implementation=implementation
            )
            kernels[implementation], times = timed_calls(lambda: ntk_fn(x), arguments.repeats, x.device)
            seconds = min(times)
            rows.append(Row(choice.name, implementation, tuple(kernels[implementation].shape), seconds, 0.0, True))
            steps.update(1)
        reference = kernels[implementations[0]]
        tolerance = 1e-9 if dtype == torch.float64 else 1e-4
        for row in rows[-len(implementations):]:
            row.difference = _relative_difference(kernels[row.implementation], reference)
            row.agrees = row.difference <= tolerance
        auto = torchntk.empirical_ntk_fn(model, trace_axes=arguments.trace_axes, vmap_axes=arguments.vmap_axes, implementation=0)
        chosen = int(auto.auto_choice(x).implementation)
        notes.append(f"{choice.name}: {choice.description}, {arguments.n} examples of shape "
                     f"{tuple(choice.input_shape)}; AUTO picks {chosen} ({IMPLEMENTATION_NAMES[chosen]}).")
        steps.update(1)
        figure = kernel_figure(reference, arguments.output / f"ntk_{_file_name(choice.name)}.png", choice.name)
        notes.append(f"{choice.name}: {figure}")
    steps.close()
    headers, body = _cells(rows, implementations[0])
    print(text_table(headers, body))
    print()
    print("\n".join(notes))
    (arguments.output / "results.md").write_text(_markdown(headers, body, notes, arguments, dtype))
    print(f"\nresults: {arguments.output / 'results.md'}")
    return 0 if all(row.agrees for row in rows) else 1


def _models(names: list[str], input_shape: Optional[tuple[int, ...]]) -> list[ModelChoice]:
    choices = []
    for name in names:
        if name in DEMO_MODELS:
            choice = DEMO_MODELS[name]
            if input_shape is not None and input_shape != choice.input_shape:
                raise UsageError(
                    f"--input-shape {','.join(map(str, input_shape))}: the built-in {name} takes inputs of shape "
                    f"{','.join(map(str, choice.input_shape))}; use --model module:callable for other shapes"
                )
            choices.append(choice)
        else:
            choices.append(user_model(name, input_shape))
    return choices


def _relative_difference(kernel: torch.Tensor, reference: torch.Tensor) -> float:
    scale = reference.abs().max().item()
    return (kernel - reference).abs().max().item() / (scale or 1.0)


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def _cells(rows: list[Row], reference: int) -> tuple[list[str], list[list[str]]]:
    headers = ["model", "implementation", "kernel shape", "time [s]", f"max rel diff vs {reference}", "agrees"]
    body = [
        [row.model, f"{row.implementation} ({IMPLEMENTATION_NAMES[row.implementation]})", "x".join(map(str, row.shape)),
         f"{row.seconds:.4f}", f"{row.difference:.1e}", "yes" if row.agrees else "NO"]
        for row in rows
    ]
    return headers, body


def _markdown(headers: list[str], body: list[list[str]], notes: list[str], arguments, dtype: torch.dtype) -> str:
    settings = (f"{arguments.n} examples, trace_axes={arguments.trace_axes}, vmap_axes={arguments.vmap_axes}, "
                f"{str(dtype).replace('torch.', '')}, device {arguments.device}, torch {torch.__version__}")
    lines = ["# torchntk demo", "", settings, "", markdown_table(headers, body), ""]
    return "\n".join(lines + [f"- {note}" for note in notes]) + "\n"
