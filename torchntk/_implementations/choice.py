"""What ``ntk_fn.auto_choice`` reports: :class:`AutoChoice` and the cost model's :class:`Estimate`.

Kept apart from ``auto.py`` because every implementation reports an :class:`AutoChoice` (NOTE:
[The implementation table]), and AUTO imports the implementations it prices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from .._utils.types import NtkImplementation


@dataclass(frozen=True)
class Estimate:
    """The cost model's view of one implementation: FLOPs and peak extra memory in bytes.

    Attributes:
        flops: estimated multiply-add FLOPs (of the plan with ``chunk_size``, whose blocks prepare
            some derivatives again).
        memory_bytes: the memory model's peak of the computation in bytes, beyond what the call's
            validation left (``docs/batching.md``, "Memory plans"): of the call as given (or an
            upper bound of it, where that fits the budget and spares a counted pass), or, when it
            exceeds the budget, of the plan with ``chunk_size``; above the budget when no
            ``chunk_size`` fits.
        note: how the implementation would run when not in its usual way, else ``""``; e.g.
            ``"double VJP: no forward-mode derivative for aten::_weight_norm_interface"`` for
            implementation 2 on a model PyTorch cannot run forward mode through.
        chunk_size: the ``chunk_size`` this candidate would run with to fit the budget, or None when
            it runs as the kernel function was built.
    """

    flops: float
    memory_bytes: float
    note: str = ""
    chunk_size: Optional[int] = None


@dataclass(frozen=True)
class AutoChoice:
    """What AUTO picked for one set of input shapes, and why.

    Attributes:
        implementation: the implementation used.
        estimates: the cost model's estimate per candidate (empty when ``implementation`` was
            fixed by the caller rather than chosen).
        memory_budget_bytes: the memory budget of the choice (NOTE: [Memory budgets]): candidates
            whose plan exceeds it were dropped (unless none fits: the call then raises
            ``KernelMemoryError``).
        fallback_parameters: ``{parameter name: reason}`` for every parameter whose share of the
            kernel structured derivatives take from the Jacobian fallback (full per-parameter
            Jacobians, exact but slower) instead of their rules: an operation without a rule
            consumes it, it is written in place, or its rules disagreed with autograd when the
            plan was checked (see ``docs/structured.md``). Filled when implementation 3 is used or
            priced; empty otherwise. When AUTO priced 3 but picked another, the plan was not
            checked (NOTE: [What choosing may cost]), so only rule-less and in-place uses appear.
        excluded: ``{NtkImplementation: reason}`` for every candidate AUTO found it cannot run on
            this model or could not price (NOTE: [AUTO's feasibility filter]); such a candidate is
            never chosen and has no entry in ``estimates``. Empty when ``implementation`` was
            fixed by the caller.
        unprobed: ``{NtkImplementation: reason}`` for every candidate AUTO did not probe because
            probing could not change the pick or would cost more than it could save (NOTE:
            [What choosing may cost] in ``auto.py``): implementation 2 is then priced with forward
            mode assumed and not checked to run (it was not the cheapest either way), and
            implementation 3 is not priced (no entry in ``estimates``, no
            ``fallback_parameters``). A candidate is never picked unprobed.
        vmap_axes: the ``vmap_axes`` the call maps its examples with, as
            ``(in_axes, out_axes, kwargs_axes)``, or None where it computes on whole batches: the
            user's, or with ``vmap_axes="auto"`` (the default) those found for these inputs
            (NOTE: [Found vmap_axes]).
        vmap_axes_reason: with ``vmap_axes="auto"``, why no axes were found, or, where vmap cannot
            evaluate the model, whether a loop over the examples or whole batches was priced cheaper
            (with both prices; NOTE: [Loop or whole batches]). None otherwise.
    """

    implementation: NtkImplementation
    estimates: dict = field(default_factory=dict)
    memory_budget_bytes: float = math.inf
    fallback_parameters: dict = field(default_factory=dict)
    excluded: dict = field(default_factory=dict)
    unprobed: dict = field(default_factory=dict)
    vmap_axes: Any = None
    vmap_axes_reason: Optional[str] = None

    @property
    def chunk_size(self) -> Optional[int]:
        """The ``chunk_size`` the picked implementation runs with to fit the budget (None: as built)."""
        estimate = self.estimates.get(self.implementation)
        return None if estimate is None else estimate.chunk_size
