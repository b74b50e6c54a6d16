"""The peer ``torchntk bench --tutorial`` times: what a PyTorch user writes without this library.

PyTorch's ``torch.func`` tutorial on neural tangent kernels computes the NTK by Jacobian
contraction: each side's per-example Jacobians with ``vmap(jacrev(f))``, flattened per parameter,
then one ``einsum`` per parameter, summed. This is that recipe, written for the bench's models
(one input tensor, one output tensor, parameters and buffers passed to ``functional_call``).
It keeps both sides' whole Jacobians in memory, ``N * O * P`` numbers each, which
:func:`jacobian_bytes` tells beforehand, so that the bench can say "needs N GB" instead of
running out of memory.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap


def tutorial_ntk_fn(model: nn.Module, traced: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The tutorial's Jacobian-contraction NTK of ``model``: ``(N, M)`` traced over the outputs
    (``traced``; divided by ``O``, the mean that torchntk's ``trace_axes=(-1,)`` gives, as
    neural-tangents does), else ``(N, M, O, O)``, the layout of torchntk's ``trace_axes=()``.
    Like torchntk, it differentiates the parameters with ``requires_grad`` (LoRA adapters of a
    frozen model) and keeps the others and the buffers constant."""
    params = {name: tensor.detach() for name, tensor in model.named_parameters() if tensor.requires_grad}
    constants = {name: tensor.detach() for name, tensor in model.named_parameters() if not tensor.requires_grad}
    constants.update(model.named_buffers())  # frozen parameters and buffers: what torchntk keeps constant

    def one_example(parameters: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(model, (parameters, constants), (x.unsqueeze(0),)).squeeze(0)

    jacobians = vmap(jacrev(one_example), (None, 0))
    equation = "naf,maf->nm" if traced else "naf,mbf->nmab"

    def ntk(x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
        jacobian1 = [j.flatten(2) for j in jacobians(params, x1).values()]
        jacobian2 = [j.flatten(2) for j in jacobians(params, x2).values()]
        kernel = torch.stack([torch.einsum(equation, j1, j2) for j1, j2 in zip(jacobian1, jacobian2)]).sum(0)
        return kernel / jacobian1[0].shape[1] if traced else kernel

    return ntk


def jacobian_bytes(model: nn.Module, examples: int, outputs: int) -> int:
    """Bytes of one side's Jacobians for ``examples`` examples of ``outputs`` outputs."""
    return sum(p.numel() * p.element_size() for p in model.parameters()) * examples * outputs
