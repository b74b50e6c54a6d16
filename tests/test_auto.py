"""AUTO (implementation 0): what its choice probes, and that it never fails or picks blind.

NOTE: [What choosing may cost] in ``torchntk/_implementations/auto.py``: the choice counts one
forward pass, probes implementation 2 only when it is the cheapest of 1 and 2, and makes
implementation 3's plan only when 3 can pay for it. These tests spy on the probes and check every
kernel against the float64 brute force.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import torchntk
from torchntk import Estimate, NtkImplementation
from torchntk._implementations import auto as auto_module
from torchntk._implementations import structured as structured_module
from torchntk.testing import assert_kernels_close, reference_ntk

pytestmark = pytest.mark.cpu_only("builds its own models and inputs on the CPU (not converted to --device yet)")

JACOBIAN = NtkImplementation.JACOBIAN_CONTRACTION
PRODUCTS = NtkImplementation.NTK_VECTOR_PRODUCTS
STRUCTURED = NtkImplementation.STRUCTURED_DERIVATIVES


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def _wide() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4)).double()


def _inputs(features: int, n1: int = 5, n2: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return (torch.randn(n, features, dtype=torch.float64, generator=generator) for n in (n1, n2))


class _Spies:
    """Counts implementation 3's plans and implementation 2's probes."""

    def __enter__(self) -> "_Spies":
        self._patches = [
            mock.patch.object(structured_module, "plan_for", wraps=structured_module.plan_for),
            mock.patch.object(auto_module, "vector_products_method", wraps=auto_module.vector_products_method),
        ]
        self.plans, self.probes = (patch.__enter__() for patch in self._patches)
        return self

    def __exit__(self, *exc_info) -> None:
        for patch in reversed(self._patches):
            patch.__exit__(*exc_info)


def test_a_tiny_model_is_chosen_for_without_making_the_structured_plan():
    model = _tiny()
    x1, x2 = _inputs(3)
    with _Spies() as spies:
        auto = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0)
        choice = auto.auto_choice(x1, x2)
        plans_for_choice = spies.plans.call_count
        actual = auto(x1, x2)
    assert plans_for_choice == 0
    assert STRUCTURED in choice.unprobed and STRUCTURED not in choice.estimates
    assert choice.unprobed[STRUCTURED].startswith("not priced")
    assert choice.fallback_parameters == {} and choice.excluded == {}
    assert choice.implementation in choice.estimates and choice.implementation not in choice.unprobed
    # 2 is probed exactly when it is the cheaper of 1 and 2 (never picked unprobed)
    if choice.estimates[PRODUCTS].flops < choice.estimates[JACOBIAN].flops:
        assert spies.probes.call_count == 1 and PRODUCTS not in choice.unprobed
    else:
        assert spies.probes.call_count == 0 and PRODUCTS in choice.unprobed
    assert_kernels_close(actual, reference_ntk(model, x1, x2, trace_axes=()), rtol=1e-10)


def test_probing_everything_prices_every_candidate_and_picks_the_same():
    model = _tiny()
    x1, x2 = _inputs(3)
    lazy = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0).auto_choice(x1, x2)
    with mock.patch.object(auto_module, "_PROBE_EVERYTHING", True):
        auto = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0)
        thorough = auto.auto_choice(x1, x2)
        actual = auto(x1, x2)
    assert thorough.unprobed == {} and set(thorough.estimates) == {JACOBIAN, PRODUCTS, STRUCTURED}
    # what was skipped could not have been picked
    assert thorough.implementation == lazy.implementation
    for implementation, estimate in lazy.estimates.items():
        assert thorough.estimates[implementation].flops == pytest.approx(estimate.flops)
    assert_kernels_close(actual, reference_ntk(model, x1, x2, trace_axes=()), rtol=1e-10)


def test_the_plan_made_to_price_structured_derivatives_is_reused_by_the_kernel():
    model = _wide()
    x1, x2 = _inputs(16, 6, 4)
    with _Spies() as spies:
        auto = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0)
        choice = auto.auto_choice(x1, x2)
        actual = auto(x1, x2)
    assert STRUCTURED in choice.estimates and STRUCTURED not in choice.unprobed
    assert choice.implementation == STRUCTURED
    assert spies.plans.call_count == 1, "the kernel computes with the plan AUTO priced"
    assert_kernels_close(actual, reference_ntk(model, x1, x2, trace_axes=()), rtol=1e-10)


def test_implementation_2_is_never_picked_unprobed_and_is_excluded_when_its_probe_fails():
    """Priced cheapest of 1 and 2, implementation 2 is probed; a failing probe excludes it."""
    model = _tiny()
    x1, x2 = _inputs(3)
    expensive = mock.patch.object(auto_module._Prices, "jacobian_contraction", lambda self: Estimate(1e30, 0.0))

    with expensive, _Spies() as spies:
        choice = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=0).auto_choice(x1, x2)
    assert spies.probes.call_count == 1 and choice.implementation != JACOBIAN
    assert PRODUCTS not in choice.unprobed

    def cannot_run(side):
        raise ValueError("no derivative of this model")

    with expensive, mock.patch.object(auto_module, "vector_products_method", cannot_run):
        auto = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=0)
        choice = auto.auto_choice(x1, x2)
        actual = auto(x1, x2)
    assert choice.excluded == {PRODUCTS: "ValueError: no derivative of this model"}
    assert PRODUCTS not in choice.estimates and choice.implementation != PRODUCTS
    assert_kernels_close(actual, reference_ntk(model, x1, x2), rtol=1e-10)


def test_structured_derivatives_are_priced_when_nothing_else_fits_in_memory():
    model = _tiny()
    x1, x2 = _inputs(3)
    with mock.patch.object(auto_module, "_memory_budget", lambda device: 0.0):
        auto = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0)
        choice = auto.auto_choice(x1, x2)
        actual = auto(x1, x2)
    assert STRUCTURED in choice.estimates and choice.unprobed.keys() <= {PRODUCTS}
    smallest = min(choice.estimates, key=lambda key: choice.estimates[key].memory_bytes)
    assert choice.implementation == smallest
    assert_kernels_close(actual, reference_ntk(model, x1, x2, trace_axes=()), rtol=1e-10)


def test_the_choice_never_raises_when_the_cost_model_fails():
    model = _tiny()
    x1, x2 = _inputs(3)

    def broken(self, call):
        raise RuntimeError("cost model broke")

    with mock.patch.object(auto_module._Prices, "__init__", broken):
        auto = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=0)
        choice = auto.auto_choice(x1, x2)
        actual = auto(x1, x2)
    assert choice.implementation == JACOBIAN and choice.estimates == {} and choice.excluded == {}
    assert set(choice.unprobed) == {JACOBIAN, PRODUCTS, STRUCTURED}
    assert all("RuntimeError: cost model broke" in reason for reason in choice.unprobed.values())
    assert_kernels_close(actual, reference_ntk(model, x1, x2), rtol=1e-10)


@pytest.mark.parametrize("vmap_axes", [0, None], ids=["vmap0", "novmap"])
@pytest.mark.parametrize("trace_axes", [(), (-1,)], ids=["full", "traced"])
@pytest.mark.parametrize("width", [2, 64])
def test_the_choice_is_a_priced_candidate_and_its_kernel_is_right(width, trace_axes, vmap_axes):
    model = nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 3)).double()
    x1, x2 = _inputs(3, 4, 2)
    auto = torchntk.empirical_ntk_fn(model, trace_axes=trace_axes, vmap_axes=vmap_axes, implementation=0)
    choice = auto.auto_choice(x1, x2)
    assert choice.implementation in choice.estimates
    assert choice.implementation not in choice.unprobed and choice.implementation not in choice.excluded
    assert not (set(choice.excluded) & set(choice.estimates))
    assert STRUCTURED not in choice.unprobed or STRUCTURED not in choice.estimates
    assert_kernels_close(auto(x1, x2), reference_ntk(model, x1, x2, trace_axes=trace_axes), rtol=1e-10)


class _Mixed(nn.Module):
    """A convolution, a matrix product, a batched product and attention: every FLOP formula kind."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3)
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x).transpose(1, 2)
        h = torch.bmm(h, h.transpose(1, 2)) @ h
        h, _ = self.attention(h, h, h, need_weights=False)
        return self.head(h.mean(1))


def test_the_counter_counts_the_flops_torchs_flop_counter_counts():
    model = _Mixed().eval()
    x = torch.randn(2, 2, 7)
    params = dict(model.named_parameters())
    with torch.no_grad(), FlopCounterMode(display=False) as reference:
        model(x)
    counter = auto_module._Counter()
    with torch.no_grad(), counter:
        torch.func.functional_call(model, params, (x,))
    assert counter.flops == reference.get_total_flops() > 0
    assert counter.calls > 0 and counter.elements > counter.view_elements > 0
