"""Kernels written into caller-given arrays (``out=``), and the record that lets a run resume.

NOTE: [Kernels on disk]
``batched(x1, x2, out=...)`` writes every block straight into ``out``: a NumPy array or memmap,
or any object with ``.shape``, ``.dtype`` and slice assignment of NumPy arrays (a zarr array),
one per result leaf (a pytree matching the result: a dict keyed like its fields for
``get=("ntk", "nngp")``). Nothing of the kernel's size is allocated by ``batch`` then; writes are
serialised, because two blocks may share a chunk of a chunked store.

``progress_file=PATH`` makes the run resumable. The record (JSON) holds a *fingerprint* of the
problem and the blocks whose data reached ``out``; a block enters it only after ``out`` was
flushed (``out.flush()`` where it exists, e.g. ``np.memmap``; other stores must make assignments
durable themselves, as zarr does). The record is rewritten atomically (a temporary file, fsync,
``os.replace``, fsync of the directory) at most every :data:`RECORD_SECONDS` and at the end, so a
kill loses at most that much work, and never leaves a record listing unwritten blocks.

The fingerprint is the kernel function (kind, ``trace_axes``, ``diagonal_axes``, the module's
architecture and a hash of its parameters and buffers), a hash of the inputs and other
arguments, ``batch_size``, the rank and world size in shard mode, and every output leaf's shape and dtype. A
record with another fingerprint is refused with a ``ValueError`` naming what differs, never
reused. Each recorded block carries a checksum of its first values, and on resume the last
blocks recorded are read back from ``out`` and compared, which catches an ``out`` that was
recreated (``np.memmap(..., mode="w+")`` zeroes the file: reopen with ``"r+"``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
import zlib
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch.utils import _pytree as pytree

from .._utils.tree import Flat, key_entry

RECORD_SECONDS = 10.0
"""At most this long between rewrites of the progress record (blocks done since are redone after
a kill)."""
_FORMAT = 1
_CHECKED_ON_RESUME = 4
"""Recorded blocks read back from ``out`` on resume."""
_CHECKSUM_VALUES = 4096


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype holding ``dtype`` bit for bit (``ValueError`` for those NumPy lacks)."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError as error:
        raise ValueError(f"batch: `out` cannot hold a {dtype} kernel (NumPy has no such dtype).") from error


def as_numpy(block: torch.Tensor) -> np.ndarray:
    """A CPU NumPy view (or copy, from another device) of ``block``."""
    return block.detach().to("cpu").numpy()


def _paths(tree: Any, is_leaf=None) -> list[tuple]:
    flat, _ = pytree.tree_flatten_with_path(tree, is_leaf=is_leaf)
    return [tuple(key_entry(key) for key in path) for path, _ in flat]


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "__setitem__")


def out_leaves(out: Any) -> list[Any]:
    """The arrays of an ``out`` pytree (arrays are leaves, even those pytree could open)."""
    return pytree.tree_leaves(out, is_leaf=_is_array)


def match_out(out: Any, result: Flat) -> list[tuple[tuple, Any]]:
    """``(path, leaf)`` of ``out`` for each of ``result``'s leaves, in their order.

    ``out`` matches when every result leaf's path (dict keys, namedtuple fields, sequence
    positions) leads to an array in ``out``; a namedtuple result accepts a dict keyed by its fields.

    Raises:
        TypeError: an ``out`` leaf that is not an array.
        ValueError: ``out`` with other paths than the result (e.g. one array for two kernels).
    """
    wanted = _paths(result.rebuild(list(range(len(result.leaves)))))
    leaves = pytree.tree_leaves(out, is_leaf=_is_array)
    given = dict(zip(_paths(out, is_leaf=_is_array), leaves))
    if sorted(map(repr, given)) != sorted(map(repr, wanted)) or len(given) != len(leaves):
        raise ValueError(
            f"batch: `out` must match the result's structure, one array per kernel: the result has "
            f"{len(wanted)} leaf(s) at {_show_paths(wanted)}, `out` has {len(leaves)} at {_show_paths(list(given))}."
        )
    for path, leaf in given.items():
        if not _is_array(leaf):
            raise TypeError(
                f"batch: every leaf of `out` must be an array with .shape, .dtype and slice assignment "
                f"(a NumPy memmap, a zarr array), got {type(leaf).__name__} at {_show_path(path)}."
            )
    return [(path, given[path]) for path in wanted]


def _show_paths(paths: list[tuple], most: int = 6) -> str:
    shown = ", ".join(map(_show_path, paths[:most]))
    return shown + (f", ... ({len(paths) - most} more)" if len(paths) > most else "")


def _show_path(path: tuple) -> str:
    return "the root" if not path else "out" + "".join(f"[{key!r}]" for key in path)


def check_out_leaf(array: Any, shape: Sequence[int], dtype: torch.dtype, path: tuple) -> None:
    """``ValueError`` unless ``array`` (a tensor, or an array of NumPy dtype) has exactly the kernel
    leaf's shape and dtype."""
    if isinstance(array, torch.Tensor):
        expected, got = dtype, array.dtype
    else:
        expected, got = numpy_dtype(dtype), np.dtype(array.dtype)
    if tuple(array.shape) != tuple(shape) or got != expected:
        raise ValueError(
            f"batch: `out` at {_show_path(path)} must have the kernel's shape {tuple(shape)} and dtype "
            f"{expected}, got shape {tuple(array.shape)} and dtype {got}."
        )


def assign_whole(target: Any, value: torch.Tensor) -> None:
    """``target[...] = value`` for a tensor or an array ``target``."""
    if isinstance(target, torch.Tensor):
        target.copy_(value)
    else:
        target[...] = as_numpy(value)


def flush(arrays: Sequence[Any]) -> None:
    for array in arrays:
        if hasattr(array, "flush"):
            array.flush()


def checksum(block: np.ndarray) -> int:
    return zlib.crc32(np.ascontiguousarray(block.reshape(-1)[:_CHECKSUM_VALUES]).tobytes())


# -- the fingerprint -----------------------------------------------------------------------------


def _hash_tensors(tree: Any, digest: Any) -> None:
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            data = leaf.detach().to("cpu").contiguous().reshape(-1)
            digest.update(f"{leaf.dtype}{tuple(leaf.shape)}".encode())
            digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        elif leaf is None or isinstance(leaf, (bool, int, float, str)):
            digest.update(repr(leaf).encode())
        else:  # reprs of other objects carry addresses, which differ between processes
            digest.update(type(leaf).__qualname__.encode())


def fingerprint(spec: Any, inputs: Any, batch_size: int, shard: Optional[list[int]]) -> dict:
    """What a progress record must agree on; ``inputs`` is ``(x1, x2, args, kwargs)``, ``shard``
    ``[rank, world_size]`` in shard mode."""
    model = spec.f
    model_digest = hashlib.blake2b(digest_size=16)
    if isinstance(model, torch.nn.Module):
        model_digest.update(str(model).encode())
        _hash_tensors(dict(model.named_parameters()), model_digest)
        _hash_tensors(dict(model.named_buffers()), model_digest)
    else:
        model_digest.update(getattr(model, "__qualname__", type(model).__qualname__).encode())
    input_digest = hashlib.blake2b(digest_size=16)
    _hash_tensors(inputs, input_digest)
    return {
        "kernel": spec.kind,
        "trace_axes": list(spec.trace_axes),
        "diagonal_axes": list(spec.diagonal_axes),
        "model": model_digest.hexdigest(),
        "inputs": input_digest.hexdigest(),
        "batch_size": batch_size,
        "shard": shard,
    }


# -- the record ----------------------------------------------------------------------------------


class ProgressRecord:
    """The blocks of one problem already in ``out``, kept in a JSON file rewritten atomically.

    ``done`` maps ``(run1, run2)`` to the checksums of the block's leaves.
    """

    def __init__(self, path: os.PathLike, problem: dict):
        self.path = os.fspath(path)
        self.problem = problem
        self.done: dict[tuple, list[int]] = {}
        self._pending: dict[tuple, list[int]] = {}
        self._lock = threading.Lock()
        self._saved_at = time.monotonic()

    @classmethod
    def open(cls, path: Any, problem: dict) -> "ProgressRecord":
        """The record at ``path`` if it exists (and matches ``problem``), else an empty one.

        Raises:
            TypeError: ``path`` is not a path.
            ValueError: the file is not a progress record of this format, or is another problem's.
        """
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"batch: `progress_file` must be a path (str or os.PathLike), got {type(path).__name__}.")
        record = cls(path, problem)
        if not os.path.exists(record.path):
            return record
        try:
            with open(record.path, encoding="utf-8") as file:
                saved = json.load(file)
            assert saved["format"] == _FORMAT
            blocks = {(tuple(entry[0]), tuple(entry[1])): list(entry[2]) for entry in saved["blocks"]}
            stored = saved["problem"]
        except (OSError, ValueError, KeyError, TypeError, IndexError, AssertionError) as error:
            raise ValueError(
                f"batch: `progress_file` {record.path!r} exists but is not a progress record of this "
                f"version of torchntk ({type(error).__name__}: {error}). Delete it to start over."
            ) from error
        different = sorted(key for key in set(stored) | set(problem) if stored.get(key) != problem.get(key))
        if different:
            shown = "; ".join(f"{key}: recorded {stored.get(key)!r}, now {problem.get(key)!r}" for key in different)
            raise ValueError(
                f"batch: `progress_file` {record.path!r} records another problem ({shown}). Resuming "
                f"would mix two kernels: delete the file (and start `out` afresh) or pass the same "
                f"model, inputs and arguments as the interrupted run."
            )
        record.done = blocks
        return record

    def verify(self, read_back: Any) -> None:
        """Compares the checksums of the last recorded blocks with ``read_back(run1, run2)``.

        Raises:
            ValueError: ``out`` does not hold what the record says it holds.
        """
        for block in list(self.done)[-_CHECKED_ON_RESUME:]:
            if read_back(*block) != self.done[block]:
                raise ValueError(
                    f"batch: `out` does not hold the blocks that `progress_file` {self.path!r} records "
                    f"(block rows {block[0]}, columns {block[1]} differ). Was `out` recreated, e.g. with "
                    f"np.memmap(..., mode='w+'), which zeroes the file? Reopen it with mode='r+', or "
                    f"delete the progress file to start over."
                )

    def completed(self, run1: tuple, run2: tuple, checksums: list[int], arrays: Sequence[Any]) -> None:
        """Notes a block written to ``arrays``; saves the record when it is due."""
        with self._lock:
            self._pending[(tuple(run1), tuple(run2))] = checksums
            if time.monotonic() - self._saved_at >= RECORD_SECONDS:
                self._save(arrays)

    def finish(self, arrays: Sequence[Any]) -> None:
        with self._lock:
            self._save(arrays)

    def _save(self, arrays: Sequence[Any]) -> None:
        flush(arrays)  # first the data, then the record that says it is there
        self.done.update(self._pending)
        self._pending = {}
        payload = {
            "format": _FORMAT,
            "problem": self.problem,
            "blocks": [[list(run1), list(run2), sums] for (run1, run2), sums in self.done.items()],
        }
        directory = os.path.dirname(os.path.abspath(self.path))
        handle, temporary = tempfile.mkstemp(prefix=".progress-", dir=directory)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                json.dump(payload, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.path)
        except BaseException:
            if os.path.exists(temporary):
                os.unlink(temporary)
            raise
        _fsync_directory(directory)
        self._saved_at = time.monotonic()


def _fsync_directory(directory: str) -> None:
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:  # some platforms cannot open directories; the replace is still atomic
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
