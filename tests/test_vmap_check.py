"""NOTE: [Checking vmap_axes]: the check covers derivatives, and its errors name the real cause.

Every case is a model for which ``vmap_axes=0`` used to give a silently wrong kernel or an error
naming the wrong cause. Each test computes the kernel with every implementation and requires
either the float64 brute-force kernel (``reference_ntk``) or a ValueError whose message names
the cause; where the message promises that another setting gives the right kernel, the test
computes that kernel and compares it with the reference too.

Models and inputs live on the run device (``pytest --device``), inputs drawn on CPU generators and
moved, so every device sees the same numbers.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchntk
from tests.cases import to_device
from torchntk.testing import assert_kernels_close, reference_ntk

F64 = torch.float64
IMPLEMENTATIONS = pytest.mark.parametrize("implementation", [1, 2, 3], ids=["JC", "NVP", "SD"])
X2_GIVEN = pytest.mark.parametrize("x2_given", [True, False], ids=["x2", "x2-None"])
TRACE = pytest.mark.parametrize("trace_axes", [(-1,), ()], ids=["traced", "full"])


def _inputs(n1: int, n2: int, *shape: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n1`` and ``n2`` float64 examples from one seeded CPU generator, on the run device."""
    generator = torch.Generator().manual_seed(seed)
    x1 = torch.randn(n1, *shape, generator=generator, dtype=F64)
    return to_device((x1, torch.randn(n2, *shape, generator=generator, dtype=F64)))


def _seeded(build, device: torch.device) -> nn.Module:
    """``build()`` from seed 0 (the global stream left as it was), as a float64 module on ``device`` in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return build().double().to(device).eval()


def _kernel_or_error(kernel_fn, reference, *args, **kwargs) -> ValueError | None:
    """The kernel must equal ``reference``, or the call raise a ValueError (returned)."""
    try:
        kernel = kernel_fn(*args, **kwargs)
    except ValueError as error:
        return error
    assert_kernels_close(kernel, reference)
    return None


# -- a PyTorch vmap bug in a derivative: nn.PReLU --------------------------------------------------


def _prelu_model(device: torch.device) -> nn.Module:
    return _seeded(lambda: nn.Sequential(nn.Linear(4, 6), nn.PReLU(), nn.Linear(6, 3)), device)


@IMPLEMENTATIONS
@X2_GIVEN
@TRACE
@pytest.mark.parametrize("sizes", [(5, 3), (1, 3), (3, 2)], ids=["5-3", "1-3", "3-2"])
def test_prelu_kernel_is_right_through_an_example_loop(implementation, x2_given, trace_axes, sizes, device):
    """The forward pass of PReLU under vmap is right, its derivative is not (PyTorch 2.x): the
    per-example Jacobians mix examples up; with N2 = O = 3 that was a silently wrong kernel. The
    derivative check sees the bug (the same examples without vmap agree with the batch), and the
    kernel function evaluates the examples in a loop instead (NOTE: [Switching to example loops])."""
    model = _prelu_model(device)
    x1, x2 = _inputs(*sizes, 4)
    x2 = x2 if x2_given else None
    reference = reference_ntk(model, x1, x2, trace_axes=trace_axes)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=trace_axes, vmap_axes=0, implementation=implementation)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel = ntk_fn(x1, x2)
    assert_kernels_close(kernel, reference)
    loops = [str(w.message) for w in caught if issubclass(w.category, torchntk.ExampleLoopWarning)]
    if not (sizes[0] == 1 and not x2_given):  # a batch of one cannot mix examples up
        assert len(loops) == 1 and "bug of PyTorch's torch.func.vmap" in loops[0], loops


# -- per-example keyword arguments left unmapped ----------------------------------------------------


class _MaskRows(nn.Module):
    """Multiplies each example by its row of the mask (``mask[: len(x)]`` keeps the shapes)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, attention_mask):
        return torch.tanh(self.linear(x * attention_mask[: x.shape[0]]))


class _MaskedMeanPool(nn.Module):
    """A masked mean over tokens ``(N, T, 4) -> (N, 3)``; the mask ``(N, T)`` broadcasts."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x, attention_mask):
        hidden = torch.tanh(self.linear(x))
        weights = attention_mask.unsqueeze(-1)
        return (hidden * weights).sum(-2) / weights.sum(-2)


def _masked_reference(module: nn.Module, inputs1, inputs2, trace_axes):
    """``reference_ntk`` with the mask travelling with its examples (a per-side keyword)."""
    params = {name: p.detach() for name, p in module.named_parameters()}

    def f(p, inputs):
        x, mask = inputs
        return torch.func.functional_call(module, p, (x,), {"attention_mask": mask})

    return reference_ntk(f, inputs1, inputs2, params, trace_axes=trace_axes)


MASK_MODELS = {
    "rows": (_MaskRows, (4,), lambda n, g: (torch.rand(n, 4, generator=g) > 0.3).to(F64)),
    "mean-pool": (_MaskedMeanPool, (6, 4), lambda n, g: (torch.rand(n, 6, generator=g) > 0.3).to(F64) + 1e-3),
}


@IMPLEMENTATIONS
@X2_GIVEN
@TRACE
@pytest.mark.parametrize("model_id", MASK_MODELS)
def test_unmapped_attention_mask_is_named_with_the_vmap_axes_to_pass(
    implementation, x2_given, trace_axes, model_id, device
):
    build, shape, make_mask = MASK_MODELS[model_id]
    module = _seeded(build, device)
    x1, x2 = _inputs(5, 3, *shape)
    generator = torch.Generator().manual_seed(1)
    mask1, mask2 = to_device((make_mask(5, generator), make_mask(3, generator)))
    if not x2_given:
        x2, mask2 = None, mask1
    reference = _masked_reference(module, (x1, mask1), None if x2 is None else (x2, mask2), trace_axes)
    mask = mask1 if x2 is None else (mask1, mask2)

    ntk_fn = torchntk.empirical_ntk_fn(module, trace_axes=trace_axes, vmap_axes=0, implementation=implementation)
    error = _kernel_or_error(ntk_fn, reference, x1, x2, attention_mask=mask)
    assert error is not None
    message = str(error)
    assert "keyword argument 'attention_mask' (shape (5," in message
    assert "Pass vmap_axes=(0, 0, {'attention_mask': 0})" in message
    assert "check_vmap_axes=False" not in message and "couples" not in message

    suggested = torchntk.empirical_ntk_fn(
        module, trace_axes=trace_axes, vmap_axes=(0, 0, {"attention_mask": 0}), implementation=implementation
    )
    assert_kernels_close(suggested(x1, x2, attention_mask=mask), reference)


def test_suggestion_keeps_the_keyword_axes_already_given(device):
    module = _seeded(_MaskRows, device)
    x, _ = _inputs(5, 1, 4)
    f = lambda p, x, attention_mask, scale: torch.func.functional_call(module, p, (x * scale,), {"attention_mask": attention_mask})  # noqa: E731
    params = {name: p.detach() for name, p in module.named_parameters()}
    mask = torch.ones(5, 4, dtype=F64, device=device)
    scale = to_device(torch.rand(5, 1, dtype=F64))
    mask[2] = 0
    with pytest.raises(ValueError, match=r"Pass vmap_axes=\(0, 0, \{'scale': 0, 'attention_mask': 0\}\)"):
        torchntk.empirical_ntk_fn(f, vmap_axes=(0, 0, {"scale": 0}))(x, None, params, attention_mask=mask, scale=scale)


# -- NaN / Inf ----------------------------------------------------------------------------------------


def _tanh_mlp(device: torch.device) -> nn.Module:
    return _seeded(lambda: nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)), device)


@IMPLEMENTATIONS
@pytest.mark.parametrize("side", ["x1", "x2"])
def test_nan_in_an_input_is_named(implementation, side, device):
    x1, x2 = _inputs(5, 3, 4)
    (x1 if side == "x1" else x2)[1, 2] = float("nan")
    ntk_fn = torchntk.empirical_ntk_fn(_tanh_mlp(device), vmap_axes=0, implementation=implementation)
    with pytest.raises(ValueError, match=rf"output leaf 0 for {side} holds 3 NaN .* input {side} \(1 entry\)") as caught:
        ntk_fn(x1, x2)
    assert "couples" not in str(caught.value) and "check_vmap_axes=False" not in str(caught.value)


@IMPLEMENTATIONS
def test_nan_in_a_parameter_is_named(implementation, device):
    model = _tanh_mlp(device)
    with torch.no_grad():
        model[2].weight[1, 0] = float("inf")
    x1, x2 = _inputs(5, 3, 4)
    with pytest.raises(ValueError, match=r"NaN or infinite .* parameter '2.weight' \(1 entry\)"):
        torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)(x1, x2)


def test_nan_in_a_keyword_argument_is_named(device):
    f = lambda p, x, shift: torch.tanh(x @ p + shift)  # noqa: E731
    shift = torch.zeros(5, 3, dtype=F64, device=device)
    shift[4, 1] = float("nan")
    x1, _ = _inputs(5, 1, 4)
    with pytest.raises(ValueError, match=r"NaN/Inf in keyword argument 'shift' \(1 entry\)"):
        params = to_device(torch.randn(4, 3, dtype=F64))
        torchntk.empirical_ntk_fn(f, vmap_axes=(0, 0, {"shift": 0}))(x1, None, params, shift=shift)


def test_nan_made_by_the_model_says_so():
    f = lambda p, x: torch.log(x @ p)  # noqa: E731  negative arguments
    x1, _ = _inputs(5, 1, 4)
    with pytest.raises(ValueError, match="the model creates them"):
        torchntk.empirical_ntk_fn(f, vmap_axes=0)(x1, None, to_device(torch.randn(4, 3, dtype=F64)))


# -- genuine coupling ---------------------------------------------------------------------------------


class _CoupledDerivatives(nn.Module):
    """Outputs independent of the batch, derivatives not: ``h + (m - m.detach())`` with ``m`` the
    batch mean adds nothing forward but couples every example's derivatives."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        hidden = torch.tanh(self.linear(x))
        mean = hidden.mean(0, keepdim=True)
        return hidden + (mean - mean.detach())


@IMPLEMENTATIONS
@X2_GIVEN
def test_coupling_only_in_derivatives_is_caught(implementation, x2_given, device):
    model = _seeded(_CoupledDerivatives, device)
    x1, x2 = _inputs(5, 3, 4)
    x2 = x2 if x2_given else None
    reference = reference_ntk(model, x1, x2)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)
    error = _kernel_or_error(ntk_fn, reference, x1, x2)
    assert error is not None
    message = str(error)
    assert "couples examples through its derivatives" in message and "also without vmap" in message
    assert "check_vmap_axes=False" not in message
    assert_kernels_close(torchntk.empirical_ntk_fn(model, implementation=implementation)(x1, x2), reference)


# -- NOTE: [The derivative check within a plan's check] -------------------------------------------


class _ExpScale(nn.Module):
    """A parameter that reaches the outputs through ``exp``, which no structured rule states: it is
    left to the Jacobian fallback."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return torch.tanh(self.linear(x)) * self.scale.exp()


class _CountedDerivativeChecks:
    """Counts the runs of the derivative check on its own (``VmapAxesCheck.derivatives``)."""

    def __init__(self, monkeypatch):
        from torchntk._call.vmap_check import VmapAxesCheck

        self.runs = 0
        original = VmapAxesCheck.derivatives

        def counted(check, side):
            self.runs += 1
            return original(check, side)

        monkeypatch.setattr(VmapAxesCheck, "derivatives", counted)


@pytest.mark.parametrize(
    "implementation, build, runs",
    [(3, _tanh_mlp, 0), (0, _tanh_mlp, 0), (1, _tanh_mlp, 1), (2, _tanh_mlp, 1), (3, _ExpScale, 1)],
    ids=["SD", "AUTO-picks-SD", "JC", "NVP", "SD-with-fallback"],
)
@pytest.mark.parametrize("vmap_axes", [0, "auto"])
@pytest.mark.parametrize("compile", [False, "eager"], ids=["eager", "captured"])
def test_a_structured_plan_check_settles_the_derivative_check(
    implementation, build, runs, vmap_axes, compile, monkeypatch, device
):
    """Where 3's plan is checked on the first call and leaves nothing to the Jacobian fallback, its
    comparison with the sampled examples' whole-batch derivatives is the derivative check: the
    check's own pass (per-example derivatives under nested vmap) does not run; with 1 and 2, or a
    fallback parameter, it runs. The kernel is right on the first, second and a later call (with
    ``compile``, the replays)."""
    if implementation == 0:
        monkeypatch.setattr("torchntk._implementations.auto._PROBE_EVERYTHING", True)  # 3 priced on a small model
    model = build(device) if build is _tanh_mlp else _seeded(build, device)
    x1, x2 = _inputs(5, 4, 4)
    reference = reference_ntk(model, x1, x2)
    counted = _CountedDerivativeChecks(monkeypatch)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=vmap_axes, implementation=implementation, compile=compile)
    for _ in range(3):
        assert_kernels_close(ntk_fn(x1, x2), reference)
    if implementation == 0:
        choice = ntk_fn.auto_choice(x1, x2)
        assert choice.implementation == 3, choice
    if build is _ExpScale:
        assert "scale" in ntk_fn.auto_choice(x1, x2).fallback_parameters
    assert counted.runs == runs


def test_auto_choosing_another_implementation_after_checking_3_runs_the_derivative_check(monkeypatch, device):
    """3's check vouches for 3's per-example derivatives only: where AUTO checks 3's plan and then
    picks another implementation (here forced to 1), the derivative check runs as before."""
    import dataclasses

    from torchntk._implementations import auto as auto_module

    monkeypatch.setattr(auto_module, "_PROBE_EVERYTHING", True)
    checked_3 = []
    choose = auto_module.choose

    def picks_1(call, plans, *args, **kwargs):
        choice = choose(call, plans, *args, **kwargs)
        checked_3.append(plans.checked() is not None)
        return dataclasses.replace(choice, implementation=torchntk.NtkImplementation.JACOBIAN_CONTRACTION)

    monkeypatch.setattr(auto_module, "choose", picks_1)
    model = _tanh_mlp(device)
    x1, x2 = _inputs(5, 4, 4)
    counted = _CountedDerivativeChecks(monkeypatch)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
    assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))
    assert checked_3 and all(checked_3) and counted.runs == 1


def test_running_out_of_memory_in_a_first_calls_plan_is_a_kernel_memory_error(monkeypatch):
    """3's plan, made while the first call is prepared (it settles the derivative check), fails as
    the kernel would: an allocation failure becomes a KernelMemoryError with its budget, not a raw
    PyTorch error."""
    from torchntk._implementations import structured as structured_module

    def fails(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(structured_module, "per_example_factors", fails)
    x1, _ = _inputs(5, 1, 4)
    ntk_fn = torchntk.empirical_ntk_fn(_tanh_mlp(torch.device("cpu")), vmap_axes=0, implementation=3)
    with pytest.raises(torchntk.KernelMemoryError, match="ran out of memory") as caught:
        ntk_fn(x1)
    assert caught.value.budget_bytes is not None and caught.value.budget_bytes > 0


@pytest.mark.parametrize("implementation", [0, 3], ids=["AUTO", "SD"])
@pytest.mark.parametrize("compile", [False, "eager"], ids=["eager", "captured"])
def test_coupling_only_in_derivatives_is_caught_by_a_structured_plans_check(
    implementation, compile, monkeypatch, device
):
    """The coupling only the derivative check sees, where 3's plan check stands in for it: the
    disagreement concludes nothing, the derivative check runs and says what is wrong; under
    ``vmap_axes="auto"`` the kernel is then computed on whole batches, right (with ``compile``, on
    the replays too)."""
    monkeypatch.setattr("torchntk._implementations.auto._PROBE_EVERYTHING", True)
    model = _seeded(_CoupledDerivatives, device)
    x1, x2 = _inputs(5, 3, 4)
    reference = reference_ntk(model, x1, x2)
    with pytest.raises(ValueError, match="couples examples through its derivatives"):
        torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation, compile=compile)(x1, x2)
    found = torchntk.empirical_ntk_fn(model, implementation=implementation, compile=compile)
    for _ in range(3):
        assert_kernels_close(found(x1, x2), reference)
    assert found.auto_choice(x1, x2).vmap_axes is None


class _CentreOverBatch(nn.Module):
    def __init__(self, weight: float):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.weight = weight

    def forward(self, x):
        hidden = self.linear(x)
        return hidden - self.weight * hidden.mean(0, keepdim=True)


@pytest.mark.parametrize("implementation", [1, 2, 3], ids=["JC", "NVP", "SD"])
def test_coupled_outputs_do_not_offer_to_skip_the_check(implementation, device):
    x1, x2 = _inputs(5, 3, 4)
    model = _seeded(lambda: _CentreOverBatch(1.0), device)
    with pytest.raises(ValueError, match="differs between the whole batch and a per-example evaluation") as caught:
        torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)(x1, x2)
    assert "check_vmap_axes=False" not in str(caught.value)


_FORWARDS: list = []


class _CoupledWhenLarge(nn.Module):
    """Couples its examples only when some input entry exceeds 10: a later call with other values
    can break the promise that an earlier call with the same shapes kept."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x):
        _FORWARDS.append(x.shape)  # torchntk evaluates a private copy of the module: count outside it
        hidden = self.linear(x)
        large = (x.abs().amax() > 10).to(hidden.dtype)
        return hidden - large * hidden.mean(0, keepdim=True)


@pytest.mark.parametrize("implementation", [1, 2, 3, 0], ids=["JC", "NVP", "SD", "AUTO"])
@X2_GIVEN
@TRACE
def test_later_calls_check_their_outputs_in_the_kernels_own_pass(implementation, x2_given, trace_axes, device):
    """With ``check_vmap_axes=True``, after the first call per shapes the output check is left to
    the implementation (NOTE: [Checking vmap_axes]): it still runs on every call, and catches
    coupling that only these values show."""
    model = _seeded(_CoupledWhenLarge, device)
    ntk_fn = torchntk.empirical_ntk_fn(
        model, trace_axes=trace_axes, vmap_axes=0, implementation=implementation, check_vmap_axes=True
    )
    x1, x2 = _inputs(5, 3, 4)
    x2 = x2 if x2_given else None
    for _ in range(2):
        assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2, trace_axes=trace_axes))
    large = x1.clone()
    large[2, 1] = 50.0
    with pytest.raises(ValueError, match="differs between the whole batch and a per-example evaluation"):
        ntk_fn(large, x2)


@pytest.mark.parametrize(("implementation", "forwards"), [(1, 2), (3, 2), (0, 2), (2, 3)])
def test_later_calls_pay_no_forward_pass_for_the_output_check(implementation, forwards, device):
    """Jacobian contraction and structured derivatives compare the outputs of their own
    per-example pass: a later call evaluates the model on the whole batch and in that pass only
    (AUTO picks 1 or 3 here); NTK-vector products compare the outputs of the reverse pass that
    forms x2's vectors (x2 is x1 here), and make one forward-mode pass for their 15 columns.
    The count is of ``forward`` calls, each batch traced once under vmap, with
    ``check_vmap_axes=True`` (the default checks once per key: no whole-batch pass at all)."""
    model = _seeded(_CoupledWhenLarge, device)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation, check_vmap_axes=True)
    x1, _ = _inputs(5, 3, 4)
    ntk_fn(x1)
    _FORWARDS.clear()
    ntk_fn(x1)
    assert len(_FORWARDS) == forwards


_SIZES_AND_COUPLED_SIDES = [
    *((sizes, "x1", x2_given) for x2_given in (False, True) for sizes in ((5, 3), (2, 2), (3, 1))),
    *((sizes, "x2", True) for sizes in ((5, 3), (2, 2), (1, 2))),  # one example of x2 cannot show coupling
]


@pytest.mark.parametrize(
    ("sizes", "coupled", "x2_given"), _SIZES_AND_COUPLED_SIDES,
    ids=[f"{n1}-{n2}-{side}{'' if given else '-x2None'}" for (n1, n2), side, given in _SIZES_AND_COUPLED_SIDES],
)
def test_ntk_vector_products_check_outputs_in_their_own_passes(sizes, coupled, x2_given, device):
    """NOTE: [The output check of NTK-vector products]: a later call of implementation 2 compares
    the per-example outputs of the reverse pass that forms x2's vectors (a run of at most two
    examples too, differentiated as one batch: sizes 2-2 and 3-1), and with x2 given makes one
    check pass over x1, whose columns come from forward mode over the whole batch. Coupling that
    only a later call's values show is still caught on either side, and a later call evaluates
    the model once less than with a check pass per side: one whole-batch pass per side, the
    reverse pass, one forward-mode pass (at most 15 columns) and, with x2 given, x1's check pass."""
    model = _seeded(_CoupledWhenLarge, device)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=2, check_vmap_axes=True)
    x1, x2 = _inputs(*sizes, 4)
    x2 = x2 if x2_given else None
    expected = reference_ntk(model, x1, x2)
    assert_kernels_close(ntk_fn(x1, x2), expected)
    _FORWARDS.clear()
    assert_kernels_close(ntk_fn(x1, x2), expected)
    assert len(_FORWARDS) == (5 if x2_given else 3)
    large = (x1 if coupled == "x1" else x2).clone()
    large[-1, 1] = 50.0
    with pytest.raises(ValueError, match="differs between the whole batch and a per-example evaluation"):
        ntk_fn(*((large, x2) if coupled == "x1" else (x1, large)))


def test_differences_near_the_rounding_tolerance_offer_to_skip_the_check(device):
    """float32 outputs are compared to 1e-4 relative; a 3e-4 coupling may be rounding."""
    model = _seeded(lambda: _CentreOverBatch(3e-4), device).float()
    x1, x2 = (x.float() for x in _inputs(5, 3, 4))
    with pytest.raises(ValueError, match="if it is the expected rounding of this model, pass check_vmap_axes=False"):
        torchntk.empirical_ntk_fn(model, vmap_axes=0)(x1, x2)


# -- the check passes on models that keep the promise --------------------------------------------------


@IMPLEMENTATIONS
@X2_GIVEN
def test_independent_float32_models_pass_both_checks(implementation, x2_given, device):
    """No false alarm from rounding: float32, a conv net and an MLP, against the float64 reference."""
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 25, 3))
    conv = conv.to(device).eval()
    x1, x2 = to_device((torch.randn(6, 2, 5, 5), torch.randn(4, 2, 5, 5)))
    x2 = x2 if x2_given else None
    kernel = torchntk.empirical_ntk_fn(conv, vmap_axes=0, implementation=implementation)(x1, x2)
    assert_kernels_close(kernel, reference_ntk(conv, x1, x2))


def test_the_check_leaves_the_global_random_stream_alone(device):
    """Neither the CPU's stream nor the run device's (the same stream on the CPU)."""
    # built first: its seeding forks the CPU stream only, and torch.manual_seed reseeds every device
    ntk_fn = torchntk.empirical_ntk_fn(_tanh_mlp(device), vmap_axes=0)
    x1, _ = _inputs(5, 1, 4)
    torch.manual_seed(3)
    expected = torch.rand(3), torch.rand(3, device=device)
    torch.manual_seed(3)
    ntk_fn(x1)
    assert torch.equal(torch.rand(3), expected[0])
    assert torch.equal(torch.rand(3, device=device), expected[1])


def test_batched_kernels_run_the_derivative_check_too(device):
    """``batch`` prepares the whole call once (by runs): the probe check runs there as well, and
    the blocks are computed by example loops."""
    model = _prelu_model(device)
    x1, x2 = _inputs(6, 4, 4)
    with pytest.warns(torchntk.ExampleLoopWarning, match="bug of PyTorch's torch.func.vmap"):
        kernel = torchntk.batch(torchntk.empirical_ntk_fn(model, vmap_axes=0), 2)(x1, x2)
    assert_kernels_close(kernel, reference_ntk(model, x1, x2))


def test_running_out_of_memory_is_not_blamed_on_vmap():
    from torchntk._call.per_example import vmap_errors

    error = RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to allocate 77309411328 bytes.")
    with pytest.raises(RuntimeError, match="can't allocate memory") as raised:
        with vmap_errors("ntk_fn"):
            raise error
    assert raised.value is error
