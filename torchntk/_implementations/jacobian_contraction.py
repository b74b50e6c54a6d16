"""NTK implementation 1: Jacobian contraction.

``K = sum_p J1_p J2_p^T`` where ``J_p`` is the Jacobian of the outputs with respect to parameter
tensor ``p``. Jacobians come from reverse mode (per example under ``vmap_axes``), and each
parameter tensor is contracted on its own, so the concatenated Jacobian of all parameters never
exists. The contraction only forms what the layout keeps: traced axes are summed inside the
matrix product and diagonal axes are batch axes of it (see NOTE: [Kernel layout]).

With parameter groups (NOTE: [Parameter groups] in ``_call/groups.py``) each parameter's term is added to
its group's sum instead of the one sum: the same work, one kernel per group.

Cost: ``O (N1 + N2)`` backward passes of one example, plus ``N1 N2 O1 O2 P / |T|`` multiply-adds,
where ``|T|`` is the number of traced output coordinates.

Accuracy: the per-parameter terms and, for float32 Jacobians, the blocks of each long
contraction are summed in float64, and the kernel is rounded to its dtype once (NOTE: [Accurate
contraction] in ``_layout/kernel_layout.py``): float32 kernels of models with tens of millions of parameters
stay as accurate as those of implementations 2 and 3.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import torch
from torch.func import vjp, vmap

from .._call.blocks import BlockPlan, assemble
from .._call.kernel_call import KernelCall
from .._call.per_example import OutputAxisError, Side
from .._layout.runs import runs
from .._utils.types import promoted

Jacobians = tuple[tuple[torch.Tensor, ...], ...]


def jacobian_contraction_ntk(call: KernelCall) -> list[torch.Tensor]:
    return assemble(call, jacobian_contraction_blocks(call))


def jacobian_contraction_blocks(call: KernelCall) -> BlockPlan:
    if output_runs(call):
        return _output_run_blocks(call)
    jacobian_chunk = None if call.side1.mapped else call.chunk_size

    def prepare(side: Side) -> Jacobians:
        if call.vmap_check is None or not side.mapped:
            return side.jacobians(chunk_size=jacobian_chunk)
        return checked_jacobians(call, side, side.jacobians_and_outputs)

    groups, group_of = _groups(call)

    def contract(jacobians1: Jacobians, jacobians2: Jacobians, needed: Sequence[bool]) -> list[Optional[Any]]:
        blocks: list[Optional[Any]] = []
        for layout, per_param1, per_param2, is_needed in zip(call.layouts, jacobians1, jacobians2, needed):
            if not is_needed:
                blocks.append(None)
                continue
            sums = _Sums(len(groups))
            sums.add(layout, per_param1, per_param2, group_of)
            blocks.append(sums.result(call.groups is not None))
        return blocks

    return BlockPlan(
        prepare, prepare, contract, reuse_prepared=True, run_length=call.run_length,
        keep_prepared=call.chunk_size is None,
    )


def _groups(call: KernelCall) -> tuple[tuple[tuple[int, ...], ...], dict[int, int]]:
    """The parameter groups and each parameter's group: each parameter's term goes to its group's sum
    (NOTE: [Parameter groups]); without groups, one sum."""
    groups = call.groups if call.groups is not None else (tuple(range(len(call.model.params))),)
    return groups, {index: position for position, indices in enumerate(groups) for index in indices}


class _Sums:
    """One output leaf's kernel, summed over parameters (and runs of outputs) per group, in float64
    until the end (NOTE: [Accurate contraction])."""

    def __init__(self, groups: int) -> None:
        self.totals: list[Optional[torch.Tensor]] = [None] * groups
        self.dtypes: list[Optional[torch.dtype]] = [None] * groups

    def add(self, layout: Any, per_param1: Sequence[torch.Tensor], per_param2: Sequence[torch.Tensor],
            group_of: dict[int, int]) -> None:
        """Adds ``J1_p J2_p^T`` of every parameter ``p``, its Jacobians shaped ``(*output, *param)``."""
        for index, (one, two) in enumerate(zip(per_param1, per_param2)):
            first = _flatten_param(one, layout.ndim)
            # The same tensor on both sides (x2 is None) lets the layout use the symmetric product.
            second = first if two is one else _flatten_param(two, layout.ndim)
            term = layout.contract(first, second, wide=True)
            group = group_of[index]
            self.dtypes[group] = _promote(self.dtypes[group], first.dtype, second.dtype)
            total = self.totals[group]
            self.totals[group] = term if total is None else _accumulate(total, term)

    def result(self, grouped: bool) -> Any:
        """The kernel rounded to its dtype: one per group with groups, else the one sum."""
        sums = tuple(None if total is None else total.to(dtype) for total, dtype in zip(self.totals, self.dtypes))
        return sums if grouped else sums[0]


# NOTE: [Runs of traced outputs]
# Without vmap_axes the whole batch is one example, and its Jacobian holds every output entry of
# every example: N O P entries (374 GB for a ResNet-18 in training mode, 8 images, 1000 logits).
# A traced output axis needs far less: the kernel sums ``J[..., t, :] J[..., t, :]^T`` over its
# coordinates t, so the coordinates can be taken a run at a time, each run's Jacobian contracted
# into the sum and dropped before the next. With a chunk_size (the output entries differentiated
# at once, which the memory plan chooses when the whole Jacobian does not fit), implementation 1
# cuts each output leaf along its longest traced axis into runs of as many coordinates as
# chunk_size entries hold (at least one), and holds one run's Jacobian per side: the forward pass
# is taken once per side (its pullback kept), and the backward passes are those of the whole
# Jacobian, so the runs cost nothing but the loop. A leaf without a traced axis is one run. The
# memory model (``memory.py``) prices the same runs; without a chunk_size nothing changes.


def output_runs(call: KernelCall) -> bool:
    """Whether ``call`` is computed in runs of traced outputs (NOTE: [Runs of traced outputs]):
    without ``vmap_axes``, with a ``chunk_size``, and some output leaf traced along an axis."""
    if call.side1.mapped or call.chunk_size is None:
        return False
    return any(layout.run_axis(output.shape) is not None for layout, output in zip(call.layouts, call.outputs1))


def _output_run_blocks(call: KernelCall) -> BlockPlan:
    """Implementation 1 over runs of traced output coordinates (NOTE: [Runs of traced outputs])."""
    groups, group_of = _groups(call)
    chunk = call.chunk_size

    def prepare(side: Side) -> tuple[tuple[torch.Tensor, ...], Callable]:
        return vjp(side.whole_batch(), side.model.params)

    def contract(prepared1: Any, prepared2: Any, needed: Sequence[bool]) -> list[Optional[Any]]:
        (outputs1, pullback1), (outputs2, pullback2) = prepared1, prepared2
        blocks: list[Optional[Any]] = []
        for leaf, (layout, is_needed) in enumerate(zip(call.layouts, needed)):
            if not is_needed:
                blocks.append(None)
                continue
            axis = layout.run_axis(outputs1[leaf].shape)
            size = 1 if axis is None else outputs1[leaf].shape[axis]
            unit = max(outputs1[leaf].numel(), outputs2[leaf].numel()) // size  # entries per coordinate
            sums = _Sums(len(groups))
            entries1, entries2 = _entries(outputs1[leaf]), _entries(outputs2[leaf])
            for start, length in runs(size, max(1, chunk // max(1, unit))):
                one = _run_jacobians(outputs1, pullback1, leaf, _run(entries1, axis, start, length), chunk)
                two = one if prepared1 is prepared2 else _run_jacobians(
                    outputs2, pullback2, leaf, _run(entries2, axis, start, length), chunk)
                sums.add(layout, one, two, group_of)
                one = two = None  # this run's Jacobians go before the next run's are formed
            blocks.append(sums.result(call.groups is not None))
        return blocks

    return BlockPlan(prepare, prepare, contract, reuse_prepared=True)


def _entries(output: torch.Tensor) -> torch.Tensor:
    """Where each entry of ``output`` sits in it flattened, in ``output``'s shape."""
    return torch.arange(output.numel(), device=output.device).reshape(output.shape)


def _run(entries: torch.Tensor, axis: Optional[int], start: int, length: int) -> torch.Tensor:
    """The entries of a run: ``[start, start + length)`` along ``axis`` (all of them for None)."""
    return entries if axis is None else entries.narrow(axis, start, length)


def _run_jacobians(
    outputs: tuple[torch.Tensor, ...], pullback: Callable, leaf: int, run: torch.Tensor, chunk: int,
) -> tuple[torch.Tensor, ...]:
    """The Jacobian of output ``leaf`` at the entries ``run`` holds (:func:`_run`), one
    ``(*run.shape, *param.shape)`` tensor per parameter; its rows differentiated ``chunk`` at a
    time by ``pullback``."""
    target = outputs[leaf]
    shape = run.shape
    where = run.reshape(-1)
    rows = where.numel()
    zeros = [torch.zeros((), dtype=output.dtype, device=output.device) for output in outputs]
    per_param: Optional[tuple[torch.Tensor, ...]] = None
    for first in range(0, rows, chunk):
        count = min(chunk, rows - first)
        basis = torch.zeros(count, target.numel(), dtype=target.dtype, device=target.device)
        basis[torch.arange(count, device=target.device), where[first:first + count]] = 1
        cotangents = tuple(
            basis.view(count, *target.shape) if index == leaf else zero.expand(count, *output.shape)
            for index, (output, zero) in enumerate(zip(outputs, zeros))
        )
        (products,) = vmap(pullback)(cotangents)
        if count == rows:
            per_param = tuple(products)
            break
        if per_param is None:  # filled in place: no second copy of the run's Jacobian at once
            per_param = tuple(product.new_empty(rows, *product.shape[1:]) for product in products)
        for whole, product in zip(per_param, products):
            whole[first:first + count] = product
        products = basis = cotangents = None
    return tuple(product.reshape(*shape, *product.shape[1:]) for product in per_param)


def checked_jacobians(
    call: KernelCall, side: Side, jacobians_and_outputs: Callable[[], tuple[Jacobians, tuple[torch.Tensor, ...]]]
) -> Jacobians:
    """The Jacobians of ``jacobians_and_outputs()``, a per-example pass over ``side`` that also
    returns its per-example outputs, once the call's pending output check (NOTE: [Checking
    vmap_axes]) has compared those outputs with the whole batch's: the check costs no pass of its
    own. Implementation 2 forms its x2 vectors the same way.

    Raises:
        ValueError: the outputs differ (coupled examples, wrong axes), or the pass failed and the
            model's outputs show why (the check's own forward pass then explains it).
        RuntimeError: the pass failed for another reason.
    """
    try:
        jacobians, outputs = jacobians_and_outputs()
    except (RuntimeError, OutputAxisError):
        call.check_outputs(side)  # explains the failure when the model's outputs show why
        raise
    call.vmap_check.per_example_outputs(side, call.expected_outputs(side), outputs)
    return jacobians


def _flatten_param(jacobian: torch.Tensor, output_ndim: int) -> torch.Tensor:
    """``(*output, *param) -> (*output, param_size)``."""
    return jacobian.reshape(*jacobian.shape[:output_ndim], math.prod(jacobian.shape[output_ndim:]))


def _promote(dtype: Optional[torch.dtype], *others: torch.dtype) -> torch.dtype:
    """The kernel's dtype: what the per-parameter float products would have promoted to."""
    for other in others:
        dtype = other if dtype is None else promoted((dtype, other))
    return dtype


def _accumulate(total: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    if total.dtype == promoted((total.dtype, term.dtype)):
        return total.add_(term)
    return total + term
