"""The empirical NNGP kernel: the layout contraction of the outputs themselves."""

from __future__ import annotations

import torch

from .._call import KernelCall


def nngp(call: KernelCall) -> list[torch.Tensor]:
    """``K[r1, r2, d] = sum_t f(x1)[t, d, r1] f(x2)[t, d, r2]`` per output leaf (unnormalised)."""
    return [
        layout.contract(one.unsqueeze(-1), two.unsqueeze(-1))
        for layout, one, two in zip(call.layouts, call.outputs1, call.outputs2)
    ]
