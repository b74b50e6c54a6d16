"""Models in the wrappers users hold them in: compiled modules and reentrant checkpoints.

NOTE: [Compiled modules]
``torch.compile(model)`` returns an ``OptimizedModule`` that registers the model as its submodule
``_orig_mod`` and whose ``forward`` is the compiled ``model.__call__``, bound to the user's own
module object. Evaluated through a private shell (``_model/shell.py``), that bound call still runs
the user's module with the user's tensors, not the tensors ``functional_call`` swapped into the
shell, so every derivative was zero. A kernel is a ``torch.func`` transform of the forward pass,
which the compiled graph would not serve anyway (dynamo falls back to eager under transforms), so
the wrapper is looked through: the kernel is computed on the module it wraps, eagerly, and the
parameters keep the wrapper's names (``_orig_mod.0.weight``, as the user's object lists them).
``model.compile()`` (compiling in place) stores a compiled ``_call_impl`` bound to the module;
shells drop it for the same reason. A compiled function ``f(params, x)`` is called uncompiled too:
dynamo cannot trace the function modes of structured derivatives. ``compile=True`` is how to ask
torchntk for a compiled kernel (``_kernel/captured.py``).

NOTE: [Reentrant checkpoints]
``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)`` runs ``fn`` inside the
``autograd.Function`` ``CheckpointFunction``, which has no ``setup_context`` and so cannot be
transformed by ``torch.func`` (and runs ``fn`` under ``torch.no_grad``, hiding parameters from
derivatives whose inputs do not require grad); ``use_reentrant=False`` installs saved-tensor hooks,
which ``torch.func``'s reverse mode refuses. ``checkpoint`` looks both mechanisms up in its
module's globals at every call, so while torchntk evaluates a model (:func:`plain_checkpoints`)
those globals are stand-ins that call ``fn(*args)`` directly on the threads doing so, and defer to
the real ones on every other thread. Checkpointing only trades memory for recomputation,
so the values, and the derivatives of the plain call, are the function's own. A reference count
installs the stand-in on the first concurrent evaluation and restores the original global after
the last, so user code that bound ``checkpoint`` at import is covered and nothing stays patched.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

import torch.utils.checkpoint as _checkpoint_module
from torch import nn

_WRAPPED = "_orig_mod"
"""The attribute under which ``torch.compile``'s ``OptimizedModule`` holds the module it compiles."""


def compiled_wrapper(module: nn.Module) -> Optional[tuple[nn.Module, str]]:
    """``(wrapped module, name prefix)`` when ``module`` is a compile wrapper (NOTE: [Compiled
    modules]), else None. Nested wrappers are looked through to the innermost module; the prefix
    is what the wrapper's parameter names add to the wrapped module's (``"_orig_mod."``), or
    ``""`` when the wrapped module is held but not registered (the wrapper then lists no
    parameters of its own and the wrapped module's names are used).

    Only a module whose only content is the wrapped module counts: a module of the user's that
    happens to hold an ``_orig_mod`` next to parameters of its own is evaluated as it is.

    Example:
        >>> import torch
        >>> inner = torch.nn.Linear(2, 2)
        >>> compiled = torch.compile(inner, backend="eager")
        >>> found, prefix = compiled_wrapper(compiled)
        >>> found is inner, prefix, compiled_wrapper(inner)
        (True, '_orig_mod.', None)
    """
    prefix, current, found = "", module, False
    while True:
        state = current.__dict__
        modules = state.get("_modules")
        modules = modules if isinstance(modules, dict) else {}  # TorchScript keeps its own table type
        registered = modules.get(_WRAPPED)
        inner = registered if registered is not None else state.get(_WRAPPED)
        if not isinstance(inner, nn.Module) or inner is current:
            break
        if state.get("_parameters") or state.get("_buffers") or set(modules) - {_WRAPPED}:
            break
        if registered is None:
            prefix = ""  # the wrapper lists none of the wrapped module's parameters
        else:
            prefix += _WRAPPED + "."
        current, found = inner, True
    return (current, prefix) if found else None


def compiled_function(f: Callable[..., Any]) -> Callable[..., Any]:
    """The function ``torch.compile(f)`` compiled, or ``f`` itself (NOTE: [Compiled modules]):
    traced into torchntk's own function modes (structured derivatives), dynamo fails inside them.

    Example:
        >>> import torch
        >>> def f(p, x):
        ...     return p * x
        >>> compiled_function(torch.compile(f, backend="eager")) is f, compiled_function(f) is f
        (True, True)
    """
    while not isinstance(f, nn.Module):
        inner = getattr(f, "_torchdynamo_orig_callable", None)
        if inner is None or inner is f or not callable(inner):
            break
        f = inner
    return f


class _State:
    """The reference count of the evaluations running now, and the globals the stand-ins replaced."""

    lock = threading.Lock()
    count = 0
    originals: dict[str, Any] = {}
    local = threading.local()  # ``depth``: this thread's evaluations in progress


def _computing() -> bool:
    return bool(getattr(_State.local, "depth", 0))


class _PlainCheckpoint:
    """Stands in for ``torch.utils.checkpoint.CheckpointFunction`` (NOTE: [Reentrant checkpoints])."""

    @staticmethod
    def apply(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        if _computing():
            return function(*args)
        return _State.originals["CheckpointFunction"].apply(function, preserve_rng_state, *args)


def _plain_checkpoint_steps(*arguments: Any, **kwargs: Any) -> Iterator[None]:
    """Stands in for the generator of ``use_reentrant=False``, whose saved-tensor hooks
    ``torch.func`` refuses: ``checkpoint`` runs the function between its two steps, and here they
    do nothing on a thread computing a kernel."""
    if _computing():
        yield
        return
    yield from _State.originals[_STEPS](*arguments, **kwargs)


_STEPS = "_checkpoint_without_reentrant_generator"
_STAND_INS = {"CheckpointFunction": _PlainCheckpoint, _STEPS: _plain_checkpoint_steps}
"""The globals of ``torch.utils.checkpoint`` that ``checkpoint`` reads at every call, and their stand-ins."""


@contextlib.contextmanager
def plain_checkpoints() -> Iterator[None]:
    """``checkpoint`` calls on this thread run their function directly while the context is active
    (NOTE: [Reentrant checkpoints]); reentrant, thread-safe, restores the globals after."""
    with _State.lock:
        if _State.count == 0:
            _State.originals = {
                name: getattr(_checkpoint_module, name) for name in _STAND_INS if hasattr(_checkpoint_module, name)
            }
            for name in _State.originals:
                setattr(_checkpoint_module, name, _STAND_INS[name])
        _State.count += 1
    _State.local.depth = getattr(_State.local, "depth", 0) + 1
    try:
        yield
    finally:
        _State.local.depth -= 1
        with _State.lock:
            _State.count -= 1
            if _State.count == 0:
                for name, original in _State.originals.items():
                    setattr(_checkpoint_module, name, original)
                _State.originals = {}
