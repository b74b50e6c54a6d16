"""The structured factors against autograd: ``J_p^T v`` for one random ``v``, per parameter.

NOTE: [Checking a plan against autograd]
For a random cotangent ``v`` shaped like a side's outputs, autograd gives ``J_p^T v`` for every
parameter ``p`` with one backward pass of the same per-example function the kernel
differentiates. The structured side gives the same from one perturbed pass with ``v`` as the
cotangent, contracted with the rules' operands (a joint weight+bias role split back into its two
parameters). They must agree entry by entry for every parameter the rules cover, and autograd
must give exactly zero for parameters no op was seen consuming; a disagreement means the recorder
missed a use (TorchScript, ``torch._C.DisableTorchFunction``, a C++ extension) or a rule was
applied where it does not hold.

An entry agrees when ``|structured - autograd| <= rtol * (bound + |autograd| + _FLOOR * max bound)``,
where ``bound`` is the same contraction over absolute values: the size of the terms summed, which
bounds the rounding error of both sides (they share the backward pass down to the ops' outputs),
and the largest bound of the parameter stands for the rounding of autograd's own products, which
follows their largest terms (:data:`_FLOOR`). ``rtol`` is tight in float64 and looser where
float32 products may run in TF32 (CUDA).

When a plan is made this runs on the probe example(s) and demotes disagreeing parameters to the
Jacobian fallback (:func:`disagreements`); ``verify=True`` runs it on all of x1 on every call and
raises instead (:func:`verify`). Because ``v`` differs between examples, the check also catches
examples that interact despite ``vmap_axes``. Under a plan whose passes run over the whole batch
(NOTE: [Whole-batch pullback] in ``_side.py``) the structured side of ``verify=True`` comes from
that pass, so it is checked against autograd as well; the plan's own check runs before that is
decided, on the per-example pass.
"""

from __future__ import annotations

import math
from typing import Optional

import opt_einsum
import torch
from opt_einsum.parser import convert_to_valid_einsum_chars
from torch.func import vjp

from ..._call.kernel_call import KernelCall
from ..._call.per_example import Side
from ..._utils.types import promoted
from ._plan import Plan
from ._roles import Role
from ._side import SideFactors, Use, side_factors

_RTOL = {torch.float64: 1e-9, torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 5e-2}
_TF32_RTOL = 2e-2
"""TF32 products keep 10 mantissa bits: ``2^-11`` relative error per product, on either side."""

_FLOOR = 1e-2
"""An entry's error is also allowed ``rtol * _FLOOR`` of the parameter's largest bound: autograd's
own products round relative to their largest terms. ResNet-18's float32 convolution weight
gradients on the CPU (oneDNN, whose kernels vary from run to run) were off by up to 3e-3 of
entries a thousand times smaller than the largest, which is 3.5e-7 of the largest bound, and that
demoted a parameter in one run out of six."""
_HIDDEN = "(TorchScript, torch._C.DisableTorchFunction, a C++ extension)"


def disagreements(
    side: Side, plan: Plan, seed: int = 0, cotangents: Optional[tuple[torch.Tensor, ...]] = None,
    factors: Optional[SideFactors] = None, expected: Optional[tuple[torch.Tensor, ...]] = None,
) -> dict[int, str]:
    """Parameters outside the plan's fallback whose structured ``J^T v`` is wrong, with why.

    Args:
        side: the examples to check on (all of them: narrow the side first for a cheap check).
        plan: the plan to check.
        seed: seeds the random cotangent.
        cotangents: the cotangent ``v``, laid out like the side's outputs, instead of a random one.
        factors: the side's per-example factors contracted with ``cotangents`` under ``plan``
            (``per_example_factors``), where the caller has them: the whole-batch check compares
            the same factors (NOTE: [Whole-batch pullback]), so one pass serves both checks.
        expected: autograd's ``J^T v`` for ``cotangents`` to compare with, one tensor per
            parameter, instead of the per-example products this computes (the examples as one
            batch: NOTE: [The derivative check within a plan's check]).

    Returns:
        ``{parameter index: reason}``, empty when every parameter agrees.
    """
    params = side.model.params
    if expected is None:
        cotangents, autograd = _autograd_products(side, seed, cotangents)
    else:
        autograd = expected
    if factors is None:
        factors = side_factors(side, plan, cotangents=cotangents)
    consumed = {index for use in factors.uses for index in use.role.unit}
    found = {}
    references = {}
    for index, reference in enumerate(autograd):
        if index in plan.fallback:
            continue
        reference = reference.reshape(-1)
        if index not in consumed:
            if reference.count_nonzero():
                found[index] = (
                    f"no operation the recorder saw consumes it, but autograd's J^T v is not zero "
                    f"(norm {reference.norm().item():.3g}): it is consumed where a torch function mode cannot "
                    f"see it {_HIDDEN}"
                )
            continue
        references[index] = reference
    doubtful = _doubtful(factors, params, side.mapped, references)
    if not doubtful:
        return found
    # the entrywise test, and the bounds (a second contraction, of absolute values) only where
    # that cannot decide, for the parameters the streamed test left in doubt
    values = _structured_products(factors, params, side.mapped, doubtful)
    compared = {index: (values[index], references[index]) for index in doubtful}
    if _all_agree_without_bounds(list(compared.values())):
        return found
    bounds = _structured_products(factors, params, side.mapped, doubtful, absolute=True)
    triples = {index: (value, bounds[index], reference) for index, (value, reference) in compared.items()}
    if not _all_agree(list(triples.values())):  # then find which, one by one, to say why
        for index, (value, bound, reference) in triples.items():
            reason = _compare(value, bound, reference)
            if reason is not None:
                found[index] = reason
    return found


@torch.no_grad()  # a comparison: no graph (the factors require gradients inside derivatives of the model)
def _doubtful(
    factors: SideFactors, params: tuple[torch.Tensor, ...], mapped: bool, references: dict[int, torch.Tensor]
) -> set[int]:
    """The parameters of ``references`` (autograd's ``J^T v``, flat) whose structured ``J^T v``
    fails the quick test of :func:`_all_agree_without_bounds` (the largest difference within
    ``rtol * _FLOOR`` of the largest reference entry), or all of them where that test cannot be
    shared (dtypes or devices that differ); one synchronisation.

    NOTE: [Streamed comparisons]
    The check holds three parameter-sized tensors per parameter if it forms them all before
    comparing: autograd's products, the structured ones and their differences. That is 1.1 GB
    beside the call on a RoBERTa-base-size model with all its 92M parameters differentiated, whose
    first call then peaked at 2.9 GB and, faulting in that fresh memory on the CPU, took 4.4 s
    against 0.5 s for a warm call (docs/benchmarks.md, "The plan check, one parameter at a time").
    So the structured products are formed one use at a time and compared as soon as a parameter's
    uses are summed, each difference written into one scratch buffer of the largest parameter's
    size; a product is freed before the next is formed. Only the parameters left in doubt are
    formed again, for the entrywise test and its bounds.
    """
    if not references:
        return set()
    rtol = _shared_tolerance([tuple(references.values())])
    if rtol is None:
        return set(references)
    uses_left: dict[int, int] = {}
    for use in factors.uses:
        for index in use.role.unit:
            if index in references:
                uses_left[index] = uses_left.get(index, 0) + 1
    reference = next(iter(references.values()))
    scratch = reference.new_empty(max(tensor.numel() for tensor in references.values()))
    sums: dict[int, torch.Tensor] = {}
    order, measured = [], []
    for use in factors.uses:
        if not any(index in references for index in use.role.unit):
            continue
        # a joint role's weight unflattened: flat, its slice of the product would be a copy
        for index, part in _per_parameter(use.role, _transposed_product(use, mapped), params, flat=False):
            if index not in references:
                continue
            sums[index] = part if index not in sums else sums[index].reshape(-1) + part.reshape(-1)
            uses_left[index] -= 1
            if uses_left[index]:
                continue
            value, reference = sums.pop(index), references[index]
            if (value.dtype, value.device) != (reference.dtype, reference.device):
                return set(references)
            if value.numel():
                gap = torch.sub(value, reference.view(value.shape), out=scratch[: value.numel()].view(value.shape))
                measured.append(torch.stack([_largest(gap), _largest(reference)]))
                order.append(index)
        part = value = None  # the product is freed before the next one is formed
    if not measured:
        return set()
    largest = torch.stack(measured)
    quick = (largest[:, 0] <= rtol * _FLOOR * largest[:, 1]).tolist()  # NaN is no agreement
    return {index for index, ok in zip(order, quick) if not ok}


def _largest(tensor: torch.Tensor) -> torch.Tensor:
    """``max |tensor|`` as a 0-dim tensor, without a tensor of absolute values."""
    low, high = torch.aminmax(tensor)
    return torch.maximum(-low, high)


def _structured_products(
    factors: SideFactors, params: tuple[torch.Tensor, ...], mapped: bool, only: set[int], absolute: bool = False
) -> dict[int, torch.Tensor]:
    """``{parameter index: structured J^T v}``, flat, summed over the uses, for the parameters
    ``only`` (and any sharing a joint role with them); with ``absolute``, the same contractions
    over absolute values instead: the entries' rounding bounds."""
    structured: dict[int, torch.Tensor] = {}
    for use in factors.uses:
        if only.isdisjoint(use.role.unit):
            continue
        for index, part in _per_parameter(use.role, _transposed_product(use, mapped, absolute), params):
            structured[index] = part if index not in structured else structured[index] + part
    return structured


def _all_agree_without_bounds(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Whether every ``(value, expected)`` is within ``rtol * (|expected| + _FLOOR * max |expected|)``,
    with one synchronisation (two for parameters that need the entrywise test): a tolerance never
    looser than :func:`_compare`'s (the bound of an entry is at least its value, and so at least
    about ``|expected|``), so passing it passes that too, without the contraction of absolute values
    the bound costs (on a ResNet-18, most of the check). Most parameters pass on their largest
    difference alone (``max |value - expected| <= rtol * _FLOOR * max |expected|``), which reads each
    tensor once. False where it cannot tell (other dtypes or devices, NaN, an entry beyond it)."""
    pairs = [pair for pair in pairs if pair[0].numel()]
    if not pairs:
        return True
    rtol = _shared_tolerance(pairs)
    if rtol is None:
        return False

    gaps = [value - expected for value, expected in pairs]
    measured = torch.stack(
        [torch.stack([_largest(gap), _largest(expected)]) for gap, (_, expected) in zip(gaps, pairs)]
    )
    quick = (measured[:, 0] <= rtol * _FLOOR * measured[:, 1]).tolist()  # NaN is no agreement
    rest = [
        (gap, expected, scale) for gap, (_, expected), scale, ok in zip(gaps, pairs, measured[:, 1], quick) if not ok
    ]
    if not rest:
        return True
    worst = [(gap.abs() - rtol * (expected.abs() + _FLOOR * scale)).max() for gap, expected, scale in rest]
    return bool((torch.stack(worst) <= 0).all())


def _all_agree(triples: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> bool:
    """Whether every ``(value, bound, expected)`` passes :func:`_compare`, with one synchronisation
    for all parameters instead of one each. False where it cannot tell at once (other dtypes or
    devices, NaN): :func:`_compare` then decides parameter by parameter."""
    triples = [triple for triple in triples if triple[0].numel()]
    if not triples:
        return True
    rtol = _shared_tolerance(triples)
    if rtol is None:
        return False
    worst = [
        ((value - expected).abs() - rtol * (bound + expected.abs() + _FLOOR * bound.max())).max()
        for value, bound, expected in triples
    ]
    return bool((torch.stack(worst) <= 0).all())  # NaN is no agreement


def _shared_tolerance(groups: list[tuple[torch.Tensor, ...]]) -> Optional[float]:
    """The tolerance of every tensor in ``groups`` where they share one dtype and device (the
    comparison of all parameters at once needs it), else None."""
    if len({(tensor.dtype, tensor.device) for group in groups for tensor in group}) != 1:
        return None
    return _tolerance(groups[0][0].dtype, groups[0][0].device)


def verify(call: KernelCall, plan: Plan) -> None:
    """``verify=True``: raises ValueError naming the first parameter whose ``J^T v`` on x1 is wrong."""
    found = disagreements(call.side1, plan)
    if found:
        index = min(found)
        raise ValueError(
            f"{call.where}: structured derivatives disagree with autograd for parameter "
            f"{call.model.names[index]!r}: {found[index]}. Either the parameter is consumed where the "
            f"recorder cannot see it, or the model couples examples despite `vmap_axes`. Use "
            f"implementation=1 for this model, or leave verify=False to let such parameters take the "
            f"Jacobian fallback."
        )


def whole_batch_products(side: Side, cotangents: tuple[torch.Tensor, ...]) -> Optional[tuple[torch.Tensor, ...]]:
    """Autograd's ``J^T v`` of ``side``'s examples evaluated as one batch, with ``cotangents`` laid
    out like its outputs; None where the model cannot be differentiated so (the checks that
    follow explain it)."""
    try:
        _, pullback = vjp(side.whole_batch(), side.model.params)
        (gradients,) = pullback(tuple(cotangents))
    except Exception:  # noqa: BLE001 - nothing is concluded; the derivative check runs as before
        return None
    return gradients


def _autograd_products(
    side: Side, seed: int, given: Optional[tuple[torch.Tensor, ...]] = None
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """A random cotangent ``v`` (laid out like the side's outputs), or the ``given`` one, and
    autograd's ``J_p^T v``."""
    params = side.model.params
    outputs, pullback = vjp(lambda p: side.per_example(lambda x, kw: side.evaluate(p, x, kw)), params)
    if given is not None:
        per_example = tuple(given)
        if side.mapped:  # per_example stacks the examples first
            per_example = tuple(v.movedim(axis, 0) for v, axis in zip(per_example, side.out_axes))
        (gradients,) = pullback(per_example)
        return tuple(given), gradients
    generator = torch.Generator(device="cpu").manual_seed(seed)
    per_example = tuple(
        torch.randn(output.shape, generator=generator, dtype=output.dtype).to(output.device) for output in outputs
    )
    (gradients,) = pullback(per_example)
    if side.mapped:  # per_example stacks the examples first; side_factors wants them at out_axes
        per_example = tuple(v.movedim(0, axis) for v, axis in zip(per_example, side.out_axes))
    return per_example, gradients


def _transposed_product(use: Use, mapped: bool, absolute: bool = False) -> torch.Tensor:
    """The structured ``J^T v`` of one use in the role's coordinates (flat), or (``absolute``) the
    same contraction over absolute values, its bound."""
    role = use.role
    batch = opt_einsum.get_symbol(5000) if mapped else ""
    terms = [batch + role.g_labels] + [batch + labels for _, labels in role.operands]
    tensors = [use.gradients[0]] + [tensor for tensor, _ in role.operands]
    dtype = promoted(tensor.dtype for tensor in tensors)
    tensors = [tensor.to(dtype).abs() if absolute else tensor.to(dtype) for tensor in tensors]
    equation = ",".join(terms) + "->" + role.param_labels
    value = _contracted(equation, tensors)
    scale = abs(role.scale) if absolute else role.scale
    if scale != 1.0:  # a parameter-sized product otherwise
        value = value * scale
    return value.reshape(math.prod(role.param_shape))


def _contracted(equation: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """``equation`` over ``tensors``; ``G`` and one operand by ``torch.einsum``, which keeps ``G``
    on the left of its batched product, so the parameter-sized result comes out contiguous:
    opt_einsum's came out transposed for convolution weights, and flattening it copied (a
    ResNet-18's plan check: 33 ms of copies, and 2.5 against 9.5 ms for a 512 x 4608 weight)."""
    if len(tensors) == 2:
        return torch.einsum(convert_to_valid_einsum_chars(equation), *tensors)
    return opt_einsum.contract(equation, *tensors, backend="torch")


def _per_parameter(
    role: Role, value: torch.Tensor, params: tuple[torch.Tensor, ...], flat: bool = True
) -> list[tuple[int, torch.Tensor]]:
    """``(index, value)`` per parameter, flat in the parameter's own coordinates (``flat=False``:
    a joint role's parts keep the role's axes, in the same order of entries)."""
    if role.joint:  # see Role: the last entry of the last coordinate is the bias
        (weight, bias) = role.unit
        parts = []
        for index, select in ((weight, slice(None, -1)), (bias, -1)):
            piece = value.reshape(role.param_shape)[..., select]
            piece = piece.reshape(-1) if flat else piece
            if piece.numel() != params[index].numel():
                raise AssertionError(f"joint role {role.name!r} does not split into its parameters")
            parts.append((index, piece))
        return parts
    ref = role.refs[0]
    return [(ref.param, ref.scatter(value, params[ref.param].numel()))]


def _compare(value: torch.Tensor, bound: torch.Tensor, expected: torch.Tensor) -> Optional[str]:
    dtype = torch.promote_types(value.dtype, expected.dtype)
    rtol = max(_tolerance(value.dtype, value.device), _tolerance(expected.dtype, expected.device))
    value, bound, expected = value.to(dtype), bound.to(dtype), expected.to(dtype)
    excess = (value - expected).abs() - rtol * (bound + expected.abs() + _FLOOR * bound.max())
    if not excess.numel() or excess.max().item() <= 0:
        return None
    entry = int(excess.argmax())
    return (
        f"its structured J^T v differs from autograd's (flat entry {entry}: {value[entry].item():.6g} "
        f"against {expected[entry].item():.6g}, beyond the rounding bound {rtol * bound[entry].item():.3g}): "
        f"part of its use is hidden from the recorder {_HIDDEN} or is not what a rule assumed"
    )


def _tolerance(dtype: torch.dtype, device: torch.device) -> float:
    if dtype.is_complex:
        dtype = dtype.to_real()
    rtol = _RTOL.get(dtype, _RTOL[torch.float32])
    if dtype == torch.float32 and device.type == "cuda" and _tf32_enabled():
        rtol = max(rtol, _TF32_RTOL)
    return rtol


def _tf32_enabled() -> bool:
    return bool(
        torch.backends.cuda.matmul.allow_tf32
        or torch.backends.cudnn.allow_tf32
        or torch.get_float32_matmul_precision() != "highest"
    )
