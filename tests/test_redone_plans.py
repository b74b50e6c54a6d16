"""NOTE: [Plans redone within a call] (``torchntk/_implementations/structured/_redone.py``): a side
that meets operations its plan did not foresee is prepared under a plan from every example, made
once; sides prepared before are prepared again under it before any contraction, once each; under
a plan from every example a mismatch is a clear error. End to end (``batch``, ``chunk_size``, a
whole call): ``tests/test_batching.py::test_structured_plan_is_redone_when_later_spans_run_other_operations``."""

from __future__ import annotations

import threading
from collections import Counter

import pytest

from torchntk._call.blocks import BlockPlan
from torchntk._implementations.structured._redone import RedonePlan
from torchntk._implementations.structured._side import PlanMismatch

pytestmark = pytest.mark.cpu_only("plain Python objects stand in for plans and factors")


class _Plan:
    def __init__(self, thorough: bool):
        self.thorough = thorough


class _Script:
    """Fake plans and block plans: a side named in ``unforeseen`` mismatches a quick plan (and, in
    ``never``, any plan); factors record the plan they were prepared under."""

    def __init__(self, unforeseen=(), never=(), barrier=None):
        self.unforeseen, self.never, self.barrier = set(unforeseen), set(never), barrier
        self.plans = []
        self.prepared = Counter()

    def planned(self, thorough: bool) -> _Plan:
        self.plans.append(thorough)
        return _Plan(thorough)

    def blocks_of(self, plan: _Plan) -> BlockPlan:
        def prepare(side: str):
            if self.barrier is not None and side in self.unforeseen and not plan.thorough:
                self.barrier.wait()  # both threads meet the quick plan's mismatch at once
            if side in self.never or (side in self.unforeseen and not plan.thorough):
                raise PlanMismatch
            self.prepared[side, plan.thorough] += 1
            return (side, plan)

        def contract(first, second, needed):
            assert first[1] is second[1], "contracted under two plans"
            return [(first[0], second[0], first[1].thorough)]

        return BlockPlan(prepare, prepare, contract, reuse_prepared=True)

    def redone(self) -> RedonePlan:
        return RedonePlan(self.planned, self.blocks_of, lambda: RuntimeError("different operations"))


def test_a_mismatch_makes_the_plan_once_and_earlier_sides_are_prepared_again_once():
    script = _Script(unforeseen={"x2"})
    redone = script.redone()
    first = redone.prepare("x1", first=True)
    second = redone.prepare("x2", first=False)  # the quick plan's mismatch: a plan from every example
    assert script.plans == [False, True] and redone.plan.thorough
    for _ in range(3):  # x1's side, prepared under the quick plan, is prepared again once
        assert redone.contract(first, second, [True]) == [("x1", "x2", True)]
    assert script.prepared == Counter({("x1", False): 1, ("x1", True): 1, ("x2", True): 1})
    third = redone.prepare("x3", first=True)
    assert redone.contract(third, third, [True]) == [("x3", "x3", True)]
    assert script.plans == [False, True]


def test_sides_that_match_keep_their_quick_plan():
    script = _Script()
    redone = script.redone()
    first, second = redone.prepare("x1", first=True), redone.prepare("x2", first=False)
    assert redone.contract(first, second, [True]) == [("x1", "x2", False)]
    assert script.plans == [False] and script.prepared == Counter({("x1", False): 1, ("x2", False): 1})


def test_a_mismatch_under_a_plan_from_every_example_is_a_clear_error():
    script = _Script(unforeseen={"x2"}, never={"x3"})
    redone = script.redone()
    redone.prepare("x2", first=False)
    with pytest.raises(RuntimeError, match="different operations"):
        redone.prepare("x3", first=True)
    fresh = _Script(never={"x3"}).redone()
    with pytest.raises(RuntimeError, match="different operations"):  # quick, then thorough, both refuse it
        fresh.prepare("x3", first=True)


def test_two_threads_meeting_the_mismatch_make_one_plan():
    script = _Script(unforeseen={"x2", "y2"}, barrier=threading.Barrier(2))
    redone = script.redone()
    results, errors = {}, []

    def run(name):
        try:
            results[name] = redone.prepare(name, first=False)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(name,)) for name in ("x2", "y2")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and script.plans == [False, True]
    assert redone.contract(results["x2"], results["y2"], [True]) == [("x2", "y2", True)]
