"""A kernel call copies no parameter memory, yet never changes the module.

NOTE: [Modules are never mutated] (``_model/functional.py``): the private copies of a kernel call are
copy-on-write, so a call that only reads the parameters copies none of them, a forward pass that
writes into one copies that one first, and nothing of the call outlives it. Every kernel here is
checked against the float64 brute force of ``torchntk.testing``. Models and inputs live on the run
device (``pytest --device``; CPU and CUDA memory are both shared copy-on-write), inputs drawn on the
CPU and moved.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from torch import nn

import torchntk
from torchntk._call.kernel_call import FULL_CHECKS, CallSpec, prepare_call
from torchntk._call.vmap_axes import parse_vmap_axes
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_ntk


def _mlp(device: torch.device) -> nn.Module:
    """A float32 MLP on ``device``, its parameters drawn on the CPU."""
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return model.to(device)


def _inputs(n1: int, n2: int, device: torch.device, dtype: torch.dtype = torch.float32):
    """``(n1, 5)`` and ``(n2, 5)`` inputs on ``device``, drawn on the CPU."""
    generator = torch.Generator().manual_seed(1)
    x1, x2 = (torch.randn(n, 5, generator=generator, dtype=dtype) for n in (n1, n2))
    return x1.to(device), x2.to(device)


def _prepare(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor, params=None):
    return prepare_call(
        model, x1, x2, params, {}, CallSpec((-1,), (), vmap_axes=parse_vmap_axes(0, "test")), where="test",
        plan=replace(FULL_CHECKS, outputs_in_kernel=True),
    )


def test_private_parameters_share_the_module_memory_copy_on_write(device):
    model = _mlp(device)
    call = _prepare(model, *_inputs(4, 3, device))
    assert len(call.model.params) == 4
    assert all(torch._C._is_cow_tensor(param) for param in call.model.params)
    for param, original in zip(call.model.params, model.parameters()):
        assert param is not original and not param.requires_grad
        assert param.device == original.device and torch.equal(param, original)


def test_a_write_into_the_private_copy_leaves_the_module_unchanged(device):
    model = _mlp(device)
    snapshot = ModuleSnapshot.of(model)
    call = _prepare(model, *_inputs(4, 3, device))
    private = call.model.params[0]
    private.add_(1.0)  # what a forward pass renormalising its weight in place does
    snapshot.assert_unchanged()
    assert torch.equal(private, model[0].weight.detach() + 1.0)


def test_no_copy_outlives_the_call(device):
    """After a call, the module's next write takes its memory back: nothing shares it any more."""
    model = _mlp(device)
    x1, x2 = _inputs(6, 4, device)
    addresses = [param.data_ptr() for param in model.parameters()]
    kernel_fns = [torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=index) for index in (0, 1, 2, 3)]
    kernel_fns.append(torchntk.empirical_ntk_fn(model, vmap_axes=None, implementation=3))
    for kernel_fn in kernel_fns:  # kept alive with their caches
        assert_kernels_close(kernel_fn(x1, x2), reference_ntk(model, x1, x2))
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.0)
    assert [param.data_ptr() for param in model.parameters()] == addresses


@pytest.mark.cpu_only("memory owned by NumPy (torch.from_numpy) exists only on the CPU; moved elsewhere, torch owns it")
def test_parameters_from_numpy_are_copied_eagerly(device):
    """Memory torch does not own cannot be shared copy-on-write; the call copies it instead."""
    model = _mlp(device).double()
    generator = np.random.default_rng(1)
    params = {
        name: torch.from_numpy(generator.standard_normal(tuple(param.shape)))
        for name, param in model.named_parameters()
    }
    before = {name: tensor.clone() for name, tensor in params.items()}
    snapshot = ModuleSnapshot.of(model, extra=params)
    x1, x2 = _inputs(6, 4, device, torch.float64)
    call = _prepare(model, x1, x2, params)
    assert not any(torch._C._is_cow_tensor(param) for param in call.model.params)
    kernel = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3)(x1, x2, params=params)
    assert_kernels_close(kernel, reference_ntk(model, x1, x2, params=params))
    snapshot.assert_unchanged()
    assert all(torch.equal(params[name], before[name]) for name in params)
