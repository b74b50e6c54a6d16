"""Analytic cost of implementation 3 for given shapes, without computing anything (for AUTO).

The probe passes give every use's per-example shapes; the pair contractions are priced by
opt_einsum's planner on those shapes scaled to the batch, and the fallback parameters by the
Jacobian-contraction formula. A pair of uses seeing a parameter in different coordinates (``W``
and ``W.T``, a slice and the whole) is contracted through both uses' ``J`` (``_contract.py``)
and priced that way. The backward sweeps are priced by the caller.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..._call import KernelCall
from ._contract import jacobian_equation, merge_pays, output_symbols, pair_cost, pair_equation, pair_kind
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
    """

    contraction_flops: float
    memory_elements: float
    fallback_params: int
    contractions: int = 0


def structured_cost(call: KernelCall, plan: Plan) -> StructuredCost:
    """The cost of ``call`` under ``plan`` (which must come from a probe of ``call``'s x1)."""
    sides = [call.side1] if call.side2 is None else [call.side1, call.side2]
    probed = plan.first_example_calls if plan.first_example_calls is not None else probe(call.side1).calls
    calls = probed if plan.ruled else []
    outputs = (call.outputs1, call.outputs2 if call.side2 is not None else call.outputs1)
    uses = [
        [_meta_use(role, side, output_leaves) for c in calls for role in plan.roles(c)]
        for side, output_leaves in zip(sides, outputs)
    ]
    out_axes = call.side1.out_axes if call.side1.mapped else None
    pays = merge_pays(call.layouts[0], None if out_axes is None else out_axes[0])
    uses1, uses2 = (merged_uses(side_uses, out_axes is not None, pays) for side_uses in (uses[0], uses[-1]))
    param_sizes = [param.numel() for param in call.model.params]
    flops = memory = 0.0
    contractions = 0
    for leaf, (layout, kernel_shape) in enumerate(zip(call.layouts, call.kernel_shapes())):
        out_axis = None if out_axes is None else out_axes[leaf]
        kernel = math.prod(kernel_shape) * layout.trace_size(call.outputs1[leaf].shape)
        jacobians: set[int] = set()  # uses whose J is formed (once, shared by their pairs)
        for first in uses1:
            for second in uses2:
                kind = pair_kind(first.role, second.role) if first.role.unit == second.role.unit else "disjoint"
                if kind == "disjoint":
                    continue
                contractions += 1
                if kind == "einsum":
                    equation, tensors = pair_equation(layout, out_axis, first, second, leaf)
                    cost, largest = pair_cost(equation, tuple(tuple(t.shape) for t in tensors))
                    flops += cost
                    memory = max(memory, largest)
                    continue
                size = param_sizes[first.role.unit[0]]
                for use in (first, second):
                    if id(use) not in jacobians:
                        jacobians.add(id(use))
                        contractions += 1
                        flops += _jacobian_cost(use, leaf, layout, out_axis)
                        memory += math.prod(use.gradients[leaf].shape[: layout.ndim]) * size
                flops += 2.0 * kernel * size
    memory += sum(t.numel() for side_uses in (uses1, uses2) for use in side_uses for t in _tensors(use))
    fallback = sum(param_sizes[index] for index in plan.fallback)
    kernel = sum(
        math.prod(shape) * layout.trace_size(output.shape)
        for shape, layout, output in zip(call.kernel_shapes(), call.layouts, call.outputs1)
    )
    flops += 2.0 * kernel * fallback
    memory += fallback * sum(o.numel() for o in call.outputs1 + call.outputs2)
    return StructuredCost(flops, memory, fallback, contractions)


def _jacobian_cost(use: Use, leaf: int, layout, out_axis) -> float:
    out_symbols, _, _ = output_symbols(layout)
    equation, tensors = jacobian_equation(use, leaf, out_symbols, out_axis)
    cost, _ = pair_cost(equation, tuple(tuple(t.shape) for t in tensors))
    return cost


def _meta_use(role, side, output_leaves) -> Use:
    examples = (side.batch_size(),) if side.mapped else ()
    operands = [(torch.empty(examples + tuple(t.shape), device="meta"), labels) for t, labels in role.operands]
    gradients = tuple(torch.empty(tuple(o.shape) + tuple(role.y_shape), device="meta") for o in output_leaves)
    return Use(dataclasses.replace(role, operands=operands), gradients)


def _tensors(use: Use):
    yield from use.gradients
    for tensor, _ in use.role.operands:
        yield tensor
