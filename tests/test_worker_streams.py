"""``batch``'s workers on their own streams (NOTE: [Worker streams] in ``torchntk/batching/_streams.py``).

Blocks bound for host memory are copied asynchronously on CUDA and written into place later. On
any device these tests replace the lanes with ones whose staged copies hold NaN until their
arrival is awaited, so that a block read before its copy arrived shows up in the kernel. On a
CUDA run (``--device cuda``) the real lanes are checked too: a stream per worker, the result on
the caller's stream, and the documented bound on peak GPU memory.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

import torchntk
import torchntk.batching._jobs
from tests.cases import to_device
from torchntk.batching._streams import Lane
from torchntk.testing import assert_kernels_close, reference_ntk


def _model(device: torch.device, width: int = 8, dtype=torch.float64) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, 4))
    return model.to(device=device, dtype=dtype).eval()


def _inputs(n1: int, n2: int, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(n1 * 100 + n2)
    return to_device((torch.randn(n1, 3, generator=generator, dtype=dtype),
                      torch.randn(n2, 3, generator=generator, dtype=dtype)))


class _Arrival:
    """A fake event: the copies it stands for happen when it is awaited."""

    def __init__(self, copies: list):
        self.copies = copies
        self.awaited = False

    def synchronize(self) -> None:
        for staged, block in self.copies:
            staged.copy_(block)
        self.awaited = True


class _LateCopyLane(Lane):
    """A lane that defers every write, as a CUDA lane does, and whose staged copies arrive late."""

    made: list[_LateCopyLane] = []

    def __init__(self, device: torch.device, result_device: torch.device):
        super().__init__(device, result_device)
        self._queued: list = []
        self.arrivals: list[_Arrival] = []
        _LateCopyLane.made.append(self)

    def to_host(self, block: torch.Tensor) -> torch.Tensor:
        staged = torch.full(block.shape, float("nan"), dtype=block.dtype)
        self._queued.append((staged, block))
        return staged

    def _arrival(self) -> _Arrival:
        arrival = _Arrival(self._queued)
        self._queued = []
        self.arrivals.append(arrival)
        return arrival


@pytest.fixture
def late_lanes(monkeypatch):
    _LateCopyLane.made = []
    monkeypatch.setattr(torchntk.batching._jobs, "Lane", _LateCopyLane)
    return _LateCopyLane.made


@pytest.mark.parametrize("vmap_axes", [0, None], ids=["spans", "per-block"])
@pytest.mark.parametrize("trace_axes, diagonal_axes", [((-1,), ()), ((), ()), ((0,), ()), ((), (0,))],
                         ids=["traced", "full", "batch-traced", "batch-diagonal"])
@pytest.mark.parametrize("same", [False, True], ids=["x2", "x2-none"])
@pytest.mark.parametrize("workers", [1, 3])
def test_blocks_for_host_memory_are_written_only_after_their_copy_arrived(
    device, late_lanes, vmap_axes, trace_axes, diagonal_axes, same, workers
):
    x1, x2 = _inputs(9, 9)
    x2 = None if same else x2
    model = _model(device)
    kernel_fn = torchntk.empirical_ntk_fn(model, trace_axes, diagonal_axes, vmap_axes, implementation=3)
    batched = torchntk.batch(kernel_fn, 2, devices=[str(device)] * workers, store_on_device=False, cache_bytes=4000)
    kernel = batched(x1, x2)
    assert kernel.device.type == "cpu"
    expected = reference_ntk(model, x1, x2, trace_axes=trace_axes, diagonal_axes=diagonal_axes)
    assert_kernels_close(kernel, expected.cpu(), rtol=1e-10, atol=1e-12)
    assert late_lanes and all(not lane._pending for lane in late_lanes)
    arrivals = [arrival for lane in late_lanes for arrival in lane.arrivals]
    assert len(arrivals) > 1 and all(arrival.awaited for arrival in arrivals)


def test_a_progress_record_sees_only_blocks_that_arrived(device, late_lanes, tmp_path):
    """Checksums and the record are made from the arrived copies: a resumed run verifies them."""
    x1, _ = _inputs(7, 7)
    model = _model(device)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1)
    out = np.lib.format.open_memmap(tmp_path / "k.npy", "w+", np.float64, (7, 7))
    batched = torchntk.batch(ntk_fn, 2, devices=[str(device)] * 2)
    batched(x1, out=out, progress_file=tmp_path / "k.progress")
    assert_kernels_close(torch.from_numpy(np.array(out)), reference_ntk(model, x1).cpu(), rtol=1e-10, atol=1e-12)
    reopened = np.lib.format.open_memmap(tmp_path / "k.npy", "r+")
    batched(x1, out=reopened, progress_file=tmp_path / "k.progress")  # verifies every recorded block's checksum
    assert np.array_equal(np.array(reopened), np.array(out))


class _FailingArray(np.ndarray):
    """An ``out`` array whose third block write fails, like a full disk."""

    writes = 0

    def __setitem__(self, index, value):
        type(self).writes += 1
        if type(self).writes == 3:
            raise OSError("No space left on device")
        super().__setitem__(index, value)


@pytest.mark.parametrize("late", [False, True], ids=["lane", "late-copy-lane"])
def test_a_write_that_fails_later_stops_the_batch_with_its_error(device, monkeypatch, late):
    if late:
        monkeypatch.setattr(torchntk.batching._jobs, "Lane", _LateCopyLane)
    _FailingArray.writes = 0
    x1, x2 = _inputs(8, 8)
    ntk_fn = torchntk.empirical_ntk_fn(_model(device), vmap_axes=0)
    out = np.zeros((8, 8)).view(_FailingArray)
    with pytest.raises(OSError, match="No space left on device"):
        torchntk.batch(ntk_fn, 2, devices=[str(device)] * 3, cache_bytes=0)(x1, x2, out=out)


def test_every_worker_has_a_lane_of_its_own_and_results_go_to_the_callers_stream(device):
    lanes = [Lane(device, device) for _ in range(3)]
    if device.type != "cuda":  # nothing to order: blocks are written at once
        assert all(lane.stream is None and lane.result_stream is None for lane in lanes)
        written = []
        lanes[0].then(lambda: written.append(1))
        assert written == [1]
        return
    streams = {lane.stream for lane in lanes}
    assert len(streams) == 3 and torch.cuda.current_stream(device) not in streams
    assert all(lane.origin == lane.result_stream == torch.cuda.current_stream(device) for lane in lanes)
    host_lane = Lane(device, torch.device("cpu"))
    assert host_lane.result_stream is None and host_lane.stream is not None


@pytest.mark.parametrize("store_on_device", [True, False], ids=["on-device", "host"])
def test_a_caller_on_its_own_stream_gets_the_kernel_there(device, store_on_device):
    """Workers start after the caller's stream and the result is written on it: a caller that
    queues work on a side stream (the inputs made there) gets the right kernel, on that stream."""
    model = _model(device)
    x1, x2 = _inputs(10, 7)
    kernel_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=3)
    batched = torchntk.batch(kernel_fn, 3, devices=[str(device)] * 3, store_on_device=store_on_device)
    side = torch.cuda.Stream(device) if device.type == "cuda" else None
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        inputs = (x1 * 1.0, x2 * 1.0)  # queued on the side stream on CUDA
        kernel = batched(*inputs) * 1.0
    if side is not None:
        side.synchronize()
    assert_kernels_close(kernel, reference_ntk(model, x1, x2, trace_axes=()), rtol=1e-10, atol=1e-12)


def _peak_bytes(device: torch.device, run) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    result = run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del result
    return peak


@pytest.mark.cuda_only("peak GPU memory, from torch.cuda.max_memory_allocated")
@pytest.mark.parametrize("implementation", [1, 3])
def test_peak_gpu_memory_follows_cache_bytes_not_the_kernel(device, implementation):
    """docs/batching.md, "Memory": with the result in host memory, a device holds the model, the
    inputs, and per worker ``cache_bytes`` plus one span's preparation and one pair's contraction;
    with the result on the device, the kernel too."""
    model = _model(device, width=256, dtype=torch.float32)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)
    cache_bytes = 2**22
    peaks = {}
    for n in (1024, 4096):
        x1 = torch.randn(n, 3, device=device)
        batched = torchntk.batch(ntk_fn, 64, cache_bytes=cache_bytes, store_on_device=False)
        peaks[n] = _peak_bytes(device, lambda: batched(x1))
    kernel_bytes = 4096 * 4096 * 4  # 64 MiB
    # A pair of spans holds at most SPAN_ENTRIES entries; preparing a span costs a few times its data.
    bound = 4 * cache_bytes + 4 * torchntk.batching._jobs.SPAN_ENTRIES * 4 + 4096 * 3 * 4
    assert peaks[4096] <= bound, (peaks, bound)
    # No growth with the kernel's N^2 entries (60 MiB more at 4096): spans grow with N only up to
    # what cache_bytes allows (1.5 MB more on an H100).
    assert peaks[4096] <= peaks[1024] + cache_bytes, peaks
    x1 = torch.randn(4096, 3, device=device)
    on_device = _peak_bytes(device, lambda: torchntk.batch(ntk_fn, 64, cache_bytes=cache_bytes)(x1))
    assert on_device >= kernel_bytes > peaks[4096], (on_device, peaks)
