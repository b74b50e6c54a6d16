"""The function mode that sees every op consuming a differentiated parameter while the model runs.

NOTE: [Recording parameter uses]
The model runs under :class:`Recorder`, a ``TorchFunctionMode``. Parameters are recognised by
identity: the tensors passed to ``functional_call`` are the ones the ops receive. For each op:

* no parameter (or a view of one) among its arguments: it runs untouched;
* a view, slice or cast of a parameter: it runs, and its result is tracked as a view
  (``_views.py``) so the consumer further on still sees the parameter;
* an op with a rule (``rules/``) that accepts the call: a *rule call*. When recording, its roles
  are built; when perturbing, ``delta_k`` is added to the ``k``-th rule call's output, so that the
  VJP with respect to ``delta_k`` is ``G_k = df/dy_k``;
* a Python composite (``F.multi_head_attention_forward`` and the like) receiving a parameter: its
  body is run with the mode still active, so the ops inside are seen one by one;
* anything else receiving a parameter (and returning a tensor): the parameter is *unruled* and its
  share of the kernel comes from the Jacobian fallback. Calls returning no tensor (``W.shape``,
  ``W.dim()``) are metadata and ignored.

The same sequence of rule calls must happen in every pass over the same inputs (the forward must be
deterministic); :class:`Recorder` checks the output shapes it perturbs.
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ._roles import ParamRef, RuleCall
from ._views import (
    CAST_OPS,
    VIEW_OPS,
    follow_view,
    is_view_property,
    positions,
    view_refs,
)
from .rules import RULES


class Recorder(TorchFunctionMode):
    """Records rule calls and adds ``deltas[k]`` (when given) to the output of the ``k``-th.

    Attributes:
        calls: the rule calls, in order.
        unruled: parameter indices consumed by an op without an applicable rule.
    """

    def __init__(self, params: tuple[torch.Tensor, ...], deltas: Optional[dict[int, torch.Tensor]] = None):
        super().__init__()
        self._params = params
        self._index = {id(param): position for position, param in enumerate(params)}
        self._views: dict[int, tuple[torch.Tensor, ParamRef]] = {}
        self._deltas = deltas
        self._count = 0
        self.calls: list[RuleCall] = []
        self.unruled: set[int] = set()

    def ref_of(self, value: Any) -> Optional[ParamRef]:
        if not isinstance(value, torch.Tensor):
            return None
        position = self._index.get(id(value))
        if position is not None:
            return ParamRef(position)
        tracked = self._views.get(id(value))
        # the tensor itself is kept alive in the table, so an id is never reused for another tensor
        if tracked is not None and tracked[0] is value:
            return tracked[1]
        return None

    def __torch_function__(self, func: Callable, types_: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        found = [(leaf, ref) for leaf in pytree.tree_leaves((args, kwargs)) if (ref := self.ref_of(leaf)) is not None]
        if not found:
            return func(*args, **kwargs)
        if func in CAST_OPS or func in VIEW_OPS or is_view_property(func):
            return self._view(func, args, kwargs, found)
        rule = RULES.get(func)
        if rule is not None:
            call = rule(func, args, kwargs, self.ref_of)
            if call is not None:
                return self._rule_call(call)
        elif isinstance(func, types.FunctionType):
            with self:
                return _without_outer_check(func)(*args, **kwargs)
        result = func(*args, **kwargs)
        if any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(result)):
            self.unruled.update(ref.param for _, ref in found)
        return result

    def _view(self, func: Callable, args: tuple, kwargs: dict, found: list) -> Any:
        result = func(*args, **kwargs)
        source_ref = self.ref_of(args[0]) if args else None
        if source_ref is None:
            return result  # a parameter only as a template (``x.view_as(W)``, ``x.to(W)``)
        if len(found) != 1:
            self.unruled.update(ref.param for _, ref in found)
            return result
        if func in CAST_OPS:
            if isinstance(result, torch.Tensor):
                self._track(result, source_ref)
            return result
        index = follow_view(func, args, kwargs, 0, positions(self._params[source_ref.param], source_ref))
        for tensor, view_ref in view_refs(result, index, source_ref.param):
            self._track(tensor, view_ref)
        return result

    def _track(self, tensor: torch.Tensor, ref: ParamRef) -> None:
        self._views[id(tensor)] = (tensor, ref)

    def _rule_call(self, call: RuleCall) -> torch.Tensor:
        position = self._count
        self._count += 1
        self.calls.append(call)
        delta = None if self._deltas is None else self._deltas.get(position)
        if delta is None:
            return call.output
        if delta.shape != call.output.shape or delta.dtype != call.output.dtype:
            raise ShapeMismatch(position, tuple(call.output.shape), tuple(delta.shape))
        return call.output + delta


class ShapeMismatch(Exception):
    """A perturbation prepared for a rule call does not have the shape of the call's output."""


_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


@functools.lru_cache(maxsize=None)
def _without_outer_check(func: types.FunctionType) -> types.FunctionType:
    """A copy of a Python composite whose own ``has_torch_function`` check says no.

    A function mode is paused while it handles a call, so running the composite as-is would hide
    every op inside it. The copy runs the body instead of dispatching back to the mode; calls the
    body makes go through the real, unmodified functions and so reach the mode again.
    """
    namespace = dict(func.__globals__)
    for name in _CHECKS:
        if name in namespace:
            namespace[name] = lambda *args, **kwargs: False
    copy = types.FunctionType(func.__code__, namespace, func.__name__, func.__defaults__, func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return copy
