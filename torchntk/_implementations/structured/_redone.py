"""Implementation 3's block plan of one call, made again from every example where a prepared side
meets parameter uses its plan did not foresee.

NOTE: [Plans redone within a call]
A quick plan comes from a probe of x1's first example (``plan_for``). Under ``vmap`` every example
of a side runs the operations that one ran, but x2's examples may have other shapes (a
shape-dependent branch is the only kind vmap allows), and an example loop runs Python per example
(branches on values). A pass that meets such operations raises ``PlanMismatch`` inside the
implementation. The plan is then made again from probes of every example (``thorough``), kept in
the key's record for later calls in place of the quick one, and the side is prepared under it.

Sides prepared before under the quick plan are not thrown away or refused: every prepared side is
a :class:`PreparedSide` that knows the plan it was prepared under and how to prepare it again,
and a contraction first brings both of its sides under the current plan (once per side: a kept
span is prepared again in place, not for each of its pairs). Whoever holds prepared sides
(``assemble``, ``batch``'s caches of spans and its workers) sees nothing of this: no exception
leaves the implementation, and nothing is computed twice that did not need to be. Blocks
contracted before the plan was made again stay valid: both of their sides were prepared under a
plan that foresaw their examples' operations, and such a plan's contraction is exact.

Under a thorough plan a mismatch means the model ran other operations on the same inputs, which
no plan can state: a ``RuntimeError`` that says to use implementation 1.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

from ..._call.blocks import BlockPlan
from ..._call.per_example import Side
from ._plan import Plan
from ._side import PlanMismatch, SideFactors


@dataclass
class PreparedSide:
    """A side's factors and the plan they were prepared under (NOTE: [Plans redone within a call]).

    Only ``factors`` holds tensors (``batch`` counts a prepared span's bytes by its fields): the plan
    is referred to weakly and the side is held by ``again``.
    """

    factors: SideFactors
    plan: weakref.ref
    again: Callable[[], tuple[Plan, SideFactors]]


class RedonePlan:
    """The current plan of one call of implementation 3 and its block plan, redone from every
    example once a prepared side meets operations the plan did not foresee.

    Args:
        planned: ``thorough -> plan``: the key's kept plan (``False``) or a new one from every
            example, then kept (``True``).
        blocks_of: the block plan of a plan.
        nondeterministic: the error of a mismatch under a thorough plan.
    """

    def __init__(
        self, planned: Callable[[bool], Plan], blocks_of: Callable[[Plan], BlockPlan],
        nondeterministic: Callable[[], Exception],
    ):
        self._planned = planned
        self._blocks_of = blocks_of
        self._nondeterministic = nondeterministic
        self._lock = threading.Lock()
        plan = planned(False)
        self._current = (plan, blocks_of(plan), False)  # read and replaced whole: a thread sees one plan

    @property
    def plan(self) -> Plan:
        return self._current[0]

    @property
    def blocks(self) -> BlockPlan:
        return self._current[1]

    def prepare(self, side: Side, first: bool) -> PreparedSide:
        """``side`` prepared under the current plan (``prepare1`` of the block plan where ``first``)."""

        def again() -> tuple[Plan, SideFactors]:
            return self._prepared(side, first)

        plan, factors = again()
        return PreparedSide(factors, weakref.ref(plan), again)

    def contract(self, first: PreparedSide, second: PreparedSide, needed: list[bool]) -> list[Any]:
        """The block plan's contraction of two prepared sides, both brought under the current plan."""
        while True:
            plan, blocks, _ = self._current
            for prepared in (first, second):
                if prepared.plan() is not plan:
                    made_under, prepared.factors = prepared.again()
                    prepared.plan = weakref.ref(made_under)
            if first.plan() is plan and second.plan() is plan:
                return blocks.contract(first.factors, second.factors, needed)
            # the plan was made again while a side was being prepared: bring both under the new one

    def _prepared(self, side: Side, first: bool) -> tuple[Plan, SideFactors]:
        plan, blocks, thorough = self._current
        try:
            return plan, (blocks.prepare1 if first else blocks.prepare2)(side)
        except PlanMismatch:
            if thorough:
                raise self._nondeterministic() from None
        plan, blocks = self._thorough(plan)
        try:
            return plan, (blocks.prepare1 if first else blocks.prepare2)(side)
        except PlanMismatch:
            raise self._nondeterministic() from None

    def _thorough(self, seen: Plan) -> tuple[Plan, BlockPlan]:
        """The thorough plan and its block plan, made once whichever thread asks first."""
        with self._lock:
            plan, blocks, thorough = self._current
            if plan is seen and not thorough:
                plan = self._planned(True)
                blocks = self._blocks_of(plan)
                self._current = (plan, blocks, True)
            return plan, blocks
