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
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch.func import jacfwd, jacrev, vjp, vmap

from ..._call.per_example import Side
from ._plan import Plan
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


@dataclass
class SideFactors:
    """Everything one side contributes to the contraction, and the side's per-example outputs."""

    uses: list[Use]
    fallback: Optional[tuple[tuple[torch.Tensor, ...], ...]]
    outputs: tuple[torch.Tensor, ...]

    def narrow(self, start: int, length: int, out_axes: tuple[int, ...]) -> "SideFactors":
        """The factors of examples ``start .. start + length - 1`` (mapped sides: operands' axis 0)."""
        uses = [
            Use(
                dataclasses.replace(
                    use.role,
                    operands=[(tensor.narrow(0, start, length), labels) for tensor, labels in use.role.operands],
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
        return SideFactors(uses, fallback, outputs)


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
    """

    calls: list[RuleCall]
    output_specs: list[OutputSpec]
    unruled: set[int]
    reasons: dict[int, str]


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
    recorder = Recorder(side.model.params, looped=side.loop)

    def record(x_leaves: tuple, kwarg_leaves: tuple) -> None:
        with torch.no_grad(), recorder:
            side.evaluate(side.model.params, x_leaves, kwarg_leaves)
        for call in recorder.calls:
            call.keep_shapes_only()

    def run(x_leaves: tuple, kwarg_leaves: tuple) -> torch.Tensor:
        under_a_transform(lambda: record(x_leaves, kwarg_leaves))
        return torch.zeros(())

    side.per_example(run)
    return Probe(recorder.calls, recorder.output_specs, recorder.unruled, recorder.reasons)


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
    side: Side, plan: Plan, chunk_size: Optional[int] = None, cotangents: Optional[tuple[torch.Tensor, ...]] = None
) -> SideFactors:
    """``G`` and operands of every contributing use, plus the fallback parameters' Jacobians.

    With ``cotangents`` (shaped like the outputs) ``G`` is contracted with them instead of a basis:
    ``gradients`` then holds one tensor of shape ``role.y_shape`` (after the example axis when
    mapped), the ``G``-side of ``J^T v`` (used by ``verify``).
    """
    params = side.model.params
    kept_roles = _KeptRoles()

    def run(x_leaves: tuple, kwarg_leaves: tuple, *cotangent_leaves: torch.Tensor) -> tuple:
        def perturbed_model(deltas: tuple[torch.Tensor, ...]) -> tuple:
            # One pass records the rule calls, builds their operands and perturbs their outputs.
            recorder = Recorder(params, dict(zip(positions, deltas)), looped=side.loop)
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
            return outputs, tuple(tensor.detach() for _, role in kept for tensor, _ in role.operands)

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
            recorder = Recorder(params, looped=side.loop)
            with torch.no_grad(), recorder:
                under_a_transform(lambda: side.evaluate(params, x_leaves, kwarg_leaves))
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
    gradients, operands, outputs = side.per_example(run, extra, extra_dims)
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
        contracted: ``G`` was contracted with cotangents instead of a basis (``B`` is 1).
    """
    sizes = [math.prod(shape) for shape in output_shapes]
    example_axes = 1 if side.mapped else 0
    uses = []
    for gradient_index, role in kept:
        role = dataclasses.replace(role, operands=[(next(operands), labels) for _, labels in role.operands])
        gradient = gradients[gradient_index]  # ([N,] B, *y)
        if contracted:
            per_leaf = (gradient.reshape(*gradient.shape[:example_axes], *role.y_shape),)
        else:
            per_leaf = tuple(
                _place(part, shape, role.y_shape, side, leaf)
                for leaf, (part, shape) in enumerate(zip(gradient.split(sizes, dim=example_axes), output_shapes))
            )
        uses.append(Use(role, per_leaf))
    return uses


def _place(gradient: torch.Tensor, output_shape: tuple, y_shape: tuple, side: Side, leaf: int) -> torch.Tensor:
    """``([N,] B_leaf, *y) -> output.shape + y_shape``, the example axis moved to the output's batch axis."""
    if not side.mapped:
        return gradient.reshape(*output_shape, *y_shape)
    gradient = gradient.reshape(gradient.shape[0], *output_shape, *y_shape)
    return gradient.movedim(0, side.out_axes[leaf])


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
