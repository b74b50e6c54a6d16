"""NTK implementation 3: structured derivatives.

``K = sum_p J1_p J2_p^T`` with each ``J_p = sum_k G_k Y_k`` split at the ops ``y_k = op(p, ...)``
that consume ``p``: ``G_k = df/dy_k`` comes from batched VJPs that stop at ``y_k``, and
``Y_k = dy_k/dp`` is never formed: closed-form rules (``rules/``) state ``G_k Y_k`` as a small
einsum, and one opt_einsum-planned contraction per pair of uses gives ``J1_p J2_p^T``. For a
width-``W`` dense layer that removes a factor ``W`` from the cost of Jacobian contraction.

The pieces, in the order they run:

* ``_recorder.py``: a ``TorchFunctionMode`` that sees every op consuming a parameter;
* ``_plan.py``: which parameters the rules cover (the rest go to the Jacobian fallback);
* ``_side.py``: ``G`` and the operands of each use, per side;
* ``_contract.py``: the pair contractions;
* ``_verify.py``: the check of a plan against autograd (when it is made, or on every call).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..._blocks import BlockPlan, Replan, assemble
from ..._bounded_cache import BoundedCache
from ..._call import KernelCall
from ..._per_example import Side
from ..._types import NtkImplementation
from .._choice import AutoChoice
from ._contract import contract_sides
from ._plan import Plan, make_plan
from ._roles import OutputSpec, RuleCall
from ._side import PlanMismatch, SideFactors, probe, side_factors
from ._verify import disagreements, verify


@dataclass(frozen=True)
class StructuredOptions:
    """Knobs of implementation 3 (see ``empirical_ntk_fn``)."""

    structure_rules: bool = True
    closed_form_rules: bool = True
    local_jacobian: str = "auto"
    verify: bool = False


def plan_for(call: KernelCall, options: StructuredOptions, thorough: bool = False) -> Plan:
    """Splits the parameters between the rules and the fallback from probe passes, checked.

    The quick plan probes the first example of x1; a ``thorough`` one probes every example of
    both sides (needed when the model's operations depend on the data). The plan is then checked
    against autograd on the probed examples (NOTE: [Checking a plan against autograd]) and every
    parameter that fails goes to the fallback, its reason kept in :attr:`Plan.reasons`; with
    ``verify=True`` the check runs on every call instead and raises.

    Raises:
        RuntimeError: the check's pass met other operations than the probe on the same inputs.
    """
    n_params = len(call.model.params)
    local = None if options.closed_form_rules else options.local_jacobian
    if not options.structure_rules:
        return make_plan([], set(), n_params, structure_rules=False, local_jacobian=local)
    sides = [side for side in (call.side1, call.side2) if side is not None] if thorough else [call.side1]
    if not thorough:
        sides = [side.narrow(0, min(1, side.batch_size())) if side.mapped else side for side in sides]
    calls: list[RuleCall] = []
    unruled: set[int] = set()
    shapes: list[OutputSpec] = []
    reasons: dict[int, str] = {}
    for side in sides:
        probed = probe(side, first_example_only=False)
        calls.extend(probed.calls)
        unruled |= probed.unruled
        shapes.extend(probed.output_specs)
        reasons = {**probed.reasons, **reasons}  # the first side's reason wins
    one_pass = len(sides) == 1 and local is None

    def build(demoted: dict[int, str]) -> Plan:
        return make_plan(
            calls, unruled | set(demoted), n_params, structure_rules=True, local_jacobian=local,
            shapes=shapes if one_pass else None, reasons={**reasons, **demoted},
        )

    plan = build({})
    if options.verify or len(plan.fallback) == n_params:  # verify=True checks every call; nothing to check
        return _with_probe(plan, calls, thorough)
    demoted: dict[int, str] = {}
    for side in sides:
        try:
            demoted.update(disagreements(side, plan))
        except PlanMismatch:
            raise _nondeterministic(call.where) from None
    return _with_probe(build(demoted) if demoted else plan, calls, thorough)


def _with_probe(plan: Plan, calls: list[RuleCall], thorough: bool) -> Plan:
    """The plan, keeping the calls of a quick plan's probe for AUTO's pricing (``structured_cost``)."""
    return plan if thorough else dataclasses.replace(plan, first_example_calls=tuple(calls))


_REMEMBERED_PLANS = 64
"""Input shapes whose plans a kernel function keeps (the least recently used is dropped)."""


def _nondeterministic(where: str) -> RuntimeError:
    return RuntimeError(
        f"{where}: structured derivatives: the model consumed its parameters through different "
        f"operations in different evaluations on the same inputs; it must run the same operations "
        f"every time. Use implementation=1 for this model."
    )


class StructuredDerivatives:
    """Implementation 3 for one kernel function: its options and a plan per input shapes.

    The plan (which parameters the rules cover) comes from a probe of one example and is reused
    for calls with the same input shapes; every pass checks that the model still consumes its
    parameters as the plan says and re-plans from a probe of all examples when it does not.
    """

    def __init__(self, options: StructuredOptions = StructuredOptions()):
        self.options = options
        self._plans = BoundedCache(_REMEMBERED_PLANS)

    def __call__(self, call: KernelCall, key: Any = None) -> list[torch.Tensor]:
        try:
            return assemble(call, self.block_plan(call, key))
        except Replan:
            return assemble(call, self.block_plan(call, key, thorough=True))

    # -- NOTE: [The implementation table] ------------------------------------------------------

    def kernels(self, call: KernelCall, key: Any) -> list[torch.Tensor]:
        return self(call, key)

    def blocks(self, call: KernelCall, key: Any, thorough: bool = False, block: Optional[tuple] = None) -> BlockPlan:
        return self.block_plan(call, key, thorough)

    def choice(self, call: KernelCall, key: Any) -> AutoChoice:
        fallback = self.fallback_parameters(call, key)  # from the plan the kernel itself uses
        return AutoChoice(NtkImplementation.STRUCTURED_DERIVATIVES, fallback_parameters=fallback)

    def plan(self, call: KernelCall, key: Any = None, thorough: bool = False) -> Plan:
        """The cached plan for ``key`` (or a new one, cached; always new when ``thorough``)."""
        key = call.cache_key(key)
        plan = None if thorough else self._plans.get(key)
        if plan is None:
            plan = plan_for(call, self.options, thorough=thorough)
        if key is not None:
            self._plans[key] = plan
        return plan

    def fallback_parameters(self, call: KernelCall, key: Any = None) -> dict[str, str]:
        """``{name: reason}`` of the parameters whose share comes from the Jacobian fallback."""
        plan = self.plan(call, key)
        return {call.model.names[index]: plan.reasons.get(index, "") for index in plan.fallback}

    def block_plan(self, call: KernelCall, key: Any = None, thorough: bool = False) -> BlockPlan:
        """The :class:`BlockPlan` of ``call`` under the cached plan, or a ``thorough`` new one.

        Its prepare functions raise :class:`Replan` when a pass meets parameter uses the cached
        plan did not foresee (the plan is then dropped from the cache); under a thorough plan
        that is a RuntimeError: the model runs different operations on the same inputs.
        """
        plan = self.plan(call, key, thorough)
        key = call.cache_key(key)
        blocks = _block_plan(call, self.options, plan)

        def guarded(side: Side) -> SideFactors:
            try:
                return blocks.prepare1(side)
            except PlanMismatch:
                if thorough:
                    raise _nondeterministic(call.where) from None
                self._plans.pop(key, None)
                raise Replan from None

        return dataclasses.replace(blocks, prepare1=guarded, prepare2=guarded)


def _block_plan(call: KernelCall, options: StructuredOptions, plan: Plan) -> BlockPlan:
    if options.verify:
        verify(call, plan)
    inner_chunk = None if call.side1.mapped else call.chunk_size
    param_sizes = [param.numel() for param in call.model.params]
    out_axes = call.side1.out_axes if call.side1.mapped else None

    def prepare(side: Side) -> SideFactors:
        factors = side_factors(side, plan, inner_chunk)
        if call.vmap_check is not None:
            call.vmap_check.per_example_outputs(side, call.expected_outputs(side), factors.outputs)
        return factors

    def contract(first: SideFactors, second: SideFactors, needed) -> list[Optional[torch.Tensor]]:
        return contract_sides(call.layouts, out_axes, first, second, needed, call.dtypes, param_sizes)

    return BlockPlan(prepare, prepare, contract, reuse_prepared=True, run_length=call.chunk_size)
