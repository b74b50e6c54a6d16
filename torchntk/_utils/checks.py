"""Argument validators shared by the public functions.

Every message starts with the public function (``where``), names the argument, shows the value
received and says what was expected, so a user can fix the call from the message alone.
"""

from __future__ import annotations

import datetime
import math
import numbers
import os
import sys
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .types import NtkImplementation
from .values import safe_repr


def show(value: Any) -> str:
    return f"{safe_repr(value)} ({type(value).__name__})"


def leaves_with_names(tree: Any, root: str) -> list[tuple[str, Any]]:
    """``(name, leaf)`` for every non-``None`` leaf of ``tree``, named like ``x1['image'][0]``."""
    leaves, _ = pytree.tree_flatten_with_path(tree)
    return [(root + pytree.keystr(path), leaf) for path, leaf in leaves if leaf is not None]


def _is_numpy_array(value: Any) -> bool:
    kind = type(value)
    return kind.__name__ == "ndarray" and kind.__module__ == "numpy"


def input_argument(value: Any, name: str, where: str, *, required: bool = False) -> None:
    """Checks the input pytree ``value`` (``x1`` or ``x2``): its leaves must include a tensor.

    Numpy arrays are not converted, as PyTorch modules and ``torch.func`` do not convert them either:
    the dtype and device the model needs are the caller's choice (numpy's default float64 would
    not fit a float32 model), and a silent copy to the device would hide a cost. Nested lists of
    Python numbers are refused for the same reason. Non-tensor leaves next to tensors (a flag in a
    dict of inputs) are left to the model. ``required``: ``value`` must not be None (``x1``).

    Raises:
        TypeError: a numpy leaf (named, with its shape and dtype), or leaves none of which is a tensor.
        ValueError: ``required`` and ``value`` is None or holds only None.

    Example:
        >>> input_argument([[1.0, 2.0]], "x1", "ntk_fn")
        Traceback (most recent call last):
        TypeError: ntk_fn: `x1` must be a tensor or a pytree of tensors, got [[1.0, 2.0]] (list),
        which holds no tensor (x1[0][0] is 1.0 (float)). Convert it with torch.tensor(...), in the
        dtype and on the device of the model's parameters.
    """
    leaves = leaves_with_names(value, name)
    for leaf_name, leaf in leaves:
        if _is_numpy_array(leaf):
            raise TypeError(
                f"{where}: `{name}` must be a tensor or a pytree of tensors, but {leaf_name} is a numpy.ndarray "
                f"of shape {tuple(leaf.shape)} and dtype {leaf.dtype}. Convert it with "
                f"torch.from_numpy(...).to(dtype, device), in the dtype and on the device of the model's parameters."
            )
    if not leaves:
        if required:
            raise ValueError(f"{where}: `{name}` must contain at least one tensor, got {show(value)}.")
        return
    if not any(isinstance(leaf, torch.Tensor) for _, leaf in leaves):
        leaf_name, leaf = leaves[0]
        inside = "" if leaf_name == name else f", which holds no tensor ({leaf_name} is {show(leaf)})"
        raise TypeError(
            f"{where}: `{name}` must be a tensor or a pytree of tensors, got {show(value)}{inside}. Convert it "
            f"with torch.tensor(...), in the dtype and on the device of the model's parameters."
        )


def non_finite_count(tensor: torch.Tensor) -> int:
    """How many entries of a floating or complex tensor are NaN or infinite (0 for other dtypes)."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return 0
    return int((~torch.isfinite(tensor)).sum())


def finite_tensor_argument(value: torch.Tensor, name: str, where: str) -> None:
    """Raises ValueError when the tensor argument ``name`` holds NaN or infinite entries."""
    count = non_finite_count(value)
    if count:
        raise ValueError(
            f"{where}: `{name}` holds {count} NaN or infinite entr{'y' if count == 1 else 'ies'} (shape "
            f"{tuple(value.shape)}); every result computed from it would be NaN. Find where the NaN/Inf "
            f"come from (e.g. a kernel computed from NaN inputs or parameters) and remove them."
        )


def real_number_argument(value: Any, name: str, where: str) -> float:
    """A finite real number (an int, a float or a one-element real tensor) as a float.

    Raises:
        TypeError: a string, a bool, a complex number or anything else that is not a real number.
        ValueError: NaN or infinite.
    """
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
        number = float(value.item())
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{where}: `{name}` must be a real number, got {show(value)}.")
    else:
        number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{where}: `{name}` must be a finite number, got {show(value)}.")
    return number


def axes_argument(value: Any, name: str, where: str) -> tuple[int, ...]:
    """Checks the type of ``trace_axes``/``diagonal_axes``; an int means one axis."""
    if isinstance(value, bool):
        raise TypeError(f"{where}: `{name}` must be an int or a sequence of ints, got {show(value)}.")
    if isinstance(value, numbers.Integral):
        return (int(value),)
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{where}: `{name}` must be an int or a sequence of ints, got {show(value)}.")
    axes = tuple(value)
    for axis in axes:
        if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
            raise TypeError(
                f"{where}: `{name}` must contain only ints, got {show(value)} "
                f"with element {show(axis)}."
            )
    return tuple(int(axis) for axis in axes)


def implementation_argument(value: Any, where: str) -> NtkImplementation:
    """Accepts an :class:`NtkImplementation` or a plain int in 0..3."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{where}: `implementation` must be an NtkImplementation or an int in 0..3, got {show(value)}."
        )
    if int(value) not in {member.value for member in NtkImplementation}:
        raise ValueError(
            f"{where}: `implementation` must be one of 0 (AUTO), 1 (JACOBIAN_CONTRACTION), "
            f"2 (NTK_VECTOR_PRODUCTS) or 3 (STRUCTURED_DERIVATIVES), got {show(value)}."
        )
    return NtkImplementation(int(value))


def positive_int_argument(value: Any, name: str, where: str, *, none_allowed: bool = False, meaning: str = "") -> Any:
    """``value`` as an int >= 1 (``None`` too where ``none_allowed``): the one check of every argument
    that counts something (``chunk_size``, ``k``, ``block_size``, ...); ``meaning`` is said after the
    name in the message (e.g. ``"the number of features"``).

    Raises:
        TypeError: not an int (bools included), nor ``None`` where allowed.
        ValueError: zero or negative.

    Example:
        >>> positive_int_argument(3, "k", "f"), positive_int_argument(None, "chunk_size", "f", none_allowed=True)
        (3, None)
        >>> positive_int_argument(0, "k", "f", meaning="the number of features")
        Traceback (most recent call last):
        ValueError: f: `k` (the number of features) must be a positive int, got 0 (int).
    """
    if value is None and none_allowed:
        return None
    label = f"`{name}` ({meaning})" if meaning else f"`{name}`"
    expected = "None or a positive int" if none_allowed else "a positive int"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: {label} must be {expected}, got {show(value)}.")
    if value < 1:
        raise ValueError(f"{where}: {label} must be {expected}, got {show(value)}.")
    return int(value)


def callable_model_argument(f: Any, where: str) -> None:
    if not isinstance(f, torch.nn.Module) and not callable(f):
        raise TypeError(
            f"{where}: `f` must be an nn.Module or a callable f(params, x, **kwargs), got {show(f)}."
        )


def bool_argument(value: Any, name: str, where: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: `{name}` must be True or False, got {show(value)}.")
    return value



def timeout_argument(value: Any, where: str) -> float:
    """A timeout for collectives across processes, in seconds: a number or a ``timedelta``.

    The one check of every ``timeout`` argument (``batch``, Monte Carlo, ``torchntk.distributed``):
    collectives take a ``timedelta``, which cannot be infinite.

    Raises:
        TypeError: neither a number nor a ``timedelta`` (bools included).
        ValueError: not positive, or not finite.
    """
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise TypeError(f"{where}: `timeout` must be seconds (a number) or a timedelta, got {show(value)}.")
    if not seconds > 0:
        raise ValueError(f"{where}: `timeout` must be a positive number of seconds, got {show(value)}.")
    if not math.isfinite(seconds):
        raise ValueError(f"{where}: `timeout` must be a finite number of seconds, got {show(value)}.")
    return float(seconds)


def non_negative_int_argument(value: Any, name: str, where: str, zero_means: str = "") -> int:
    """``value`` as an int >= 0; ``zero_means`` explains 0 in the message (e.g. ``"one block"``).

    Raises:
        TypeError: not an int (bools included).
        ValueError: negative.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: `{name}` must be a non-negative int, got {show(value)}.")
    if value < 0:
        zero = f"0 ({zero_means})" if zero_means else "0"
        raise ValueError(f"{where}: `{name}` must be {zero} or positive, got {value}.")
    return int(value)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The command line calls the library as a user would: its frames are where its warnings belong.
_COMMAND_LINE = os.path.join(_PACKAGE, "cli") + os.sep
_THREAD_STARTERS = ("threading", "concurrent.futures")


def user_stacklevel() -> int:
    """The ``stacklevel`` that attributes a warning to the line that called torchntk: the first
    frame, counted from the caller of ``warnings.warn``, whose file is outside the package or in
    its command line (``torchntk/cli``). Without such a frame (the top of the stack, or the start
    of one of torchntk's worker threads), the outermost frame of torchntk."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_PACKAGE + os.sep) or path.startswith(_COMMAND_LINE):
            break
        frame, level = frame.f_back, level + 1
    if level > 1 and frame.f_globals.get("__name__", "").startswith(_THREAD_STARTERS):
        return level - 1  # a worker thread of torchntk's (batch): no user line above it
    return level
