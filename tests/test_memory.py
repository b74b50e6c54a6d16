"""Memory budgets: every kernel planned within ``memory=``, refused at once when it cannot fit, and
real out-of-memory errors explained (NOTE: [Memory plans], [Memory budgets], [Out of memory at the
kernel boundary], [Automatic tiling]).

Peaks are measured in child processes by ``tests/_memory_grid.py`` (its docstring says how); the
factor the memory model is held to is ``docs/batching.md``'s ("Memory plans").
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
import time
import warnings
import weakref
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

import torchntk
from torchntk._implementations.memory import modelled_peak
from torchntk._kernel.settings import NtkSettings
from tests._memory_grid import (
    BATCHED, BUDGET_SLACK, FAST_GRID, FULL_GRID, GIGABYTE, prediction_errors, run_grid, within_budget,
)
from tests._processes import run_python
from torchntk import _memory
from torchntk._memory import budget as budget_module
from torchntk._memory import errors as errors_module
from torchntk.cli import main as cli_main

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.cpu_only("measures and plans the CPU's memory (the CUDA paths are checked with mocks)")

def _mlp(width: int = 32, outputs: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, outputs))


def _x(n: int, features: int = 6, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, features, generator=torch.Generator().manual_seed(seed))


# -- the budget -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, expected", [
    ("8GB", 8e9), ("512MiB", 512 * 2**20), ("1.5 gib", 1.5 * 2**30), ("2e9", 2e9), ("64 MB", 64e6), ("100", 100.0),
    (123, 123.0), (2.5e9, 2.5e9), (math.inf, math.inf), ("unlimited", math.inf), (None, None), ("4K", 4096.0),
])
def test_memory_takes_bytes_and_amounts_with_units(value, expected):
    assert _memory.memory_argument(value, "f") == expected


@pytest.mark.parametrize("value, error, message", [
    ("lots", ValueError, "a string such as '8GB'"), ("8 GBs", ValueError, "got '8 GBs'"), (0, ValueError, "positive"),
    (-1e9, ValueError, "positive"), (float("nan"), ValueError, "positive"), (True, TypeError, "got True"),
    ([8], TypeError, "number of bytes"),
])
def test_memory_that_is_no_amount_is_refused_when_the_kernel_function_is_built(value, error, message):
    with pytest.raises(error, match=message):
        torchntk.empirical_ntk_fn(_mlp(), vmap_axes=0, memory=value)
    with pytest.raises(error, match=message):
        torchntk.batch(torchntk.empirical_ntk_fn(_mlp(), vmap_axes=0), memory=value)


def test_the_default_budget_is_half_the_available_ram_and_most_of_a_gpus_free_memory(monkeypatch):
    monkeypatch.setattr(budget_module, "_cpu_available", lambda: 10e9)
    assert _memory.default_budget(torch.device("cpu")) == 0.5 * 10e9 == _memory.CPU_FRACTION * 10e9
    # CUDA (not run on a GPU yet: mocked): the driver's free bytes and the allocator's unused reserve.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (6e9, 80e9))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3e9)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1e9)
    assert _memory.default_budget(torch.device("cuda:0")) == pytest.approx(0.8 * (6e9 + 2e9))
    assert _memory.resolve_budget(5e9, torch.device("cuda:0")) == 5e9  # an explicit budget is taken as given


def test_the_cpu_budget_reads_memavailable():
    with open("/proc/meminfo") as meminfo:
        available = next(float(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    assert _memory.available_bytes(torch.device("cpu")) == pytest.approx(available, rel=0.2)


# -- refusals -------------------------------------------------------------------------------------


_SEEN: list[int] = []
"""The batch sizes :class:`_Counted`'s forward passes see (kernel calls run private copies of a
module, NOTE: [Modules are never mutated], so the record cannot be an attribute)."""


class _Counted(nn.Module):
    """The benchmark MLP, recording the batch sizes its forward passes see in ``_SEEN``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    def forward(self, x):
        _SEEN.append(x.shape[0])
        return self.net(x)


@pytest.mark.parametrize("implementation", [0, 1, 3])
def test_a_kernel_larger_than_the_budget_is_refused_in_under_a_second_without_the_forward_passes(implementation):
    model = _Counted()
    _SEEN.clear()
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=implementation, memory="1GB")
    x = torch.randn(20_000, 784)
    start = time.perf_counter()
    with pytest.raises(torchntk.KernelMemoryError) as refused:
        ntk_fn(x)
    assert time.perf_counter() - start < 1.0
    assert _SEEN and max(_SEEN) == 1  # one example only: no pass over the batch, nothing of the kernel's size
    error = refused.value
    assert isinstance(error, MemoryError) and error.kernel_alone
    assert error.needed_bytes == 20_000 * 20_000 * 10 * 10 * 4 and error.budget_bytes == 1e9
    for text in ("160 GB", "20000x20000x10x10", "memory budget of 1 GB", "torchntk.batch(kernel_fn)(x1, x2, out=",
                 "trace_axes", "output_fn", "memory="):
        assert text in str(error)


def test_a_small_batch_whose_kernel_is_too_large_is_refused_after_its_validation():
    torch.manual_seed(0)
    model = nn.Linear(6, 2000)
    groups = {"weight": "weight", "bias": "bias"}
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, memory="100MB", groups=groups)
    with pytest.raises(torchntk.KernelMemoryError, match="for each of 2 parameter groups") as refused:
        ntk_fn(_x(10))  # 10 x 10 x 2000 x 2000 float32 per group
    assert refused.value.needed_bytes == 2 * 10 * 10 * 2000 * 2000 * 4


def test_an_unlimited_budget_plans_nothing():
    ntk_fn = torchntk.empirical_ntk_fn(_mlp(), vmap_axes=0, memory=math.inf, implementation=0)
    choice = ntk_fn.auto_choice(_x(5))
    assert choice.memory_budget_bytes == math.inf and choice.chunk_size is None
    assert torch.allclose(ntk_fn(_x(5)), torchntk.empirical_ntk_fn(_mlp(), vmap_axes=0)(_x(5)))


# -- plans -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", [1, 2, 3])
@pytest.mark.parametrize("trace_axes", [(-1,), ()], ids=["traced", "full"])
@pytest.mark.parametrize("x2_given", [True, False], ids=["x2", "x2-None"])
def test_a_call_over_its_budget_runs_in_blocks_that_fit_and_gives_the_same_kernel(implementation, trace_axes, x2_given):
    model = _mlp(width=64, outputs=8)
    x1, x2 = _x(40), (_x(30, seed=2) if x2_given else None)
    unlimited = torchntk.empirical_ntk_fn(model, trace_axes=trace_axes, vmap_axes=0, implementation=implementation,
                                          memory=math.inf)
    expected = unlimited(x1, x2)
    settings = unlimited._settings
    key = torchntk._kernel.settings.input_shape_key(x1, x2, None, {})
    call = settings.prepare(x1, x2, None, {}, "ntk_fn", shape_key=key)
    scope = settings.planner.scope(call.plan_key)
    structured = settings.table[3].plan(call, scope) if implementation == 3 else None
    whole = modelled_peak(call, scope, torchntk.NtkImplementation(implementation), None, structured)
    budget = 0.5 * whole.planned  # the call as given does not fit; blocks of a few examples do
    planned = torchntk.empirical_ntk_fn(model, trace_axes=trace_axes, vmap_axes=0, implementation=implementation,
                                        memory=budget)
    if implementation == 2 and modelled_peak(call, scope, torchntk.NtkImplementation(2), 1).planned > budget:
        with pytest.raises(torchntk.KernelMemoryError, match="Implementation 2 pushes all of x1"):
            planned(x1, x2)  # its chunk_size cuts x2 only: batch cuts x1 too
        return
    with pytest.warns(torchntk.MemoryPlanWarning, match=r"computing it with chunk_size=\d+") as caught:
        actual = planned(x1, x2)
        again = planned(x1, x2)
    assert len(caught) == 1  # once per kernel function
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(again, actual)
    plan = torchntk._implementations.memory_plan(settings.table, settings.implementation, call, scope, budget)
    assert plan.chosen and plan.chunk_size < 40 and plan.peak.planned <= budget


@pytest.mark.parametrize("implementation", [1, 3])
def test_working_set_runs_bound_the_planned_activations(implementation, monkeypatch):
    """Without a chunk_size, the per-example pass runs one working-set run at a time (NOTE:
    [Working-set runs]): the plan counts one run's activations, not all examples', so a budget
    between the two needs no chunk_size."""
    from torchntk._kernel import working_set

    torch.manual_seed(0)
    # Few parameters, large activations: what the runs bound dominates the call.
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4))
    x = torch.randn(32, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    expected = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation, memory=math.inf)(x)

    def modelled(runs: int | None) -> float:
        ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation, memory=math.inf)
        key = torchntk._kernel.settings.input_shape_key(x, None, None, {})
        call = ntk_fn._settings.prepare(x, None, None, {}, "ntk_fn", shape_key=key, needs_outputs=False)
        assert call.working_runs == runs
        scope = ntk_fn._settings.planner.scope(call.plan_key)
        structured = ntk_fn._settings.table[3].plan(call, scope) if implementation == 3 else None
        return modelled_peak(call, scope, torchntk.NtkImplementation(implementation), None, structured).planned

    whole = modelled(None)
    monkeypatch.setattr(working_set, "WORKING_SET_BYTES", 1)  # runs of one example
    one_run = modelled(1)
    assert one_run < 0.7 * whole  # implementation 3 keeps every example's factors (the layers' inputs)
    budget = (one_run * whole) ** 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchntk.MemoryPlanWarning)
        kernel = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation, memory=budget)(x)
    torch.testing.assert_close(kernel, expected, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(working_set, "WORKING_SET_BYTES", 2**40)  # one pass: the same budget needs blocks
    with pytest.warns(torchntk.MemoryPlanWarning, match=r"computing it with chunk_size=\d+"):
        torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation, memory=budget)(x)


def test_a_plan_that_cannot_fit_is_refused_naming_its_smallest_peak():
    model = _mlp(width=64)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1, memory=20_000)
    with pytest.raises(torchntk.KernelMemoryError, match="even with one example per block") as refused:
        ntk_fn(_x(8))
    assert refused.value.needed_bytes > 20_000 and not refused.value.kernel_alone
    unmapped = torchntk.empirical_ntk_fn(model, vmap_axes=None, implementation=1, memory=20_000)
    with pytest.raises(torchntk.KernelMemoryError, match="Pass vmap_axes if the examples are independent"):
        unmapped(_x(8))


def test_without_vmap_axes_the_plan_bounds_the_vectors_differentiated_at_once():
    model = _mlp(width=64, outputs=8)
    x = _x(12)
    expected = torchntk.empirical_ntk_fn(model, trace_axes=(), memory=math.inf)(x)
    settings = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=None, implementation=1)._settings
    key = torchntk._kernel.settings.input_shape_key(x, None, None, {})
    call = settings.prepare(x, None, None, {}, "ntk_fn", shape_key=key)
    scope = settings.planner.scope(call.plan_key)
    whole = modelled_peak(call, scope, torchntk.NtkImplementation(1), None)
    one = modelled_peak(call, scope, torchntk.NtkImplementation(1), 1)
    budget = (whole.planned + one.planned) / 2
    with pytest.warns(torchntk.MemoryPlanWarning, match="output entries differentiated at once"):
        actual = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=None, implementation=1, memory=budget)(x)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


def test_auto_picks_the_fastest_plan_that_fits_and_reports_its_chunk_size():
    model = _mlp(width=256, outputs=10)
    x1, x2 = _x(64), _x(48, seed=2)
    free = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0, memory=math.inf)
    unplanned = free.auto_choice(x1, x2)
    assert unplanned.chunk_size is None
    # A budget below Jacobian contraction's unchunked peak but above structured derivatives': 1 gets blocks.
    budget = 0.5 * min(unplanned.estimates[torchntk.NtkImplementation.JACOBIAN_CONTRACTION].memory_bytes, 1e12)
    auto = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0, memory=budget)
    choice = auto.auto_choice(x1, x2)
    jacobian = choice.estimates[torchntk.NtkImplementation.JACOBIAN_CONTRACTION]
    assert jacobian.chunk_size is not None and jacobian.memory_bytes <= budget
    assert jacobian.flops > unplanned.estimates[torchntk.NtkImplementation.JACOBIAN_CONTRACTION].flops  # blocks cost
    assert choice.estimates[choice.implementation].memory_bytes <= budget
    fitting = {key: value for key, value in choice.estimates.items() if value.memory_bytes <= budget}
    assert choice.implementation == min(fitting, key=lambda key: (fitting[key].flops, int(key)))
    torch.testing.assert_close(auto(x1, x2), free(x1, x2), rtol=1e-5, atol=1e-5)


# -- out of memory at the kernel boundary ----------------------------------------------------------


def test_an_allocator_error_is_re_raised_with_the_plan_and_its_tensors_are_released(monkeypatch):
    model = _mlp()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1, chunk_size=3)
    table = ntk_fn._settings.table
    held = []

    def fails(call, scope):
        big = torch.ones(1000)
        held.append(weakref.ref(big))
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 209715200000 bytes. Error code 12 (Cannot allocate memory)")

    released = []
    monkeypatch.setitem(table, torchntk.NtkImplementation(1), mock.Mock(kernels=fails))
    original = errors_module.release_memory
    monkeypatch.setattr(errors_module, "release_memory", lambda device: (released.append(device), original(device)))
    with pytest.raises(torchntk.KernelMemoryError) as caught:
        ntk_fn(_x(7))
    text = str(caught.value)
    for part in ("ran out of memory", "implementation 1 (chunk_size=3", "budget", "smaller memory=",
                 "torchntk.batch", "DefaultCPUAllocator: can't allocate memory"):
        assert part in text
    assert caught.value.__cause__ is None and released == [torch.device("cpu")]
    assert held[0]() is None  # the failed computation's tensors were freed before the error was raised


def test_other_errors_pass_the_boundary_unchanged(monkeypatch):
    ntk_fn = torchntk.empirical_ntk_fn(_mlp(), vmap_axes=0, implementation=1)
    broken = mock.Mock(kernels=mock.Mock(side_effect=KeyError("not memory")))
    monkeypatch.setitem(ntk_fn._settings.table, torchntk.NtkImplementation(1), broken)
    with pytest.raises(KeyError, match="not memory"):
        ntk_fn(_x(3))


def test_the_cuda_cache_is_released_after_an_out_of_memory_error(monkeypatch):
    """Not run on a GPU yet: the CUDA calls are mocked."""
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    oom = getattr(torch, "OutOfMemoryError", RuntimeError)("CUDA out of memory. Tried to allocate 20.00 GiB")
    assert _memory.is_allocation_failure(oom) and not _memory.is_allocation_failure(torchntk.KernelMemoryError("x"))

    def compute():
        raise oom

    with pytest.raises(torchntk.KernelMemoryError, match="CUDA out of memory"):
        _memory.out_of_memory_boundary(compute, "ntk_fn", lambda: "implementation 3", "advice.", torch.device("cuda"))
    assert emptied == [True]


# -- batch_size="auto" ------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", [0, 1, 3])
@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["1cpu", "2cpu"])
@pytest.mark.parametrize("memory", ["inf", "tight"])
def test_batch_auto_equals_the_kernel_within_any_budget(implementation, devices, memory):
    model = _mlp(width=64, outputs=4)
    x1, x2 = _x(37), _x(23, seed=2)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)
    expected, symmetric = ntk_fn(x1, x2), ntk_fn(x1)
    budget = math.inf if memory == "inf" else 600_000  # per device: spans of a few examples
    batched = torchntk.batch(ntk_fn, devices=devices, memory=budget)  # the CPU also beside a GPU
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchntk.MemoryPlanWarning)  # batch plans spans, never chunk_size
        torch.testing.assert_close(batched(x1, x2), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(batched(x1), symmetric, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("trace_axes, diagonal_axes", [((-1,), ()), ((), ()), ((), (0,)), ((0,), ()), ((), (1,))])
def test_batch_auto_tiles_every_layout_within_a_tight_budget(trace_axes, diagonal_axes):
    model = _mlp(width=32, outputs=3)
    x1, x2 = _x(21), _x(21, seed=2)
    kernel_fn = torchntk.empirical_kernel_fn(model, trace_axes, diagonal_axes, vmap_axes=0, implementation=1)
    expected = kernel_fn(x1, x2, ("ntk", "nngp"))
    batched = torchntk.batch(kernel_fn, memory=200_000, devices=["cpu", "cpu"])
    actual = batched(x1, x2, ("ntk", "nngp"))
    for name in ("ntk", "nngp"):
        torch.testing.assert_close(getattr(actual, name), getattr(expected, name), rtol=1e-5, atol=1e-6)


def test_batch_auto_with_room_for_everything_is_one_call_of_the_kernel_function(monkeypatch):
    """Asked whether the call fits whole (NOTE: [Budgets of callers]), the kernel function computes
    it in one call: one kernel computation for ``batch``, one for the kernel function itself."""
    ntk_fn = torchntk.empirical_ntk_fn(_mlp(), vmap_axes=0, implementation=3)
    calls = []
    original = NtkSettings.ntk
    monkeypatch.setattr(NtkSettings, "ntk", lambda *args, **kwargs: (calls.append(1), original(*args, **kwargs))[1])
    x = _x(9)
    assert torch.equal(torchntk.batch(ntk_fn)(x), ntk_fn(x)) and len(calls) == 2


def test_batch_auto_refuses_a_result_too_large_and_writes_it_to_out_instead(tmp_path):
    model = _mlp(width=16, outputs=3)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=3)
    x = _x(60)
    result_bytes = 60 * 60 * 3 * 3 * 4
    batched = torchntk.batch(ntk_fn, memory=result_bytes // 2, devices=["cpu", "cpu"])
    with pytest.raises(torchntk.KernelMemoryError, match="out=np.lib.format.open_memmap") as refused:
        batched(x)
    assert refused.value.kernel_alone and refused.value.needed_bytes == result_bytes
    out = np.lib.format.open_memmap(tmp_path / "k.npy", mode="w+", dtype=np.float32, shape=(60, 60, 3, 3))
    torchntk.batch(ntk_fn, memory=result_bytes // 2)(x, out=out)  # spans of a few examples, written to disk
    np.testing.assert_allclose(out, ntk_fn(x).numpy(), rtol=1e-5, atol=1e-6)


def test_batch_auto_without_vmap_axes_plans_each_worker_within_its_share(monkeypatch):
    model = _mlp(width=64, outputs=4)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=None, implementation=1)
    budgets = []
    original = torchntk._kernel.settings.NtkSettings.budget
    monkeypatch.setattr(torchntk._kernel.settings.NtkSettings, "budget",
                        lambda self, call, caller=None: budgets.append(original(self, call, caller)) or budgets[-1])
    x = _x(20)
    actual = torchntk.batch(ntk_fn, memory="2GB", devices=["cpu", "cpu"])(x)
    torch.testing.assert_close(actual, ntk_fn(x), rtol=1e-5, atol=1e-6)
    assert budgets and max(budgets[:-1]) <= 1e9  # each of the two workers: half of the device's 2 GB


@pytest.mark.parametrize("value", ["big", -1, 2.5])
def test_batch_size_is_auto_or_a_non_negative_int(value):
    with pytest.raises((ValueError, TypeError), match="batch_size"):
        torchntk.batch(torchntk.empirical_ntk_fn(_mlp(), vmap_axes=0), batch_size=value)


def test_plan_spans_takes_long_spans_that_keep_x2_cached_and_stays_within_the_budget():
    plan_spans = torchntk.batching._plan.plan_spans
    roomy = plan_spans(1000, 1000, 1e6, lambda length: 3e6 * length, 10e9, longest=1000, mirrored=False)
    assert roomy.span == 1000 and roomy.cache >= 1000 * 1e6  # one pair, every example prepared once
    tight = plan_spans(1000, 1000, 1e6, lambda length: 3e6 * length, 1.2e9, longest=1000, mirrored=False)
    assert tight.span < 1000 and tight.peak <= 1.2e9
    caching = plan_spans(1000, 1000, 1e6, lambda length: 3e6 * length, 2e9, longest=128, mirrored=False)
    assert caching.span == 128 and caching.cache >= 1000 * 1e6  # spans capped: x2 kept whole in the cache
    with pytest.raises(torchntk.KernelMemoryError, match="spans of one example needs about 3 MB"):
        torchntk.batching._plan.plan_spans(10, 10, 1e6, lambda length: 3e6 * length, 1e6, longest=10, mirrored=True)


# -- the command line -------------------------------------------------------------------------------


def test_the_command_line_takes_memory(tmp_path, capsys):
    arguments = ["--model", "mlp", "--n", "3", "--implementation", "1", "--progress", "off", "--output", str(tmp_path)]
    assert cli_main(arguments + ["--memory", "4GB"]) == 0
    assert cli_main(arguments + ["--memory", "lots"]) == 2
    assert "--memory: expected an amount of memory such as 8GB or 512MiB, got 'lots'" in capsys.readouterr().err
    assert cli_main(arguments + ["--trace-axes", "none", "--memory", "1kB"]) == 3  # the kernel alone is larger
    assert "KernelMemoryError" in capsys.readouterr().err


# -- predicted against measured peaks (child processes) ------------------------------------------------

@functools.lru_cache(maxsize=None)
def _fast_rows() -> tuple:
    """The fast tests' measurements, in one child process (its start-up is most of the time)."""
    return tuple(run_grid(FAST_GRID + GIGABYTE + BATCHED, timeout=300))


def _rows_of(configs: list[dict]) -> list[dict]:
    wanted = [dict(config, trace_axes=list(config["trace_axes"])) for config in configs]
    return [row for row in _fast_rows() if {key: row.get(key) for key in wanted[0]} in wanted]


def _check_predictions(rows: list[dict]) -> None:
    assert rows, "the grid measured nothing"
    bad = prediction_errors(rows)
    assert not bad, "\n".join(bad)


def test_predicted_peaks_are_within_the_documented_factor_of_the_measured_ones():
    rows = _rows_of(FAST_GRID)
    assert len(rows) == len(FAST_GRID) and max(row["measured"] for row in rows) > 100e6
    _check_predictions(rows)


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted({config["model"] for config in FULL_GRID}))
def test_predicted_peaks_are_within_the_documented_factor_on_the_full_grid(model):
    # One test (and child process) per model, so that pytest-xdist's workers share the grid.
    configs = [config for config in FULL_GRID if config["model"] == model]
    rows = run_grid(configs, timeout=900)
    assert len(rows) == len(configs)
    _check_predictions(rows)


def test_a_kernel_needing_a_gigabyte_completes_within_96_and_320_mb_and_equals_the_unplanned_one():
    unplanned, *planned = _rows_of(GIGABYTE)
    assert unplanned["measured"] > 0.8e9 and unplanned["chunk_size"] is None
    for row in planned:
        assert row["chunk_size"] is not None and row["implementation"] == 3 and within_budget(row), row
        assert math.isclose(row["kernel_sum"], unplanned["kernel_sum"], rel_tol=1e-6)


@pytest.mark.slow
def test_jacobian_contraction_needing_a_gigabyte_completes_within_64_mb():
    configs = [dict(model="mlp", n1=200, n2=None, implementation=1, trace_axes=(-1,), memory=memory)
               for memory in ("64MB", "inf")]
    planned, unplanned = run_grid(configs, timeout=900)
    assert unplanned["measured"] > 0.9e9 and planned["chunk_size"] is not None and within_budget(planned)
    assert math.isclose(planned["kernel_sum"], unplanned["kernel_sum"], rel_tol=1e-6)


def test_batch_auto_stays_within_its_budget():
    (row,) = _rows_of(BATCHED)
    assert within_budget(row) and row["measured"] > 4e6, row


@pytest.mark.slow
@pytest.mark.parametrize("implementation", [1, 2, 3])  # one child process each, shared by pytest-xdist's workers
def test_batch_auto_stays_within_its_budget_with_every_implementation_and_two_workers(implementation):
    configs = [dict(model="cnn", scale=2, n1=64, n2=None, implementation=implementation, trace_axes=(),
                    memory="64MB", batch={"devices": devices})
               for devices in (["cpu"], ["cpu"] * 2)]
    rows = run_grid(configs, timeout=900)
    assert len(rows) == len(configs)
    for row in rows:
        assert within_budget(row), row


@pytest.mark.slow
def test_the_memory_benchmark_runs_and_plans_within_its_budgets(tmp_path):
    done = run_python(
        str(ROOT / "benchmarks" / "bench_memory.py"), "--models", "mlp", "--mlp-sizes", "300", "--batch-sizes", "64",
        "--budgets", "default,64MB", "--markdown", tmp_path / "memory.md", timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "memory.json").read_text())
    assert len(rows) == 3 and all("error" not in row for row in rows)
    assert all(row["peak"] <= BUDGET_SLACK[0] * row["budget"] + BUDGET_SLACK[1] for row in rows if row["budget"])
