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
import inspect
import sys
import threading
from typing import Any, Callable, Iterator, Optional

import torch.utils.checkpoint  # noqa: F401  (a module whose globals the stand-ins replace)
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
    originals: dict[str, Any] = {}  # the functions the stand-ins defer to, by key of _STAND_INS
    owners: dict[str, tuple[Any, str, Any]] = {}  # where each stand-in was set, and what to restore
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


def _never_skipped(name: str) -> Callable[..., Any]:
    """Stands in for a Hugging Face test of whether an attention mask may be skipped (NOTE:
    [Attention masks under vmap]): on a thread computing a kernel the mask is always built."""

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        if _computing():
            return False
        return _State.originals[name](*args, **kwargs)

    return stand_in


_MASKS = "transformers.masking_utils"
_OLD_MASKS = "transformers.modeling_attn_mask_utils"
_STAND_INS: dict[str, tuple[str, str, Any]] = {
    "CheckpointFunction": ("torch.utils.checkpoint", "CheckpointFunction", _PlainCheckpoint),
    _STEPS: ("torch.utils.checkpoint", _STEPS, _plain_checkpoint_steps),
    f"{_MASKS}._ignore_causal_mask_sdpa": (_MASKS, "_ignore_causal_mask_sdpa", None),
    f"{_MASKS}._ignore_bidirectional_mask_sdpa": (_MASKS, "_ignore_bidirectional_mask_sdpa", None),
    f"{_OLD_MASKS}.AttentionMaskConverter._ignore_causal_mask_sdpa": (
        _OLD_MASKS, "AttentionMaskConverter._ignore_causal_mask_sdpa", None
    ),
}
"""The globals that checkpoints and Hugging Face's attention masks read at every call, as ``key:
(module, attribute path, stand-in)``; a stand-in of None is :func:`_never_skipped`. A module is
only patched when the user's code has imported it already (torchntk imports none of them)."""

# NOTE: [Attention masks under vmap]
# Hugging Face models build their attention masks with ``transformers.masking_utils``, which first
# asks whether the mask may be skipped (no padding: ``padding_mask.all()``) so that scaled dot-product
# attention can run unmasked or with ``is_causal=True``. That question reads a tensor's value, which
# ``vmap`` refuses ("data-dependent control flow"), so every masked transformer fell back to the slow
# per-example loop (NOTE: [Switching to example loops]). While a kernel is computed the question is
# answered "no" on the computing threads: the mask is built, which gives the same attention (the
# all-true or causal mask the skip stood for) and runs under ``vmap``. Older versions ask the same
# question in ``AttentionMaskConverter._ignore_causal_mask_sdpa``, replaced alike.


def _resolve(module_name: str, path: str) -> tuple[Any, str, Any]:
    """``(owner, attribute, current value)`` of ``module.path``, or ``(None, "", None)`` when the
    module is not imported or has no such attribute."""
    owner = sys.modules.get(module_name)
    *parents, attribute = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent, None)
    if owner is None or not hasattr(owner, attribute):
        return None, "", None
    return owner, attribute, inspect.getattr_static(owner, attribute)


@contextlib.contextmanager
def plain_checkpoints() -> Iterator[None]:
    """``checkpoint`` calls on this thread run their function directly, and Hugging Face attention
    masks are always built, while the context is active (NOTE: [Reentrant checkpoints], NOTE:
    [Attention masks under vmap]); reentrant, thread-safe, restores the globals after."""
    with _State.lock:
        if _State.count == 0:
            replacements = {}
            for key, (module_name, path, stand_in) in _STAND_INS.items():
                owner, attribute, original = _resolve(module_name, path)
                if owner is None:
                    continue
                replacement = _never_skipped(key) if stand_in is None else stand_in
                if isinstance(original, staticmethod):
                    replacement = staticmethod(replacement)
                replacements[key] = (owner, attribute, original, replacement)
            # Originals are added, never removed: a thread that looked a stand-in up just before
            # the last evaluation restored the globals still finds what to defer to.
            _State.originals.update({
                key: original.__func__ if isinstance(original, staticmethod) else original
                for key, (_, _, original, _) in replacements.items()
            })
            _State.owners = {key: entry[:3] for key, entry in replacements.items()}
            for owner, attribute, _, replacement in replacements.values():
                setattr(owner, attribute, replacement)
        _State.count += 1
    _State.local.depth = getattr(_State.local, "depth", 0) + 1
    try:
        yield
    finally:
        _State.local.depth -= 1
        with _State.lock:
            _State.count -= 1
            if _State.count == 0:
                for owner, attribute, original in _State.owners.values():
                    setattr(owner, attribute, original)
                _State.owners = {}
