"""The empirical NNGP kernel: the layout contraction of the outputs themselves."""

from __future__ import annotations

import torch

from .._call.kernel_call import KernelCall


def nngp(call: KernelCall) -> list[torch.Tensor]:
    """``K[r1, r2, d] = sum_t f(x1)[t, d, r1] f(x2)[t, d, r2]`` per output leaf (unnormalised)."""
    kernels = []
    for layout, one, two in zip(call.layouts, call.outputs1, call.outputs2):
        first = one.unsqueeze(-1)
        # x2 None: the same operand twice gives the layout's exactly symmetric product.
        kernels.append(layout.contract(first, first if two is one else two.unsqueeze(-1)))
    return kernels
