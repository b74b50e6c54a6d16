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

from .._call.blocks import BlockPlan, assemble
from .._call.kernel_call import KernelCall
from .._call.per_example import OutputAxisError, Side

Jacobians = tuple[tuple[torch.Tensor, ...], ...]


def jacobian_contraction_ntk(call: KernelCall) -> list[torch.Tensor]:
    return assemble(call, jacobian_contraction_blocks(call))


def jacobian_contraction_blocks(call: KernelCall) -> BlockPlan:
    jacobian_chunk = None if call.side1.mapped else call.chunk_size

    def prepare(side: Side) -> Jacobians:
        if call.vmap_check is None or not side.mapped:
            return side.jacobians(chunk_size=jacobian_chunk)
        return checked_jacobians(call, side, side.jacobians_and_outputs)

    # Each parameter's term goes to its group's sum (NOTE: [Parameter groups]); without groups, one sum.
    groups = call.groups if call.groups is not None else (tuple(range(len(call.model.params))),)
    group_of = {index: position for position, indices in enumerate(groups) for index in indices}

    def contract(jacobians1: Jacobians, jacobians2: Jacobians, needed: Sequence[bool]) -> list[Optional[Any]]:
        blocks: list[Optional[Any]] = []
        for layout, per_param1, per_param2, is_needed in zip(call.layouts, jacobians1, jacobians2, needed):
            if not is_needed:
                blocks.append(None)
                continue
            totals: list[Optional[torch.Tensor]] = [None] * len(groups)
            dtypes: list[Optional[torch.dtype]] = [None] * len(groups)
            for index, (one, two) in enumerate(zip(per_param1, per_param2)):
                first = _flatten_param(one, layout.ndim)
                # The same tensor on both sides (x2 is None) lets the layout use the symmetric product.
                second = first if two is one else _flatten_param(two, layout.ndim)
                # Terms stay in float64 until every parameter is summed (NOTE: [Accurate contraction]).
                term = layout.contract(first, second, wide=True)
                group = group_of[index]
                dtypes[group] = _promote(dtypes[group], first.dtype, second.dtype)
                totals[group] = term if totals[group] is None else _accumulate(totals[group], term)
            sums = tuple(None if total is None else total.to(dtype) for total, dtype in zip(totals, dtypes))
            blocks.append(sums if call.groups is not None else sums[0])
        return blocks

    return BlockPlan(
        prepare, prepare, contract, reuse_prepared=True, run_length=call.run_length,
        keep_prepared=call.chunk_size is None,
    )


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
        dtype = other if dtype is None else torch.promote_types(dtype, other)
    return dtype


def _accumulate(total: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
    if total.dtype == torch.promote_types(total.dtype, term.dtype):
        return total.add_(term)
    return total + term
