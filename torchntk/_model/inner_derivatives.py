"""Models that take derivatives inside their forward pass: PINN residuals, force fields.

NOTE: [Derivatives inside the forward pass]
A physics-informed network returns a PDE residual such as ``u_xx + u_yy``, a force field the forces
``-dE/dx`` of an energy network: the forward pass itself differentiates, with respect to its input.
Users write it in one of two ways, and torchntk computes both kernels exactly:

* with ``torch.func`` inside ``forward`` (``vmap(hessian(u))(x)``, ``vmap(grad(E))(pos)``): those
  transforms nest inside torchntk's own (vmap over examples, jacrev, jvp, vjp) as ``torch.func``
  defines, so implementations 1 and 2 need nothing. Implementation 3 sees the operations inside the
  model's transforms one level deeper than its own and leaves their parameters to its exact
  Jacobian fallback (``structured/_recorder.py``), as it has no rules for what a transform does to
  an operation;
* with ``torch.autograd.grad(outputs, x, create_graph=True)`` on an input the model marks with
  ``x.requires_grad_()`` (on ``x``, ``x.clone()`` or ``x.detach()``) or that requires grad already.
  Under ``torch.func`` transforms this fails as it is (``requires_grad_`` is refused, and
  ``prepare_call``'s first evaluation runs under ``no_grad``). Such a model is evaluated inside a
  ``torch.func`` grad level of its own, innermost, opened where the model is called
  (:func:`_in_own_level`): its inputs are wrapped for that level and require grad there, in-place
  ``requires_grad_`` is allowed there, grad mode is on there. ``torch.func.grad`` itself works this
  way (``torch.autograd.grad`` on tensors wrapped for its level), so the model's inner
  ``autograd.grad`` is one more reverse-mode level that torchntk's transforms differentiate through
  like any other: the kernel is exact with every implementation, and nothing is written into the
  user's inputs (only the level's wrappers are marked). A model that differentiates with respect
  to its own parameters (a MAML inner step, ``torch.autograd.grad(loss, self.parameters(),
  create_graph=True)``) fails there with autograd's "does not require grad"; it is evaluated again
  with its parameters wrapped and marked in the level too, and remembered. Implementation 3's
  recorder and the sketches' capture know such a wrapper as the parameter behind it
  (:func:`parameter_behind`), and leave it to the exact fallback like any parameter used inside a
  derivative.

Which models need their own level is found by watching, not by a flag: the first evaluation of a
model (per module or function, kept weakly in :data:`_VERDICTS`) runs under :class:`_Watch`, a
``TorchFunctionMode`` that stops at the first ``torch.autograd.grad``, ``torch.autograd.backward``
or ``Tensor.backward`` call (and at a ``requires_grad_`` request that a transform refuses, which
fails anyway), undoes the ``requires_grad`` flags that pass set on tensors it did not create (the
user's input), and evaluates the model again in its own level; every later evaluation goes
straight to the right path, for the price of one attribute check (an ordinary model pays one
watched evaluation, once). The watch looks only at calls made at the level it was entered at:
``torch.func.grad`` and ``jacrev`` inside the model call ``torch.autograd.grad`` and
``requires_grad_`` themselves, one level deeper, and need no level of their own. A
``requires_grad_`` request alone is no derivative: Hugging Face's input-grad hooks make them (NOTE:
[Hooks that ask for gradients]), and a model marked for its own level for them would only lose
speed. A model found to take no derivative that fails later (an input or a flag that turns its
derivatives on) is watched again before its error is raised. Function modes and functorch levels
are per thread, so another thread, the user's own code among them, sees neither; nothing in
PyTorch is patched (a stand-in for ``torch.autograd.grad`` would miss ``from torch.autograd import
grad`` and reach every thread), and the verdicts are shared under a lock.

Inside its level the model runs under :class:`_InnerCalls`, which makes every ``torch.autograd.grad``
call ``create_graph=True``: the kernel is that of the function the forward pass computes, and
force fields commonly pass ``create_graph=self.training``, which in eval mode would make the forces
constants of the parameters and their kernel zero without any error. ``.backward()`` inside the
forward pass, which writes ``.grad`` instead of returning the derivative, cannot run under a
transform: it is refused with an error that names the cause and ``torch.autograd.grad`` as the
rewrite. Why not evaluate such models without transforms, by autograd over the parameters (double
backward per example)? That is the loop users write by hand: per-example Python work at every
collocation point, where the nested level keeps ``vmap_axes``' batching and all three
implementations (docs/benchmarks.md, "Derivatives inside the forward pass", measures both).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Mapping, Optional

import torch
from torch._C._functorch import _unwrap_for_grad, _wrap_for_grad
from torch._functorch.eager_transforms import enable_inplace_requires_grad, grad_increment_nesting
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from .requires_grad import asks_for_grad, refused_here

INNER_DERIVATIVES = "the model takes derivatives inside its forward pass"
"""The cause named wherever such a model is treated apart (implementation 3's fallback reason)."""

_FUNCTORCH = torch._C._functorch
_GRAD = torch.autograd.grad
_BACKWARDS = {torch.autograd.backward: "torch.autograd.backward", torch.Tensor.backward: "Tensor.backward"}

Call = Callable[[tuple, tuple, Mapping[str, Any]], Any]


class InnerBackwardError(ValueError):
    """The model calls ``.backward()`` (or ``torch.autograd.backward``) inside its forward pass."""


def _backward_error(what: str, where: str) -> InnerBackwardError:
    return InnerBackwardError(
        f"{where}: {INNER_DERIVATIVES} with {what}(), which writes the derivative into `.grad` instead "
        f"of returning it, and cannot run under the torch.func transforms every implementation "
        f"differentiates with. Use the derivative that torch.autograd.grad(outputs, inputs, "
        f"create_graph=True) returns instead: implementations 1, 2, 3 and AUTO then compute the kernel."
    )


class _Detected(Exception):
    """Raised by :class:`_Watch` at the first sign of a derivative inside the forward pass."""


class _Watch(TorchFunctionMode):
    """Stops the model at its first derivative call (NOTE: [Derivatives inside the forward pass]).

    Attributes:
        seen: what was seen (``"torch.autograd.grad"``, ...), or None.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seen: Optional[str] = None
        self._marked: list[torch.Tensor] = []
        self._level = _FUNCTORCH.maybe_current_level()

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if _FUNCTORCH.maybe_current_level() != self._level:
            # inside a torch.func transform of the model's own, whose calls of torch.autograd.grad
            # and requires_grad_ are its way of working: torchntk's transforms nest it as it is
            return func(*args, **kwargs)
        if func is _GRAD or func in _BACKWARDS:
            self.seen = "torch.autograd.grad" if func is _GRAD else _BACKWARDS[func]
            raise _Detected
        if asks_for_grad(func, args, kwargs) and isinstance(args[0], torch.Tensor):
            if refused_here():
                self.seen = "Tensor.requires_grad_"  # refused under a transform: it cannot go on
                raise _Detected
            if not args[0].requires_grad:
                self._marked.append(args[0])
        return func(*args, **kwargs)

    def undo(self) -> None:
        """Clears the ``requires_grad`` flags the watched pass set (the user's inputs keep theirs)."""
        for tensor in self._marked:
            if tensor.is_leaf and tensor.requires_grad:
                tensor.requires_grad_(False)
        self._marked.clear()


class _InnerCalls(TorchFunctionMode):
    """What a model in its own level runs under: ``torch.autograd.grad`` always builds its graph,
    ``.backward()`` is refused (NOTE: [Derivatives inside the forward pass])."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self._where = where

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is _GRAD:
            kwargs = dict(kwargs, create_graph=True)
        elif func in _BACKWARDS:
            raise _backward_error(_BACKWARDS[func], self._where)
        return func(*args, **kwargs)


def _in_own_level(
    call: Call, param_leaves: tuple, args: tuple, kwargs: Mapping[str, Any], where: str, params_too: bool = False
) -> Any:
    """``call(param_leaves, args, kwargs)`` in a grad level of its own, its input tensors (with
    ``params_too``, its parameters as well) wrapped for that level and (floating ones) requiring grad
    there; the output unwrapped from it."""
    with grad_increment_nesting() as level, torch.enable_grad(), enable_inplace_requires_grad(True):

        def mark(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            wrapped = _wrap_for_grad(leaf, level)
            return wrapped.requires_grad_() if wrapped.is_floating_point() or wrapped.is_complex() else wrapped

        args, kwargs = pytree.tree_map(mark, (tuple(args), dict(kwargs)))
        if params_too:
            output = _with_wrapped_parameters(call, tuple(param_leaves), mark, args, kwargs, where)
        else:
            with _InnerCalls(where):
                output = call(param_leaves, args, kwargs)
        return pytree.tree_map(
            lambda leaf: _unwrap_for_grad(leaf, level) if isinstance(leaf, torch.Tensor) else leaf, output
        )


def _with_wrapped_parameters(
    call: Call, param_leaves: tuple, mark: Callable[[Any], Any], args: tuple, kwargs: Mapping[str, Any], where: str
) -> Any:
    """``call`` on the parameters wrapped by ``mark``, each wrapper known as its parameter meanwhile
    (:func:`parameter_behind`)."""
    params = tuple(mark(leaf) for leaf in param_leaves)
    aliases = _ALIASES.__dict__.setdefault("stack", [])
    aliases.append({id(wrapped): (wrapped, original) for wrapped, original in zip(params, param_leaves)})
    try:
        with _InnerCalls(where):
            return call(params, args, kwargs)
    finally:
        aliases.pop()


class _AliasStack(threading.local):  # NOTE: [Thread-local state] in _utils/threads.py
    # A thread's own list from its first level on, this empty default before: read for every
    # argument of every op a recorder sees, where a missing thread-local attribute costs ten
    # times one found.
    stack: Any = ()


_ALIASES = _AliasStack()
"""Per thread, a stack of ``{id(wrapped): (wrapped, parameter)}``: the parameters wrapped for the levels of
models that differentiate with respect to their own parameters, innermost last."""


def parameter_behind(value: Any) -> Optional[torch.Tensor]:
    """The parameter that ``value`` wraps for a model's own level (NOTE: [Derivatives inside the
    forward pass]), or None: what implementation 3's recorder and the sketches' capture look through,
    so that such a parameter is still known as the parameter it is."""
    for level in reversed(_ALIASES.stack):
        entry = level.get(id(value))
        if entry is not None and entry[0] is value:
            return entry[1]
    return None


def _differentiates_parameters(error: BaseException) -> bool:
    """Whether ``error`` is autograd's refusal to differentiate with respect to a tensor that does not
    require grad: inside a model's own level, the parameters, which the level does not mark first."""
    return isinstance(error, RuntimeError) and "does not require grad" in str(error)


class _Verdict:
    """What one model was found to do: ``known`` once a watched evaluation ran to its end or to a
    derivative; ``takes``: what it differentiates with (``"torch.autograd.grad"``, ...), or None;
    ``params``: whether it differentiates with respect to its own parameters."""

    def __init__(self) -> None:
        self.known = False
        self.takes: Optional[str] = None
        self.params = False  # it differentiates with respect to its parameters too


_VERDICTS: "weakref.WeakKeyDictionary[Any, _Verdict]" = weakref.WeakKeyDictionary()
_VERDICTS_LOCK = threading.Lock()


def _verdict_of(owner: Any) -> _Verdict:
    """The verdict kept for ``owner`` (the user's module or function), shared by every kernel function
    of it; a fresh one when ``owner`` cannot be kept weakly (it is then found once per model built)."""
    try:
        with _VERDICTS_LOCK:
            verdict = _VERDICTS.get(owner)
            if verdict is None:
                verdict = _VERDICTS[owner] = _Verdict()
            return verdict
    except TypeError:  # not hashable, or no weak reference to it
        return _Verdict()


def takes_derivatives(owner: Any) -> Optional[str]:
    """What ``owner``'s forward pass was seen to differentiate with (``"torch.autograd.grad"``, ...),
    or None (none seen, or not evaluated yet)."""
    try:
        with _VERDICTS_LOCK:
            verdict = _VERDICTS.get(owner)
    except TypeError:
        return None
    return None if verdict is None else verdict.takes


def with_inner_derivatives(call: Call, owner: Any, where: str) -> Call:
    """``call`` evaluating a model that takes derivatives inside its forward pass in a grad level of its
    own, found on its first evaluation (NOTE: [Derivatives inside the forward pass]).

    Args:
        call: ``call(param_leaves, args, kwargs)``, the model in functional form.
        owner: the user's module or function, under which the finding is kept.
        where: the caller's name, for errors.

    Raises:
        InnerBackwardError: the model calls ``.backward()`` inside its forward pass.
    """
    verdict = _verdict_of(owner)

    def watched(param_leaves: tuple, args: tuple, kwargs: Mapping[str, Any]) -> tuple[bool, Any]:
        """``(found, output)``: the watched evaluation's output, or ``found`` with no output."""
        watch = _Watch()
        try:
            with watch:
                output = call(param_leaves, args, kwargs)
        except _Detected:
            pass
        except Exception:
            if watch.seen is None:
                raise
        else:
            if watch.seen is None:
                return False, output
        # stopped at a derivative (or the model caught _Detected and went on or failed): its own level decides
        watch.undo()
        if watch.seen in _BACKWARDS.values():
            raise _backward_error(watch.seen, where) from None
        verdict.takes = watch.seen
        return True, None

    def own_level(param_leaves: tuple, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        if verdict.params:
            return _in_own_level(call, param_leaves, args, kwargs, where, params_too=True)
        try:
            return _in_own_level(call, param_leaves, args, kwargs, where)
        except RuntimeError as error:
            if not _differentiates_parameters(error):
                raise
        # it differentiates with respect to its parameters (a MAML inner step): they are marked too
        output = _in_own_level(call, param_leaves, args, kwargs, where, params_too=True)
        verdict.params = True
        return output

    def evaluate(param_leaves: tuple, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        if verdict.takes is not None:
            return own_level(param_leaves, args, kwargs)
        if not verdict.known:
            found, output = watched(param_leaves, args, kwargs)
            verdict.known = True
            if not found:
                return output
            return own_level(param_leaves, args, kwargs)
        try:
            return call(param_leaves, args, kwargs)
        except RuntimeError as error:
            if isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error):
                raise
            try:  # a derivative that this input or flag turns on fails as a plain evaluation
                found, _ = watched(param_leaves, args, kwargs)
            except Exception:  # noqa: BLE001 - the model's own error is the one to raise
                found = False
            if not found:
                raise
            return own_level(param_leaves, args, kwargs)

    return evaluate
