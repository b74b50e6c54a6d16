"""Parameters that a forward pass reaches by another way than their registered names.

NOTE: [Aliased parameters]
``functional_call`` substitutes torchntk's tensors for a module's parameters in its parameter
tables (of a private shell, NOTE: [Modules are never mutated]). A forward pass that reaches a
parameter another way (a Python list or dict of weights, a closure, a helper object holding the
weight, a view taken in ``__init__``) gets the module's own tensor, which no transform tracks, so
that parameter's part of the NTK silently vanished. There is no clean way to redirect such a
reference (the holder may be any object), so the reference is detected and refused:

* while the model is evaluated with torchntk's tensors in place, a function mode looks at the
  tensors each operation receives; one whose storage is that of a watched parameter (the
  ``StorageImpl``, not the data pointer: torchntk's copy-on-write clones share the data but not
  the storage object, while views and ``detach()`` of the original share both) is the original;
* watched are the differentiated parameters when the evaluation is differentiated (a
  ``torch.func`` grad or jvp transform, forward-mode AD, or autograd recording them), and at any
  evaluation those whose value torchntk replaces by another (``params`` given, Monte Carlo
  draws). Reading the module's value where it is the value used is harmless (the NNGP);
* the first such read raises a ValueError after the evaluation, naming the parameter and, when a
  shallow search of the module's attributes finds it, what holds it.

A model is watched until its first differentiated evaluation passes without such a read. Kernel
functions do this once per input shapes and module structure, like the derivative part of NOTE:
[Checking vmap_axes]: ``NtkSettings.prepare`` opens :func:`alias_checks` around the models it
builds, with a callback that records the key once a check has passed and ``skip`` for keys
already recorded. Models built elsewhere (NTK-vector products, spectra, Taylor expansions,
sketches, NNGPs) are watched until their first differentiated evaluation.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch._C._functorch import TransformType, get_interpreter_stack, is_functorch_wrapped_tensor
from torch.autograd import forward_ad
from torch.overrides import TorchFunctionMode, resolve_name

_DIFFERENTIATING = (TransformType.Grad, TransformType.Jvp)
_SEARCH_DEPTH = 3
"""How deep :func:`_holders` looks into attribute values (a list in a helper object's dict is 3)."""
_MODULE_TABLES = frozenset({"_parameters", "_buffers", "_modules"})


@dataclass
class _Request:
    skip: bool = False
    on_clean: Optional[Callable[[], None]] = None


_requests = threading.local()  # NOTE: [Thread-local state] in _utils/threads.py


@contextlib.contextmanager
def alias_checks(*, skip: bool = False, on_clean: Optional[Callable[[], None]] = None) -> Iterator[None]:
    """Models built on this thread inside the context are not watched (``skip``), or call
    ``on_clean`` once their first differentiated evaluation passed the check (NOTE: [Aliased
    parameters])."""
    previous = getattr(_requests, "current", None)
    _requests.current = _Request(skip, on_clean)
    try:
        yield
    finally:
        _requests.current = previous


def storage_key(tensor: torch.Tensor) -> Optional[int]:
    """The identity of ``tensor``'s storage object, or None for tensors without one reachable here
    (``torch.func``'s wrapped tensors, which are never the user's own, sparse tensors, fakes)."""
    if is_functorch_wrapped_tensor(tensor):
        return None
    try:
        return tensor.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError, TypeError):
        return None


def _differentiating(param_leaves: tuple) -> bool:
    stack = get_interpreter_stack()
    if stack and any(interpreter.key() in _DIFFERENTIATING for interpreter in stack):
        return True
    if getattr(forward_ad, "_current_level", -1) >= 0:
        return True
    return torch.is_grad_enabled() and any(
        isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in param_leaves
    )


class _Watcher(TorchFunctionMode):
    """Records the first watched original that an operation receives."""

    def __init__(self, by_id: dict[int, str], by_storage: dict[int, str]):
        super().__init__()
        self.by_id, self.by_storage = by_id, by_storage
        self.found: Optional[tuple[str, str]] = None  # (parameter name, operation)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if self.found is None:
            for value in (*args, *kwargs.values()):
                if isinstance(value, (list, tuple)):
                    for item in value:
                        self._look(item, func)
                else:
                    self._look(value, func)
        return func(*args, **kwargs)

    def _look(self, value: Any, func: Any) -> None:
        if self.found is not None or not isinstance(value, torch.Tensor):
            return
        name = self.by_id.get(id(value))
        if name is None:
            key = storage_key(value)
            name = None if key is None else self.by_storage.get(key)
        if name is not None:
            self.found = (name, _operation_name(func))


class AliasWatch:
    """Watches one module's evaluations for parameters reached around ``functional_call`` (NOTE:
    [Aliased parameters]).

    Args:
        module: the user's module (what is searched for the holder of a found reference).
        originals: ``name -> the module's own tensor`` of every differentiated parameter.
        replaced: the names among them whose value torchntk replaces by another tensor.
        where: the public function's name, for the message.
        on_clean: called once the first differentiated evaluation passed.
    """

    def __init__(
        self, module: nn.Module, originals: dict[str, torch.Tensor], replaced: set[str], where: str,
        on_clean: Optional[Callable[[], None]] = None,
    ):
        self.module, self.where, self.on_clean = module, where, on_clean
        self.armed = True
        self._all = self._tables(originals)
        self._replaced = self._tables({name: originals[name] for name in replaced})

    @staticmethod
    def _tables(tensors: dict[str, torch.Tensor]) -> tuple[dict[int, str], dict[int, str]]:
        by_id, by_storage = {}, {}
        for name, tensor in tensors.items():
            by_id.setdefault(id(tensor), name)
            key = storage_key(tensor)
            if key is not None:
                by_storage.setdefault(key, name)
        return by_id, by_storage

    def evaluate(self, param_leaves: tuple, evaluate: Callable[[], Any]) -> Any:
        """``evaluate()``, watched while armed.

        Raises:
            ValueError: the evaluation read a watched parameter through another reference.
        """
        if not self.armed:
            return evaluate()
        differentiating = _differentiating(param_leaves)
        by_id, by_storage = self._all if differentiating else self._replaced
        if not by_id and not by_storage:
            return evaluate()
        watcher = _Watcher(by_id, by_storage)
        with watcher:
            output = evaluate()
        if watcher.found is not None:
            raise ValueError(self._message(*watcher.found))
        if differentiating:
            self.armed = False
            if self.on_clean is not None:
                self.on_clean()
        return output

    def _message(self, name: str, operation: str) -> str:
        target = dict(self.module.named_parameters(remove_duplicate=False)).get(name)
        holders = [] if target is None else _holders(self.module, target)
        if holders:
            found = f"through {', '.join(holders[:3])}"
        else:
            found = "through a reference that is not its registered name (not found among the module's attributes)"
        return (
            f"{self.where}: the forward pass reads parameter {name!r} {found} (in {operation}), not as the "
            f"module attribute it is registered as. torchntk evaluates the model with its own tensors in "
            f"place of the registered parameters, so this reference would bypass them and that parameter's "
            f"part of the kernel would silently be wrong. Read the parameter through its module inside "
            f"forward (e.g. `self.{name}`) instead of keeping it in a list, dict, closure or helper object."
        )


def watched(
    module: nn.Module, originals: dict[str, torch.Tensor], replaced: set[str], where: str
) -> Optional[AliasWatch]:
    """The :class:`AliasWatch` of a module model being built, or None where :func:`alias_checks`
    says to skip."""
    request = getattr(_requests, "current", None) or _Request()
    if request.skip:
        return None
    return AliasWatch(module, originals, replaced, where, request.on_clean)


def _holders(module: nn.Module, target: torch.Tensor) -> list[str]:
    """Where among ``module``'s attributes (besides its tensor and submodule tables) a tensor with
    ``target``'s storage is held: ``"`blocks.0.cache[1]`"``-style labels, searched shallowly."""
    key = storage_key(target)
    found: list[str] = []
    seen: set[int] = set()

    def search(value: Any, label: str, depth: int) -> None:
        if len(found) >= 3 or depth > _SEARCH_DEPTH or id(value) in seen:
            return
        if isinstance(value, torch.Tensor):
            if value is target or (key is not None and storage_key(value) == key):
                found.append(f"`{label}`")
            return
        if isinstance(value, (str, bytes, int, float, bool, type(None), type)):
            return
        seen.add(id(value))
        if isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                search(item, f"{label}[{index}]", depth + 1)
        elif isinstance(value, dict):
            for item_key, item in list(value.items()):
                search(item, f"{label}[{item_key!r}]", depth + 1)
        elif callable(value) and hasattr(value, "__code__"):
            cells = getattr(value, "__closure__", None) or ()
            for variable, cell in zip(value.__code__.co_freevars, cells):
                try:
                    contents = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                search(contents, f"{label} (closure variable {variable!r})", depth + 1)
        elif hasattr(value, "__func__") and hasattr(value, "__self__"):  # a bound method
            search(value.__func__, label, depth)
        elif hasattr(value, "__dict__") and not isinstance(value, nn.Module):
            for attribute, item in list(vars(value).items()):
                search(item, f"{label}.{attribute}", depth + 1)
        elif isinstance(value, nn.Module):  # a module held but not registered
            for name, item in value.named_parameters():
                search(item, f"{label}.{name}", depth + 1)

    for path, sub in module.named_modules(remove_duplicate=True):
        for attribute, value in vars(sub).items():
            if attribute in _MODULE_TABLES or (attribute.startswith("_") and attribute.endswith("hooks")):
                continue
            search(value, f"{path}.{attribute}" if path else attribute, 1)
    return found


def _operation_name(func: Any) -> str:
    """A readable name of what a function mode intercepted (``torch.Tensor.T.__get__``)."""
    try:
        return resolve_name(func) or getattr(func, "__name__", repr(func))
    except Exception:  # resolve_name inspects arbitrary callables; a name is only for the message
        return getattr(func, "__name__", repr(func))
