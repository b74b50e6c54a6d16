"""Measured against predicted peak memory of kernel calls: the grid of ``tests/test_memory.py`` and
``benchmarks/bench_memory.py``.

How the peak is measured (CPU). Each grid runs in a child process of its own
(``python -m tests._memory_grid``), started with ``MALLOC_MMAP_THRESHOLD_=65536``: glibc's malloc then
maps every allocation of 64 kB or more on its own and unmaps it when it is freed, so the process's
resident memory follows the tensors alive (without it, freed memory stays in malloc's heap and a
later call reuses it unseen). For every configuration the child calls the kernel function once
(plans, caches and imports settle), collects garbage, hands malloc's free memory back to the
system (``malloc_trim``: memory freed by threads' arenas stays otherwise, and a 1 GB configuration
hid the next one's growth), resets the kernel's record of the peak
resident set (``/proc/self/clear_refs``, value 5, Linux 4.0 or later), calls it again and reads
``VmHWM - VmRSS``-before from ``/proc/self/status``: the growth of the peak over the call, the
result included. That is what the operating system charges the process, page by page; it misses
only pages a tensor never touches (``torch.empty`` never written), which the implementations do not
leave. The alternatives were worse on CI's 2-core machine: ``ru_maxrss`` cannot be reset between
configurations; ``torch.profiler``'s memory events report per operation, not a live total, and
slow small kernels down many times; CPU tensors have no ``torch.cuda.max_memory_allocated``.

The prediction is the memory model's (``torchntk/_implementations/memory.py``): the peak of the plan
the call runs (validation included), for the kernel function's ``memory`` budget.

On CUDA (``measure_cuda``, in the calling process: the caching allocator's statistics are the
process's own, whatever else ran in it) the peak is the growth of
``torch.cuda.max_memory_allocated`` over the call: the tensors handed out, which is what the model
predicts, not the segments the allocator reserves around them. ``tests/test_memory_cuda.py`` holds
it to the same factors as the CPU; ``benchmarks/bench_cuda.py --parts memory`` prints the table.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import time
import warnings
from typing import Any, Optional

import torch
from torch import nn


class FirstOutput(nn.Module):
    """An RNN as the first element of what it returns."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)[0]


PREDICTION_FACTOR = 2.0
"""The memory model's predicted peak is within this factor of the measured one, either way
(docs/batching.md, "Memory plans")..."""
PREDICTION_SLACK = 16e6
"""... or within this many bytes of it (small peaks: the resident set grows by pages and by what
the allocator maps at once)."""
BUDGET_SLACK = (1.4, 16e6)
"""A planned call's measured peak stays under ``1.4 * budget + 16 MB`` (docs/batching.md): the model
underestimated measured peaks by up to 1/0.73 on the grid."""

FAST_GRID = [
    dict(model=model, scale=scale, n1=n1, n2=n2, implementation=implementation, trace_axes=trace_axes, memory="inf")
    for model, scale, n1, n2, trace_axes in (
        ("mlp", 2, 24, 12, (-1,)), ("cnn", 1, 16, 8, ()), ("transformer", 1, 8, 4, (-1,)), ("lstm", 1, 8, 4, ()))
    for implementation in (1, 2, 3)
]
"""The grid of every test run."""
FULL_GRID = [
    dict(model=model, scale=scale, n1=n1, n2=n2, implementation=implementation, trace_axes=trace_axes, memory="inf")
    for model, scale, n1 in (("mlp784", 1, 48), ("cnn", 2, 24), ("transformer", 1, 16), ("lstm", 1, 16))
    for n2 in (n1 // 2, None)
    for implementation in (1, 2, 3)
    for trace_axes in ((-1,), ())
]
"""The grid of docs/benchmarks.md ("Memory plans: predicted and measured peaks"), and of the slow tests."""
GIGABYTE = [
    dict(model="transformer", tokens=12, n1=48, n2=None, implementation=implementation, trace_axes=(-1,),
         memory=memory)
    for implementation, memory in ((3, "inf"), (3, "96MB"), (0, "96MB"), (3, "320MB"))
]
"""Structured derivatives' traced kernel of the transformer block for 48 examples of 12 tokens holds
about 1 GB of pair intermediates at once; within 96 or 320 MB it runs in blocks of a few examples.
(With 8 tokens, the order of NOTE: [Contraction order] holds 0.1 GB for 24 examples, where the order
of fewest FLOPs held 1 GB.) The blocks of x1 with itself off the diagonal hold both runs' factors
and Jacobians: priced as one run with itself, the plan for 320 MB took blocks of 12 examples and
peaked at 550 MB. Measured after the unplanned call in the same process, a planned call's peak is
up to 40 MB higher than in a fresh one (64 MB: 63-65 MB fresh, 97-104 MB after it, either torch)."""
BATCHED = [dict(model="cnn", scale=1, n1=64, n2=None, implementation=3, trace_axes=(), memory="16MB", batch=True)]
"""``batch(batch_size="auto")`` within a budget a tenth of its unplanned peak."""


def prediction_errors(rows: list[dict]) -> list[str]:
    """The rows whose prediction is neither within :data:`PREDICTION_FACTOR` of the measured peak nor
    within :data:`PREDICTION_SLACK` bytes of it, one line each."""
    bad = []
    for row in rows:
        predicted, measured = row["predicted"], row["measured"]
        close = abs(predicted - measured) <= PREDICTION_SLACK
        if not close and not measured / PREDICTION_FACTOR <= predicted <= measured * PREDICTION_FACTOR:
            bad.append(f"{row['model']} impl {row['implementation']} trace {row['trace_axes']} n2 {row['n2']}: "
                       f"predicted {predicted / 1e6:.1f} MB, measured {measured / 1e6:.1f} MB")
    return bad


def within_budget(row: dict) -> bool:
    """Whether a planned row's measured peak stays under its budget with :data:`BUDGET_SLACK`."""
    from torchntk._memory import memory_argument

    factor, slack = BUDGET_SLACK
    return row["measured"] <= factor * memory_argument(row["memory"], "test") + slack


def build(name: str, scale: int = 1, tokens: int = 8) -> tuple[nn.Module, tuple[int, ...]]:
    """A grid model and the shape of one example; ``scale`` widens it (the benchmarks use 1 and the
    tests' model sizes; see the builders), ``tokens``: the transformer's sequence length."""
    torch.manual_seed(0)
    if name == "mlp":
        width = 256 * scale
        layers = nn.Linear(196, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
        return nn.Sequential(*layers), (196,)
    if name == "mlp784":  # the benchmark MLP of docs/benchmarks.md
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)), (784,)
    if name == "cnn":  # the benchmark CNN of docs/benchmarks.md
        channels = 16 * scale
        return nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
            nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(channels * 256, 10),
        ), (3, 16, 16)
    if name == "transformer":
        layer = nn.TransformerEncoderLayer(32 * scale, 2, 64 * scale, dropout=0.0, batch_first=True).eval()
        return layer, (tokens, 32 * scale)
    if name == "lstm":
        return FirstOutput(nn.LSTM(8, 32 * scale, batch_first=True)).eval(), (6, 8)
    raise ValueError(f"unknown grid model {name!r}")


def _status(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _trim() -> None:
    """Returns malloc's free memory to the system (``malloc_trim``), so that the next call's growth
    is not hidden by memory an earlier configuration freed into malloc's heap."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")


def predicted(ntk_fn: Any, x1: Any, x2: Any, kwargs: Optional[dict] = None) -> dict:
    """The plan the kernel function makes for ``(x1, x2)``: implementation, chunk_size, peak bytes."""
    from torchntk._implementations import memory_plan
    from torchntk._kernel.settings import input_shape_key

    settings = ntk_fn._settings
    kwargs = kwargs or {}
    key = input_shape_key(x1, x2, None, kwargs)
    call = settings.prepare(x1, x2, None, kwargs, "ntk_fn", shape_key=key)
    scope = settings.planner.scope(call.plan_key)
    plan = memory_plan(settings.table, settings.implementation, call, scope, settings.budget(call))
    peak = plan.peak
    if peak is None:  # an unlimited budget plans nothing: the model's peak of the call as given
        from torchntk._implementations.memory import modelled_peak

        peak = modelled_peak(
            call, scope, plan.implementation, plan.chunk_size,
            settings.table[plan.implementation].plan(call, scope) if int(plan.implementation) == 3 else None,
        )
    return {"implementation": int(plan.implementation), "chunk_size": plan.chunk_size, "predicted": peak.total,
            "result": peak.result, "derivatives": peak.derivatives, "validation": peak.validation}


def kernel_call(config: dict, device: Optional[torch.device] = None) -> tuple:
    """The kernel function of one configuration and its arguments ``(ntk_fn, x1, x2, kwargs)``, with
    the model and the inputs on ``device`` (default the CPU). ``config``: ``model`` (a name of
    :func:`build`, or ``zoo:<name>`` for a model of docs/real_models.md as tests/zoo.py builds it),
    ``scale``, ``n1``, ``n2`` (None: x2 = None), ``implementation``, ``trace_axes``, ``memory``,
    ``chunk_size``, ``vmap_axes`` (default 0) and ``batch`` (``batch(batch_size="auto")`` within the
    budget, with the options of a dict; its workers compute on ``device`` alone)."""
    import torchntk

    device = device or torch.device("cpu")
    kwargs, vmap_axes, output_fn = {}, config.get("vmap_axes", 0), None
    if config["model"].startswith("zoo:"):
        from benchmarks.bench_zoo import resized
        from tests import zoo

        torch.manual_seed(0)
        case = resized({**zoo.FAST, **zoo.SLOW}[config["model"][4:]](), config["n1"], config["n2"] or config["n1"])
        model, x1, x2, kwargs, vmap_axes, output_fn = case
        if config.get("n2") is None:
            x2, kwargs = None, {key: (value[0], value[0]) for key, value in kwargs.items()}
    else:
        model, shape = build(config["model"], config.get("scale", 1), config.get("tokens", 8))
        generator = torch.Generator().manual_seed(1)
        x1 = torch.randn(config["n1"], *shape, generator=generator)
        x2 = None if config.get("n2") is None else torch.randn(config["n2"], *shape, generator=generator)
    model = model.to(device)
    x1, x2, kwargs = torch.utils._pytree.tree_map(
        lambda leaf: leaf.to(device) if isinstance(leaf, torch.Tensor) else leaf, (x1, x2, kwargs))
    batched = config.get("batch")
    ntk_fn = torchntk.empirical_ntk_fn(
        model, trace_axes=tuple(config["trace_axes"]), vmap_axes=vmap_axes, output_fn=output_fn,
        implementation=config["implementation"], memory=None if batched else config.get("memory"),
        chunk_size=config.get("chunk_size"),
    )
    if batched:  # its plan is the span plan, not the model's peak: nothing is predicted for it
        options = dict(batched) if isinstance(batched, dict) else {}
        if "devices" not in options:  # this measures one device: no other of the machine may take work
            options["devices"] = [str(device)]
        ntk_fn = torchntk.batch(ntk_fn, memory=config.get("memory"), **options)
    return ntk_fn, x1, x2, kwargs


def _measured(config: dict, device: torch.device, start: Any, stop: Any) -> dict:
    """One configuration's row: a first call (plans, caches and imports settle), then ``start()``,
    the timed call, and ``stop()``, which returns the growth of the peak over it in bytes."""
    ntk_fn, x1, x2, kwargs = kernel_call(config, device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = ntk_fn(x1, x2, **kwargs)
        del first
        row = dict(config, **({"predicted": None} if config.get("batch") else predicted(ntk_fn, x1, x2, kwargs)))
        start()
        began = time.perf_counter()
        kernel = ntk_fn(x1, x2, **kwargs)
        row["measured"] = stop()
        row["seconds"] = time.perf_counter() - began
    row["kernel_sum"] = float(sum(leaf.double().sum() for leaf in torch.utils._pytree.tree_leaves(kernel)))
    return row


def measure(config: dict) -> dict:
    """One configuration (see :func:`kernel_call`) on the CPU, in this process: the growth of the
    peak resident set over one call (the module docstring says how)."""
    before = []

    def start() -> None:
        gc.collect()
        _trim()
        before.append(_status("VmRSS"))
        _reset_peak()

    return _measured(config, torch.device("cpu"), start, lambda: float(_status("VmHWM") - before[0]))


def measure_cuda(config: dict, device: Optional[torch.device] = None) -> dict:
    """:func:`measure` on a CUDA device (default the current one): the growth of
    ``torch.cuda.max_memory_allocated`` over one call, the tensors the caching allocator hands out
    (what the memory model predicts), not what it reserves around them."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    before = []

    def start() -> None:
        gc.collect()
        torch.cuda.synchronize(device)
        before.append(torch.cuda.memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)

    def stop() -> float:
        torch.cuda.synchronize(device)
        return float(torch.cuda.max_memory_allocated(device) - before[0])

    return _measured(config, device, start, stop)


def run_grid(configs: list[dict], timeout: float = 600, threads: int = 1) -> list[dict]:
    """``measure`` of every configuration, in one child process (see the module docstring)."""
    environment = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(threads))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [path for path in environment.get("PYTHONPATH", "").split(os.pathsep) if path]
    environment["PYTHONPATH"] = os.pathsep.join([root] + paths)
    done = subprocess.run(
        [sys.executable, "-m", "tests._memory_grid"], input=json.dumps({"configs": configs, "threads": threads}),
        capture_output=True, text=True, timeout=timeout, env=environment, cwd=root,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the memory grid failed (status {done.returncode}):\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


if __name__ == "__main__":
    from tests.zoo import skip_torchvision_op_registrations

    skip_torchvision_op_registrations()
    request = json.loads(sys.stdin.read())
    torch.set_num_threads(request.get("threads", 1))
    for entry in request["configs"]:
        print(json.dumps(measure(entry)), flush=True)
