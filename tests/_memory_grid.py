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
the call runs (validation included), for the kernel function's ``memory`` budget. On CUDA the same
child would read ``torch.cuda.max_memory_allocated`` (``measure_cuda``); no GPU has run it yet.
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


def build(name: str, scale: int = 1) -> tuple[nn.Module, tuple[int, ...]]:
    """A grid model and the shape of one example; ``scale`` widens it (the benchmarks use 1 and the
    tests' model sizes; see the builders)."""
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
        return layer, (8, 32 * scale)
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
    plan = memory_plan(settings.table, settings.implementation, call, key, settings.budget(call))
    peak = plan.peak
    if peak is None:  # an unlimited budget plans nothing: the model's peak of the call as given
        from torchntk._implementations import memory_planner

        peak = memory_planner(settings.table).peak(
            call, key, plan.implementation, plan.chunk_size,
            settings.table[plan.implementation].plan(call, key) if int(plan.implementation) == 3 else None,
        )
    return {"implementation": int(plan.implementation), "chunk_size": plan.chunk_size, "predicted": peak.total,
            "result": peak.result, "derivatives": peak.derivatives, "validation": peak.validation}


def measure(config: dict) -> dict:
    """One configuration, in this process: ``model``, ``scale``, ``n1``, ``n2`` (None: x2 = None),
    ``implementation``, ``trace_axes``, ``memory``, ``chunk_size``, ``vmap_axes`` (default 0)."""
    import torchntk

    kwargs, vmap_axes, output_fn = {}, config.get("vmap_axes", 0), None
    if config["model"].startswith("zoo:"):  # a model of docs/real_models.md, as tests/zoo.py builds it
        from benchmarks.bench_zoo import resized
        from tests import zoo

        torch.manual_seed(0)
        case = resized({**zoo.FAST, **zoo.SLOW}[config["model"][4:]](), config["n1"], config["n2"] or config["n1"])
        model, x1, x2, kwargs, vmap_axes, output_fn = case
        if config.get("n2") is None:
            x2, kwargs = None, {key: (value[0], value[0]) for key, value in kwargs.items()}
    else:
        model, shape = build(config["model"], config.get("scale", 1))
        generator = torch.Generator().manual_seed(1)
        x1 = torch.randn(config["n1"], *shape, generator=generator)
        x2 = None if config.get("n2") is None else torch.randn(config["n2"], *shape, generator=generator)
    batched = config.get("batch")
    ntk_fn = torchntk.empirical_ntk_fn(
        model, trace_axes=tuple(config["trace_axes"]), vmap_axes=vmap_axes, output_fn=output_fn,
        implementation=config["implementation"], memory=None if batched else config.get("memory"),
        chunk_size=config.get("chunk_size"),
    )
    if batched:  # batch(batch_size="auto") within the budget; its plan is the span plan, not the model's peak
        options = dict(batched) if isinstance(batched, dict) else {}
        if "devices" not in options:  # this measures the CPU: no GPU of the machine may take the work
            options["device_count"] = 0
        ntk_fn = torchntk.batch(ntk_fn, memory=config.get("memory"), **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = ntk_fn(x1, x2, **kwargs)
        del first
        row = dict(config, **({"predicted": None} if batched else predicted(ntk_fn, x1, x2, kwargs)))
        gc.collect()
        _trim()
        base = _status("VmRSS")
        _reset_peak()
        start = time.perf_counter()
        kernel = ntk_fn(x1, x2, **kwargs)
        row["seconds"] = time.perf_counter() - start
        row["measured"] = float(_status("VmHWM") - base)
    row["kernel_sum"] = float(sum(leaf.double().sum() for leaf in torch.utils._pytree.tree_leaves(kernel)))
    return row


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


def measure_cuda(config: dict, device: Optional[torch.device] = None) -> dict:
    """:func:`measure` on a CUDA device with ``torch.cuda.max_memory_allocated`` (not run yet: no GPU)."""
    import torchntk

    device = device or torch.device("cuda")
    model, shape = build(config["model"], config.get("scale", 1))
    model = model.to(device)
    x1 = torch.randn(config["n1"], *shape, device=device)
    x2 = None if config.get("n2") is None else torch.randn(config["n2"], *shape, device=device)
    ntk_fn = torchntk.empirical_ntk_fn(
        model, trace_axes=tuple(config["trace_axes"]), vmap_axes=0, implementation=config["implementation"],
        memory=config.get("memory"),
    )
    ntk_fn(x1, x2)
    row = dict(config, **predicted(ntk_fn, x1, x2))
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    ntk_fn(x1, x2)
    torch.cuda.synchronize(device)
    row["measured"] = float(torch.cuda.max_memory_allocated(device) - base)
    return row


if __name__ == "__main__":
    from tests.zoo import skip_torchvision_op_registrations

    skip_torchvision_op_registrations()
    request = json.loads(sys.stdin.read())
    torch.set_num_threads(request.get("threads", 1))
    for entry in request["configs"]:
        print(json.dumps(measure(entry)), flush=True)
