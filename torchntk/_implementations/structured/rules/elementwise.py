"""Elementwise parameters: ``x * p``, ``p / x``, ``x + p``, ``x - p``, with ``p`` broadcast.

Aligning ``p``'s axes with ``y``'s from the right, an axis of ``y`` is either one of ``p``'s (the
Jacobian is diagonal there: ``y[.., k, ..]`` only depends on ``p[.., k, ..]``) or one ``p`` is
broadcast over (summed). With ``G = df/dy``:

    mul: J_p[k] = sum_{broadcast} G x            div (p the numerator): J_p[k] = sum_{broadcast} G / x
    add: J_p[k] = sum_{broadcast} G              sub: the same, times -1 when p is subtracted

(``alpha`` of ``add``/``sub`` scales the second operand.) ``x / p``, ``p * p`` and a rounding
division are not linear in ``p`` and go to the Jacobian fallback.
"""

from __future__ import annotations

import numbers
from typing import Callable, Optional

import torch

from .._roles import Role, RuleCall, letters
from ._registry import RefOf, rule

Tensor = torch.Tensor
_ATEN = torch.ops.aten  # the overloads a traced graph calls (NOTE: [Unrolled derivatives])


@rule(torch.mul, Tensor.mul, Tensor.__mul__, _ATEN.mul.Tensor, _ATEN.mul.Scalar)
def mul_rule(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf) -> Optional[RuleCall]:
    """``x * p`` or ``p * x``."""
    return _product(func, args, kwargs, ref_of, divide=False)


@rule(torch.div, Tensor.div, Tensor.__truediv__, _ATEN.div.Tensor)
def div_rule(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf) -> Optional[RuleCall]:
    """``p / x`` (true division only)."""
    if kwargs.get("rounding_mode") is not None or len(args) > 2:
        return None
    return _product(func, args, kwargs, ref_of, divide=True)


@rule(torch.add, Tensor.add, Tensor.__add__, _ATEN.add.Tensor)
def add_rule(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf) -> Optional[RuleCall]:
    """``x + p`` or ``p + x``, with ``alpha``."""
    return _sum(func, args, kwargs, ref_of, sign=1.0)


@rule(torch.sub, Tensor.sub, Tensor.__sub__, _ATEN.sub.Tensor)
def sub_rule(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf) -> Optional[RuleCall]:
    """``x - p`` or ``p - x``, with ``alpha``."""
    return _sum(func, args, kwargs, ref_of, sign=-1.0)


def _operands(args: tuple, kwargs: dict) -> Optional[tuple]:
    """The two operands, or ``None`` for a call this family does not cover (``out=`` and the like)."""
    if len(args) != 2 or set(kwargs) - {"alpha"}:
        return None
    return args


def _product(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf, divide: bool) -> Optional[RuleCall]:
    operands = _operands(args, kwargs)
    if operands is None or kwargs:
        return None
    first, second = operands
    first_ref, second_ref = ref_of(first), ref_of(second)
    if (first_ref is None) == (second_ref is None) or (divide and first_ref is None):
        return None
    param, other, ref = (first, second, first_ref) if first_ref is not None else (second, first, second_ref)
    output = func(*args, **kwargs)
    if not isinstance(other, (torch.Tensor, numbers.Number)) or isinstance(other, bool):
        return None

    def build():
        g_labels, param_labels, param_shape = _broadcast_labels(param, output)
        if isinstance(other, numbers.Number):
            scale = 1.0 / other if divide else float(other)
            operands_ = []
        else:
            factor = other.detach().to(output.dtype).reciprocal() if divide else other.detach().clone()
            scale, operands_ = 1.0, [(torch.broadcast_to(factor, output.shape), g_labels)]
        local = (lambda p: func(p, other)) if param is first else (lambda p: func(other, p))
        role = Role(
            (ref,), "elementwise factor", tuple(output.shape), g_labels, operands_, param_labels, param_shape, scale,
            local, param,
        )
        return [role], None

    return RuleCall(output, build)


def _sum(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf, sign: float) -> Optional[RuleCall]:
    operands = _operands(args, kwargs)
    if operands is None:
        return None
    first, second = operands
    first_ref, second_ref = ref_of(first), ref_of(second)
    if (first_ref is None) == (second_ref is None):
        return None
    alpha = kwargs.get("alpha", 1)
    param, ref = (first, first_ref) if first_ref is not None else (second, second_ref)
    if not isinstance(param, torch.Tensor):
        return None
    scale = 1.0 if param is first else sign * float(alpha)
    output = func(*args, **kwargs)

    def build():
        g_labels, param_labels, param_shape = _broadcast_labels(param, output)
        local = (lambda p: func(p, second, **kwargs)) if param is first else (lambda p: func(first, p, **kwargs))
        role = Role(
            (ref,), "elementwise term", tuple(output.shape), g_labels, [], param_labels, param_shape, scale, local,
            param,
        )
        return [role], None

    return RuleCall(output, build)


def _broadcast_labels(param: torch.Tensor, output: torch.Tensor) -> tuple[str, str, tuple[int, ...]]:
    """Letters of ``y``'s axes, the subset that are ``p``'s own (not broadcast), and their sizes."""
    names = letters(output.ndim)
    offset = output.ndim - param.ndim
    own = [
        axis for axis in range(output.ndim)
        if axis >= offset and param.shape[axis - offset] == output.shape[axis]
    ]
    return names, "".join(names[axis] for axis in own), tuple(output.shape[axis] for axis in own)
