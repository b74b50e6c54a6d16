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

from typing import Optional, Sequence

import torch
from torch.func import jvp, vmap

from .._blocks import assemble
from .._call import KernelCall
from .._per_example import Side

Jacobians = tuple[tuple[torch.Tensor, ...], ...]


def ntk_vector_products_ntk(call: KernelCall) -> list[torch.Tensor]:
    vector_chunk = None if call.side1.mapped else call.chunk_size

    def prepare_x2(side: Side) -> Jacobians:
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

            columns = vmap(column, chunk_size=vector_chunk or _TANGENTS_AT_ONCE)(tangents)
            # columns: (*output2, *output1) -> unzipped kernel (*output1, *output2)
            columns = columns.reshape(*output2_shape, *columns.shape[1:])
            full = columns.permute(*range(layout.ndim, 2 * layout.ndim), *range(layout.ndim))
            blocks.append(layout.from_full(full))
        return blocks

    return assemble(
        call, lambda side: side, prepare_x2, contract, reuse_prepared=False, split_x1=False,
        run_length=call.chunk_size or _default_run_length(call),
    )


# NOTE: [Run lengths of NTK-vector products]
# Measured on the benchmark MLP and CNN (2-core CPU): forming the parameter-space vectors of a few
# x2 examples at a time, and pushing them through forward mode 16 at a time, was 1.4-2x faster
# than doing all at once: the vectors stay in cache between the reverse and the forward pass and
# no multi-GB buffer is allocated (page faults cost ~0.4 s/GB here). The run length keeps a run's
# vectors within _RUN_BYTES.
_RUN_BYTES = 32 * 2**20
_TANGENTS_AT_ONCE = 16


def _default_run_length(call: KernelCall) -> Optional[int]:
    if not call.side1.mapped:
        return None
    side2 = call.side2 if call.side2 is not None else call.side1
    examples = max(1, side2.batch_size())
    outputs_per_example = sum(output.numel() for output in call.outputs2) / examples
    params = call.model.params
    vector_bytes = sum(p.numel() for p in params) * params[0].element_size()
    return max(1, int(_RUN_BYTES // max(1.0, outputs_per_example * vector_bytes)))
