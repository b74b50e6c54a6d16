"""Analytic cost of implementation 3 for given shapes, without computing anything (for AUTO).

The probe passes give every use's per-example shapes; the pair contractions are priced by
opt_einsum's planner on those shapes scaled to the batch, and the fallback parameters by the
Jacobian-contraction formula. The backward sweeps are priced by the caller.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..._call import KernelCall
from ._contract import pair_cost, pair_equation, pair_kind
from ._plan import make_plan
from ._side import Use, probe


@dataclasses.dataclass(frozen=True)
class StructuredCost:
    contraction_flops: float
    memory_elements: float
    fallback_params: int


def structured_cost(call: KernelCall, structure_rules: bool) -> StructuredCost:
    sides = [call.side1] if call.side2 is None else [call.side1, call.side2]
    recorder = probe(call.side1) if structure_rules else None
    calls = recorder.calls if recorder is not None else []
    unruled = recorder.unruled if recorder is not None else set()
    plan = make_plan(calls, unruled, len(call.model.params), structure_rules=structure_rules, local_jacobian=None)
    outputs = (call.outputs1, call.outputs2 if call.side2 is not None else call.outputs1)
    uses = [
        [_meta_use(role, side, output_leaves) for c in calls for role in plan.roles(c)]
        for side, output_leaves in zip(sides, outputs)
    ]
    uses1, uses2 = uses[0], uses[-1]
    out_axes = call.side1.out_axes if call.side1.mapped else None
    flops = memory = 0.0
    for leaf, layout in enumerate(call.layouts):
        for first in uses1:
            for second in uses2:
                if first.role.unit != second.role.unit or pair_kind(first.role, second.role) == "disjoint":
                    continue
                equation, tensors = pair_equation(layout, None if out_axes is None else out_axes[leaf], first, second, leaf)
                cost, largest = pair_cost(equation, tuple(tuple(t.shape) for t in tensors))
                flops += cost
                memory = max(memory, largest)
    memory += sum(t.numel() for side_uses in (uses1, uses2) for use in side_uses for t in _tensors(use))
    fallback = sum(call.model.params[index].numel() for index in plan.fallback)
    kernel = sum(math.prod(s) * layout.trace_size(o.shape) for s, layout, o in zip(call.kernel_shapes(), call.layouts, call.outputs1))
    flops += 2.0 * kernel * fallback
    memory += fallback * sum(o.numel() for o in call.outputs1 + call.outputs2)
    return StructuredCost(flops, memory, fallback)


def _meta_use(role, side, output_leaves) -> Use:
    examples = (side.batch_size(),) if side.mapped else ()
    operands = [(torch.empty(examples + tuple(t.shape), device="meta"), labels) for t, labels in role.operands]
    gradients = tuple(torch.empty(tuple(o.shape) + tuple(role.y_shape), device="meta") for o in output_leaves)
    return Use(dataclasses.replace(role, operands=operands), gradients)


def _tensors(use: Use):
    yield from use.gradients
    for tensor, _ in use.role.operands:
        yield tensor
