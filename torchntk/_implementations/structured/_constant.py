"""Implementation 3's kernels are constants of the inputs: a backward pass through them raises.

NOTE: [Kernels that are constants of the inputs]
Implementation 3 builds the kernel from factors taken apart from the inputs' autograd graph: the
rules' operands are detached, and each ``G`` comes from a pullback of its own (plain autograd over
the whole batch, NOTE: [The whole-batch pass by plain autograd] in ``_side.py``; ``torch.func``
per example). A kernel differentiated with respect to x1 or x2 (kernel inducing points, inputs
optimised against a kernel) would therefore get none of the derivative on the whole-batch pass
and part of it on the per-example pass: on a tanh MLP, -0.049 where finite differences give
0.821, without an error. Implementations 1 and 2 compute the kernel under ``torch.func``
transforms, which compose with autograd, and their derivatives with respect to the inputs are
exact. So where grad mode is on and an input of the call requires grad, implementation 3 (chosen
or AUTO's pick) returns its kernels tied to those inputs by :class:`_ConstantOfInputs`, whose
backward raises and names 1 and 2: the values are unchanged, nothing fails unless a derivative
is taken through the kernel, and no wrong derivative is ever returned. (Kernels are constants of
the parameters in every implementation: the model's parameters are differentiated as copies.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..._call.kernel_call import KernelCall


def constant_of_inputs(call: KernelCall, kernels: Any) -> Any:
    """``kernels`` (a pytree of tensors), tied to the call's inputs that require grad so that a
    backward pass through them raises; ``kernels`` itself where there are none, grad mode is off
    or a ``torch.func`` transform is active (NOTE: [Kernels that are constants of the inputs])."""
    if not torch.is_grad_enabled() or torch._C._are_functorch_transforms_active():
        return kernels
    sides = [side for side in (call.side1, call.side2) if side is not None]
    inputs = [
        leaf for side in sides for flat in (side.x, *side.kwargs.values()) for leaf in flat.leaves
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad
    ]
    if not inputs:
        return kernels

    def tied(kernel: Any) -> Any:
        return _ConstantOfInputs.apply(call.where, kernel, *inputs) if isinstance(kernel, torch.Tensor) else kernel

    return pytree.tree_map(tied, kernels)


class _ConstantOfInputs(torch.autograd.Function):
    """The kernel as it is, with a backward that raises: see NOTE: [Kernels that are constants of
    the inputs]."""

    @staticmethod
    def forward(ctx: Any, where: str, kernel: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.where = where
        return kernel.clone()  # not a view: the caller may write into the kernel in place

    @staticmethod
    def backward(ctx: Any, *gradients: Any) -> Any:
        raise RuntimeError(
            f"{ctx.where}: implementation 3 (structured derivatives, also AUTO's pick) computes the kernel "
            f"as a constant of x1 and x2: it has no derivative with respect to them, and a backward pass "
            f"reached an input through it. Use implementation=1 or implementation=2, whose kernels are "
            f"differentiable with respect to the inputs, or detach the inputs."
        )
