"""``params`` as a name pattern, a list of patterns or a predicate: parameter subsets (LoRA
adapters, a head) without editing the model, against the float64 brute force restricted to them.
Models and inputs live on the run device (``pytest --device``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchntk
from tests.cases import DEVICE, to_device
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_ntk


class _LoraLinear(nn.Module):
    """``W x + B A x`` with a frozen ``W`` and trainable low-rank adapters, as LoRA fine-tuning has."""

    def __init__(self, features: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(features, features)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, features) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(features, rank) * 0.3)

    def forward(self, x):
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_LoraLinear(5), nn.Tanh(), _LoraLinear(5), nn.Tanh(), nn.Linear(5, 3)).double().to(DEVICE)


def _subset(model: nn.Module, names: list[str]) -> dict:
    values = dict(model.named_parameters())
    return {name: values[name] for name in names}


SELECTIONS = {
    "lora pattern": ("*.lora_*", ["0.lora_a", "0.lora_b", "2.lora_a", "2.lora_b"]),
    "head patterns": (["4.*"], ["4.weight", "4.bias"]),
    "frozen by pattern": ("*.base.weight", ["0.base.weight", "2.base.weight"]),
    "predicate": (lambda name, param: param.ndim == 1, ["0.base.bias", "2.base.bias", "4.bias"]),
}


@pytest.mark.parametrize("vmap_axes", [0, None], ids=["vmap0", "no-vmap"])
@pytest.mark.parametrize("implementation", [1, 2, 3, 0], ids=["JC", "NVP", "SD", "AUTO"])
@pytest.mark.parametrize("selection", sorted(SELECTIONS))
def test_selected_parameters_are_differentiated(selection, implementation, vmap_axes):
    model = _model()
    x1, x2 = to_device((torch.randn(4, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)))
    pattern, names = SELECTIONS[selection]
    snapshot = ModuleSnapshot.of(model)
    expected = reference_ntk(model, x1, x2, params=_subset(model, names), trace_axes=())
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=implementation)
    assert_kernels_close(ntk_fn(x1, x2, pattern), expected)
    snapshot.assert_unchanged()


def test_a_selection_matching_nothing_names_the_parameters():
    model = _model()
    with pytest.raises(ValueError, match=r"'\*\.adapter_\*' selects no parameter.*0\.base\.weight"):
        torchntk.empirical_ntk_fn(model)(to_device(torch.randn(2, 5, dtype=torch.float64)), None, "*.adapter_*")


def test_a_predicate_must_return_a_bool():
    model = _model()
    with pytest.raises(TypeError, match="predicate must return a bool"):
        torchntk.empirical_ntk_fn(model)(to_device(torch.randn(2, 5, dtype=torch.float64)), None, lambda name, p: name)


def test_a_module_is_not_taken_for_a_predicate():
    model = _model()
    with pytest.raises(TypeError, match="`params` must be None, a mapping"):
        torchntk.empirical_ntk_fn(model)(to_device(torch.randn(2, 5, dtype=torch.float64)), None, nn.Linear(2, 2))
