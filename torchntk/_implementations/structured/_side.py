"""One side's factors: ``G = df/dy`` for every recorded use, the rules' operands, fallback Jacobians.

NOTE: [df/dy by perturbed passes]
The model runs once under a :class:`~._recorder.Recorder` that records the rule calls, builds
their operands and adds a zero ``delta_k`` to the output of every rule call that contributes
(their shapes come from the plan's probe; a recording pass finds them first when the inputs have
other shapes). The VJP with respect to the deltas, batched over a basis of the output entries,
gives ``G_k[o, ...] = d f[o] / d y_k`` for all of them at once: ``O`` backward sweeps that stop at
the ``y_k`` and never form parameter-shaped tensors. With ``vmap_axes`` this runs per example
under ``vmap`` (so the model never needs to say where its batch axis is inside), and ``O`` is the
output size of one example; without it the whole batch is one "example" and the basis covers
every output entry (which is what batch-coupled models such as BatchNorm in training mode need).

NOTE: [Whole-batch pullback]
Under ``vmap_axes`` the pass above is ``vmap`` over the examples of (the VJP of the perturbed
model, then ``vmap`` over the ``O`` basis vectors of its pullback): every op of the forward and of
the ``O`` backward sweeps goes through two levels of batching rules, whose views, permutes and
clones were a sixth of the ATen calls of a ResNet-18 kernel, and on a GPU the host's time. The
examples are independent (``vmap_axes`` says so, and is checked), so one VJP of the perturbed
model over the whole batch gives the same ``G``: with basis vector ``o`` set for every example at
once, the cotangent reaching example ``n``'s entries of ``y_k`` is ``d out_n[o] / d y_k``, as
example ``n``'s outputs depend on its own entries of ``y_k`` only. That is ``O`` backward sweeps
of the whole batch, batched by one ``vmap`` over the basis, and no per-example ``vmap``.

The whole-batch tensors (each ``y_k``, and the operands the rules build from the ops' inputs) are
then read as the per-example ones stacked, without a copy: the examples lie on one axis (its
one-example size 1), or are the outer factor of an axis that a rule flattened (``F.linear``'s
positions: one example's ``(T, F)`` is the whole batch's ``(n T, F)`` when the batch axis came
first), or the tensor is shared by all examples (an operand computed from buffers only). Where
that holds is decided from the shapes and checked once per plan (``_whole_batch.py``): when the
plan is made, the whole-batch pass and the per-example pass of a few examples must agree on every
``G`` (contracted with a random cotangent) and operand, or the plan keeps the per-example pass and
says why (:attr:`~._plan.Plan.whole_batch_reason`). Shapes alone cannot tell: a time-major
recurrence (``nn.RNN`` with ``batch_first=False``, and every recurrent layer inside, see NOTE:
[Unfused kernels]) projects its ``(T, n, F)`` input with one ``F.linear``, whose operand
``(T n, F)`` holds the example as the *inner* factor, and a ``(T, F)`` example looks the same.
Every pass checks the shapes against the plan's (a side of other per-example shapes, or a rule
that states one example differently from the batch, takes the per-example pass), and the rules'
roles against the probe's.

Sides mapped by an example loop or not mapped keep the per-example pass (which, unmapped, is the
whole batch already). The output check of ``vmap_axes`` cannot use this pass's outputs, which are
the whole batch's: a call with a pending check (``check_vmap_axes=True`` after the first call)
keeps the per-example pass, whose outputs the check compares for free, rather than pay the
check's own per-example forward pass (``KernelCall.check_outputs``) on top of this one.

NOTE: [The whole-batch pass by plain autograd]
The whole-batch pass needs no per-example ``vmap``, and its VJP needs no ``torch.func`` either: the
deltas are made leaves that require grad, the perturbed model runs under ``torch.enable_grad()``,
and the pullback is ``torch.autograd.grad`` on the graph kept (``vmap`` over the basis, as
before). ``torch.func.vjp`` wraps every tensor of the forward for its grad level, a few
microseconds per operation: the tiny MLP of ``bench_overhead.py``'s forward took 43 us plain and
117 us wrapped, and its warm call fell from 0.91 to 0.80 of the tutorial's time; the LSTM row of
``bench_first_call.py`` (an unfused cell per step), 7% of a warm call (docs/benchmarks.md, "The
whole-batch pass by plain autograd"). The ATen count grows by a few views (the deltas detached
as leaves of their own: 141 to 149 on the tiny MLP). Its gradients are the same:
autograd follows every op's derivative, a custom ``autograd.Function``'s own backward included,
and the layout check of ``_whole_batch.py`` compares this pass with the per-example pass, which
runs under ``vmap``, when the plan is made. It keeps ``torch.func.vjp`` where plain autograd would
see the model otherwise than the probe did: a custom ``torch.autograd.Function`` reaches the
recorder as one call only under a transform (``under_a_transform``), so where the probe met one
(``Plan.custom_functions``) the pass runs as the probe did; and where a transform is active already
(a caller's ``vmap``, the recorder's own passes) or inference mode forbids recording a graph.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch.func import jacfwd, jacrev, vjp, vmap

from ..._call.per_example import Side, transformed
from ..._utils.values import leaf_key
from ._plan import Fold, Plan, WholeBatchLayout
from ._recorder import Recorder, ShapeMismatch
from ._roles import OutputSpec, Role, RuleCall, letters


@dataclass
class Use:
    """A contributing role with its ``G`` per output leaf.

    ``gradients[k]`` has shape ``output_k.shape + role.y_shape`` (the output's batch axis included;
    with ``vmap_axes`` it doubles as the role operands' leading example axis).
    """

    role: Role
    gradients: tuple[torch.Tensor, ...]


# NOTE: [Kept factors of operandless roles]
# A role without operands states its parameter's Jacobian as ``G`` summed over the letters the
# parameter lacks: a bias of a linear layer is ``J_b[c] = sum_s G[s, c]`` over the token
# positions ``s``, a LayerNorm's or a convolution's bias the same over positions. The pair
# contraction would sum them anyway; the factors a kernel call keeps for all its examples (NOTE:
# [Working-set runs]) are summed as soon as a pass has laid them out (:func:`_uses`), so that they
# hold ``J_b`` itself, not a cotangent per position. On a RoBERTa-base-size model with BitFit
# (only biases, 32 tokens, two label logits) that is a 32nd of about 26 MB per example. Where
# another use keeps the same ``G`` per position anyway (a weight beside its bias) the sums would
# only add to it (measured on the memory grid's CNN under ``batch_size="auto"``: 68 to 81 MB), so
# that bias keeps ``G`` too. The checks (the plan check, the whole-batch layout check, ``verify``)
# contract ``G`` with cotangents instead, which is never summed. Pricing (``_cost.py``) keeps ``G``
# per position: a run's pass forms all of it before the sums, and ``batch_size="auto"`` sized on
# the sums alone took that CNN's blocks to 106 MB under a 64 MB budget (tests/test_memory.py).


@dataclass
class SideFactors:
    """Everything one side contributes to the contraction, and the side's outputs.

    ``per_example``: whether :attr:`outputs` come from a per-example evaluation (mapped sides), so
    that the output check of ``vmap_axes`` may compare them with the whole batch's; False after a
    whole-batch pass (NOTE: [Whole-batch pullback]), whose outputs are the whole batch's.
    """

    uses: list[Use]
    fallback: Optional[tuple[tuple[torch.Tensor, ...], ...]]
    outputs: tuple[torch.Tensor, ...]
    per_example: bool = True

    def narrow(self, start: int, length: int, out_axes: tuple[int, ...]) -> "SideFactors":
        """The factors of examples ``start .. start + length - 1`` (mapped sides: operands' axis 0)."""
        uses = [
            Use(
                use.role.with_operands(
                    [(tensor.narrow(0, start, length), labels) for tensor, labels in use.role.operands]
                ),
                tuple(g.narrow(axis, start, length) for g, axis in zip(use.gradients, out_axes)),
            )
            for use in self.uses
        ]
        fallback = None
        if self.fallback is not None:
            fallback = tuple(
                tuple(j.narrow(axis, start, length) for j in per_leaf)
                for per_leaf, axis in zip(self.fallback, out_axes)
            )
        outputs = tuple(output.narrow(axis, start, length) for output, axis in zip(self.outputs, out_axes))
        return SideFactors(uses, fallback, outputs, self.per_example)


class PlanMismatch(Exception):
    """A pass met parameter uses the plan (from a probe of one example) did not foresee."""


@dataclass(frozen=True)
class Probe:
    """What a recording pass saw.

    Attributes:
        calls: the rule calls, in order; their roles' operands are meta tensors of the per-example
            shapes (:meth:`RuleCall.keep_shapes_only`).
        output_specs: the per-example shape and dtype of each call's output.
        unruled: parameter indices consumed by an op without an applicable rule.
        reasons: why each unruled parameter is.
        custom_functions: whether a custom ``torch.autograd.Function`` ran in the pass.
    """

    calls: list[RuleCall]
    output_specs: list[OutputSpec]
    unruled: set[int]
    reasons: dict[int, str]
    custom_functions: bool = False


def probe(side: Side, first_example_only: bool = True) -> Probe:
    """One recording pass (per example, on the first example only by default): finds the rule calls.

    Args:
        side: the examples to record.
        first_example_only: narrow a mapped side to its first example first.

    Returns:
        The calls with their roles on meta tensors (for the plan and AUTO), and the unruled
        parameters.
    """
    if side.mapped and first_example_only:
        side = side.narrow(0, min(1, side.batch_size()))
    unfuse = recorder_unfuses(side)
    recorder = Recorder(side.model.params, looped=side.loop, unfuse=unfuse)

    def record(x_leaves: tuple, kwarg_leaves: tuple) -> None:
        with torch.no_grad(), recorder:
            side.evaluate(side.model.params, x_leaves, kwarg_leaves)
        for call in recorder.calls:
            call.keep_shapes_only()

    def run(x_leaves: tuple, kwarg_leaves: tuple) -> torch.Tensor:
        under_a_transform(lambda: record(x_leaves, kwarg_leaves))
        return torch.zeros(())

    side.per_example(run, unfuse=not unfuse)
    return Probe(
        recorder.calls, recorder.output_specs, recorder.unruled, recorder.reasons, recorder.met_custom_function
    )


def recorder_unfuses(side: Side) -> bool:
    """Whether a recorder pass over ``side`` decomposes the model's fused kernels itself (NOTE:
    [The recorder unfuses]): wherever ``Side.per_example`` would enter ``Unfused`` for it (not in
    an example loop, whose reverse-mode passes run the fused kernels)."""
    return bool(side.model.fused) and side.mapped and not side.loop


def under_a_transform(function: Callable[[], Any]) -> Any:
    """``function()``, under a ``torch.func`` transform like every perturbed pass.

    A custom ``torch.autograd.Function`` reaches a function mode as one ``custom_function_call``
    only under a transform; outside one the mode would see the ops of its ``forward`` (which its
    ``backward`` need not differentiate) and the probe and the perturbed passes would disagree.
    """
    if torch._C._are_functorch_transforms_active():
        return function()
    results = []  # vjp returns tensors only: the result leaves through the closure

    def run(_unused: torch.Tensor) -> torch.Tensor:
        results.append(function())
        return _unused

    vjp(run, torch.zeros(()))
    return results[0]


def _zeros(spec: OutputSpec, side: Side) -> torch.Tensor:
    shape, dtype = spec
    return torch.zeros(shape, dtype=dtype, device=side.model.params[0].device)


@dataclass
class _KeptRoles:
    """The roles a perturbed pass keeps, each with the index of its ``G`` among the deltas.

    Roles are not tensors, so they cannot be results of ``vmap``: the pass stores them here. When
    a loop maps the examples this holds the last example's: every example's pass keeps the same
    rule calls (the plan check and the positions check raise otherwise).
    """

    roles: list[tuple[int, Role]] = field(default_factory=list)


def side_factors(
    side: Side, plan: Plan, chunk_size: Optional[int] = None, cotangents: Optional[tuple[torch.Tensor, ...]] = None,
    whole_batch: bool = True,
) -> SideFactors:
    """``G`` and operands of every contributing use, plus the fallback parameters' Jacobians.

    With ``cotangents`` (shaped like the outputs) ``G`` is contracted with them instead of a basis:
    ``gradients`` then holds one tensor of shape ``role.y_shape`` (after the example axis when
    mapped), the ``G``-side of ``J^T v`` (used by ``verify``).

    The factors come from one whole-batch pass where the plan allows it, the side fits and
    ``whole_batch`` is True (NOTE: [Whole-batch pullback]), else from the per-example pass.
    """
    if whole_batch and plan.whole_batch is not None and takes_whole_batch(side, plan.whole_batch):
        factors = whole_batch_factors(side, plan, plan.whole_batch, cotangents)
        if factors is not None:
            return factors
    return per_example_factors(side, plan, chunk_size, cotangents)


def per_example_factors(
    side: Side, plan: Plan, chunk_size: Optional[int] = None, cotangents: Optional[tuple[torch.Tensor, ...]] = None
) -> SideFactors:
    """:func:`side_factors` from the per-example pass of NOTE: [df/dy by perturbed passes]."""
    params = side.model.params
    kept_roles = _KeptRoles()
    unfuse = recorder_unfuses(side)

    def run(x_leaves: tuple, kwarg_leaves: tuple, *cotangent_leaves: torch.Tensor) -> tuple:
        def perturbed_model(deltas: tuple[torch.Tensor, ...]) -> tuple:
            # One pass records the rule calls, builds their operands and perturbs their outputs.
            recorder = Recorder(params, dict(zip(positions, deltas)), looped=side.loop, unfuse=unfuse)
            with recorder:
                outputs = side.evaluate(params, x_leaves, kwarg_leaves)
            if not plan.foresees(recorder.calls, recorder.unruled):
                raise PlanMismatch
            kept = [(position, role) for position, call in enumerate(recorder.calls) for role in plan.roles(call)]
            if sorted({position for position, _ in kept}) != positions:
                raise ShapeMismatch
            if plan.local_jacobian is not None:
                kept = [(position, _dense_role(role, plan.local_jacobian)) for position, role in kept]
            kept_roles.roles = [(positions.index(position), role) for position, role in kept]
            return outputs, _detached(tensor for _, role in kept for tensor, _ in role.operands)

        if plan.perturbed_shapes is not None:
            positions = sorted(plan.perturbed_shapes)
            zeros = tuple(_zeros(plan.perturbed_shapes[position], side) for position in positions)
            try:
                outputs, pullback, operands = vjp(perturbed_model, zeros, has_aux=True)
            except ShapeMismatch:
                positions = None
        else:
            positions = None
        if positions is None:  # shapes differ from the probe's: find them with a recording pass
            recorder = Recorder(params, looped=side.loop, unfuse=unfuse)

            def record() -> None:
                with torch.no_grad(), recorder:  # entered inside the transform: NOTE: [Transforms inside the model]
                    side.evaluate(params, x_leaves, kwarg_leaves)

            under_a_transform(record)
            if not plan.foresees(recorder.calls, recorder.unruled):
                raise PlanMismatch
            positions = [position for position, call in enumerate(recorder.calls) if plan.roles(call)]
            zeros = tuple(torch.zeros_like(recorder.calls[position].output) for position in positions)
            try:
                outputs, pullback, operands = vjp(perturbed_model, zeros, has_aux=True)
            except ShapeMismatch:
                raise PlanMismatch from None
        basis = tuple(c.unsqueeze(0) for c in cotangent_leaves) if cotangent_leaves else _identity_basis(outputs)
        (gradients,) = vmap(pullback, chunk_size=chunk_size)(basis) if positions else ((),)
        return tuple(gradients), operands, tuple(outputs)

    extra = tuple(cotangents) if cotangents is not None else ()
    extra_dims = tuple(side.out_axes) if (cotangents is not None and side.mapped) else tuple(None for _ in extra)
    gradients, operands, outputs = side.per_example(run, extra, extra_dims, unfuse=not unfuse)
    # mapped results are stacked on a leading example axis; the rest is one example's shape
    output_shapes = [tuple(output.shape[1:] if side.mapped else output.shape) for output in outputs]
    if side.mapped:
        outputs = tuple(output.movedim(0, axis) for output, axis in zip(outputs, side.out_axes))
    uses = _uses(side, kept_roles.roles, output_shapes, gradients, iter(operands), contracted=cotangents is not None)
    fallback = None
    if plan.fallback and cotangents is None:
        fallback = side.jacobians(chunk_size=chunk_size, only=plan.fallback)
    return SideFactors(uses, fallback, outputs)


def _uses(
    side: Side,
    kept: list[tuple[int, Role]],
    output_shapes: list[tuple[int, ...]],
    gradients: tuple[torch.Tensor, ...],
    operands: Iterator[torch.Tensor],
    contracted: bool,
) -> list[Use]:
    """The kept roles with the pass's operands and their ``G`` laid out per output leaf.

    Args:
        side: the side of the pass.
        kept: ``(index of G, role)`` of every kept role; the roles' operands are replaced, in order.
        output_shapes: one example's shape of every output leaf.
        gradients: ``G`` of every delta, ``([N,] B, *y)`` with ``B`` the basis size.
        operands: the pass's operands, in the order of the kept roles' operands.
        contracted: ``G`` was contracted with cotangents instead of a basis (``B`` is 1); else
            operandless roles' ``G`` is summed once laid out (NOTE: [Kept factors of operandless
            roles]).
    """
    sizes = [math.prod(shape) for shape in output_shapes]
    example_axes = 1 if side.mapped else 0
    # a G that another use keeps per position (a weight beside its bias) is held anyway: its sums
    # would only add memory
    held = set() if contracted else {index for index, role in kept if role.summed is None}
    uses = []
    for gradient_index, role in kept:
        role = role.with_operands([(next(operands), labels) for _, labels in role.operands])
        gradient = gradients[gradient_index]  # ([N,] B, *y)
        if contracted:
            per_leaf = (gradient.reshape(*gradient.shape[:example_axes], *role.y_shape),)
        else:
            per_leaf = tuple(
                _place(part, shape, role.y_shape, side, leaf)
                for leaf, (part, shape) in enumerate(zip(_split(gradient, sizes, example_axes), output_shapes))
            )
            if role.summed is not None and gradient_index not in held:  # (*output, *y) summed
                y = len(role.y_shape)
                axes = [axis - y for axis, label in enumerate(role.g_labels) if label not in role.summed.g_labels]
                per_leaf = tuple(placed.sum(dim=axes) for placed in per_leaf)
                role = role.summed
        uses.append(Use(role, per_leaf))
    return uses


def _place(gradient: torch.Tensor, output_shape: tuple, y_shape: tuple, side: Side, leaf: int) -> torch.Tensor:
    """``([N,] B_leaf, *y) -> output.shape + y_shape``, the example axis moved to the output's batch axis."""
    if not side.mapped:
        return gradient.reshape(*output_shape, *y_shape)
    gradient = gradient.reshape(gradient.shape[0], *output_shape, *y_shape)
    axis = side.out_axes[leaf]
    return gradient if axis == 0 else gradient.movedim(0, axis)  # an identity permute is still an op


def _split(gradient: torch.Tensor, sizes: list[int], dim: int) -> tuple[torch.Tensor, ...]:
    """``gradient.split(sizes, dim)``, without an op for one output leaf (the usual case)."""
    return (gradient,) if len(sizes) == 1 else gradient.split(sizes, dim=dim)


def _identity_basis(outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """One cotangent per output entry of every leaf (the other leaves zero): ``(B, *leaf.shape)``."""
    sizes = [output.numel() for output in outputs]
    total = sum(sizes)
    basis = []
    start = 0
    for output, size in zip(outputs, sizes):
        eye = torch.zeros(total, size, dtype=output.dtype, device=output.device)
        eye[start : start + size] = torch.eye(size, dtype=output.dtype, device=output.device)
        basis.append(eye.reshape(total, *output.shape))
        start += size
    return tuple(basis)


def _dense_role(role: Role, mode: str) -> Role:
    """The role with ``dy/dp`` computed densely from ``role.local`` (no structure used)."""
    seen = role.seen
    y = role.local(seen)
    forward = mode == "forward" or (mode == "auto" and y.numel() > seen.numel())
    jacobian = (jacfwd if forward else jacrev)(role.local)(seen)
    y_letters = letters(y.ndim)
    param_letters = letters(seen.ndim, start=y.ndim)
    return Role(
        role.refs, role.name, tuple(y.shape), y_letters, [(jacobian, y_letters + param_letters)], param_letters,
        tuple(seen.shape),
    )


# -- NOTE: [Whole-batch pullback] ---------------------------------------------------------------


def find_fold(whole: Sequence[int], single: Sequence[int], examples: int) -> Optional[Fold]:
    """Where a tensor of shape ``whole`` over ``examples`` examples may hold tensors of shape ``single``.

    The shapes must agree but on one axis whose size is ``examples`` times one example's; equal
    shapes mean a tensor shared by every example (or, for one example, nothing to tell). None
    when neither holds. Shapes cannot tell whether the example is the outer or the inner factor of
    a flattened axis (the result says outer): NOTE: [Whole-batch pullback] says what decides.

    Example:
        >>> find_fold((8, 5, 3), (8, 1, 3), 5), find_fold((12, 4), (3, 4), 4), find_fold((2, 3), (3, 2), 2)
        (Fold(axis=1, inner=False), Fold(axis=0, inner=False), None)
    """
    whole, single = tuple(whole), tuple(single)
    if len(whole) != len(single):
        return None
    differing = [axis for axis, (one, other) in enumerate(zip(whole, single)) if one != other]
    if not differing:
        return Fold(None)
    if len(differing) == 1 and whole[differing[0]] == examples * single[differing[0]]:
        return Fold(differing[0])
    return None


def examples_first(tensor: torch.Tensor, fold: Fold, examples: int, lead: int = 0) -> torch.Tensor:
    """The per-example tensors of a whole-batch one, stacked on a new axis 0: a view, no copy.

    Args:
        tensor: the whole-batch tensor, after ``lead`` axes of its own (``G``'s basis axis).
        fold: where its examples lie, in the coordinates after the ``lead`` axes.
        examples: how many.
        lead: leading axes that stay, after the new example axis.
    """
    if fold.axis is None:
        return tensor.unsqueeze(0).expand(examples, *tensor.shape)
    axis = lead + fold.axis
    size = tensor.shape[axis] // examples
    if fold.inner:
        return tensor.unflatten(axis, (size, examples)).movedim(axis + 1, 0)
    if axis == 0:  # the usual batch-first layout: one view
        return tensor.view(examples, size, *tensor.shape[1:]) if size != 1 else tensor.unsqueeze(1)
    return tensor.unflatten(axis, (examples, size)).movedim(axis, 0)


def whole_shape(single: Sequence[int], axis: int, examples: int) -> tuple[int, ...]:
    """The whole-batch shape of tensors shaped ``single`` per example, held on ``axis``."""
    shape = list(single)
    shape[axis] *= examples
    return tuple(shape)


def example_signature(side: Side) -> tuple:
    """The per-example shapes of a mapped side's inputs: mapped leaves without their example axis,
    unmapped ones whole, with dtypes; other leaves by ``leaf_key``. Sides of one signature run the same
    per-example shapes through a model that does not read its inputs' values for shapes."""

    def leaf(value: Any, axis: Optional[int]) -> tuple:
        if not isinstance(value, torch.Tensor):
            return ("value", leaf_key(value))
        shape = tuple(value.shape)
        if axis is None:
            return ("shared", shape, value.dtype, value.device)
        return ("mapped", axis, shape[:axis] + shape[axis + 1 :], value.dtype, value.device)

    signature = [leaf(value, axis) for value, axis in zip(side.x.leaves, side.x_axes or ())]
    for key, flat in side.kwargs.items():
        axes = (side.kwarg_axes or {}).get(key, ())
        signature.append((key, tuple(leaf(value, axis) for value, axis in zip(flat.leaves, axes))))
    return tuple(signature)


def takes_whole_batch(side: Side, layout: WholeBatchLayout) -> bool:
    """Whether ``side`` may take the whole-batch pass of a plan with ``layout``: mapped by vmap (an
    example loop keeps its per-example pass), not empty, and shaped per example like the probe."""
    return (
        side.mapped and not side.loop and side.batch_size() > 0
        and example_signature(side) == layout.example_signature
    )


@dataclass
class WholeBatchPass:
    """What a whole-batch pass gives before it is read per example.

    Attributes:
        examples: how many examples the pass held.
        outputs: the whole-batch output leaves.
        kept: ``(index of G, role)`` of every kept role, with one example's ``y_shape`` (the probe's).
        gradients: per perturbed rule call (the plan's positions, sorted), ``(B, *whole y)``.
        operands: the kept roles' operands in order, whole-batch.
        operand_folds: where each operand holds the examples, as far as shapes tell.
        parameter_products: autograd's ``J^T v`` of every parameter for the cotangents, where the
            pass was asked for them (NOTE: [Autograd's products from the whole-batch check]).
    """

    examples: int
    outputs: tuple[torch.Tensor, ...]
    kept: list[tuple[int, Role]]
    gradients: tuple[torch.Tensor, ...]
    operands: tuple[torch.Tensor, ...]
    operand_folds: tuple[Fold, ...]
    parameter_products: Optional[tuple[torch.Tensor, ...]] = None


def whole_batch_pass(
    side: Side, plan: Plan, output_axes: dict[int, int], cotangents: Optional[tuple[torch.Tensor, ...]] = None,
    parameters: bool = False, raise_mismatch: bool = False,
) -> Optional[WholeBatchPass]:
    """One whole-batch pass of NOTE: [Whole-batch pullback]: the perturbed model's VJP over the
    whole batch, pulled back over the basis of one example's outputs set for every example at once
    (or over ``cotangents``, shaped like the outputs).

    Returns None, before any backward sweep, when the pass does not fit the plan's probe: another
    per-example shape, a rule stating the batch otherwise than one example, operations the plan did
    not foresee (the per-example pass then raises what it raises).

    Args:
        side: a mapped side (see :func:`takes_whole_batch`).
        plan: a plan with a perturbed probe (``perturbed_shapes``, ``first_example_calls``).
        output_axes: for every perturbed rule call, the axis of its output holding the examples.
        cotangents: as for :func:`side_factors`.
        parameters: with ``cotangents``, also differentiate the parameters: autograd's ``J^T v``
            (:attr:`WholeBatchPass.parameter_products`; NOTE: [Autograd's products from the
            whole-batch check]).
        raise_mismatch: raise the recorder's :class:`ShapeMismatch` (the first rule call whose
            output is not shaped as ``output_axes`` say; NOTE: [The layout read from the check's
            own pass]) instead of returning None.
    """
    params = side.model.params
    examples = side.batch_size()
    positions = sorted(plan.perturbed_shapes)
    zeros = tuple(
        torch.zeros(
            whole_shape(plan.perturbed_shapes[position][0], output_axes[position], examples),
            dtype=plan.perturbed_shapes[position][1], device=params[0].device,
        )
        for position in positions
    )
    evaluate = side.whole_batch()
    recorded: list[tuple[int, Role]] = []

    def perturbed_model(deltas: tuple[torch.Tensor, ...], differentiated: tuple[torch.Tensor, ...] = params) -> tuple:
        # the recorder knows the parameters by identity: those the model is evaluated with
        recorder = Recorder(differentiated, dict(zip(positions, deltas)), unfuse=recorder_unfuses(side))
        with recorder:
            outputs = evaluate(differentiated)
        if not plan.foresees(recorder.calls, recorder.unruled):
            raise PlanMismatch
        kept = [(position, role) for position, call in enumerate(recorder.calls) for role in plan.roles(call)]
        if sorted({position for position, _ in kept}) != positions:
            raise ShapeMismatch
        recorded[:] = kept
        return outputs, _detached(tensor for _, role in kept for tensor, _ in role.operands)

    primals = (zeros, tuple(params)) if parameters and cotangents is not None else (zeros,)
    with whole_batch_context(side):
        try:
            outputs, pullback, operands = _whole_batch_vjp(perturbed_model, primals, plan.custom_functions)
        except (ShapeMismatch, PlanMismatch) as error:
            if raise_mismatch and isinstance(error, ShapeMismatch):
                raise
            return None
        checked = _probe_roles(recorded, plan, positions, examples, operands)
        if checked is None:
            return None
        kept, operand_folds = checked
        outputs = tuple(outputs)
        products: list = []
        if cotangents is None:
            basis = _whole_batch_basis(outputs, side.out_axes)
            if basis[0].shape[0] == 1:  # one output entry per example (an energy): no vmap over one vector
                (gradients,) = pullback(tuple(vector[0] for vector in basis))
                gradients = tuple(gradient.unsqueeze(0) for gradient in gradients)
            else:
                (gradients,) = vmap(pullback)(basis)
        else:
            gradients, *products = pullback(tuple(cotangents))
            gradients = tuple(gradient.unsqueeze(0) for gradient in gradients)  # a basis of one vector
    return WholeBatchPass(
        examples, outputs, kept, tuple(gradients), tuple(operands), operand_folds,
        tuple(products[0]) if products else None,
    )


def _whole_batch_vjp(
    function: Callable, primals: tuple[tuple[torch.Tensor, ...], ...], custom_functions: bool,
) -> tuple:
    """``torch.func.vjp(function, *primals, has_aux=True)``, by plain autograd where nothing needs
    the transform (NOTE: [The whole-batch pass by plain autograd]): the output leaves (detached),
    the pullback (a tuple of cotangents, one per output leaf, to a tuple of gradients per primal)
    and ``function``'s auxiliary result. ``primals``: tuples of tensors; ``function`` returns a
    tuple of output tensors and the auxiliary result. ``custom_functions``: the plan's probe met a
    custom ``torch.autograd.Function``."""
    if custom_functions or torch._C._are_functorch_transforms_active() or torch.is_inference_mode_enabled():
        return vjp(function, *primals, has_aux=True)
    groups = tuple(tuple(primal.detach().requires_grad_() for primal in group) for group in primals)
    leaves = tuple(primal for group in groups for primal in group)
    with torch.enable_grad():
        outputs, aux = function(*groups)
    outputs = tuple(outputs)
    # an output leaf no delta reaches (computed from the inputs alone) has no graph: its share is zero
    live = [index for index, output in enumerate(outputs) if output.requires_grad]

    def pullback(cotangents: tuple[torch.Tensor, ...]) -> tuple:
        if live:
            gradients = iter(torch.autograd.grad(
                [outputs[index] for index in live], leaves, [cotangents[index] for index in live],
                retain_graph=True, allow_unused=True, materialize_grads=True,
            ))
        else:
            gradients = iter([torch.zeros_like(leaf) for leaf in leaves])
        return tuple(tuple(next(gradients) for _ in group) for group in groups)

    return tuple(output.detach() for output in outputs), pullback, aux


def whole_batch_factors(
    side: Side, plan: Plan, layout: WholeBatchLayout, cotangents: Optional[tuple[torch.Tensor, ...]] = None
) -> Optional[SideFactors]:
    """:func:`side_factors` from one whole-batch pass read by the plan's ``layout``: the factors of
    the per-example pass, laid out alike (example axis first), as views of the whole-batch tensors.
    None when the pass does not fit the plan (:func:`whole_batch_pass`) or its ``layout``."""
    output_axes = {position: fold.axis for position, fold in layout.output_folds.items()}
    done = whole_batch_pass(side, plan, output_axes, cotangents)
    return None if done is None else read_per_example(side, plan, done, layout, cotangents is not None)


def read_per_example(
    side: Side, plan: Plan, done: WholeBatchPass, layout: WholeBatchLayout, contracted: bool
) -> Optional[SideFactors]:
    """The :class:`SideFactors` of a whole-batch pass ``done`` over ``side``, each ``G`` and operand
    read per example by ``layout`` (None where the pass's operands do not lie as ``layout`` says).

    Args:
        contracted: the pass was pulled back over cotangents, not a basis (see :func:`side_factors`).
    """
    examples = done.examples
    if len(done.operand_folds) != len(layout.operand_folds):
        return None
    operands = []
    for tensor, seen, fold in zip(done.operands, done.operand_folds, layout.operand_folds):
        if examples > 1 and seen.axis != fold.axis:
            return None
        operands.append(examples_first(tensor, fold, examples))
    positions = sorted(plan.perturbed_shapes)
    gradients = tuple(
        examples_first(gradient, layout.output_folds[position], examples, lead=1)  # (examples, B, *y)
        for gradient, position in zip(done.gradients, positions)
    )
    outputs = done.outputs
    output_shapes = [
        tuple(output.shape[:axis]) + tuple(output.shape[axis + 1 :]) for output, axis in zip(outputs, side.out_axes)
    ]
    uses = _uses(side, done.kept, output_shapes, gradients, iter(operands), contracted=contracted)
    fallback = None
    if plan.fallback and not contracted:
        fallback = side.jacobians(only=plan.fallback)
    return SideFactors(uses, fallback, outputs, per_example=False)


def _probe_roles(
    recorded: list[tuple[int, Role]], plan: Plan, positions: list[int], examples: int, operands: tuple
) -> Optional[tuple[list[tuple[int, Role]], tuple[Fold, ...]]]:
    """The roles of a whole-batch pass as :func:`_uses` takes them, ``(index of G, role)``, and
    where their operands hold the examples by their shapes.

    Each role is stated as the probe stated it for one example (its letters, ``y_shape`` and
    parameter coordinates), which the per-example tensors read from the whole batch then fill:
    a rule may state the batch otherwise than one example (an elementwise parameter of shape
    ``(1, T, D)`` is broadcast over the batch's first axis, but not over one example's size-1
    axis), and both are right. None unless every role is the probe's role of the same rule call,
    parameters and coordinates, and every operand is shaped as the probe's for ``examples``
    examples.
    """
    probed = plan.first_example_calls
    singles = [(position, role) for position in positions for role in plan.roles(probed[position])]
    if len(singles) != len(recorded):
        return None
    kept = []
    folds = []
    tensors = iter(operands)
    for (position, role), (single_position, single) in zip(recorded, singles):
        if position != single_position or not _same_use(role, single):
            return None
        for meta, _ in single.operands:
            tensor = next(tensors)
            fold = find_fold(tensor.shape, meta.shape, examples)
            if fold is None or tensor.dtype != meta.dtype:
                return None
            folds.append(fold)
        kept.append((positions.index(position), single))
    return kept, tuple(folds)


def _detached(operands: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The operands as the pass's aux results, detached where they still require gradients (the
    rules detach what they state, and each ``detach`` is an ATen call on every kernel call)."""
    return tuple(tensor.detach() if tensor.requires_grad else tensor for tensor in operands)


def _same_use(role: Role, single: Role) -> bool:
    """Whether a whole-batch role and one example's role state the same parameters' use."""
    return (
        role.name == single.name and role.unit == single.unit and len(role.operands) == len(single.operands)
        and all(one.same_coordinates(other) and one.injective == other.injective
                for one, other in zip(role.refs, single.refs))
    )


def _whole_batch_basis(outputs: tuple[torch.Tensor, ...], out_axes: Sequence[int]) -> tuple:
    """:func:`_identity_basis` of one example's outputs with every example's entry set at once:
    ``(B, *leaf.shape)`` per leaf, ``B`` the entries of one example's outputs."""
    singles = [tuple(output.shape[:axis]) + tuple(output.shape[axis + 1 :]) for output, axis in zip(outputs, out_axes)]
    sizes = [math.prod(shape) for shape in singles]
    total = sum(sizes)
    basis = []
    start = 0
    for output, axis, single, size in zip(outputs, out_axes, singles, sizes):
        eye = torch.eye(size, dtype=output.dtype, device=output.device)
        if size != total:  # several leaves: this leaf's rows of the basis, zero elsewhere
            eye = torch.cat([eye.new_zeros(start, size), eye, eye.new_zeros(total - start - size, size)])
        if single != (size,):
            eye = eye.reshape(total, *single)
        eye = eye.unsqueeze(1 + axis)
        # materialised: autograd may accumulate into a cotangent in place, which an expanded one forbids
        basis.append(eye.expand(total, *output.shape).contiguous())
        start += size
    return tuple(basis)


@contextlib.contextmanager
def whole_batch_context(side: Side) -> Iterator[None]:
    """What the per-example pass runs under (``Side.per_example``), for the whole-batch pass: its
    ``vmap`` over the basis meets the same kernels (fused recurrent and attention kernels). The
    model's fused kernels are decomposed by the pass's recorder (``Recorder(unfuse=...)``, NOTE:
    [The recorder unfuses]), not by a mode of their own."""
    with transformed(side.model, side.where, unfuse=False):
        yield
