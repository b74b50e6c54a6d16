"""x1 and x2 in one ``df/dy`` pass: their examples concatenated, the factors split afterwards.

NOTE: [One pass for both sides]
With ``vmap_axes`` every example's factors come from its own pass (NOTE: [df/dy by perturbed
passes]), or from a whole-batch pass read per example (NOTE: [Whole-batch pullback]), so the two
sides' examples may as well share one batched pass: the fixed cost of a pass
(recording, ``vjp``, ``vmap`` over the output basis: about 2 ms on a 2-core CPU, most of a call at
N=16) is paid once, and every backward matrix product is one product with twice the rows, which
a CPU runs nearer its peak (a ``(640, 2048) x (2048, 2048)`` product at 322 GFLOP/s against 276
for ``(320, 2048)``). The concatenated factors are then narrowed back into the two sides, which
sees each example exactly as its own pass would.

The sides are joined only when nothing but the examples differs: the same input structure and
mapped axes, the same shapes apart from the batch axis, and the very same unmapped leaves; and
only while the joint pass's ``G`` stays small (:data:`MAX_JOINED_GRADIENTS` elements): beyond,
the fixed cost is small next to the work and the larger working set costs more than the larger
products gain (measured with one thread: 20-35% faster on the benchmark MLPs at N=16 and 64,
within noise for the wide MLP at N=64, 0-7% slower for it at N=256 and 10-15% slower on the
benchmark CNN at N=64, whose ``G`` holds 25 thousand entries per output and example).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from ..._call.kernel_call import KernelCall
from ..._call.per_example import Side
from ..._utils.tree import Flat
from ._plan import Plan

MAX_JOINED_GRADIENTS = 2**22
"""The most entries of ``G`` (all uses, outputs and examples: 16 MiB in float32) a joint pass may
hold (NOTE: [One pass for both sides])."""


def gradients_per_example(call: KernelCall, plan: Plan) -> Optional[int]:
    """Entries of ``G`` per example of x1 under ``plan``: output entries times perturbed entries
    (None when the plan does not perturb, or x1 is not mapped or empty)."""
    if plan.perturbed_shapes is None or not call.side1.mapped or not call.side1.batch_size():
        return None
    outputs = sum(output.numel() for output in call.outputs1) // call.side1.batch_size()
    return outputs * sum(math.prod(shape) for shape, _ in plan.perturbed_shapes.values())


def joinable(side1: Side, side2: Side, gradients_per_example: Optional[int]) -> bool:
    """Whether :func:`joined` joins the two sides (without joining them): see its conditions."""
    if not (side1.mapped and side2.mapped) or side1.loop or side2.loop or gradients_per_example is None:
        return False
    if (side1.batch_size() + side2.batch_size()) * gradients_per_example > MAX_JOINED_GRADIENTS:
        return False
    if side1.x_axes != side2.x_axes or side1.kwarg_axes != side2.kwarg_axes or side1.out_axes != side2.out_axes:
        return False
    if side1.kwargs.keys() != side2.kwargs.keys():
        return False
    pairs = [(side1.x, side2.x, side1.x_axes)]
    pairs += [(flat, side2.kwargs[key], side1.kwarg_axes[key]) for key, flat in side1.kwargs.items()]
    return all(_joinable_flat(one, two, axes) for one, two, axes in pairs)


def joined(side1: Side, side2: Side, gradients_per_example: Optional[int]) -> Optional[Side]:
    """One side holding the examples of ``side1`` then those of ``side2``, or None when they differ
    in more than their examples, are not mapped, or their ``G`` (``gradients_per_example`` entries
    per example; None: unknown) would exceed :data:`MAX_JOINED_GRADIENTS`."""
    if not joinable(side1, side2, gradients_per_example):
        return None
    x = _joined_flat(side1.x, side2.x, side1.x_axes)
    kwargs = {key: _joined_flat(flat, side2.kwargs[key], side1.kwarg_axes[key]) for key, flat in side1.kwargs.items()}
    return dataclasses.replace(side1, x=x, kwargs=kwargs, offset=0)


def _joinable_flat(one: Flat, two: Flat, axes: tuple[Optional[int], ...]) -> bool:
    if not one.same_structure(two) or len(one.leaves) != len(two.leaves):
        return False
    for first, second, axis in zip(one.leaves, two.leaves, axes):
        if axis is None:
            if first is not second:  # an unmapped leaf both sides share; anything else is not one pass
                return False
            continue
        if not (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor)):
            return False
        shape1, shape2 = list(first.shape), list(second.shape)
        if first.dtype != second.dtype or first.device != second.device or len(shape1) != len(shape2):
            return False
        shape1[axis] = shape2[axis] = 0
        if shape1 != shape2:
            return False
    return True


def _joined_flat(one: Flat, two: Flat, axes: tuple[Optional[int], ...]) -> Flat:
    """The leaves of two joinable flats (:func:`_joinable_flat`), mapped ones concatenated."""
    leaves = [
        first if axis is None else torch.cat([first, second], dim=axis)
        for first, second, axis in zip(one.leaves, two.leaves, axes)
    ]
    return dataclasses.replace(one, leaves=tuple(leaves))
