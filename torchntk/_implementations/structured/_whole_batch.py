"""Whether a plan's passes run over the whole batch: decided and checked once, when the plan is made.

NOTE: [Whole-batch pullback] (``_side.py``) says what the whole-batch pass computes and why its
layout needs a check; this module makes that check. With ``vmap_axes`` and a plan probed on one
example, the whole-batch pass over a few examples of the call (at most :data:`CHECK_EXAMPLES`, at
least two) finds the axis of every perturbed op's output that holds the examples (where it is not
the one a single example's shapes suggest, a recording pass finds it, unless the pass showed an
output shared by every example: NOTE: [The layout read from the check's own pass]); then the
whole-batch pass and the per-example pass of those examples, with one random cotangent, must agree
on every use's ``G`` and every operand, example by example, within a tolerance far below what a
wrong reading gives (another example's values). Comparing ``J^T v`` summed over the examples would
not do: a reading that permutes the examples consistently leaves that sum unchanged. Cotangents
differ between examples, so ``G`` tells examples apart even where the inputs do not.

A plan whose check fails, or that cannot be checked (fewer than two examples of one per-example
shape, examples mapped by a loop, a plan probed on every example, dense local Jacobians), keeps the
per-example pass, and :attr:`~._plan.Plan.whole_batch_reason` says why. The check costs one
whole-batch and one per-example backward pass of those few examples (and a recording pass where
the examples are elsewhere than one example's shapes suggest), once per plan (that is, per input
shapes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from ..._call.kernel_call import KernelCall
from ..._call.per_example import Side, is_out_of_memory
from ..._utils.precision import requested_mode
from ._plan import Fold, Plan, WholeBatchLayout
from ._recorder import Recorder, ShapeMismatch
from ._roles import Role
from ._side import (
    PlanMismatch,
    SideFactors,
    WholeBatchPass,
    example_signature,
    examples_first,
    find_fold,
    per_example_factors,
    read_per_example,
    recorder_unfuses,
    under_a_transform,
    whole_batch_context,
    whole_batch_pass,
    whole_shape,
)

CHECK = True
"""Whether the whole-batch pass is checked against the per-example pass when a plan is made. Only
a test switches it off, to show what the check catches."""

CHECK_EXAMPLES = 3
"""Examples the check runs on (fewer when the call has fewer)."""

_SEED = 0

_RTOL = {torch.float64: 1e-10, torch.float32: 1e-4}
"""Of the largest entry of a tensor: both passes compute the same products, batched otherwise, so
they differ by rounding only; a wrong reading gives other examples' values, of the order of 1."""
_LOW_PRECISION_RTOL = 5e-2
_REDUCED_FLOAT32_RTOL = 2e-2
"""Float32 products in TF32 or bfloat16 (CUDA's TF32 flags, ``torchntk.precision``)."""


@dataclass(frozen=True)
class LayoutShapes:
    """What shapes tell of a plan's whole-batch pass over the check's examples: the axis of each
    perturbed rule call's output that holds the examples, or why the pass cannot run over the
    whole batch. AUTO prices 3 from it before it pays for the plan's check
    (``StructuredDerivatives.layout_reason``), and the check then reuses it, with the pass that
    found it (NOTE: [The layout read from the check's own pass]).

    Attributes:
        perturbed_shapes, fallback: those of the plan it was found for (it holds for no other:
            the pass is read by what the plan perturbs and foresees).
        output_axes: ``{position: axis}``, or None where ``reason`` says why not.
        reason: why the passes cannot run over the whole batch, or None.
        done: the whole-batch pass of :func:`check_sample`'s examples and cotangents that found
            the axes, for the check to use (None where a recording pass found them).
    """

    perturbed_shapes: Optional[dict]
    fallback: Any
    output_axes: Optional[dict[int, int]]
    reason: Optional[str]
    done: Optional[WholeBatchPass] = field(default=None, compare=False, repr=False)

    def holds_for(self, plan: Plan) -> bool:
        return self.perturbed_shapes == plan.perturbed_shapes and self.fallback == plan.fallback

    def pass_for(self, plan: Plan, parameters: bool) -> Optional[WholeBatchPass]:
        """The pass that found the shapes, where it serves ``plan`` (with autograd's products when
        ``parameters``)."""
        done = self.done if self.holds_for(plan) else None
        return None if done is None or (parameters and done.parameter_products is None) else done


def layout_shapes(call: KernelCall, plan: Plan) -> LayoutShapes:
    """:class:`LayoutShapes` of ``plan`` (a quick plan, checked or not) on ``call``, from a
    recording pass over the check's examples."""
    sample = check_sample(call)
    refused = _refused(call, plan, sample)
    if refused is not None:
        return refused
    return LayoutShapes(plan.perturbed_shapes, plan.fallback, *_output_axes(sample[0], plan))


def _refused(call: KernelCall, plan: Plan, sample: Optional[tuple]) -> Optional[LayoutShapes]:
    """The :class:`LayoutShapes` of a ``call`` and ``plan`` whose passes cannot run over the whole
    batch whatever the model's shapes (``sample``: its :func:`check_sample`); None where the
    shapes decide."""
    def refused(reason: str) -> LayoutShapes:
        return LayoutShapes(plan.perturbed_shapes, plan.fallback, None, reason)

    side = call.side1
    if not side.mapped:
        return refused("without vmap_axes the pass is over the whole batch already")
    if side.loop:
        return refused("the examples are mapped by a loop")
    if plan.local_jacobian is not None:
        return refused("dense local Jacobians (closed_form_rules=False) are computed per example")
    if plan.perturbed_shapes is None or plan.first_example_calls is None:
        return refused("the plan comes from probes of every example (the model's operations depend on the data)")
    if not plan.perturbed_shapes:
        return refused("no rule call contributes")
    if sample is None:
        return refused("fewer than two examples of one per-example shape to check the whole-batch pass on")
    return None


# NOTE: [The layout read from the check's own pass]
# The whole-batch pass of the check's examples needs the axis of every perturbed rule call's output
# that holds the examples before it starts (its perturbations are inputs of the VJP), and a
# recording pass over the same examples used to find them. One example's pass runs as a batch of
# one, so its outputs nearly always keep that batch axis with size 1: the first axis (batch-first
# activations) or another (a recurrence's input projection over all steps, time-major inside an
# LSTM). So the pass is first tried with the examples on the first axis of size 1 of each output's
# per-example shape (the first axis where none has size 1): the recorder refuses it
# (``ShapeMismatch``) at the first rule call whose output has another shape or dtype, and an
# operation the plan did not foresee ends it too (``whole_batch_pass`` returns None). A pass that
# completes had every perturbed output shaped as ``whole_shape(one example's, axis, examples)``,
# which the recording pass reads (``find_fold``) as that same axis; guesses the reading would not
# confirm (an empty axis, a scalar output) are not tried. So the guess decides exactly what the
# recording pass would. Where the pass stops at a rule call whose output over the examples has one
# example's shape (a position embedding of Hugging Face transformers: one row for every example),
# the recording pass would read that output as shared by every example (``find_fold``) and refuse
# the layout for the same reason, the calls before it being shaped as the guess; so that reason
# decides, and no recording pass runs (which would name another reason only where the whole batch
# also makes other rule calls or consumes the parameters otherwise: whole batches are ruled out
# either way). The recording pass runs only where the guess fails otherwise (a model that moves the
# examples to an axis whose per-example size is not 1, or makes other rule calls over the whole
# batch), to find the axes or the reason. The pass found is then the check's own (``sample_pass``
# with autograd's products, ``_layout`` without; AUTO's ``layout_reason`` keeps it for them): one
# pass of the model fewer on a first call. The values are still checked against the per-example pass
# (``_readings``, ``_compare``), as for axes a recording pass found.


def found_layout(
    call: KernelCall, plan: Plan, parameters: bool, sample: Optional[tuple[Side, tuple[torch.Tensor, ...]]] = None,
) -> LayoutShapes:
    """:class:`LayoutShapes` of ``plan`` on ``call``, with the whole-batch pass of the check's
    examples and cotangents (``sample``, :func:`check_sample`'s) that found them where the axes
    one example's shapes suggest hold the examples (with autograd's products when
    ``parameters``), or the reason where that pass stops at an output shared by every example,
    else from a recording pass (NOTE: [The layout read from the check's own pass])."""
    sample = sample or check_sample(call)
    refused = _refused(call, plan, sample)
    if refused is not None:
        return refused
    guessed = _guessed(plan, sample, parameters)
    return guessed if guessed is not None else layout_shapes(call, plan)


def _guessed(plan: Plan, sample: tuple[Side, tuple[torch.Tensor, ...]], parameters: bool) -> Optional[LayoutShapes]:
    """The whole-batch pass of the check's examples and cotangents (``sample``) with the examples
    of every perturbed output on the axis one example's pass gives size 1 (the first, where none
    does), and the :class:`LayoutShapes` it shows; None where it does not fit (NOTE: [The layout
    read from the check's own pass])."""
    examples, cotangents = sample
    count = examples.batch_size()
    axes = {position: next((axis for axis, size in enumerate(shape) if size == 1), 0)
            for position, (shape, _) in plan.perturbed_shapes.items()}
    if any(not shape or find_fold(whole_shape(shape, axes[position], count), shape, count) != Fold(axes[position])
           for position, (shape, _) in plan.perturbed_shapes.items()):
        return None  # a scalar or an empty axis: no reading the recording pass would confirm
    try:
        done = _pass_or_none(examples, plan, axes, cotangents, parameters, raise_mismatch=True)
    except ShapeMismatch as mismatch:
        if len(mismatch.args) != 3:
            return None  # the pass made other rule calls: the recording pass says which
        position, shape, _ = mismatch.args
        single = plan.perturbed_shapes[position][0]
        if shape != single:
            return None  # the examples lie elsewhere: the recording pass finds where
        # the same output for every example: the recording pass's reading (find_fold) refuses it
        return LayoutShapes(plan.perturbed_shapes, plan.fallback, None, _not_on_one_axis(position, shape, single, count))
    return None if done is None else LayoutShapes(plan.perturbed_shapes, plan.fallback, axes, None, done)


def _pass_or_none(
    examples: Side, plan: Plan, axes: dict[int, int], cotangents: tuple[torch.Tensor, ...], parameters: bool,
    raise_mismatch: bool = False,
) -> Optional[WholeBatchPass]:
    """:func:`whole_batch_pass`, None where it fails for the model's sake (running out of memory
    is raised, and with ``raise_mismatch`` the recorder's :class:`ShapeMismatch`)."""
    try:
        return whole_batch_pass(examples, plan, axes, cotangents, parameters=parameters, raise_mismatch=raise_mismatch)
    except RuntimeError as error:  # the pass returns None itself where it does not fit the plan
        if is_out_of_memory(error):
            raise
        return None


def with_whole_batch(
    call: KernelCall, plan: Plan, checked: Optional[Plan] = None, single: Optional[SideFactors] = None,
    shapes: Optional[LayoutShapes] = None, done: Optional[WholeBatchPass] = None,
) -> Plan:
    """``plan`` with its :attr:`~._plan.Plan.whole_batch` layout when the whole-batch pass is checked
    to agree with the per-example pass on ``call``'s examples, else with the reason it is not.

    Args:
        call: the call the plan is made for (its first examples are checked).
        plan: the plan, checked against autograd already.
        checked: the plan as the call's passes state their roles (parameter groups split joint
            roles), when it differs from ``plan``.
        single: the per-example factors of :func:`check_sample`'s examples and cotangents under the
            plan checked, where the check against autograd made them already.
        shapes: :func:`layout_shapes` found already (used where they hold for this plan).
        done: the whole-batch pass of :func:`check_sample`'s examples and cotangents under the plan
            checked, where the check against autograd made it already (:func:`sample_pass`).
    """
    layout, reason = _layout(call, checked or plan, single, shapes, done, found=checked is None)
    return dataclasses.replace(plan, whole_batch=layout, whole_batch_reason=reason)


def check_sample(call: KernelCall) -> Optional[tuple[Side, tuple[torch.Tensor, ...]]]:
    """The examples the whole-batch check runs on and its random cotangents, laid out like their
    outputs; None where the check cannot run on any (no ``vmap_axes``, an example loop, fewer than
    two examples of one per-example shape)."""
    side = call.side1
    if not side.mapped or side.loop:
        return None
    examples = _examples_to_check(call, example_signature(side))
    if examples is None:
        return None
    return examples, _random_cotangents(call.expected_outputs(examples))


# NOTE: [Autograd's products from the whole-batch check]
# On a key's first call a quick plan of 3 is checked against autograd's J^T v of a few examples
# evaluated as one batch (NOTE: [The derivative check within a plan's check]), and its whole-batch
# pass against its per-example pass on the same examples and cotangents (the module docstring).
# Both were whole-batch VJPs of those examples with those cotangents: autograd's of the model,
# 3's of the perturbed model. One VJP of the perturbed model with respect to its deltas *and* the
# parameters gives both (``whole_batch_pass(parameters=True)``): the perturbed model is the model,
# every rule call's output computed by the op itself (``func(*args, **kwargs)`` in every rule) plus
# a delta of zeros, so its parameter derivatives are the model's. They stay independent of what
# the check tests: autograd differentiates every op the parameters reach, seen by the recorder or
# not (a TorchScript use missing from the structured side still shows), and the structured side
# comes from the rules' factors of the per-example pass (under vmap), not from this pass. The
# fused kernels the recorder decomposes are their decompositions here, as in every pass of 3; the
# output check compares the decomposed per-example outputs with the fused whole-batch ones. This
# saves autograd's own forward pass and the input-gradient part of its backward pass (the merged
# backward computes the parameters' gradients, as that pass did): 15-20 ms of a ResNet-18's first
# call, where the separate pass took 45. A plan whose whole-batch pass cannot run, or that the check
# demotes, takes autograd's own pass, or a whole-batch check of its own, as before.


def sample_pass(
    call: KernelCall, plan: Plan, sample: tuple[Side, tuple[torch.Tensor, ...]], shapes: Optional[LayoutShapes] = None
) -> tuple[LayoutShapes, Optional[WholeBatchPass]]:
    """The whole-batch pass of :func:`check_sample`'s examples and cotangents (``sample``) under
    ``plan``, with autograd's ``J^T v`` of every parameter (NOTE: [Autograd's products from the
    whole-batch check]), and the :class:`LayoutShapes` it was made with; None where the shapes
    rule the pass out, it does not fit the plan or it fails (:func:`with_whole_batch` then says
    why)."""
    if shapes is None or not shapes.holds_for(plan):
        shapes = found_layout(call, plan, True, sample)
    if shapes.output_axes is None:
        return shapes, None
    done = shapes.pass_for(plan, True)
    if done is not None:
        return shapes, done
    examples, cotangents = sample
    return shapes, _pass_or_none(examples, plan, shapes.output_axes, cotangents, True)


def _layout(
    call: KernelCall, plan: Plan, single: Optional[SideFactors] = None, shapes: Optional[LayoutShapes] = None,
    done: Optional[WholeBatchPass] = None, found: bool = True,
) -> tuple[Optional[WholeBatchLayout], Optional[str]]:
    """``found``: ``shapes`` (and their pass) were found for ``plan`` itself, not for the plan
    before parameter groups split its roles (a pass is read by the roles it kept)."""
    if shapes is None or not shapes.holds_for(plan):
        shapes = found_layout(call, plan, False) if done is None and found else layout_shapes(call, plan)
    if done is None and found:
        done = shapes.pass_for(plan, False)  # the pass that found the shapes
    if shapes.output_axes is None:
        return None, shapes.reason
    output_axes = shapes.output_axes
    signature = example_signature(call.side1)
    examples, cotangents = check_sample(call)
    if done is None:
        try:
            done = whole_batch_pass(examples, plan, output_axes, cotangents)
        except (RuntimeError, PlanMismatch, ShapeMismatch) as error:
            if is_out_of_memory(error):
                raise
            text = str(error).strip()
            return None, f"the whole-batch pass failed ({type(error).__name__}: {text.splitlines()[0] if text else ''})"
    if done is None:
        return None, "the whole-batch pass states its rule calls otherwise than one example's pass"
    if not CHECK:  # the readings shapes suggest, unchecked (only tests do this)
        folds = {position: Fold(axis) for position, axis in output_axes.items()}
        return WholeBatchLayout(folds, done.operand_folds, signature, 0), None
    if single is None:
        single = per_example_factors(examples, plan, cotangents=cotangents)
    readings = _readings(done, plan, single, call.model.names)
    if isinstance(readings, str):
        return None, readings
    layout = WholeBatchLayout(*readings, signature, done.examples)
    # the factors exactly as the kernel's passes will read them, against the per-example pass's
    reason = _compare(read_per_example(examples, plan, done, layout, True), single, call.model.names)
    return (None, reason) if reason is not None else (layout, None)


def _examples_to_check(call: KernelCall, signature: tuple) -> Optional[Side]:
    """The first examples of x1 (or of x2, when x1 has one) that the check runs on."""
    for side in (call.side1, call.side2):
        if side is None or side.loop or side.batch_size() < 2 or example_signature(side) != signature:
            continue
        return side.narrow(0, min(side.batch_size(), CHECK_EXAMPLES))
    return None


def _output_axes(examples: Side, plan: Plan) -> tuple[Optional[dict[int, int]], Optional[str]]:
    """The axis of each perturbed rule call's whole-batch output that holds the examples, from a
    recording pass over ``examples`` (None and why, when one has none)."""
    params = examples.model.params
    evaluate = examples.whole_batch()
    recorder = Recorder(params, unfuse=recorder_unfuses(examples))  # under whole_batch_context

    def record() -> None:
        with torch.no_grad(), recorder:
            evaluate(params)

    with whole_batch_context(examples):
        under_a_transform(record)
    if not plan.foresees(recorder.calls, recorder.unruled):
        return None, "a pass over the whole batch consumes the parameters otherwise than one example's pass"
    count = examples.batch_size()
    axes = {}
    for position, (shape, dtype) in plan.perturbed_shapes.items():
        if position >= len(recorder.calls) or not plan.roles(recorder.calls[position]):
            return None, "a pass over the whole batch makes other rule calls than one example's pass"
        output = recorder.calls[position].output
        fold = find_fold(output.shape, shape, count)
        if fold is None or fold.axis is None or output.dtype != dtype:
            return None, _not_on_one_axis(position, tuple(output.shape), shape, count)
        axes[position] = fold.axis
    return axes, None


def _not_on_one_axis(position: int, whole: tuple, single: tuple, count: int) -> str:
    """Why the passes cannot run over the whole batch where rule call ``position``'s output over
    ``count`` examples, shaped ``whole``, does not hold them on one axis of one example's ``single``."""
    return (
        f"rule call {position} gives {whole} for {count} examples but {single} for one: its output does not hold "
        f"the examples on one axis"
    )


def _readings(
    done: WholeBatchPass, plan: Plan, single: SideFactors, names: tuple[str, ...]
) -> Union[tuple[dict[int, Fold], tuple[Fold, ...]], str]:
    """Where the whole-batch pass ``done`` holds the examples of every ``G`` and operand: the one
    reading its shapes allow that gives the per-example pass's values (``single``, from the same
    cotangents), or why there is none. A flattened axis allows two (the example the outer or the
    inner factor), which only the values tell apart; when both fit, nothing can be told and the
    plan keeps the per-example pass. Every candidate reading is measured in one batch
    (:func:`_relative_differences`), then decided factor by factor."""
    if len(done.kept) != len(single.uses):
        return "the whole-batch pass keeps other uses than the per-example pass"
    positions = sorted(plan.perturbed_shapes)
    examples = done.examples
    factors = []  # (what, position or None for an operand, read, expected, candidate folds)
    tensors = iter(zip(done.operands, done.operand_folds))
    for (index, role), use in zip(done.kept, single.uses):
        what = f"the {role.name} use of {', '.join(repr(names[param]) for param in role.unit)}"
        position = positions[index]
        shape_axis = find_fold(done.gradients[index].shape[1:], plan.perturbed_shapes[position][0], examples).axis

        def gradient(fold: Fold, raw: torch.Tensor = done.gradients[index], role: Role = role) -> torch.Tensor:
            return examples_first(raw, fold, examples, lead=1).reshape(examples, *role.y_shape)

        flattened = plan.perturbed_shapes[position][0][shape_axis] > 1
        factors.append((f"G of {what}", position, gradient, use.gradients[0], _candidates(shape_axis, flattened)))
        for number, (expected, _) in enumerate(use.role.operands):
            tensor, seen = next(tensors)
            flattened = seen.axis is not None and tensor.shape[seen.axis] > examples
            read = functools.partial(examples_first, tensor, examples=examples)
            factors.append((f"operand {number} of {what}", None, read, expected, _candidates(seen.axis, flattened)))
    requests, pairs = [], []
    for number, (_, _, read, expected, candidates) in enumerate(factors):
        for fold in candidates:
            try:
                pairs.append((read(fold), expected))
            except RuntimeError:  # a reading the tensor's layout does not allow: no candidate
                continue
            requests.append((number, fold))
    differences = dict(zip(requests, _relative_differences(pairs)))
    output_folds: dict[int, Fold] = {}
    operand_folds: list[Fold] = []
    for number, (what, position, read, expected, candidates) in enumerate(factors):
        decided = output_folds.get(position) if position is not None else None
        if decided is not None:
            candidates = [decided]
        fold = _reading(
            [(fold, differences[(number, fold)] if (number, fold) in differences else _measured(read, fold, expected))
             for fold in candidates],
            _tolerance(expected),
        )
        if isinstance(fold, str):
            return f"{what}: {fold}"
        if position is not None:
            output_folds[position] = fold
        else:
            operand_folds.append(fold)
    return output_folds, tuple(operand_folds)


def _measured(read: Callable[[Fold], torch.Tensor], fold: Fold, expected: torch.Tensor) -> Optional[float]:
    try:
        return _relative_difference(read(fold), expected)
    except RuntimeError:
        return None


def _candidates(axis: Optional[int], flattened: bool) -> list[Fold]:
    """The readings of a tensor whose examples lie on ``axis``: the example the outer factor of the
    axis, or (``flattened``: one example's size along it is not 1) the inner one."""
    return [Fold(axis)] + ([Fold(axis, inner=True)] if flattened else [])


def _reading(measured: list[tuple[Fold, Optional[float]]], tolerance: float) -> Union[Fold, str]:
    """The one fold among ``measured`` (each candidate reading with its relative difference from the
    per-example value, None for another shape) within ``tolerance``, or why there is none."""
    fitting = [fold for fold, difference in measured if difference is not None and difference <= tolerance]
    if len(fitting) == 1:
        return fitting[0]
    if fitting:
        return "the examples checked cannot tell whether the example is the outer or the inner factor of its axis"
    last = measured[-1][1] if measured else None
    return (
        f"no reading of the whole-batch tensor gives the per-example pass's value (relative difference "
        f"{last:.3g}): the model does not keep each example on one axis of its tensors as their shapes suggest"
        if last is not None else "the whole-batch tensor does not have the per-example pass's shape"
    )


def _random_cotangents(outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Standard normal cotangents shaped like ``outputs``, from a fixed seed (the user's random
    stream is left alone)."""
    generator = torch.Generator().manual_seed(_SEED)
    return tuple(
        torch.randn(output.shape, generator=generator, dtype=torch.float64).to(dtype=output.dtype, device=output.device)
        for output in outputs
    )


def _compare(whole: Optional[SideFactors], single: SideFactors, names: tuple[str, ...]) -> Optional[str]:
    """Why the factors of a whole-batch pass differ from the per-example pass's (None: they agree)."""
    if whole is None:
        return "the whole-batch pass's operands do not lie where their shapes say"
    if len(whole.uses) != len(single.uses):
        return "the whole-batch pass keeps other uses than the per-example pass"
    checked = []  # (what, name, mine, theirs) of every factor, compared together below
    for one, other in zip(whole.uses, single.uses):
        what = f"the {one.role.name} use of {', '.join(repr(names[index]) for index in one.role.unit)}"
        if one.role.unit != other.role.unit:
            return "the whole-batch pass keeps its uses in another order than the per-example pass"
        checked.append((what, "G", one.gradients[0], other.gradients[0]))
        checked += [
            (what, f"operand {index}", mine, theirs)
            for index, ((mine, _), (theirs, _)) in enumerate(zip(one.role.operands, other.role.operands))
        ]
    differences = _relative_differences([(mine, theirs) for _, _, mine, theirs in checked])
    for (what, name, mine, theirs), difference in zip(checked, differences):
        if difference is None:
            return (
                f"{name} of {what} has shape {tuple(mine.shape)} in the whole-batch pass but "
                f"{tuple(theirs.shape)} per example"
            )
        if not difference <= _tolerance(theirs):
            return (
                f"{name} of {what} differs between the whole-batch pass and the per-example pass "
                f"(relative difference {difference:.3g}): the model does not keep each example on one "
                f"axis of the whole-batch tensors as their shapes suggest (e.g. a time-major recurrence)"
            )
    return None


def _relative_differences(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[Optional[float]]:
    """:func:`_relative_difference` of every pair with one synchronisation for all of them instead of
    one per pair (a ResNet-18's factors are about 180); pairs of other shapes, no entries, or NaN or
    infinite entries are measured one by one."""
    def largest(tensor: torch.Tensor) -> torch.Tensor:
        low, high = torch.aminmax(tensor)
        return torch.maximum(-low, high)

    fused = [index for index, (mine, theirs) in enumerate(pairs) if mine.shape == theirs.shape and mine.numel()]
    results: list[Optional[float]] = [None] * len(pairs)
    if fused:
        measured = []
        for index in fused:
            mine, theirs = (tensor.detach().to(torch.float64) for tensor in pairs[index])
            measured.append(torch.stack([largest(mine - theirs), torch.maximum(largest(mine), largest(theirs))]))
        for index, (error, scale) in zip(fused, torch.stack(measured).to(pairs[fused[0]][0].device).tolist()):
            if math.isfinite(error) and math.isfinite(scale):
                results[index] = 0.0 if error == 0.0 else (error / scale if scale > 0 else float("inf"))
    return [
        result if result is not None else _relative_difference(*pair) for result, pair in zip(results, pairs)
    ]


def _relative_difference(mine: torch.Tensor, theirs: torch.Tensor) -> Optional[float]:
    """``max |mine - theirs| / max |theirs, mine|`` (0 for empty or all-zero tensors; NaN where
    one holds NaN the other does not; None for different shapes)."""
    if mine.shape != theirs.shape:
        return None
    if not mine.numel():
        return 0.0
    mine, theirs = mine.detach().to(torch.float64), theirs.detach().to(torch.float64)
    same = (mine == theirs) | (mine.isnan() & theirs.isnan())  # equal infinities and NaNs agree
    gap = torch.where(same, torch.zeros((), dtype=mine.dtype, device=mine.device), (mine - theirs).abs())
    scale = torch.maximum(mine.abs(), theirs.abs()).nan_to_num(nan=0.0, posinf=0.0).max()
    error, scale = torch.stack([gap.max(), scale]).tolist()
    if error == 0.0:
        return 0.0
    return error / scale if scale > 0 else float("inf")


def _tolerance(tensor: torch.Tensor) -> float:
    dtype = tensor.dtype
    if dtype == torch.float64:
        return _RTOL[dtype]
    if dtype != torch.float32:
        return _LOW_PRECISION_RTOL
    reduced = requested_mode() != "float32" or (
        tensor.device.type == "cuda"
        and (torch.backends.cuda.matmul.allow_tf32 or torch.backends.cudnn.allow_tf32
             or torch.get_float32_matmul_precision() != "highest")
    )
    return _REDUCED_FLOAT32_RTOL if reduced else _RTOL[dtype]
