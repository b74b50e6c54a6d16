"""NTK implementation 2: NTK-vector products.

For every entry ``b`` of the x2 output, reverse mode gives the parameter-space vector
``J2[b]^T`` (per example under ``vmap_axes``, so ``O`` backward passes of one example each), and
one forward-mode pass over the whole x1 batch turns it into the kernel column
``J1 J2[b]^T = K[:, b]``. The forward-mode passes are batched over ``b`` with ``vmap``; the
parameter-space contraction of Jacobian contraction never happens, which wins when ``P`` is
large relative to the cost of a forward pass. Trace and diagonal axes are extracted from the
columns afterwards.

NOTE: [NTK-vector products are batched over the whole input]
The PyTorch tutorial vmaps the product over pairs of examples ``(x1[n], x2[m])`` with an
``O``-sized basis each, holding ``N1 N2 O`` parameter-sized vectors at once. Here each x2
output entry gives one tangent, used once for the whole x1 batch: ``N2 O`` tangents in all,
bounded further by ``chunk_size``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
from torch.func import jacrev, jvp, vmap

from .._blocks import BlockPlan, assemble
from .._call import KernelCall
from .._per_example import Side

Jacobians = tuple[tuple[torch.Tensor, ...], ...]


def ntk_vector_products_ntk(call: KernelCall) -> list[torch.Tensor]:
    return assemble(call, ntk_vector_products_blocks(call))


def ntk_vector_products_blocks(call: KernelCall) -> BlockPlan:
    vector_chunk = None if call.side1.mapped else call.chunk_size

    def prepare_x2(side: Side) -> Jacobians:
        if side.mapped and side.batch_size() <= _MIN_RUN:
            # See NOTE: [Run lengths of NTK-vector products]: rank-2 instead of rank-1 products.
            return jacrev(side.whole_batch())(side.model.params)
        return side.jacobians(chunk_size=vector_chunk)

    def contract(side1: Side, jacobians2: Jacobians, needed: Sequence[bool]) -> list[Optional[torch.Tensor]]:
        forward = side1.whole_batch()
        params = side1.model.params
        blocks: list[Optional[torch.Tensor]] = []
        for leaf, (layout, per_param2, is_needed) in enumerate(zip(call.layouts, jacobians2, needed)):
            if not is_needed:
                blocks.append(None)
                continue
            output2_shape = per_param2[0].shape[: layout.ndim]
            tangents = tuple(
                jacobian.reshape(-1, *param.shape) for jacobian, param in zip(per_param2, params)
            )

            def column(tangent: tuple, leaf: int = leaf) -> torch.Tensor:
                return jvp(forward, (params,), (tangent,))[1][leaf]

            columns = vmap(column, chunk_size=vector_chunk or _even_chunks(tangents[0].shape[0]))(tangents)
            # columns: (*output2, *output1) -> unzipped kernel (*output1, *output2)
            columns = columns.reshape(*output2_shape, *columns.shape[1:])
            full = columns.permute(*range(layout.ndim, 2 * layout.ndim), *range(layout.ndim))
            blocks.append(layout.from_full(full))
        return blocks

    return BlockPlan(
        lambda side: side, prepare_x2, contract, reuse_prepared=False, split_x1=False,
        run_length=call.chunk_size or _default_run_length(call),
    )


# NOTE: [Run lengths of NTK-vector products]
# Measured on the benchmark MLP and CNN (2-core CPU), against forming every x2 vector at once:
# * x2 in runs whose parameter-space vectors take about _RUN_BYTES (x1 whole) was 1.4-2x faster:
#   the vectors stay in cache between the reverse and the forward pass, and no multi-GB buffer is
#   allocated (fresh memory costs ~0.4 s/GB in page faults here);
# * runs of at least _MIN_RUN examples, differentiated as one small batch, were ~20% faster on the
#   MLP than per-example vmap: the weight gradients become rank-2 matrix products, which the BLAS
#   runs far better than rank-1 ones (the cross-example blocks are zero under the vmap_axes promise);
# * pushing a run's vectors through forward mode in equal chunks of at most _TANGENTS_PER_PASS
#   avoided a small trailing chunk that cost a whole extra forward pass.
_RUN_BYTES = 32 * 2**20
_MIN_RUN = 2
_TANGENTS_PER_PASS = 24


def _even_chunks(count: int) -> int:
    """The chunk size that splits ``count`` vectors into equal chunks of at most _TANGENTS_PER_PASS."""
    chunks = max(1, math.ceil(count / _TANGENTS_PER_PASS))
    return max(1, math.ceil(count / chunks))


def _default_run_length(call: KernelCall) -> Optional[int]:
    if not call.side1.mapped:
        return None
    side2 = call.side2 if call.side2 is not None else call.side1
    examples = max(1, side2.batch_size())
    outputs_per_example = sum(output.numel() for output in call.outputs2) / examples
    params = call.model.params
    vector_bytes = sum(p.numel() for p in params) * params[0].element_size()
    return max(_MIN_RUN, int(_RUN_BYTES // max(1.0, outputs_per_example * vector_bytes)))
