"""``x @ W`` and ``W @ x`` (``torch.matmul``, ``Tensor.matmul``, ``mm``) with a 1-D or 2-D parameter,
and ``addmm(b, x, W)``.

Parameter on the right, ``y[s, j] = sum_i x[s, i] W[i, j]`` (leading axes of ``x`` flattened into
``s``): ``J_W[i, j] = sum_s x[s, i] G[s, j]``, the linear-layer rule with the weight transposed. A
1-D ``w`` drops ``j``. Parameter on the left, ``y[s, c, k] = sum_i W[c, i] x[s, i, k]``:
``J_W[c, i] = sum_{s,k} G[s, c, k] x[s, i, k]``. A parameter with more axes (a batched product)
or on both sides goes to the Jacobian fallback.

``addmm(b, x, W, beta=β, alpha=α) = β b + α x W`` is how Hugging Face's ``Conv1D`` (GPT-2's
linear layers) computes ``x W + b``: the weight is the right-hand rule scaled by ``α``, a bias of
one entry per column is ``J_b[j] = β sum_s G[s, j]``. A bias of another shape, or ``x`` a
parameter, goes to the fallback.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .._roles import ParamRef, Role, RuleCall
from ._common import bind
from ._registry import RefOf, rule

Tensor = torch.Tensor


@rule(torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.mm, Tensor.mm, torch.ops.aten.mm.default)
def matmul_rule(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf) -> Optional[RuleCall]:
    """A product with the parameter on exactly one side."""
    left, right = bind(args, kwargs, ("input", "other"), {})
    left_ref, right_ref = ref_of(left), ref_of(right)
    if (left_ref is None) == (right_ref is None):
        return None
    output = func(*args, **kwargs)
    if right_ref is not None:
        return _parameter_on_the_right(func, left, right, right_ref, output)
    return _parameter_on_the_left(func, left, right, left_ref, output)


def _parameter_on_the_right(
    func: Callable, x: Tensor, weight: Tensor, ref: ParamRef, output: Tensor
) -> Optional[RuleCall]:
    if weight.ndim not in (1, 2) or x.ndim < 1:
        return None
    features = weight.shape[0]
    positions = x.numel() // features if features else 0

    def build():
        inputs = x.detach().reshape(positions, features).clone()
        local = lambda w: func(x, w)  # noqa: E731
        if weight.ndim == 1:
            role = Role(
                (ref,), "matmul operand", (positions,), "s", [(inputs, "si")], "i", (features,),
                local=local, seen=weight,
            )
            return [role], None
        return [_right_weight_role(ref, "matmul operand", inputs, weight, local)], None

    return RuleCall(output, build)


def _right_weight_role(
    ref: ParamRef, name: str, inputs: Tensor, weight: Tensor, local: Callable, scale: float = 1.0
) -> Role:
    """``J_W[i, j] = scale sum_s inputs[s, i] G[s, j]`` for ``y = scale inputs @ W (+ ...)``, with
    ``inputs`` the detached ``(S, I)`` left operand."""
    positions, features = inputs.shape
    columns = weight.shape[1]
    return Role(
        (ref,), name, (positions, columns), "sj", [(inputs, "si")], "ij", (features, columns), scale=scale,
        local=local, seen=weight,
    )


def _parameter_on_the_left(
    func: Callable, weight: Tensor, x: Tensor, ref: ParamRef, output: Tensor
) -> Optional[RuleCall]:
    if weight.ndim != 2 or x.ndim < 1:
        return None
    rows, features = weight.shape

    def build():
        local = lambda w: func(w, x)  # noqa: E731
        if x.ndim == 1:
            inputs = x.detach().clone()
            role = Role(
                (ref,), "matmul operand", (rows,), "c", [(inputs, "i")], "ci", (rows, features),
                local=local, seen=weight,
            )
            return [role], None
        columns = x.shape[-1]
        positions = x.numel() // (features * columns) if features * columns else 0
        inputs = x.detach().reshape(positions, features, columns).clone()
        role = Role(
            (ref,), "matmul operand", (positions, rows, columns), "sck", [(inputs, "sik")], "ci", (rows, features),
            local=local, seen=weight,
        )
        return [role], None

    return RuleCall(output, build)


@rule(torch.addmm, Tensor.addmm, torch.ops.aten.addmm.default)
def addmm_rule(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf) -> Optional[RuleCall]:
    """``beta * b + alpha * (x @ W)`` with the weight and/or a per-column bias as parameters."""
    bias, x, weight, beta, alpha = bind(args, kwargs, ("input", "mat1", "mat2", "beta", "alpha"),
                                        {"beta": 1, "alpha": 1})
    bias_ref, weight_ref = ref_of(bias), ref_of(weight)
    if ref_of(x) is not None or (bias_ref is None and weight_ref is None) or x.ndim != 2 or weight.ndim != 2:
        return None
    if not all(isinstance(value, (int, float)) for value in (beta, alpha)):
        return None
    positions, columns = x.shape[0], weight.shape[1]
    if bias_ref is not None and tuple(bias.shape) != (columns,):
        return None
    output = func(*args, **kwargs)

    def build():
        roles = []
        if weight_ref is not None:
            local = lambda w: func(bias, x, w, beta=beta, alpha=alpha)  # noqa: E731
            roles.append(_right_weight_role(weight_ref, "weight", x.detach().clone(), weight, local, float(alpha)))
        if bias_ref is not None:
            roles.append(Role(
                (bias_ref,), "bias", (positions, columns), "sj", [], "j", (columns,), scale=float(beta),
                local=lambda b: func(b, x, weight, beta=beta, alpha=alpha), seen=bias,
            ))
        return roles, None

    return RuleCall(output, build)
