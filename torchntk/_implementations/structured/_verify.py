"""A cheap check of the structured factors against autograd: ``J^T v`` for one random ``v``.

For a random cotangent ``v`` shaped like the x1 outputs, autograd gives ``J_p^T v`` for every
parameter with one backward pass. The structured side gives the same from one perturbed pass
with ``v`` as the cotangent, contracted with the rules' operands. They must agree for every
parameter the rules cover, and autograd must give zero for parameters no op was seen consuming.
Because ``v`` differs between examples, the check also catches examples that interact.
"""

from __future__ import annotations

import math

import opt_einsum
import torch
from torch.func import vjp

from ..._call import KernelCall
from ._plan import Plan
from ._side import Use, side_factors

_RTOL = {torch.float64: 1e-8, torch.complex128: 1e-8}
_DEFAULT_RTOL = 1e-3


def verify(call: KernelCall, plan: Plan) -> None:
    """Raises ValueError naming the first parameter whose structured ``J^T v`` is wrong."""
    side = call.side1
    params = side.model.params
    generator = torch.Generator(device="cpu").manual_seed(0)
    cotangents = tuple(
        torch.randn(output.shape, generator=generator, dtype=output.dtype).to(output.device) for output in call.outputs1
    )
    _, pullback = vjp(lambda p: side.whole_batch()(p), params)
    (autograd,) = pullback(cotangents)
    factors = side_factors(side, plan, cotangents=cotangents)
    structured: dict[tuple[int, ...], torch.Tensor] = {}
    for use in factors.uses:
        value = _transposed_product(use, side.mapped, params)
        unit = use.role.unit
        structured[unit] = value if unit not in structured else structured[unit] + value
    covered = set()
    for unit, value in structured.items():
        covered.update(unit)
        if len(unit) == 1:
            expected = autograd[unit[0]].reshape(-1)
            _compare(value, expected, [unit[0]], call, "J^T v")
        else:  # a joint role lives in its own coordinates; compare norms
            expected = torch.cat([autograd[index].reshape(-1) for index in unit])
            _compare(value.norm().reshape(1), expected.norm().reshape(1), list(unit), call, "|J^T v|")
    for index, gradient in enumerate(autograd):
        if index in covered or index in plan.fallback:
            continue
        scale = max(g.abs().max().item() for g in autograd if g.numel())
        if gradient.numel() and gradient.abs().max().item() > _tolerance(gradient.dtype) * max(scale, 1e-30):
            raise ValueError(
                f"{call.where}: structured derivatives saw no operation consuming parameter "
                f"{side.model.names[index]!r}, but it changes the output (|J^T v| = "
                f"{gradient.norm().item():.3g}). It is consumed where a torch function mode cannot "
                f"see it (TorchScript, torch._C.DisableTorchFunction, a C++ extension). Use "
                f"implementation=1 for this model."
            )


def _transposed_product(use: Use, mapped: bool, params) -> torch.Tensor:
    """The structured ``J^T v`` of one use, in the parameter's coordinates (flat)."""
    role = use.role
    batch = opt_einsum.get_symbol(5000) if mapped else ""
    terms = [batch + role.g_labels] + [batch + labels for _, labels in role.operands]
    tensors = [use.gradients[0]] + [tensor for tensor, _ in role.operands]
    dtype = tensors[0].dtype
    for tensor in tensors[1:]:
        dtype = torch.promote_types(dtype, tensor.dtype)
    value = opt_einsum.contract(",".join(terms) + "->" + role.param_labels, *[t.to(dtype) for t in tensors], backend="torch")
    value = value.reshape(math.prod(role.param_shape)) * role.scale
    ref = role.refs[0]
    if role.joint or ref.index is None:
        return value
    full = value.new_zeros(params[ref.param].numel())
    return full.index_add_(0, ref.index.reshape(-1).to(value.device), value)


def _tolerance(dtype: torch.dtype) -> float:
    return _RTOL.get(dtype, _DEFAULT_RTOL)


def _compare(value: torch.Tensor, expected: torch.Tensor, indices: list[int], call: KernelCall, what: str) -> None:
    expected = expected.to(value.dtype)
    scale = max(expected.abs().max().item(), value.abs().max().item(), 1e-30)
    error = (value - expected).abs().max().item()
    if error > _tolerance(value.dtype) * scale:
        names = ", ".join(repr(call.model.names[index]) for index in indices)
        raise ValueError(
            f"{call.where}: structured derivatives disagree with autograd for parameter {names}: "
            f"{what} differs by {error:.3g} (largest entry {scale:.3g}). Either the parameter is also "
            f"consumed where the recorder cannot see it, or the model couples examples despite "
            f"`vmap_axes`. Use implementation=1 for this model."
        )
