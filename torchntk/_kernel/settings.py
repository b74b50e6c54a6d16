"""The validated arguments of an NTK kernel function, and what its calls share.

:class:`NtkSettings` is built once per kernel function by ``empirical_ntk_fn`` and
``empirical_kernel_fn``: it validates the builder's arguments, prepares each call (with the
``vmap_axes`` checks and the switch to example loops, NOTE: [Switching to example loops]),
dispatches to the implementation table (NOTE: [The implementation table]) and publishes the
:class:`~torchntk.KernelFunction`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Union

import torch

from .._call.example_loop import LOOP_EXAMPLE_FLOPS, ExampleLoops, vmap_failure
from .._call.finite import NonFiniteOutputs, all_finite, raise_for_non_finite_outputs
from .._call.groups import ParameterGroups, groups_argument
from .._call.kernel_call import CallSpec, KernelCall, bind_call, prepare_call
from .._call.outputs import output_fn_argument
from .._call.per_example import VmapLimitation, first_line
from .._call.vmap_axes import FOUND, ParsedVmapAxes, candidate_vmap_axes, parse_vmap_axes
from .._implementations import implementation_table, memory_plan, policy
from .._implementations.memory import (
    OUT_OF_MEMORY_ADVICE, VALIDATION_RUN, CallSizes, kept_sizes, kernel_refusal, modelled_peak, warn_chosen_chunk,
    with_chunk,
)
from .._implementations.auto import estimate_of
from .._implementations.ntk_vector_products import TANGENTS_PER_PASS
from .._implementations.choice import AutoChoice
from .._implementations.structured import StructuredOptions
from .._layout.notices import OutputNotices
from .._memory import (
    KernelMemoryError,
    NEEDS_BLOCKS,
    CallerPlan,
    format_bytes,
    memory_argument,
    out_of_memory_boundary,
    resolve_budget,
)
from .._model.aliases import alias_checks
from .._model.survey import training_mode_layers
from .._plan import UNDECIDED, CallPlan, CallTemplate, PlanKey, Planner, Purpose, Scope, input_shape_key, plan_key
from .._model.torch_errors import explained
from .._utils import checks as _checks
from .._utils.bounded_cache import BoundedCache
from .._utils.threads import serialised
from .._utils.tree import is_all_none
from .._utils.types import Model, NtkImplementation, PyTree
from .block_source import BlockRequest, BlockSource
from .captured import CapturedCalls, compile_argument
from .kernel_function import KernelFnSpec, KernelFunction
from .working_set import forward_mode_tangents, working_set_run_length

KernelFn = Callable[..., PyTree]

_PLAN_CHECKED = (NtkImplementation.AUTO, NtkImplementation.STRUCTURED_DERIVATIVES)
"""Implementations whose choice on a first call may check implementation 3's plan, and with it
settle the derivative check (NOTE: [The derivative check within a plan's check])."""

FORWARD_RUN = 256
"""Examples per whole-batch forward pass of a batched call (``open_blocks``), at least the block
size. A forward pass without gradients holds a small part of what an example's derivatives
need, so runs this long bound memory without paying a model call per small block (32 calls of
16 examples cost 10 ms more than 2 of 256 on the benchmark MLP)."""


@dataclass(frozen=True, **({"kw_only": True} if sys.version_info >= (3, 10) else {}))
class NtkOptions:
    """The arguments of ``empirical_ntk_fn`` and ``empirical_kernel_fn`` besides the model, as the
    user gave them (:meth:`NtkSettings.validate` checks them). Build it by keyword: the fields are
    the builders' keyword names, and a kernel function is rebuilt around another copy of the model
    from them (``batch``'s replicas)."""

    trace_axes: Any
    diagonal_axes: Any
    vmap_axes: Any
    implementation: Any
    chunk_size: Any
    check_vmap_axes: Any
    structure_rules: Any
    closed_form_rules: Any
    local_jacobian: Any
    verify: Any
    output_fn: Any
    groups: Any
    compile: Any
    memory: Any = None

    def as_keywords(self) -> dict[str, Any]:
        """The builder's keyword arguments (the values themselves, not copies)."""
        return {option.name: getattr(self, option.name) for option in dataclasses.fields(self)}


_STRUCTURED_OPTIONS = ("structure_rules", "closed_form_rules", "local_jacobian", "verify")


class _Once:
    """True the first time only: a warning a kernel function gives once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._given = False

    def first(self) -> bool:
        with self._lock:
            first, self._given = not self._given, True
        return first


@dataclass
class KernelFunctionState:
    """What the calls of one kernel function share and learn (NOTE: [The planning stage]): its
    plans, the graphs it captured, and the warnings and reports it gives once.

    Attributes:
        planner: the facts and plans of its calls (``_plan/stage.py``).
        captured: NOTE: [Captured kernels]'s graphs; None: every call eager.
        example_loops: the example loop's warning, once per kernel function.
        chunk_warnings: the warning of a ``chunk_size`` a memory plan chose, once per kernel function.
        variants: the settings with each ``vmap_axes`` found, by axes and checks (NOTE: [Found
            vmap_axes]).
        reported: ``auto_choice``'s reports, kept so that a cached choice is the same object.
    """

    planner: Planner
    captured: Optional[CapturedCalls] = None
    example_loops: ExampleLoops = field(default_factory=ExampleLoops)
    chunk_warnings: _Once = field(default_factory=_Once)
    variants: dict = field(default_factory=dict)
    reported: BoundedCache = field(default_factory=lambda: BoundedCache(64))


@dataclass(frozen=True)
class NtkSettings:
    """Builder arguments, validated once when the kernel function is built, and the state its
    calls share.

    Attributes:
        f: the model.
        given: the builder's arguments as the user gave them (to build the same kernel function
            around another copy of the model).
        spec: what every call is prepared with (:class:`~torchntk._call.kernel_call.CallSpec`).
        implementation: as validated (AUTO included).
        check_vmap_axes: True, ``"first"`` or False (:func:`check_mode_argument`).
        table: NOTE: [The implementation table], one per kernel function.
        memory: NOTE: [Memory budgets]; None: the default, a share of the free memory.
        state: the plans, captured graphs and once-only reports (:class:`KernelFunctionState`).
    """

    f: Model
    given: NtkOptions
    spec: CallSpec
    implementation: NtkImplementation
    check_vmap_axes: Union[bool, str]
    table: dict
    memory: Optional[float]
    state: KernelFunctionState = field(compare=False)

    # what the spec and the state hold, by the names the call pipeline reads
    trace_axes = property(lambda self: self.spec.trace_axes)
    diagonal_axes = property(lambda self: self.spec.diagonal_axes)
    vmap_axes = property(lambda self: self.spec.vmap_axes)
    chunk_size = property(lambda self: self.spec.chunk_size)
    output_fn = property(lambda self: self.spec.output_fn)
    groups = property(lambda self: self.spec.groups)
    notices = property(lambda self: self.spec.notices)
    finds_axes = property(lambda self: self.spec.finds_axes)
    planner = property(lambda self: self.state.planner)
    captured = property(lambda self: self.state.captured)
    example_loops = property(lambda self: self.state.example_loops)
    variants = property(lambda self: self.state.variants)
    reported = property(lambda self: self.state.reported)

    @property
    def options(self) -> StructuredOptions:
        """Implementation 3's options, as its entry of the table holds them."""
        return self.table[NtkImplementation.STRUCTURED_DERIVATIVES].options

    @classmethod
    def validate(cls, f: Model, given: NtkOptions, *, where: str) -> "NtkSettings":
        """Checks every builder argument (``where``: the builder's name, for messages).

        Raises:
            TypeError, ValueError: an argument of the wrong type or value, named in the message.
        """
        _checks.callable_model_argument(f, where)
        chosen = _checks.implementation_argument(given.implementation, where)
        parsed_groups = groups_argument(given.groups, f, where)
        if parsed_groups is not None:  # resolved (submodules as paths), so that a replica is grouped alike
            given = dataclasses.replace(given, groups=parsed_groups)
        options = structured_options({name: getattr(given, name) for name in _STRUCTURED_OPTIONS}, chosen, where)
        compiling = compile_argument(given.compile, where)
        if compiling is not None and options.verify:
            raise ValueError(
                f"{where}: `verify=True` checks every call against autograd, which a replayed graph "
                f"would skip; use one of `verify` and `compile`."
            )
        checks = check_mode_argument(given.check_vmap_axes, where)
        finds_axes = isinstance(given.vmap_axes, str) and given.vmap_axes == FOUND
        if isinstance(given.vmap_axes, str) and not finds_axes:
            raise TypeError(
                f"{where}: `vmap_axes` must be 'auto', None, an int, a pytree of ints or "
                f"(in_axes, out_axes, kwargs_axes), got {_checks.show(given.vmap_axes)}."
            )
        spec = CallSpec(
            _checks.axes_argument(given.trace_axes, "trace_axes", where),
            _checks.axes_argument(given.diagonal_axes, "diagonal_axes", where),
            parse_vmap_axes(None if finds_axes else given.vmap_axes, where),
            _checks.positive_int_argument(given.chunk_size, "chunk_size", where, none_allowed=True),
            output_fn_argument(given.output_fn, where),
            parsed_groups,
            OutputNotices(),
            finds_axes=finds_axes and checks is not False,  # nothing would prove the axes found
        )
        state = KernelFunctionState(
            Planner(keeps_forward_pass=compiling is not None, watches_aliases=isinstance(f, torch.nn.Module)),
            captured=None if compiling is None else CapturedCalls(compiling, f, where),
        )
        return cls(
            f, given, spec, chosen, checks, implementation_table(options), memory_argument(given.memory, where), state
        )

    def called(self, compute: Callable[..., Any], *arguments: Any, caller: Optional[CallerPlan] = None) -> Any:
        """``compute(self, *arguments, caller)``: a kernel call, replayed from its captured graph where
        ``compile`` is set (NOTE: [Captured kernels]); ``arguments`` hold every tensor of the call.
        ``caller``: the budget ``batch`` gives the call (NOTE: [Budgets of callers]); a replay plans
        nothing, so it only matters to eager calls."""
        if self.captured is None:
            return compute(self, *arguments, caller)
        return self.captured(
            arguments, functools.partial(_last, compute, self, caller=caller),
            functools.partial(_last, compute, self._unchecked, caller=caller),
        )

    @functools.cached_property
    def _unchecked(self) -> "NtkSettings":
        """These settings without the per-call output check, sharing every cache (what is captured)."""
        return dataclasses.replace(self, check_vmap_axes=False, state=dataclasses.replace(self.state, captured=None))

    def prepare(
        self, x1: Any, x2: Any, params: Any, kwargs: dict, where: str, *, for_ntk: bool = True,
        computes_ntk: bool = True, forward_run_length: Optional[int] = None, shape_key: Optional[tuple] = None,
        needs_outputs: bool = True, admit: bool = False, caller: Optional[CallerPlan] = None,
    ) -> KernelCall:
        """One call, prepared as its plan says (NOTE: [The planning stage]): bound to the plan's
        template on a warm call, else validated in full by :func:`prepare_call`, after which what
        the call learnt becomes the facts of later plans.

        ``vmap_axes`` only matter (and are only checked) for the NTK (``for_ntk``), or for a
        batched NNGP (``computes_ntk=False``: the check cannot wait for the structured pass, which
        will not run). ``shape_key``: the caller's :func:`input_shape_key` of these arguments, if it
        has one, or their plan key (a module's structure fingerprint is the dearest part of a key:
        a call makes it once). ``needs_outputs``: False where only the NTK is computed, whose implementations read
        the outputs' shapes only (NOTE: [Remembered output shapes]). ``admit``: refuse an NTK too
        large for the memory budget before the forward passes over a large batch (NOTE: [Memory
        plans]); those passes then run on ``VALIDATION_RUN`` examples at a time, within the budget
        of ``caller`` too (NOTE: [Budgets of callers]).

        Which checks run is the plan's: the derivative part of NOTE: [Checking vmap_axes] and
        NOTE: [Aliased parameters]'s check of the module's parameter references run once per key
        (what they catch, a PyTorch vmap bug, coupling in the backward pass, an aliased parameter,
        does not depend on the values); the output check on every call with
        ``check_vmap_axes=True``, on the first per key with ``"first"`` (the default)."""
        key = shape_key if isinstance(shape_key, PlanKey) else None
        shape_key = key.parts[0] if key is not None else shape_key or input_shape_key(x1, x2, params, kwargs)
        key = self.planner.canonical(key or self._plan_key(shape_key))
        if self.finds_axes and for_ntk:
            options = dict(
                for_ntk=for_ntk, computes_ntk=computes_ntk, forward_run_length=forward_run_length,
                shape_key=key, needs_outputs=needs_outputs, admit=admit, caller=caller,
            )
            return self._prepare_finding_axes(x1, x2, params, kwargs, where, options)
        mapped = for_ntk and self.maps_examples
        purpose = Purpose(mapped, for_ntk, computes_ntk, needs_outputs, forward_run_length, admit, self.check_vmap_axes)
        plan = self.planner.plan(key, purpose)
        if plan.warm:
            call = self._bind(plan, x1, x2, params, kwargs)
            if call is not None:
                return replace(call, plan_key=key)
        prepared = self._prepare_in_full(key, purpose, plan, x1, x2, params, kwargs, where, shape_key, caller)
        return replace(prepared, plan_key=key)

    def _plan_key(self, shape_key: tuple) -> PlanKey:
        """:func:`plan_key` of this kernel function's model, from its planner's last walk of the
        module (NOTE: [Unchanged modules])."""
        return plan_key(self.f, shape_key, self.planner.fingerprints)

    def found(self, x1: Any, x2: Any, params: Any, kwargs: dict, shape_key: Optional[tuple] = None) -> "NtkSettings":
        """These settings with the ``vmap_axes`` found for the call's key where they were decided
        (NOTE: [Found vmap_axes]); ``self`` where the axes are the user's or not decided yet."""
        if not self.finds_axes:
            return self
        key = self._plan_key(shape_key or input_shape_key(x1, x2, params, kwargs))
        found = self.planner.facts(key).found_axes
        return self if found is UNDECIDED else self._with_axes(found)

    def _with_axes(self, axes: Optional[ParsedVmapAxes]) -> "NtkSettings":
        """These settings with ``vmap_axes`` ``axes`` (None: no axes), sharing every cache."""
        found = None if axes is None else (repr(axes.in_axes), repr(axes.out_axes), repr(axes.kwargs_axes))
        # the settings a capture traces with (no checks, nothing captured) share the variants: keyed
        # apart, so that neither gets the other's checks
        name = (found, self.check_vmap_axes, self.captured is None)
        variant = self.variants.get(name)
        if variant is None:
            parsed = axes if axes is not None else parse_vmap_axes(None, "")
            spec = dataclasses.replace(self.spec, vmap_axes=parsed, finds_axes=False)
            variant = self.variants[name] = dataclasses.replace(self, spec=spec)
        return variant

    def _prepare_finding_axes(
        self, x1: Any, x2: Any, params: Any, kwargs: dict, where: str, options: dict
    ) -> KernelCall:
        """:meth:`prepare` with ``vmap_axes="auto"`` (NOTE: [Found vmap_axes]): with the axes found for
        the key, or on its first call with the candidate axes, whose checks decide (:meth:`_trial`);
        where none are found, without axes."""
        key = options["shape_key"]  # the plan key (see prepare)
        found = self.planner.facts(key).found_axes
        if found is UNDECIDED:
            call = self._trial(key, x1, x2, params, kwargs, where, options)
            if call is not None:
                return call
            found = None
        return self._with_axes(found).prepare(x1, x2, params, kwargs, where, **options)

    def _trial(
        self, key: Any, x1: Any, x2: Any, params: Any, kwargs: dict, where: str, options: dict
    ) -> Optional[KernelCall]:
        """The first call of ``key`` prepared with the candidate axes, which are then the key's; None,
        preparing nothing more, where there is no candidate or its checks refuse it (or vmap cannot
        evaluate the model): the key then has no axes, and the reason is kept
        (``auto_choice(...).vmap_axes_reason``)."""
        coupled, random = training_mode_layers(self.f) if isinstance(self.f, torch.nn.Module) else ((), ())
        if coupled or random:  # decided before any forward pass: the plan key holds the train/eval modes
            reason = f"{(coupled + random)[0]} couples the examples in training mode"
            candidate = None
        else:
            reason = "the inputs have no leading axis of examples shared by every tensor leaf"
            candidate = candidate_vmap_axes(x1, x2, kwargs)
        if candidate is not None:
            # learnt first: the trial's own facts then keep the plan it makes (NOTE: [The planning stage])
            self.planner.learn(key, found_axes=candidate)
            try:
                with self.example_loops.held() as switches:
                    call = self._with_axes(candidate).prepare(x1, x2, params, kwargs, where, **options)
            except NonFiniteOutputs:
                # says nothing about the axes (NOTE: [Non-finite kernels]): the next call decides them
                self.planner.learn(key, found_axes=UNDECIDED)
                raise
            except (ValueError, VmapLimitation) as error:
                reason = first_line(error)
            else:
                kinds = {layout.kind(axis) for layout, axis in zip(call.layouts, call.side1.out_axes or ())}
                if kinds <= {"kept"}:
                    if switches and call.side1.loop:
                        return self._loop_or_whole_batches(
                            key, call, switches[0], x1, x2, params, kwargs, where, options
                        )
                    return call
                # the layout would treat the leading output axis as the examples' where, without axes,
                # it is traced or diagonal: the same arguments would mean another kernel
                reason = "`trace_axes` or `diagonal_axes` name the leading output axis"
        self.planner.learn(key, found_axes=None, found_reason=reason)
        return None

    def _loop_or_whole_batches(
        self, key: Any, looped: KernelCall, error: VmapLimitation, x1: Any, x2: Any, params: Any, kwargs: dict,
        where: str, options: dict,
    ) -> KernelCall:
        """The trial's call ``looped`` (its examples mapped by a loop, as vmap failed with ``error``)
        or the call on whole batches, whichever is priced cheaper (NOTE: [Loop or whole batches]);
        the key's facts then say which, and why."""
        failure = vmap_failure(error)
        loop_price = whole_price = None
        whole = None
        if options["computes_ntk"]:  # an NNGP alone is forward passes: nothing to weigh
            whole = self._with_axes(None).prepare(x1, x2, params, kwargs, where, **options)
            scope = self.planner.scope(options["shape_key"])  # the plan key (see prepare)
            loop_price, whole_price = self._price(looped, scope), self._price(whole, scope)
        if whole is not None and loop_price is not None and whole_price is not None and whole_price < loop_price:
            reason = (
                f"torch.func.vmap cannot evaluate the model per example ({failure}), and whole batches are "
                f"priced below a Python loop over the examples ({whole_price:.3g} against {loop_price:.3g} "
                f"FLOP equivalents)"
            )
            self.planner.learn(key, found_axes=None, found_reason=reason)
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
        self.planner.learn(key, found_reason=reason)
        self.example_loops.switch(error, where)
        return looped

    def _price(self, call: KernelCall, scope: Optional[Scope]) -> Optional[float]:
        """The cost model's FLOP equivalents of ``call``'s NTK with the implementation that would
        compute it (NOTE: [Loop or whole batches]), or None where it cannot be priced."""
        try:
            if self.implementation == NtkImplementation.AUTO:
                choice = self.choice(call, scope)
                estimate = choice.estimates.get(choice.implementation)
            else:
                estimate = estimate_of(self.table, self.implementation, call, scope)
        except Exception:  # noqa: BLE001 - pricing decides nothing the call cannot do without it
            return None
        if estimate is None or not math.isfinite(estimate.flops):
            return None
        if not call.side1.loop:
            return estimate.flops
        examples = call.side1.batch_size() + (0 if call.side2 is None else call.side2.batch_size())
        return estimate.flops + LOOP_EXAMPLE_FLOPS * examples

    def with_axes_reported(self, choice: AutoChoice, shape_key: tuple) -> AutoChoice:
        """``choice`` with the ``vmap_axes`` its call maps with (NOTE: [Found vmap_axes])."""
        axes, reason = self.vmap_axes, None
        if self.finds_axes:
            facts = self.planner.facts(self._plan_key(shape_key))
            axes, reason = (None if facts.found_axes is UNDECIDED else facts.found_axes), facts.found_reason
        shown = None
        if axes is not None and not (is_all_none(axes.in_axes) and axes.kwargs_axes is None):
            shown = (axes.in_axes, axes.out_axes, axes.kwargs_axes)
        reported = self.reported.get(id(choice))  # the same object for the same cached choice
        if reported is None or reported[0] is not choice or reported[1] != (shown, reason):
            reported = self.reported[id(choice)] = (
                choice, (shown, reason), dataclasses.replace(choice, vmap_axes=shown, vmap_axes_reason=reason)
            )
        return reported[2]

    def _bind(self, plan: CallPlan, x1: Any, x2: Any, params: Any, kwargs: dict) -> Optional[KernelCall]:
        """A warm call: the plan's template with this call's tensors, or None where the differentiated
        parameters changed since (their ``requires_grad`` flags are not part of the key)."""
        template = plan.template
        with alias_checks(skip=True) if isinstance(self.f, torch.nn.Module) else contextlib.nullcontext():
            return bind_call(
                template, self.f, x1, x2, params, kwargs, output_fn=self.output_fn, groups=self.groups,
                loop=plan.example_loop,
            )

    def _prepare_in_full(
        self, key: tuple, purpose: Purpose, plan: CallPlan, x1: Any, x2: Any, params: Any, kwargs: dict, where: str,
        shape_key: tuple, caller: Optional[CallerPlan],
    ) -> KernelCall:
        """:func:`prepare_call` with the plan's checks, loop and stand-in outputs; then the facts it
        learnt, and for later calls of the same key and purpose a template (NOTE: [The planning stage])."""
        forward_run_length = purpose.forward_run_length
        computes_ntk = purpose.for_ntk and purpose.computes_ntk
        early = self._admission(where, caller) if purpose.admit and computes_ntk else None
        if early is not None and forward_run_length is None:
            forward_run_length = VALIDATION_RUN
        aliases: Any = contextlib.nullcontext()
        if isinstance(self.f, torch.nn.Module):
            learn = functools.partial(self.planner.learn, key, aliases_checked=True)
            aliases = alias_checks(on_clean=learn) if plan.check_aliases else alias_checks(skip=True)

        # NOTE: [The derivative check within a plan's check]: a kernel computed right after by AUTO
        # or 3 lets 3's plan check settle the derivative check
        deferred = purpose.admit and computes_ntk and self.implementation in _PLAN_CHECKED

        def prepare(*, example_loop: bool) -> KernelCall:
            spec = replace(
                self.spec, vmap_axes=self.vmap_axes if purpose.for_ntk else None,
                groups=self.groups if computes_ntk else None,
            )
            call = prepare_call(
                self.f, x1, x2, params, kwargs, spec, where=where, admit=early,
                plan=replace(plan, example_loop=example_loop, derivatives_deferred=deferred),
                computes_ntk=computes_ntk, forward_run_length=forward_run_length,
            )
            if not purpose.needs_outputs and not self.given.compile:
                call = self._within_working_set(call, self.planner.scope(key), self.implementation)
            if call.derivative_check is not None:  # priced as computed: with its working-set runs
                self._settle_derivatives(call, self.planner.scope(key), caller)
            return call

        with aliases:
            try:
                call = prepare(example_loop=plan.example_loop)
            except VmapLimitation as error:  # NOTE: [Switching to example loops]
                if not purpose.maps_examples or plan.example_loop:
                    raise
                call = prepare(example_loop=True)  # a model that also fails in the loop raises its own error, unwarned
                self._switch_to_loop(key, error, where)
        outputs = plan.outputs
        if purpose.maps_examples:
            learnt: dict[str, Any] = {}
            if self.check_vmap_axes:
                learnt["derivatives_checked"] = True
            if outputs is None and self.check_vmap_axes is not True and call.side1.mapped:
                outputs = learnt["outputs"] = call.output_shapes()
            if learnt:
                self.planner.learn(key, **learnt)
        runs = call.working_runs
        if computes_ntk and outputs is not None and call.side1.mapped:
            side2 = call.side2
            template = CallTemplate(
                call.template(outputs), call.model.names, (call.side1.x_axes, call.side1.kwarg_axes),
                None if side2 is None else (side2.x_axes, side2.kwarg_axes), call.side1.out_axes,
                None if call.model.survey is None else call.model.survey.kept(),
            )
            self.planner.template_for(key, purpose, template, runs)
        return call

    def _within_working_set(
        self, call: KernelCall, scope: Optional[Scope], implementation: NtkImplementation,
    ) -> KernelCall:
        """``call`` with the run lengths of NOTE: [Working-set runs] for ``implementation``:
        examples per per-example pass (mapped, without ``chunk_size``; for AUTO, 1's and 3's), and
        tangents per forward-mode pass where implementation 2 may compute it. The sizes are counted
        once per key."""
        mapped = call.side1.mapped
        products = implementation in (NtkImplementation.NTK_VECTOR_PRODUCTS, NtkImplementation.AUTO)
        if not (mapped and self.chunk_size is None) and not products:
            return call
        sizes = kept_sizes(call, scope)
        changes: dict[str, Any] = {}
        if mapped and self.chunk_size is None:
            changes["working_runs"] = _working_runs(call, sizes, implementation)
            if implementation == NtkImplementation.AUTO:  # for a pick of 3, made later
                structured = _working_runs(call, sizes, _STRUCTURED)
                changes["structured_runs"] = None if structured == changes["working_runs"] else structured
        if products:
            changes["tangents_per_pass"] = forward_mode_tangents(
                sizes.side1.examples, sizes.side1.activations.largest, max(sizes.param_sizes, default=0),
                sizes.element, TANGENTS_PER_PASS,
            )
        return replace(call, **changes)

    def _settle_derivatives(self, call: KernelCall, scope: Optional[Scope], caller: Optional[CallerPlan]) -> None:
        """The derivative check a first call left to the plan (NOTE: [The derivative check within a
        plan's check]): the call's choice is made first, within the budget its kernel will have
        (AUTO's pick and, where it is 3, 3's plan, checked; cached for the kernel that follows),
        then the check runs unless 3's check settled it and 3 computes the kernel. Raises what the
        check raises."""
        pending = call.derivative_check
        budget = self.budget(call, caller)

        def choose() -> AutoChoice:
            with serialised(self.thread_safe), explained(call.where):  # NOTE: [Threads]: AUTO probes forward mode
                return self.choice(call, scope, budget)

        try:
            # as the kernel's own planning is: NOTE: [Out of memory at the kernel boundary]
            picked = out_of_memory_boundary(
                choose, call.where, lambda: f"implementation {int(self.implementation)}'s plan",
                OUT_OF_MEMORY_ADVICE, call.outputs1[0].device, lambda: budget,
            )
        except Exception:
            pending.settle()  # a vmap bug or coupled examples, explained before what they caused
            raise
        pending.settle(computed_by_3=picked.implementation == NtkImplementation.STRUCTURED_DERIVATIVES)

    def _switch_to_loop(self, key: tuple, error: VmapLimitation, where: str) -> None:
        """NOTE: [Switching to example loops]: later plans of ``key`` map examples by a loop."""
        self.planner.learn(key, example_loop=True)
        self.example_loops.switch(error, where)

    def _admission(self, where: str, caller: Optional[CallerPlan]) -> Optional[Callable[..., None]]:
        """``admit(shapes, dtypes, device)`` for :func:`prepare_call`: raises the refusal of a kernel
        larger than the budget; None with an unlimited budget."""
        if self.memory is not None and not math.isfinite(self.memory):
            return None
        groups = len(self.groups.names) if self.groups is not None else 1

        def admit(shapes: tuple, dtypes: tuple, device: torch.device, examples: Optional[tuple] = None) -> None:
            budget = resolve_budget(self.memory, device, caller)
            refusal = kernel_refusal(shapes, dtypes, groups, budget, where, device, examples)
            if refusal is not None:
                raise refusal

        return admit

    def computed(self, call: KernelCall, compute: Callable[[KernelCall], Any]) -> Any:
        """``compute(call)``, again with an example loop if vmap fails on the model (NOTE:
        [Switching to example loops])."""
        try:
            return compute(call)
        except VmapLimitation as error:
            if not call.side1.mapped or call.side1.loop:
                raise
            result = compute(call.looped())
            self._switch_to_loop(call.plan_key, error, call.where)
            return result

    def open_blocks(
        self, request: BlockRequest, x1: Any, x2: Any, params: Any, kwargs: dict, *, names: tuple[str, ...],
        bare: bool, where: str,
    ) -> Optional[BlockSource]:
        """The call as a :class:`BlockSource` for ``batch``, or None without ``vmap_axes`` (see
        NOTE: [Prepared spans]); the NNGP's forward passes are mapped by ``vmap_axes`` too."""
        forward_runs = None if request.block_size is None else max(request.block_size, FORWARD_RUN)
        shape_key = input_shape_key(x1, x2, params, kwargs)
        if self.finds_axes:  # NOTE: [Found vmap_axes]: the key's first call decides them
            found = self.found(x1, x2, params, kwargs, shape_key)
            if found is self:  # only the trial: without axes, batch computes block by block
                key = self._plan_key(shape_key)
                options = dict(
                    for_ntk=True, computes_ntk="ntk" in names, forward_run_length=forward_runs, shape_key=key,
                    needs_outputs="nngp" in names, admit=False, caller=None,
                )
                self._trial(key, x1, x2, params, kwargs, where, options)
                found = self.found(x1, x2, params, kwargs, shape_key)
            return found.open_blocks(request, x1, x2, params, kwargs, names=names, bare=bare, where=where)
        if not self.maps_examples:
            return None  # before any forward pass: without vmap_axes the model sees whole batches
        call = self.prepare(
            x1, x2, params, kwargs, where, computes_ntk="ntk" in names, forward_run_length=forward_runs,
            shape_key=shape_key, needs_outputs="nngp" in names,  # the NTK's spans read output shapes only
        )
        if not call.side1.mapped:
            return None
        plan = None
        spans = self.planner.scope(call.plan_key, "blocks")  # planned apart from whole calls
        if "ntk" in names:
            n1 = call.side1.batch_size()
            n2 = n1 if call.reuses_x1 else call.side2.batch_size()
            block = (min(n1, request.block_size or n1), min(n2, request.block_size or n2))
            plan = policy(self.table, self.implementation).blocks(call, spans, block)
        span_memory = None
        if plan is not None and plan.implementation is not None:
            implementation, structured = plan.implementation, plan.structured

            def span_memory(length: int) -> float:
                """NOTE: [Memory plans]: two spans of ``length`` prepared and contracted (no result)."""
                peak = modelled_peak(call, spans, implementation, length, structured, cut=True)
                return peak.derivatives

        return BlockSource(
            call, plan, names, bare=bare, thread_safe=self.thread_safe, span_memory=span_memory,
            explains_non_finite=self.check_vmap_axes is not False,
        )

    @property
    def maps_examples(self) -> bool:
        """Whether ``vmap_axes`` can map anything (an axis for some input or keyword argument)."""
        return not (is_all_none(self.vmap_axes.in_axes) and self.vmap_axes.kwargs_axes is None)

    @property
    def thread_safe(self) -> bool:
        """See ``KernelFnSpec.thread_safe``: forward-mode AD is not thread-safe in PyTorch."""
        forward_mode = self.implementation in (NtkImplementation.AUTO, NtkImplementation.NTK_VECTOR_PRODUCTS)
        local = self.implementation == NtkImplementation.STRUCTURED_DERIVATIVES and not self.options.closed_form_rules
        return not (forward_mode or local)

    def choice(self, call: KernelCall, scope: Optional[Scope], budget: Optional[float] = None) -> AutoChoice:
        """What ``auto_choice`` reports for ``call``: AUTO's pick within ``budget`` (default: the
        call's, NOTE: [Memory budgets]), or the fixed implementation."""
        chooser = policy(self.table, self.implementation)
        if self.implementation == NtkImplementation.AUTO:
            return chooser.choice(call, scope, self.budget(call, None) if budget is None else budget)
        return chooser.choice(call, scope)

    def budget(self, call: KernelCall, caller: Optional[CallerPlan] = None) -> float:
        """The call's memory budget in bytes (NOTE: [Memory budgets]), at most ``caller``'s."""
        return resolve_budget(self.memory, call.outputs1[0].device, caller)

    def ntk(self, call: KernelCall, caller: Optional[CallerPlan] = None) -> Any:
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
        budget = self.budget(call, caller)
        chunking = caller is None or caller.chunking
        attempted: list = []
        scope = self.planner.scope(call.plan_key)

        def planned(call: KernelCall) -> Any:
            # NOTE: [Memory plans]: refused, or given a chunk_size, before any derivative is taken
            # (inside `computed`: implementation 3's plan may need the example loop too)
            try:
                plan = self.planner.memory_plan(
                    call.plan_key, _memory_choices(call), budget,
                    lambda budget: memory_plan(self.table, self.implementation, call, scope, budget),
                )
            except KernelMemoryError as refusal:
                if chunking or refusal.kernel_alone:
                    raise self._explained(refusal, call) from None
                return NEEDS_BLOCKS  # NOTE: [Budgets of callers]: the caller cuts x1 too
            if plan.chosen and not chunking:
                return NEEDS_BLOCKS
            if plan.chosen and self.state.chunk_warnings.first():
                warn_chosen_chunk(plan, call)
            attempted.append(plan)
            if call.structured_runs is not None and plan.implementation == _STRUCTURED:
                # NOTE: [Working-set runs]: AUTO's pick of 3 runs with 3's runs
                call = replace(call, working_runs=call.structured_runs)
            return self.table[plan.implementation].kernels(with_chunk(call, plan), scope)

        def compute() -> PyTree:
            with serialised(self.thread_safe), explained(call.where):  # NOTE: [Threads]
                kernels = self.computed(call, planned)
                if kernels is NEEDS_BLOCKS:
                    return kernels
                self.explain_non_finite(call, kernels)
                return call.normalise(kernels)

        def described() -> str:
            if attempted:
                return attempted[-1].describe()
            return f"implementation {int(self.implementation)} (budget {format_bytes(budget)})"

        def planned_budget() -> float:
            return attempted[-1].budget if attempted else budget

        # NOTE: [Out of memory at the kernel boundary]
        return out_of_memory_boundary(
            compute, call.where, described, OUT_OF_MEMORY_ADVICE, call.outputs1[0].device, planned_budget
        )

    def explain_non_finite(self, call: KernelCall, kernels: list) -> None:
        """NOTE: [Non-finite kernels]: raises :class:`NonFiniteOutputs` where ``kernels`` (a call's
        kernels before :meth:`KernelCall.normalise`) are not finite because the outputs are not;
        nothing with ``check_vmap_axes=False``."""
        if self.check_vmap_axes is not False and not all_finite(kernels):
            raise_for_non_finite_outputs(call.where, call.model, (call.side1, call.side2 or call.side1))

    def _explained(self, refusal: KernelMemoryError, call: KernelCall) -> KernelMemoryError:
        """``refusal`` of a call that ``vmap_axes="auto"`` left unmapped, with the reason first: a
        model in training mode needs whole batches only because of its batch statistics."""
        if not self.finds_axes or call.side1.mapped or call.plan_key is None:
            return refusal
        reason = self.planner.facts(call.plan_key).found_reason
        if reason is None:
            return refusal
        advice = " (model.eval() lets them be)" if "training mode" in reason else ""
        explained = KernelMemoryError(
            f"{refusal} The examples are not mapped one by one{advice} because {reason}.",
            refusal.needed_bytes, refusal.budget_bytes, kernel_alone=refusal.kernel_alone,
        )
        return explained

    def publish(
        self, kernel_fn: KernelFn, kind: str, builder: Callable[..., KernelFn], open_blocks: Callable[..., Any],
        where: str, doc: str, within: Callable[[CallerPlan], KernelFn],
    ) -> KernelFunction:
        """The :class:`KernelFunction` of ``kernel_fn``: its spec (for ``batch``: ``open_blocks``,
        ``within``), ``auto_choice`` and ``doc``."""
        options = self.given.as_keywords()
        rebuild = functools.partial(builder, **options)
        spec = KernelFnSpec(
            kind, self.f, self.trace_axes, self.diagonal_axes, rebuild, thread_safe=self.thread_safe,
            open_blocks=open_blocks, options=options, within=within,
        )

        def auto_choice(x1: PyTree, x2: Optional[PyTree] = None, params: Any = None, **kwargs: Any) -> AutoChoice:
            key = input_shape_key(x1, x2, params, kwargs)
            # prepared as the NTK call prepares it (its working-set runs among what is priced), so
            # that the kept choice is the same whichever of the two comes first
            call = self.prepare(x1, x2, params, kwargs, where, shape_key=key, needs_outputs=False)
            return self.with_axes_reported(self.choice(call, self.planner.scope(call.plan_key)), key)

        published = KernelFunction(kernel_fn, spec, doc, auto_choice)
        published._settings = self  # for the memory model's tests and benchmarks (tests/_memory_grid.py)
        return published


def _last(compute: Callable[..., Any], settings: "NtkSettings", *arguments: Any, caller: Optional[CallerPlan]) -> Any:
    """``compute(settings, *arguments, caller)``: the captured path calls with ``arguments`` alone."""
    return compute(settings, *arguments, caller)


_STRUCTURED = NtkImplementation.STRUCTURED_DERIVATIVES


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


def _memory_choices(call: KernelCall) -> tuple:
    """What a call's memory plan depends on besides its plan key (NOTE: [Plan keys]): the parameters
    differentiated, the chunk and run lengths, the example loop, the groups."""
    return (
        call.model.names, call.chunk_size, call.working_runs, call.structured_runs, call.tangents_per_pass,
        call.side1.loop, call.groups,
    )


def structured_options(values: dict, chosen: NtkImplementation, where: str) -> StructuredOptions:
    defaults = StructuredOptions()
    for name in ("structure_rules", "closed_form_rules", "verify"):
        _checks.bool_argument(values[name], name, where)
    if values["local_jacobian"] not in ("auto", "forward", "reverse"):
        raise ValueError(
            f"{where}: `local_jacobian` must be 'auto', 'forward' or 'reverse', got "
            f"{_checks.show(values['local_jacobian'])}."
        )
    changed = [name for name, value in values.items() if value != getattr(defaults, name)]
    uses_them = (NtkImplementation.STRUCTURED_DERIVATIVES, NtkImplementation.AUTO)
    if changed and chosen not in uses_them:
        raise ValueError(
            f"{where}: {', '.join(f'`{name}`' for name in changed)} only apply to implementation=3 "
            f"(STRUCTURED_DERIVATIVES) or 0 (AUTO), but implementation={int(chosen)} ({chosen.name})."
        )
    return StructuredOptions(**values)


def check_mode_argument(value: Any, where: str) -> Union[bool, str]:
    """``check_vmap_axes``: True (outputs on every call), ``"first"`` (everything on the first call
    per input shapes and module structure) or False."""
    if value is True or value is False or value == "first":
        return value
    raise ValueError(f"{where}: `check_vmap_axes` must be True, 'first' or False, got {_checks.show(value)}.")
