"""AUTO (implementation 0): what its choice probes, and that it never fails or picks blind.

NOTE: [What choosing may cost] in ``torchntk/_implementations/auto.py``: the choice counts one
forward pass, probes implementation 2 only when it is the cheapest of 1 and 2, and makes
implementation 3's plan only when 3 can pay for it. These tests spy on the probes and check every
kernel against the float64 brute force.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from unittest import mock

import opt_einsum
import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import torchntk
from tests import cases
from tests.cases import to_device
from tests.zoo import AniWithForces
from torchntk import Estimate, NtkImplementation
from torchntk._implementations import auto as auto_module
from torchntk._implementations import counting as counting_module
from torchntk._implementations import structured as structured_module
from torchntk._implementations.structured import _contract as structured_contract
from torchntk._implementations.structured import _cost as structured_cost_module
from torchntk._implementations.structured import _joint as structured_joint
from torchntk._plan.shared import forget_shared_planners
from torchntk._utils.threads import FORWARD_MODE_LOCK
from torchntk.testing import assert_kernels_close, reference_ntk

JACOBIAN = NtkImplementation.JACOBIAN_CONTRACTION
PRODUCTS = NtkImplementation.NTK_VECTOR_PRODUCTS
STRUCTURED = NtkImplementation.STRUCTURED_DERIVATIVES


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double().to(cases.DEVICE)


def _wide() -> nn.Module:
    layers = (nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))
    return nn.Sequential(*layers).double().to(cases.DEVICE)


def _inputs(features: int, n1: int = 5, n2: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)  # on the CPU, then moved: the same numbers on every device
    return to_device(tuple(torch.randn(n, features, dtype=torch.float64, generator=generator) for n in (n1, n2)))


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


def test_a_tiny_unmapped_model_is_chosen_for_without_making_the_structured_plan():
    # Without vmap_axes, 3's passes sweep every output entry of the batch and cannot take the
    # whole-batch pass: its lower bound alone exceeds 2's price (mapped, 3 is the fastest here)
    model = _tiny()
    x1, x2 = _inputs(3)
    with _Spies() as spies:
        auto = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=None, implementation=0)
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
    forget_shared_planners()  # a kernel function of its own, planned under this patch
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


@pytest.fixture
def cpu_prices(monkeypatch):
    """ATen calls priced as on the CPU, on every device: the tests using it need 3 to be probed and
    picked, and CUDA's price of a call (its launch) makes a small model's probe not worth it."""
    monkeypatch.setitem(auto_module._OP_CALL_FLOPS, "cuda", auto_module._OP_CALL_FLOPS["cpu"])


def test_auto_choice_prices_the_call_as_the_kernel_function_prepares_it(monkeypatch):
    """The choice is cached per input shapes, so ``auto_choice`` before the first call and the
    first call itself must price the same call, working-set runs included (NOTE: [Working-set
    runs]): they once differed, and a GPT-2 kernel computed with 3 where auto_choice said 1."""
    monkeypatch.setattr(torchntk._kernel.preparation, "working_set_run_length", lambda examples, written, element: 2)
    model = _wide()
    x1, x2 = _inputs(16, 6, 4)
    asked_first = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0)
    before = asked_first.auto_choice(x1, x2)
    called_first = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0)
    called_first(x1, x2)
    after = called_first.auto_choice(x1, x2)
    assert before.implementation == after.implementation
    assert before.estimates == after.estimates


class _PositionEmbedded(nn.Module):
    """Token and position embeddings, a hidden layer, a head: the position embedding's output, of
    one row for every example, does not hold the examples, so implementation 3's passes cannot
    run over the whole batch (as in Hugging Face transformers)."""

    def __init__(self):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(50, 16), nn.Embedding(12, 16)
        self.register_buffer("ids", torch.arange(12)[None])
        self.hidden, self.head = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(self.tokens(x) + self.positions(self.ids))).mean(1))


def test_a_layout_that_rules_out_whole_batches_is_priced_before_3s_plan_is_checked(cpu_prices):
    """NOTE: [What choosing may cost]: where 3 wins only by passes over the whole batch, the check's
    whole-batch pass tells whether the shapes allow them before the plan's check is paid for; here
    they do not (it stops at the position embedding, whose output is one example's shape over
    every example, and no recording pass runs: NOTE: [The layout read from the check's own
    pass]), 3 priced per example loses to 1, and its plan is never checked."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _PositionEmbedded().double().to(cases.DEVICE).eval()
    x = to_device(torch.randint(0, 50, (8, 12), generator=torch.Generator().manual_seed(1)))
    reasons = []
    layout_reason = structured_module.StructuredDerivatives.layout_reason

    def spied(self, call, scope=None):
        reasons.append(layout_reason(self, call, scope))
        return reasons[-1]

    with mock.patch.object(structured_module.StructuredDerivatives, "layout_reason", spied), \
            mock.patch.object(structured_module, "plan_for", wraps=structured_module.plan_for) as plans, \
            mock.patch.object(structured_module._whole_batch, "_output_axes",
                              wraps=structured_module._whole_batch._output_axes) as recorded:
        ntk_fn = torchntk.empirical_ntk_fn(model)
        kernels = [ntk_fn(x) for _ in range(3)]
        choice = ntk_fn.auto_choice(x)
    assert len(reasons) == 1 and "does not hold the examples" in reasons[0] and recorded.call_count == 0
    assert choice.implementation == JACOBIAN and plans.call_count == 0
    for kernel in kernels:
        assert_kernels_close(kernel, reference_ntk(model, x))


class _LeadingAxis(nn.Module):
    """The hidden layer runs on the inputs with a leading axis of size 1: its output holds the
    examples on axis 1, behind another axis of size 1 per example, where the whole-batch pass
    cannot guess them."""

    def __init__(self):
        super().__init__()
        self.hidden, self.head = nn.Linear(16, 256), nn.Linear(256, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(x.unsqueeze(0))).squeeze(0))


@pytest.mark.parametrize("model, recorded_passes", [(_wide, 0), (_LeadingAxis, 1)], ids=["guessed", "recorded"])
def test_the_layout_shapes_found_for_pricing_are_reused_by_the_plans_check(model, recorded_passes, cpu_prices):
    """Where the shapes allow whole batches and 3 is picked, its check reuses the pass that priced
    it: the check's own whole-batch pass, where every perturbed output holds the examples on the
    axis a guess from one example's shapes names (no recording pass), else the recording pass that
    found the axes (NOTE: [The layout read from the check's own pass]). One whole-batch pass of the
    check's examples completes."""
    model = model().double().to(cases.DEVICE)
    x1, x2 = _inputs(16, 6, 4)
    whole_batch_pass = structured_module._whole_batch.whole_batch_pass
    completed = []

    def counted(*args, **kwargs):
        done = whole_batch_pass(*args, **kwargs)
        completed.extend([done] if done is not None else [])
        return done

    with mock.patch.object(structured_module._whole_batch, "_output_axes",
                           wraps=structured_module._whole_batch._output_axes) as recorded, \
            mock.patch.object(structured_module._whole_batch, "whole_batch_pass", counted):
        ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), implementation=0)
        kernels = [ntk_fn(x1, x2) for _ in range(3)]
    choice = ntk_fn.auto_choice(x1, x2)
    assert choice.implementation == STRUCTURED and choice.vmap_axes_reason is None
    assert recorded.call_count == recorded_passes and len(completed) == 1
    for kernel in kernels:
        assert_kernels_close(kernel, reference_ntk(model, x1, x2, trace_axes=()))


def test_the_plan_made_to_price_structured_derivatives_is_reused_by_the_kernel(cpu_prices):
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


def _plan_spies():
    """Spies on implementation 3's probe passes and on the check of a plan against autograd."""
    return (
        mock.patch.object(structured_module, "probe_plan", wraps=structured_module.probe_plan),
        mock.patch.object(structured_module, "disagreements", wraps=structured_module.disagreements),
    )


def test_structured_derivatives_are_priced_from_the_probe_and_checked_only_when_picked(cpu_prices):
    model = _wide()
    x1, x2 = _inputs(16, 6, 4)
    priced = mock.patch.object(auto_module, "_PROBE_BUDGET", float("inf"))  # price 3 whatever it saves
    losing = mock.patch.object(auto_module, "_STRUCTURED_CONTRACTION_WEIGHT", 1e12)  # ... and let it lose
    probes, checks = _plan_spies()
    with priced, losing, probes as probe_passes, checks as check_passes:
        auto = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0)
        choice = auto.auto_choice(x1, x2)
        assert STRUCTURED in choice.estimates and choice.implementation != STRUCTURED
        assert (probe_passes.call_count, check_passes.call_count) == (1, 0), "3 lost: its plan is not checked"
        actual = auto(x1, x2)
    assert_kernels_close(actual, reference_ntk(model, x1, x2, trace_axes=()), rtol=1e-10)

    probes, checks = _plan_spies()
    forget_shared_planners()  # a kernel function of its own, planned under these patches
    with priced, probes as probe_passes, checks as check_passes:
        auto = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0)
        choice = auto.auto_choice(x1, x2)
        assert choice.implementation == STRUCTURED
        assert check_passes.call_count == 1, "3 is picked: its plan is checked against autograd"
        actual = auto(x1, x2)
        # the check reused the probe AUTO priced from, and the kernel computes with the checked plan
        assert (probe_passes.call_count, check_passes.call_count) == (1, 1)
    assert_kernels_close(actual, reference_ntk(model, x1, x2, trace_axes=()), rtol=1e-10)


def test_parameters_the_check_demotes_are_priced_again_as_fallback(cpu_prices):
    model = _wide()
    x1, x2 = _inputs(16, 6, 4)
    first_weight = dict(model.named_parameters())["0.weight"]

    def demoting(side, plan, **options):
        index = next(i for i, param in enumerate(side.model.params) if param.shape == first_weight.shape)
        return {index: "demoted by the test"}

    probes, _ = _plan_spies()
    with probes, mock.patch.object(structured_module, "disagreements", demoting):
        unchecked = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0)
        with mock.patch.object(structured_module.StructuredDerivatives, "plan", lambda *args, **kwargs: 1 / 0):
            priced_unchecked = unchecked.auto_choice(x1, x2)  # 3 is excluded when checking it fails
        forget_shared_planners()  # a kernel function of its own, planned without that patch
        auto = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0)
        choice = auto.auto_choice(x1, x2)
        actual = auto(x1, x2)
    assert priced_unchecked.excluded == {STRUCTURED: "ZeroDivisionError: division by zero"}
    assert STRUCTURED not in priced_unchecked.estimates and priced_unchecked.implementation != STRUCTURED
    assert choice.fallback_parameters == {"0.weight": "demoted by the test"}
    call = _first_call(model, x1, x2)
    probed = structured_module.probe_plan(call, structured_module.StructuredOptions()).unchecked()
    assert choice.estimates[STRUCTURED].flops > auto_module._Prices(call).structured_derivatives(probed).flops
    assert_kernels_close(actual, reference_ntk(model, x1, x2, trace_axes=()), rtol=1e-10)


def _first_call(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor, trace_axes: tuple = ()):
    """The validated kernel call AUTO chooses for (caught on its way to ``choose``)."""
    calls = []
    original = auto_module.choose

    def catching(call, plans, *args, **kwargs):
        calls.append(call)
        return original(call, plans, *args, **kwargs)

    forget_shared_planners()  # a kernel function of its own, whose choice is made, not kept
    with mock.patch.object(auto_module, "choose", catching):
        torchntk.empirical_ntk_fn(model, trace_axes=trace_axes, vmap_axes=0, implementation=0).auto_choice(x1, x2)
    return calls[0]


def test_one_df_dy_pass_for_both_sides_is_priced_where_the_sides_join():
    model = _wide()
    x1, x2 = _inputs(16, 6, 4)
    call = _first_call(model, x1, x2)
    plan = structured_module.plan_for(call, structured_module.StructuredOptions())
    per_example = structured_joint.gradients_per_example(call, plan)
    assert per_example == 4 * (256 + 256 + 4)  # outputs times the perturbed entries of the three layers
    assert structured_joint.joinable(call.side1, call.side2, per_example)
    assert structured_joint.joined(call.side1, call.side2, per_example) is not None
    prices = auto_module._Prices(call)
    joint = prices.structured_derivatives(plan).flops
    with mock.patch.object(structured_joint, "MAX_JOINED_GRADIENTS", 0):  # G too large to join
        assert not structured_joint.joinable(call.side1, call.side2, per_example)
        assert structured_joint.joined(call.side1, call.side2, per_example) is None
        apart = prices.structured_derivatives(plan).flops
    # the ATen calls of one side's df/dy pass are saved: 2 per call of the counted pass (forward and
    # sweep, both over the whole batch: NOTE: [Whole-batch pullback])
    assert plan.whole_batch is not None
    assert apart - joint == pytest.approx(auto_module._WHOLE_BATCH_OPS * prices.per_op * prices.per_example_ops[1])
    # per example (a plan whose whole-batch pass was refused), 4 per call
    per_example_plan = dataclasses.replace(plan, whole_batch=None, whole_batch_reason="refused")
    joint = prices.structured_derivatives(per_example_plan).flops
    with mock.patch.object(structured_joint, "MAX_JOINED_GRADIENTS", 0):
        apart = prices.structured_derivatives(per_example_plan).flops
    assert apart - joint == pytest.approx(4 * prices.per_op * prices.per_example_ops[1])
    assert not structured_joint.joinable(call.side1, call.side2, None)


def test_implementation_2_is_never_picked_unprobed_and_is_excluded_when_its_probe_fails():
    """Priced cheapest of 1 and 2, implementation 2 is probed; a failing probe excludes it."""
    model = _tiny()
    x1, x2 = _inputs(3)
    expensive = mock.patch.object(auto_module._Prices, "jacobian_contraction", lambda self: Estimate(1e30, 0.0))
    # 3, the cheapest on this model, priced above 2 so that 2 is the pick to probe
    dear = mock.patch.object(auto_module._Prices, "structured_derivatives", lambda self, plan: Estimate(1e29, 0.0))

    with expensive, dear, _Spies() as spies:
        choice = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=0).auto_choice(x1, x2)
    assert spies.probes.call_count == 1 and choice.implementation != JACOBIAN
    assert PRODUCTS not in choice.unprobed

    def cannot_run(side):
        raise ValueError("no derivative of this model")

    forget_shared_planners()  # a kernel function of its own, planned under these patches
    with expensive, dear, mock.patch.object(auto_module, "vector_products_method", cannot_run):
        auto = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=0)
        choice = auto.auto_choice(x1, x2)
        actual = auto(x1, x2)
    assert choice.excluded == {PRODUCTS: "ValueError: no derivative of this model"}
    assert PRODUCTS not in choice.estimates and choice.implementation != PRODUCTS
    assert_kernels_close(actual, reference_ntk(model, x1, x2), rtol=1e-10)


def test_structured_derivatives_are_priced_when_nothing_else_fits_in_memory():
    model = _tiny()
    x1, x2 = _inputs(3)
    auto = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0, memory=1)
    choice = auto.auto_choice(x1, x2)
    assert STRUCTURED in choice.estimates and choice.unprobed.keys() <= {PRODUCTS}
    smallest = min(choice.estimates, key=lambda key: (choice.estimates[key].memory_bytes, int(key)))
    assert choice.implementation == smallest and choice.memory_budget_bytes == 1
    with pytest.raises(torchntk.KernelMemoryError, match="more than the memory budget of 1 B"):
        auto(x1, x2)  # nothing fits: refused (tests/test_memory.py has the plans that do fit)


def test_the_choice_never_raises_when_the_cost_model_fails():
    model = _tiny()
    x1, x2 = _inputs(3)

    def broken(self, call, *counts):
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
    model = nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 3)).double().to(cases.DEVICE)
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
    model = _Mixed().eval().to(cases.DEVICE)
    x = to_device(torch.randn(2, 2, 7))
    params = dict(model.named_parameters())
    with torch.no_grad(), FlopCounterMode(display=False) as reference:
        model(x)
    counter = counting_module._CountingMode()
    with torch.no_grad(), counter:
        torch.func.functional_call(model, params, (x,))
    assert counter.flops == reference.get_total_flops() > 0
    assert counter.calls > 0 and counter.elements > counter.view_elements > 0


class _Products(nn.Module):
    """Every matrix product the counter prices from shapes (``addmm`` with its scalars, ``baddbmm``),
    a recurrent layer (multi-output ops) and a view-heavy tail."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 4))
        self.bias = nn.Parameter(torch.randn(4))
        self.rnn = nn.LSTM(4, 3, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.addmm(self.bias, x.reshape(-1, 5), self.weight, beta=0.5, alpha=2.0).reshape(x.shape[0], -1, 4)
        mix = torch.ones(x.shape[0], 4, 2, dtype=h.dtype, device=h.device)
        h = torch.baddbmm(h[..., :1, :2], h, mix, alpha=0.5)  # the input broadcast: shaped unlike the factors
        h, _ = self.rnn(torch.cat([h, h], -1))
        return h.transpose(1, 2).reshape(x.shape[0], -1)


class _Convolutions(nn.Module):
    """Every convolution form the counter prices from shapes: 1-, 2- and 3-d, strided, dilated,
    grouped and transposed (whose positions are the input's)."""

    def __init__(self) -> None:
        super().__init__()
        self.one = nn.Conv1d(3, 4, 3, dilation=2)
        self.two = nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2)
        self.up = nn.ConvTranspose2d(6, 2, 3, stride=2, output_padding=1)
        self.three = nn.Conv3d(2, 2, 2)
        self.down = nn.ConvTranspose1d(2, 2, 3, groups=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (N, 3, 14)
        h = self.one(x)  # (N, 4, 10)
        h = self.up(self.two(h.unsqueeze(-1).expand(-1, -1, -1, 10)))  # (N, 2, 10, 10)
        h = self.three(h.unsqueeze(2).expand(-1, -1, 3, -1, -1))  # (N, 2, 2, 9, 9)
        return self.down(h.flatten(2)).flatten(1)


class _ReferenceCounter(TorchDispatchMode):
    """What :class:`counting_module._CountingMode` counts for AUTO, written the plain way: the
    registry's formula looked up per call, every result flattened by pytree."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = self.elements = self.view_elements = self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        self.calls += 1
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=result)
        elements = sum(leaf.numel() for leaf in pytree.tree_leaves(result) if isinstance(leaf, torch.Tensor))
        self.elements += elements
        self.view_elements += elements if func.is_view else 0
        return result


@pytest.mark.parametrize(
    "build, shape", [(_Mixed, (2, 2, 7)), (_Products, (2, 3, 5)), (_wide, (3, 16)), (_Convolutions, (2, 3, 14))]
)
def test_the_counter_counts_what_a_plain_count_counts(build, shape):
    model = build().double().to(cases.DEVICE)
    x = to_device(torch.randn(*shape, dtype=torch.float64))
    params = dict(model.named_parameters())
    counts = []
    # the second counting mode finds what each op needs cached
    for counter in (_ReferenceCounter(), counting_module._CountingMode(), counting_module._CountingMode()):
        with torch.no_grad(), counter:
            torch.func.functional_call(model, params, (x,))
        counts.append((counter.calls, counter.elements, counter.view_elements, counter.flops))
    with torch.no_grad(), FlopCounterMode(display=False) as flop_counter:
        model(x)
    assert counts[0] == counts[1] == counts[2]
    assert counts[1][3] == flop_counter.get_total_flops() > 0
    assert counts[1][1] > counts[1][2] > 0


_LOCK_HELD: list = []


class _Sequences(nn.Module):
    """A dense layer over the last axis of ``(N, L, 3)`` inputs: x1 and x2 may differ in ``L``, so in
    their examples' shapes. Records whether its caller holds the forward-mode lock (outside the
    module: torchntk evaluates a private copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _LOCK_HELD.append(FORWARD_MODE_LOCK._is_owned())
        return torch.tanh(self.linear(x))


@pytest.mark.parametrize("x2_shape", ["none", "same", "other"])
@pytest.mark.parametrize("implementation", [0, 1])
def test_one_counting_pass_per_example_shapes_serves_auto_and_the_memory_model(implementation, x2_shape):
    """NOTE: [One counting pass]: a new kernel function counts each side's example once, whether
    for AUTO's choice (``auto_choice``, then the first call) or for the memory model alone (the
    working-set runs and the memory plan of a fixed implementation under a budget); x2 whose
    examples have x1's shapes is priced from x1's count. The kernels stay exact."""
    model = _Sequences().double().to(cases.DEVICE)
    generator = torch.Generator().manual_seed(0)
    x1 = to_device(torch.randn(4, 5, 3, dtype=torch.float64, generator=generator))
    x2 = {"none": None, "same": x1[:3] + 1, "other": x1[:3, :2] + 1}[x2_shape]
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation, memory="64GB")
    with mock.patch.object(counting_module, "count_example", wraps=counting_module.count_example) as count:
        if implementation == 0:
            ntk_fn.auto_choice(x1, x2)
            assert count.call_count == (2 if x2_shape == "other" else 1)
        kernel = ntk_fn(x1, x2)
        ntk_fn(x1, x2)
        assert count.call_count == (2 if x2_shape == "other" else 1)
    assert_kernels_close(kernel, reference_ntk(model, x1, x2))


def test_the_counting_pass_holds_the_forward_mode_lock():
    """NOTE: [One counting pass]: the pass enters ``forward_mode_kernels``, which saves and sets
    process-wide flags, so it holds FORWARD_MODE_LOCK also where the caller does not (``auto_choice``
    of a kernel function, the memory model of implementation 1), and releases it after."""
    model = _Sequences().double().to(cases.DEVICE)
    x = to_device(torch.randn(4, 5, 3, dtype=torch.float64))
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1)
    call = ntk_fn._settings.prepare(x, None, None, {}, "ntk_fn", needs_outputs=False)
    _LOCK_HELD.clear()
    count = counting_module.count_example(call.side1)
    assert _LOCK_HELD == [True] and not FORWARD_MODE_LOCK._is_owned()
    assert count is not None and count.calls > 0 and count.written > 0


class _Forces(nn.Module):
    """Forces ``-dE/dx`` of an energy network, by ``torch.autograd.grad`` inside ``forward``; or the
    energies alone (``forces=False``)."""

    def __init__(self, forces: bool = True) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        self.forces = forces

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_()
        energy = self.net(x)
        if not self.forces:
            return energy
        return -torch.autograd.grad(energy.sum(), x, create_graph=True)[0]


class _Laplacian(nn.Module):
    """A Poisson residual by ``torch.func.hessian`` inside ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hessians = torch.func.vmap(torch.func.hessian(lambda point: self.net(point).squeeze(-1)))(x)
        return hessians.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True)


class _NodeCounter(TorchDispatchMode):
    """ATen calls, and those made while autograd's engine runs a node of a backward pass (read
    through another of PyTorch's hooks than the counter's)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = self.in_backward = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        self.in_backward += torch._C._current_autograd_node() is not None
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "build, shape", [(_Forces, (3, 6)), (_Laplacian, (3, 2)), (lambda: _Forces(forces=False), (3, 6)), (_wide, (3, 16))],
    ids=["autograd-grad", "func-hessian", "energies", "plain"],
)
def test_the_counter_tells_the_derivatives_a_model_takes_apart(build, shape):
    """NOTE: [Derivatives in the counted pass]: the calls made by the backward passes inside the
    model's forward are counted apart, as a count through ``_current_autograd_node`` finds them;
    a model without such derivatives has none."""
    model = build().double().to(cases.DEVICE)
    x = to_device(torch.randn(*shape, dtype=torch.float64))
    params = dict(model.named_parameters())
    counter, reference = counting_module._CountingMode(), _NodeCounter()
    for mode in (counter, reference):
        with torch.enable_grad(), mode:  # as the counted pass evaluates a model that takes derivatives
            torch.func.functional_call(model, params, (x,))
    count = counter.count()
    assert count.calls == reference.calls
    assert count.derivative_calls == reference.in_backward
    assert (count.derivative_calls > 0) == (build in (_Forces, _Laplacian))


def test_a_backward_pass_around_the_count_is_not_the_models():
    """The counted pass run inside a backward pass (a kernel computed in a user's backward hook)
    counts no derivative calls of a model that takes none."""
    model = _wide().double().to(cases.DEVICE)
    params = dict(model.named_parameters())
    x = to_device(torch.randn(3, 16, dtype=torch.float64))
    counts = []

    def hook(gradient: torch.Tensor) -> torch.Tensor:
        counter = counting_module._CountingMode()
        with torch.no_grad(), counter:
            torch.func.functional_call(model, params, (x,))
        counts.append(counter.count())
        return gradient

    weight = to_device(torch.ones(2, dtype=torch.float64, requires_grad=True))
    weight.register_hook(hook)
    (weight * 3).sum().backward()
    assert len(counts) == 1 and counts[0].calls > 0 and counts[0].derivative_calls == 0


def test_forward_mode_prices_the_derivatives_a_model_takes_at_their_own_rate(monkeypatch, cpu_prices):
    """NOTE: [Derivatives in the counted pass]: implementation 2's forward-mode pass is priced at
    ``_FORWARD_MODE_DERIVATIVE_OPS`` calls per call of the model's own derivatives, and at
    ``_FORWARD_MODE_OPS`` per call of the forward; 1's estimate does not change."""
    model = _Forces().double().to(cases.DEVICE)
    x1, x2 = (to_device(torch.randn(n, 6, dtype=torch.float64)) for n in (3, 2))

    counts, original = [], counting_module.count_example

    def counted(side):
        counts.append(original(side))
        return counts[-1]

    def estimates() -> dict:
        forget_shared_planners()  # each priced by a kernel function of its own
        ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=None, implementation=0)
        with mock.patch.object(counting_module, "count_example", counted):
            return ntk_fn.auto_choice(x1, x2).estimates

    priced, rate = estimates(), auto_module._FORWARD_MODE_DERIVATIVE_OPS - auto_module._FORWARD_MODE_OPS
    monkeypatch.setattr(auto_module, "_FORWARD_MODE_DERIVATIVE_OPS", auto_module._FORWARD_MODE_OPS)
    flat = estimates()
    one, two = NtkImplementation.JACOBIAN_CONTRACTION, NtkImplementation.NTK_VECTOR_PRODUCTS
    assert priced[one].flops == flat[one].flops
    x1_count = counts[0]
    passes = math.ceil(x2.numel() / auto_module.TANGENTS_PER_PASS)  # x2's forces, all tangents
    extra = rate * x1_count.derivative_calls * passes * auto_module._op_call_flops(x1.device)
    assert x1_count.derivative_calls > 0
    assert priced[two].flops == pytest.approx(flat[two].flops + extra)


def test_auto_prices_torchanis_float64_energies_with_forces_inside_forward_for_1(monkeypatch):
    """The recipe of docs/scientific.md (torchani, float64, forces computed in ``forward``, the
    energies picked by ``output_fn``): on whole batches AUTO priced 2 below 1 while 2 ran 1.5x
    slower (NOTE: [Derivatives in the counted pass]); it prices 1 below 2 now, and the kernel is
    exact."""
    monkeypatch.setenv("TORCHANI_NO_WARN_EXTENSIONS", "1")  # its CUDA extensions are not needed
    model = AniWithForces().double().eval()
    generator = torch.Generator().manual_seed(0)
    methane = torch.tensor([[0.0, 0.0, 0.0], [0.63, 0.63, 0.63], [-0.63, -0.63, 0.63], [-0.63, 0.63, -0.63],
                            [0.63, -0.63, -0.63]], dtype=torch.float64)
    x1, x2 = (methane + 0.05 * torch.randn(n, 5, 3, dtype=torch.float64, generator=generator) for n in (3, 2))
    energies = torchntk.empirical_ntk_fn(model, output_fn=lambda out: out[0])
    choice = energies.auto_choice(x1, x2)
    assert choice.vmap_axes is None  # torchani's neighbour search does not vmap
    one, two = NtkImplementation.JACOBIAN_CONTRACTION, NtkImplementation.NTK_VECTOR_PRODUCTS
    assert choice.estimates[one].flops < choice.estimates[two].flops
    assert choice.implementation == one
    reference = torchntk.empirical_ntk_fn(model, output_fn=lambda out: out[0], implementation=2)(x1, x2)
    assert_kernels_close(energies(x1, x2), reference)


class _Tied(nn.Module):
    """One weight used whole twice (once transposed) and sliced once (pairs through ``J``), and an
    RNN whose uses merge over time steps."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(6, 4)
        self.rnn = nn.RNN(4, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(torch.tanh(self.encode(x)))
        return h @ self.encode.weight + h[..., :2] @ self.encode.weight[:2]


def _contract_path_cost(equation: str, shapes: tuple) -> tuple[float, float]:
    """``_contract.pair_cost`` the plain way: ``opt_einsum.contract_path``'s report for the order
    the contraction takes (NOTE: [Contraction order]), after summing out the indices of one operand
    only."""
    inputs, output = equation.split("->")
    terms = inputs.split(",")
    counts = collections.Counter(equation.replace(",", "").replace("->", ""))
    reduced_terms, reduced_shapes, summed = [], [], 0.0
    for term, shape in zip(terms, shapes):
        keep = [i for i, letter in enumerate(term) if counts[letter] > 1]
        summed += math.prod(shape) if len(keep) < len(term) else 0
        reduced_terms.append("".join(term[i] for i in keep))
        reduced_shapes.append(tuple(shape[i] for i in keep))
    reduced = ",".join(reduced_terms) + "->" + output
    order = [list(step) for step in structured_contract._path(reduced, tuple(reduced_shapes))]
    _, info = opt_einsum.contract_path(reduced, *reduced_shapes, shapes=True, optimize=order)
    return summed + float(info.opt_cost), float(info.largest_intermediate)


@pytest.mark.parametrize("trace_axes", [(), (-1,)], ids=["full", "traced"])
@pytest.mark.parametrize("build, features", [(_wide, (16,)), (_Tied, (5, 6)), (_Mixed, (2, 7))])
def test_structured_pricing_on_shapes_prices_what_meta_tensors_and_contract_path_price(build, features, trace_axes):
    """``structured_cost`` prices uses of :class:`_cost._Shape` with ``_contract.pair_cost``; on
    meta tensors with ``opt_einsum.contract_path``'s report it gives the same numbers, and so does
    every equation it prices."""
    model = build().double().to(cases.DEVICE)
    generator = torch.Generator().manual_seed(5)
    x1, x2 = to_device(tuple(torch.randn(n, *features, dtype=torch.float64, generator=generator) for n in (4, 3)))
    call = _first_call(model, x1, x2, trace_axes)
    plan = structured_module.probe_plan(call, structured_module.StructuredOptions()).unchecked()
    priced = []
    original = structured_contract.pair_cost.__wrapped__

    def recording(equation, shapes):
        priced.append((equation, shapes))
        return original(equation, shapes)

    with mock.patch.object(structured_cost_module, "pair_cost", recording):
        fast = structured_cost_module.structured_cost(call, plan)

    def meta(shape, dtype):
        return torch.empty(shape, dtype=dtype, device="meta")

    with mock.patch.object(structured_cost_module, "_Shape", meta), \
            mock.patch.object(structured_cost_module, "pair_cost", _contract_path_cost):
        slow = structured_cost_module.structured_cost(call, plan)
    assert fast == slow and fast.contraction_flops > 0 and fast.contractions > 0
    assert len(priced) > 0
    for equation, shapes in priced:
        assert original(equation, shapes) == _contract_path_cost(equation, shapes)


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -3])
def test_stacking_shapes_gives_the_shape_stacking_tensors_gives(dim):
    tensors = [torch.empty(2, 3, device="meta", dtype=torch.float64) for _ in range(4)]
    shapes = [structured_cost_module._Shape((2, 3), torch.float64) for _ in range(4)]
    stacked = torch.stack(shapes, dim=dim)
    expected = torch.stack(tensors, dim=dim)
    assert (stacked.shape, stacked.dtype, stacked.ndim, stacked.numel()) == (
        expected.shape, expected.dtype, expected.ndim, expected.numel()
    )
    assert torch.stack(shapes, dim).shape == expected.shape
    with pytest.raises(TypeError):
        torch.cat(shapes)  # pricing needs stacking only: anything else fails loudly


def test_the_whole_batch_pass_is_priced_and_priced_again_where_the_checked_plan_refuses_it():
    """NOTE: [Whole-batch pullback]: 3's passes over the whole batch make fewer ATen calls than its
    per-example passes (``_WHOLE_BATCH_OPS`` against 4 per counted call); a plan whose check keeps
    the per-example pass is priced as such before it is picked."""
    model = _wide()
    x1, x2 = _inputs(16, 6, 4)
    with mock.patch.object(auto_module, "_PROBE_EVERYTHING", True):
        whole = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=0).auto_choice(x1, x2)

        def refused(call, plan, checked=None, **options):
            return dataclasses.replace(plan, whole_batch=None, whole_batch_reason="refused by the test")

        forget_shared_planners()  # a kernel function of its own, planned under this patch
        with mock.patch.object(structured_module, "with_whole_batch", refused):
            auto = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=0)
            per_example = auto.auto_choice(x1, x2)
            actual = auto(x1, x2)
    call = _first_call(model, x1, x2)
    prices = auto_module._Prices(call)
    saved = (4 - auto_module._WHOLE_BATCH_OPS) * prices.per_op * prices.per_example_ops[0]  # one joint pass
    assert per_example.estimates[STRUCTURED].flops - whole.estimates[STRUCTURED].flops == pytest.approx(saved)
    assert_kernels_close(actual, reference_ntk(model, x1, x2), rtol=1e-10)
