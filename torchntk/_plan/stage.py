"""The plans of one kernel function: decided from facts once per key, kept in one record per key.

See NOTE: [The planning stage] in ``plan.py`` and NOTE: [One record per key] in ``scope.py``.
"""

from __future__ import annotations

import threading
from dataclasses import replace
import math
from typing import Any, Callable, Hashable, Optional

from .._model.fingerprint import FingerprintMemo
from .._utils.bounded_cache import BoundedCache
from .._utils.values import PLAIN
from .plan import CallPlan, CallTemplate, Facts, Purpose
from .scope import Scope

__all__ = ["KeyRecord", "Planner"]

_KEYS = 64
"""Keys (input shapes, module structures) whose records a kernel function keeps."""

_MEMORY_PLANS = 16
"""Memory plans a record keeps: per differentiated parameters, chunk and run lengths, loop, groups."""

_DERIVED = 128
"""Entries a record keeps of what the implementations derived (NOTE: [One record per key])."""

_NO_FACTS = Facts()


class KeyRecord:
    """Everything a kernel function keeps about one plan key (NOTE: [One record per key]).

    Attributes:
        key: the key, as first seen (see :meth:`Planner.canonical`).
        facts: what calls with the key learnt.
        plans: ``purpose -> (facts, CallPlan)``: the plans kept, with the facts they were decided from.
        memory: the memory plans by the call's choices within the key.
        derived: what the implementations derived (:class:`~torchntk._plan.scope.Scope`).
    """

    __slots__ = ("key", "facts", "plans", "memory", "derived")

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.facts = _NO_FACTS
        self.plans: dict = {}
        self.memory = BoundedCache(_MEMORY_PLANS)
        self.derived = BoundedCache(_DERIVED)


class Planner:
    """The records of one kernel function's keys (NOTE: [The planning stage], NOTE: [One record
    per key]). Thread-safe: its cache is, a record is made under a lock, and a fact is only ever
    added (two threads learning the same fact agree).

    Args:
        keeps_forward_pass: calls always evaluate the whole batch (captured kernels, whose graph
            is traced from the call).
        watches_aliases: the model is a module whose parameter references are checked once per key
            (NOTE: [Aliased parameters]).
    """

    def __init__(self, keeps_forward_pass: bool, watches_aliases: bool) -> None:
        self.keeps_forward_pass = keeps_forward_pass
        self.watches_aliases = watches_aliases
        self._records = BoundedCache(_KEYS)
        self._lock = threading.Lock()
        self.fingerprints = FingerprintMemo()  # NOTE: [Unchanged modules]: the keys' last walk of the module

    def record(self, key: Hashable) -> KeyRecord:
        """The record of ``key``, made empty the first time."""
        found = self._records.get(key)
        if found is None:
            with self._lock:
                found = self._records.get(key)
                if found is None:
                    found = self._records[key] = KeyRecord(key)
        return found

    def scope(self, key: Optional[Hashable], name: Hashable = "call") -> Optional[Scope]:
        """Where the implementations keep what they derive for calls of ``key`` (None: a call
        planned alone, nothing kept)."""
        return None if key is None else Scope(self.record(key).derived, name)

    def canonical(self, key: Hashable) -> Hashable:
        """The key this planner keeps for keys equal to ``key`` (``key`` itself the first time): a
        call's lookups of its record then find it by identity, where a new key's equal parts (a
        module's structure fingerprint, a deep tuple) would be compared anew in every one (they
        were 0.2 ms of a schnetpack SchNet's 12 ms)."""
        return self.record(key).key

    def facts(self, key: Hashable) -> Facts:
        """What calls with ``key`` learnt."""
        return self.record(key).facts

    def learn(self, key: Hashable, **facts: Any) -> None:
        """Adds facts about ``key``; plans decided from the older facts are not used again. Facts
        known already change nothing: a call that learns again what an earlier one learnt (every
        ``auto_choice``, the first call of a kernel function that shares the planner) leaves the
        plans, and their templates, in place."""
        record = self.record(key)
        with self._lock:
            known = record.facts
            if all(_same(getattr(known, name), value) for name, value in facts.items()):
                return
            record.facts = known.learnt(**facts)

    def forget(self, key: Hashable) -> None:
        """Drops the record of ``key``: its next call is planned anew (NOTE: [Outputs that outgrow
        their plan] in ``_call/per_example.py``)."""
        self._records.pop(key)

    def plan(self, key: Hashable, purpose: Purpose) -> CallPlan:
        """The plan for ``key`` and ``purpose``: the kept one, else one decided from the facts."""
        record = self.record(key)
        facts = record.facts
        found = record.plans.get(purpose)
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
        record = self.record(key)
        record.plans[purpose] = (record.facts, plan)

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

    def memory_plan(
        self, key: Optional[Hashable], choices: Hashable, budget: float, make: Callable[[float], Any]
    ) -> Any:
        """The memory plan (``MemoryPlan``) of a call whose plan key is ``key`` (None: nothing kept)
        and whose other choices are ``choices``, made by ``make(budget)`` unless the one kept for
        them still holds: made for this budget, or for another whose plan chose no ``chunk_size``
        and fits this one too (a default budget follows the free memory, which moves between calls;
        AUTO keeps its pick on the same rule). ``make`` raises the refusal of a call that does not
        fit."""
        memory = None if key is None else self.record(key).memory
        kept = None if memory is None else memory.get(choices)
        if kept is not None and _still_holds(kept, budget):
            return kept
        made = make(budget)
        if memory is not None:
            memory[choices] = made
        return made


def _same(known: Any, value: Any) -> bool:
    """Whether a fact's ``value`` is the one ``known``: the same object, or an equal plain value
    (an output description holds trees, compared by identity only)."""
    return known is value or (type(known) is type(value) and type(value) in PLAIN and known == value)


def _still_holds(plan: Any, budget: float) -> bool:
    if plan.budget == budget:
        return True
    if plan.chosen or math.isfinite(plan.budget) != math.isfinite(budget):
        return False
    return not math.isfinite(budget) or (plan.peak is not None and plan.peak.planned <= budget)
