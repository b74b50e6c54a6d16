"""How a prepared call's kernels are computed: planned within the memory budget, by the
implementation the plan names, with the example loop where vmap fails on the implementation's
passes (NOTE: [Switching to example loops]), inside the out-of-memory boundary (NOTE: [Out of
memory at the kernel boundary]) and with non-finite outputs explained (NOTE: [Non-finite kernels]).

:meth:`NtkSettings.ntk <torchntk._kernel.settings.NtkSettings.ntk>` calls :func:`ntk`.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import torch

from .._call.kernel_call import KernelCall
from .._call.per_example import VmapLimitation
from .._implementations import memory_plan
from .._implementations.memory import OUT_OF_MEMORY_ADVICE, warn_chosen_chunk, with_chunk
from .._memory import NEEDS_BLOCKS, CallerPlan, KernelMemoryError, format_bytes, out_of_memory_boundary
from .._model.torch_errors import explained
from .._utils.threads import serialised
from .._utils.types import NtkImplementation, PyTree

if TYPE_CHECKING:
    from .settings import NtkSettings

_STRUCTURED = NtkImplementation.STRUCTURED_DERIVATIVES

Result = TypeVar("Result")


def ntk(settings: NtkSettings, call: KernelCall, caller: Optional[CallerPlan] = None) -> Any:
    """The NTK of a prepared call, planned within the budget (and ``caller``'s, NOTE: [Budgets of
    callers]): :data:`NEEDS_BLOCKS`, computing nothing, where ``caller`` allows no blocks and the
    plan would need them."""
    shapes = call.kernel_shapes()
    if all(math.prod(shape) == 0 for shape in shapes):
        # Empty kernels (e.g. x2 with no examples): transforms cannot map over size 0.
        groups = len(call.groups) if call.groups is not None else None
        zeros = [
            torch.zeros(shape, device=out.device) if groups is None
            else tuple(torch.zeros(shape, device=out.device) for _ in range(groups))
            for shape, out in zip(shapes, call.outputs1)
        ]
        return call.normalise(zeros)
    budget = settings.budget(call, caller)
    chunking = caller is None or caller.chunking
    attempted: list = []
    scope = settings.planner.scope(call.plan_key)

    def planned(call: KernelCall) -> Any:
        # NOTE: [Memory plans]: refused, or given a chunk_size, before any derivative is taken
        # (inside looped_where_vmap_fails: implementation 3's plan may need the example loop too)
        try:
            plan = settings.planner.memory_plan(
                call.plan_key, _memory_choices(call), budget,
                lambda budget: memory_plan(settings.table, settings.implementation, call, scope, budget),
            )
        except KernelMemoryError as refusal:
            if chunking or refusal.kernel_alone:
                raise _explained(settings, refusal, call) from None
            return NEEDS_BLOCKS  # NOTE: [Budgets of callers]: the caller cuts x1 too
        if plan.chosen and not chunking:
            return NEEDS_BLOCKS
        if plan.chosen and settings.state.chunk_warnings.first():
            warn_chosen_chunk(plan, call)
        attempted.append(plan)
        if call.structured_runs is not None and plan.implementation == _STRUCTURED:
            # NOTE: [Working-set runs]: AUTO's pick of 3 runs with 3's runs
            call = replace(call, working_runs=call.structured_runs)
        return settings.table[plan.implementation].kernels(with_chunk(call, plan), scope)

    def compute() -> PyTree:
        with serialised(settings.thread_safe), explained(call.where):  # NOTE: [Threads]
            kernels = looped_where_vmap_fails(
                settings, call.plan_key, call.where, lambda loop: planned(call.looped() if loop else call),
                call.side1.mapped and not call.side1.loop,
            )
            if kernels is NEEDS_BLOCKS:
                return kernels
            settings.explain_non_finite(call, kernels)
            return call.normalise(kernels)

    def described() -> str:
        if attempted:
            return attempted[-1].describe()
        return f"implementation {int(settings.implementation)} (budget {format_bytes(budget)})"

    def planned_budget() -> float:
        return attempted[-1].budget if attempted else budget

    # NOTE: [Out of memory at the kernel boundary]
    return out_of_memory_boundary(
        compute, call.where, described, OUT_OF_MEMORY_ADVICE, call.outputs1[0].device, planned_budget
    )


def looped_where_vmap_fails(
    settings: NtkSettings, key: Any, where: str, run: Callable[[bool], Result], can_loop: bool
) -> Result:
    """``run(False)``; where vmap cannot evaluate the model in it and ``can_loop`` (the examples are
    mapped by vmap), ``run(True)``, the examples mapped by a loop, and later plans of ``key`` then
    loop from the start (NOTE: [Switching to example loops]). The one place where a failure of
    vmap becomes the key's fact: the preparation's checks and the implementations' passes both
    come here."""
    try:
        return run(False)
    except VmapLimitation as error:
        if not can_loop:
            raise
        result = run(True)  # a model that also fails in the loop raises its own error, unwarned
        settings.planner.learn(key, example_loop=True)
        settings.example_loops.switch(error, where)
        return result


def _explained(settings: NtkSettings, refusal: KernelMemoryError, call: KernelCall) -> KernelMemoryError:
    """``refusal`` of a call that ``vmap_axes="auto"`` left unmapped, with the reason first: a
    model in training mode needs whole batches only because of its batch statistics."""
    if not settings.finds_axes or call.side1.mapped or call.plan_key is None:
        return refusal
    reason = settings.planner.facts(call.plan_key).found_reason
    if reason is None:
        return refusal
    advice = " (model.eval() lets them be)" if "training mode" in reason else ""
    explained = KernelMemoryError(
        f"{refusal} The examples are not mapped one by one{advice} because {reason}.",
        refusal.needed_bytes, refusal.budget_bytes, kernel_alone=refusal.kernel_alone,
    )
    return explained


def _memory_choices(call: KernelCall) -> tuple:
    """What a call's memory plan depends on besides its plan key (NOTE: [Plan keys]): the parameters
    differentiated, the chunk and run lengths, the example loop, the groups."""
    return (
        call.model.names, call.chunk_size, call.working_runs, call.structured_runs, call.tangents_per_pass,
        call.side1.loop, call.groups,
    )
