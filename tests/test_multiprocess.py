"""Monte Carlo kernels and batched kernels shared across gloo processes equal one process's.

Spawned with ``torch.multiprocessing`` on this machine (marked slow: run by the second step of
``.ci/run``). Each rank writes its result to a file that the parent compares.
"""

from __future__ import annotations

import os
import pathlib
import time

import pytest
import torch
import torch.distributed as dist

import torchntk
from tests._processes import SpawnFailed, run_python, spawn

pytestmark = [pytest.mark.slow, pytest.mark.cpu_only("gloo process groups of CPU processes")]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).double().eval()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randn(7, 3, generator=generator, dtype=torch.float64),
            torch.randn(5, 3, generator=generator, dtype=torch.float64))


def _compute(kind: str):
    x1, x2 = _inputs()
    if kind.startswith("mc-"):
        strategy = kind[3:]
        mc = torchntk.monte_carlo_kernel_fn(_model(), [1, 3, 6], seed=3, batch_size=3, distributed=strategy, timeout=60)
        return [tuple(estimate) for estimate in mc(x1, x2, ("nngp", "ntk"))]
    vmap_axes = None if kind == "batch-per-block" else 0  # prepared spans, or a kernel call per block
    batched = torchntk.batch(torchntk.empirical_ntk_fn(_model(), trace_axes=(), vmap_axes=vmap_axes), 2, timeout=60)
    return [batched(x1, x2), batched(x1, None)]


def _shard_kernels(out_dir: str):
    """Row shards (distributed='shard') of a full NTK with x2 and of a symmetric traced one, the
    latter also written into one memmap file that every rank shares."""
    import numpy as np

    x1, x2 = _inputs()
    full_fn = torchntk.empirical_ntk_fn(_model(), trace_axes=(), vmap_axes=0)  # prepared spans
    full = torchntk.batch(full_fn, 2, distributed="shard", timeout=60)
    traced_fn = torchntk.empirical_ntk_fn(_model(), vmap_axes=None)  # a kernel function call per block
    traced = torchntk.batch(traced_fn, 2, distributed="shard", timeout=60)
    shared = np.lib.format.open_memmap(os.path.join(out_dir, "shared.npy"), "r+", np.float64, (7, 7))
    return [tuple(full(x1, x2)), tuple(traced(x1)), traced(x1, out=shared)[1:]]


def _rank_main(rank: int, world_size: int, rendezvous: str, kind: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    try:
        if kind.startswith("raises"):
            x1, x2 = _inputs()
            if rank == 1:  # a bad input on one rank only: the error happens inside the computation
                x1 = torch.randn(7, 4, dtype=torch.float64)
            try:
                if kind == "raises-mc":
                    torchntk.monte_carlo_kernel_fn(_model(), 4, batch_size=3, timeout=60)(x1, x2, "ntk")
                else:
                    torchntk.batch(torchntk.empirical_ntk_fn(_model(), vmap_axes=0), 2, timeout=60)(x1, x2)
            except Exception as error:  # record what each rank saw, then fail as usual
                torch.save(type(error).__name__, os.path.join(out_dir, f"rank{rank}.pt"))
                raise
            return
        result = _shard_kernels(out_dir) if kind == "batch-shard" else _compute(kind)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        torchntk.distributed.finalize(timeout=60)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(tmp_path, world_size: int, kind: str) -> list:
    """Runs every rank to its end (a failing rank does not kill the others), then loads their files."""
    spawn(_rank_main, world_size, (world_size, str(tmp_path / "rendezvous"), kind, str(tmp_path)),
          grace=30.0, deadline=120.0)
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world_size)]


def _assert_equal(got, want) -> None:
    flat_got, flat_want = torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)
    assert len(flat_got) == len(flat_want)
    for a, b in zip(flat_got, flat_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("kind", ["mc-samples", "mc-blocks", "batch", "batch-per-block"])
def test_processes_equal_one_process(tmp_path, world_size, kind):
    """Equal up to rounding: sums run in another order, and batch sizes its spans by the workers."""
    expected = _compute(kind)
    for result in _spawn(tmp_path, world_size, kind):
        _assert_equal(result, expected)


def test_row_shards_of_two_ranks_equal_one_process_rows(tmp_path):
    """Each rank keeps only its rows (no all-reduce of the kernel): they equal the single-process
    kernel's rows, cover it, and both ranks' rows land in one shared memmap."""
    import numpy as np

    np.lib.format.open_memmap(tmp_path / "shared.npy", "w+", np.float64, (7, 7))
    x1, x2 = _inputs()
    full = torchntk.empirical_ntk_fn(_model(), trace_axes=(), vmap_axes=0)(x1, x2)
    traced = torchntk.empirical_ntk_fn(_model())(x1)
    results = _spawn(tmp_path, 2, "batch-shard")
    for (full_shard, traced_shard, shared_rows), rows in zip(results, [(0, 4), (4, 7)]):
        assert full_shard[1:] == traced_shard[1:] == shared_rows == rows
        torch.testing.assert_close(full_shard[0], full[rows[0]:rows[1]], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(traced_shard[0], traced[rows[0]:rows[1]], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.from_numpy(np.load(tmp_path / "shared.npy")), traced, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["raises-mc", "raises-batch"])
def test_a_rank_that_raises_makes_the_others_fail_promptly(tmp_path, kind):
    """Rank 1's error reaches rank 0 at its next collective, long before the 60 s timeout."""
    start = time.monotonic()
    # Whichever rank the parent sees fail first, its message has rank 1's error (rank 0's
    # RankFailedError quotes it).
    with pytest.raises(SpawnFailed, match="mat1 and mat2 shapes cannot be multiplied"):
        _spawn(tmp_path, 2, kind)
    assert time.monotonic() - start < 45
    # torchntk's explanation of the model's failure on x1 (a ValueError that is still PyTorch's
    # RuntimeError), raised by rank 1 itself
    assert torch.load(tmp_path / "rank1.pt") == "ModelInputError"
    assert torch.load(tmp_path / "rank0.pt") == "RankFailedError"


def test_the_torchrun_example_runs():
    script = pathlib.Path(__file__).resolve().parents[1] / "examples" / "distributed_monte_carlo.py"
    result = run_python("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script,
                        timeout=300, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "ntk" in result.stdout.lower()
