"""Assembling a kernel from blocks of examples, to bound memory and reuse symmetry.

NOTE: [Blocks of examples]
With ``vmap_axes`` and a ``chunk_size``, x1 and x2 are cut into runs of at most ``chunk_size``
examples (the last one may be shorter). Each implementation supplies how to prepare one run of
a side (e.g. its Jacobians) and how to turn a pair of prepared runs into kernel blocks; this
module loops over the pairs and writes each block into one preallocated kernel per output leaf,
where NOTE: [Tiles] (``_layout/tiles.py``) puts it. A diagonal or traced batch axis only has pairs
``i == j``; traced blocks are summed in float64 for float32 kernels. When x2 is None the kernel is
symmetric, so only pairs ``i <= j`` are computed and mirrored. Without ``vmap_axes`` there is a
single block covering everything. With parameter groups every leaf's block is a tuple of one block
per group (NOTE: [Parameter groups] in ``_call/groups.py``), placed alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .._layout.runs import runs
from .._layout.tiles import Placement
from .._utils.precision import accumulation_dtype
from .kernel_call import KernelCall

Prepare = Callable[[Any], Any]
Contract = Callable[[Any, Any, Sequence[bool]], list[Optional[torch.Tensor]]]


@dataclass(frozen=True)
class BlockPlan:
    """How an implementation computes a kernel from runs of examples (see NOTE: [Blocks of examples]).

    Attributes:
        prepare1, prepare2: ``side -> prepared data`` for a run of x1 / x2 examples.
        contract: ``(prepared1, prepared2, needed) -> blocks``, one unnormalised block per output
            leaf (a tuple of one block per group with parameter groups), ``None`` where ``needed``
            is False. Given the same object twice (x2 None, a run paired with itself) it may use
            the symmetric product.
        reuse_prepared: whether ``prepare1`` and ``prepare2`` return the same thing, so that a
            run paired with itself is prepared once.
        split_x1: whether x1 is cut into runs too. An implementation whose x1 work is cheap per
            example and batched over the whole x1 (NTK-vector products) keeps x1 whole.
        run_length: examples per run; ``None`` means no runs. The user's ``chunk_size`` unless the
            implementation has a better default.
        keep_prepared: prepare every run once and keep it for all its pairs (NOTE: [Working-set
            runs]), instead of preparing x1's runs again for every run of x2, which bounds memory
            by two runs' prepared data (the user's ``chunk_size``).
        implementation: which implementation made the plan (an ``NtkImplementation``), and
        structured: implementation 3's plan of its parameters: what the memory model needs to
            price the plan's runs (NOTE: [Memory plans]); None where unknown.
    """

    prepare1: Prepare
    prepare2: Prepare
    contract: Contract
    reuse_prepared: bool
    split_x1: bool = True
    run_length: Optional[int] = None
    keep_prepared: bool = False
    implementation: Any = None
    structured: Any = None


def assemble(call: KernelCall, plan: BlockPlan) -> list[torch.Tensor]:
    """Computes every output leaf's unnormalised kernel block by block, following ``plan``."""
    prepare1, prepare2, contract = plan.prepare1, plan.prepare2, plan.contract
    reuse_prepared, split_x1, run_length = plan.reuse_prepared, plan.split_x1, plan.run_length
    side1 = call.side1
    side2 = call.side2 if call.side2 is not None else call.side1
    if side1.mapped:
        placements = [Placement.of(layout, axis) for layout, axis in zip(call.layouts, side1.out_axes)]
        batch_kinds = [placement.kind for placement in placements]
        runs2 = runs(side2.batch_size(), run_length)
        # A traced or diagonal batch axis pairs run i of x1 with run i of x2, so both are cut alike.
        split1 = split_x1 or any(kind != "kept" for kind in batch_kinds)
        runs1 = runs(side1.batch_size(), run_length if split1 else None)
    if not side1.mapped or (len(runs1) == 1 and len(runs2) == 1):
        prepared2 = prepare2(side2)
        prepared1 = prepared2 if (call.reuses_x1 and reuse_prepared) else prepare1(side1)
        return contract(prepared1, prepared2, [True] * len(call.layouts))

    mirrored = call.reuses_x1 and split1  # pairs (i, j) and (j, i) are transposes of each other
    if plan.keep_prepared:
        prepare1, prepare2 = _kept(prepare1, prepare2, call.reuses_x1 and reuse_prepared)

    # A traced batch axis sums one block per run; float64 keeps that sum exact enough however
    # many runs there are (NOTE: [Accurate contraction] in _layout/kernel_layout.py).
    kernels = [
        _per_group(call, lambda: torch.zeros(
            shape,
            dtype=accumulation_dtype(dtype, output.device) if kind == "trace" else dtype,
            device=output.device,
        ))
        for shape, dtype, output, kind in zip(call.kernel_shapes(), call.dtypes, call.outputs1, batch_kinds)
    ]
    # A run's prepared data is dropped before the next run is prepared: rebinding the name only
    # after the new data exists would hold three runs at the peak, not two (NOTE: [Memory plans]).
    prepared1 = prepared2 = blocks = None
    for j, (start2, length2) in enumerate(runs2):
        prepared1 = prepared2 = None
        prepared2 = prepare2(side2.narrow(start2, length2))
        for i, (start1, length1) in enumerate(runs1):
            if mirrored and i > j:
                continue  # filled when pair (j, i) was computed
            needed = [kind == "kept" or i == j for kind in batch_kinds]
            if not any(needed):
                continue
            prepared1 = blocks = None
            if mirrored and reuse_prepared and i == j:
                prepared1 = prepared2
            else:
                prepared1 = prepare1(side1.narrow(start1, length1))
            blocks = contract(prepared1, prepared2, needed)
            for kernel, block, placement in zip(kernels, blocks, placements):
                if block is None:
                    continue
                # With parameter groups a leaf's kernel and block are tuples, one entry per group.
                pairs = zip(kernel, block) if isinstance(kernel, tuple) else [(kernel, block)]
                for group_kernel, group_block in pairs:
                    placement.put(group_kernel, group_block, (start1, length1), (start2, length2), mirror=mirrored)
    return [
        tuple(k.to(dtype) for k in kernel) if isinstance(kernel, tuple) else kernel.to(dtype)
        for kernel, dtype in zip(kernels, call.dtypes)
    ]


def _kept(prepare1: Prepare, prepare2: Prepare, shared: bool) -> tuple[Prepare, Prepare]:
    """``prepare1`` and ``prepare2`` computing each run once (runs are keyed by where they start
    and their length); ``shared``: both prepare the same side alike (x2 None)."""
    kept: dict = {}

    def keeping(prepare: Prepare, name: str) -> Prepare:
        def prepared(side: Any) -> Any:
            key = ("x" if shared else name, side.offset, side.batch_size())
            if key not in kept:
                kept[key] = prepare(side)
            return kept[key]

        return prepared

    return keeping(prepare1, "x1"), keeping(prepare2, "x2")


def _per_group(call: KernelCall, make: Callable[[], torch.Tensor]) -> Any:
    """``make()``, or a tuple of one ``make()`` per parameter group (NOTE: [Parameter groups])."""
    return make() if call.groups is None else tuple(make() for _ in call.groups)
