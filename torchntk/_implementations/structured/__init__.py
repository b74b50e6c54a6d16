"""NTK implementation 3: structured derivatives.

``K = sum_p J1_p J2_p^T`` with each ``J_p = sum_k G_k Y_k`` split at the ops ``y_k = op(p, ...)``
that consume ``p``: ``G_k = df/dy_k`` comes from batched VJPs that stop at ``y_k``, and
``Y_k = dy_k/dp`` is never formed: closed-form rules (``rules/``) state ``G_k Y_k`` as a small
einsum, and one opt_einsum-planned contraction per pair of uses gives ``J1_p J2_p^T``. For a
width-``W`` dense layer that removes a factor ``W`` from the cost of Jacobian contraction.

The pieces, in the order they run:

* ``_recorder.py``: a ``TorchFunctionMode`` that sees every op consuming a parameter;
* ``_plan.py``: which parameters the rules cover (the rest go to the Jacobian fallback);
* ``_side.py``: ``G`` and the operands of each use, per side (``_joint.py``: x1 and x2 in one pass;
  ``_whole_batch.py``: whether the passes may run over the whole batch instead of per example);
* ``_merge.py``: the uses of one parameter stated alike, merged into one;
* ``_contract.py``: the pair contractions;
* ``_verify.py``: the check of a plan against autograd (when it is made, or on every call);
* ``_redone.py``: a call's plan made again from every example where a pass meets what it did not foresee;
* ``_unrolled.py``: models that differentiate inside their forward pass, evaluated through a
  traced graph of it so that the rules see the derivatives' products;
* ``_constant.py``: the kernels are constants of the inputs, and a backward pass through them
  raises instead of returning a wrong derivative.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..._call.blocks import BlockPlan, assemble
from ..._call.kernel_call import KernelCall
from ..._call.per_example import Side
from ..._plan.scope import Scope, cached
from ..._utils.types import NtkImplementation
from ..choice import AutoChoice
from ._constant import constant_of_inputs
from ._contract import contract_sides
from ._joint import gradients_per_example, joined
from ._plan import Plan, make_plan
from ._redone import RedonePlan
from ._roles import OutputSpec, RuleCall
from ._side import PlanMismatch, SideFactors, WholeBatchPass, per_example_factors, probe, side_factors
from ._unrolled import WHOLE_BATCH_REASON, is_unrolled, through_derivatives
from ._verify import disagreements, verify, whole_batch_products
from ._whole_batch import LayoutShapes, check_sample, found_layout, layout_shapes, sample_pass, with_whole_batch


@dataclass(frozen=True)
class StructuredOptions:
    """Knobs of implementation 3 (see ``empirical_ntk_fn``)."""

    structure_rules: bool = True
    closed_form_rules: bool = True
    local_jacobian: str = "auto"
    verify: bool = False


@dataclass(frozen=True)
class ProbedPlan:
    """What the probe passes of a plan saw, before the plan is checked against autograd.

    AUTO prices implementation 3 from :meth:`unchecked` and has the plan checked (the dearer part)
    only when it picks 3; the check then reuses these probes. Holds shapes only (the rule calls
    keep their roles on meta tensors), so a cached one keeps no parameters alive.
    """

    calls: tuple[RuleCall, ...]
    unruled: frozenset[int]
    shapes: tuple[OutputSpec, ...]
    reasons: dict[int, str]
    n_params: int
    local_jacobian: Optional[str]
    thorough: bool
    one_pass: bool  # one side probed with closed-form rules: its perturbed shapes serve every pass
    custom_functions: bool = False  # NOTE: [The whole-batch pass by plain autograd] in _side.py

    def build(self, demoted: dict[int, str]) -> Plan:
        """The plan with the ``demoted`` parameters (index: reason) in the fallback."""
        return make_plan(
            list(self.calls), set(self.unruled) | set(demoted), self.n_params, structure_rules=True,
            local_jacobian=self.local_jacobian, shapes=list(self.shapes) if self.one_pass else None,
            reasons={**self.reasons, **demoted},
        )

    def unchecked(self) -> Plan:
        """The plan as probed, nothing demoted: what pricing needs."""
        return _with_probe(self.build({}), self)


def probe_plan(call: KernelCall, options: StructuredOptions, thorough: bool = False) -> ProbedPlan:
    """The probe passes of :func:`plan_for`: x1's first example, or (``thorough``) every example of
    both sides. Needs ``options.structure_rules``."""
    sides = _probed_sides(call, thorough)
    calls: list[RuleCall] = []
    unruled: set[int] = set()
    shapes: list[OutputSpec] = []
    reasons: dict[int, str] = {}
    custom_functions = False
    for side in sides:
        probed = probe(side, first_example_only=False)
        calls.extend(probed.calls)
        unruled |= probed.unruled
        shapes.extend(probed.output_specs)
        reasons = {**probed.reasons, **reasons}  # the first side's reason wins
        custom_functions |= probed.custom_functions
    local = None if options.closed_form_rules else options.local_jacobian
    return ProbedPlan(
        tuple(calls), frozenset(unruled), tuple(shapes), reasons, len(call.model.params), local, thorough,
        one_pass=len(sides) == 1 and local is None, custom_functions=custom_functions,
    )


def _probed_sides(call: KernelCall, thorough: bool) -> list[Side]:
    if thorough:
        return [side for side in (call.side1, call.side2) if side is not None]
    side = call.side1
    return [side.narrow(0, min(1, side.batch_size())) if side.mapped else side]


def plan_for(
    call: KernelCall, options: StructuredOptions, thorough: bool = False, probed: Optional[ProbedPlan] = None,
    shapes: Optional[LayoutShapes] = None,
) -> Plan:
    """Splits the parameters between the rules and the fallback from probe passes, checked.

    The quick plan probes the first example of x1; a ``thorough`` one probes every example of
    both sides (needed when the model's operations depend on the data). The plan is then checked
    against autograd on the probed examples (NOTE: [Checking a plan against autograd]) and every
    parameter that fails goes to the fallback, its reason kept in :attr:`Plan.reasons`; with
    ``verify=True`` the check runs on every call instead and raises. Last, whether its passes may
    run over the whole batch is decided and checked (NOTE: [Whole-batch pullback]).

    NOTE: [One pass for both checks of a plan]
    A quick plan is checked twice when it is made: against autograd (``_verify.py``) and, where its
    passes may run over the whole batch, the whole-batch pass against the per-example pass
    (``_whole_batch.py``). Both compare the per-example pass's factors contracted with a random
    cotangent, so where the whole-batch check can run (``check_sample``: a few examples of one
    per-example shape, mapped by vmap) the check against autograd runs on the same examples and
    cotangents and both read one per-example pass, and autograd's products come from the
    whole-batch check's own pass (NOTE: [Autograd's products from the whole-batch check]); a plan
    that demotes parameters passes the whole-batch check a pass of its own. Against autograd, the
    examples are then those the whole-batch check takes (up to three) rather than the first one.

    Args:
        probed: the quick probes of ``call`` made already (:func:`probe_plan`), to check.
        shapes: what the shapes of the whole-batch pass told AUTO already (``layout_shapes``).

    Raises:
        RuntimeError: the check's pass met other operations than the probe on the same inputs.
    """
    n_params = len(call.model.params)
    if not options.structure_rules:
        local = None if options.closed_form_rules else options.local_jacobian
        return make_plan([], set(), n_params, structure_rules=False, local_jacobian=local)
    if probed is None or probed.thorough != thorough:
        probed = probe_plan(call, options, thorough)
    plan = _with_probe(probed.build({}), probed)
    single = done = None  # NOTE: [One pass for both checks of a plan]
    if not (options.verify or len(plan.fallback) == n_params):  # verify=True checks every call; nothing to check
        demoted: dict[int, str] = {}
        sample = None if thorough or plan.local_jacobian is not None else check_sample(call)
        try:
            if sample is not None:
                examples, cotangents = sample
                single = per_example_factors(examples, plan, cotangents=cotangents)
                settled, shapes, done = _settles_derivatives(call, plan, sample, single, shapes)
                if not settled:
                    demoted.update(disagreements(examples, plan, cotangents=cotangents, factors=single))
            else:
                for side in _probed_sides(call, thorough):
                    demoted.update(disagreements(side, plan))
        except PlanMismatch:
            raise _nondeterministic(call.where) from None
        if demoted:
            plan, single, done = _with_probe(probed.build(demoted), probed), None, None
    if thorough:  # probed on every example: no one-example probe to read the whole batch by
        return dataclasses.replace(plan, whole_batch_reason="the plan comes from probes of every example")
    if is_unrolled(call.model):
        return dataclasses.replace(plan, whole_batch_reason=WHOLE_BATCH_REASON)
    grouped = _within_groups(plan, call.groups) if call.groups is not None else None
    try:
        ungrouped = grouped is None
        return with_whole_batch(
            call, plan, grouped, single=single if ungrouped else None, shapes=shapes, done=done if ungrouped else None
        )
    except PlanMismatch:
        raise _nondeterministic(call.where) from None


def _settles_derivatives(
    call: KernelCall, plan: Plan, sample: tuple[Side, tuple], factors: SideFactors, shapes: Optional[LayoutShapes]
) -> tuple[bool, Optional[LayoutShapes], Optional[WholeBatchPass]]:
    """Whether the structured ``J^T v`` of the ``sample``'s examples and cotangents (``factors``)
    agrees with autograd's on the examples as one batch, which settles the call's pending
    derivative check (NOTE: [The derivative check within a plan's check]) and 3's own check.
    False, concluding nothing, where no check is pending, a parameter is left to the Jacobian
    fallback (whose per-example derivatives this would not see), or they disagree.

    Autograd's products come from the whole-batch check's pass of the same examples where that
    pass can run (NOTE: [Autograd's products from the whole-batch check]), returned with the
    layout shapes it was made with for that check to reuse."""
    if not _may_settle_derivatives(call, plan):
        return False, shapes, None
    pending = call.derivative_check
    examples, cotangents = sample
    done = None
    if call.groups is None and not is_unrolled(call.model):  # where the whole-batch check runs on this plan
        shapes, done = sample_pass(call, plan, sample, shapes)
    if done is not None:
        # parameter-sized: not kept beyond this comparison while the pass's factors are checked
        whole, done.parameter_products = done.parameter_products, None
    else:
        whole = whole_batch_products(examples, cotangents)
    if whole is None or disagreements(examples, plan, cotangents=cotangents, factors=factors, expected=whole):
        return False, shapes, done
    pending.vouched_by_3 = True
    return True, shapes, done


def _may_settle_derivatives(call: KernelCall, plan: Plan) -> bool:
    """Whether 3's check of ``plan`` can settle the call's pending derivative check (NOTE: [The
    derivative check within a plan's check]): one is pending and no parameter is left to the
    Jacobian fallback, whose per-example derivatives the check would not see."""
    pending = call.derivative_check
    return pending is not None and pending.open and not plan.fallback


def _with_probe(plan: Plan, probed: ProbedPlan) -> Plan:
    """The plan, keeping the calls of a quick plan's probe for AUTO's pricing (``structured_cost``),
    and whether the probe met a custom ``torch.autograd.Function`` (for the whole-batch pass)."""
    if probed.thorough:
        return plan
    return dataclasses.replace(plan, first_example_calls=probed.calls, custom_functions=probed.custom_functions)


def _nondeterministic(where: str) -> RuntimeError:
    return RuntimeError(
        f"{where}: structured derivatives: the model consumed its parameters through different "
        f"operations in different evaluations on the same inputs; it must run the same operations "
        f"every time. Use implementation=1 for this model."
    )


_PLAN, _PROBE, _SHAPES = "structured plan", "structured probe", "structured layout shapes"
"""The kinds of what implementation 3 keeps in a key's record (NOTE: [One record per key]): the
checked plan; the quick probe AUTO priced from, until checked; what ``layout_reason`` found, until
checked."""


@dataclass(frozen=True)
class StructuredDerivatives:
    """Implementation 3 with its options. Holds no state: the plan of a key (which parameters the
    rules cover) is kept in the key's record, reached by the ``scope`` each method is given
    (NOTE: [One record per key]; None: planned for the call alone).

    The plan comes from a probe of one example and is reused for calls with the same key; every
    pass checks that the model still consumes its parameters as the plan says and re-plans from a
    probe of all examples when it does not, within the call (NOTE: [Plans redone within a call]).
    """

    options: StructuredOptions = StructuredOptions()

    def unrolled(self, call: KernelCall, scope: Optional[Scope]) -> KernelCall:
        """``call``, its model evaluated through a traced graph where it takes derivatives that
        consume its parameters (NOTE: [Unrolled derivatives]); every method starts from it."""
        if not self.options.structure_rules:
            return call

        def probed(one: KernelCall) -> ProbedPlan:
            return cached(scope, _PROBE, one, lambda: probe_plan(one, self.options))

        def forget(one: KernelCall) -> None:
            for kind in (_PLAN, _PROBE, _SHAPES):
                scope.pop(kind, one)  # called only with a scope (through_derivatives)

        return through_derivatives(call, scope, probed, forget)

    def __call__(self, call: KernelCall, scope: Optional[Scope] = None) -> list[torch.Tensor]:
        planned = self.unrolled(call, scope)
        return assemble(planned, self._blocks_of(call, planned, scope))

    # -- NOTE: [The implementation table] ------------------------------------------------------

    def kernels(self, call: KernelCall, scope: Optional[Scope]) -> list[torch.Tensor]:
        # NOTE: [Kernels that are constants of the inputs]: no wrong derivative through them
        return constant_of_inputs(call, self(call, scope))

    def blocks(self, call: KernelCall, scope: Optional[Scope], block: Optional[tuple] = None) -> BlockPlan:
        return self.block_plan(call, scope)

    def choice(self, call: KernelCall, scope: Optional[Scope]) -> AutoChoice:
        fallback = self.fallback_parameters(call, scope)  # from the plan the kernel itself uses
        return AutoChoice(NtkImplementation.STRUCTURED_DERIVATIVES, fallback_parameters=fallback)

    def plan(self, call: KernelCall, scope: Optional[Scope] = None, thorough: bool = False) -> Plan:
        """The kept plan of the call's key (or a new one, kept; always new when ``thorough``)."""
        return self._plan(self.unrolled(call, scope), scope, thorough)

    def _plan(self, call: KernelCall, scope: Optional[Scope], thorough: bool = False) -> Plan:
        """:meth:`plan` of a call :meth:`unrolled` already (the private methods all take one)."""
        plan = None if thorough or scope is None else scope.get(_PLAN, call)
        if plan is not None:
            return plan
        probed = None if thorough or scope is None else scope.pop(_PROBE, call)
        shapes = None if thorough or scope is None else scope.pop(_SHAPES, call)
        plan = plan_for(call, self.options, thorough=thorough, probed=probed, shapes=shapes)
        if scope is not None:
            scope.put(_PLAN, call, plan)
        return plan

    def unchecked_plan(self, call: KernelCall, scope: Optional[Scope] = None) -> Plan:
        """The quick plan before its check against autograd (what AUTO prices 3 from); the checked
        plan when there is one. Its probe is kept for :meth:`plan` to check."""
        return self._unchecked_plan(self.unrolled(call, scope), scope)

    def _unchecked_plan(self, call: KernelCall, scope: Optional[Scope]) -> Plan:
        plan = None if scope is None else scope.get(_PLAN, call)
        if plan is not None:
            return plan
        if not self.options.structure_rules:
            return self._plan(call, scope)  # nothing to probe or check
        return cached(scope, _PROBE, call, lambda: probe_plan(call, self.options)).unchecked()

    def layout_reason(self, call: KernelCall, scope: Optional[Scope] = None) -> Optional[str]:
        """Why the quick plan's passes cannot run over the whole batch, as far as the shapes of the
        check's whole-batch pass tell (``found_layout``; None: they may), without checking the
        plan: AUTO prices 3 from it before paying for the check. Kept, with that pass, for
        :meth:`plan`'s check to reuse."""
        call = self.unrolled(call, scope)
        plan = None if scope is None else scope.get(_PLAN, call)
        if plan is not None:
            return plan.whole_batch_reason
        if is_unrolled(call.model):
            return WHOLE_BATCH_REASON
        plan = self._unchecked_plan(call, scope)
        if call.groups is not None:  # the check reads the pass by the roles groups split
            shapes = layout_shapes(call, plan)
        else:  # NOTE: [The layout read from the check's own pass]: the check's own, if it settles derivatives
            shapes = found_layout(call, plan, parameters=_may_settle_derivatives(call, plan))
        if scope is not None:
            scope.put(_SHAPES, call, shapes)
        return shapes.reason

    def fallback_parameters(self, call: KernelCall, scope: Optional[Scope] = None) -> dict[str, str]:
        """``{name: reason}`` of the parameters whose share comes from the Jacobian fallback."""
        call = self.unrolled(call, scope)
        plan = self._plan(call, scope)
        return {call.model.names[index]: plan.reasons.get(index, "") for index in plan.fallback}

    def block_plan(self, call: KernelCall, scope: Optional[Scope] = None) -> BlockPlan:
        """The :class:`BlockPlan` of ``call`` under the kept plan, made again from every example
        (and kept so) where a prepared side meets parameter uses the kept plan did not foresee
        (NOTE: [Plans redone within a call]); under a plan from every example that is a
        RuntimeError: the model runs different operations on the same inputs.
        """
        return self._blocks_of(call, self.unrolled(call, scope), scope)

    def _blocks_of(self, given: KernelCall, call: KernelCall, scope: Optional[Scope]) -> BlockPlan:
        """:meth:`block_plan` of ``given``, ``call`` being it :meth:`unrolled`."""
        redone = RedonePlan(
            lambda thorough: self._plan(call, scope, thorough),
            lambda plan: _block_plan(call, self.options, plan),
            lambda: _nondeterministic(call.where),
        )
        blocks = redone.blocks

        def as_planned(side: Side) -> Side:
            """A side of the call as its caller holds it, with the model the plan evaluates."""
            if call is given:
                return side
            if side is given.side1 or side is given.side2:
                return call.side1 if side is given.side1 else call.side2
            return dataclasses.replace(side, model=call.model)  # a span or run of the call's examples

        return dataclasses.replace(
            blocks,
            prepare1=lambda side: redone.prepare(as_planned(side), first=True),
            prepare2=lambda side: redone.prepare(as_planned(side), first=False),
            contract=redone.contract,
            implementation=NtkImplementation.STRUCTURED_DERIVATIVES, structured=redone.plan,
        )


def _block_plan(call: KernelCall, options: StructuredOptions, plan: Plan) -> BlockPlan:
    if call.groups is not None:
        plan = _within_groups(plan, call.groups)
    if options.verify:
        verify(call, plan)
    inner_chunk = None if call.side1.mapped else call.chunk_size
    param_sizes = [param.numel() for param in call.model.params]
    out_axes = call.side1.out_axes if call.side1.mapped else None

    # A pending output check of vmap_axes (check_vmap_axes=True, on calls after the first) compares
    # per-example outputs with the whole batch's: the per-example pass gives them for free, where a
    # whole-batch pass would need the check's own per-example forward pass on top of its own
    # evaluation of the model (NOTE: [Whole-batch pullback]). Such calls keep the per-example pass.
    whole_batch = call.vmap_check is None

    def check_outputs(side: Side, factors: SideFactors) -> None:
        if call.vmap_check is None:
            return
        if factors.per_example:
            call.vmap_check.per_example_outputs(side, call.expected_outputs(side), factors.outputs)
        else:  # never skipped: a whole-batch pass has no per-example outputs, the check makes its own
            call.check_outputs(side)

    def prepare(side: Side) -> SideFactors:
        factors = side_factors(side, plan, inner_chunk, whole_batch=whole_batch)
        check_outputs(side, factors)
        return factors

    pending: dict[int, SideFactors] = {}  # x1's half of a joint pass, until prepare1 asks for it
    per_example = gradients_per_example(call, plan)

    def prepare2(side: Side) -> SideFactors:
        # NOTE: [One pass for both sides]: assemble prepares the whole x2 first, then the whole x1
        both = joined(call.side1, side, per_example) if side is call.side2 else None
        if both is None:
            return prepare(side)
        factors = side_factors(both, plan, inner_chunk, whole_batch=whole_batch)
        size1 = call.side1.batch_size()
        first = factors.narrow(0, size1, out_axes)
        second = factors.narrow(size1, side.batch_size(), out_axes)
        for one, part in ((call.side1, first), (side, second)):
            check_outputs(one, part)
        pending[id(call.side1)] = first
        return second

    def prepare1(side: Side) -> SideFactors:
        factors = pending.pop(id(side), None) if side is call.side1 else None
        return prepare(side) if factors is None else factors

    group_sets = [set(indices) for indices in call.groups or ()]

    def contract(first: SideFactors, second: SideFactors, needed) -> list[Optional[Any]]:
        if call.groups is None:
            return contract_sides(call.layouts, out_axes, first, second, needed, call.dtypes, param_sizes)
        per_group = []
        for indices in group_sets:  # every use's pair contraction lands in one group's sum
            one = _group_factors(first, indices, plan)
            two = one if second is first else _group_factors(second, indices, plan)
            per_group.append(contract_sides(call.layouts, out_axes, one, two, needed, call.dtypes, param_sizes))
        return [
            tuple(blocks[leaf] for blocks in per_group) if is_needed else None for leaf, is_needed in enumerate(needed)
        ]

    return BlockPlan(
        prepare1, prepare2, contract, reuse_prepared=True, run_length=call.run_length,
        keep_prepared=call.chunk_size is None,
    )


# -- NOTE: [Parameter groups] (``torchntk/_call/groups.py``) ---------------------------------------------


def _within_groups(plan: Plan, groups: tuple[tuple[int, ...], ...]) -> Plan:
    """The plan without joint weight/bias roles whose parameters are in different groups (their one
    contraction cannot be split between the groups): those parameters get separate roles."""
    group_of = {index: position for position, indices in enumerate(groups) for index in indices}
    joint = frozenset(unit for unit in plan.joint if len({group_of[index] for index in unit}) == 1)
    return plan if joint == plan.joint else dataclasses.replace(plan, joint=joint)


def _group_factors(factors: SideFactors, indices: set[int], plan: Plan) -> SideFactors:
    """The factors of the parameters ``indices`` only: their uses and fallback Jacobians."""
    uses = [use for use in factors.uses if use.role.unit[0] in indices]
    fallback = factors.fallback
    if fallback is not None:
        kept = [position for position, index in enumerate(plan.fallback) if index in indices]
        fallback = tuple(tuple(per_leaf[position] for position in kept) for per_leaf in fallback)
    return dataclasses.replace(factors, uses=uses, fallback=fallback)
