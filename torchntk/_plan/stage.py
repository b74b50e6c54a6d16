"""The plans of one kernel function: decided from facts once per key, kept in a bounded cache.

See NOTE: [The planning stage] in ``plan.py``.
"""

from __future__ import annotations

import threading
from dataclasses import replace
import math
from typing import Any, Callable, Hashable, Optional

from .._utils.bounded_cache import BoundedCache
from .plan import CallPlan, CallTemplate, Facts, Purpose

__all__ = ["Planner"]

_KEYS = 64
"""Keys (input shapes, module structures) whose facts a kernel function keeps."""

_PLANS = 4 * _KEYS
"""Plans a kernel function keeps: a few purposes per key."""

_NO_FACTS = Facts()


class Planner:
    """The facts and plans of one kernel function (NOTE: [The planning stage]). Thread-safe: its
    caches are, and a fact is only ever added (two threads learning the same fact agree).

    Args:
        keeps_forward_pass: calls always evaluate the whole batch (captured kernels, whose graph
            is traced from the call).
        watches_aliases: the model is a module whose parameter references are checked once per key
            (NOTE: [Aliased parameters]).
    """

    def __init__(self, keeps_forward_pass: bool, watches_aliases: bool) -> None:
        self.keeps_forward_pass = keeps_forward_pass
        self.watches_aliases = watches_aliases
        self._keys = BoundedCache(_KEYS)
        self._facts = BoundedCache(_KEYS)
        self._plans = BoundedCache(_PLANS)
        self._memory = BoundedCache(_PLANS)
        self._lock = threading.Lock()

    def canonical(self, key: Hashable) -> Hashable:
        """The key this planner keeps for keys equal to ``key`` (``key`` itself the first time): a
        call's lookups in the planner's caches then find it by identity, where a new key's equal
        parts (a module's structure fingerprint, a deep tuple) would be compared anew in every one
        (eight times per warm call, 0.2 ms of a schnetpack SchNet's 12 ms)."""
        kept = self._keys.get(key)
        if kept is None:
            self._keys[key] = key
            return key
        return kept

    def facts(self, key: Hashable) -> Facts:
        """What calls with ``key`` learnt."""
        return self._facts.get(key, _NO_FACTS)

    def learn(self, key: Hashable, **facts: Any) -> None:
        """Adds facts about ``key``; plans decided from the older facts are not used again."""
        with self._lock:
            self._facts[key] = self.facts(key).learnt(**facts)

    def plan(self, key: Hashable, purpose: Purpose) -> CallPlan:
        """The plan for ``key`` and ``purpose``: the kept one, else one decided from the facts."""
        facts = self.facts(key)
        found = self._plans.get((key, purpose))
        if found is not None and found[0] is facts:
            return found[1]
        return self.decide(facts, purpose)

    def decide(self, facts: Facts, purpose: Purpose) -> CallPlan:
        """The checks, loop and stand-in outputs of a call with these facts (no template yet).

        The derivative check runs once per key (with any ``check_vmap_axes`` but False); the
        output check on every call with True, on the first with ``"first"``; the remembered
        outputs stand in for the whole-batch forward pass where no output check runs and only the
        NTK is computed (NOTE: [Remembered output shapes])."""
        mode = purpose.checks
        mapped = purpose.maps_examples
        check_outputs = mode is True or (mode == "first" and not (mapped and facts.derivatives_checked))
        outputs = None
        if mapped and purpose.computes_ntk and not (
            purpose.needs_outputs or check_outputs or self.keeps_forward_pass
        ):
            outputs = facts.outputs
        check_derivatives = mapped and bool(mode) and not facts.derivatives_checked
        return CallPlan(
            check_outputs=check_outputs,
            check_derivatives=check_derivatives,
            outputs_in_kernel=check_outputs and purpose.computes_ntk and not check_derivatives,
            check_aliases=self.watches_aliases and not facts.aliases_checked,
            example_loop=mapped and facts.example_loop,
            outputs=outputs,
        )

    def keep(self, key: Hashable, purpose: Purpose, plan: CallPlan) -> None:
        """Keeps ``plan`` for ``key`` and ``purpose`` while the facts it was decided from hold."""
        self._plans[(key, purpose)] = (self.facts(key), plan)

    def template_for(
        self, key: Hashable, purpose: Purpose, template: CallTemplate, working_runs: Optional[int],
    ) -> Optional[CallPlan]:
        """The plan of later calls with ``key`` and ``purpose`` after a call prepared ``template``:
        kept (and returned) only where such a call runs no check and needs the outputs' shapes
        alone, so that binding its tensors to the template is the whole preparation."""
        later = self.decide(self.facts(key), purpose)
        if later.outputs is None or later.check_outputs or later.check_derivatives or later.check_aliases:
            return None
        plan = replace(later, template=template, working_runs=working_runs)
        self.keep(key, purpose, plan)
        return plan

    def memory_plan(self, key: Optional[Hashable], budget: float, make: Callable[[float], Any]) -> Any:
        """The memory plan (``MemoryPlan``) of a call whose plan key and call-specific choices are
        ``key`` (None: nothing kept), made by ``make(budget)`` unless the one kept for ``key`` still
        holds: made for this budget, or for another whose plan chose no ``chunk_size`` and fits this
        one too (a default budget follows the free memory, which moves between calls; AUTO keeps its
        pick on the same rule). ``make`` raises the refusal of a call that does not fit."""
        kept = None if key is None else self._memory.get(key)
        if kept is not None and _still_holds(kept, budget):
            return kept
        made = make(budget)
        if key is not None:
            self._memory[key] = made
        return made


def _still_holds(plan: Any, budget: float) -> bool:
    if plan.budget == budget:
        return True
    if plan.chosen or math.isfinite(plan.budget) != math.isfinite(budget):
        return False
    return not math.isfinite(budget) or (plan.peak is not None and plan.peak.planned <= budget)
