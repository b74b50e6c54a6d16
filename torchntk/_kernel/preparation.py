"""How a kernel call is prepared from its plan: bound to the plan's template on a warm call, or
validated in full on a key's first call, whose checks and choices become the facts of later
plans (NOTE: [The planning stage] in ``_plan/plan.py``).

:meth:`NtkSettings.prepare <torchntk._kernel.settings.NtkSettings.prepare>` is the entry point:
it looks the plan up and calls :func:`bind` or :func:`prepare_in_full`, or with
``vmap_axes="auto"`` :func:`prepare_finding_axes` (NOTE: [Found vmap_axes]). What a full
preparation decides on the way lives here too: the example loop where vmap fails on the checks'
passes (NOTE: [Switching to example loops]), the loop or whole batches of a found key (NOTE:
[Loop or whole batches]), the working-set runs (NOTE: [Working-set runs]), the early refusal of a
kernel over the memory budget (NOTE: [Memory plans]) and the derivative check settled within
implementation 3's plan (NOTE: [The derivative check within a plan's check]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from .._call.example_loop import LOOP_EXAMPLE_FLOPS, vmap_failure
from .._call.finite import NonFiniteOutputs
from .._call.kernel_call import KernelCall, bind_call, prepare_call
from .._call.per_example import VmapLimitation, first_line
from .._call.vmap_axes import candidate_vmap_axes
from .._implementations.auto import estimate_of
from .._implementations.choice import AutoChoice
from .._implementations.memory import VALIDATION_RUN, CallSizes, OUT_OF_MEMORY_ADVICE, kept_sizes, kernel_refusal
from .._implementations.ntk_vector_products import TANGENTS_PER_PASS
from .._memory import CallerPlan, out_of_memory_boundary, resolve_budget
from .._model.aliases import alias_checks
from .._model.survey import training_mode_layers
from .._model.torch_errors import explained
from .._plan import UNDECIDED, CallPlan, CallTemplate, Purpose, Scope
from .._utils.threads import serialised
from .._utils.tree import is_all_none
from .._utils.types import NtkImplementation
from .execution import looped_where_vmap_fails
from .working_set import forward_mode_tangents, working_set_run_length

if TYPE_CHECKING:
    from .settings import NtkSettings

_STRUCTURED = NtkImplementation.STRUCTURED_DERIVATIVES

_PLAN_CHECKED = (NtkImplementation.AUTO, NtkImplementation.STRUCTURED_DERIVATIVES)
"""Implementations whose choice on a first call may check implementation 3's plan, and with it
settle the derivative check (NOTE: [The derivative check within a plan's check])."""


def bind(
    settings: NtkSettings, key: Any, plan: CallPlan, x1: Any, x2: Any, params: Any, kwargs: dict,
) -> Optional[KernelCall]:
    """A warm call: the plan's template with this call's tensors, or None where the differentiated
    parameters changed since (their ``requires_grad`` flags are not part of the key). Its sides
    check that the model still returns the outputs the plan was made for (NOTE: [Outputs that
    outgrow their plan] in ``_call/per_example.py``), and drop ``key``'s plans where it does not.
    The output notices of the key are given here too, once per kernel function: the plans may be
    another kernel function's (NOTE: [Plans shared by kernel functions])."""
    template = plan.template
    if template.call.notices and settings.spec.notices is not None:
        settings.spec.notices.give(template.call.notices)
    with alias_checks(skip=True) if isinstance(settings.f, torch.nn.Module) else contextlib.nullcontext():
        return bind_call(
            template, settings.f, x1, x2, params, kwargs, output_fn=settings.output_fn, groups=settings.groups,
            loop=plan.example_loop, forget=functools.partial(settings.planner.forget, key),
        )


def prepare_in_full(
    settings: NtkSettings, key: tuple, purpose: Purpose, plan: CallPlan, x1: Any, x2: Any, params: Any, kwargs: dict,
    where: str, shape_key: tuple, caller: Optional[CallerPlan],
) -> KernelCall:
    """:func:`prepare_call` with the plan's checks, loop and stand-in outputs; then the facts it
    learnt, and for later calls of the same key and purpose a template (NOTE: [The planning stage])."""
    forward_run_length = purpose.forward_run_length
    computes_ntk = purpose.for_ntk and purpose.computes_ntk
    early = _admission(settings, where, caller) if purpose.admit and computes_ntk else None
    if early is not None and forward_run_length is None:
        forward_run_length = VALIDATION_RUN
    aliases: Any = contextlib.nullcontext()
    if isinstance(settings.f, torch.nn.Module):
        learn = functools.partial(settings.planner.learn, key, aliases_checked=True)
        aliases = alias_checks(on_clean=learn) if plan.check_aliases else alias_checks(skip=True)

    # NOTE: [The derivative check within a plan's check]: a kernel computed right after by AUTO
    # or 3 lets 3's plan check settle the derivative check
    deferred = purpose.admit and computes_ntk and settings.implementation in _PLAN_CHECKED

    def prepare(*, example_loop: bool) -> KernelCall:
        spec = replace(
            settings.spec, vmap_axes=settings.vmap_axes if purpose.for_ntk else None,
            groups=settings.groups if computes_ntk else None,
        )
        call = prepare_call(
            settings.f, x1, x2, params, kwargs, spec, where=where, admit=early,
            plan=replace(plan, example_loop=example_loop, derivatives_deferred=deferred),
            computes_ntk=computes_ntk, forward_run_length=forward_run_length,
        )
        if not purpose.needs_outputs and not settings.given.compile:
            call = _within_working_set(settings, call, settings.planner.scope(key), settings.implementation)
        if call.derivative_check is not None:  # priced as computed: with its working-set runs
            _settle_derivatives(settings, call, settings.planner.scope(key), caller)
        return call

    with aliases:
        call = looped_where_vmap_fails(
            settings, key, where, lambda loop: prepare(example_loop=loop or plan.example_loop),
            purpose.maps_examples and not plan.example_loop,
        )
    outputs = plan.outputs
    if purpose.maps_examples:
        learnt: dict[str, Any] = {}
        if settings.check_vmap_axes:
            learnt["derivatives_checked"] = True
        if outputs is None and settings.check_vmap_axes is not True and call.side1.mapped:
            outputs = learnt["outputs"] = call.output_shapes()
        if learnt:
            settings.planner.learn(key, **learnt)
    runs = call.working_runs
    if computes_ntk and outputs is not None and call.side1.mapped:
        side2 = call.side2
        template = CallTemplate(
            call.template(outputs), call.model.names, (call.side1.x_axes, call.side1.kwarg_axes),
            None if side2 is None else (side2.x_axes, side2.kwarg_axes), call.side1.out_axes,
            None if call.model.survey is None else call.model.survey.kept(),
        )
        settings.planner.template_for(key, purpose, template, runs)
    return call


def _admission(settings: NtkSettings, where: str, caller: Optional[CallerPlan]) -> Optional[Callable[..., None]]:
    """``admit(shapes, dtypes, device)`` for :func:`prepare_call`: raises the refusal of a kernel
    larger than the budget; None with an unlimited budget."""
    if settings.memory is not None and not math.isfinite(settings.memory):
        return None
    groups = len(settings.groups.names) if settings.groups is not None else 1

    def admit(shapes: tuple, dtypes: tuple, device: torch.device, examples: Optional[tuple] = None) -> None:
        budget = resolve_budget(settings.memory, device, caller)
        refusal = kernel_refusal(shapes, dtypes, groups, budget, where, device, examples)
        if refusal is not None:
            raise refusal

    return admit


def _within_working_set(
    settings: NtkSettings, call: KernelCall, scope: Optional[Scope], implementation: NtkImplementation,
) -> KernelCall:
    """``call`` with the run lengths of NOTE: [Working-set runs] for ``implementation``:
    examples per per-example pass (mapped, without ``chunk_size``; for AUTO, 1's and 3's), and
    tangents per forward-mode pass where implementation 2 may compute it. The sizes are counted
    once per key."""
    mapped = call.side1.mapped
    products = implementation in (NtkImplementation.NTK_VECTOR_PRODUCTS, NtkImplementation.AUTO)
    if not (mapped and settings.chunk_size is None) and not products:
        return call
    sizes = kept_sizes(call, scope)
    changes: dict[str, Any] = {}
    if mapped and settings.chunk_size is None:
        changes["working_runs"] = _working_runs(call, sizes, implementation)
        if implementation == NtkImplementation.AUTO:  # for a pick of 3, made later
            structured = _working_runs(call, sizes, _STRUCTURED)
            changes["structured_runs"] = None if structured == changes["working_runs"] else structured
    if products:
        changes["tangents_per_pass"] = forward_mode_tangents(
            sizes.side1.examples, sizes.side1.activations.largest, max(sizes.param_sizes, default=0),
            sizes.element, TANGENTS_PER_PASS, call.outputs1[0].device,
        )
    return replace(call, **changes)


def _working_runs(call: KernelCall, sizes: CallSizes, implementation: NtkImplementation) -> Optional[int]:
    """NOTE: [Working-set runs]'s run length of the mapped ``call`` for ``implementation``: its
    activations per example, and for implementations 2 and 3 the cotangents their reverse passes
    form (``O`` per parameter's output; 2's bound x2's runs where its forward-mode passes are
    bounded, NOTE: [Forward-mode passes over runs of x1])."""
    activations = sizes.side1.activations
    per_example = activations.written
    if implementation in (_STRUCTURED, NtkImplementation.NTK_VECTOR_PRODUCTS):
        per_example += sizes.side1.outputs * activations.parameter_outputs
    return working_set_run_length(call.side1.batch_size(), per_example, sizes.element)


def _settle_derivatives(
    settings: NtkSettings, call: KernelCall, scope: Optional[Scope], caller: Optional[CallerPlan]
) -> None:
    """The derivative check a first call left to the plan (NOTE: [The derivative check within a
    plan's check]): the call's choice is made first, within the budget its kernel will have
    (AUTO's pick and, where it is 3, 3's plan, checked; cached for the kernel that follows),
    then the check runs unless 3's check settled it and 3 computes the kernel. Raises what the
    check raises."""
    pending = call.derivative_check
    budget = settings.budget(call, caller)

    def choose() -> AutoChoice:
        with serialised(settings.thread_safe), explained(call.where):  # NOTE: [Threads]: AUTO probes forward mode
            return settings.choice(call, scope, budget)

    try:
        # as the kernel's own planning is: NOTE: [Out of memory at the kernel boundary]
        picked = out_of_memory_boundary(
            choose, call.where, lambda: f"implementation {int(settings.implementation)}'s plan",
            OUT_OF_MEMORY_ADVICE, call.outputs1[0].device, lambda: budget,
        )
    except Exception:
        pending.settle()  # a vmap bug or coupled examples, explained before what they caused
        raise
    pending.settle(computed_by_3=picked.implementation == NtkImplementation.STRUCTURED_DERIVATIVES)


def prepare_finding_axes(
    settings: NtkSettings, x1: Any, x2: Any, params: Any, kwargs: dict, where: str, options: dict
) -> KernelCall:
    """``NtkSettings.prepare`` with ``vmap_axes="auto"`` (NOTE: [Found vmap_axes]): with the axes found
    for the key, or on its first call with the candidate axes, whose checks decide (:func:`trial`);
    where none are found, without axes."""
    key = options["shape_key"]  # the plan key (see prepare)
    found = settings.planner.facts(key).found_axes
    if found is UNDECIDED:
        call = trial(settings, key, x1, x2, params, kwargs, where, options)
        if call is not None:
            return call
        found = None
    return settings.with_axes(found).prepare(x1, x2, params, kwargs, where, **options)


def trial(
    settings: NtkSettings, key: Any, x1: Any, x2: Any, params: Any, kwargs: dict, where: str, options: dict
) -> Optional[KernelCall]:
    """The first call of ``key`` prepared with the candidate axes, which are then the key's; None,
    preparing nothing more, where there is no candidate or its checks refuse it (or vmap cannot
    evaluate the model): the key then has no axes, and the reason is kept
    (``auto_choice(...).vmap_axes_reason``)."""
    coupled, random = training_mode_layers(settings.f) if isinstance(settings.f, torch.nn.Module) else ((), ())
    if coupled or random:  # decided before any forward pass: the plan key holds the train/eval modes
        reason = f"{(coupled + random)[0]} couples the examples in training mode"
        candidate = None
    else:
        reason = "the inputs have no leading axis of examples shared by every tensor leaf"
        candidate = candidate_vmap_axes(x1, x2, kwargs)
    if candidate is not None:
        # learnt first: the trial's own facts then keep the plan it makes (NOTE: [The planning stage])
        settings.planner.learn(key, found_axes=candidate)
        try:
            with settings.example_loops.held() as switches:
                call = settings.with_axes(candidate).prepare(x1, x2, params, kwargs, where, **options)
        except NonFiniteOutputs:
            # says nothing about the axes (NOTE: [Non-finite kernels]): the next call decides them
            settings.planner.learn(key, found_axes=UNDECIDED)
            raise
        except (ValueError, VmapLimitation) as error:
            reason = first_line(error)
        else:
            kinds = {layout.kind(axis) for layout, axis in zip(call.layouts, call.side1.out_axes or ())}
            if kinds <= {"kept"}:
                if switches and call.side1.loop:
                    return _loop_or_whole_batches(
                        settings, key, call, switches[0], x1, x2, params, kwargs, where, options
                    )
                return call
            # the layout would treat the leading output axis as the examples' where, without axes,
            # it is traced or diagonal: the same arguments would mean another kernel
            reason = "`trace_axes` or `diagonal_axes` name the leading output axis"
    settings.planner.learn(key, found_axes=None, found_reason=reason)
    return None


def _loop_or_whole_batches(
    settings: NtkSettings, key: Any, looped: KernelCall, error: VmapLimitation, x1: Any, x2: Any, params: Any,
    kwargs: dict, where: str, options: dict,
) -> KernelCall:
    """The trial's call ``looped`` (its examples mapped by a loop, as vmap failed with ``error``)
    or the call on whole batches, whichever is priced cheaper (NOTE: [Loop or whole batches]);
    the key's facts then say which, and why."""
    failure = vmap_failure(error)
    loop_price = whole_price = None
    whole = None
    if options["computes_ntk"]:  # an NNGP alone is forward passes: nothing to weigh
        whole = settings.with_axes(None).prepare(x1, x2, params, kwargs, where, **options)
        scope = settings.planner.scope(options["shape_key"])  # the plan key (see prepare)
        loop_price, whole_price = _price(settings, looped, scope), _price(settings, whole, scope)
    if whole is not None and loop_price is not None and whole_price is not None and whole_price < loop_price:
        reason = (
            f"torch.func.vmap cannot evaluate the model per example ({failure}), and whole batches are "
            f"priced below a Python loop over the examples ({whole_price:.3g} against {loop_price:.3g} "
            f"FLOP equivalents)"
        )
        settings.planner.learn(key, found_axes=None, found_reason=reason)
        return whole
    if loop_price is None or whole_price is None:
        reason = (
            f"torch.func.vmap cannot evaluate the model per example ({failure}); the examples are mapped "
            f"by a Python loop"
        )
    else:
        reason = (
            f"torch.func.vmap cannot evaluate the model per example ({failure}), and a Python loop over "
            f"the examples is priced below whole batches ({loop_price:.3g} against {whole_price:.3g} FLOP "
            f"equivalents)"
        )
    settings.planner.learn(key, found_reason=reason)
    settings.example_loops.switch(error, where)
    return looped


def _price(settings: NtkSettings, call: KernelCall, scope: Optional[Scope]) -> Optional[float]:
    """The cost model's FLOP equivalents of ``call``'s NTK with the implementation that would
    compute it (NOTE: [Loop or whole batches]), or None where it cannot be priced."""
    try:
        if settings.implementation == NtkImplementation.AUTO:
            choice = settings.choice(call, scope)
            estimate = choice.estimates.get(choice.implementation)
        else:
            estimate = estimate_of(settings.table, settings.implementation, call, scope)
    except Exception:  # noqa: BLE001 - pricing decides nothing the call cannot do without it
        return None
    if estimate is None or not math.isfinite(estimate.flops):
        return None
    if not call.side1.loop:
        return estimate.flops
    examples = call.side1.batch_size() + (0 if call.side2 is None else call.side2.batch_size())
    return estimate.flops + LOOP_EXAMPLE_FLOPS * examples


def with_axes_reported(settings: NtkSettings, choice: AutoChoice, shape_key: tuple) -> AutoChoice:
    """``choice`` with the ``vmap_axes`` its call maps with (NOTE: [Found vmap_axes])."""
    axes, reason = settings.vmap_axes, None
    if settings.finds_axes:
        facts = settings.planner.facts(settings.key_of(shape_key))
        axes, reason = (None if facts.found_axes is UNDECIDED else facts.found_axes), facts.found_reason
    shown = None
    if axes is not None and not (is_all_none(axes.in_axes) and axes.kwargs_axes is None):
        shown = (axes.in_axes, axes.out_axes, axes.kwargs_axes)
    reported = settings.reported.get(id(choice))  # the same object for the same cached choice
    if reported is None or reported[0] is not choice or reported[1] != (shown, reason):
        reported = settings.reported[id(choice)] = (
            choice, (shown, reason), dataclasses.replace(choice, vmap_axes=shown, vmap_axes_reason=reason)
        )
    return reported[2]
