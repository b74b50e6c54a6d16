"""Analytic cost of implementation 3 for given shapes, without computing anything (for AUTO).

The probe passes give every use's per-example shapes; the pair contractions are priced by
opt_einsum's optimal order on those shapes scaled to the batch (:func:`~._contract.pair_cost`), and the
fallback parameters by the Jacobian-contraction formula. Uses hold shapes, not tensors
(:class:`_Shape`): pricing computes nothing. A pair of uses seeing a parameter in different
coordinates (a slice and the whole; ``W`` and ``W.T`` are stated alike, see
:meth:`~._roles.Role.in_parameter_order`) is contracted through both uses' ``J`` (``_contract.py``)
and priced that way. The backward sweeps are priced by the caller.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import weakref
from typing import Any, Optional

import torch

from ..._call.kernel_call import KernelCall
from ._contract import (
    jacobian_equation, merge_pays, output_symbols, pair_cost, pair_equation, pair_kind, use_pairs,
)
from ._merge import merged_uses
from ._plan import Plan
from ._side import Use, probe


@dataclasses.dataclass(frozen=True)
class StructuredCost:
    """The priced work of implementation 3 for one call.

    Attributes:
        contraction_flops: the pair contractions', the Jacobians formed and the fallback's FLOPs.
        memory_elements: elements held: the largest pair intermediate, the Jacobians formed,
            the factors and the fallback's Jacobians.
        fallback_params: parameter entries whose Jacobians are contracted directly.
        contractions: einsum calls: pair contractions and Jacobians formed (AUTO prices each
            call's overhead).
        held_elements: what the memory model counts (NOTE: [Memory plans]): ``memory_elements``
            with the factors, Jacobians and fallback of x2 None held once, not per side.
        largest_elements: the largest pair intermediate among them.
    """

    contraction_flops: float
    memory_elements: float
    fallback_params: int
    contractions: int = 0
    held_elements: float = 0.0
    largest_elements: float = 0.0


def structured_cost(call: KernelCall, plan: Plan) -> StructuredCost:
    """The cost of ``call`` under ``plan`` (which must come from a probe of ``call``'s x1).

    The last result of each thread is kept (by weak references to ``call`` and ``plan``): AUTO
    prices 3 and then asks its memory (NOTE: [Memory plans]) of the same call and plan.
    """
    last = getattr(_LAST, "priced", None)
    if last is not None and last[0]() is call and last[1]() is plan:
        return last[2]
    cost = _structured_cost(call, plan)
    _LAST.priced = (weakref.ref(call), weakref.ref(plan), cost)
    return cost


_LAST = threading.local()  # NOTE: [Thread-local state] in _utils/threads.py


def _structured_cost(call: KernelCall, plan: Plan) -> StructuredCost:
    sides = [call.side1] if call.side2 is None else [call.side1, call.side2]
    probed = plan.first_example_calls if plan.first_example_calls is not None else probe(call.side1).calls
    calls = probed if plan.ruled else []
    outputs = (call.outputs1, call.outputs2 if call.side2 is not None else call.outputs1)
    uses = [
        [_shaped_use(role, side, output_leaves) for c in calls for role in plan.roles(c)]
        for side, output_leaves in zip(sides, outputs)
    ]
    out_axes = call.side1.out_axes if call.side1.mapped else None
    pays = merge_pays(call.layouts[0], None if out_axes is None else out_axes[0])
    uses1, uses2 = (merged_uses(side_uses, out_axes is not None, pays) for side_uses in (uses[0], uses[-1]))
    param_sizes = [param.numel() for param in call.model.params]
    same_unit = [(first, second) for first, second, _ in use_pairs(uses1, uses2, symmetric=False)]
    flops = memory = largest_intermediate = formed = 0.0
    contractions = 0
    for leaf, (layout, kernel_shape) in enumerate(zip(call.layouts, call.kernel_shapes())):
        out_axis = None if out_axes is None else out_axes[leaf]
        kernel = math.prod(kernel_shape) * layout.trace_size(call.outputs1[leaf].shape)
        jacobians: set[int] = set()  # uses whose J is formed (once, shared by their pairs)
        for first, second in same_unit:
            kind = pair_kind(first.role, second.role)
            if kind == "disjoint":
                continue
            contractions += 1
            if kind == "einsum":
                equation, tensors = pair_equation(layout, out_axis, first, second, leaf)
                cost, largest = pair_cost(equation, tuple(tuple(t.shape) for t in tensors))
                flops += cost
                memory = max(memory, largest)
                largest_intermediate = max(largest_intermediate, largest)
                continue
            size = param_sizes[first.role.unit[0]]
            for use in (first, second):
                if id(use) not in jacobians:
                    jacobians.add(id(use))
                    contractions += 1
                    flops += _jacobian_cost(use, leaf, layout, out_axis)
                    memory += math.prod(use.gradients[leaf].shape[: layout.ndim]) * size
                    formed += math.prod(use.gradients[leaf].shape[: layout.ndim]) * size
            flops += 2.0 * kernel * size
    factors = [sum(t.numel() for use in side_uses for t in _tensors(use)) for side_uses in (uses1, uses2)]
    memory += sum(factors)
    fallback = sum(param_sizes[index] for index in plan.fallback)
    kernel = sum(
        math.prod(shape) * layout.trace_size(output.shape)
        for shape, layout, output in zip(call.kernel_shapes(), call.layouts, call.outputs1)
    )
    flops += 2.0 * kernel * fallback
    memory += fallback * sum(o.numel() for o in call.outputs1 + call.outputs2)
    # With x2 None the two sides above are one: its factors, Jacobians and fallback are held once.
    once = call.side2 is None
    held = largest_intermediate + (formed / 2 if once else formed) + factors[0] + (0 if once else factors[1])
    held += fallback * sum(o.numel() for o in call.outputs1 + (() if once else call.outputs2))
    return StructuredCost(flops, memory, fallback, contractions, held, largest_intermediate)


def _jacobian_cost(use: Use, leaf: int, layout, out_axis) -> float:
    out_symbols, _, _ = output_symbols(layout)
    equation, tensors = jacobian_equation(use, leaf, out_symbols, out_axis)
    cost, _ = pair_cost(equation, tuple(tuple(t.shape) for t in tensors))
    return cost


def _shaped_use(role, side, output_leaves) -> Use:
    """The use of ``role`` on ``side`` with shapes for tensors (:class:`_Shape`)."""
    examples = (side.batch_size(),) if side.mapped else ()
    operands = [(_Shape(examples + tuple(t.shape), t.dtype), labels) for t, labels in role.operands]
    gradients = tuple(_Shape(tuple(o.shape) + tuple(role.y_shape), o.dtype) for o in output_leaves)
    return Use(dataclasses.replace(role, operands=operands), gradients)


class _Shape:
    """A tensor's shape and dtype without the tensor: what pricing gives a use for its operands and
    ``G``. Merging alike uses (NOTE: [Merged uses]) stacks them; ``torch.stack`` of meta tensors
    runs PyTorch's Python reference kernels (about 80 us a call, most of the cost of pricing a
    recurrent layer), ``torch.stack`` of shapes (:meth:`__torch_function__`) a few microseconds.
    """

    __slots__ = ("shape", "dtype")
    device = torch.device("meta")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        self.shape = torch.Size(shape)
        self.dtype = dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func is not torch.stack:
            return NotImplemented  # pricing needs no other op: a new use of shapes fails loudly
        kwargs = kwargs or {}
        shapes = args[0]
        dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
        first = shapes[0].shape
        dim = dim if dim >= 0 else dim + len(first) + 1
        return _Shape((*first[:dim], len(shapes), *first[dim:]), shapes[0].dtype)


def _tensors(use: Use):
    yield from use.gradients
    for tensor, _ in use.role.operands:
        yield tensor
