"""Implementation 3 through the derivatives a model takes in its forward pass: the pass traced.

NOTE: [Unrolled derivatives]
A PINN residual ``u_xx + u_yy`` or a force field's ``-dE/dx`` consumes every weight again in the
backward passes of the derivatives the model takes, which no function mode sees (NOTE:
[Transforms inside the model] in ``_recorder.py``): the recorder leaves those parameters to the
Jacobian fallback, and the kernel costs ``N^2 P`` plus forming ``J``, like implementation 1. Yet
through a derivative a dense layer's weight still enters the output only through products: the
forward ``x W^T`` and, in each backward pass, ``g W`` (and, in a second derivative, a few more),
so ``J_W`` is a sum of a few rank-one terms per example and the rules' pair contractions apply.

To let the rules see those products, the model's per-example function is traced once per key
with ``make_fx`` (fake tensors, so no value is computed and a Python branch on a tensor's value
fails the trace instead of being frozen into it): the derivatives the model takes become ATen
calls of the graph (``mm``, ``addmm``, ``tanh_backward``, ...), a plain function of the parameters
and the example that the recorder runs at its own level. ``mm`` and ``addmm`` have the matmul
rules, the views between a weight and its products (``t``, ``t`` of ``t``) are followed like any
view (``_views.py``), and a use of ``W`` through its transpose is stated in ``W``'s own axis
order (``Recorder``), so all of a weight's uses pair by einsum and merge by kind (NOTE: [Merged
uses]). A convolution's ``convolution_backward`` whose input gradient alone is used becomes
:func:`~.rules.conv.convolution_input_gradient`, which has a rule (NOTE: [Convolutions through
derivatives] in ``rules/conv.py``). Parameters the graph still consumes without a rule (a
transposed convolution's weight) keep the exact fallback, with the reason.

The graph stands for the model only where it computes what the model computes:

* autograd's saved tensors enter the traced backward ops through ``detach`` calls, which are
  aliases to autograd (their ``grad_fn`` is restored on unpacking) and are run as aliases; a
  ``detach`` of the user's own, or an op under ``no_grad``, would then be differentiated, so the
  graph is checked against the model when it is made: outputs and ``J^T v`` for a random ``v`` on
  the first example of each side, or it is not used (the reason is kept);
* a graph drawing random numbers (dropout) is not used;
* values the trace froze (private copies of buffers and frozen parameters, Python numbers the
  model reads from its attributes) may change between calls under one key, so every call compares
  the graph's outputs with the model's on its first example, and traces again when they differ
  (the graph is dropped for the key if a new trace still differs);
* the graph is traced for one example's shapes (per side where x1 and x2 differ, and again for a
  side of a signature not traced yet); the passes over whole batches (NOTE: [Whole-batch
  pullback]) are not taken;
* a capture of ``compile=`` is refused: a replay would skip the per-call comparison.

The record keeps the graphs, and with them what the trace froze: private copies of the model's
frozen parameters and buffers (small for the models this is for), never the parameters
differentiated, which are inputs of the graph.

Tracing costs a few evaluations of the model and, in a process that has not traced before, about
a second of imports (``make_fx`` loads ``torch._dynamo``), so a model is traced only where its
fallback contraction is priced above that (:data:`_MIN_FALLBACK_FLOPS`); under it the fallback
computes the kernel, as before. A trace is then used only where it lets the rules cover more
parameters and their contractions through it are priced below the fallback's (``_cost.py``, the
model AUTO prices 3 with): about ``T^2 (in + out)`` against ``in out`` per pair of examples for a
dense layer whose weight has ``T`` uses, so wide layers gain and narrow ones keep the fallback.
The decision, the graphs and the graph's probe are kept in the key's record; AUTO prices 3 from
that probe like any other.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Union

import torch
from torch.func import vjp
from torch.utils import _pytree as pytree

from ..._call.kernel_call import KernelCall
from ..._call.per_example import Side, first_line
from ..._call.vmap_check import computations_agree
from ..._model.functional import FunctionalModel
from ..._model.inner_derivatives import INNER_DERIVATIVES
from ..._plan.scope import Scope
from ..._utils.capturing import CaptureRefused, is_capturing
from ..._utils.values import PLAIN, leaf_key
from .rules.conv import convolution_input_gradient

_KIND = "structured unrolled derivatives"
"""The kind of the decision in a key's record (NOTE: [One record per key])."""

WHOLE_BATCH_REASON = "the model's derivatives run as a graph traced for one example (NOTE: [Unrolled derivatives])"

_MIN_FALLBACK_FLOPS = {False: 2e11, True: 1e10}
"""Multiply-adds of the fallback's ``J1 J2^T`` above which tracing pays for itself, by whether
``make_fx``'s imports are loaded already: about 1.5 s of a first trace in a fresh process, about
0.1 s after, at the 10^11 FLOP/s a 2-core CPU reaches on that product."""

_ALWAYS = False
"""Unroll wherever the graph stands for the model, whatever it costs (tests of the path on small models)."""

_ATEN = torch.ops.aten
_PRIMS = {
    getattr(torch.ops.prims, name).default: getattr(_ATEN, name).Tensor
    for name in ("add", "sub", "mul", "div") if hasattr(torch.ops.prims, name)
}


@dataclass(frozen=True)
class _Graph:
    """One trace: ``module(params, tensors)`` gives the output's tensor leaves."""

    module: torch.fx.GraphModule
    output_spec: pytree.TreeSpec
    output_leaves: tuple  # the output's leaves, _COMPUTED where the graph gives a tensor

    def __call__(self, params: tuple, args: tuple, kwargs: Any) -> Any:
        tensors = [leaf for leaf in pytree.tree_leaves((args, dict(kwargs))) if isinstance(leaf, torch.Tensor)]
        computed = iter(self.module(list(params), tensors))
        leaves = [next(computed) if value is _COMPUTED else value for value in self.output_leaves]
        return pytree.tree_unflatten(leaves, self.output_spec)


_COMPUTED = object()


def _signature(args: tuple, kwargs: Any) -> Optional[Hashable]:
    """What a trace is specific to: the arguments' structure, tensor shapes, dtypes and devices,
    and their other values (None when one cannot be told apart by value)."""
    leaves, spec = pytree.tree_flatten((args, dict(kwargs)))
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append((tuple(leaf.shape), leaf.dtype, leaf.device))
        else:
            if type(leaf) not in PLAIN:  # an object: its state may change under one key
                return None
            parts.append(leaf_key(leaf))
    return (str(spec), tuple(parts))


def _trace(model: FunctionalModel, args: tuple, kwargs: dict) -> Union[_Graph, str]:
    """The graph of ``model.call`` on ``args`` (one example's), or why there is none."""
    from torch.fx.experimental.proxy_tensor import make_fx  # loads torch._dynamo: only when tracing

    leaves, spec = pytree.tree_flatten((args, dict(kwargs)))
    positions = [index for index, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    output: dict[str, Any] = {}

    def evaluate(params: list, tensors: list) -> list:
        full = list(leaves)
        for index, tensor in zip(positions, tensors):
            full[index] = tensor
        call_args, call_kwargs = pytree.tree_unflatten(full, spec)
        result = model.call(tuple(params), call_args, call_kwargs)
        result_leaves, output["spec"] = pytree.tree_flatten(result)
        output["leaves"] = tuple(_COMPUTED if isinstance(leaf, torch.Tensor) else leaf for leaf in result_leaves)
        return [leaf for leaf in result_leaves if isinstance(leaf, torch.Tensor)]

    try:
        module = make_fx(evaluate, tracing_mode="fake", _allow_non_fake_inputs=True)(
            list(model.params), [leaves[index] for index in positions]
        )
    except Exception as error:  # noqa: BLE001 - any failure leaves the model to the fallback, as before
        return f"tracing its forward pass failed ({first_line(error)})"
    for node in module.graph.nodes:
        if node.op != "call_function":
            continue
        if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
            return f"it draws random numbers (`{node.target}`)"
        if node.target is _ATEN.detach.default:
            node.target = _ATEN.alias.default  # autograd's saved tensors: see the NOTE
        elif node.target in _PRIMS:
            # a prim that a decomposition inside functorch's transforms left (zero tensors added):
            # prims have no derivatives, their ATen twins do
            node.target = _PRIMS[node.target]
    _input_gradients(module.graph)
    module.recompile()
    return _Graph(module, output["spec"], output["leaves"])


def _input_gradients(graph: torch.fx.Graph) -> None:
    """Every ``convolution_backward`` of which only the input gradient is used, as
    :func:`~.rules.conv.convolution_input_gradient` (NOTE: [Convolutions through derivatives]);
    others (the weight's gradient used too, a transposed convolution) stay, their weight left to
    the fallback."""
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _ATEN.convolution_backward.default:
            continue
        grad_output, source, weight, _, stride, padding, dilation, transposed, _, groups, _ = node.args
        users = list(node.users)
        if transposed or not all(
            user.target is operator.getitem and (user.args[1] == 0 or not user.users) for user in users
        ):
            continue
        input_shape = list(source.meta["val"].shape)
        with graph.inserting_before(node):
            gradient = graph.call_function(
                convolution_input_gradient,
                (grad_output, weight, input_shape, list(stride), list(padding), list(dilation), groups),
            )
        for user in users:
            user.replace_all_uses_with(gradient)
            graph.erase_node(user)
        graph.erase_node(node)


def _example(side: Side) -> tuple[tuple, dict]:
    """The ``(args, kwargs)`` the model receives for ``side``'s first example (its whole batch
    when the side is not mapped): what ``Side._one_example`` passes, unsqueezed."""
    one = side.narrow(0, 1) if side.mapped else side
    return (one.x.rebuild(one.x.leaves),), {key: flat.rebuild(flat.leaves) for key, flat in one.kwargs.items()}


def _tensors(output: Any) -> tuple:
    return tuple(leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor))


def _outputs_agree(model: FunctionalModel, graph: _Graph, args: tuple, kwargs: dict) -> bool:
    with torch.no_grad():
        return computations_agree(
            _tensors(model.call(model.params, args, kwargs)), _tensors(graph(model.params, args, kwargs))
        )


def _checked_trace(model: FunctionalModel, side: Side) -> Union[tuple[Hashable, _Graph], str]:
    """The signature and the graph of ``side``'s first example, checked against the model, or why
    there is none."""
    args, kwargs = _example(side)
    key = _signature(args, kwargs)
    if key is None:
        return "an argument is an object whose state a trace cannot be keyed by"
    graph = _trace(model, args, kwargs)
    if isinstance(graph, str):
        return graph
    reason = _disagreement(model, graph, args, kwargs)
    return (key, graph) if reason is None else reason


def _disagreement(model: FunctionalModel, graph: _Graph, args: tuple, kwargs: dict) -> Optional[str]:
    """Why the graph does not stand for the model on this example (None: it does)."""
    def through(call):
        return lambda params: _tensors(call(params, args, kwargs))

    try:
        expected, model_pullback = vjp(through(model.call), model.params)
        traced, graph_pullback = vjp(through(graph), model.params)
    except Exception as error:  # noqa: BLE001 - the graph is then not used
        return f"its traced forward pass failed ({first_line(error)})"
    if not all(output.is_floating_point() for output in expected):
        return "its outputs are not all floating-point"
    if not computations_agree(expected, traced):
        return "its traced forward pass computes other outputs"
    generator = torch.Generator(device=expected[0].device).manual_seed(0)  # the user's RNG is left alone
    cotangents = tuple(
        torch.randn(output.shape, dtype=output.dtype, device=output.device, generator=generator) for output in expected
    )
    if not computations_agree(model_pullback(cotangents)[0], graph_pullback(cotangents)[0], derivatives=True):
        return ("its traced forward pass has other derivatives than the model (a `detach()` or `no_grad` "
                "of the model's own on a value that depends on the parameters)")
    return None


@dataclass
class Unrolled:
    """A key's traces, by signature (NOTE: [Unrolled derivatives]), kept in its record."""

    graphs: dict[Hashable, _Graph]
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # the last model checked (a weak reference) and its twin, held while that model lives: the record
    # must not keep a call's private copies alive (NOTE: [Modules are never mutated])
    _checked: Any = field(default=None, repr=False)

    def model_for(self, call: KernelCall) -> Optional[FunctionalModel]:
        """The call's model evaluated through the graphs, its first examples' outputs compared
        with the model's once per kernel call (traced again where they differ, traced first where
        a side has a signature not traced yet: another device, a span of another size without
        ``vmap_axes``); None when a new trace does not stand for the model."""
        model = call.model
        with self.lock:
            checked = self._checked
            if checked is not None and checked[0]() is model:
                return checked[1]
            for side in _sides(call):
                args, kwargs = _example(side)
                graph = self.graphs.get(_signature(args, kwargs))
                if graph is not None and _outputs_agree(model, graph, args, kwargs):
                    continue
                traced = _checked_trace(model, side)
                if isinstance(traced, str):
                    return None
                self.graphs[traced[0]] = traced[1]
            return self.remember(model, _through_graphs(model, self.graphs))

    def remember(self, model: FunctionalModel, twin: FunctionalModel) -> FunctionalModel:
        """Keeps ``twin`` as ``model``'s until ``model`` dies (the end of its kernel call)."""
        self_ref = weakref.ref(self)

        def forget(dead: weakref.ref) -> None:
            unrolled = self_ref()
            if unrolled is not None and unrolled._checked is not None and unrolled._checked[0] is dead:
                unrolled._checked = None

        self._checked = (weakref.ref(model, forget), twin)
        return twin


@dataclass(frozen=True)
class NotUnrolled:
    """Why a key's model is not evaluated through a trace (kept in its record)."""

    reason: str


def _sides(call: KernelCall) -> list[Side]:
    return [side for side in (call.side1, call.side2) if side is not None and (not side.mapped or side.batch_size())]


def _through_graphs(model: FunctionalModel, graphs: dict[Hashable, _Graph]) -> FunctionalModel:
    """``model`` whose evaluations with a traced signature run the graph (others run the model)."""
    inner = model.call

    def call(params: tuple, args: tuple, kwargs: Any) -> Any:
        graph = graphs.get(_signature(args, kwargs))
        return inner(params, args, kwargs) if graph is None else graph(params, args, kwargs)

    call.unrolled = True  # type: ignore[attr-defined]
    return dataclasses.replace(model, call=call)


def is_unrolled(model: FunctionalModel) -> bool:
    """Whether ``model`` evaluates through traced graphs (NOTE: [Unrolled derivatives])."""
    return getattr(model.call, "unrolled", False)


def _with_model(call: KernelCall, model: FunctionalModel) -> KernelCall:
    side2 = None if call.side2 is None else dataclasses.replace(call.side2, model=model)
    return dataclasses.replace(call, model=model, side1=dataclasses.replace(call.side1, model=model), side2=side2)


def through_derivatives(call: KernelCall, scope: Optional[Scope], probed: Callable, forget: Callable) -> KernelCall:
    """``call`` with its model evaluated through traced graphs where that lets the rules cover
    parameters that derivatives inside the model consume (NOTE: [Unrolled derivatives]); else
    ``call`` itself.

    Args:
        call: the kernel call.
        scope: the key's record, where the decision is kept (None, a call planned alone outside a
            kernel function: ``call`` itself, as a trace would not be kept).
        probed: ``probed(call)``, implementation 3's quick probe of a call (kept in the record):
            the decision starts from the one of ``call`` and, when it unrolls, the probe of the
            unrolled call becomes the one kept.
        forget: ``forget(call)`` drops what implementation 3 kept for the key (its probe, plan and
            layout): when a probe is replaced, or a kept decision withdrawn.
    """
    if scope is None or is_unrolled(call.model):
        return call
    decision = scope.get(_KIND, call)
    if decision is None:
        decision = scope.put(_KIND, call, _decide(call, probed, forget))
    if not isinstance(decision, Unrolled):
        return call
    if is_capturing():
        # A captured graph would keep what the trace froze (NOTE: [Captured kernels]): the
        # per-call comparison that catches a change cannot run inside it.
        raise CaptureRefused(
            "implementation 3 evaluates this model through a graph traced from the derivatives its forward "
            "pass takes, whose frozen values (copies of buffers and frozen parameters, Python numbers) only "
            "an eager call compares with the model (NOTE: [Unrolled derivatives])"
        )
    model = decision.model_for(call)
    if model is None:
        scope.put(_KIND, call, NotUnrolled("its traced forward pass stopped computing what the model computes"))
        forget(call)
        return call
    return _with_model(call, model)


def _decide(call: KernelCall, probed: Callable, forget: Callable) -> Union[Unrolled, NotUnrolled]:
    from ._cost import structured_cost  # _cost imports _side, which imports the recorder

    seen = probed(call)
    inner = {index for index, reason in seen.reasons.items() if reason.startswith(INNER_DERIVATIVES)}
    if not inner:
        return NotUnrolled("no parameter is consumed inside a derivative the model takes")
    flops = _fallback_flops(call, inner)
    threshold = _MIN_FALLBACK_FLOPS["torch._dynamo" in sys.modules]
    if flops < threshold and not _ALWAYS:
        return NotUnrolled(f"its fallback contraction (about {flops:.2g} multiply-adds) costs less than tracing")
    graphs: dict[Hashable, _Graph] = {}
    for side in _sides(call):
        if _signature(*_example(side)) in graphs:
            continue
        traced = _checked_trace(call.model, side)
        if isinstance(traced, str):
            return NotUnrolled(traced)
        graphs[traced[0]] = traced[1]
    twin = _through_graphs(call.model, graphs)
    forget(call)  # the probe kept is the unrolled call's from here on
    unrolled = _with_model(call, twin)
    after = probed(unrolled)
    reason = None
    if len(after.unruled) >= len(seen.unruled):
        reason = "its traced derivatives consume the parameters through operations without rules too"
    else:
        before_cost = structured_cost(call, seen.unchecked()).contraction_flops
        after_cost = structured_cost(unrolled, after.unchecked()).contraction_flops
        if after_cost >= before_cost and not _ALWAYS:
            reason = (f"the rules' contractions through its derivatives (about {after_cost:.2g} FLOPs) "
                      f"cost more than the fallback's (about {before_cost:.2g})")
    if reason is not None:
        forget(call)
        return NotUnrolled(reason)
    unrolled = Unrolled(graphs)
    unrolled.remember(call.model, twin)
    return unrolled


def _fallback_flops(call: KernelCall, params: set[int]) -> float:
    """Multiply-adds of the fallback's ``J1 J2^T`` over ``params``, every output entry counted (a bound:
    traced output axes cost less)."""
    size = sum(call.model.params[index].numel() for index in params)
    entries1 = sum(output.numel() for output in call.outputs1)
    entries2 = entries1 if call.side2 is None else sum(output.numel() for output in call.outputs2)
    return float(entries1) * float(entries2) * size
