"""The function mode that sees every op consuming a differentiated parameter while the model runs.

NOTE: [Recording parameter uses]
The model runs under :class:`Recorder`, a ``TorchFunctionMode``. Parameters are recognised by
identity: the tensors passed to ``functional_call`` are the ones the ops receive. For each op:

* no parameter (or a view of one) among its arguments: it runs untouched;
* a parameter consumed at a deeper ``torch.func`` level than the recording's, inside a derivative
  the model takes: the parameter is *unruled* (NOTE: [Transforms inside the model]);
* a view, slice or cast of a parameter: it runs, and its result is tracked as a view
  (``_views.py``) so the consumer further on still sees the parameter;
* an op with a rule (``rules/``) that accepts the call: a *rule call*. When recording, its roles
  are built; when perturbing, ``delta_k`` is added to the ``k``-th rule call's output, so that the
  VJP with respect to ``delta_k`` is ``G_k = df/dy_k``;
* a Python composite (``F.multi_head_attention_forward`` and the like) receiving a parameter: its
  body is run with the mode still active, so the ops inside are seen one by one;
* a fused recurrent kernel (``torch._VF.lstm`` of ``nn.LSTM``, ``gru``, ``rnn_tanh``, ``rnn_relu``)
  receiving a parameter: likewise, its decomposition (NOTE: [Unfused kernels] in ``_model/unfused.py``)
  runs with the mode active, so each product with a weight is one ``F.linear`` rule call (the
  hidden-to-hidden weight one per time step). Calls it leaves to the kernel (packed sequences,
  dropout between layers in training mode) fall under the last case;
* an op that writes in place (``Tensor.__setitem__``, a method or ``torch`` function ending in
  ``_``, an ``out=`` argument) into a parameter or a tracked view of one, or that writes one into
  another tensor: the parameter is *unruled*; a view no longer tells what the tensor holds;
* anything else receiving a parameter and returning a floating-point tensor: the parameter is
  *unruled* and its share of the kernel comes from the Jacobian fallback. An op whose results
  carry no derivative is not a use: calls returning no tensor (``W.shape``, ``W.dim()``,
  ``W.item()``) and casts or comparisons giving integer or boolean tensors (``W.to(torch.int64)``,
  ``W > 0``); autograd gives nothing through them either.

A rule reads its operands (``x`` of ``F.linear(x, W)``) after the forward, so the recorder notes
the version counter of every tensor a rule call received and, when the recording ends, unrules the
parameters of calls whose inputs were later written in place. Complex-valued rule calls are
unruled too: the rules state real derivatives. :attr:`Recorder.reasons` says why each unruled
parameter is.

The same sequence of rule calls must happen in every pass over the same inputs (the forward must be
deterministic); :class:`Recorder` checks the output shapes it perturbs. A custom
``torch.autograd.Function`` reaches a function mode as one ``custom_function_call`` only under a
``torch.func`` transform (outside one, the mode sees the ops of its ``forward``, which its
``backward`` may contradict), so every recording pass runs under a transform (``_side.py``).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from ..._model.inner_derivatives import INNER_DERIVATIVES, parameter_behind
from ..._model.unfused import DECOMPOSITIONS, RECURRENT
from ..._utils.tree import argument_leaves
from ._roles import OutputSpec, ParamRef, RuleCall
from ._views import (
    CAST_OPS,
    VIEW_OPS,
    follow_view,
    is_view_property,
    positions,
    view_refs,
)
from .rules import rule_for


class Recorder(TorchFunctionMode):
    """Records rule calls and adds ``deltas[k]`` (when given) to the output of the ``k``-th.

    Attributes:
        calls: the rule calls, in order.
        output_specs: the shape and dtype of each rule call's output (per example under ``vmap``),
            read while the pass runs: the outputs' wrappers do not outlive its transforms.
        unruled: parameter indices consumed by an op without an applicable rule.
        reasons: why each unruled parameter is (the first reason met).
        met_custom_function: whether a custom ``torch.autograd.Function`` ran (seen as one
            ``custom_function_call``, under a transform; NOTE: [The whole-batch pass by plain
            autograd] in ``_side.py``).
    """

    def __init__(
        self, params: tuple[torch.Tensor, ...], deltas: Optional[dict[int, torch.Tensor]] = None, looped: bool = False,
        unfuse: bool = False,
    ):
        super().__init__()
        self._params = params
        self._looped = looped  # examples mapped by a Python loop: NOTE: [Indices that depend on the example]
        # NOTE: [The recorder unfuses]
        self._decompositions = DECOMPOSITIONS if unfuse else None
        # one ParamRef per parameter, shared by every use: ``ref_of`` answers for every argument of every op
        self._index = {id(param): ParamRef(position) for position, param in enumerate(params)}
        self._views: dict[int, tuple[torch.Tensor, ParamRef]] = {}
        self._deltas = deltas
        self._count = 0
        self._depth = 0  # composites re-enter the mode (``with self``) while it is active
        self._level: Optional[int] = None
        self._inputs: list[tuple[str, set[int], list[tuple[torch.Tensor, int]]]] = []
        self.calls: list[RuleCall] = []
        self.output_specs: list[OutputSpec] = []
        self.unruled: set[int] = set()
        self.reasons: dict[int, str] = {}
        self.met_custom_function = False

    def ref_of(self, value: Any) -> Optional[ParamRef]:
        """The parameter ``value`` is (or is a tracked view, slice or cast of); ``None`` if none."""
        # the parameters and the tracked tensors are kept alive (in ``_params``, in the table), so
        # their ids are never another object's, whatever ``value`` is
        ref = self._index.get(id(value))
        if ref is not None:
            return ref
        behind = parameter_behind(value)  # wrapped for a model's own level (NOTE: [Derivatives inside the forward pass])
        if behind is not None and id(behind) in self._index:
            return self._index[id(behind)]
        tracked = self._views.get(id(value))
        if tracked is not None and tracked[0] is value:
            return tracked[1]
        return None

    def __torch_function__(self, func: Callable, types_: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is _CUSTOM_FUNCTION_CALL:
            self.met_custom_function = True
        found = [(leaf, ref) for leaf in argument_leaves(args, kwargs) if (ref := self.ref_of(leaf)) is not None]
        if not found:
            return func(*args, **kwargs) if self._decompositions is None else self._run(func, args, kwargs)
        if _current_level() != self._level:
            # NOTE: [Transforms inside the model]: no rule states what a transform of the model's own does
            self._unrule(found, f"{INNER_DERIVATIVES} (`{_name(func)}` consumes it inside a derivative the model takes)")
            if isinstance(func, types.FunctionType) and rule_for(func) is None:
                with self:  # a composite's body may reach parameters that are not among its arguments
                    return _without_outer_check(func)(*args, **kwargs)
            return self._run(func, args, kwargs)
        if _writes_in_place(func, kwargs):
            self._unrule(found, f"`{_name(func)}` writes in place into it (or a view of it), or writes it elsewhere")
            return self._run(func, args, kwargs)
        if func in CAST_OPS or func in VIEW_OPS or is_view_property(func):
            return self._view(func, args, kwargs, found)
        decomposition = RECURRENT.get(func)
        if decomposition is not None:
            with self:
                result = decomposition(*args, **kwargs)
            if result is not NotImplemented:
                return result
        rule = rule_for(func)
        if rule is not None:
            call = rule(func, args, kwargs, self.ref_of)
            if call is not None and not call.output.is_complex():
                return self._rule_call(call, func, args, kwargs, found)
            if call is not None:
                self._unrule(found, f"`{_name(func)}` is complex-valued here (the rules state real derivatives)")
                return call.output
        elif isinstance(func, types.FunctionType):
            with self:
                return _without_outer_check(func)(*args, **kwargs)
        result = self._run(func, args, kwargs)
        if any(_carries_derivative(leaf) for leaf in pytree.tree_leaves(result)):
            self._unrule(found, _no_rule(func, args))
        return result

    def _run(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)``, a fused kernel as its decomposition where the recorder unfuses
        (NOTE: [The recorder unfuses])."""
        if self._decompositions is not None:
            decomposition = self._decompositions.get(func)
            if decomposition is not None:
                result = decomposition(*args, **kwargs)
                if result is not NotImplemented:
                    return result
        return func(*args, **kwargs)

    def __enter__(self) -> "Recorder":
        if not self._depth:
            self._level = _current_level()  # the level the model is evaluated at
        self._depth += 1
        return super().__enter__()

    def __exit__(self, exc_type: Any = None, exc_value: Any = None, traceback: Any = None) -> Any:
        result = super().__exit__(exc_type, exc_value, traceback)
        self._depth -= 1
        if self._depth:
            return result
        for name, params, inputs in self._inputs:
            if any(_storage_version(tensor) != version for tensor, version in inputs):
                reason = f"an input of `{name}` was written in place after `{name}` consumed it"
                for param in params:
                    self.unruled.add(param)
                    self.reasons.setdefault(param, reason)
        self._inputs.clear()
        return result

    def _unrule(self, found: list, reason: str) -> None:
        for _, ref in found:
            self.unruled.add(ref.param)
            self.reasons.setdefault(ref.param, reason)

    def _view(self, func: Callable, args: tuple, kwargs: dict, found: list) -> Any:
        result = func(*args, **kwargs)
        source_ref = self.ref_of(args[0]) if args else None
        if source_ref is None:
            return result  # a parameter only as a template (``x.view_as(W)``, ``x.to(W)``)
        if len(found) != 1:
            self._unrule(found, f"`{_name(func)}` receives it twice")
            return result
        source = args[0]
        if not any(_carries_derivative(leaf) for leaf in pytree.tree_leaves(result)):
            return result  # a cast to an integer or boolean dtype: no derivative flows through it
        dtypes = {leaf.dtype for leaf in pytree.tree_leaves(result) if isinstance(leaf, torch.Tensor)}
        if any(dtype.is_complex for dtype in dtypes) or (func in VIEW_OPS and dtypes != {source.dtype}):
            # a bit reinterpretation (``W.view(torch.int32)``) or a cast to complex: not a view
            self._unrule(found, f"`{_name(func)}` changes its dtype to one the rules do not follow")
            return result
        if func in CAST_OPS:
            if isinstance(result, torch.Tensor):
                self._track(result, source_ref)
            return result
        seen = positions(self._params[source_ref.param], source_ref)
        index = follow_view(func, args, kwargs, 0, seen)
        if any(_is_batched(leaf) for leaf in pytree.tree_leaves(index)) and not _is_batched(seen):
            # NOTE: [Indices that depend on the example]: ``W[x.argmax(-1)]`` under vmap selects other
            # entries for every example, which one recorded index cannot state.
            self._unrule(found, f"`{_name(func)}` selects its entries with indices computed from the input")
            return result
        if self._looped and any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves((args[1:], kwargs))):
            # In an example loop every example is recorded apart, with nothing to tell an index
            # computed from it from a constant one, and the passes keep one example's roles.
            self._unrule(found, f"`{_name(func)}` selects its entries with a tensor of indices, which may differ "
                                f"between the examples of an example loop")
            return result
        for tensor, view_ref in view_refs(result, index, source_ref.param):
            self._track(tensor, view_ref)
        return result

    def _in_parameter_order(self, build: Callable, found: list) -> Callable:
        """``build`` with its roles stated in their parameters' own axis order where they see a
        parameter whole through a transpose (:meth:`Role.in_parameter_order`)."""
        shapes = {ref.param: tuple(self._params[ref.param].shape) for _, ref in found}

        def in_parameter_order() -> tuple:
            separate, joint = build()
            return [role.in_parameter_order(shapes[role.refs[0].param]) for role in separate], joint

        return in_parameter_order

    def _track(self, tensor: torch.Tensor, ref: ParamRef) -> None:
        self._views[id(tensor)] = (tensor, ref)

    def _rule_call(self, call: RuleCall, func: Callable, args: tuple, kwargs: dict, found: list) -> torch.Tensor:
        inputs = [
            (tensor, _storage_version(tensor))
            for tensor in argument_leaves(args, kwargs)
            if isinstance(tensor, torch.Tensor) and self.ref_of(tensor) is None
        ]
        self._inputs.append((_name(func), {ref.param for _, ref in found}, inputs))
        position = self._count
        self._count += 1
        for _, ref in found:  # a loop, not any(): this runs for every rule call of every pass
            if ref.index is not None:  # a view: maybe a transpose of the whole parameter
                call.build = self._in_parameter_order(call.build, found)
                break
        self.calls.append(call)
        self.output_specs.append((tuple(call.output.shape), call.output.dtype))
        delta = None if self._deltas is None else self._deltas.get(position)
        if delta is None:
            return call.output
        if delta.shape != call.output.shape or delta.dtype != call.output.dtype:
            raise ShapeMismatch(position, tuple(call.output.shape), tuple(delta.shape))
        return call.output + delta


# NOTE: [The recorder unfuses]
# Under ``torch.func`` transforms a model's fused recurrent and weight-norm kernels run as their
# decompositions (NOTE: [Unfused kernels] in ``_model/unfused.py``), which the ``Unfused`` function
# mode does for every other pass. Implementation 3's recording passes (the probe, the per-example
# pass and the whole-batch pass in ``_side.py``) run the model under the recorder, which sees every
# call first: a second function mode below it cost every operation another Python dispatch (an
# LSTM's unfused cells: a tenth of the Python calls of a warm call) to decompose a handful of them.
# So those passes enter no ``Unfused`` (``Side.per_example(unfuse=False)``, ``whole_batch_context``)
# and their recorder (``unfuse=True``) runs a kernel of ``DECOMPOSITIONS`` as its decomposition
# wherever it would run the kernel itself, as ``Unfused`` would have right below it: with the
# recorder paused, so what it records is unchanged. A recurrent kernel consuming recorded
# parameters is decomposed under the recorder, as before (``RECURRENT``). In an example loop no
# pass unfuses (reverse mode runs the fused kernels), and neither does its recorder.


# NOTE: [Indices that depend on the example]
# A view op's result is tracked by applying the same op to the parameter's flat positions. When an
# argument of the op (an index tensor) is computed from the input under the per-example vmap of
# ``vmap_axes``, those positions come out batched: every example sees other entries of the
# parameter (``table[x.argmax(-1)]``, an embedding lookup by computed ids). A ParamRef holds one
# index for all examples and must not keep a batched tensor beyond the transform, so the parameter
# is unruled and its share of the kernel comes from exact Jacobians (the fallback). Constant
# indices (a buffer of positions, a slice) stay unbatched and are followed as before; without
# vmap the whole batch is one example and its index is exact. In an example loop (NOTE: [Example
# loops]) no example is batched, and each pass keeps one example's roles (``_side._KeptRoles``), so
# there any tensor of indices unrules the parameter: exact, at the fallback's price, in a mode that
# is already the slow one.


# NOTE: [Transforms inside the model]
# A model may run torch.func transforms of its own (``vmap(hessian(u))(x)`` for a PDE residual), or
# run in the reverse-mode level that torchntk opens for a model calling ``torch.autograd.grad``
# (NOTE: [Derivatives inside the forward pass] in ``_model/inner_derivatives.py``). Its operations
# then run at a deeper functorch level than the one the recorder was entered at, and are not what the rules
# state: their tensors are wrapped for levels that end before the recording does (a rule's operand
# kept from there escapes its level, which PyTorch answers with an INTERNAL ASSERT), a delta added
# there is batched or differentiated by the model's own transforms, and the derivative the model
# takes consumes the parameters again in backward passes that no function mode sees. So a
# parameter consumed at another level is unruled, and its share of the kernel comes from the
# Jacobian fallback, exact whatever the model does; operations at the recorder's level keep their
# rules (a dense head after a derivative, say).


class ShapeMismatch(Exception):
    """A perturbation prepared for a rule call does not have the shape of the call's output.

    Its ``args``: the rule call's position, its output's shape and the perturbation's, where the
    recorder raised it; none where a pass found its rule calls otherwise than the plan's.
    """


_IN_PLACE_OPERATORS = frozenset(
    "__setitem__ __iadd__ __isub__ __imul__ __itruediv__ __ifloordiv__ __imod__ __ipow__ __imatmul__ "
    "__iand__ __ior__ __ixor__ __ilshift__ __irshift__".split()
)


def _name(func: Callable) -> str:
    return getattr(func, "__name__", None) or repr(func)


def _no_rule(func: Callable, args: tuple) -> str:
    function_class = args[0] if args else None
    if isinstance(function_class, type) and issubclass(function_class, torch.autograd.Function):
        # ``custom_function_call(cls, *inputs)``: the class's own backward defines the derivative
        return f"the custom torch.autograd.Function `{function_class.__name__}` consumes it"
    return f"`{_name(func)}` consumes it and has no derivative rule"


def _writes_in_place(func: Callable, kwargs: dict) -> bool:
    """``Tensor.__setitem__``, ``x += y``, ``Tensor.add_``, ``torch.relu_``, or an ``out=`` argument."""
    if isinstance(func, torch._ops.OpOverload):  # an ATen call of a traced graph: its schema says
        return func._schema.is_mutable
    name = getattr(func, "__name__", "")
    if name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.endswith("__")):
        return True
    return kwargs.get("out") is not None


def _carries_derivative(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and (value.dtype.is_floating_point or value.dtype.is_complex)


def _storage_version(tensor: torch.Tensor) -> int:
    """The version counter of the storage behind ``tensor``: under ``torch.func`` transforms the
    wrappers' own counters do not move when the wrapped tensor is written in place."""
    while _is_wrapped(tensor):
        tensor = _unwrapped(tensor)
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor: it has no counter, and cannot be written outside inference mode
        return -1


_current_level = torch._C._functorch.maybe_current_level

try:  # what a custom autograd.Function reaches a function mode as, under a torch.func transform
    from torch._functorch.autograd_function import custom_function_call as _CUSTOM_FUNCTION_CALL
except ImportError:  # pragma: no cover - every supported torch has it
    _CUSTOM_FUNCTION_CALL = None

_is_wrapped = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", lambda tensor: False)
_unwrapped = getattr(torch._C._functorch, "get_unwrapped", None)

_is_batched_wrapper = getattr(torch._C._functorch, "is_batchedtensor", lambda tensor: False)


def _is_batched(value: Any) -> bool:
    """Whether a vmap level batches ``value`` under any other transform's wrapper (NOTE: [Indices
    that depend on the example]); tensors made inside a transform are wrapped without being batched."""
    if not isinstance(value, torch.Tensor):
        return False
    while _is_wrapped(value):
        if _is_batched_wrapper(value):
            return True
        value = _unwrapped(value)
    return False


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
