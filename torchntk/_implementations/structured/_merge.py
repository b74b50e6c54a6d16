"""Uses of one parameter stated alike, merged into one use before the pair contractions.

NOTE: [Merged uses]
A parameter consumed ``T`` times by ops of the same kind and shapes (an RNN's ``w_hh`` at every
time step, a weight shared by several branches) has ``J_p = sum_u G_u Y_u``. Its uses differ only
in their tensors, so they stack along a new axis ``u`` that every term of the use carries and that
is summed on its own side: the stacked use states ``J_p`` itself, and one pair einsum covers all
``T^2`` pairs of uses (the ``T(T+1)/2`` einsums of ``x2=None`` become one). opt_einsum then sees
the whole sum and may form ``J`` once per side instead of ``T`` Gram pairs when that is cheaper.

Uses merge when their roles agree in everything but the tensors: the parameter unit and its
coordinates (the same entries in the same order), the letters, the shapes and dtypes, and the
scale. The sum over ``u`` runs in another order than the sum over pairs, so the kernel changes by
rounding only.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Optional, Sequence

import torch

from ._roles import _ALPHABET, ParamRef
from ._side import SideFactors, Use

Pays = Callable[[Use, Use, int], bool]
"""``pays(single, stacked, count)``: whether contracting ``stacked`` (``count`` uses like ``single``)
costs less than contracting the ``count^2`` pairs of them one by one."""


def merged_factors(factors: SideFactors, mapped: bool, pays: Optional[Pays] = None) -> SideFactors:
    """``factors`` with every group of alike uses stacked into one (:func:`merged_uses`)."""
    uses = merged_uses(factors.uses, mapped, pays)
    if uses is factors.uses:
        return factors
    return SideFactors(uses, factors.fallback, factors.outputs)


def merged_uses(uses: Sequence[Use], mapped: bool, pays: Optional[Pays] = None) -> list[Use]:
    """The uses with every group of alike ones (NOTE: [Merged uses]) stacked into one use.

    Args:
        uses: one side's uses, in recording order.
        mapped: whether the operands carry a leading example axis (``vmap_axes``).
        pays: decides whether a group is merged (default: always).

    Returns:
        ``uses`` itself when no two uses are alike; else a new list, each group at the position of
        its first use.
    """
    groups: dict[Hashable, list[list[Use]]] = {}
    order: list[list[Use]] = []
    for use in uses:
        candidates = groups.setdefault(_signature(use), [])
        for group in candidates:
            if _same_coordinates(group[0].role.refs, use.role.refs):
                group.append(use)
                break
        else:
            group = [use]
            candidates.append(group)
            order.append(group)
    if len(order) == len(uses):
        return uses if isinstance(uses, list) else list(uses)
    merged: list[Use] = []
    for group in order:
        stacked = _stacked(group, mapped) if len(group) > 1 else None
        if stacked is not None and (pays is None or pays(group[0], stacked, len(group))):
            merged.append(stacked)
        else:
            merged.extend(group)
    return merged


def _signature(use: Use) -> Hashable:
    role = use.role
    return (
        role.unit, role.y_shape, role.g_labels, role.param_labels, role.param_shape, role.scale,
        tuple((tuple(tensor.shape), tensor.dtype, tensor.device, labels) for tensor, labels in role.operands),
        tuple((tuple(gradient.shape), gradient.dtype) for gradient in use.gradients),
    )


def _same_coordinates(first: tuple[ParamRef, ...], second: tuple[ParamRef, ...]) -> bool:
    return all(one.same_coordinates(two) for one, two in zip(first, second))


def _stacked(group: list[Use], mapped: bool) -> Optional[Use]:
    """One use stating the sum of the group's ``J``: every term gains a new summed letter (None
    when the role already uses every letter)."""
    role = group[0].role
    taken = set(role.g_labels) | set(role.param_labels) | {letter for _, labels in role.operands for letter in labels}
    stack = next((letter for letter in _ALPHABET if letter not in taken), None)
    if stack is None:
        return None
    operand_axis = 1 if mapped else 0  # after the operands' example axis
    operands = [
        (torch.stack([use.role.operands[k][0] for use in group], dim=operand_axis), stack + labels)
        for k, (_, labels) in enumerate(role.operands)
    ]
    gradients = []
    for leaf, gradient in enumerate(group[0].gradients):
        axis = gradient.ndim - len(role.y_shape)  # G is (*output, *y)
        gradients.append(torch.stack([use.gradients[leaf] for use in group], dim=axis))
    merged = dataclasses.replace(
        role,
        name=f"{role.name} x{len(group)}",
        y_shape=(len(group), *role.y_shape),
        g_labels=stack + role.g_labels,
        operands=operands,
        local=None,
        seen=None,
    )
    return Use(merged, tuple(gradients))
