"""Validation and preparation shared by every kernel function call.

The front end (``empirical.py``) turns a user call into a :class:`KernelCall`: the model in
functional form, both sides, one :class:`~torchntk._layout.kernel_layout.KernelLayout` per output leaf and the
result dtypes. Implementations only compute; they never validate.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch import nn

from .._layout.kernel_layout import KernelLayout, check_shapes, make_layout
from .._layout.notices import OutputNotices, found_notices
from .._layout.runs import runs
from .._model.functional import (
    FunctionalModel,
    OutputFn,
    functional_model,
    reject_vmap_with_coupling,
    warn_training_mode,
)
from .._plan import CallPlan, CallTemplate
from .._utils.capturing import is_capturing
from .._utils.checks import input_argument, leaves_with_names, show
from .._utils.tree import Flat, describe, is_all_none
from .._utils.types import promoted
from .groups import GroupKernels, ParameterGroups
from .per_example import PlannedOutputs, Side, is_out_of_memory
from .vmap_axes import ParsedVmapAxes, broadcast_axes, resolve_inputs, resolve_outputs, split_kwargs
from .vmap_check import PendingDerivatives, VmapAxesCheck, miscounted_examples


@dataclass(frozen=True)
class OutputShapes:
    """The structure, shapes, dtypes and devices of a call's outputs on x1 and x2 (``second``:
    None when x2 is None).

    NOTE: [Remembered output shapes]
    The implementations of the NTK read the whole-batch outputs only for their shapes, dtypes and
    devices; their values serve the output check of NOTE: [Checking vmap_axes] (and the NNGP).
    Where no output check runs (``check_vmap_axes`` False, or ``"first"`` after the first call per
    input shapes and module structure) and only the NTK is computed, a kernel function remembers
    the outputs' description per input shapes and module structure and later calls stand in for
    the outputs with :meth:`stand_ins`: tensors of the right shapes that own one element each
    (expanded), so the whole-batch forward pass, a sizeable part of a kernel whose backward
    passes stop early (LoRA, BitFit, a head), is not made. Compiled kernels keep the forward pass.
    """

    first: tuple[Flat, tuple]
    second: Optional[tuple[Flat, tuple]]

    @staticmethod
    def stand_ins(described: tuple[Flat, tuple]) -> Flat:
        flat, leaves = described
        return replace(flat, leaves=tuple(
            torch.zeros((), dtype=dtype, device=device).expand(shape) for shape, dtype, device in leaves
        ))


@dataclass(frozen=True)
class KernelCall:
    """Everything an implementation needs for one kernel evaluation.

    Attributes:
        side1, side2: the x1 and x2 sides; ``side2`` is None when x2 is None (x1 is reused).
        outputs1, outputs2: output leaves of the model on x1 and x2 (no autograd graph).
        output_tree: the structure of the model output, to rebuild one kernel per leaf.
        layouts: one layout per output leaf.
        dtypes: the NTK's dtype per output leaf: the promotion of the output and parameter dtypes
            (the NNGP keeps :attr:`output_dtypes`).
        chunk_size: the memory knob (examples per block when mapped, else vectors at once).
        vmap_check: the output check the implementation must still run on its per-example
            outputs against :meth:`expected_outputs` (``VmapAxesCheck.per_example_outputs``),
            or None.
        groups: with parameter groups (NOTE: [Parameter groups] in ``_call/groups.py``), the indices of
            each group's parameters in ``model.params`` (a partition of them); implementations then
            return a tuple of one block per group for every output leaf. None without groups.
        group_names: the groups' names, in the order of ``groups``.
        working_runs: without ``chunk_size``, the examples per run that keep a per-example pass's
            activations within NOTE: [Working-set runs]'s bound (``_kernel/working_set.py``), or None.
        structured_runs: for AUTO, whose calls are prepared before its pick (with ``working_runs``
            for implementation 1), implementation 3's run length where it differs: its pass also
            forms a cotangent per basis vector for every output of an operation that consumes a
            parameter (NOTE: [Working-set runs]). None elsewhere.
        tangents_per_pass: the tangents one forward-mode pass of implementation 2 carries at most,
            where its activations would otherwise exceed that bound, or on the CPU its largest
            activation the fresh-pages bound (``forward_mode_tangents``), or None
            (``TANGENTS_PER_PASS``).
        plan_key: the key of the call's plan (NOTE: [Plan keys] in ``_plan/key.py``), under which
            what the call learns (a switch to the example loop) is kept; None outside a kernel function.
        derivative_check: the derivative check of a key's first call, left to the plan and settled
            before the call goes on (NOTE: [The derivative check within a plan's check]), or None.
        notices: the output notices the call's outputs call for (NOTE: [Output notices]), as
            ``(kind, message)``: a warm call of another kernel function bound to the same plans
            gives them once too.
    """

    where: str
    model: FunctionalModel
    side1: Side
    side2: Optional[Side]
    outputs1: tuple[torch.Tensor, ...]
    outputs2: tuple[torch.Tensor, ...]
    output_tree: Flat
    layouts: tuple[KernelLayout, ...]
    dtypes: tuple[torch.dtype, ...]
    chunk_size: Optional[int]
    vmap_check: Optional[VmapAxesCheck] = None
    groups: Optional[tuple[tuple[int, ...], ...]] = None
    group_names: tuple[str, ...] = ()
    working_runs: Optional[int] = None
    structured_runs: Optional[int] = None
    tangents_per_pass: Optional[int] = None
    plan_key: Any = None
    derivative_check: Optional[PendingDerivatives] = None
    notices: tuple[tuple[str, str], ...] = ()

    @property
    def run_length(self) -> Optional[int]:
        """Examples per run of a per-example pass: the user's ``chunk_size``, else the working-set
        bound of NOTE: [Working-set runs] (None: one pass)."""
        return self.chunk_size if self.chunk_size is not None else self.working_runs

    @property
    def reuses_x1(self) -> bool:
        return self.side2 is None

    @property
    def output_dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(output.dtype for output in self.outputs1)

    def expected_outputs(self, side: Side) -> tuple[torch.Tensor, ...]:
        """The whole-batch outputs of the examples a (narrowed, mapped) side holds."""
        outputs = self.outputs1 if side.name == "x1" or self.side2 is None else self.outputs2
        return tuple(
            output.narrow(axis, side.offset, side.batch_size()) for output, axis in zip(outputs, side.out_axes)
        )

    def output_shapes(self) -> "OutputShapes":
        """What later calls with the same input shapes may stand in for the outputs with (NOTE:
        [Remembered output shapes])."""
        def described(flat: Flat, leaves: tuple) -> tuple:
            return flat, tuple((tuple(leaf.shape), leaf.dtype, leaf.device) for leaf in leaves)

        second = None if self.side2 is None else described(self.output_tree, self.outputs2)
        return OutputShapes(described(self.output_tree, self.outputs1), second)

    def check_outputs(self, side: Side) -> None:
        """The deferred output check of ``side`` (a run of x1 or x2) with a forward pass of its
        own: for implementations whose per-example passes return no outputs, and to explain a
        failure of those that do. Nothing without a pending check."""
        if self.vmap_check is not None and side.mapped:
            self.vmap_check.outputs(side, self.expected_outputs(side), None)

    def narrow(self, run1: tuple[int, int], run2: Optional[tuple[int, int]]) -> "KernelCall":
        """The call restricted to a run ``(start, length)`` of x1 and one of x2 (needs vmap_axes).

        ``run2=None`` pairs the x1 run with itself (x2 None); the result then reuses x1 too.
        """
        side1 = self.side1.narrow(*run1)
        outputs1 = self.expected_outputs(side1)
        if run2 is None:
            return replace(self, side1=side1, side2=None, outputs1=outputs1, outputs2=outputs1)
        side2 = (self.side2 or self.side1).narrow(*run2)
        return replace(self, side1=side1, side2=side2, outputs1=outputs1, outputs2=self.expected_outputs(side2))

    def cache_key(self, key: Any) -> Any:
        """``key`` (a scope's name within its plan key's record, NOTE: [One record per key]) extended
        by what else decides a kept plan or choice under one plan key: which parameters are
        differentiated and their shapes, which may change between calls, and how the examples are
        mapped (a key's first call with ``vmap_axes="auto"`` prices a loop and whole batches alike,
        NOTE: [Loop or whole batches]). None stays None (nothing is kept)."""
        if key is None:
            return None
        # Asked for by every lookup in the key's record, a few per call: the parts that do not depend
        # on ``key`` are made once per call (a changed call is a new object, ``dataclasses.replace``)
        parts = self.__dict__.get("_cache_parts")
        if parts is None:
            parts = (self.model.names, tuple(tuple(param.shape) for param in self.model.params),
                     (self.side1.mapped, self.side1.loop))
            object.__setattr__(self, "_cache_parts", parts)
        return (key, *parts)

    def template(self, outputs: "OutputShapes") -> "KernelCall":
        """This call without its tensors (model, sides, pending check), its outputs replaced by
        stand-ins of ``outputs`` (this call's :meth:`output_shapes`): what a plan keeps for later
        calls with the same key (NOTE: [The planning stage] in ``_plan/plan.py``), which holds on to
        none of this call's inputs or private copies."""
        first = OutputShapes.stand_ins(outputs.first)
        second = first if outputs.second is None else OutputShapes.stand_ins(outputs.second)
        return replace(
            self, model=None, side1=None, side2=None, vmap_check=None, groups=None, output_tree=first,
            outputs1=first.leaves, outputs2=second.leaves, derivative_check=None,
        )

    def looped(self) -> "KernelCall":
        """The same call with its examples mapped by a loop instead of vmap (NOTE: [Example loops])."""
        return replace(
            self, side1=self.side1.looped(), side2=None if self.side2 is None else self.side2.looped()
        )

    def kernel_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(
            layout.kernel_shape(one.shape, two.shape)
            for layout, one, two in zip(self.layouts, self.outputs1, self.outputs2)
        )

    def kernels_of(self, name: str) -> int:
        """How many kernel tensors the result holds per output leaf for the kernel ``name``
        (``"ntk"`` or ``"nngp"``): one per group for a grouped NTK, else one."""
        return len(self.groups) if name == "ntk" and self.groups is not None else 1

    def normalise(self, kernels: list[Any], dtypes: Optional[tuple[torch.dtype, ...]] = None) -> Any:
        """Divides by traced sizes, casts to the result dtypes and rebuilds the output tree.

        An entry that is a tuple (one block per parameter group) becomes a :class:`GroupKernels`.
        """
        results = []
        for kernel, layout, output, dtype in zip(kernels, self.layouts, self.outputs1, dtypes or self.dtypes):
            size = layout.trace_size(output.shape)
            if isinstance(kernel, tuple):
                results.append(GroupKernels(
                    (name, _normalised(block, size, dtype)) for name, block in zip(self.group_names, kernel)
                ))
            else:
                results.append(_normalised(kernel, size, dtype))
        return self.output_tree.rebuild(results)


def _normalised(kernel: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """``kernel / size`` in ``dtype``, contiguous. The implementations' kernels are fresh tensors of
    the call, so one already in ``dtype`` and contiguous is divided in place: a kernel close to the
    memory budget then needs no second copy (NOTE: [Memory plans]). Not while a call is captured
    into a graph, which keeps its operations functional."""
    if kernel.dtype == dtype and kernel.is_contiguous() and not is_capturing() and kernel._base is None:
        return kernel if size == 1 else kernel.div_(size)
    return (kernel / size).to(dtype).contiguous()


FULL_CHECKS = CallPlan(check_outputs=True, check_derivatives=True, check_aliases=True, example_loop=False)
"""The plan of a call prepared on its own, outside a kernel function's planning stage: every check."""

NO_CHECKS = CallPlan(check_outputs=False, check_derivatives=False, check_aliases=True, example_loop=False)
"""The same without the ``vmap_axes`` checks (``check_vmap_axes=False``)."""


@dataclass(frozen=True)
class CallSpec:
    """What one kernel function asks of every call it prepares, validated by its builder.

    Attributes:
        trace_axes, diagonal_axes: the kernel layout (NOTE: [Kernel layout]).
        vmap_axes: the axes that map the examples, or None (whole batches).
        chunk_size: the memory knob (examples per block when mapped, else vectors at once).
        output_fn: what the kernel is taken of, from
            :func:`~torchntk._call.outputs.output_fn_argument` (NOTE: [Selected outputs]).
        groups: split the NTK by parameter groups (NOTE: [Parameter groups]); only the grouped
            parameters are differentiated.
        notices: the kernel function's notices about its outputs (NOTE: [Output notices]), given
            once the layouts and the examples' axes of the outputs are known; None gives none.
        finds_axes: ``vmap_axes="auto"``: the kernel function finds the axes per key (NOTE: [Found
            vmap_axes]); a call is prepared with the axes found (``vmap_axes``), never with this.
    """

    trace_axes: tuple[int, ...] = (-1,)
    diagonal_axes: tuple[int, ...] = ()
    vmap_axes: Optional[ParsedVmapAxes] = None
    chunk_size: Optional[int] = None
    output_fn: Optional[OutputFn] = None
    groups: Optional[ParameterGroups] = None
    notices: Optional[OutputNotices] = None
    finds_axes: bool = False


def prepare_call(
    f: Any,
    x1: Any,
    x2: Any,
    params: Any,
    kwargs: Mapping[str, Any],
    spec: CallSpec,
    *,
    where: str,
    admit: Optional[Admit] = None,
    plan: CallPlan = FULL_CHECKS,
    computes_ntk: Optional[bool] = None,
    forward_run_length: Optional[int] = None,
) -> KernelCall:
    """Validates a kernel call and evaluates the model once on each side, as ``plan`` says.

    ``x1`` and ``x2`` are pytrees of tensors; numpy arrays are rejected, not converted (see
    :func:`~torchntk._utils.checks.input_argument`). ``plan`` (NOTE: [The planning stage] in
    ``_plan/plan.py``; every check by default) decides which checks of NOTE: [Checking vmap_axes]
    run here: the output check (``check_outputs``; left to the implementation's own per-example
    pass, ``KernelCall.vmap_check``, with ``outputs_in_kernel``), the derivative check on the probe
    (``check_derivatives``), and whether the examples are mapped by a loop instead of vmap
    (``example_loop``, NOTE: [Example loops]) and the whole-batch forward pass is replaced by the
    remembered outputs' stand-ins (``outputs``, NOTE: [Remembered output shapes]).
    ``computes_ntk``: whether the NTK will be computed, which rejects complex parameters and
    outputs; ``None`` means "when ``vmap_axes`` is given" (the NTK front ends always pass one, the
    NNGP never does). ``forward_run_length``: with ``vmap_axes`` mapping the inputs, evaluate the
    model (and the per-example check) on runs of at most this many examples, so that memory never
    scales with the whole batch (``batch`` sets it to its block size). ``spec``: the layout, axes,
    outputs, groups and notices of the kernel function (:class:`CallSpec`). ``admit(kernel_shapes, dtypes, device)``: called with
    the NTK's shapes and dtypes before the model runs on more than one example when a side has over
    ``EARLY_ADMISSION`` examples mapped by ``vmap_axes`` (the shapes then come from one example
    per side), so that a kernel too large for its memory is refused before the forward passes over
    the whole batch (NOTE: [Memory plans]); it raises to refuse.

    Raises:
        TypeError: outputs that are not tensors; bad ``params``; numpy inputs; for the NTK,
            complex parameters or outputs; a ``groups`` predicate returning no bool.
        ValueError: output structures or ndims that differ between x1 and x2, bad axes, traced
            or diagonal sizes that differ, ``vmap_axes`` that do not fit the data or the model
            (NOTE: [Checking vmap_axes] lists the causes told apart), a model that vmap cannot
            evaluate per example (data-dependent shapes or control flow), an empty parameter group.
    """
    input_argument(x1, "x1", where, required=True)
    input_argument(x2, "x2", where)
    trace_axes, diagonal_axes, vmap_axes, chunk_size = spec.trace_axes, spec.diagonal_axes, spec.vmap_axes, spec.chunk_size
    output_fn, groups, notices = spec.output_fn, spec.groups, spec.notices
    computes_ntk = vmap_axes is not None if computes_ntk is None else computes_ntk
    example_loop, known_outputs, check_derivatives = plan.example_loop, plan.outputs, plan.check_derivatives
    evaluated = f if computes_ntk else without_trainable_parameters(f, params)
    model = functional_model(evaluated, params, where, output_fn, lazy=True)  # dies with the call
    index_groups = None
    if groups is not None:
        model, index_groups = groups.split(model, f if isinstance(f, torch.nn.Module) else None, where)
    warn_training_mode(model, where)
    if computes_ntk:
        _reject_complex_parameters(model, where)
    reuse = is_all_none(x2)
    kwargs1, kwargs2 = split_kwargs(kwargs, x2_is_none=reuse, where=where)
    resolved1 = resolved2 = None
    if vmap_axes is not None:
        resolved1 = resolve_inputs(vmap_axes, x1, kwargs1, where)
        resolved2 = resolved1 if reuse else resolve_inputs(vmap_axes, x2, kwargs2, where)
        if (resolved1 is None) != (resolved2 is None):
            raise ValueError(f"{where}: `vmap_axes` maps the inputs of only one of x1 and x2.")
    run_length = forward_run_length if resolved1 is not None else None
    if known_outputs is not None and (known_outputs.second is None) == reuse:
        output1 = known_outputs.stand_ins(known_outputs.first)
        output2 = output1 if reuse else known_outputs.stand_ins(known_outputs.second)
    else:
        if admit is not None and resolved1 is not None:
            _admit_early(model, (x1, kwargs1, resolved1), None if reuse else (x2, kwargs2, resolved2), vmap_axes,
                         trace_axes, diagonal_axes, where, admit)
        with torch.no_grad():
            with model_failures(model, x1, "x1", where):
                output1 = _whole_batch(model, x1, kwargs1, resolved1, vmap_axes, run_length, where)
            with model_failures(model, x2, "x2", where, worked=x1):
                output2 = output1 if reuse else _whole_batch(model, x2, kwargs2, resolved2, vmap_axes, run_length, where)
    if resolved1 is not None and not reuse:
        _reject_miscounted_inputs(
            vmap_axes, (("x1", x1, kwargs1, resolved1), ("x2", x2, kwargs2, resolved2)), (output1, output2), where
        )
    _check_outputs(output1, output2, where)
    leaves1, leaves2 = output1.leaves, output2.leaves
    if computes_ntk:
        _reject_complex_outputs(leaves1, leaves2, where)
    layouts = []
    for index, (one, two) in enumerate(zip(leaves1, leaves2)):
        leaf = "the output" if len(leaves1) == 1 else f"output leaf {index} of {len(leaves1)}"
        layout = make_layout(one.ndim, trace_axes, diagonal_axes, where, leaf)
        check_shapes(layout, one.shape, two.shape, where, leaf)
        layouts.append(layout)

    out_axes = None
    if resolved1 is not None:
        out_axes = resolve_outputs(vmap_axes, output1.rebuild(leaves1), where)
        reject_vmap_with_coupling(model, where)
    found = ()
    if notices is not None:
        found = found_notices(output1, layouts, out_axes, x1, trace_axes, output_fn is not None, where)
        notices.give(found)
    side1 = Side.build(model, x1, kwargs1, resolved1, out_axes, where, "x1", example_loop)
    side2 = None if reuse else Side.build(model, x2, kwargs2, resolved2, out_axes, where, "x2", example_loop)
    pending = derivatives = None
    if side1.mapped and plan.check_outputs:
        check = VmapAxesCheck(model, vmap_axes, where)
        sides = [(side, leaves) for side, leaves in ((side1, leaves1), (side2, leaves2)) if side is not None]
        for side, leaves in sides:
            check.finite_outputs(side, leaves)
        if plan.outputs_in_kernel:
            # A call whose shapes passed the checks before: no failure to diagnose is expected, and
            # the implementation's own pass gives the per-example outputs for free.
            pending = check
        else:
            for side, leaves in sides:
                check.outputs(side, leaves, run_length)
        if check_derivatives:
            derivatives = PendingDerivatives(check, side1, side2)
            if not plan.derivatives_deferred:
                derivatives.settle()
                derivatives = None

    param_dtype = model.param_dtype
    dtypes = tuple(promoted((leaf.dtype, param_dtype)) for leaf in leaves1)
    return KernelCall(
        where, model, side1, side2, leaves1, leaves2, output1, tuple(layouts), dtypes, chunk_size, pending,
        index_groups, groups.names if groups is not None else (), derivative_check=derivatives, notices=found,
    )


def bind_call(
    kept: CallTemplate, f: Any, x1: Any, x2: Any, params: Any, kwargs: Mapping[str, Any], *,
    output_fn: Optional[OutputFn], groups: Optional[ParameterGroups], loop: bool, forget: Callable[[], None],
) -> Optional[KernelCall]:
    """A warm call: the template an earlier call with the same plan key left in its plan (``kept``,
    NOTE: [The planning stage]) with this call's model and inputs. Everything the key decides
    (axes, layouts, output shapes, dtypes, the checks that passed) is taken from the template; what
    values decide is done again: the model's private copies, the parameters differentiated (None
    when they are not ``kept.names`` any more: the caller prepares the call in full), the groups,
    the keyword arguments split between x1 and x2 (whose halves must be equal when x2 is None).
    The sides compare the model's outputs with the template's, and call ``forget`` (which drops the
    key's plans) before they raise where those differ (NOTE: [Outputs that outgrow their plan])."""
    template, names, axes1, axes2, out_axes = kept.call, kept.names, kept.axes1, kept.axes2, kept.out_axes
    where = template.where
    model = functional_model(f, params, where, output_fn, lazy=True, survey=kept.survey)  # dies with the call
    index_groups = None
    if groups is not None:
        model, index_groups = groups.split(model, f if isinstance(f, nn.Module) else None, where)
    if model.names != names:
        return None
    kwargs1, kwargs2 = split_kwargs(kwargs, x2_is_none=axes2 is None, where=where)
    planned1 = PlannedOutputs.of(template.output_tree, template.outputs1, out_axes, forget)
    side1 = Side(model, Flat.of(x1), {key: Flat.of(value) for key, value in kwargs1.items()}, *axes1, out_axes,
                 where, "x1", loop=loop, planned=planned1)
    side2 = None
    if axes2 is not None:
        planned2 = PlannedOutputs.of(template.output_tree, template.outputs2, out_axes, forget)
        side2 = Side(model, Flat.of(x2), {key: Flat.of(value) for key, value in kwargs2.items()}, *axes2, out_axes,
                     where, "x2", loop=loop, planned=planned2)
    return replace(template, model=model, side1=side1, side2=side2, groups=index_groups)


Admit = Callable[[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...], torch.device, tuple[int, int]], None]
"""``admit(kernel shapes, dtypes, device, (N1, N2))``: raises to refuse the kernel (NOTE: [Memory plans])."""

EARLY_ADMISSION = 1024
"""Examples on a side above which a call's NTK is admitted from one example's outputs, before the
forward passes over the whole batch (which took 2.5 s for 20,000 examples of the benchmark MLP)."""


def _admit_early(model, first: tuple, second: Optional[tuple], vmap_axes, trace_axes, diagonal_axes, where: str,
                 admit: Admit) -> None:
    """``admit`` with the kernel shapes from one example of each side (see :func:`prepare_call`).
    Anything unusual (a model failing on one example, shapes that do not fit) is left to the full
    validation, which says what is wrong."""
    sides = [first] + ([second] if second is not None else [])
    sizes = [_examples(x, kwargs, resolved) for x, kwargs, resolved in sides]
    if max(sizes) <= EARLY_ADMISSION or min(sizes) == 0:
        return
    try:
        outputs = []
        for (x, kwargs, resolved), size in zip(sides, sizes):
            run = Side.build(model, x, kwargs, resolved, (), where, "x").narrow(0, 1)
            run_kwargs = {key: flat.rebuild(flat.leaves) for key, flat in run.kwargs.items()}
            with torch.no_grad():
                outputs.append(Flat.of(model.apply(model.params, run.x.rebuild(run.x.leaves), run_kwargs)))
        out_axes = resolve_outputs(vmap_axes, outputs[0].rebuild(outputs[0].leaves), where)
        shapes, dtypes = [], []
        for index, (one, axis) in enumerate(zip(outputs[0].leaves, out_axes)):
            two = outputs[-1].leaves[index]
            whole1 = one.shape[:axis] + (sizes[0],) + one.shape[axis + 1:]
            whole2 = two.shape[:axis] + (sizes[-1],) + two.shape[axis + 1:]
            layout = make_layout(one.ndim, trace_axes, diagonal_axes, where, "the output")
            shapes.append(layout.kernel_shape(whole1, whole2))
            dtypes.append(torch.promote_types(one.dtype, model.param_dtype))
    except Exception:  # noqa: BLE001 - the full validation explains it
        return
    admit(tuple(shapes), tuple(dtypes), outputs[0].leaves[0].device, (sizes[0], sizes[-1]))


def _examples(x: Any, kwargs: Mapping[str, Any], resolved) -> int:
    """The examples ``vmap_axes`` (``resolved``) maps in ``x`` and ``kwargs`` (0 if none)."""
    for leaf, axis in zip(Flat.of(x).leaves, resolved.x_axes):
        if axis is not None:
            return leaf.shape[axis]
    for key, axes in (resolved.kwarg_axes or {}).items():
        for leaf, axis in zip(Flat.of(kwargs[key]).leaves, axes):
            if axis is not None:
                return leaf.shape[axis]
    return 0


def _whole_batch(model, x, kwargs, resolved, vmap_axes, run_length: Optional[int], where: str) -> Flat:
    """The model's output on a whole batch; with a run length, by runs concatenated on the batch axes."""
    if run_length is None or _examples(x, kwargs, resolved) <= run_length:
        return Flat.of(model.apply(model.params, x, kwargs))
    side = Side.build(model, x, kwargs, resolved, (), where, "x")
    parts = []
    for start, length in runs(side.batch_size(), run_length):
        run = side.narrow(start, length)
        run_kwargs = {key: flat.rebuild(flat.leaves) for key, flat in run.kwargs.items()}
        parts.append(Flat.of(model.apply(model.params, run.x.rebuild(run.x.leaves), run_kwargs)))
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    if any(not part.same_structure(first) for part in parts):
        raise ValueError(f"{where}: the model returns differently structured outputs for different examples.")
    out_axes = resolve_outputs(vmap_axes, first.rebuild(first.leaves), where)
    leaves = [torch.cat([part.leaves[index] for part in parts], dim=axis) for index, axis in enumerate(out_axes)]
    return Flat.of(first.rebuild(leaves))


def _reject_miscounted_inputs(vmap_axes: ParsedVmapAxes, sides: tuple, outputs: tuple[Flat, Flat], where: str) -> None:
    """Raises ValueError when, with ``vmap_axes`` mapping both inputs, an output leaf has another
    number of axes for x1 than for x2 and one side's leaf does not hold that side's examples on its
    out axis (a 1-D input whose entries became examples): the input is named with the message the
    per-example check gives x1 alone, not the generic one about output axes. ``sides``: ``(name,
    x, kwargs, resolved axes)`` of x1 and x2."""
    output1, output2 = outputs
    if not output1.same_structure(output2):
        return
    for index, pair in enumerate(zip(output1.leaves, output2.leaves)):
        if not all(isinstance(leaf, torch.Tensor) for leaf in pair) or pair[0].ndim == pair[1].ndim:
            continue
        for (name, x, kwargs, resolved), output, leaf, (other_name, other) in zip(
            sides, outputs, pair, (("x2", pair[1]), ("x1", pair[0]))
        ):
            axis = _out_axis(vmap_axes, output, index, where)
            if axis is None:
                continue
            message = miscounted_examples(
                name, x, resolved.x_axes, _examples(x, kwargs, resolved), index, leaf, axis, where,
                f"while on {other_name} it has shape {tuple(other.shape)}",
            )
            if message is not None:
                raise ValueError(message)


def _out_axis(vmap_axes: ParsedVmapAxes, output: Flat, index: int, where: str) -> Optional[int]:
    """The out axis ``vmap_axes`` gives output leaf ``index``; an int given for a leaf with too few
    axes is that int (the leaf then misses the examples), a tree that does not fit is None (the
    generic checks explain it)."""
    try:
        return broadcast_axes(vmap_axes.out_axes, output.rebuild(output.leaves), "vmap_axes (out_axes)", where)[index]
    except ValueError:
        return int(vmap_axes.out_axes) if isinstance(vmap_axes.out_axes, int) else None


def _check_outputs(output1: Flat, output2: Flat, where: str) -> None:
    for flat in (output1, output2):
        for leaf in flat.leaves:
            if not isinstance(leaf, torch.Tensor):
                raise TypeError(
                    f"{where}: the model must return tensors (or pytrees of tensors), got a leaf {show(leaf)}."
                )
    if not output1.leaves:
        raise ValueError(
            f"{where}: the model returned no floating-point or complex tensor (integer and boolean outputs "
            f"get no kernel; see NOTE: [Integer outputs] in _model/functional.py)."
        )
    if not output1.same_structure(output2):
        raise ValueError(
            f"{where}: the model returns differently structured outputs for x1 and x2: "
            f"{describe(output1.rebuild(output1.leaves))} vs {describe(output2.rebuild(output2.leaves))}."
        )
    for index, (one, two) in enumerate(zip(output1.leaves, output2.leaves)):
        if one.ndim != two.ndim:
            raise ValueError(
                f"{where}: output leaf {index} has shape {tuple(one.shape)} for x1 but "
                f"{tuple(two.shape)} for x2; the outputs must have the same number of axes."
            )


def _reject_complex_parameters(model: FunctionalModel, where: str) -> None:
    for name, param in zip(model.names, model.params):
        if param.is_complex():
            raise TypeError(
                f"{where}: parameter {name!r} is complex ({param.dtype}); the NTK is defined here for real "
                f"parameters only. Store it as a real tensor, torch.view_as_real(...) (real and imaginary "
                f"parts on a last axis of size 2), and rebuild it in the model with torch.view_as_complex."
            )


def _reject_complex_outputs(leaves1: tuple, leaves2: tuple, where: str) -> None:
    for name, leaves in (("x1", leaves1), ("x2", leaves2)):
        for index, leaf in enumerate(leaves):
            if leaf.is_complex():
                raise TypeError(
                    f"{where}: output leaf {index} of {len(leaves)} for {name} is complex ({leaf.dtype}); the NTK "
                    f"needs real outputs. Return torch.view_as_real(output) (real and imaginary parts on a new "
                    f"last axis) instead; the NNGP (empirical_nngp_fn) accepts complex outputs."
                )


# NOTE: [NNGP without parameters]
# The NNGP takes no derivative, so a module without any trainable parameter (nn.Tanh(), a frozen
# feature extractor) still has one. Functional models refuse such modules ("nothing to
# differentiate"), so for the NNGP alone the module is evaluated through a holder that owns one
# unused scalar parameter: the module's own parameters stay constants, its buffers and state are
# still private copies (NOTE: [Modules are never mutated]). The NTK of such a module stays refused.


class _ParameterFree(nn.Module):
    """``module`` with one unused trainable scalar, so that it has something to differentiate."""

    def __init__(self, module: nn.Module, like: Optional[torch.Tensor]):
        super().__init__()
        self.module = module
        dtype = like.dtype if like is not None else torch.get_default_dtype()
        device = like.device if like is not None else None
        self.unused = nn.Parameter(torch.zeros((), dtype=dtype, device=device))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def without_trainable_parameters(f: Any, params: Any) -> Any:
    """``f``, or for a module with no trainable parameter and ``params=None``, the holder of NOTE:
    [NNGP without parameters] (for kernels that take no derivative)."""
    if not isinstance(f, nn.Module) or params is not None or any(p.requires_grad for p in f.parameters()):
        return f
    floating = [t for t in (*f.parameters(), *f.buffers()) if t.is_floating_point()]
    return _ParameterFree(f, floating[0] if floating else None)


class ModelInputError(ValueError, RuntimeError):
    """The model raised on ``x1`` or ``x2``: a ValueError that names the input, still the
    RuntimeError PyTorch raised for whoever catches that (``original``)."""


class ModelInputDtypeError(TypeError, RuntimeError):
    """The model raised on an input whose floating dtype differs from its parameters'."""


@contextlib.contextmanager
def model_failures(model: FunctionalModel, x: Any, name: str, where: str, worked: Any = None) -> Iterator[None]:
    """Names the input when the model raises on it (the first evaluation of ``x1`` or ``x2``).

    PyTorch's messages (``mat1 and mat2 shapes cannot be multiplied``, ``expected scalar type
    Float``) do not say which input is wrong; the explanation gives its name, shapes and dtypes,
    the parameters' dtype, ``worked`` (x1, when x2 fails) and PyTorch's text last. Only the plain
    RuntimeError and TypeError of the model's operations are explained; running out of memory and
    torchntk's own errors pass unchanged.

    Raises:
        ModelInputDtypeError: a floating input leaf whose dtype is none of the parameters'.
        ModelInputError: any other RuntimeError.
        TypeError: a TypeError of the model (e.g. a pytree where a tensor was expected).
    """
    try:
        yield
    except (RuntimeError, TypeError) as error:
        if type(error) not in (RuntimeError, TypeError) or is_out_of_memory(error):
            raise
        leaves = leaves_with_names(x, name)
        param_dtypes = sorted({str(p.dtype) for p in model.params if p.is_floating_point()})
        params_text = " or ".join(param_dtypes) or "not floating-point"
        mismatched = [
            (leaf_name, leaf) for leaf_name, leaf in leaves
            if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and param_dtypes
            and str(leaf.dtype) not in param_dtypes
        ]
        if mismatched and isinstance(error, RuntimeError):
            leaf_name, leaf = mismatched[0]
            raise ModelInputDtypeError(
                f"{where}: the model failed on `{name}`: {leaf_name} has dtype {leaf.dtype} (shape "
                f"{tuple(leaf.shape)}) but the model's parameters are {params_text}. Convert the input with "
                f"{name}.to({param_dtypes[0]}) (or the model to {leaf.dtype}). PyTorch said: {error}"
            ) from error
        other = ""
        if worked is not None:
            other = f" (x1, {_describe_input(worked, 'x1')}, worked)"
        text = (
            f"{where}: the model failed on `{name}`, {_describe_input(x, name)}{other}; the model's parameters are "
            f"{params_text}. Check that `{name}` is laid out as the model expects (the examples on the batch "
            f"axis, then the sizes its layers were built for). PyTorch said: {error}"
        )
        if isinstance(error, TypeError):
            raise TypeError(text) from error
        raise ModelInputError(text) from error


def _describe_input(x: Any, name: str) -> str:
    """``of shape (4, 6) and dtype torch.float32``, or the same per tensor leaf of a pytree."""
    leaves = [(leaf_name, leaf) for leaf_name, leaf in leaves_with_names(x, name) if isinstance(leaf, torch.Tensor)]
    if isinstance(x, torch.Tensor):
        return f"of shape {tuple(x.shape)} and dtype {x.dtype}"
    parts = [f"{leaf_name} of shape {tuple(leaf.shape)} and dtype {leaf.dtype}" for leaf_name, leaf in leaves[:4]]
    more = f" and {len(leaves) - 4} more tensors" if len(leaves) > 4 else ""
    return f"with {', '.join(parts)}{more}" if parts else f"which is {show(x)}"
