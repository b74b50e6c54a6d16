"""The validated arguments of an NTK kernel function, and what its calls share.

:class:`NtkSettings` is built once per kernel function by ``empirical_ntk_fn`` and
``empirical_kernel_fn``: it validates the builder's arguments and holds them with the kernel
function's plans (NOTE: [The planning stage]). A call is three steps, each a method here that
hands the work to its module:

* :meth:`NtkSettings.prepare`: the call's plan key and plan, then its tensors bound to the plan's
  template (a warm call) or the call validated in full (``preparation.py``);
* :meth:`NtkSettings.ntk`: the kernels the plan's implementation computes (``execution.py``);
* :meth:`NtkSettings.called` around both: the captured graph's replay where ``compile`` is set
  (``captured.py``).

``batch`` asks :meth:`NtkSettings.open_blocks` for spans instead (``block_source.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import threading
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Union

import torch

from .._call.example_loop import ExampleLoops
from .._call.finite import all_finite, raise_for_non_finite_outputs
from .._call.groups import groups_argument
from .._call.kernel_call import CallSpec, KernelCall
from .._call.outputs import output_fn_argument
from .._call.per_example import PlanOutdated
from .._call.vmap_axes import FOUND, ParsedVmapAxes, parse_vmap_axes
from .._implementations import implementation_table, policy
from .._implementations.choice import AutoChoice
from .._implementations.structured import StructuredOptions
from .._layout.notices import OutputNotices
from .._memory import CallerPlan, memory_argument, resolve_budget
from .._plan import UNDECIDED, PlanKey, Planner, Purpose, Scope, input_shape_key, plan_key, shared_planner
from .._utils import checks as _checks
from .._utils.bounded_cache import BoundedCache
from .._utils.tree import is_all_none
from .._utils.types import Model, NtkImplementation, PyTree
from . import execution, preparation
from .block_source import BlockRequest, BlockSource, open_blocks
from .captured import CapturedCalls, compile_argument
from .kernel_function import KernelFnSpec, KernelFunction

KernelFn = Callable[..., PyTree]


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
        trace_axes = _checks.axes_argument(given.trace_axes, "trace_axes", where)
        diagonal_axes = _checks.axes_argument(given.diagonal_axes, "diagonal_axes", where)
        # what kernel functions built again compare (NOTE: [Plans shared by kernel functions]): the
        # arguments as given, those parsed to plain values as parsed (``implementation=0`` is the
        # default ``NtkImplementation.AUTO``, ``trace_axes=[-1]`` the default ``(-1,)``)
        parsed = {"implementation": int(chosen), "trace_axes": trace_axes, "diagonal_axes": diagonal_axes}
        options_given = (where, tuple({**given.as_keywords(), **parsed}.items()))
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
            trace_axes,
            diagonal_axes,
            parse_vmap_axes(None if finds_axes else given.vmap_axes, where),
            _checks.positive_int_argument(given.chunk_size, "chunk_size", where, none_allowed=True),
            output_fn_argument(given.output_fn, where),
            parsed_groups,
            OutputNotices(),
            finds_axes=finds_axes and checks is not False,  # nothing would prove the axes found
        )

        def planner() -> Planner:
            return Planner(keeps_forward_pass=compiling is not None, watches_aliases=isinstance(f, torch.nn.Module))

        state = KernelFunctionState(
            planner() if compiling is not None else shared_planner(f, options_given, planner),
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
            try:
                return compute(self, *arguments, caller)
            except PlanOutdated:  # NOTE: [Outputs that outgrow their plan]: the key's plans are gone
                return compute(self, *arguments, caller)  # planned anew, from the model as it is
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
        key = self.planner.canonical(key or self.key_of(shape_key))
        if self.finds_axes and for_ntk:
            options = dict(
                for_ntk=for_ntk, computes_ntk=computes_ntk, forward_run_length=forward_run_length,
                shape_key=key, needs_outputs=needs_outputs, admit=admit, caller=caller,
            )
            return preparation.prepare_finding_axes(self, x1, x2, params, kwargs, where, options)
        mapped = for_ntk and self.maps_examples
        purpose = Purpose(mapped, for_ntk, computes_ntk, needs_outputs, forward_run_length, admit, self.check_vmap_axes)
        plan = self.planner.plan(key, purpose)
        if plan.warm:
            call = preparation.bind(self, key, plan, x1, x2, params, kwargs)
            if call is not None:
                return replace(call, plan_key=key)
        prepared = preparation.prepare_in_full(
            self, key, purpose, plan, x1, x2, params, kwargs, where, shape_key, caller
        )
        return replace(prepared, plan_key=key)

    def key_of(self, shape_key: tuple) -> PlanKey:
        """:func:`plan_key` of this kernel function's model, from its planner's last walk of the
        module (NOTE: [Unchanged modules])."""
        return plan_key(self.f, shape_key, self.planner.fingerprints)

    def found(self, x1: Any, x2: Any, params: Any, kwargs: dict, shape_key: Optional[tuple] = None) -> "NtkSettings":
        """These settings with the ``vmap_axes`` found for the call's key where they were decided
        (NOTE: [Found vmap_axes]); ``self`` where the axes are the user's or not decided yet."""
        if not self.finds_axes:
            return self
        key = self.key_of(shape_key or input_shape_key(x1, x2, params, kwargs))
        found = self.planner.facts(key).found_axes
        return self if found is UNDECIDED else self.with_axes(found)

    def with_axes(self, axes: Optional[ParsedVmapAxes]) -> "NtkSettings":
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
        """The NTK of a prepared call (:func:`~torchntk._kernel.execution.ntk`): planned within the
        budget (and ``caller``'s), or :data:`NEEDS_BLOCKS` where ``caller`` allows no blocks and the
        plan would need them."""
        return execution.ntk(self, call, caller)

    def open_blocks(
        self, request: BlockRequest, x1: Any, x2: Any, params: Any, kwargs: dict, *, names: tuple[str, ...],
        bare: bool, where: str,
    ) -> Optional[BlockSource]:
        """The call as a :class:`BlockSource` for ``batch`` (:func:`~torchntk._kernel.block_source.open_blocks`)."""
        return open_blocks(self, request, x1, x2, params, kwargs, names=names, bare=bare, where=where)

    def explain_non_finite(self, call: KernelCall, kernels: list) -> None:
        """NOTE: [Non-finite kernels]: raises :class:`NonFiniteOutputs` where ``kernels`` (a call's
        kernels before :meth:`KernelCall.normalise`) are not finite because the outputs are not;
        nothing with ``check_vmap_axes=False``."""
        if self.check_vmap_axes is not False and not all_finite(kernels):
            raise_for_non_finite_outputs(call.where, call.model, (call.side1, call.side2 or call.side1))

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
            return preparation.with_axes_reported(self, self.choice(call, self.planner.scope(call.plan_key)), key)

        published = KernelFunction(kernel_fn, spec, doc, auto_choice)
        published._settings = self  # for the memory model's tests and benchmarks (tests/_memory_grid.py)
        return published


def _last(compute: Callable[..., Any], settings: "NtkSettings", *arguments: Any, caller: Optional[CallerPlan]) -> Any:
    """``compute(settings, *arguments, caller)``: the captured path calls with ``arguments`` alone."""
    return compute(settings, *arguments, caller)



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
