"""The planners that kernel functions of one model, built with the same options, share.

NOTE: [Plans shared by kernel functions]
A kernel function plans each key once (NOTE: [The planning stage]), and the first call of a key
pays for it: the ``vmap_axes`` checks, AUTO's choice, implementation 3's plan and its check, a
few passes of the model each. Users rebuild kernel functions: ``empirical_ntk_fn(model)(x)`` as a
one-liner every few hundred training steps, a helper that builds one per evaluation, a notebook
cell run again. Each new kernel function used to plan again what an earlier one with the same
model and options had planned, though its records hold exactly what the new one's first call
would find: a plan depends on the key (input shapes, the module's structure and modes, NOTE:
[Plan keys]) and on the builder's options, never on tensor values. So kernel functions of one
model built by one builder with the same options share one :class:`~.stage.Planner`: a rebuilt
kernel function's first call is a warm call of the key, bound to the plan the first kernel
function made, with the same guarantees as any warm call (the NaN check on every call, the
output check on every call with ``check_vmap_axes=True``; the checks that run once per key ran on
the first call of the first kernel function), and the key's output notices given once by each
kernel function (NOTE: [Output notices]).

The options are compared by value where they are plain (numbers, strings, dtypes, devices,
enumerations, and tuples, lists and dicts of them; ``implementation``, ``trace_axes`` and
``diagonal_axes`` as the builder parses them, so that ``implementation=0`` shares with the
default ``NtkImplementation.AUTO`` and ``trace_axes=[-1]`` with ``(-1,)``) and by identity
otherwise (an ``output_fn``, a ``groups`` predicate or module): a lambda made anew for each kernel
function is a new option, and its kernel functions plan anew. The model and the option objects are held weakly, so a shared
planner never keeps a model or its options alive: it is dropped when the model is, and when an
option object it was built with is gone (a lambda ``output_fn`` written anew in a training loop
leaves at most one planner behind, dropped when the next kernel function of the model is built;
the gone object's address, which another may reuse, matches nothing). Options that take no weak
reference (a named tuple holding a module, say) and models that take none are not shared.
Captured kernels (``compile=``) keep their own planner, beside their graphs. At most
:data:`_OPTION_SETS` option sets are kept per model, the least recently built dropped first.
"""

from __future__ import annotations

import enum
import threading
import weakref
from typing import Any, Callable

from .._utils.values import PLAIN, Identity
from .stage import Planner

__all__ = ["forget_shared_planners", "shared_planner"]

_OPTION_SETS = 8
"""Option sets whose planners are kept per model, the least recently built dropped first."""

_MODELS: dict[int, tuple[weakref.ref, dict]] = {}
"""``id(model) -> (weak reference to it, {options: (planner, weak references to its option objects)})``."""

_LOCK = threading.Lock()


class _Unshared(Exception):
    """An option that cannot be compared without holding it (raised and caught in this module)."""


def shared_planner(model: Any, options: tuple, make: Callable[[], Planner]) -> Planner:
    """The planner of the kernel functions of ``model`` built with ``options`` (the builder's name
    and its arguments), made by ``make()`` the first time; a planner of its own where the model or
    an option cannot be held weakly (NOTE: [Plans shared by kernel functions])."""
    held: list[weakref.ref] = []
    try:
        key = _described(options, 0, held)
    except _Unshared:
        return make()
    identity = id(model)
    with _LOCK:
        entry = _MODELS.get(identity)
        if entry is None or entry[0]() is not model:
            try:
                reference = weakref.ref(model, lambda gone, identity=identity: _forget(identity, gone))
            except TypeError:  # a model without weak references: nothing can be kept for it
                return make()
            entry = _MODELS[identity] = (reference, {})
        planners = entry[1]
        gone = [options for options, (_, objects) in planners.items() if any(one() is None for one in objects)]
        for options in gone:  # an option object is gone, and with it the kernel functions built with it
            del planners[options]
        found = planners.pop(key, None)
        planner, objects = (make(), held) if found is None else found
        planners[key] = (planner, objects)  # the most recently built last
        while len(planners) > _OPTION_SETS:
            del planners[next(iter(planners))]
    return planner


def _forget(identity: int, gone: weakref.ref) -> None:
    # runs when the model is freed, maybe inside a garbage collection while this thread holds
    # _LOCK: no lock here (one dictionary operation, atomic under the GIL, drops only this entry)
    if _MODELS.get(identity, (None,))[0] is gone:
        _MODELS.pop(identity, None)


_DEPTH = 8


def _described(value: Any, depth: int, held: list) -> Any:
    """``value`` as a key part: plain values by value, exact tuples, lists and dicts by their
    entries, enumeration members by type and value, anything else by weak identity (a weak
    reference to it appended to ``held``)."""
    kind = type(value)
    if kind in PLAIN:
        return (kind, value)
    if isinstance(value, enum.Enum):
        return (kind, _described(value.value, depth + 1, held))
    if depth < _DEPTH and (kind is tuple or kind is list):
        return (kind, tuple(_described(entry, depth + 1, held) for entry in value))
    if depth < _DEPTH and kind is dict:
        return (kind, tuple(
            (_described(name, depth + 1, held), _described(entry, depth + 1, held)) for name, entry in value.items()
        ))
    try:
        held.append(weakref.ref(value))
    except TypeError:
        raise _Unshared from None  # Identity would hold it, and it may hold the model
    return (kind, Identity(value))


def forget_shared_planners() -> None:
    """Drops every shared planner, so that kernel functions built after it plan anew: the tests'
    switch, for a test that changes a module constant between two kernel functions of one model
    (and, in ``tests/conftest.py``, between tests that reuse a model)."""
    _MODELS.clear()
