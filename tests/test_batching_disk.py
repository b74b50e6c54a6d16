"""``torchntk.batch`` writing into caller-given arrays (``out=``), resuming from a progress record
(``progress_file=``), keeping row shards (``distributed="shard"``) and counting kernel entries.

The model, the inputs and the batch workers are on the run device (``pytest --device``); ``out``
stays in host memory (NumPy arrays, memmaps, a CPU tensor), so on an accelerator these tests
exercise the device-to-host path. References are compared on the CPU."""

from __future__ import annotations

import json
import os
import textwrap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchntk
import torchntk.batching
from tests import cases
from tests._processes import run_python
from tests.cases import to_device
from torchntk.testing import assert_kernels_close, reference_nngp, reference_ntk

N1, N2 = 13, 8
# (trace_axes, diagonal_axes): the full kernel, traced logits, the batch axis diagonal or traced.
LAYOUTS = [((), ()), ((-1,), ()), ((), (0,)), ((0,), ())]
MODES = {"spans": (0, 2**30), "no-cache": (0, 0), "per-block": (None, 0)}  # vmap_axes, cache_bytes


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    return model.double().eval().to(cases.DEVICE)


def _inputs(n1: int = N1, n2: int = N2) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)  # on the CPU, then moved: the same numbers on every device
    return to_device((torch.randn(n1, 3, generator=generator, dtype=torch.float64),
                      torch.randn(n2, 3, generator=generator, dtype=torch.float64)))


class _Chunked:
    """A minimal array store (shape, dtype, slice assignment and nothing else), like a zarr array."""

    def __init__(self, shape, dtype):
        self._data = np.zeros(shape, dtype)
        self.shape, self.dtype = self._data.shape, self._data.dtype
        self.writes = 0

    def __setitem__(self, index, value):
        self.writes += 1
        self._data[index] = value

    def __getitem__(self, index):
        return self._data[index]

    def __array__(self, dtype=None, copy=None):
        return self._data


def _reference(layout, x1, x2):
    """The float64 reference kernel, on the CPU (where ``out`` is)."""
    trace_axes, diagonal_axes = layout
    return reference_ntk(_model(), x1, x2, trace_axes=trace_axes, diagonal_axes=diagonal_axes).cpu()


def _rotated(layouts: list, slow_marks: bool) -> list:
    """Every (layout, x2, mode): one mode per layout and x2 in the fast run, the others marked slow."""
    combinations = []
    for index, (layout, same) in enumerate((layout, same) for layout in layouts for same in (False, True)):
        for shift, mode in enumerate(MODES):
            marks = [pytest.mark.slow] if (shift != index % len(MODES)) and slow_marks else []
            combinations.append(pytest.param(layout, same, mode, marks=marks, id=f"{layout}-{same}-{mode}"))
    return combinations


@pytest.mark.parametrize("layout, same, mode", _rotated(LAYOUTS, True))
def test_out_receives_the_reference_kernel(tmp_path, mode, layout, same):
    x1, x2 = _inputs()
    if 0 in layout[0] + layout[1]:
        x2 = _inputs(N1, N1)[1]
    x2 = None if same else x2
    vmap_axes, cache_bytes = MODES[mode]
    ntk_fn = torchntk.empirical_ntk_fn(_model(), *layout, vmap_axes=vmap_axes)
    expected = _reference(layout, x1, x2)
    shape = tuple(expected.shape)
    outs = [np.zeros(shape), np.lib.format.open_memmap(tmp_path / "k.npy", "w+", np.float64, shape),
            _Chunked(shape, np.float64), torch.zeros(shape, dtype=torch.float64)]
    for out, workers in zip(outs, (1, 3, 2, 1)):
        devices = [cases.DEVICE] * workers
        batched = torchntk.batch(ntk_fn, 3, devices=devices, cache_bytes=cache_bytes)
        assert batched(x1, x2, out=out) is out
        assert_kernels_close(torch.as_tensor(np.asarray(out)), expected, rtol=1e-10, atol=1e-12)
    if layout[0] != (0,):  # block by block, not one whole kernel (a traced batch axis is summed first)
        assert outs[2].writes > 1


def test_a_pytree_of_outs_for_several_kernels():
    x1, x2 = _inputs()
    kernel_fn = torchntk.empirical_kernel_fn(_model(), trace_axes=(), vmap_axes=0)
    ntk = reference_ntk(_model(), x1, x2, trace_axes=()).cpu()
    nngp = reference_nngp(_model(), x1, x2, trace_axes=()).cpu()
    out = {"ntk": np.zeros(tuple(ntk.shape)), "nngp": np.zeros(tuple(nngp.shape))}
    assert torchntk.batch(kernel_fn, 4)(x1, x2, ("ntk", "nngp"), out=out) is out
    assert_kernels_close(torch.from_numpy(out["ntk"]), ntk, rtol=1e-10, atol=1e-12)
    assert_kernels_close(torch.from_numpy(out["nngp"]), nngp, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"`out` must match the result's structure.*2 leaf\(s\) at out\['ntk'\], "
                                         r"out\['nngp'\], `out` has 1 at the root"):
        torchntk.batch(kernel_fn, 4)(x1, x2, ("ntk", "nngp"), out=out["ntk"])


@pytest.mark.parametrize("vmap_axes", [0, None])
def test_out_of_the_wrong_shape_or_dtype_or_type_is_refused(vmap_axes):
    x1, x2 = _inputs()
    batched = torchntk.batch(torchntk.empirical_ntk_fn(_model(), vmap_axes=vmap_axes), 4)
    with pytest.raises(ValueError, match=r"`out` at the root must have the kernel's shape \(13, 8\) and dtype float64, "
                                         r"got shape \(8, 13\) and dtype float64"):
        batched(x1, x2, out=np.zeros((8, 13)))
    with pytest.raises(ValueError, match=r"dtype float64, got shape \(13, 8\) and dtype float32"):
        batched(x1, x2, out=np.zeros((13, 8), np.float32))
    with pytest.raises(ValueError, match=r"dtype torch.float64, got shape \(13, 8\) and dtype torch.float32"):
        batched(x1, x2, out=torch.zeros(13, 8))
    with pytest.raises(TypeError, match="every leaf of `out` must be an array .* got str at the root"):
        batched(x1, x2, out="kernel.npy")
    with pytest.raises(ValueError, match=r"the result has 1 leaf\(s\) at the root, `out` has 104 at out\[0\]\[0\], "
                                         r".*out\[0\]\[5\], \.\.\. \(98 more\)"):
        batched(x1, x2, out=[[0.0] * 8] * 13)


def test_an_empty_side_fills_out_with_the_empty_kernel():
    x1 = _inputs()[0]
    empty = to_device(torch.zeros(0, 3, dtype=torch.float64))
    out = np.zeros((N1, 0))
    assert torchntk.batch(torchntk.empirical_ntk_fn(_model(), vmap_axes=0), 4)(x1, empty, out=out) is out


# -- resuming -------------------------------------------------------------------------------------


def _open(path, shape, fresh: bool):
    return np.lib.format.open_memmap(path, "w+" if fresh else "r+", np.float64, shape)


def test_progress_file_records_blocks_and_a_finished_run_is_not_redone(tmp_path, monkeypatch):
    x1 = _inputs()[0]
    ntk_fn = torchntk.empirical_ntk_fn(_model(), trace_axes=(), vmap_axes=0)
    batched = torchntk.batch(ntk_fn, 3, cache_bytes=0)
    out = _open(tmp_path / "k.npy", (N1, N1, 4, 4), fresh=True)
    record = tmp_path / "k.progress.json"
    batched(x1, out=out, progress_file=record)
    saved = json.loads(record.read_text())
    assert len(saved["blocks"]) == 15  # 5 runs of x1: the pairs on and above the diagonal
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".progress-")]  # no temporary left
    assert_kernels_close(torch.from_numpy(np.array(out)), reference_ntk(_model(), x1, trace_axes=()).cpu(),
                         rtol=1e-10, atol=1e-12)
    contracted = []
    original = torchntk._kernel.block_source.BlockSource.contract
    monkeypatch.setattr(torchntk._kernel.block_source.BlockSource, "contract",
                        lambda self, a, b: contracted.append(1) or original(self, a, b))
    batched(x1, out=_open(tmp_path / "k.npy", (N1, N1, 4, 4), fresh=False), progress_file=record)
    assert len(contracted) == 1  # the probe that checks `out`; every block is recorded


def test_a_record_of_another_problem_or_a_recreated_out_is_refused(tmp_path):
    x1, x2 = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(_model(), vmap_axes=0)
    record = tmp_path / "k.json"
    torchntk.batch(ntk_fn, 3, cache_bytes=0)(x1, out=_open(tmp_path / "k.npy", (N1, N1), True), progress_file=record)
    with pytest.raises(ValueError, match=r"records another problem \(batch_size: recorded 3, now 4\)"):
        torchntk.batch(ntk_fn, 4)(x1, out=_open(tmp_path / "k.npy", (N1, N1), False), progress_file=record)
    with pytest.raises(ValueError, match=r"records another problem \(inputs: recorded '[0-9a-f]+', now '[0-9a-f]+'"):
        torchntk.batch(ntk_fn, 3)(x1 + 1, out=_open(tmp_path / "k.npy", (N1, N1), False), progress_file=record)
    changed = _model()
    with torch.no_grad():
        changed[0].bias.add_(1.0)
    with pytest.raises(ValueError, match=r"records another problem \(parameters: the model's parameters or buffers "
                                         r"differ"):
        torchntk.batch(torchntk.empirical_ntk_fn(changed, vmap_axes=0), 3)(
            x1, out=_open(tmp_path / "k.npy", (N1, N1), False), progress_file=record)
    with pytest.raises(ValueError, match=r"`out` does not hold the blocks .* mode='w\+'"):
        torchntk.batch(ntk_fn, 3)(x1, out=_open(tmp_path / "k.npy", (N1, N1), True), progress_file=record)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="exists but is not a progress record"):
        torchntk.batch(ntk_fn, 3)(x1, x2, out=np.zeros((N1, N2)), progress_file=tmp_path / "bad.json")


def test_progress_file_needs_out_and_a_kept_batch_axis(tmp_path):
    x1 = _inputs()[0]
    with pytest.raises(ValueError, match="`progress_file` .* needs `out`"):
        torchntk.batch(torchntk.empirical_ntk_fn(_model(), vmap_axes=0), 3)(x1, progress_file=tmp_path / "p")
    with pytest.raises(ValueError, match=r"`progress_file` needs a kernel with the batch axis kept or diagonal"):
        torchntk.batch(torchntk.empirical_ntk_fn(_model(), trace_axes=(0,), vmap_axes=0), 3)(
            x1, out=np.zeros((4, 4)), progress_file=tmp_path / "p")
    with pytest.raises(TypeError, match="`progress_file` must be a path"):
        torchntk.batch(torchntk.empirical_ntk_fn(_model(), vmap_axes=0), 3)(x1, out=np.zeros((N1, N1)), progress_file=3)


_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import torch, torchntk
    import torchntk.batching._disk as disk
    from tests.test_batching_disk import _batched, _open, _problem

    torch.set_num_threads(1)
    disk.RECORD_SECONDS = 0.0  # record every block
    folder, mode, kill_after = sys.argv[1], sys.argv[2], int(sys.argv[3])
    completed = []
    original = disk.ProgressRecord.completed

    def completed_then_die(self, *args):
        completed.append(1)
        if len(completed) == kill_after:  # this block is in `out` but not yet in the record
            os.kill(os.getpid(), signal.SIGKILL)
        original(self, *args)

    disk.ProgressRecord.completed = completed_then_die
    x1, x2, shape = _problem(mode)
    out = _open(os.path.join(folder, "k.npy"), shape, True)
    _batched(mode)(x1, x2, out=out, progress_file=os.path.join(folder, "k.json"))
    """
)


def _problem(mode: str):
    x1, x2 = _inputs()
    x2 = None if mode == "spans" else x2
    return x1, x2, (N1, N1 if x2 is None else N2, 4, 4)


def _batched(mode: str):
    vmap_axes = 0 if mode == "spans" else None
    # device_count=0: the inputs' device (the CPU), also on a machine with GPUs
    kernel_fn = torchntk.empirical_ntk_fn(_model(), trace_axes=(), vmap_axes=vmap_axes)
    return torchntk.batch(kernel_fn, 3, cache_bytes=0, device_count=0)


@pytest.mark.cpu_only("the killed child process computes on the CPU, and the resumed kernel must equal its bits")
@pytest.mark.parametrize("mode", ["spans", pytest.param("per-block", marks=pytest.mark.slow)])
def test_a_run_killed_midway_resumes_to_the_uninterrupted_kernel(tmp_path, monkeypatch, mode):
    """A process killed (SIGKILL) after 7 of 15 blocks (6 recorded, the 7th written but not
    recorded); the resumed run does the 9 others, and the kernel equals an uninterrupted run's bit
    for bit, and the float64 reference."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    killed = run_python(script, tmp_path, mode, 7, env=env, timeout=120)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert len(json.loads((tmp_path / "k.json").read_text())["blocks"]) == 6

    x1, x2, shape = _problem(mode)
    completed = []
    original = torchntk.batching._disk.ProgressRecord.completed
    monkeypatch.setattr(torchntk.batching._disk.ProgressRecord, "completed",
                        lambda self, *args: completed.append(1) or original(self, *args))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the child: the same BLAS blocking, so the same bits
    try:
        out = _open(tmp_path / "k.npy", shape, False)
        _batched(mode)(x1, x2, out=out, progress_file=tmp_path / "k.json")
        whole = _batched(mode)(x1, x2)
    finally:
        torch.set_num_threads(threads)
    assert len(completed) == 15 - 6
    resumed = np.load(tmp_path / "k.npy")
    assert np.array_equal(resumed, whole.numpy())
    expected = reference_ntk(_model(), x1, x2, trace_axes=())
    assert_kernels_close(torch.from_numpy(resumed), expected, rtol=1e-10, atol=1e-12)
    assert len(json.loads((tmp_path / "k.json").read_text())["blocks"]) == 15


# -- row shards -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout, same, mode", _rotated(LAYOUTS[:3], True))
def test_each_rank_keeps_its_rows(monkeypatch, mode, layout, same):
    """Ranks simulated in one process (``world`` patched): each shard equals its rows of the
    reference, and the shards cover the kernel; with `out`, every rank writes its rows only."""
    x1, x2 = _inputs()
    if layout[1]:
        x2 = _inputs(N1, N1)[1]
    x2 = None if same else x2
    vmap_axes, cache_bytes = MODES[mode]
    ntk_fn = torchntk.empirical_ntk_fn(_model(), *layout, vmap_axes=vmap_axes)
    expected = _reference(layout, x1, x2)
    barriers = []
    monkeypatch.setattr(torchntk.batching, "checkpoint", lambda timeout: barriers.append(timeout))
    for world_size in (1, 2, 3):
        stops = [0]
        shared = np.zeros(tuple(expected.shape))
        for rank in range(world_size):
            monkeypatch.setattr(torchntk.batching, "world", lambda rank=rank: (rank, world_size))
            batched = torchntk.batch(ntk_fn, 2, distributed="shard", cache_bytes=cache_bytes,
                                     devices=[cases.DEVICE] * 2)
            shard = batched(x1, x2)
            assert isinstance(shard, torchntk.distributed.KernelShard)
            assert (shard.start, shard.stop) == torchntk.distributed.shard_rows(N1, 2, rank, world_size)
            assert shard.start == stops[-1]
            stops.append(shard.stop)
            assert_kernels_close(shard.kernel.cpu(), expected[shard.start:shard.stop], rtol=1e-10, atol=1e-12)
            before = shared.copy()
            assert batched(x1, x2, out=shared).kernel is shared
            outside = np.ones(shared.shape[0], bool)
            outside[shard.start:shard.stop] = False
            assert np.array_equal(shared[outside], before[outside])
        assert stops[-1] == N1
        assert_kernels_close(torch.from_numpy(shared), expected, rtol=1e-10, atol=1e-12)
    assert len(barriers) == 2 * (2 + 3)  # one per call with several ranks


def test_shards_refuse_a_traced_batch_axis_and_auto_refuses_out(monkeypatch):
    x1 = _inputs()[0]
    with pytest.raises(ValueError, match="distributed='shard' keeps rows of the kernel, but the batch axis is traced"):
        torchntk.batch(torchntk.empirical_ntk_fn(_model(), trace_axes=(0,), vmap_axes=0), 3, distributed="shard")(x1)
    monkeypatch.setattr(torchntk.batching, "world", lambda: (0, 2))
    with pytest.raises(ValueError, match=r"`out` under torch.distributed \(rank 0 of 2\) needs distributed='shard'"):
        torchntk.batch(torchntk.empirical_ntk_fn(_model(), vmap_axes=0), 3)(x1, out=np.zeros((N1, N1)))
    with pytest.raises(ValueError, match="`distributed` must be 'auto', 'shard' or 'off', got 'rows'"):
        torchntk.batch(torchntk.empirical_ntk_fn(_model()), 3, distributed="rows")


def test_shard_rows_are_whole_blocks_and_checked():
    assert [torchntk.distributed.shard_rows(10, 3, rank, 3) for rank in range(3)] == [(0, 6), (6, 9), (9, 10)]
    # 15 units over 6 ranks: 3 ranks of 3 and 3 of 2 (ceil(15 / 6) = 3 each left the last rank none).
    assert [torchntk.distributed.shard_rows(15, 1, rank, 6) for rank in range(6)] == [
        (0, 3), (3, 6), (6, 9), (9, 11), (11, 13), (13, 15)]
    assert [torchntk.distributed.shard_rows(30, 2, rank, 6) for rank in range(6)] == [
        (0, 6), (6, 12), (12, 18), (18, 22), (22, 26), (26, 30)]
    assert [torchntk.distributed.shard_rows(7, 0, rank, 2) for rank in range(2)] == [(0, 4), (4, 7)]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        torchntk.distributed.shard_rows(7, 0, 2, 2)
    with pytest.raises(ValueError, match="n1 must be a non-negative int, got -1"):
        torchntk.distributed.shard_rows(-1, 0, 0, 2)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 60), st.integers(0, 7), st.integers(1, 9))
def test_shard_rows_split_the_blocks_as_evenly_as_possible(n1, batch_size, world_size):
    """The shards cover ``range(n1)`` contiguously in rank order, start on block boundaries, and
    their numbers of blocks differ by at most one."""
    unit = batch_size or 1
    shards = [torchntk.distributed.shard_rows(n1, batch_size, rank, world_size) for rank in range(world_size)]
    assert shards[0][0] == 0 and shards[-1][1] == n1
    assert all(stop == start for (_, stop), (start, _) in zip(shards, shards[1:]))
    assert all(start <= stop and (start % unit == 0 or start == n1) for start, stop in shards)
    blocks = [-(-(stop - start) // unit) for start, stop in shards]
    assert max(blocks) - min(blocks) <= 1
    assert blocks == sorted(blocks, reverse=True)  # the extra blocks go to the first ranks


# -- progress -------------------------------------------------------------------------------------


def test_progress_counts_kernel_entries(capsys):
    x1, x2 = _inputs()
    for vmap_axes in (0, None):
        torchntk.batch(torchntk.empirical_ntk_fn(_model(), vmap_axes=vmap_axes), 3, progress=True)(x1, x2)
        error = capsys.readouterr().err
        assert f"{N1 * N2}/{N1 * N2}" in error and "entries/s" in error


def test_blocks_reach_the_host_synchronously_and_accelerators_asynchronously():
    """A non-blocking copy to the CPU returns before its data arrives, and blocks are placed by CPU
    copies right after: such copies must block (accelerator to accelerator, the stream orders them)."""
    from torchntk.batching._output import moved

    class Block:
        def __init__(self, device):
            self.device = torch.device(device)
            self.calls = []

        def to(self, device, non_blocking):
            self.calls.append((str(device), non_blocking))
            return self

    for source, target, asynchronous in [("cuda:0", "cpu", False), ("cuda:0", "cuda:1", True), ("cpu", "cuda:0", False),
                                         ("cpu", "cpu", False)]:
        block = Block(source)
        moved(block, torch.device(target))
        assert block.calls == [(target, asynchronous)]


_FORMAT_1 = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "progress_record_format_1")


@pytest.mark.cpu_only("a record of a CPU run, shipped with the tests")
def test_a_record_written_by_an_earlier_version_is_refused(tmp_path, monkeypatch):
    """``tests/data/progress_record_format_1``: a run of the problem below (``batch(ntk_fn, 2,
    cache_bytes=0)(x, out=<6 x 6 memmap>, progress_file=...)``) written by an earlier version, its
    record then cut to its first 3 of 6 blocks, as a killed run leaves it. Format 1 did not record
    ``output_fn``, ``groups``, the module's attributes or hooks, so it cannot tell this problem
    from another: it is refused, saying why, before anything is computed, and ``out`` is kept."""
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    with torch.no_grad():
        for index, parameter in enumerate(model.parameters()):
            values = torch.linspace(-1, 1, parameter.numel(), dtype=torch.float64)
            parameter.copy_(values.reshape(parameter.shape) * (index + 1) / 3)
    x = torch.linspace(-2, 2, 18, dtype=torch.float64).reshape(6, 3)
    for name in ("kernel.npy", "progress.json"):
        (tmp_path / name).write_bytes(open(os.path.join(_FORMAT_1, name), "rb").read())
    assert len(json.loads((tmp_path / "progress.json").read_text())["blocks"]) == 3
    _refuse_computing(monkeypatch)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
    out = np.lib.format.open_memmap(tmp_path / "kernel.npy", mode="r+")
    before = np.array(out)
    message = (r"`progress_file` .* was written by an older version of torchntk \(record format 1, now 2\), whose "
               r"records left out output_fn, groups, .* Delete it and compute the kernel afresh")
    with pytest.raises(ValueError, match=message):
        torchntk.batch(ntk_fn, 2, cache_bytes=0)(x, out=out, progress_file=tmp_path / "progress.json")
    assert np.array_equal(np.array(out), before)


def _refuse_computing(monkeypatch) -> None:
    """Makes any kernel computation of ``batch`` fail the test."""
    for name in ("_by_spans", "_by_blocks"):
        monkeypatch.setattr(torchntk.batching, name, lambda *args, name=name: pytest.fail(f"batch computed ({name})"))


# -- refusing another problem's record ------------------------------------------------------------


class _Scaled(torch.nn.Module):
    """The test MLP times a plain attribute its forward pass reads."""

    def __init__(self):
        super().__init__()
        self.net = _model()
        self.scale = 1.0

    def forward(self, x):
        return self.net(x) * self.scale


class _Selected(torch.nn.Module):
    """``output_fn(model(x))`` as a module, for the reference kernel."""

    def __init__(self, model, output_fn):
        super().__init__()
        self.model, self.output_fn = model, output_fn

    def forward(self, x):
        return self.output_fn(self.model(x))


def _doubled(module, inputs, output):
    return output * 2.0


def _squashed(output):
    return torch.tanh(output)


def _change(what: str, model: _Scaled) -> tuple[dict, str, torch.Tensor]:
    """Changes ``what`` of the problem: the builder keywords, the refusal expected, the new kernel's
    float64 reference (for the inputs of ``_inputs()``)."""
    x1 = _inputs()[0]
    if what == "groups":
        second = {name: p for name, p in model.named_parameters() if name.startswith("net.2.")}
        return ({"groups": {"g": "net.2.*"}}, r"groups: recorded \"\{'g': \[net\.0\.\*\]\}\", now "
                r"\"\{'g': \[net\.2\.\*\]\}\"", {"g": reference_ntk(model, x1, params=second)})
    if what == "output_fn":
        return ({"output_fn": _squashed}, r"output_fn: recorded 'None', now 'tests\.test_batching_disk\._squashed#",
                reference_ntk(_Selected(model, _squashed), x1))
    if what == "attribute":
        model.scale = 3.0
        message = r"model: attribute `scale` of the model \(_Scaled\): recorded '1\.0', now '3\.0'"
        return {}, message, reference_ntk(model, x1)
    model.net[2].register_forward_hook(_doubled)
    return ({}, r"model: forward hooks of the model's submodule 'net\.2' \(Linear\): recorded none, now "
                r"'\[\"tests\.test_batching_disk\._doubled#", reference_ntk(model, x1))


@pytest.mark.parametrize("what", ["groups", "output_fn", "attribute", "hook"])
def test_a_record_of_another_output_fn_groups_attribute_or_hook_is_refused(tmp_path, monkeypatch, what):
    """A run differing from the recorded one only in ``groups``, ``output_fn``, a plain attribute
    the forward pass reads or a forward hook is refused before anything is computed, naming what
    differs; the recorded problem still resumes, and the other one computed afresh is its own kernel."""
    x1 = _inputs()[0]
    model = _Scaled()
    first = {"groups": {"g": "net.0.*"}} if what == "groups" else {}

    def run(path, keywords, fresh):
        out = _open(tmp_path / f"{path}.npy", (N1, N1), fresh)
        out_tree = {"g": out} if what == "groups" else out
        ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, **keywords)
        torchntk.batch(ntk_fn, 3, cache_bytes=0)(x1, out=out_tree, progress_file=tmp_path / f"{path}.json")
        return out

    run("k", first, fresh=True)
    recorded = np.array(np.load(tmp_path / "k.npy"))
    second, message, expected = _change(what, model)
    with monkeypatch.context() as patched:
        _refuse_computing(patched)
        with pytest.raises(ValueError, match=rf"records another problem \({message}"):
            run("k", second, fresh=False)
    assert np.array_equal(np.load(tmp_path / "k.npy"), recorded)
    changed = run("other", second, fresh=True)
    assert_kernels_close({"g": torch.from_numpy(np.array(changed))} if what == "groups" else
                         torch.from_numpy(np.array(changed)), expected, rtol=1e-10, atol=1e-12)
    assert not np.allclose(np.array(changed), recorded, rtol=0.05)  # the old kernel would have been wrong
    if what == "attribute":
        model.scale = 1.0
    elif what == "hook":
        model.net[2]._forward_hooks.clear()
    completed = []
    original = torchntk.batching._disk.ProgressRecord.completed
    monkeypatch.setattr(torchntk.batching._disk.ProgressRecord, "completed",
                        lambda self, *args: completed.append(1) or original(self, *args))
    assert np.array_equal(run("k", first, fresh=False), recorded)
    assert not completed  # every block is recorded: none is redone


def _closure(factor: float):
    def scaled(output):
        return output * factor

    return scaled


SCALE = 2.0


def _reads_a_global(output):
    return output * SCALE


def _with_keywords(module, args, kwargs, output):
    return output


def _described_problem(factor: float = 2.0) -> dict:
    """The fingerprint of a problem with a closure ``output_fn``, a hook, an attribute, a predicate
    in ``groups`` and a ``params`` argument (run in a child process too)."""
    model = _Scaled().cpu()
    model.net[0].register_forward_pre_hook(lambda module, args: (args[0] * 0.5,))
    model.net[2].register_forward_hook(_doubled)
    model.register_forward_hook(_with_keywords, with_kwargs=True, always_call=True)
    groups = {"first": model.net[0], "biases": lambda name, parameter: name.endswith("bias"), "rest": "*"}
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, output_fn=_closure(factor), groups=groups)
    x = torch.linspace(-1, 1, 12, dtype=torch.float64).reshape(4, 3)
    params = {"net.2.weight": torch.ones(4, 8, dtype=torch.float64)}
    return torchntk.batching._disk.fingerprint(ntk_fn.spec, (x, None, (params,), {}), 3, None)


@pytest.mark.cpu_only("a child process describes the same problem on the CPU")
def test_a_problem_is_described_alike_in_a_fresh_process(tmp_path):
    """Functions (closures, lambdas, hooks, predicates) are described by what they compute, not by
    their address: a fresh process (another string hash seed) describes the same problem alike,
    and another closure value, another global read or another ``params`` differs."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "child.py"
    script.write_text("import json\nfrom tests.test_batching_disk import _described_problem\n"
                      "print(json.dumps(_described_problem()))\n")
    child = run_python(script, env={"PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
                                    "PYTHONHASHSEED": "12345"}, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    here = json.loads(json.dumps(_described_problem()))
    assert json.loads(child.stdout) == here
    assert here["options"]["output_fn"].startswith("tests.test_batching_disk._closure.<locals>.scaled#")
    assert _described_problem(3.0)["options"]["output_fn"] != here["options"]["output_fn"]
    describe = torchntk.batching._describe.describe
    before = describe(_reads_a_global)
    global SCALE
    SCALE = 3.0
    try:
        assert describe(_reads_a_global) != before
    finally:
        SCALE = 2.0
    ntk_fn = torchntk.empirical_ntk_fn(_model(), vmap_axes=0)
    x = _inputs()[0]
    fingerprints = [json.dumps(torchntk.batching._disk.fingerprint(ntk_fn.spec, (x, None, (params,), {}), 3, None))
                    for params in (None, {"0.weight": torch.ones(8, 3)}, {"2.weight": torch.ones(8, 3)})]
    assert len(set(fingerprints)) == 3  # the params argument counts, names included
