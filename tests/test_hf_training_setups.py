"""Models as training set-ups leave them: activation checkpointing (either ``use_reentrant``, on the
PyTorch versions of CI's matrix) and Hugging Face's input-grad hooks (NOTE: [Reentrant checkpoints],
NOTE: [Hooks that mark outputs as requiring grad]).

Each kernel is compared with the float64 kernel of the same weights in a model without checkpoints
or hooks, and the user's model must come out unchanged (hooks, flags, parameters).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import torchntk
from tests import zoo
from tests.cases import DEVICE, to_device
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_ntk

IMPLEMENTATIONS = (1, 2, 3, 0)


class _Checkpointed(nn.Module):
    """A block run through ``torch.utils.checkpoint`` (or ``checkpoint_sequential``)."""

    def __init__(self, use_reentrant: bool, sequential: bool = False) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 2)
        self.use_reentrant, self.sequential = use_reentrant, sequential

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequential:
            h = checkpoint_sequential(self.block, 2, x, use_reentrant=self.use_reentrant)
        else:
            h = checkpoint(self.block, x, use_reentrant=self.use_reentrant)
        return self.head(h)


class _Plain(nn.Module):
    def __init__(self, checkpointed: _Checkpointed) -> None:
        super().__init__()
        self.block, self.head = checkpointed.block, checkpointed.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


@pytest.mark.parametrize("sequential", [False, True], ids=["checkpoint", "checkpoint_sequential"])
@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_checkpointed_modules_are_exact(implementation, use_reentrant, sequential):
    torch.manual_seed(0)
    model = _Checkpointed(use_reentrant, sequential).double().to(DEVICE)
    generator = torch.Generator().manual_seed(1)
    x1, x2 = to_device(tuple(torch.randn(n, 3, dtype=torch.float64, generator=generator) for n in (4, 3)))
    snapshot = ModuleSnapshot.of(model)
    for vmap_axes in ("auto", 0, None):
        ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=implementation)
        assert_kernels_close(ntk_fn(x1, x2), reference_ntk(_Plain(model), x1, x2, trace_axes=()), rtol=1e-10)
    snapshot.assert_unchanged()
    assert "requires_grad_" not in vars(torch.Tensor)  # nothing left patched


def _gpt2(setup: str) -> tuple[nn.Module, nn.Module]:
    """A GPT-2 set up for training as ``setup`` says, and a plain copy of the same weights."""
    transformers = zoo.import_transformers()
    config = transformers.GPT2Config(
        vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # training mode without randomness
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).double().eval()
    plain = copy.deepcopy(model)
    if setup == "input_require_grads":
        model.enable_input_require_grads()
    elif setup.startswith("checkpointing"):
        reentrant = setup.endswith("reentrant")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.enable_input_require_grads()  # what peft's prepare_model_for_kbit_training adds
        model.train()  # Hugging Face checkpoints in training mode only
        plain.train()
    elif setup == "disabled":
        model.gradient_checkpointing_enable()
        model.enable_input_require_grads()
        model.gradient_checkpointing_disable()  # the input hook stays
    return model.to(DEVICE), plain.to(DEVICE)


def _last_logits(output, input_ids):
    return output.logits[:, -1]


@pytest.mark.parametrize("setup", ["input_require_grads", "checkpointing", "checkpointing_reentrant", "disabled"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_hugging_face_training_setups_are_exact(setup, implementation):
    model, plain = _gpt2(setup)
    generator = torch.Generator().manual_seed(2)
    x1, x2 = to_device(tuple(torch.randint(0, 50, (n, 6), generator=generator) for n in (3, 2)))
    hooks = {name: dict(module._forward_hooks) for name, module in model.named_modules()}
    flags = {name: getattr(module, "gradient_checkpointing", None) for name, module in model.named_modules()}
    snapshot = ModuleSnapshot.of(model)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), implementation=implementation, output_fn=_last_logits)
    kernel = ntk_fn(x1, x2)
    expected = torchntk.empirical_ntk_fn(plain, trace_axes=(), vmap_axes=None, implementation=1,
                                         output_fn=_last_logits)(x1, x2)
    assert_kernels_close(kernel, expected, rtol=1e-9)
    snapshot.assert_unchanged()
    assert {name: dict(module._forward_hooks) for name, module in model.named_modules()} == hooks
    assert {name: getattr(module, "gradient_checkpointing", None) for name, module in model.named_modules()} == flags
    # PyTorch's requires_grad_ is back, and works
    assert "requires_grad_" not in vars(torch.Tensor) and torch.zeros(1).requires_grad_().requires_grad
