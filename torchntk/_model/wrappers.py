"""Models in the wrappers users hold them in: compiled modules and activation checkpoints.

NOTE: [Compiled modules]
``torch.compile(model)`` returns an ``OptimizedModule`` that registers the model as its submodule
``_orig_mod`` and whose ``forward``, set on the instance, is the compiled ``model.__call__``, bound
to the user's own module object. Evaluated through a private shell (``_model/shell.py``), that
bound call still runs the user's module with the user's tensors, not the tensors
``functional_call`` swapped into the shell: no transform tracks them. A kernel is a ``torch.func``
transform of the forward pass, which the compiled graph would not serve anyway (dynamo falls back
to eager under transforms), so a compile wrapper is computed on the module it wraps, eagerly, and
the parameters keep the names the user's object lists (``_orig_mod.0.weight``):

* a top-level wrapper is looked through (:func:`compiled_wrapper`): the functional model evaluates
  the wrapped module under the wrapper's names less their prefix;
* a wrapper inside the model (``outer.block = torch.compile(block)``, at any depth, several, or
  inside a compiled top-level module) is shelled like any module, and its shell's ``forward`` calls
  the shell of the wrapped module (:func:`uncompiled_forward`), so the call reaches the shell's
  tables, which hold torchntk's tensors.

A wrapper is a module whose only content is the wrapped module under ``_orig_mod`` and whose
instance ``forward`` is known to call it: an ``OptimizedModule``, or the wrapped module's bound
``__call__``, compiled or not. Any other ``forward`` may compute something
else: such a module is evaluated as it is (a ``forward`` defined by its class then reaches the
shell's copies; one bound to the user's objects is refused by NOTE: [Aliased parameters]), never
replaced by a guess.
``model.compile()`` (compiling in place) stores a compiled ``_call_impl`` bound to the module;
shells drop it for the same reason. A compiled function ``f(params, x)`` is called uncompiled too:
dynamo cannot trace the function modes of structured derivatives. ``compile=True`` is how to ask
torchntk for a compiled kernel (``_kernel/captured.py``).

NOTE: [Checkpoints run plain]
Activation checkpointing trades memory for recomputation: the checkpointed function's outputs, and
the derivatives of the plain call, are the function's own. Its machinery cannot run under
``torch.func``: ``checkpoint(fn, *args, use_reentrant=True)`` runs ``fn`` inside the
``autograd.Function`` ``CheckpointFunction``, which has no ``setup_context`` (and runs ``fn`` under
``torch.no_grad``, hiding the parameters from derivatives whose inputs do not require grad);
``use_reentrant=False`` installs saved-tensor hooks, which ``torch.func``'s reverse mode refuses. So
while torchntk evaluates a model, checkpointed regions run as their plain forward, and the kernel is
that of the same model without checkpointing (exactly: the same operations run once, in the same
order). How, without touching the model: ``checkpoint`` looks its machinery up in its module's
globals at every call (``CheckpointFunction``, and the generator of ``use_reentrant=False``, named
``_checkpoint_without_reentrant_generator`` up to PyTorch 2.13 and ``..._impl`` from 2.14), so
while any thread evaluates a model (:func:`plain_checkpoints`) those globals are stand-ins. On the
threads computing a kernel the reentrant stand-in calls ``fn(*args)``, and the generator's two steps
only enter and leave the forward context of the call's ``context_fn`` (a user's context, e.g.
autocast, changes values; selective checkpointing's caching mode only keeps results and is left
out); on every other thread they defer to the real ones. Whatever reaches ``checkpoint`` is
covered: a call of ``torch.utils.checkpoint.checkpoint``, a ``checkpoint`` bound at import or in a
``functools.partial`` (Hugging Face's ``_gradient_checkpointing_func``, bound when checkpointing is
enabled), ``checkpoint_sequential``, timm's ``checkpoint_seq``, PyTorch 2.14's decorator form
``checkpoint(use_reentrant=False)(fn)``; the composable ``torch.distributed._composable.checkpoint``,
which imported the generator under its own name, gets the same stand-in there. Hugging Face's
``gradient_checkpointing_enable(offload=True)`` also wraps each checkpoint in ``save_on_cpu``, whose
saved-tensor hooks only move activations to the host and back; the name it calls is an empty
context on computing threads. Argument checks stay PyTorch's (keyword arguments with
``use_reentrant=True`` still raise). A reference count installs the stand-ins on the first
concurrent evaluation and restores the original globals after the last, also when an evaluation
raises, so nothing stays patched; the stand-ins keep no state of their own. A module imported while
they are set (importing ``torch._dynamo`` the first time imports the composable checkpoint) binds
them under its own names; it gets the originals back at the restore (:func:`_rebind_leaked`), and
a stand-in is never taken for an original. The hooks that Hugging Face's checkpointing set-up puts
on the input embeddings are the other half of a training set-up (NOTE: [Hooks that ask for
gradients] in ``_model/requires_grad.py``).
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
from typing import Any, Callable, Iterator, Optional

import torch
import torch.utils.checkpoint  # noqa: F401  (a module whose globals the stand-ins replace)
from torch import nn

_WRAPPED = "_orig_mod"
"""The attribute under which ``torch.compile``'s ``OptimizedModule`` holds the module it compiles."""


def _optimized_module_class() -> Optional[type]:
    """``OptimizedModule``, or None while ``torch._dynamo`` (heavy to import) is not loaded: then no
    module compiled by ``torch.compile`` exists."""
    return getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)


def _wrapped(module: nn.Module) -> Optional[tuple[nn.Module, bool]]:
    """``(wrapped module, whether it is registered)`` when ``module`` is one compile wrapper (NOTE:
    [Compiled modules]), else None."""
    state = module.__dict__
    modules = state.get("_modules")
    modules = modules if isinstance(modules, dict) else {}  # TorchScript keeps its own table type
    registered = modules.get(_WRAPPED)
    inner = registered if registered is not None else state.get(_WRAPPED)
    if not isinstance(inner, nn.Module) or inner is module:
        return None
    if state.get("_parameters") or state.get("_buffers") or set(modules) - {_WRAPPED}:
        return None
    optimized = _optimized_module_class()
    if optimized is None or not isinstance(module, optimized):
        forward = state.get("forward")
        if forward is None:
            return None  # the class's forward: what it computes is its own, evaluated as it is
        forward = compiled_function(forward)
        method = getattr(forward, "__func__", None)
        # the wrapped module's own call, hooks included, which the shell's forward makes again
        if getattr(forward, "__self__", None) is not inner or method is None or method is not getattr(
            type(inner), "__call__", None
        ):
            return None
    return inner, registered is not None


def compiled_wrapper(module: nn.Module) -> Optional[tuple[nn.Module, str]]:
    """``(wrapped module, name prefix)`` when ``module`` is a compile wrapper (NOTE: [Compiled
    modules]), else None. Nested wrappers are looked through to the innermost module; the prefix
    is what the wrapper's parameter names add to the wrapped module's (``"_orig_mod."``), or
    ``""`` when the wrapped module is held but not registered (the wrapper then lists no
    parameters of its own and the wrapped module's names are used).

    Only a module whose only content is the wrapped module, and whose forward is known to call it,
    counts: a module of the user's that happens to hold an ``_orig_mod`` is evaluated as it is.

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
        wrapped = _wrapped(current)
        if wrapped is None:
            break
        inner, registered = wrapped
        # an unregistered wrapped module: the wrapper lists none of its parameters
        prefix = prefix + _WRAPPED + "." if registered else ""
        current, found = inner, True
    return (current, prefix) if found else None


def uncompiled_forward(original: nn.Module, shell_modules: dict[str, Any]) -> Optional[Callable[..., Any]]:
    """The ``forward`` of the shell of ``original`` when it is a compile wrapper holding a registered
    module (NOTE: [Compiled modules]): the eager call of the wrapped module's shell, found in
    ``shell_modules`` (the shell's submodule table). None for every other module, whose shell keeps
    its forward.

    Example:
        >>> import torch
        >>> inner, copy = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
        >>> compiled = torch.compile(inner, backend="eager")
        >>> uncompiled_forward(compiled, {"_orig_mod": copy}) == copy.__call__, uncompiled_forward(inner, {})
        (True, None)
    """
    wrapped = _wrapped(original)
    if wrapped is None or not wrapped[1]:
        return None  # an unregistered wrapped module is no parameter's module: evaluated as it is
    return shell_modules[_WRAPPED].__call__


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
    installed: dict[int, tuple[Any, Any]] = {}  # id(stand-in) -> (stand-in, original), while set
    last_module: Optional[str] = None  # the module imported last when the stand-ins were set
    local = threading.local()  # ``depth``: this thread's evaluations in progress (NOTE: [Thread-local state])


def _computing() -> bool:
    return bool(getattr(_State.local, "depth", 0))


_STAND_IN_MARK = "_torchntk_stand_in"
"""An attribute every stand-in carries, so that one is never taken for an original."""


def _stand_in(function: Any) -> Any:
    setattr(function, _STAND_IN_MARK, True)
    return function


@_stand_in
class _PlainCheckpoint:
    """Stands in for ``torch.utils.checkpoint.CheckpointFunction`` (NOTE: [Checkpoints run plain])."""

    @staticmethod
    def apply(function: Callable[..., Any], preserve_rng_state: bool, *args: Any) -> Any:
        if _computing():
            return function(*args)
        return _State.originals["CheckpointFunction"].apply(function, preserve_rng_state, *args)


def _plain_steps(key: str) -> Callable[..., Iterator[None]]:
    """Stands in for the generator of ``use_reentrant=False`` (``key``: its name in ``_STAND_INS``),
    whose saved-tensor hooks ``torch.func`` refuses: ``checkpoint`` runs the function between its
    two steps, and on a thread computing a kernel they only enter and leave the forward context of
    the call's ``context_fn`` (NOTE: [Checkpoints run plain])."""

    def steps(*arguments: Any, **kwargs: Any) -> Iterator[None]:
        original = _State.originals[key]
        context = _forward_context(original, arguments, kwargs) if _computing() else None
        if context is None:
            yield from original(*arguments, **kwargs)
            return
        with context:
            yield

    return _stand_in(steps)


_SIGNATURES: dict[Any, inspect.Signature] = {}


def _forward_context(original: Callable[..., Any], arguments: tuple, kwargs: dict) -> Any:
    """The context in which ``original``, the generator of ``use_reentrant=False``, would run the
    checkpointed function: the first of the two that ``context_fn()`` returns (what a user's
    ``context_fn`` puts there, e.g. autocast, changes values); nothing for the default, with grad
    disabled, and for selective checkpointing's caching mode, which only keeps results for the
    recomputation. None when the arguments do not fit ``original``, which then raises its own error."""
    signature = _SIGNATURES.get(original)
    if signature is None:
        signature = _SIGNATURES[original] = inspect.signature(original)
    try:
        context_fn = signature.bind(*arguments, **kwargs).arguments.get("context_fn")
    except TypeError:
        return None
    if context_fn is None or context_fn is getattr(torch.utils.checkpoint, "noop_context_fn", None):
        return contextlib.nullcontext()
    forward, _ = context_fn()
    caching = getattr(torch.utils.checkpoint, "_CachingTorchDispatchMode", None)
    if not torch.is_grad_enabled() or (caching is not None and isinstance(forward, caching)):
        return contextlib.nullcontext()  # without grad, ``checkpoint`` runs the function outside it too
    return forward


_STEPS = "_checkpoint_without_reentrant_generator"
_STEPS_2_14 = "_checkpoint_without_reentrant_generator_impl"
"""What ``checkpoint`` calls from PyTorch 2.14 on; the older name remains there as a wrapper of it."""
_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"
"""``torch.distributed._composable.checkpoint(module)``, whose hooks call the generator under the
name they imported."""


def _not_offloaded(key: str) -> Callable[..., Any]:
    """Stands in for ``save_on_cpu`` where Hugging Face's ``gradient_checkpointing_enable(offload=True)``
    wraps each checkpoint in it: saved-tensor hooks, which ``torch.func``'s reverse mode refuses, that
    only move the saved activations to the host and back. On a thread computing a kernel it is an
    empty context (NOTE: [Checkpoints run plain])."""

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        if _computing():
            return contextlib.nullcontext()
        return _State.originals[key](*args, **kwargs)

    return _stand_in(stand_in)


def _never_skipped(name: str) -> Callable[..., Any]:
    """Stands in for a Hugging Face test of whether an attention mask may be skipped (NOTE:
    [Attention masks under vmap]): on a thread computing a kernel the mask is always built."""

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        if _computing():
            return False
        return _State.originals[name](*args, **kwargs)

    return _stand_in(stand_in)


_MASKS = "transformers.masking_utils"
_OLD_MASKS = "transformers.modeling_attn_mask_utils"
_HF_MODELS = "transformers.modeling_utils"
_STAND_INS: dict[str, tuple[str, str, Any]] = {
    "CheckpointFunction": ("torch.utils.checkpoint", "CheckpointFunction", _PlainCheckpoint),
    _STEPS: ("torch.utils.checkpoint", _STEPS, _plain_steps(_STEPS)),
    _STEPS_2_14: ("torch.utils.checkpoint", _STEPS_2_14, _plain_steps(_STEPS_2_14)),
    f"{_COMPOSABLE}.{_STEPS}": (_COMPOSABLE, _STEPS, _plain_steps(f"{_COMPOSABLE}.{_STEPS}")),
    f"{_COMPOSABLE}.{_STEPS_2_14}": (_COMPOSABLE, _STEPS_2_14, _plain_steps(f"{_COMPOSABLE}.{_STEPS_2_14}")),
    f"{_HF_MODELS}.save_on_cpu": (_HF_MODELS, "save_on_cpu", _not_offloaded(f"{_HF_MODELS}.save_on_cpu")),
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
    if owner is None:
        return None, "", None
    # as inspect.getattr_static finds it (no descriptor runs), without its cost at every evaluation
    for namespace in owner.__mro__ if isinstance(owner, type) else (owner,):
        found = vars(namespace).get(attribute, _MISSING)
        if found is not _MISSING:
            return owner, attribute, found
    return None, "", None


_MISSING = object()


@contextlib.contextmanager
def plain_checkpoints() -> Iterator[None]:
    """``checkpoint`` calls on this thread run their function directly, and Hugging Face attention
    masks are always built, while the context is active (NOTE: [Checkpoints run plain], NOTE:
    [Attention masks under vmap]); reentrant, thread-safe, restores the globals after."""
    with _State.lock:
        if _State.count == 0:
            replacements = {}
            for key, (module_name, path, stand_in) in _STAND_INS.items():
                owner, attribute, original = _resolve(module_name, path)
                if owner is None:
                    continue
                unwrapped = original.__func__ if isinstance(original, staticmethod) else original
                if getattr(unwrapped, _STAND_IN_MARK, False):
                    continue  # never defer to a stand-in (one left bound would call itself)
                replacement = _never_skipped(key) if stand_in is None else stand_in
                _State.installed[id(replacement)] = (replacement, unwrapped)
                if isinstance(original, staticmethod):
                    replacement = staticmethod(replacement)
                # an attribute the owner inherits is removed again after, not left set on the owner
                inherited = attribute not in vars(owner)
                replacements[key] = (owner, attribute, None if inherited else original, replacement)
                # Originals are added, never removed: a thread that looked a stand-in up just before
                # the last evaluation restored the globals still finds what to defer to.
                _State.originals[key] = unwrapped
            _State.owners = {key: entry[:3] for key, entry in replacements.items()}
            _State.last_module = _last_imported()
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
                    if original is None:
                        delattr(owner, attribute)
                    else:
                        setattr(owner, attribute, original)
                if _last_imported() != _State.last_module:
                    _rebind_leaked(_State.installed, _State.last_module)
                _State.owners, _State.installed = {}, {}


def _last_imported() -> Optional[str]:
    return next(reversed(sys.modules), None)


def _rebind_leaked(installed: dict[int, tuple[Any, Any]], last: Optional[str]) -> None:
    """Gives the originals back to modules imported while the stand-ins were set, which bound one
    under their own name (``from torch.utils.checkpoint import ...``: importing ``torch._dynamo``
    the first time imports ``torch.distributed._composable``, which does). ``sys.modules`` keeps
    the order of imports, so only the modules after ``last``, the last one before, are scanned
    (all of them if ``last`` is gone)."""
    names = list(sys.modules)
    start = len(names) - names[::-1].index(last) if last in sys.modules else 0
    for name in names[start:]:
        module = sys.modules.get(name)
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attribute, value in list(namespace.items()):
            entry = installed.get(id(value))
            if entry is not None and entry[0] is value:
                namespace[attribute] = entry[1]
