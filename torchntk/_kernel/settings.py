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
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from .._call.example_loop import ExampleLoops
from .._call.groups import ParameterGroups, groups_argument
from .._call.kernel_call import KernelCall, prepare_call
from .._call.outputs import output_fn_argument
from .._call.per_example import VmapLimitation
from .._call.vmap_axes import ParsedVmapAxes, parse_vmap_axes
from .._implementations import implementation_table, memory_plan, memory_planner
from .._implementations.memory import OUT_OF_MEMORY_ADVICE, VALIDATION_RUN, kernel_refusal, with_chunk
from .._implementations.choice import AutoChoice
from .._implementations.structured import StructuredOptions
from .._memory import (
    KernelMemoryError,
    WouldChunk,
    chunking_allowed,
    memory_argument,
    out_of_memory_boundary,
    resolve_budget,
)
from .._model.aliases import alias_checks
from .._model.fingerprint import structure_fingerprint
from .._model.torch_errors import explained
from .._utils import checks as _checks
from .._utils.bounded_cache import BoundedCache
from .._utils.threads import serialised
from .._utils.tree import Flat, is_all_none
from .._utils.types import Model, NtkImplementation, PyTree
from .block_source import BlockRequest, BlockSource
from .captured import CapturedCalls, compile_argument
from .kernel_function import KernelFnSpec, KernelFunction
from .working_set import working_set_run_length

KernelFn = Callable[..., PyTree]

_CHECKED_SHAPES = 64
"""Input shapes (and module structures) whose derivatives were checked, kept per kernel function."""

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


@dataclass(frozen=True)
class NtkSettings:
    """Builder arguments, validated once when the kernel function is built."""

    f: Model
    trace_axes: tuple[int, ...]
    diagonal_axes: tuple[int, ...]
    vmap_axes: ParsedVmapAxes
    implementation: NtkImplementation
    chunk_size: Optional[int]
    check_vmap_axes: Union[bool, str]  # True, "first" or False (check_mode_argument)
    options: StructuredOptions
    table: dict  # NOTE: [The implementation table], one per kernel function
    given: NtkOptions  # to build the same kernel function around another copy of the model
    derivatives_checked: BoundedCache = field(default_factory=lambda: BoundedCache(_CHECKED_SHAPES))
    aliases_checked: BoundedCache = field(default_factory=lambda: BoundedCache(_CHECKED_SHAPES))  # NOTE: [Aliased parameters]
    output_shapes: BoundedCache = field(default_factory=lambda: BoundedCache(_CHECKED_SHAPES))  # NOTE: [Remembered output shapes]
    example_loops: ExampleLoops = field(default_factory=ExampleLoops)
    output_fn: Optional[Callable] = None  # normalised by output_fn_argument
    groups: Optional[ParameterGroups] = None  # NOTE: [Parameter groups]
    captured: Optional[CapturedCalls] = None  # NOTE: [Captured kernels]; None: every call eager
    memory: Optional[float] = None  # NOTE: [Memory budgets]; None: the default, a share of the free memory

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
        backend = compile_argument(given.compile, where)
        if backend is not None and options.verify:
            raise ValueError(
                f"{where}: `verify=True` checks every call against autograd, which a replayed graph "
                f"would skip; use one of `verify` and `compile`."
            )
        return cls(
            f,
            _checks.axes_argument(given.trace_axes, "trace_axes", where),
            _checks.axes_argument(given.diagonal_axes, "diagonal_axes", where),
            parse_vmap_axes(given.vmap_axes, where),
            chosen,
            _checks.positive_int_argument(given.chunk_size, "chunk_size", where, none_allowed=True),
            check_mode_argument(given.check_vmap_axes, where),
            options,
            implementation_table(options),
            given,
            output_fn=output_fn_argument(given.output_fn, where),
            groups=parsed_groups,
            captured=None if backend is None else CapturedCalls(backend, f, where),
            memory=memory_argument(given.memory, where),
        )

    def called(self, compute: Callable[..., Any], *arguments: Any) -> Any:
        """``compute(self, *arguments)``: a kernel call, replayed from its captured graph where
        ``compile`` is set (NOTE: [Captured kernels]); ``arguments`` hold every tensor of the call."""
        if self.captured is None:
            return compute(self, *arguments)
        return self.captured(
            arguments, functools.partial(compute, self), functools.partial(compute, self._unchecked)
        )

    @functools.cached_property
    def _unchecked(self) -> "NtkSettings":
        """These settings without the per-call output check, sharing every cache (what is captured)."""
        return dataclasses.replace(self, check_vmap_axes=False, captured=None)

    def prepare(
        self, x1: Any, x2: Any, params: Any, kwargs: dict, where: str, *, for_ntk: bool = True,
        computes_ntk: bool = True, forward_run_length: Optional[int] = None, shape_key: Optional[tuple] = None,
        needs_outputs: bool = True, admit: bool = False,
    ) -> KernelCall:
        """Validates one call; ``vmap_axes`` only matter (and are only checked) for the NTK
        (``for_ntk``), or for a batched NNGP (``computes_ntk=False``: the check cannot wait for
        the structured pass, which will not run).

        The derivative part of NOTE: [Checking vmap_axes] runs once per input shapes and module
        structure: what it catches (a PyTorch vmap bug, coupling in the backward pass) does not
        depend on the values, and it costs as much as a small kernel (about 4 ms on the benchmark
        MLP); so does NOTE: [Aliased parameters]'s check of a module's parameter references. The
        output check runs on every call, unless ``check_vmap_axes="first"``. ``shape_key``: the
        caller's :func:`input_shape_key` of these arguments, if it has one. ``needs_outputs``:
        False where only the NTK is computed, whose implementations read the outputs' shapes only
        (NOTE: [Remembered output shapes]). ``admit``: refuse an NTK too large for the memory
        budget before the forward passes over a large batch (NOTE: [Memory plans]); those passes
        then run on ``VALIDATION_RUN`` examples at a time."""
        key = loop_key = None
        if for_ntk and self.maps_examples:
            shape_key = shape_key or input_shape_key(x1, x2, params, kwargs)
            loop_key = shape_key
            if self.check_vmap_axes or not needs_outputs:
                key = (shape_key, _structure_key(self.f))
        checked = key is not None and key in self.derivatives_checked
        check = self.check_vmap_axes is True or (self.check_vmap_axes == "first" and not checked)
        known = None
        if not (needs_outputs or check or self.captured is not None or self.given.compile) and computes_ntk:
            known = self.output_shapes.get(key)
        aliases = self._alias_checks(key, x1, x2, params, kwargs, shape_key)

        early = self._admission(where) if admit and for_ntk and computes_ntk else None
        if early is not None and forward_run_length is None:
            forward_run_length = VALIDATION_RUN

        def prepare(*, example_loop: bool) -> KernelCall:
            return prepare_call(
                self.f, x1, x2, params, kwargs, where=where, trace_axes=self.trace_axes,
                diagonal_axes=self.diagonal_axes, vmap_axes=self.vmap_axes if for_ntk else None,
                check_vmap_axes=check, chunk_size=self.chunk_size,
                defer_vmap_check=computes_ntk,
                forward_run_length=forward_run_length, for_ntk=for_ntk and computes_ntk,
                check_derivatives=key is not None and bool(self.check_vmap_axes) and not checked,
                example_loop=example_loop, output_fn=self.output_fn,
                groups=self.groups if for_ntk and computes_ntk else None, known_outputs=known, admit=early,
            )

        looped = loop_key is not None and self.example_loops.needed(loop_key)
        with aliases:
            try:
                call = prepare(example_loop=looped)
            except VmapLimitation as error:  # NOTE: [Switching to example loops]
                if loop_key is None or looped:
                    raise
                call = prepare(example_loop=True)  # a model that also fails in the loop raises its own error, unwarned
                self.example_loops.switch(loop_key, error, where)
        if key is not None:
            if self.check_vmap_axes:
                self.derivatives_checked[key] = True
            if known is None and self.check_vmap_axes is not True and call.side1.mapped:
                self.output_shapes[key] = call.output_shapes()
        if not needs_outputs and self.chunk_size is None and not self.given.compile and call.side1.mapped:
            sizes = memory_planner(self.table).sizes(call, shape_key)  # counted once per input shapes
            runs = working_set_run_length(call.side1.batch_size(), sizes.side1.activations.written, sizes.element)
            call = dataclasses.replace(call, working_runs=runs)
        return call

    def _admission(self, where: str) -> Optional[Callable[..., None]]:
        """``admit(shapes, dtypes, device)`` for :func:`prepare_call`: raises the refusal of a kernel
        larger than the budget; None with an unlimited budget."""
        if self.memory is not None and not math.isfinite(self.memory):
            return None
        groups = len(self.groups.names) if self.groups is not None else 1

        def admit(shapes: tuple, dtypes: tuple, device: torch.device) -> None:
            refusal = kernel_refusal(shapes, dtypes, groups, resolve_budget(self.memory, device), where)
            if refusal is not None:
                raise refusal

        return admit

    def _alias_checks(
        self, key: Optional[tuple], x1: Any, x2: Any, params: Any, kwargs: dict, shape_key: Optional[tuple]
    ) -> Any:
        """The :func:`alias_checks` context for a call's model: skipped where a check with these
        input shapes and module structure has passed (``key`` where the derivative check made it)."""
        if not isinstance(self.f, torch.nn.Module):
            return contextlib.nullcontext()
        if key is None:
            key = (shape_key or input_shape_key(x1, x2, params, kwargs), _structure_key(self.f))
        if key in self.aliases_checked:
            return alias_checks(skip=True)
        return alias_checks(on_clean=functools.partial(self.aliases_checked.__setitem__, key, True))

    def computed(self, call: KernelCall, key: tuple, compute: Callable[[KernelCall], Any]) -> Any:
        """``compute(call)``, again with an example loop if vmap fails on the model (NOTE:
        [Switching to example loops]); ``key`` is the call's shape key."""
        try:
            return compute(call)
        except VmapLimitation as error:
            if not call.side1.mapped or call.side1.loop:
                raise
            result = compute(call.looped())
            self.example_loops.switch(key, error, call.where)
            return result

    def open_blocks(
        self, request: BlockRequest, x1: Any, x2: Any, params: Any, kwargs: dict, *, names: tuple[str, ...],
        bare: bool, where: str,
    ) -> Optional[BlockSource]:
        """The call as a :class:`BlockSource` for ``batch``, or None without ``vmap_axes`` (see
        NOTE: [Prepared spans]); the NNGP's forward passes are mapped by ``vmap_axes`` too."""
        if not self.maps_examples:
            return None  # before any forward pass: without vmap_axes the model sees whole batches
        forward_runs = None if request.block_size is None else max(request.block_size, FORWARD_RUN)
        shape_key = input_shape_key(x1, x2, params, kwargs)
        call = self.prepare(
            x1, x2, params, kwargs, where, computes_ntk="ntk" in names, forward_run_length=forward_runs,
            shape_key=shape_key, needs_outputs="nngp" in names,  # the NTK's spans read output shapes only
        )
        if not call.side1.mapped:
            return None
        plan = None
        if "ntk" in names:
            n1 = call.side1.batch_size()
            n2 = n1 if call.reuses_x1 else call.side2.batch_size()
            block = (min(n1, request.block_size or n1), min(n2, request.block_size or n2))
            plan = self.table[self.implementation].blocks(call, ("blocks", shape_key), request.thorough, block)
        span_memory = None
        if plan is not None and plan.implementation is not None:
            planner, implementation, structured = memory_planner(self.table), plan.implementation, plan.structured

            def span_memory(length: int) -> float:
                """NOTE: [Memory plans]: two spans of ``length`` prepared and contracted (no result)."""
                peak = planner.peak(call, ("blocks", shape_key), implementation, length, structured, cut=True)
                return peak.derivatives

        return BlockSource(call, plan, names, bare=bare, thread_safe=self.thread_safe, span_memory=span_memory)

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

    def choice(self, call: KernelCall, key: tuple) -> AutoChoice:
        if self.implementation == NtkImplementation.AUTO:
            return self.table[self.implementation].choice(call, key, self.budget(call))
        return self.table[self.implementation].choice(call, key)

    def budget(self, call: KernelCall) -> float:
        """The call's memory budget in bytes (NOTE: [Memory budgets])."""
        return resolve_budget(self.memory, call.outputs1[0].device)

    def ntk(self, call: KernelCall, key: tuple) -> PyTree:
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
        budget = self.budget(call)
        attempted: list = []

        def planned(call: KernelCall) -> Any:
            # NOTE: [Memory plans]: refused, or given a chunk_size, before any derivative is taken
            # (inside `computed`: implementation 3's plan may need the example loop too)
            try:
                plan = memory_plan(self.table, self.implementation, call, key, budget)
            except KernelMemoryError as refusal:
                if chunking_allowed() or refusal.kernel_alone:
                    raise
                raise WouldChunk() from None  # NOTE: [Budgets of callers]: the caller cuts x1 too
            if plan.chosen and not chunking_allowed():
                raise WouldChunk()
            memory_planner(self.table).notify(plan, call)
            attempted.append(plan)
            return self.table[plan.implementation].kernels(with_chunk(call, plan), key)

        def compute() -> PyTree:
            with serialised(self.thread_safe), explained(call.where):  # NOTE: [Threads]
                return call.normalise(self.computed(call, key, planned))

        def described() -> str:
            return attempted[-1].describe() if attempted else f"implementation {int(self.implementation)}"

        # NOTE: [Out of memory at the kernel boundary]
        return out_of_memory_boundary(compute, call.where, described, OUT_OF_MEMORY_ADVICE, call.outputs1[0].device)

    def publish(
        self, kernel_fn: KernelFn, kind: str, builder: Callable[..., KernelFn], open_blocks: Callable[..., Any],
        where: str, doc: str,
    ) -> KernelFunction:
        """The :class:`KernelFunction` of ``kernel_fn``: its spec (for ``batch``), ``auto_choice`` and ``doc``."""
        options = self.given.as_keywords()
        rebuild = functools.partial(builder, **options)
        spec = KernelFnSpec(
            kind, self.f, self.trace_axes, self.diagonal_axes, rebuild, thread_safe=self.thread_safe,
            open_blocks=open_blocks, options=options,
        )

        def auto_choice(x1: PyTree, x2: Optional[PyTree] = None, params: Any = None, **kwargs: Any) -> AutoChoice:
            key = input_shape_key(x1, x2, params, kwargs)
            # prepared as the NTK call prepares it (its working-set runs among what is priced), so
            # that the cached choice is the same whichever of the two comes first
            return self.choice(self.prepare(x1, x2, params, kwargs, where, shape_key=key, needs_outputs=False), key)

        published = KernelFunction(kernel_fn, spec, doc, auto_choice)
        published._settings = self  # for the memory model's tests and benchmarks (tests/_memory_grid.py)
        return published


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


def _structure_key(f: Model) -> Any:
    """What of the model the derivative check depends on, besides the shapes."""
    return structure_fingerprint(f) if isinstance(f, torch.nn.Module) else id(f)


def input_shape_key(x1: Any, x2: Any, params: Any, kwargs: dict) -> tuple:
    """What AUTO's choice may depend on: the structure, shapes and dtypes of every argument."""
    def describe_leaves(tree: Any) -> tuple:
        flat = Flat.of(tree)
        leaves = tuple(
            (tuple(leaf.shape), leaf.dtype, leaf.device.type) if isinstance(leaf, torch.Tensor) else repr(leaf)
            for leaf in flat.leaves
        )
        return (str(flat.spec), flat.none_positions, leaves)

    return (describe_leaves(x1), is_all_none(x2), describe_leaves(x2), describe_leaves(params), describe_leaves(kwargs))


