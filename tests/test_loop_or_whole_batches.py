"""With ``vmap_axes="auto"``, a model vmap cannot map is computed by a loop over its examples or on
whole batches, whichever AUTO's cost model prices cheaper (NOTE: [Loop or whole batches]).

The model is a neighbour-list energy as force fields compute it: pairs within a cutoff found by
``torch.nonzero`` and summed per atom by an in-place ``scatter_add_`` into a shared buffer. Every
kernel is checked against the float64 brute force of ``torchntk.testing.reference_ntk``, with
each branch forced by replacing the prices.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchntk
from torchntk._kernel import preparation
from torchntk.testing import assert_kernels_close, reference_ntk

pytestmark = pytest.mark.cpu_only("vmap's data-dependent errors as raised on the CPU; the choice is priced for the CPU")


class PairEnergy(nn.Module):
    """Energy of molecules ``(M, A, 3)`` from the pairs of atoms closer than ``cutoff``."""

    def __init__(self, hidden: int = 8, cutoff: float = 1.5) -> None:
        super().__init__()
        self.cutoff = cutoff
        self.radial = nn.Linear(3, hidden)
        self.atom = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        molecules, atoms, _ = positions.shape
        flat = positions.reshape(molecules * atoms, 3)
        molecule = torch.arange(molecules).repeat_interleave(atoms)
        distance = torch.cdist(flat, flat)
        own = torch.eye(molecules * atoms, dtype=torch.bool)
        close = (distance < self.cutoff) & (molecule[:, None] == molecule[None, :]) & ~own
        i, j = torch.nonzero(close, as_tuple=True)
        r = distance[i, j]
        messages = torch.tanh(self.radial(torch.stack([r, r * r, torch.exp(-r)], -1)))
        summed = torch.zeros(molecules * atoms, messages.shape[-1], dtype=positions.dtype)
        summed.scatter_add_(0, i[:, None].expand_as(messages), messages)
        return self.atom(summed).reshape(molecules, atoms).sum(1, keepdim=True)


def _model() -> PairEnergy:
    torch.manual_seed(0)
    return PairEnergy().double()


def _molecules(n: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, 3, dtype=torch.float64, generator=generator)


def _priced(monkeypatch, loop: float, whole: float) -> list:
    """Replaces the prices (loop, whole batches); returns the calls that priced."""
    priced = []

    def price(settings, call, shape_key):
        priced.append(call.side1.loop)
        return loop if call.side1.loop else whole

    monkeypatch.setattr(preparation, "_price", price)
    return priced


def _computed(model, x1, x2, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ntk_fn = torchntk.empirical_ntk_fn(model, **options)
        kernels = [ntk_fn(x1, x2), ntk_fn(x1, x2), ntk_fn(x1)]
        choice = ntk_fn.auto_choice(x1, x2)
    loops = [w for w in caught if issubclass(w.category, torchntk.ExampleLoopWarning)]
    return kernels, choice, loops


def _assert_exact(model, x1, x2, kernels):
    expected, same = reference_ntk(model, x1, x2), reference_ntk(model, x1, None)
    assert_kernels_close(kernels[0], expected, rtol=1e-10)
    assert_kernels_close(kernels[1], expected, rtol=1e-10)
    assert_kernels_close(kernels[2], same, rtol=1e-10)


@pytest.mark.parametrize("implementation", [0, 1, 2])
def test_whole_batches_priced_cheaper_are_used_and_the_reason_says_why(monkeypatch, implementation):
    model, x1, x2 = _model(), _molecules(6, 1), _molecules(4, 2)
    priced = _priced(monkeypatch, loop=2.0, whole=1.0)
    kernels, choice, loops = _computed(model, x1, x2, implementation=implementation)
    _assert_exact(model, x1, x2, kernels)
    assert choice.vmap_axes is None
    assert "nonzero" in choice.vmap_axes_reason and "whole batches are priced below" in choice.vmap_axes_reason
    assert not loops  # the loop was never used: nothing to warn about
    assert sorted(priced) == [False, False, True, True]  # once per key: (x1, x2) and (x1, None)


@pytest.mark.parametrize("implementation", [0, 1, 2])
def test_a_loop_priced_cheaper_is_kept_with_its_warning(monkeypatch, implementation):
    model, x1, x2 = _model(), _molecules(6, 1), _molecules(4, 2)
    _priced(monkeypatch, loop=1.0, whole=2.0)
    kernels, choice, loops = _computed(model, x1, x2, implementation=implementation)
    _assert_exact(model, x1, x2, kernels)
    assert choice.vmap_axes == (0, 0, None)
    assert "nonzero" in choice.vmap_axes_reason and "loop over the examples is priced below" in choice.vmap_axes_reason
    assert len(loops) == 1


def test_without_a_price_the_loop_stays(monkeypatch):
    model, x1, x2 = _model(), _molecules(6, 1), _molecules(4, 2)
    _priced(monkeypatch, loop=None, whole=1.0)
    kernels, choice, loops = _computed(model, x1, x2)
    _assert_exact(model, x1, x2, kernels)
    assert choice.vmap_axes == (0, 0, None) and choice.vmap_axes_reason.endswith("mapped by a Python loop")
    assert len(loops) == 1


def test_the_cost_model_prices_both_and_either_choice_is_exact():
    model, x1, x2 = _model(), _molecules(6, 1), _molecules(4, 2)
    kernels, choice, _ = _computed(model, x1, x2)
    _assert_exact(model, x1, x2, kernels)
    assert "FLOP equivalents" in choice.vmap_axes_reason  # priced, not fallen back


def test_the_price_of_the_loop_follows_the_cost_model_and_its_overhead(monkeypatch):
    """Real prices, no mock: raising the loop's per-example overhead turns the choice to whole batches."""
    model, x1, x2 = _model(), _molecules(6, 1), _molecules(4, 2)
    monkeypatch.setattr(preparation, "LOOP_EXAMPLE_FLOPS", 0.0)
    low = torchntk.empirical_ntk_fn(model)
    low(x1, x2)
    monkeypatch.setattr(preparation, "LOOP_EXAMPLE_FLOPS", 1e15)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torchntk.ExampleLoopWarning)
        high = torchntk.empirical_ntk_fn(model)
        assert_kernels_close(high(x1, x2), reference_ntk(model, x1, x2), rtol=1e-10)
    assert high.auto_choice(x1, x2).vmap_axes is None
    prices = [float(word) for word in low.auto_choice(x1, x2).vmap_axes_reason.split("(")[-1].split()[::2][:2]]
    assert all(price > 0 for price in prices)


@pytest.mark.parametrize("implementation", [0, 1])
def test_explicit_vmap_axes_keep_the_loop_unpriced(monkeypatch, implementation):
    model, x1, x2 = _model(), _molecules(6, 1), _molecules(4, 2)
    priced = _priced(monkeypatch, loop=2.0, whole=1.0)
    kernels, choice, loops = _computed(model, x1, x2, vmap_axes=0, implementation=implementation)
    _assert_exact(model, x1, x2, kernels)
    assert choice.vmap_axes == (0, 0, None) and choice.vmap_axes_reason is None
    assert len(loops) == 1 and not priced
