"""``torchntk bench``: time every NTK implementation against N, beside neural-tangents when present.

For each model of the benchmark tables (``_models.BENCH_MODELS``), each N and each
implementation, the NTK of N examples against N others is computed by torchntk and, when ``jax``
and ``neural_tangents`` can be imported, by neural-tangents (jitted) on the same function with
the same weights (``_models.jax_twin``). Reported: the median of ``--repeats`` timed calls after a
warm-up call (which includes XLA's compilation), the ratio, and the largest difference between
the two kernels relative to the largest entry. neural-tangents runs after torchntk, in a process
of its own (``_neural_tangents_worker.py`` says why), on the models it has a JAX twin of (not the
ResNets). ``--tutorial`` also times, in the same process and on the same device, the torch.func
tutorial's Jacobian contraction (``_tutorial.py``), the code a PyTorch user would otherwise run;
configurations that do not fit in memory are reported as such. Output: a table on standard output, ``bench.md``
and one log-log plot of time against N per model (``bench_<model>.png``) in ``--output``.

The detailed scripts in ``benchmarks/`` (peak memory per configuration in separate processes,
the PyTorch tutorial's method, batching and Monte Carlo) produce the tables of
``docs/benchmarks.md``; this command is the quick, installed way to reproduce the comparison.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

import torchntk

from .._kernel.captured import compile_argument
from .._utils.precision import kernel_precision
from . import _arguments
from ._figures import scaling_figure
from ._models import BENCH_MODELS, JAX_LAYOUTS, UsageError, inputs
from ._timing import timed_calls
from ._tutorial import jacobian_bytes, tutorial_ntk_fn

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``torchntk bench`` (``torchntk bench --help`` prints its options)."""
    parser = _arguments.Parser(
        prog="torchntk bench",
        description="Time torchntk's NTK implementations against N, side by side with neural-tangents when installed.",
    )
    parser.add_argument("--models", default="mlp,cnn", help=f"comma list of {', '.join(BENCH_MODELS)} (default: all)")
    parser.add_argument("--sizes", type=_arguments.int_list, default=(8, 16, 32), metavar="N,...",
                        help="numbers of examples N (x1 and x2 each have N; default 8,16,32)")
    parser.add_argument("--implementations", type=_arguments.int_list, default=(1, 2, 3), metavar="I,...",
                        help="NTK implementations, from 1, 2, 3 (default: all)")
    parser.add_argument("--trace-axes", type=_arguments.axes, default=(-1,), metavar="AXES",
                        help="output axes to trace, or 'none' for the full kernel (default -1)")
    parser.add_argument("--repeats", type=_arguments.positive_int, default=3,
                        help="timed calls after the warm-up call; the median is reported (default 3)")
    parser.add_argument("--device", type=_arguments.device, default=torch.device("cpu"),
                        help="torchntk's device (default cpu)")
    parser.add_argument("--compile", default=None, metavar="BACKEND",
                        help="build torchntk's kernel functions with compile=BACKEND, a torch.compile backend "
                             "(inductor is compile=True; docs/compile.md); the capture and compilation happen "
                             "in the untimed warm-up call (default: eager)")
    parser.add_argument("--no-nt", action="store_true", help="do not run neural-tangents even if it is installed")
    parser.add_argument("--tutorial", action="store_true",
                        help="also time the torch.func tutorial's Jacobian contraction (what a PyTorch user would "
                             "write instead) in the same process, on the same device")
    parser.add_argument("--jax-layouts", default="in-out", metavar="LAYOUT,...",
                        help="dense weight layouts of neural-tangents' JAX twins: in-out (h @ W, W stored (in, out)), "
                             "out-in (h @ W.T, torch's layout), or both (default in-out); one worker process each")
    parser.add_argument("--output", type=Path, default=Path("torchntk-bench"),
                        help="folder for bench.md and the plots (default ./torchntk-bench)")
    parser.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                        help="progress bar on standard error (default: auto, shown in a terminal)")
    return parser


def main(argv: list[str]) -> int:
    """Runs ``torchntk bench`` with ``argv`` (the arguments after ``bench``); returns the exit status."""
    arguments = parser().parse_args(argv)
    models = [name.strip() for name in arguments.models.split(",") if name.strip()]
    unknown = [name for name in models if name not in BENCH_MODELS]
    if unknown or not models:
        raise UsageError(f"--models {arguments.models!r}: expected a comma list of {', '.join(BENCH_MODELS)}")
    layouts = [layout.strip() for layout in arguments.jax_layouts.split(",") if layout.strip()]
    if not layouts or any(layout not in JAX_LAYOUTS for layout in layouts):
        raise UsageError(f"--jax-layouts {arguments.jax_layouts!r}: expected a comma list of {', '.join(JAX_LAYOUTS)}")
    bad = [i for i in arguments.implementations if i not in (1, 2, 3)]
    if bad or not arguments.implementations:
        raise UsageError(f"--implementations: expected a comma list of 1, 2, 3, got {bad or 'nothing'}")
    if arguments.compile is not None:
        try:
            compile_argument(arguments.compile, "torchntk bench")
        except ValueError as error:
            raise UsageError(f"--compile {arguments.compile!r}: {str(error).split('`compile` ', 1)[-1]}") from None
    _arguments.make_output_folder(arguments.output)
    progress = {"auto": None, "on": False, "off": True}[arguments.progress]
    steps = tqdm(total=len(models) * len(arguments.sizes) * len(arguments.implementations), disable=progress,
                 desc="torchntk bench", leave=False)
    ours, peers = {}, {}
    for name in models:
        model = BENCH_MODELS[name].build().to(arguments.device)
        ours[name] = _torchntk_runs(name, model, arguments, steps)
        if arguments.tutorial:
            peers[name] = _tutorial_runs(name, model, arguments)
    steps.close()
    nt_status, theirs = "not run (--no-nt)", {}
    if not arguments.no_nt:
        nt_status = "not run (no JAX twin of these models)"
        for name in models:
            if not BENCH_MODELS[name].jax_twin:
                continue
            for layout in layouts:
                nt_status, theirs[name, layout] = _neural_tangents_runs(name, arguments, layout)
    header = _header(argv, nt_status, arguments)
    rows, notes = [], []
    for name in models:
        times: dict[tuple[str, int], dict[int, float]] = {}
        for (n, implementation), run in ours[name].items():
            if run.seconds is not None:
                times.setdefault(("torchntk", implementation), {})[n] = run.seconds
            row = [name, str(n), str(implementation), run.cell()]
            if arguments.tutorial:
                peer = peers[name][n]
                row += [peer.cell(), _ratio(peer.seconds, run.seconds), _difference(run.kernel, peer.kernel)]
                if peer.seconds is not None:
                    times.setdefault(("PyTorch tutorial", 1), {})[n] = peer.seconds  # its method is 1's
            nt_cells = ["—", "—"] * len(layouts) + ["—"]
            for position, layout in enumerate(layouts):
                if (n, implementation) not in theirs.get((name, layout), {}):
                    continue
                reference, nt_seconds = theirs[name, layout][n, implementation]
                label = "neural-tangents" if position == 0 else f"neural-tangents {layout}"
                times.setdefault((label, implementation), {})[n] = nt_seconds
                nt_cells[2 * position: 2 + 2 * position] = [f"{nt_seconds:.4f}", _ratio(nt_seconds, run.seconds)]
                if position == 0:
                    nt_cells[-1] = _difference(run.kernel, reference)
            rows.append(row + nt_cells)
        figure = scaling_figure(times, arguments.output / f"bench_{name}.png", f"NTK time vs N: {name}")
        twin = "" if BENCH_MODELS[name].jax_twin else " (no JAX twin: neural-tangents not run)"
        notes.append(f"{name}: {BENCH_MODELS[name].description}{twin}; {figure}")
    nt_columns = []
    for position, layout in enumerate(layouts):
        suffix = "" if len(layouts) == 1 else f" {layout}"
        nt_columns += [f"neural-tangents{suffix} [s]", f"NT{suffix} / torchntk"]
    tutorial_columns = ["tutorial [s]", "tutorial / torchntk", "tutorial rel diff"] if arguments.tutorial else []
    headers = ["model", "N", "impl", "torchntk [s]"] + tutorial_columns + nt_columns + ["NT rel diff"]
    print("\n".join(header))
    print(_arguments.text_table(headers, rows))
    print("\n".join(notes))
    lines = ["# torchntk bench", ""] + [f"    {line}" for line in header]
    lines += ["", _arguments.markdown_table(headers, rows), ""]
    (arguments.output / "bench.md").write_text("\n".join(lines + [f"- {note}" for note in notes]) + "\n")
    print(f"results: {arguments.output / 'bench.md'}")
    return 0


@dataclass(frozen=True)
class _Run:
    """One timed configuration: its kernel and median seconds, or why it could not run."""

    kernel: Optional[np.ndarray] = None
    seconds: Optional[float] = None
    failure: str = ""

    def cell(self) -> str:
        return f"{self.seconds:.4f}" if self.seconds is not None else self.failure

    @staticmethod
    def timed(call: Callable[[], torch.Tensor], repeats: int, device: torch.device) -> "_Run":
        """``call`` timed, or the run that ran out of memory (which the table then shows)."""
        try:
            kernel, times = timed_calls(call, repeats, device)
            return _Run(kernel.detach().cpu().numpy(), statistics.median(times))
        except (torch.OutOfMemoryError, MemoryError):
            pass
        except RuntimeError as error:
            if "allocate" not in str(error) and "out of memory" not in str(error):
                raise
        if device.type == "cuda":  # out of the except clause, whose traceback held the failed call's tensors
            torch.cuda.empty_cache()
        return _Run(failure="out of memory")


def _torchntk_runs(name: str, model: torch.nn.Module, arguments, steps) -> dict[tuple[int, int], _Run]:
    choice = BENCH_MODELS[name]
    runs = {}
    for n in arguments.sizes:
        x1, x2 = _bench_inputs(choice, n, arguments.device)
        for implementation in arguments.implementations:
            steps.set_postfix_str(f"{name}, N={n}, implementation {implementation}")
            ntk_fn = torchntk.empirical_ntk_fn(
                model, trace_axes=arguments.trace_axes, vmap_axes=0, implementation=implementation,
                compile=arguments.compile or False,
            )
            runs[n, implementation] = _Run.timed(lambda: ntk_fn(x1, x2), arguments.repeats, arguments.device)
            steps.update(1)
    return runs


def _tutorial_runs(name: str, model: torch.nn.Module, arguments) -> dict[int, _Run]:
    """The torch.func tutorial's Jacobian contraction (``_tutorial.py``) on the same model, inputs
    and device, in the precision torchntk's kernels run in (``kernel_precision``: IEEE float32,
    where PyTorch's default runs cuDNN convolutions in TF32 on a GPU, so that both sides do the
    same arithmetic); a size whose Jacobians would not fit in the device's free memory is not run."""
    choice = BENCH_MODELS[name]
    traced = tuple(arguments.trace_axes) == (-1,)
    if not traced and tuple(arguments.trace_axes):
        return {n: _Run(failure="traced -1 or full only") for n in arguments.sizes}
    ntk = tutorial_ntk_fn(model, traced)
    runs = {}
    for n in arguments.sizes:
        x1, x2 = _bench_inputs(choice, n, arguments.device)
        outputs = model(x1[:1]).shape[-1]
        needed = 2 * jacobian_bytes(model, n, outputs)
        if needed > _free_memory(arguments.device):
            runs[n] = _Run(failure=f"needs {needed / 2**30:.3g} GiB")
            continue
        with torch.no_grad(), kernel_precision():
            runs[n] = _Run.timed(lambda: ntk(x1, x2), arguments.repeats, arguments.device)
    return runs


def _bench_inputs(choice, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x = inputs(choice.input_shape, 2 * n, torch.float32, torch.device("cpu")).to(device)
    return x[:n], x[n:]


def _free_memory(device: torch.device) -> float:
    """Bytes a run may use: the CUDA device's free memory, or half the machine's."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    if hasattr(os, "sysconf"):
        return 0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return float("inf")


def _ratio(other: Optional[float], ours: Optional[float]) -> str:
    return "—" if other is None or ours is None else f"{other / ours:.2f}x"


def _difference(kernel: Optional[np.ndarray], reference: Optional[np.ndarray]) -> str:
    """The largest difference of two kernels relative to the reference's largest entry."""
    if kernel is None or reference is None:
        return "—"
    return f"{np.abs(kernel - reference).max() / max(np.abs(reference).max(), 1e-30):.1e}"


def _neural_tangents_runs(
    name: str, arguments, layout: str = "in-out"
) -> tuple[str, dict[tuple[int, int], tuple[np.ndarray, float]]]:
    """Runs the model in neural-tangents in a worker process (see ``_neural_tangents_worker``), its
    dense weights in ``layout`` (``_models.jax_twin``)."""
    with tempfile.TemporaryDirectory() as folder:
        spec = dict(
            model=name, sizes=list(arguments.sizes), implementations=list(arguments.implementations),
            trace_axes=list(arguments.trace_axes), repeats=arguments.repeats, layout=layout,
            output=os.path.join(folder, "kernels.npz"), status=os.path.join(folder, "status.json"),
        )
        spec_path = os.path.join(folder, "spec.json")
        with open(spec_path, "w") as file:
            json.dump(spec, file)
        command = [sys.executable, "-m", "torchntk.cli._neural_tangents_worker", spec_path]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return f"failed in the worker process ({last})", {}
        with open(spec["status"]) as file:
            status = json.load(file)["status"]
        with np.load(spec["output"]) as saved:
            runs = {
                (n, implementation): (saved[f"{n}-{implementation}"], float(saved[f"{n}-{implementation}-seconds"]))
                for n in arguments.sizes for implementation in arguments.implementations
                if f"{n}-{implementation}" in saved
            }
    return status, runs


def _header(argv: list[str], nt_status: str, arguments) -> list[str]:
    memory = float("nan")
    if hasattr(os, "sysconf"):
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return [
        f"command : torchntk bench {' '.join(argv)}".rstrip(),
        f"date    : {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"machine : {_processor()}, {os.cpu_count()} logical cores, {memory:.1f} GiB RAM, {platform.platform()}",
        *([f"GPU     : {torch.cuda.get_device_name(arguments.device)}"] if arguments.device.type == "cuda" else []),
        f"torch   : {torch.__version__} ({torch.get_num_threads()} threads), torchntk {torchntk.__version__}, "
        f"device {arguments.device}, compile={arguments.compile or False}",
        f"NT      : {nt_status}",
        f"timing  : 1 warm-up call, then the median of {arguments.repeats}; trace_axes={arguments.trace_axes}, "
        f"vmap_axes=0, float32; neural-tangents' dense weights {arguments.jax_layouts}",
    ]


def _processor() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
