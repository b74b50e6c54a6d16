"""Descriptions of Python values that are equal in every process exactly when the values are alike.

A progress record (NOTE: [Kernels on disk] in ``_disk.py``) is resumed by a later process, so what
it says about the problem cannot use ``id()``, ``hash()`` of strings or reprs with addresses, which
``_model/fingerprint.py`` uses for comparisons within one process. :func:`describe` turns a value
into JSON data (strings, lists and dicts with string keys), which survive the record's JSON
round trip unchanged:

* scalars (``None``, bools, numbers, strings) become their ``repr`` (so ``1.0``, ``1`` and
  ``'1.0'`` stay apart), dtypes and devices their ``str``;
* tensors and arrays become their shape, dtype and a hash of their values;
* lists, tuples and dicts are described item by item, sets in a sorted order (their subclasses
  through the built-in base's methods, never their own);
* functions become ``module.qualname#hash`` where the hash covers the bytecode and constants of
  their code (nested code included), their default arguments, the contents of their closure cells
  and the scalars and tensors among the globals their code names (a changed ``SCALE = 2.0`` at
  module level changes it). Helper functions they call are only named, not followed. Bytecode
  differs between Python versions, so a record written under another version does not resume;
* bound methods are their function and their object, ``functools.partial`` its function and
  arguments, modules (``nn.Module``) their class only (a module's own attributes are described by
  ``_disk.module_structure``), classes their qualified name;
* other objects are their class and, a few levels deep, their instance attributes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import numbers
import os
import time
import types
from typing import Any

import numpy as np
import torch

_DEPTH = 4
"""Containers and objects nested deeper than this are described by their type alone."""
_SHORT = 96
"""Descriptions longer than this (as JSON) are kept as a prefix and a hash (:func:`text`)."""
_SCALARS = (type(None), bool, numbers.Number, str, bytes)


def digest(data: bytes, size: int = 16) -> str:
    return hashlib.blake2b(data, digest_size=size).hexdigest()


def describe(value: Any, depth: int = 0, seen: frozenset = frozenset()) -> Any:
    """``value`` as JSON data, equal between processes for alike values (see the module's doc)."""
    if isinstance(value, _SCALARS) or isinstance(value, enum.Enum):
        return _repr(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, torch.Tensor):
        return tensor_text(value)
    if isinstance(value, np.ndarray):
        return f"array{list(value.shape)} {value.dtype} #{digest(np.ascontiguousarray(value).tobytes(), 8)}"
    if isinstance(value, type):
        return f"class {_name(value)}"
    if isinstance(value, torch.nn.Module):  # its state is the module tree's business, or not part of this value
        return f"module {_name(type(value))}"
    if id(value) in seen or depth >= _DEPTH:  # a cycle (a recursive closure), or deep enough
        return _name(type(value))
    seen = seen | {id(value)}
    deeper = depth + 1
    # Subclasses of the built-in containers (a namedtuple, e3nn's Irreps, whose len raises) are
    # read through their built-in base's methods, which run none of their own code.
    for base in (list, tuple):
        if isinstance(value, base):
            return [describe(item, deeper, seen) for item in base.__iter__(value)]
    if isinstance(value, dict):
        return {_key(key, deeper, seen): describe(item, deeper, seen) for key, item in dict.items(value)}
    for base in (set, frozenset):
        if isinstance(value, base):
            return sorted((describe(item, deeper, seen) for item in base.__iter__(value)), key=json.dumps)
    if isinstance(value, types.FunctionType):
        return _function(value, seen)
    if isinstance(value, types.MethodType):
        return {"method": describe(value.__func__, deeper, seen), "of": describe(value.__self__, deeper, seen)}
    if isinstance(value, functools.partial):
        return {"partial": describe(value.func, deeper, seen), "args": describe(value.args, deeper, seen),
                "keywords": describe(value.keywords, deeper, seen)}
    if isinstance(value, (types.BuiltinFunctionType, types.BuiltinMethodType)) or callable(value) and _attribute(
        value, "__dict__"
    ) is None:  # C functions (torch.tanh) and C-level callables: their name is all there is
        return f"{getattr(value, '__module__', None) or ''}.{getattr(value, '__qualname__', _name(type(value)))}"
    if dataclasses.is_dataclass(value):
        fields = {field.name: describe(_attribute(value, field.name), deeper, seen)
                  for field in dataclasses.fields(value)}
        return {"class": _name(type(value)), "fields": fields}
    state = _attribute(value, "__dict__")
    if type(state) is dict:
        return {"class": _name(type(value)), "state": describe(state, deeper, seen)}
    return _name(type(value))


def _repr(value: Any) -> str:
    """``repr`` of a scalar; where a subclass's own ``repr`` raises, a text no other process
    repeats, so that a record is never resumed for a value that cannot be described."""
    try:
        text = repr(value)
        if type(text) is str:
            return text
    except Exception:  # noqa: BLE001 - any failure of user code
        pass
    return f"unrepresentable {_name(type(value))} #{os.getpid()}:{id(value):x}:{time.monotonic_ns()}"


def _attribute(value: Any, name: str) -> Any:
    """``value.name`` as stored, without the object's own ``__getattribute__`` or ``__getattr__``;
    None where it has none."""
    try:
        return object.__getattribute__(value, name)
    except Exception:  # noqa: BLE001 - a property or slot that raises
        return None


def text(description: Any, limit: int = _SHORT) -> str:
    """A description as a short string: itself for strings, its JSON otherwise, a prefix and a
    hash of the whole when longer than ``limit`` (so records stay small and messages readable)."""
    shown = description if isinstance(description, str) else json.dumps(description, separators=(",", ":"))
    if len(shown) <= limit:
        return shown
    return f"{shown[:limit // 2]}... #{digest(shown.encode(), 8)}"


def tensor_text(tensor: torch.Tensor) -> str:
    """Shape, dtype and a hash of the values (on any device)."""
    return f"tensor{list(tensor.shape)} {tensor.dtype} #{digest(tensor_bytes(tensor), 8)}"


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    data = tensor.detach().to("cpu").contiguous().reshape(-1)
    return data.view(torch.uint8).numpy().tobytes() if data.numel() else b""


def _key(key: Any, depth: int, seen: frozenset) -> str:
    described = describe(key, depth, seen)
    return described if isinstance(described, str) else json.dumps(described)


def _name(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"


def _function(function: types.FunctionType, seen: frozenset) -> str:
    """``module.qualname#hash`` of code, defaults, closure and named global scalars and tensors."""
    cells = []
    for cell in function.__closure__ or ():
        try:
            cells.append(describe(cell.cell_contents, 1, seen))
        except ValueError:  # a cell not yet filled
            cells.append("<empty cell>")
    names = _global_names(function.__code__)
    namespace = function.__globals__
    globals_read = {
        name: describe(namespace[name], 1, seen) for name in names
        if name in namespace and isinstance(namespace[name], (_SCALARS, torch.Tensor, np.ndarray))
    }
    parts = [_code(function.__code__), describe(function.__defaults__, 1, seen),
             describe(function.__kwdefaults__, 1, seen), cells, globals_read]
    return f"{function.__module__}.{function.__qualname__}#{digest(json.dumps(parts).encode(), 6)}"


def _code(code: types.CodeType) -> list:
    constants = [_code(constant) if isinstance(constant, types.CodeType) else describe(constant)
                 for constant in code.co_consts]
    return [code.co_code.hex(), constants, list(code.co_names)]


def _global_names(code: types.CodeType) -> list[str]:
    """Names the code (and the code nested in it) may read as globals."""
    names = list(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names += _global_names(constant)
    return sorted(set(names))
