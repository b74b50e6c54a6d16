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

The fingerprint (:func:`fingerprint`) is everything that decides the kernel's values: the kernel
function's kind, ``trace_axes`` and ``diagonal_axes``; the builder's options that change values
(``output_fn``, ``groups``, ``vmap_axes``, any option not known to leave them alone; not the
implementation, ``chunk_size`` or the checks, which are exact or raise: ``_NOT_VALUES``); the
module's structure (per submodule its class, plain attributes, hooks and train/eval mode) and a
hash of its parameters and buffers (names, ``requires_grad``, values); what ``params`` decides:
for a module the names of the parameters it selects (patterns spelled differently, a predicate or
None that select the same ones are the same problem) and a hash of the values a mapping gives, for
a function model a hash of its parameter tree; a hash of the inputs and every other argument
(with their key paths); ``batch_size``; the rank and
world size in shard mode; every output leaf's shape and dtype. It is JSON data equal in every
process for the same problem: functions (``output_fn``, hooks, predicates) are described by their
code, closures and defaults, never by address (``_describe.py``). A record with another
fingerprint is refused with a ``ValueError`` naming what differs (``output_fn: recorded ...,
now ...``, the attribute or hook table and submodule), before anything is computed, never
reused. Records of format 1 covered less (no ``output_fn``, ``groups``, attributes or hooks), so
they cannot vouch for the problem and are refused, saying so. Kernel functions whose spec has no
``options`` are fingerprinted without them.

Each recorded block carries a checksum of its first values, and on resume the last blocks
recorded are read back from ``out`` and compared, which catches an ``out`` that was recreated
(``np.memmap(..., mode="w+")`` zeroes the file: reopen with ``"r+"``).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
import time
import zlib
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch
from torch.utils import _pytree as pytree

from .._call.groups import ParameterGroups
from .._model.functional import functional_model
from .._utils.tree import Flat, key_entry
from ._describe import describe, tensor_bytes, text

RECORD_SECONDS = 10.0
"""At most this long between rewrites of the progress record (blocks done since are redone after
a kill)."""
_FORMAT = 2
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

_NOT_VALUES = frozenset({
    "trace_axes", "diagonal_axes",  # recorded from the spec, normalised
    "implementation", "structure_rules", "closed_form_rules", "local_jacobian",  # every way is exact
    "chunk_size",  # memory only
    "check_vmap_axes", "verify",  # checks: they pass or raise
    "compile",  # replays the same computation
})
"""Builder options that do not change the kernel's values (beyond rounding), left out of the
fingerprint so that a run may resume with, say, another implementation or ``chunk_size``. Every
other option counts, unknown ones included: ``output_fn`` and ``groups`` choose what is
differentiated, and ``vmap_axes`` which inputs and keyword arguments each example's evaluation
sees (an argument mapped per example or given whole is another function)."""
_OPTION_TEXT = 240
"""Options are few: their descriptions may be longer than attributes' before they are hashed."""
_TABLES = ("_parameters", "_buffers", "_modules")
"""Module attributes recorded elsewhere: tensors in ``parameters``, the tree in the paths."""


def fingerprint(spec: Any, inputs: Any, batch_size: int, shard: Optional[list[int]]) -> dict:
    """What a progress record must agree on; ``inputs`` is ``(x1, x2, args, kwargs)`` (``params``
    is among them, and recorded apart: :func:`_parameters_differentiated`), ``shard`` ``[rank,
    world_size]`` in shard mode. JSON data, equal between processes for the same problem
    (``_describe.py``)."""
    model = spec.f
    x1, x2, args, kwargs = inputs
    params, args, kwargs = _split_params(spec.kind, args, kwargs)
    inputs = (x1, x2, args, kwargs)
    options = None
    if spec.options is not None:
        options = {name: _option(value) for name, value in spec.options.items() if name not in _NOT_VALUES}
    if isinstance(model, torch.nn.Module):
        structure = module_structure(model)
        tensors = hashlib.blake2b(digest_size=16)
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            tensors.update(f"{name} {tensor.requires_grad}".encode())
            _hash_tensors(tensor, tensors)
        parameters = tensors.hexdigest()
    else:  # a function f(params, x): its parameters arrive with the inputs
        structure, parameters = text(describe(model)), None
    input_digest = hashlib.blake2b(digest_size=16)
    _hash_tensors(inputs, input_digest)
    return {
        "kernel": spec.kind,
        "trace_axes": list(spec.trace_axes),
        "diagonal_axes": list(spec.diagonal_axes),
        "options": options,
        "model": structure,
        "parameters": parameters,
        "params": _parameters_differentiated(model, params),
        "inputs": input_digest.hexdigest(),
        "batch_size": batch_size,
        "shard": shard,
    }


def _split_params(kind: str, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """``(params, the other positional arguments, the other keyword arguments)`` of a call of a
    kernel function of ``kind``: ``params`` follows ``x2`` (``get`` and then ``params`` for
    ``"kernel"``), or is a keyword; None when not given."""
    position = 1 if kind == "kernel" else 0
    if len(args) > position:
        return args[position], args[:position] + args[position + 1:], kwargs
    rest = {key: value for key, value in kwargs.items() if key != "params"}
    return kwargs.get("params"), args, rest


def _parameters_differentiated(model: Any, params: Any) -> dict:
    """What ``params`` decides, as JSON data: for a module, the names of the parameters it selects
    (so that ``"*.lora_*"``, ``["*.lora_A*", "*.lora_B*"]``, a predicate or ``None`` that select the
    same ones are the same problem) and, for a mapping of tensors, a digest of the values it gives;
    for a function model, a digest of its parameter tree. ``spelling`` stands in for the names
    where the selection cannot be resolved (the kernel call then raises)."""
    digest = hashlib.blake2b(digest_size=16)
    _hash_tensors(params, digest)
    if not isinstance(model, torch.nn.Module):
        return {"names": None, "values": digest.hexdigest()}
    values = digest.hexdigest() if isinstance(params, Mapping) else None
    try:
        names = sorted(functional_model(model, params, "batch", lazy=True).names)
    except (TypeError, ValueError):
        return {"names": None, "values": values, "spelling": text(describe(params), _OPTION_TEXT)}
    return {"names": names, "values": values}


def _option(value: Any) -> str:
    """A builder option's description, as text; parsed ``groups`` readable, as the user gave them."""
    if isinstance(value, ParameterGroups):
        shown = []
        for name, selection in zip(value.names, value.selections):
            chosen = [*selection.patterns, *(f"module {path!r}" for path in selection.modules)]
            if selection.predicate is not None:
                chosen.append(f"predicate {describe(selection.predicate)}")
            shown.append(f"{name!r}: [{', '.join(chosen)}]")
        return text("{" + ", ".join(shown) + "}", _OPTION_TEXT)
    return text(describe(value), _OPTION_TEXT)


def module_structure(module: torch.nn.Module) -> dict:
    """``{path: {"class": ..., attribute: description}}`` for every submodule: what of a module
    decides its function besides its tensors' values (``_model/fingerprint.structure_fingerprint``
    describes the same for comparisons within a process). Plain attributes (``self.scale = 3.0``),
    hooks (as the functions they are) and the train/eval mode count; empty hook tables are left
    out to keep the record small."""
    structure = {}
    for path, sub in module.named_modules(remove_duplicate=False):
        entry = {"class": f"{type(sub).__module__}.{type(sub).__qualname__}"}
        # Hook tables are keyed by handle ids, a process-wide counter: hooks count by their order.
        handles: dict = {}
        for key, value in sub.__dict__.items():
            if "hooks" in key and isinstance(value, dict):
                for handle in value:
                    handles.setdefault(handle, len(handles))
        for key, value in sub.__dict__.items():
            if key in _TABLES or (key.startswith("_") and isinstance(value, (dict, set)) and not value):
                continue
            if key.endswith("hooks") and isinstance(value, dict):  # the hooks themselves, in order
                value = list(value.values())
            elif "hooks" in key and isinstance(value, dict):  # flags of some hooks (with_kwargs=True, ...)
                value = [[handles[handle], flag] for handle, flag in value.items()]
            entry[key] = text(describe(value))
        structure[path] = entry
    return structure


def _hash_tensors(tree: Any, digest: Any) -> None:
    flat, _ = pytree.tree_flatten_with_path(tree)
    for path, leaf in flat:
        digest.update(pytree.keystr(path).encode())  # a parameter under another name is another problem
        if isinstance(leaf, torch.Tensor):
            digest.update(f"{leaf.dtype}{tuple(leaf.shape)}".encode())
            digest.update(tensor_bytes(leaf))
        else:
            digest.update(text(describe(leaf)).encode())


# -- the record ----------------------------------------------------------------------------------

_OLD_FORMATS = {
    1: "output_fn, groups, vmap_axes, the module's plain attributes, hooks and train/eval mode and the "
       "parameters' requires_grad flags",
}
"""Record formats this version refuses with a message, and what their fingerprints did not cover."""
_SHOWN = 4
"""Differences named in the message refusing another problem's record."""
_ROOT = ""


def _differences(stored: dict, problem: dict) -> list[str]:
    """What differs between a recorded problem and this call's, in words."""
    found = []
    for key in problem:
        recorded, now = stored.get(key), problem.get(key)
        if recorded == now:
            continue
        if key == "options" and isinstance(recorded, dict) and isinstance(now, dict):
            found += [
                f"{name}: recorded {_shown(recorded, name)}, now {_shown(now, name)}"
                for name in _union(recorded, now) if recorded.get(name) != now.get(name)
            ]
        elif key == "model" and isinstance(recorded, dict) and isinstance(now, dict):
            found += [f"model: {difference}" for difference in _module_differences(recorded, now)]
        elif key == "parameters":
            found.append(
                "parameters: the model's parameters or buffers differ (values, names, shapes, dtypes or "
                "requires_grad flags)"
            )
        elif key == "params" and isinstance(recorded, dict) and isinstance(now, dict):
            found += _params_differences(recorded, now)
        else:
            found.append(f"{key}: recorded {recorded!r}, now {now!r}")
    return found


def _params_differences(recorded: dict, now: dict) -> list[str]:
    """What differs in the ``params`` of two problems, in words."""
    found = []
    before, after = recorded.get("names"), now.get("names")
    if before != after:
        if isinstance(before, list) and isinstance(after, list):
            only_before = [name for name in before if name not in after]
            only_after = [name for name in after if name not in before]
            found.append(
                f"params: other parameters are differentiated (only in the record: {_listed(only_before)}; "
                f"only now: {_listed(only_after)})"
            )
        else:
            found.append(
                f"params: recorded {recorded.get('spelling', before)!r}, now {now.get('spelling', after)!r}"
            )
    if recorded.get("values") != now.get("values"):
        found.append("params: the parameter values given in `params` differ")
    return found


def _listed(names: list[str]) -> str:
    shown = ", ".join(map(repr, names[:_SHOWN]))
    return (shown + f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else shown) or "none"


def _module_differences(recorded: dict, now: dict) -> list[str]:
    found = []
    for path in _union(recorded, now):
        before, after = recorded.get(path), now.get(path)
        if before == after:
            continue
        where = "the model" if path == _ROOT else f"the model's submodule {path!r}"
        if before is None or after is None or before.get("class") != after.get("class"):
            classes = [entry["class"] if isinstance(entry, dict) else "nothing" for entry in (before, after)]
            found.append(f"{where}: recorded {classes[0]}, now {classes[1]}")
            continue
        where += f" ({after['class'].rsplit('.', 1)[-1]})"
        for key in _union(before, after):
            if before.get(key) != after.get(key):
                what = key.strip("_").replace("_", " ") if key.endswith("hooks") else f"attribute `{key}`"
                found.append(f"{what} of {where}: recorded {_shown(before, key)}, now {_shown(after, key)}")
    return found


def _union(first: dict, second: dict) -> list:
    return list(first) + [key for key in second if key not in first]


def _shown(entries: dict, key: str) -> str:
    if key not in entries:
        return "none" if key.endswith("hooks") else "nothing"
    return repr(entries[key])



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
        problem = json.loads(json.dumps(problem))  # as it reads back: lists for tuples, str keys
        record = cls(path, problem)
        if not os.path.exists(record.path):
            return record
        try:
            with open(record.path, encoding="utf-8") as file:
                saved = json.load(file)
            written = saved["format"]
            if written in _OLD_FORMATS:
                blocks, stored = {}, {}
            else:
                assert written == _FORMAT
                blocks = {(tuple(entry[0]), tuple(entry[1])): list(entry[2]) for entry in saved["blocks"]}
                stored = saved["problem"]
                assert isinstance(stored, dict)
        except (OSError, ValueError, KeyError, TypeError, IndexError, AssertionError) as error:
            raise ValueError(
                f"batch: `progress_file` {record.path!r} exists but is not a progress record of this "
                f"version of torchntk ({type(error).__name__}: {error}). Delete it to start over."
            ) from error
        if written in _OLD_FORMATS:
            raise ValueError(
                f"batch: `progress_file` {record.path!r} was written by an older version of torchntk "
                f"(record format {written!r}, now {_FORMAT}), whose records left out {_OLD_FORMATS[written]}, so "
                f"it cannot tell whether this call is the problem it recorded. Delete it and compute the "
                f"kernel afresh (a new `out`, or np.memmap(..., mode='w+'))."
            )
        different = _differences(stored, problem)
        if different:
            shown = "; ".join(different[:_SHOWN])
            if len(different) > _SHOWN:
                shown += f"; and {len(different) - _SHOWN} more"
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
