"""Memory budgets on a GPU: the memory model against ``torch.cuda.max_memory_allocated``, planned
calls within their budgets, refusals and real out-of-memory errors (NOTE: [Memory plans],
[Memory budgets], [Out of memory at the kernel boundary]).

The CPU side of the same checks is ``tests/test_memory.py``; the grids, the factors and how a CUDA
peak is read are in ``tests/_memory_grid.py``. Every test here runs only with ``--device cuda``.
Each measures in its own process's caching allocator, so several pytest workers may share the GPU.
"""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

import torchntk
from tests._memory_grid import BATCHED, FAST_GRID, GIGABYTE, measure_cuda, prediction_errors, within_budget

pytestmark = pytest.mark.cuda_only("the memory model on CUDA, measured with torch.cuda.max_memory_allocated")


def test_predicted_peaks_are_within_the_documented_factor_of_max_memory_allocated(device):
    rows = [measure_cuda(config, device) for config in FAST_GRID]
    assert max(row["measured"] for row in rows) > 50e6  # the grid holds peaks that the factor constrains
    bad = prediction_errors(rows)
    assert not bad, "\n".join(bad)


def test_a_kernel_needing_a_gigabyte_completes_within_96_and_320_mb_on_cuda(device):
    unplanned, *planned = (measure_cuda(config, device) for config in GIGABYTE)
    assert unplanned["measured"] > 0.5e9 and unplanned["chunk_size"] is None, unplanned
    for row in planned:
        assert row["chunk_size"] is not None and row["implementation"] == 3 and within_budget(row), row
        assert math.isclose(row["kernel_sum"], unplanned["kernel_sum"], rel_tol=1e-5)


def test_batch_auto_stays_within_its_budget_on_cuda(device):
    (row,) = (measure_cuda(config, device) for config in BATCHED)
    assert within_budget(row) and row["measured"] > 4e6, row


def _linear(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 10).to(device)


def test_a_kernel_larger_than_free_gpu_memory_is_refused_at_once_without_allocating_it(device):
    ntk_fn = torchntk.empirical_ntk_fn(_linear(device), trace_axes=(), vmap_axes=0, implementation=1)
    x = torch.randn(20_000, 4, device=device)  # a 160 GB kernel: no GPU holds it
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with pytest.raises(torchntk.KernelMemoryError) as refused:
        ntk_fn(x)
    assert time.perf_counter() - start < 5.0  # CUDA's start-up included
    assert refused.value.kernel_alone and refused.value.needed_bytes == 20_000 ** 2 * 10 * 10 * 4
    assert "torchntk.batch(kernel_fn, out=" in str(refused.value)
    assert torch.cuda.max_memory_allocated(device) - before < 100e6


def test_a_real_cuda_out_of_memory_error_is_explained_and_the_cache_released(device):
    ntk_fn = torchntk.empirical_ntk_fn(_linear(device), trace_axes=(), vmap_axes=0, implementation=1,
                                       memory="unlimited")  # nothing planned: the allocation itself fails
    x = torch.randn(20_000, 4, device=device)
    ntk_fn(x[:8])  # CUDA's libraries load and cache their workspaces
    torch.cuda.synchronize(device)
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    with pytest.raises(torchntk.KernelMemoryError) as caught:
        ntk_fn(x)
    text = str(caught.value)
    assert "out of memory" in text.lower() and "torchntk.batch" in text and "memory=" in text
    assert caught.value.__cause__ is None  # the failed computation's frames are not kept alive
    torch.cuda.synchronize(device)
    assert torch.cuda.memory_allocated(device) == allocated  # its tensors were freed ...
    assert torch.cuda.memory_reserved(device) <= reserved  # ... and the allocator's cache released
