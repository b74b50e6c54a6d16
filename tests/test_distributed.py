"""torchntk.distributed on real gloo process groups (2 and 4 processes from ``mp.spawn``).

Each child joins through ``file://<tmp_path>/rendezvous`` (no ports), uses one thread, and
sends its results to the parent with ``torch.save`` into ``tmp_path``. The parent joins the
children with a grace period, so that when one child fails the others still get to record
how they failed before they are terminated.
"""

from __future__ import annotations

import collections
import os
import pickle
import re
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests._processes import SpawnFailed, spawn
from torchntk import distributed

pytestmark = [pytest.mark.slow, pytest.mark.cpu_only("gloo process groups of CPU processes")]

Kernel = collections.namedtuple("Kernel", ["nngp", "ntk"])

CHECKPOINTS = (1, 4, 7)  # generator mode: with 4 ranks, ranks 1-3 own no sample in (0, 1]
N_INDICES = 23           # indices checked for the ownership partition
BLOCK, N_ROWS, N_COLS, N_BLOCK_SAMPLES = 2, 6, 4, 5
SHORT_TIMEOUT = 5.0      # failure tests: a failed rank must be noticed well before this
HANG_TIMEOUT = 2.0       # hang test: the others must give up after about this long


# --- children -----------------------------------------------------------------------


def _init(rank: int, world_size: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))


def _save(tmp: str, rank: int, **result) -> None:
    torch.save(result, os.path.join(tmp, f"rank{rank}.pt"))


def _sample_kernel(s: int):
    """A stand-in for one MC sample's kernel: a pytree that depends on ``s`` only."""
    g = torch.Generator().manual_seed(1000 + s)
    return {
        "kernel": Kernel(nngp=torch.randn(4, 3, generator=g),
                         ntk=torch.randn(3, 4, generator=g, dtype=torch.float64).t()),
        "extra": (torch.randn(2, dtype=torch.complex64, generator=g),
                  torch.randint(0, 100, (5,), generator=g)),
        "tag": "not a tensor",
    }


def _zeros_like(tree):
    return torch.utils._pytree.tree_map(
        lambda x: torch.zeros_like(x) if isinstance(x, torch.Tensor) else x, tree)


def _add(a, b):
    return torch.utils._pytree.tree_map(
        lambda x, y: x + y if isinstance(x, torch.Tensor) else x, a, b)


def _strategy_a(owned, reduce):
    """Running sums at each checkpoint, as a sample loop with ``owned``/``reduce`` hooks."""
    total, previous, estimates = _zeros_like(_sample_kernel(0)), 0, []
    for n in CHECKPOINTS:
        for s in range(previous, n):
            if owned(s):
                total = _add(total, _sample_kernel(s))
        estimates.append(reduce(total))
        previous = n
    return estimates


def _block_value(s: int, i: int, j: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10_000 * s + 100 * i + j)
    return torch.randn(BLOCK, BLOCK, generator=g)


def _strategy_b(owned, reduce):
    """Each owned block sums all samples in order; the full buffer is then reduced."""
    out = torch.zeros(N_ROWS, N_COLS)
    n_col_blocks = N_COLS // BLOCK
    for i in range(N_ROWS // BLOCK):
        for j in range(n_col_blocks):
            if owned(i * n_col_blocks + j):
                block = torch.zeros(BLOCK, BLOCK)
                for s in range(N_BLOCK_SAMPLES):
                    block = block + _block_value(s, i, j)
                out[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = block
    return reduce(out)


def _sum_worker(rank: int, world_size: int, tmp: str) -> None:
    _init(rank, world_size, tmp)
    me, size = distributed.world()
    samples = distributed.owned_samples(me, size)
    blocks = distributed.owned_blocks(me, size)

    def reduce(tree):
        return distributed.all_reduce_sum(tree, timeout=60)

    with distributed.failure_guard(timeout=60):
        estimates = _strategy_a(samples, reduce)
        gathered = _strategy_b(blocks, reduce)
    # Mismatches are caught by the status table, before any data moves, on every rank; the
    # group stays usable afterwards.
    mismatches = []
    for mismatch in ("shape", "kind"):
        try:
            if mismatch == "shape":
                distributed.all_reduce_sum(torch.ones(3 + (rank == 1)), timeout=60)
            elif rank == 1:
                distributed.checkpoint(timeout=60)
            else:
                distributed.all_reduce_sum(torch.ones(3), timeout=60)
        except distributed.DistributedError as exc:
            mismatches.append(str(exc))
    distributed.finalize(timeout=60)
    _save(tmp, rank, world=(me, size), finalized=not dist.is_initialized(),
          samples=[s for s in range(N_INDICES) if samples(s)],
          blocks=[k for k in range(N_INDICES) if blocks(k)],
          estimates=estimates, gathered=gathered, mismatches=mismatches)


def _wait_until_all_set_up(tmp: str, rank: int, world_size: int) -> None:
    """Returns once every rank's ``setup`` has returned, through a file store (no sockets).

    ``setup`` makes the checkpoint group, whose gloo mesh a peer may still be connecting when
    this rank's side is done: a rank that exited at once would fail that peer inside ``setup``,
    before the failure under test.
    """
    store = dist.FileStore(f"{tmp}/set_up", world_size)
    store.set(f"rank{rank}", "done")
    store.wait([f"rank{r}" for r in range(world_size)], timedelta(seconds=60))


def _failing_worker(rank: int, world_size: int, tmp: str, failing: int, mode: str,
                    eager: bool) -> None:
    """``mode``: 'raise' (inside failure_guard), 'exit' (die outside it), 'hang' (sleep).

    ``eager``: start with ``distributed.setup``, which makes the checkpoint group at once;
    otherwise with ``dist.init_process_group``, so the first checkpoint makes it.
    """
    timeout = HANG_TIMEOUT if mode == "hang" else SHORT_TIMEOUT
    if eager:
        torch.set_num_threads(1)
        device = distributed.setup("gloo", timeout=timeout, init_method=f"file://{tmp}/rendezvous",
                                   rank=rank, world_size=world_size,
                                   process_group_timeout=timedelta(seconds=60))
        assert device == torch.device("cpu")
        _wait_until_all_set_up(tmp, rank, world_size)
    else:
        _init(rank, world_size, tmp)
    start = time.monotonic()
    try:
        with distributed.failure_guard(timeout=timeout):
            if rank == failing and mode == "raise":
                raise ValueError("boom on purpose")
            if rank == failing and mode == "exit":
                os._exit(3)  # dies without a word, as a segfault or OOM kill would
            if rank == failing and mode == "hang":
                # For the parent, which times the job from here: time.monotonic is one clock
                # for every process of the machine (Linux's CLOCK_MONOTONIC).
                _save(tmp, rank, asleep_since=time.monotonic())
                time.sleep(10 * HANG_TIMEOUT)
            distributed.all_reduce_sum(torch.ones(3), timeout=timeout)
    except Exception as exc:
        _save(tmp, rank, error=type(exc).__name__, message=str(exc),
              elapsed=time.monotonic() - start,
              failed_ranks=getattr(exc, "failed_ranks", None))
        raise
    _save(tmp, rank, error=None, elapsed=time.monotonic() - start)


# --- parent -------------------------------------------------------------------------


def _spawn(worker, world_size: int, tmp_path, *args, grace: float = 10.0) -> float:
    """Runs ``worker(rank, world_size, tmp, *args)`` in ``world_size`` processes (see
    :func:`tests._processes.spawn`); returns the wall time."""
    return spawn(worker, world_size, (world_size, str(tmp_path), *args), grace=grace, deadline=60.0)


def _results(tmp_path, world_size: int) -> list:
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _assert_tree_close(actual, expected, exact: bool = False) -> None:
    actual_leaves, actual_spec = torch.utils._pytree.tree_flatten(actual)
    expected_leaves, expected_spec = torch.utils._pytree.tree_flatten(expected)
    assert actual_spec == expected_spec
    for a, e in zip(actual_leaves, expected_leaves):
        if not isinstance(e, torch.Tensor):
            assert a == e
        elif exact or not (e.is_floating_point() or e.is_complex()):
            assert a.dtype == e.dtype and torch.equal(a, e)
        else:
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6)


def test_ownership_partitions_indices():
    for world_size in range(1, 6):
        for make in (distributed.owned_samples, distributed.owned_blocks):
            owners = [make(rank, world_size) for rank in range(world_size)]
            for index in range(50):
                assert [rank for rank in range(world_size) if owners[rank](index)] == [
                    index % world_size]
    with pytest.raises(ValueError, match="rank"):
        distributed.owned_samples(2, 2)
    with pytest.raises(ValueError, match="world_size"):
        distributed.owned_blocks(0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        distributed.owned_samples(0, 2)(-1)
    with pytest.raises(TypeError, match="sample index must be an int, got 1.0"):
        distributed.owned_samples(0, 2)(1.0)
    assert distributed.owned_samples(1, 2)(torch.tensor(3))


def test_single_process_is_a_no_op():
    tree = {"a": torch.ones(2), "b": (torch.zeros(1, dtype=torch.int64), None)}
    assert distributed.world() == (0, 1)
    assert distributed.all_reduce_sum(tree, timeout=1) is tree
    distributed.checkpoint(timeout=1)
    distributed.finalize(timeout=1)
    with distributed.failure_guard(timeout=1), pytest.raises(KeyError, match="passes through"):
        raise KeyError("passes through")
    with pytest.raises(TypeError, match="bool"):
        distributed.all_reduce_sum(torch.ones(2, dtype=torch.bool))
    with pytest.raises(ValueError, match="timeout"):
        distributed.all_reduce_sum(tree, timeout=0)


def test_timeouts_are_checked_before_any_communication():
    """Seconds or a timedelta; not a number: TypeError; not positive or not finite: ValueError."""
    for timeout in (2, 2.5, timedelta(seconds=2)):
        distributed.checkpoint(timeout=timeout)
    for timeout in (True, "60", None):
        with pytest.raises(TypeError, match="torchntk.distributed.checkpoint: `timeout` must be seconds"):
            distributed.checkpoint(timeout=timeout)
    for timeout in (0, -1, float("nan"), timedelta(0)):
        with pytest.raises(ValueError, match="all_reduce_sum: `timeout` must be a positive number of seconds"):
            distributed.all_reduce_sum(torch.ones(1), timeout=timeout)
    with pytest.raises(ValueError, match="setup: `timeout` must be a finite number of seconds"):
        distributed.setup(timeout=float("inf"))
    assert not dist.is_initialized()


def test_the_errors_keep_their_public_home():
    """Defined in a private module, shown in tracebacks (and pickled) as torchntk.distributed's."""
    for error in (distributed.DistributedError, distributed.RankFailedError):
        assert error.__module__ == "torchntk.distributed"
        assert getattr(distributed, error.__name__) is error
        assert pickle.loads(pickle.dumps(error)) is error


def test_a_reported_message_keeps_its_start_and_its_end():
    """torchntk's errors quote PyTorch's at their end: a message cut to fit keeps both ends."""
    from torchntk.distributed._checkpoint_protocol import _MESSAGE_BYTES, _clip

    short = b"ValueError: x1 is wrong"
    assert _clip(short) == short
    long = b"ModelInputError: " + b"explanation " * 1000 + b"PyTorch said: mat1 and mat2 shapes"
    clipped = _clip(long)
    assert len(clipped) == _MESSAGE_BYTES
    assert clipped.startswith(b"ModelInputError: explanation") and clipped.endswith(b"mat1 and mat2 shapes")
    assert b" [...] " in clipped


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_reduce_sum_and_strategies_match_one_process(tmp_path, world_size):
    elapsed = _spawn(_sum_worker, world_size, tmp_path)
    results = _results(tmp_path, world_size)

    expected_a = _strategy_a(lambda s: True, lambda tree: tree)
    expected_b = _strategy_b(lambda k: True, lambda tree: tree)
    for rank, result in enumerate(results):
        assert result["world"] == (rank, world_size)
        assert result["finalized"]
        for actual, expected in zip(result["estimates"], expected_a, strict=True):
            _assert_tree_close(actual, expected)
        # Strategy B: disjoint blocks summed with zeros are a gather, bitwise exact.
        _assert_tree_close(result["gathered"], expected_b, exact=True)
        # Every rank ends with the same bits, so they all return the same kernel.
        _assert_tree_close(result["estimates"], results[0]["estimates"], exact=True)

        shape, kind = result["mismatches"]
        assert "pytrees with different structures, dtypes, shapes" in shape
        assert "all_reduce_sum (checkpoint 5)" in shape  # 3 (strategy A) + 1 (B) before it
        assert "different checkpoints (checkpoint kinds by rank: ['all_reduce_sum', " \
            "'checkpoint'" in kind

    for key in ("samples", "blocks"):
        owners = sorted(index for result in results for index in result[key])
        assert owners == list(range(N_INDICES)), key  # each index owned exactly once
    print(f"world {world_size}: {elapsed:.1f} s")


# How the monitored barrier reports a rank that died: it timed out waiting for it, or (NOTE:
# [Timeouts] in torchntk/distributed/__init__.py) gloo saw the connection close first, depending on whether
# the death is noticed before this rank waits for it.
_DIED = r"Ranks {} failed to pass monitoredBarrier|Connection closed by peer"


@pytest.mark.parametrize("world_size, failing, mode, eager", [
    (2, 1, "raise", False),
    (4, 0, "raise", True),
    (2, 1, "exit", True),
])
def test_failed_rank_stops_the_others_promptly(tmp_path, world_size, failing, mode, eager):
    # The parent reports whichever child it saw fail first: with "raise", the failing rank's
    # ValueError or another rank's RankFailedError, which quotes it; with "exit", the exit of the
    # failing rank or another rank's DistributedError, which names it or the closed connection.
    first_failure = {
        "raise": "boom on purpose",
        "exit": rf"process {failing} terminated with exit code 3|DistributedError: [\s\S]*({_DIED.format(failing)})",
    }[mode]
    with pytest.raises(SpawnFailed, match=first_failure):
        _spawn(_failing_worker, world_size, tmp_path, failing, mode, eager)

    for rank in range(world_size):
        if rank == failing and mode == "exit":
            assert not (tmp_path / f"rank{rank}.pt").exists()
            continue
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["elapsed"] < SHORT_TIMEOUT / 2, result  # did not wait for the timeout
        message = result["message"]
        if rank == failing:
            assert (result["error"], message) == ("ValueError", "boom on purpose")
            continue
        assert "all_reduce_sum (checkpoint 1)" in message
        assert f"on rank {rank} of world size {world_size}" in message
        assert f"timeout {SHORT_TIMEOUT:g} s" in message
        if mode == "raise":
            assert result["error"] == "RankFailedError"
            assert result["failed_ranks"] == (failing,)
            assert f"rank {failing} failed and reported it" in message
            assert "ValueError: boom on purpose" in message
        else:
            assert result["error"] == "DistributedError"
            assert re.search(_DIED.format(failing), message), message


@pytest.mark.parametrize("world_size, hanging, eager", [(2, 0, True), (4, 3, True),
                                                        (2, 1, False)])
def test_hanging_rank_times_out_the_others(tmp_path, world_size, hanging, eager):
    # The parent sees a waiting rank give up first: the hanging one raises nothing.
    with pytest.raises(SpawnFailed, match=r"DistributedError: "):
        _spawn(_failing_worker, world_size, tmp_path, hanging, "hang", eager, grace=2.0)
    ended = time.monotonic()
    # The hanging rank sleeps 10 timeouts; the job ends long before it wakes. Timed from when it
    # fell asleep: starting the processes (each imports torch, seconds per process on a 2-core
    # machine, more for a CUDA build) is no part of what is measured.
    asleep_since = torch.load(tmp_path / f"rank{hanging}.pt", weights_only=False)["asleep_since"]
    assert ended - asleep_since < 10 * HANG_TIMEOUT

    for rank in range(world_size):
        if rank == hanging:
            continue  # terminated by the parent while asleep
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["error"] == "DistributedError"
        assert HANG_TIMEOUT * 0.9 < result["elapsed"] < HANG_TIMEOUT + 4, result
        message = result["message"]
        assert f"on rank {rank} of world size {world_size}" in message
        assert f"timeout {HANG_TIMEOUT:g} s" in message
        if not eager:  # the first checkpoint had to make the group, and timed out there
            assert "new_group(backend='gloo') for checkpoints" in message
            continue
        assert "monitored_barrier of all_reduce_sum (checkpoint 1)" in message
        if rank == 0:
            assert f"Ranks {hanging} failed to pass monitoredBarrier" in message
        else:
            assert "Rank 0 did not answer in time" in message
