"""Which parameters the rules cover, and which weight/bias pairs share one factor.

A parameter is *ruled* when every op that consumed it in a probe pass had an applicable rule;
otherwise it goes to the Jacobian fallback whole. A parameter no op consumed is *unused* and
contributes nothing. Both claims are checked against autograd when the plan is made
(``_verify.py``); a parameter failing the check is *demoted* to the fallback. A weight and a bias
are stated *jointly* when both are ruled, seen whole, and every call using either uses both.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import AbstractSet, Mapping, Optional, Sequence

from ._roles import OutputSpec, Role, RuleCall


@dataclass(frozen=True)
class Plan:
    """The split of parameters between rules and the Jacobian fallback.

    Attributes:
        ruled: indices of parameters whose every use has a rule.
        fallback: indices of parameters whose Jacobians are contracted directly.
        joint: ``(weight, bias)`` index pairs stated by one joint role.
        local_jacobian: ``None`` for closed-form rules; ``"forward"``, ``"reverse"`` or ``"auto"``
            to compute each op's ``dy/dp`` densely instead (a test oracle).
        perturbed_shapes: the rule calls that contribute and their output shapes (per example) and
            dtypes, as seen by the probe; a pass on inputs of other shapes finds its own.
        reasons: why each fallback parameter is in the fallback (by index).
        whole_batch: with ``vmap_axes``, where the examples lie in the whole-batch pass of NOTE:
            [Whole-batch pullback] (``_side.py``), checked when the plan was made; None: every pass
            runs per example.
        whole_batch_reason: why :attr:`whole_batch` is None (None when it is set, or not decided).
    """

    ruled: frozenset[int]
    fallback: tuple[int, ...]
    joint: frozenset[tuple[int, ...]]
    local_jacobian: Optional[str]
    perturbed_shapes: Optional[dict[int, OutputSpec]] = None
    reasons: Mapping[int, str] = dataclasses.field(default_factory=dict)
    first_example_calls: Optional[tuple[RuleCall, ...]] = dataclasses.field(default=None, compare=False)
    """The rule calls of the probe of x1's first example, when the plan comes from that probe alone
    (AUTO prices the plan from them without probing again)."""
    whole_batch: Optional["WholeBatchLayout"] = dataclasses.field(default=None, compare=False)
    whole_batch_reason: Optional[str] = dataclasses.field(default=None, compare=False)
    custom_functions: bool = dataclasses.field(default=False, compare=False)
    """Whether the probe met a custom ``torch.autograd.Function``: the whole-batch pass then runs
    under a ``torch.func`` transform, as the probe did (NOTE: [The whole-batch pass by plain
    autograd] in ``_side.py``)."""

    def roles(self, call: RuleCall) -> list[Role]:
        """The roles of ``call`` that contribute: ruled parameters, joint pairs stated jointly."""
        separate, joint = call.roles()
        if joint is not None and joint.unit in self.joint:
            return [joint]
        return [role for role in separate if role.unit[0] in self.ruled]

    def foresees(self, calls: Sequence[RuleCall], unruled: AbstractSet[int]) -> bool:
        """Whether a recording pass used the parameters the way the plan's probe did.

        A parameter the plan calls ruled must not reach an op without a rule, and every parameter
        a rule call consumes must be known to the plan (ruled or in the fallback).

        Args:
            calls: the pass's rule calls.
            unruled: the parameters the pass saw consumed by an op without an applicable rule.
        """
        if unruled & self.ruled:
            return False
        known, paired = self._known, self._paired
        for call in calls:
            separate, joint = call.roles()
            if any(role.unit[0] not in known for role in separate):
                return False
            # a parameter stated jointly must never be used without its partner
            units = {paired[role.unit[0]] for role in separate if role.unit[0] in paired}
            if units and (joint is None or units != {joint.unit}):
                return False
        return True


    @functools.cached_property
    def _known(self) -> frozenset[int]:
        """The parameters the plan knows (:meth:`foresees`, on every pass): ruled or in the fallback."""
        return self.ruled | frozenset(self.fallback)

    @functools.cached_property
    def _paired(self) -> dict[int, tuple[int, ...]]:
        """The joint unit of every parameter stated jointly (:meth:`foresees`)."""
        return {index: unit for unit in self.joint for index in unit}


@dataclass(frozen=True)
class Fold:
    """Where a whole-batch tensor holds the per-example ones (NOTE: [Whole-batch pullback] in
    ``_side.py``).

    Attributes:
        axis: the axis holding the examples: one of size 1 per example, or one whose per-example
            size ``S`` is ``n S`` for ``n`` examples (a rule flattened the example into it). None:
            the tensor is shared by every example.
        inner: the example is the inner factor of a flattened axis (``(S, n)`` flattened, as a
            time-major sequence gives), not the outer one (``(n, S)``).
    """

    axis: Optional[int]
    inner: bool = False


@dataclass(frozen=True)
class WholeBatchLayout:
    """Where a whole-batch pass holds the examples (NOTE: [Whole-batch pullback] in ``_side.py``).

    Attributes:
        output_folds: for every perturbed rule call (by position), where its whole-batch output
            (and so its ``G``) holds the examples.
        operand_folds: the same for every operand of the kept roles, in the pass's order.
        example_signature: the per-example shapes of the inputs the plan's probe saw
            (:func:`~._side.example_signature`): only sides whose examples look alike take the
            whole-batch pass, as their per-example shapes are those of the plan's probe.
        checked_on: how many examples the layout was checked on against the per-example pass when
            the plan was made (0: not checked, only tests do that).
    """

    output_folds: Mapping[int, Fold]
    operand_folds: tuple[Fold, ...]
    example_signature: tuple
    checked_on: int


def make_plan(
    calls: list[RuleCall],
    unruled: set[int],
    n_params: int,
    *,
    structure_rules: bool,
    local_jacobian: Optional[str],
    shapes: Optional[Sequence[OutputSpec]] = None,
    reasons: Optional[Mapping[int, str]] = None,
) -> Plan:
    """Builds the plan from the rule calls and unruled parameters of the probe passes.

    ``shapes``: the output shape and dtype of each call, when the calls come from one probe pass.
    ``reasons``: why each unruled parameter is (kept in :attr:`Plan.reasons`).
    """
    if not structure_rules:
        everything = {index: "structure_rules=False" for index in range(n_params)}
        return Plan(frozenset(), tuple(range(n_params)), frozenset(), local_jacobian, reasons=everything)
    used: set[int] = set()
    calls_using: dict[int, set[int]] = {}
    offers: dict[int, tuple[int, ...]] = {}
    for position, call in enumerate(calls):
        separate, joint = call.roles()
        for role in separate:
            used.add(role.unit[0])
            calls_using.setdefault(role.unit[0], set()).add(position)
        if joint is not None and all(ref.index is None for ref in joint.refs):
            offers[position] = joint.unit
    ruled = frozenset(used - unruled)
    joint_units = set()
    if local_jacobian is None:
        for unit in set(offers.values()):
            positions = calls_using.get(unit[0], set()) | calls_using.get(unit[1], set())
            if set(unit) <= ruled and all(offers.get(position) == unit for position in positions):
                joint_units.add(unit)
    given = reasons or {}
    reasons = {index: given.get(index, "an operation without a derivative rule consumes it") for index in unruled}
    plan = Plan(ruled, tuple(sorted(unruled)), frozenset(joint_units), local_jacobian, reasons=reasons)
    if shapes is None:
        return plan
    perturbed = {position: shapes[position] for position, call in enumerate(calls) if plan.roles(call)}
    return dataclasses.replace(plan, perturbed_shapes=perturbed)

