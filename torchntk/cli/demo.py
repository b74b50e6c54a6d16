"""``python -m torchntk``: the empirical NTK of a model with every implementation, checked and timed.

With no arguments it runs a small MLP and a small CNN on synthetic data (nothing is downloaded),
computes each one's NTK with implementations 1, 2 and 3, checks that they agree, asks AUTO which
it would pick, prints a table and writes, per model, a PNG with the kernel as a heatmap and its
eigenvalue spectrum (when matplotlib is installed: ``pip install 'torchntk[plot]'``), plus the
table as ``results.md``, into the output folder.

Models of your own come from ``--model module:factory``. Those taking token ids get integers
(``--input-dtype long --vocab-size N``); those taking keyword inputs are called as
``model(**inputs)`` (``--keyword-inputs input_ids,attention_mask=ones``). Only parameters are
differentiated, so integer inputs need nothing more.

Exit status: 0 when every implementation ran and they agree; 1 when two implementations disagree
(beyond 1e-4 relative in float32, 1e-9 in float64); 2 for a bad command-line argument (one line on
standard error, nothing computed), a ``--model`` module or factory that cannot be found included;
3 when a model failed: its module raised while imported, its factory raised or returned something
other than an ``nn.Module``, its forward pass or one implementation raised. That prints one line
on standard error naming the model, the step and the error, and the demo goes on with the other
implementations and models and still writes ``results.md``, with the failure in the table. 3
outranks 1.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import _arguments
from ._arguments import DISAGREE, MODEL_FAILED, OK, markdown_table, text_table
from ._figures import kernel_figure
from ._inputs import INPUT_DTYPES, InputSpec, keyword_inputs
from ._models import DEMO_MODELS, ModelChoice, UsageError, user_model
from ._runs import ModelRun, Row, Settings, describe_error, run_model

__all__ = ["main", "parser"]

_EPILOG = """exit status:
  0  every implementation ran and they agree
  1  two implementations disagree
  2  a bad argument (one line on standard error), e.g. a --model module that is not found
  3  a model failed (its module's import, its factory, what the factory returned, its
     forward pass or an implementation): one line on standard error per failure; the other
     implementations and models still run and results.md records the failure. 3 outranks 1.

a language model taking token ids and an attention mask, from my_lm.py's make_model():
  torchntk --model my_lm:make_model --input-shape 16 --input-dtype long --vocab-size 1000 \\
           --keyword-inputs input_ids,attention_mask=ones
"""


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``torchntk demo`` (``torchntk --help`` prints its options)."""
    parser = _arguments.Parser(
        prog="torchntk",
        description=(
            "Compute the empirical NTK of a model with every implementation, check that they agree, "
            "time them, and plot the kernel and its spectrum. `torchntk bench --help` describes the benchmarks."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", action="append", metavar="NAME",
                        help="'mlp', 'cnn' or 'module:callable' (a function returning an nn.Module, "
                             "imported from the current directory or sys.path); repeatable. "
                             "Default: mlp and cnn")
    parser.add_argument("--input-shape", type=_arguments.shape, metavar="D,...",
                        help="shape of one input example, e.g. 3,32,32, or 16 for 16 token ids (default: the "
                             "built-in model's; required for module:callable)")
    parser.add_argument("--input-dtype", choices=list(INPUT_DTYPES), default="float",
                        help="float: standard normal inputs in the model's dtype (default); long/int64 or int/int32: "
                             "random integers in [0, --vocab-size), e.g. token ids for an embedding")
    parser.add_argument("--vocab-size", type=_arguments.positive_int, metavar="V",
                        help="integer inputs are drawn from [0, V); required with an integer --input-dtype")
    parser.add_argument("--keyword-inputs", type=keyword_inputs, metavar="NAME[=FILL],...",
                        help="call the model as model(**inputs) with these keyword inputs, each of --input-shape "
                             "with N examples on axis 0: NAME is random (as --input-dtype says), NAME=ones or "
                             "NAME=zeros is constant, e.g. input_ids,attention_mask=ones. Default: model(x)")
    parser.add_argument("--n", type=_arguments.positive_int, default=16, help="number of examples (default 16)")
    parser.add_argument("--trace-axes", type=_arguments.axes, default=(-1,), metavar="AXES",
                        help="output axes to trace, comma-separated, or 'none' for the full kernel (default -1)")
    parser.add_argument("--implementation", default="all", choices=["all", "1", "2", "3"],
                        help="which NTK implementation to run (default: all; AUTO's choice is always reported)")
    parser.add_argument("--vmap-axes", type=_arguments.optional_int, default=0, metavar="AXIS",
                        help="batch axis of inputs and outputs, or 'none' if the model couples examples (default 0)")
    parser.add_argument("--device", type=_arguments.device, default=torch.device("cpu"),
                        help="e.g. cpu, cuda, cuda:1 (default cpu)")
    parser.add_argument("--memory", type=_arguments.memory, default=None, metavar="BYTES",
                        help="memory budget of each kernel, e.g. 8GB or 512MiB: larger kernels are computed in "
                             "blocks, or refused (default: half the available RAM, 80%% of a GPU's free memory)")
    parser.add_argument("--float64", action="store_true", help="compute in float64 (default float32)")
    parser.add_argument("--repeats", type=_arguments.positive_int, default=1,
                        help="timed calls per implementation after a warm-up call; the fastest is reported (default 1)")
    parser.add_argument("--output", type=Path, default=Path("torchntk-demo"),
                        help="folder for the figures and results.md (default ./torchntk-demo)")
    parser.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                        help="progress bar on standard error (default: auto, shown in a terminal)")
    return parser


def main(argv: list[str]) -> int:
    """Runs the demo with ``argv``; returns the exit status (see the module docstring).

    Raises:
        UsageError: a bad argument. Most are found before anything is computed; an output axis
            out of range only once that model has run forward (earlier models' figures may
            then exist, but no ``results.md``).
    """
    arguments = parser().parse_args(argv)
    choices = _models(arguments.model or ["mlp", "cnn"], arguments)
    implementations = (1, 2, 3) if arguments.implementation == "all" else (int(arguments.implementation),)
    dtype = torch.float64 if arguments.float64 else torch.float32
    settings = Settings(arguments.n, arguments.trace_axes, arguments.vmap_axes, implementations, dtype,
                        arguments.device, arguments.repeats, arguments.memory)
    _arguments.make_output_folder(arguments.output)
    progress = {"auto": None, "on": False, "off": True}[arguments.progress]
    steps = tqdm(total=len(choices) * (len(implementations) + 1), disable=progress, desc="torchntk", leave=False)

    def advance(step: str) -> None:
        steps.set_postfix_str(step)
        steps.update(1)

    runs: list[ModelRun] = []
    for choice, spec in choices:
        run = run_model(choice, spec, settings, advance)
        if run.kernel is not None:
            run.notes.append(f"{choice.name}: {_figure(run, arguments.output / f'ntk_{_file_name(choice.name)}.png')}")
        runs.append(run)
    steps.close()
    rows = [row for run in runs for row in run.rows]
    notes = [note for run in runs for note in run.notes]
    notes += [f"FAILED: model {failure.model!r}, {failure.step}: {failure.error}" for run in runs for failure in run.failures]
    headers, body = _cells(rows, implementations[0])
    print(text_table(headers, body))
    print()
    print("\n".join(notes))
    (arguments.output / "results.md").write_text(_markdown(headers, body, notes, arguments, dtype))
    print(f"\nresults: {arguments.output / 'results.md'}")
    if any(run.failures for run in runs):
        return MODEL_FAILED
    return OK if all(row.agrees for row in rows) else DISAGREE


def _figure(run: ModelRun, path: Path) -> str:
    """The figure of ``run``'s kernel, or why there is none; a plotting error does not stop the demo."""
    try:
        return kernel_figure(run.kernel, path, run.description) if run.description else "figure skipped: several outputs"
    except Exception as error:
        return f"figure failed: {describe_error(error)}"


def _models(names: list[str], arguments: argparse.Namespace) -> list[tuple[ModelChoice, InputSpec]]:
    """The models and their inputs.

    Raises:
        UsageError: inputs the arguments describe badly, or that a built-in model cannot take.
    """
    dtype = INPUT_DTYPES[arguments.input_dtype]
    if dtype is not None and arguments.vocab_size is None:
        raise UsageError(f"--input-dtype {arguments.input_dtype}: give the range of the integers with --vocab-size "
                         "(e.g. --vocab-size 1000 for token ids in [0, 1000))")
    if dtype is None and arguments.vocab_size is not None:
        raise UsageError("--vocab-size: only for integer inputs (add e.g. --input-dtype long)")
    keywords = arguments.keyword_inputs or ()
    choices = []
    for name in names:
        if name in DEMO_MODELS:
            choice = DEMO_MODELS[name]
            _check_built_in(choice, arguments)
        else:
            choice = user_model(name, arguments.input_shape)
        spec = InputSpec(choice.input_shape, dtype, arguments.vocab_size, keywords)
        ndim = len(spec.shape) + 1
        if arguments.vmap_axes is not None and not -ndim <= arguments.vmap_axes < ndim:
            raise UsageError(f"--vmap-axes {arguments.vmap_axes}: out of range for inputs of shape "
                             f"{(arguments.n, *spec.shape)} (N examples on axis 0)")
        choices.append((choice, spec))
    return choices


def _check_built_in(choice: ModelChoice, arguments: argparse.Namespace) -> None:
    name, shape = choice.name, arguments.input_shape
    if shape is not None and shape != choice.input_shape:
        raise UsageError(
            f"--input-shape {','.join(map(str, shape))}: the built-in {name} takes inputs of shape "
            f"{','.join(map(str, choice.input_shape))}; use --model module:callable for other shapes"
        )
    if INPUT_DTYPES[arguments.input_dtype] is not None:
        raise UsageError(f"--input-dtype {arguments.input_dtype}: the built-in {name} takes float inputs; "
                         "use --model module:callable for a model taking integers")
    if arguments.keyword_inputs:
        raise UsageError(f"--keyword-inputs: the built-in {name} takes one input, model(x); "
                         "use --model module:callable for a model taking keyword inputs")


def _file_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


def _cells(rows: list[Row], reference: int) -> tuple[list[str], list[list[str]]]:
    """The table; a failed step reads FAILED, its error is in the notes (too long for a cell)."""
    headers = ["model", "implementation", "kernel shape", "time [s]", f"max rel diff vs {reference}", "agrees"]
    body = []
    for row in rows:
        if row.error is not None:
            body.append([row.model, row.step, "—", "—", "—", "FAILED"])
            continue
        # When the first implementation failed, the others are compared with the first that ran.
        versus = "" if row.reference == reference else f" (vs {row.reference})"
        body.append([row.model, row.step, row.shape, f"{row.seconds:.4f}", f"{row.difference:.1e}{versus}",
                     "yes" if row.agrees else "NO"])
    return headers, body


def _markdown(headers: list[str], body: list[list[str]], notes: list[str], arguments, dtype: torch.dtype) -> str:
    settings = (f"{arguments.n} examples, trace_axes={arguments.trace_axes}, vmap_axes={arguments.vmap_axes}, "
                f"{str(dtype).replace('torch.', '')}, device {arguments.device}, torch {torch.__version__}")
    lines = ["# torchntk demo", "", settings, "", markdown_table(headers, body), ""]
    return "\n".join(lines + [f"- {note}" for note in notes]) + "\n"
