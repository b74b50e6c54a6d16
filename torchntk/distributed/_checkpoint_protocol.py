"""The checkpoint protocol behind :mod:`torchntk.distributed`, and its errors.

:mod:`torchntk.distributed` documents the protocol for its users (NOTE: [Checkpoints], NOTE:
[Timeouts] and NOTE: [Backends] in its docstring) and re-exports :func:`world`,
:class:`DistributedError` and :class:`RankFailedError`; this module runs it: the gloo groups the
checkpoints use, the status table every rank all-reduces, and the bounded waits.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Union

import torch
import torch.distributed as dist

from .._utils import checks as _checks

Timeout = Union[float, int, timedelta]
"""A timeout in seconds, or a ``timedelta``."""

# Status table columns (one row per rank), then the exception message bytes.
_FAILED, _COUNTER, _KIND, _SIGNATURE, _N_FIELDS = 0, 1, 2, 3, 4
# Room for a whole error message: torchntk's own messages quote PyTorch's at their end, so
# a message that must still be cut keeps its head and its tail (`_clip`).
_MESSAGE_BYTES = 4096
_KINDS = {"all_reduce_sum": 1, "checkpoint": 2, "finalize": 3, "failure report": 4}
_KIND_NAMES = {code: name for name, code in _KINDS.items()}


class DistributedError(RuntimeError):
    """A checkpoint failed: a collective timed out or errored, or the ranks disagree.

    The message says which collective, this rank, the world size and the timeout. The
    process group should not be used afterwards.
    """

    # The public home of the class, for tracebacks, pickling and the documentation.
    __module__ = "torchntk.distributed"

    def __init__(self, message: str, *, collective: str, rank: int, world_size: int,
                 timeout: float):
        super().__init__(message)
        self.collective = collective
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout


class RankFailedError(DistributedError):
    """Another rank raised and reported it (see :func:`failure_guard`).

    ``failed_ranks`` lists the ranks that reported; ``messages`` maps each to the start of
    its exception's ``"Type: message"``.
    """

    __module__ = "torchntk.distributed"

    def __init__(self, message: str, *, failed_ranks: tuple[int, ...],
                 messages: dict[int, str], **kwargs: Any):
        super().__init__(message, **kwargs)
        self.failed_ranks = failed_ranks
        self.messages = messages


def world() -> tuple[int, int]:
    """``(rank, world_size)`` of the default process group, or ``(0, 1)`` without one.

    >>> world()  # no process group in this process
    (0, 1)
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def checked_timeout(timeout: Timeout, where: str) -> float:
    """``timeout`` in seconds: :func:`torchntk._utils.checks.timeout_argument`, the package's one check."""
    return _checks.timeout_argument(timeout, where)


@dataclasses.dataclass
class _GroupState:
    default: Any     # the default ProcessGroup this state belongs to
    groups: dict = dataclasses.field(default_factory=dict)  # timeout seconds -> gloo group
    counter: int = 0


_state: _GroupState | None = None


def _group_state() -> _GroupState:
    global _state
    default = dist.group.WORLD
    # A new default group (after destroy_process_group and a new init) has new ranks: start over.
    if _state is None or _state.default is not default:
        _state = _GroupState(default=default)
    return _state


def forget_groups() -> None:
    """Drops the checkpoint groups and counter; called when the process group is destroyed."""
    global _state
    _state = None


def gloo_group(timeout_seconds: float) -> Any:
    """The gloo group over all ranks whose own timeout is ``timeout_seconds``, made on first use.

    A separate group even when the default backend is gloo: ``monitored_barrier`` enforces
    its ``timeout`` only on rank 0, and the other ranks wait for rank 0's answer with their
    group's timeout, so a hung rank 0 would otherwise hold them for the process group's
    timeout (30 minutes by default). Creating a group is a collective, bounded by
    ``timeout_seconds`` too; all ranks reach their first checkpoint with a given timeout together.
    """
    state = _group_state()
    if timeout_seconds not in state.groups:
        try:
            state.groups[timeout_seconds] = dist.new_group(backend=dist.Backend.GLOO,
                                                           timeout=timedelta(seconds=timeout_seconds))
        except Exception as exc:
            raise error(
                "new_group(backend='gloo') for checkpoints", timeout_seconds,
                f"{type(exc).__name__}: {exc}. A rank did not reach its first checkpoint "
                "(with this timeout) in time: it crashed, hung or is still working. Call "
                "torchntk.distributed.setup() when starting the job to have it named.") from exc
    return state.groups[timeout_seconds]


def error(what: str, timeout_seconds: float, detail: str, cls: type = DistributedError,
          **extra: Any) -> DistributedError:
    """A ``cls`` error saying that ``what`` failed on this rank, and why (``detail``)."""
    rank, world_size = world()
    message = (f"torchntk.distributed: {what} failed on rank {rank} of world size "
               f"{world_size} (timeout {timeout_seconds:g} s): {detail}")
    return cls(message, collective=what, rank=rank, world_size=world_size, timeout=timeout_seconds,
               **extra)


def wait(what: str, timeout_seconds: float, start: Callable[[], Any]) -> None:
    """Runs ``start()`` (an ``async_op=True`` collective) and waits at most ``timeout_seconds``.

    Raises:
        DistributedError: the backend raised (a timeout, a peer that died), or the wait ended
            before the collective completed.
    """
    try:
        work = start()
        finished = work.wait(timeout=timedelta(seconds=timeout_seconds))
    except Exception as exc:  # backend errors: timeouts, connection closed by a dead peer
        raise error(what, timeout_seconds, f"{type(exc).__name__}: {exc}".strip()) from exc
    if finished is False:
        raise error(what, timeout_seconds, "the collective did not complete in time")


def _describe_exception(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _clip(text: bytes, limit: int = _MESSAGE_BYTES) -> bytes:
    """``text`` cut to ``limit`` bytes, keeping its start and its end around a marker."""
    if len(text) <= limit:
        return text
    marker = b" [...] "
    head = (limit - len(marker)) // 2
    tail = limit - len(marker) - head
    return text[:head] + marker + text[len(text) - tail:]


def run_checkpoint(kind: str, timeout_seconds: float, signature: int = 0,
                   failure: BaseException | None = None) -> None:
    """Steps 1 and 2 of NOTE: [Checkpoints]. Raises on every rank when one of them failed.

    Args:
        kind: one of ``"all_reduce_sum"``, ``"checkpoint"``, ``"finalize"``, ``"failure report"``.
        timeout_seconds: the bound on every wait (NOTE: [Timeouts]).
        signature: a hash of the pytree this checkpoint reduces (:func:`leaf_signature`), or 0.
        failure: this rank's exception, for a failure report.

    Raises:
        RankFailedError: another rank reported a failure (never raised on the failing rank).
        DistributedError: a wait failed, or the ranks are at different checkpoints or passed
            different pytrees.
    """
    rank, world_size = world()
    state = _group_state()
    state.counter += 1
    what = f"{kind} (checkpoint {state.counter})"
    group = gloo_group(timeout_seconds)

    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_seconds),
                               wait_all_ranks=True)
    except Exception as exc:
        if rank == 0:
            hint = ("The ranks named did not reach this checkpoint in time: they crashed, "
                    "hung, or are still working (raise the timeout if their share of the work "
                    "is simply slower).")
        else:
            hint = ("Rank 0 did not answer in time: either rank 0 itself did not reach this "
                    "checkpoint (crashed, hung or still working), or it found other ranks "
                    "missing; rank 0's error names them.")
        raise error(f"monitored_barrier of {what}", timeout_seconds,
                    f"{str(exc).strip()} {hint}") from exc

    status = torch.zeros(world_size, _N_FIELDS + _MESSAGE_BYTES, dtype=torch.int64)
    row = status[rank]
    row[_COUNTER] = state.counter
    row[_KIND] = _KINDS[kind]
    row[_SIGNATURE] = signature
    if failure is not None:
        row[_FAILED] = 1
        text = _clip(_describe_exception(failure).encode("utf-8", "replace"))
        row[_N_FIELDS:_N_FIELDS + len(text)] = torch.tensor(list(text), dtype=torch.int64)
    wait(f"status all_reduce of {what}", timeout_seconds,
         lambda: dist.all_reduce(status, group=group, async_op=True))

    if failure is not None:
        return  # the failed rank re-raises its own exception
    failed = tuple(int(r) for r in torch.nonzero(status[:, _FAILED]).flatten())
    if failed:
        messages = {
            r: bytes(status[r, _N_FIELDS:].tolist()).rstrip(b"\0").decode("utf-8", "replace")
            for r in failed}
        listed = "; ".join(f"rank {r}: {messages[r]}" for r in failed)
        ranks = ", ".join(map(str, failed))
        raise error(what, timeout_seconds, f"rank {ranks} failed and reported it ({listed})",
                    cls=RankFailedError, failed_ranks=failed, messages=messages)
    for column, label in ((_COUNTER, "checkpoint counts"), (_KIND, "checkpoint kinds")):
        values = status[:, column].tolist()
        if len(set(values)) > 1:
            shown = values if column == _COUNTER else [_KIND_NAMES.get(v, v) for v in values]
            raise error(what, timeout_seconds,
                        f"the ranks are at different checkpoints ({label} by rank: {shown}); "
                        "every rank must make the same sequence of checkpoint calls")
    signatures = status[:, _SIGNATURE].tolist()
    if len(set(signatures)) > 1:
        raise error(what, timeout_seconds,
                    "the ranks passed pytrees with different structures, dtypes, shapes or "
                    f"device types (hashes by rank: {signatures})")


def leaf_signature(leaves: list, spec: Any) -> int:
    """A hash of a flattened pytree's structure and of its leaves' dtypes, shapes and device types."""
    parts = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(f"{leaf.dtype}/{tuple(leaf.shape)}/{leaf.device.type}")
        else:
            parts.append(type(leaf).__name__)
    return zlib.crc32("|".join(parts).encode())


def tensor_buckets(leaves: list) -> dict[tuple[torch.dtype, str], list[int]]:
    """The positions of the tensor leaves, by dtype and device type, in order of first appearance.

    One buffer per bucket is all-reduced (step 3 of NOTE: [Checkpoints]); the order is the same on
    every rank because their trees match.

    Raises:
        TypeError: a bool tensor, which cannot be summed.
        ValueError: tensor leaves of one device type on two devices (one buffer cannot hold both).
    """
    buckets: dict[tuple[torch.dtype, str], list[int]] = {}
    devices: dict[str, torch.device] = {}
    for position, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        if leaf.dtype == torch.bool:
            raise TypeError(f"all_reduce_sum cannot sum a bool tensor (leaf {position})")
        kind = leaf.device.type
        if devices.setdefault(kind, leaf.device) != leaf.device:
            raise ValueError(
                f"all_reduce_sum needs the tensor leaves of one device type on one device; "
                f"found {devices[kind]} and {leaf.device}")
        buckets.setdefault((leaf.dtype, kind), []).append(position)
    return buckets


def sum_buckets(leaves: list, buckets: dict[tuple[torch.dtype, str], list[int]],
                timeout_seconds: float) -> list:
    """Step 3 of NOTE: [Checkpoints]: ``leaves`` with every tensor summed over the ranks.

    Each bucket is one contiguous buffer, all-reduced on the gloo group for CPU tensors and on the
    default group (normally NCCL) for the others; the summed leaves are views into the buffers, and
    ``leaves`` are not modified. Non-tensor leaves are kept as they are.

    Raises:
        DistributedError: a backend error, or the all-reduce did not finish within the timeout.
    """
    gloo = gloo_group(timeout_seconds)
    out = list(leaves)
    for (dtype, kind), positions in buckets.items():  # insertion order, the same on all ranks
        parts = [leaves[p].detach().reshape(-1) for p in positions]
        buffer = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
        group = gloo if kind == "cpu" else None
        wait(f"all_reduce_sum of the {dtype} {kind} leaves", timeout_seconds,
             lambda buffer=buffer, group=group: dist.all_reduce(
                 buffer, op=dist.ReduceOp.SUM, group=group, async_op=True))
        for position, piece in zip(positions, buffer.split([t.numel() for t in parts])):
            out[position] = piece.view(leaves[position].shape)
    return out
