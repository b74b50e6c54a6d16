"""Multi-process helpers on :mod:`torch.distributed`: sharding predicates, a checked all-reduce.

The batcher and the Monte Carlo estimator run unchanged in every process of a
``torchrun`` job. This module gives them the few collective pieces they need, and nothing
else: it does not import them, and they use whatever process group the caller started
(with :func:`setup` or ``dist.init_process_group``). The checkpoint protocol described below
runs in the private ``torchntk/distributed/_checkpoint_protocol.py``; this module, longer than most because
it carries the reference documentation of the API page (these notes and every function's
docstring), keeps only the public functions.

* :func:`setup` starts the process group (gloo on CPU, NCCL on ``cuda:LOCAL_RANK``), if
  the caller has not, and returns this rank's device.
* :func:`world` gives ``(rank, world_size)``, or ``(0, 1)`` when no process group is
  initialised, so single-process code calls the same functions.
* :func:`owned_samples` (strategy A: each rank draws a share of the Monte Carlo samples) and
  :func:`owned_blocks` (strategy B: each rank computes a share of the kernel blocks, for all
  samples) give ``index -> bool`` predicates. Both are round-robin, so each index belongs to
  exactly one rank.
* :func:`all_reduce_sum` sums every tensor leaf of a pytree across the ranks. It is a
  *checkpoint*: all ranks must call it, in the same order and with the same tree structure.
* :func:`failure_guard` (or :func:`propagate_failure`) reports an exception on one rank to
  the others at their next checkpoint, so they stop with :class:`RankFailedError` instead
  of waiting for a rank that will never come.
* :func:`finalize` ends the job: a last checkpoint (a barrier), then
  ``destroy_process_group``.

Intended use in each rank (see ``examples/distributed_monte_carlo.py``)::

    device = distributed.setup(timeout=600)    # gloo on CPU, or nccl on cuda:LOCAL_RANK
    rank, world_size = distributed.world()
    owned = distributed.owned_samples(rank, world_size)
    with distributed.failure_guard(timeout=600):
        total = zeros_like_one_kernel          # every rank, even if it owns no sample
        for s in range(n_samples):
            if owned(s):
                total = tree_add(total, one_sample_kernel(s))
        total = distributed.all_reduce_sum(total, timeout=600)
    distributed.finalize(timeout=600)          # barrier, then destroy_process_group

NOTE: [Checkpoints]
A *checkpoint* is :func:`all_reduce_sum`, :func:`checkpoint`, :func:`finalize`, or the
failure report made by :func:`failure_guard` / :func:`propagate_failure`. Each one runs the
same short protocol on a gloo group (NOTE: [Backends]):

1. ``dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)``. If a rank does not
   arrive within ``timeout``, rank 0 raises an error naming the missing ranks; the other
   ranks raise after the same timeout, or as soon as rank 0 gives up.
2. An all-reduce of a small status table: one row per rank with a failed flag, a checkpoint
   counter, the kind of checkpoint, a hash of the pytree's structure, dtypes and shapes, and
   (for a failed rank) the first bytes of its exception message. Every rank then knows
   whether a peer failed and whether all ranks are at the same checkpoint with matching
   trees, and raises the same kind of error if not. A mismatch would otherwise deadlock or
   silently sum unrelated buffers.
3. Only :func:`all_reduce_sum`: one ``all_reduce(SUM)`` per dtype and device type of the
   flattened leaves.

Every rank must take part in every checkpoint, **including ranks that have nothing to
contribute** (in generator mode the first interval ``(0, 1]`` has one sample, so with two or
more ranks some own none). Such a rank passes zeros of the right shape. A rank that skips a
checkpoint makes the others fail after ``timeout`` (or with a "different checkpoints" error
when it later reaches a different one). Checkpoints must be issued from one thread per rank,
the same thread each time. Steps 1 and 2 cost two tiny messages per rank, well under a
millisecond on one machine next to the kernel-sized step 3.

NOTE: [Timeouts]
``timeout`` (seconds or a ``timedelta``, default :data:`DEFAULT_TIMEOUT` = 300 s) bounds
every wait of a checkpoint on every rank: the monitored barrier, the status all-reduce and
the gloo data all-reduce, and creating the checkpoint group at the first checkpoint. The
barrier measures from when *this* rank arrives, so ``timeout`` must exceed the largest
difference in work between two checkpoints across the ranks (an uneven share of samples, a
slower device), or healthy but slow ranks are reported as hung. All ranks must pass the same
value (one gloo group is made per distinct timeout, collectively).

``init_process_group(timeout=...)`` (default 30 minutes for gloo, 10 minutes for NCCL) is a
separate limit. It governs what this module does not wait on itself: the rendezvous in
``init_process_group``, collectives the caller issues directly, ``destroy_process_group``,
and the NCCL all-reduce of CUDA leaves. ``Work.wait(timeout)`` bounds an NCCL wait only with
``TORCH_NCCL_BLOCKING_WAIT=1``; otherwise NCCL's watchdog aborts the job once the process
group's timeout expires. Steps 1 and 2 run first, so a missing rank is caught there, within
``timeout``, before any NCCL collective is issued. A process-group timeout shorter than
``timeout`` does not shorten the checkpoints, which use their own group.

After a :class:`DistributedError` the process group should be considered broken: the usual
response is to let the exception end the process (``torchrun`` and ``mp.spawn`` then stop the
job). A rank that dies makes gloo report "Connection closed by peer" to the others at once,
which this module turns into a :class:`DistributedError` naming the collective.

NOTE: [Backends]
Checkpoints run on a gloo group over all ranks that this module creates with
``dist.new_group(backend="gloo", timeout=timeout)``, even when the default backend is
gloo: ``monitored_barrier`` exists only for gloo, and it applies its ``timeout`` only on
rank 0; the other ranks wait for rank 0's answer with their group's timeout, so on the
default group a hung rank 0 would hold them for the process group's timeout. CPU leaves are
reduced on that gloo group too (this covers NCCL jobs that keep results on the host, e.g.
``store_on_device=False``). CUDA (or other accelerator) leaves are reduced on the default
group, normally NCCL.
On several nodes gloo finds its network interface through the hostname; if that resolves
to the wrong interface (or to 127.0.0.1), set ``GLOO_SOCKET_IFNAME``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from .._layout.runs import shard_rows as _shard_rows
from .._utils.exports import published
from ._checkpoint_protocol import DistributedError as DistributedError
from ._checkpoint_protocol import RankFailedError as RankFailedError
from ._checkpoint_protocol import (
    Timeout,
    checked_timeout,
    forget_groups,
    gloo_group,
    leaf_signature,
    run_checkpoint,
    sum_buckets,
    tensor_buckets,
)
from ._checkpoint_protocol import world as world

__all__ = [
    "DEFAULT_TIMEOUT",
    "DistributedError",
    "RankFailedError",
    "setup",
    "world",
    "owned_samples",
    "owned_blocks",
    "KernelShard",
    "shard_rows",
    "all_reduce_sum",
    "checkpoint",
    "propagate_failure",
    "failure_guard",
    "finalize",
]

DEFAULT_TIMEOUT: float = 300.0
"""The default per-checkpoint timeout, in seconds (NOTE [Timeouts] in this module's docstring)."""


def _check_rank(rank: int, world_size: int) -> tuple[int, int]:
    """``(rank, world_size)``, checked: ints with ``0 <= rank < world_size``."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    return rank, world_size


@dataclasses.dataclass(frozen=True)
class _RoundRobin:
    """``index -> bool``: ``index % world_size == rank``. A dataclass for a useful repr."""

    what: str
    rank: int
    world_size: int

    def __call__(self, index: int) -> bool:
        if isinstance(index, bool) or not isinstance(index, int):
            try:
                index = int(index.__index__())  # numpy and 0-d tensor integers
            except AttributeError:
                raise TypeError(f"{self.what} index must be an int, got {index!r}") from None
        if index < 0:
            raise ValueError(f"{self.what} index must be >= 0, got {index}")
        return index % self.world_size == self.rank


def owned_samples(rank: int, world_size: int) -> Callable[[int], bool]:
    """Strategy A: does this rank draw global Monte Carlo sample ``s``? (``s % world == rank``)

    Round-robin keeps the shares within one sample of each other inside every checkpoint
    interval ``(n_prev, n_k]`` of generator mode. The owner only decides *who* computes a
    sample; the sample itself must depend on ``(seed, s)`` alone, so the result does not
    depend on the world size beyond float rounding of the final sum.

    Args:
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: the number of ranks, at least 1.

    Returns:
        ``owned(s) -> bool``, true for ``s % world_size == rank``. It takes ints (numpy and 0-d
        tensor integers too) and raises TypeError for others, ValueError for a negative ``s``.

    Raises:
        TypeError: ``rank`` or ``world_size`` is not an int (bools included).
        ValueError: ``world_size < 1`` or ``rank`` out of ``[0, world_size)``.

    Example:
        >>> owned = owned_samples(1, 3)
        >>> [s for s in range(8) if owned(s)]
        [1, 4, 7]
    """
    return _RoundRobin("sample", *_check_rank(rank, world_size))


def owned_blocks(rank: int, world_size: int) -> Callable[[int], bool]:
    """Strategy B: does this rank compute kernel block ``k``? (``k % world == rank``)

    ``k`` is the linear, row-major block index ``i * n_col_blocks + j`` (or the position of
    the block in whatever fixed order every rank enumerates them in). The owner accumulates
    every sample for its blocks; :func:`all_reduce_sum` of zero-initialised full buffers then
    acts as a gather, bitwise equal to the single-process result.

    Args:
        rank, world_size: as in :func:`owned_samples`, which checks them the same way.

    Returns:
        ``owned(k) -> bool``, true for ``k % world_size == rank``; it checks ``k`` as the
        predicate of :func:`owned_samples` checks ``s``.

    Example:
        >>> owned = owned_blocks(0, 2)
        >>> [k for k in range(6) if owned(k)]
        [0, 2, 4]
    """
    return _RoundRobin("block", *_check_rank(rank, world_size))


class KernelShard(NamedTuple):
    """The rows of a kernel one rank keeps: ``batch(..., distributed="shard")`` returns it.

    ``kernel`` is the result's pytree with, in every leaf, only the x1 examples ``start:stop``
    along the x1 batch axis of the kernel (e.g. ``(stop - start, N2)`` for a traced NTK); when the
    call was given ``out``, it is ``out`` itself (whole-kernel shape) with these rows written.
    ``start`` and ``stop`` are the half-open range of x1 examples (kernel rows) this rank holds,
    from :func:`shard_rows`; ``start == stop`` for a rank with none.
    """

    kernel: Any
    start: int
    stop: int


def shard_rows(n1: int, batch_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """The kernel rows ``(start, stop)`` that ``rank`` keeps with ``batch(..., distributed="shard")``.

    Contiguous, in rank order, whole multiples of ``batch_size`` (``0``: of one example; the last
    block may be shorter) and as even as possible: the ranks' numbers of blocks differ by at most
    one, the first ranks taking the extra ones, so the last ranks get none only when there are
    fewer blocks than ranks. They depend on nothing else (not memory, not timing), so a rank can
    allocate its part in advance.

    Args:
        n1: the number of x1 examples.
        batch_size: as given to :func:`torchntk.batch`.
        rank, world_size: as in :func:`owned_samples`, which checks them the same way.

    Raises:
        TypeError: ``n1``, ``batch_size``, ``rank`` or ``world_size`` not an int.
        ValueError: a negative ``n1`` or ``batch_size``; ``rank`` outside ``[0, world_size)``.

    Example:
        >>> [shard_rows(10, 3, rank, 2) for rank in range(2)]
        [(0, 6), (6, 10)]
        >>> [shard_rows(15, 0, rank, 6) for rank in range(6)]
        [(0, 3), (3, 6), (6, 9), (9, 11), (11, 13), (13, 15)]
    """
    rank, world_size = _check_rank(rank, world_size)
    for name, value in (("n1", n1), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be a non-negative int, got {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return _shard_rows(n1, batch_size or 1, rank, world_size)


def setup(backend: str | None = None, *, timeout: Timeout = DEFAULT_TIMEOUT,
          process_group_timeout: timedelta | None = None,
          **init_kwargs: Any) -> torch.device:
    """Starts the default process group for this rank and returns the device it should use.

    ``backend=None`` picks ``"nccl"`` when CUDA is available and ``"gloo"`` otherwise. With
    NCCL the device is ``cuda:LOCAL_RANK`` (the variable ``torchrun`` sets), made current with
    ``torch.cuda.set_device``; with gloo it is the CPU. ``init_kwargs`` (``init_method``,
    ``rank``, ``world_size``, ...) and ``process_group_timeout`` go to
    ``dist.init_process_group``; without them it reads ``torchrun``'s environment. A group
    that is already initialised is kept.

    It then creates the gloo group that checkpoints with this ``timeout`` use (NOTE:
    [Backends]) while all ranks are known to be together. Without this call the group is
    made at the first checkpoint, which works the same, except that a rank missing there is
    reported after ``timeout`` as "new_group ... failed", without its rank number.

    Args:
        backend: ``"gloo"``, ``"nccl"``, or ``None`` to pick one; ignored when the group exists.
        timeout: seconds (or a ``timedelta``) that checkpoints wait; see NOTE: [Timeouts].
        process_group_timeout: the ``timeout`` of ``dist.init_process_group``, or ``None`` for
            its default.
        **init_kwargs: passed to ``dist.init_process_group``.

    Returns:
        The device this rank should compute on.

    Raises:
        TypeError: ``timeout`` is neither a number nor a ``timedelta``.
        ValueError: ``timeout`` is not positive or not finite.
        RuntimeError: this PyTorch build has no ``torch.distributed``.
        DistributedError: the checkpoint group could not be made within ``timeout``.
    """
    seconds = checked_timeout(timeout, "torchntk.distributed.setup")
    if not dist.is_available():
        raise RuntimeError(
            "torchntk.distributed.setup: this PyTorch build has no torch.distributed")
    initialised = dist.is_initialized()
    if initialised:
        backend = str(dist.get_backend())  # e.g. "gloo", "nccl", "cpu:gloo,cuda:nccl"
    elif backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if "nccl" in backend:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not initialised:
        if process_group_timeout is not None:
            init_kwargs["timeout"] = process_group_timeout
        dist.init_process_group(backend, **init_kwargs)
    if world()[1] > 1:
        gloo_group(seconds)
    return device


def checkpoint(*, timeout: Timeout = DEFAULT_TIMEOUT) -> None:
    """A checked barrier: every rank waits for the others, and learns of failed peers.

    Use it where ranks must synchronise without reducing anything, e.g. before reading
    results another rank wrote. A no-op without a process group.

    Args:
        timeout: seconds (or a ``timedelta``) to wait for the others; see NOTE: [Timeouts].

    Raises:
        TypeError: ``timeout`` is neither a number nor a ``timedelta``.
        ValueError: ``timeout`` is not positive or not finite.
        RankFailedError: another rank reported a failure.
        DistributedError: a rank did not arrive in time, or the ranks are at different
            checkpoints.
    """
    seconds = checked_timeout(timeout, "torchntk.distributed.checkpoint")
    if world()[1] > 1:
        run_checkpoint("checkpoint", seconds)


def all_reduce_sum(tree: Any, *, timeout: Timeout = DEFAULT_TIMEOUT) -> Any:
    """Sums every tensor leaf of ``tree`` over all ranks; a checkpoint (NOTE: [Checkpoints]).

    The leaves (found with ``torch.utils._pytree``, so tensors, tuples, lists, dicts and
    namedtuples nest freely) are flattened into one contiguous buffer per dtype and device
    type, and each buffer is all-reduced with ``SUM``: gloo for CPU tensors, the default
    backend (normally NCCL) for CUDA tensors. The result has the structure, shapes, dtypes
    and devices of ``tree``; its leaves are new tensors (views into the reduced buffers) and
    the inputs are not modified. Non-tensor leaves are returned as they are, unsummed.

    **Every rank must call this at every checkpoint, even with nothing to contribute**: such
    a rank passes zeros with the same structure, dtypes and shapes. The ranks' trees must
    match (checked, via a hash in the status table). Without a process group, or with world
    size 1, ``tree`` is returned unchanged, so single-process callers need no special case.

    Args:
        tree: a pytree whose tensor leaves are summed.
        timeout: seconds (or a ``timedelta``) to wait for the other ranks; see NOTE:
            [Timeouts].

    Returns:
        The summed tree (``tree`` itself in a single process).

    Raises:
        TypeError: a bool tensor leaf, or a ``timeout`` that is neither a number nor a
            ``timedelta``; raised before any communication.
        ValueError: tensor leaves of one device type on two devices, or a ``timeout`` that is
            not positive or not finite; raised before any communication.
        RankFailedError: another rank reported a failure.
        DistributedError: timeouts, backend errors or mismatched trees.

    Example:
        >>> all_reduce_sum({"ntk": torch.ones(2)})  # single process: unchanged
        {'ntk': tensor([1., 1.])}
    """
    seconds = checked_timeout(timeout, "torchntk.distributed.all_reduce_sum")
    leaves, spec = pytree.tree_flatten(tree)
    buckets = tensor_buckets(leaves)
    if world()[1] == 1:
        return tree
    run_checkpoint("all_reduce_sum", seconds, leaf_signature(leaves, spec))
    return pytree.tree_unflatten(sum_buckets(leaves, buckets, seconds), spec)


def propagate_failure(exc: BaseException, *, timeout: Timeout = DEFAULT_TIMEOUT) -> None:
    """Tells the other ranks that this one failed with ``exc``; call it, then re-raise.

    It joins the next checkpoint the others are waiting in (an :func:`all_reduce_sum`, a
    :func:`checkpoint` or :func:`finalize`) with the failed flag set, so they raise
    :class:`RankFailedError` naming this rank and ``exc``'s message. Call it once, from the
    thread that makes checkpoints, after the last checkpoint this rank completed, and not
    for a :class:`DistributedError` (the others already know). If the report itself fails
    (the others exited, or time out), that is added to ``exc`` as a note and not raised, so
    the caller's ``raise`` shows the original error. A no-op without a process group.

    Args:
        exc: the exception this rank is about to raise.
        timeout: seconds (or a ``timedelta``) to wait for the others; see NOTE: [Timeouts].

    Raises:
        TypeError: ``timeout`` is neither a number nor a ``timedelta``.
        ValueError: ``timeout`` is not positive or not finite.
    """
    if isinstance(exc, DistributedError) or world()[1] == 1:
        return
    seconds = checked_timeout(timeout, "torchntk.distributed.propagate_failure")
    try:
        run_checkpoint("failure report", seconds, failure=exc)
    except Exception as report_error:  # noqa: BLE001 (reported as a note instead)
        if hasattr(exc, "add_note"):
            exc.add_note(f"torchntk.distributed: could not report this failure to the other "
                         f"ranks: {report_error}")
        return
    if hasattr(exc, "add_note"):
        exc.add_note(f"torchntk.distributed: reported to the other ranks "
                     f"(this is rank {world()[0]} of {world()[1]})")


@contextlib.contextmanager
def failure_guard(*, timeout: Timeout = DEFAULT_TIMEOUT) -> Iterator[None]:
    """Wraps a rank's work so that an exception in it reaches the other ranks.

    An ``Exception`` raised inside the block (other than a :class:`DistributedError`) is
    reported with :func:`propagate_failure` and then re-raised unchanged. The other ranks
    fail at their next checkpoint with :class:`RankFailedError` instead of waiting for the
    timeout. ``KeyboardInterrupt`` and ``SystemExit`` pass straight through.

    Args:
        timeout: passed to :func:`propagate_failure`.

    Yields:
        Nothing; the block runs inside the guard.
    """
    try:
        yield
    except DistributedError:
        raise
    except Exception as exc:
        propagate_failure(exc, timeout=timeout)
        raise


def finalize(*, timeout: Timeout = DEFAULT_TIMEOUT) -> None:
    """Ends distributed work: a final checkpoint, then ``dist.destroy_process_group()``.

    The checkpoint is the barrier that keeps a rank from tearing down gloo while a peer is
    still working, which can abort the peer with "terminate called without an active
    exception". It also surfaces a failure another rank reported after the last
    :func:`all_reduce_sum`. Call it on every rank, after the last checkpoint; a no-op
    without a process group. The process group is destroyed even if the checkpoint raises.

    Args:
        timeout: bounds the final checkpoint, as the ``timeout`` of :func:`checkpoint`.

    Raises:
        TypeError: a ``timeout`` of the wrong type, checked even without a process group.
        ValueError: a ``timeout`` that is not a positive finite number of seconds.
        RankFailedError: another rank reported a failure after the last checkpoint.
        DistributedError: a rank did not reach the final checkpoint in time, or reached
            another checkpoint; the process group is destroyed all the same.
    """
    seconds = checked_timeout(timeout, "torchntk.distributed.finalize")
    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if world()[1] > 1:
            run_checkpoint("finalize", seconds)
    finally:
        forget_groups()
        dist.destroy_process_group()


published(globals(), __name__)  # torchntk.distributed.world, not its private module
