"""Structured derivatives (``implementation=3``) and AUTO never return a silently wrong kernel.

Each model below consumes a parameter in a way the op recorder once took for something else (a
clone written in place, a parameter written into an activation, a cast through an integer dtype,
a use hidden in TorchScript or under ``torch._C.DisableTorchFunction``, a custom
``torch.autograd.Function``, a weight used both as ``W`` and ``W.T``, a forward hook). Their float64
kernels must match the brute-force ``torchntk.testing.reference_ntk`` for implementations 3 and 0,
``x2`` given or None, ``vmap_axes`` 0 or None, traced or full. Implementation 3 gets them right
either through its rules or by sending the parameter to the Jacobian fallback; the plan's check
against autograd (NOTE: [Checking a plan against autograd]) catches what the recorder cannot see,
and ``auto_choice(...).fallback_parameters`` names the parameters sent there and why.

Float32 models whose rules hold (a conv net, a transformer block, the benchmark models) must not
lose a parameter to the fallback through that check's rounding tolerance.

Models and inputs live on the run device (``pytest --device``), inputs drawn on the CPU and moved.
"""

from __future__ import annotations

import functools
import math
import weakref
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import torchntk
from tests.cases import N1, N2, ModelCase, _build, _normal, make_x1_x2, to_device
from tests.structured_cases import STRUCTURED_CASES, _tokens
from torchntk import NtkImplementation
from torchntk._implementations import auto as auto_module
from torchntk.cli._models import BENCH_MODELS, inputs
from torchntk.testing import assert_kernels_close, reference_ntk

pytestmark = [
    pytest.mark.filterwarnings(
        # functorch has no batching rule for PyTorch's fused attention kernels (vmap falls back).
        "ignore:There is a performance drop because we have not yet implemented the batching rule:UserWarning"
    ),
]


# --------------------------------------------------------------------------------------------
# Models: one per way of consuming a parameter that a function mode can misread
# --------------------------------------------------------------------------------------------


class _CloneWrittenInPlace(nn.Module):
    """``w = W.clone(); w[0] = 0``: the first row of ``W`` never reaches the output."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        weight = self.linear.weight.clone()
        weight[0] = 0
        return self.head(torch.tanh(F.linear(x, weight, self.linear.bias)))


class _ParameterWrittenIntoActivation(nn.Module):
    """``h[:, :3] = p``: ``p`` replaces part of an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)
        self.p = nn.Parameter(torch.randn(3))
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.linear(x)).clone()
        h[:, :3] = self.p
        return self.head(h)


class _IntegerCast(nn.Module):
    """``W.to(torch.int64).to(x.dtype)``: a constant as far as derivatives go."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)
        with torch.no_grad():
            self.linear.weight.mul_(8)  # integer parts that are not all zero
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        rounded = self.linear.weight.to(torch.int64).to(x.dtype)
        return self.head(torch.tanh(0.1 * (self.linear(x) + F.linear(x, rounded))))


@torch.jit.script
def _scripted_scale(h: Tensor, scale: Tensor) -> Tensor:
    return h * scale


class _ScriptedHelper(nn.Module):
    """``scale`` is consumed inside TorchScript, which a function mode does not see."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 5))
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(_scripted_scale(torch.tanh(self.linear(x)), self.scale))


class _HiddenBias(nn.Module):
    """The bias of ``linear`` is also added under DisableTorchFunction; its weight is not."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear(x)
        with torch._C.DisableTorchFunction():
            h = h + self.linear.bias
        return self.head(torch.tanh(h))


class _HalfGradientScale(torch.autograd.Function):
    """``h * s`` whose backward (and jvp) halves the derivative for ``s``: autograd follows the
    Function's own derivative, not its forward's ops."""

    generate_vmap_rule = True

    @staticmethod
    def forward(h: Tensor, s: Tensor) -> Tensor:
        return h * s

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, s = ctx.saved_tensors
        return grad * s, (0.5 * grad * h).sum_to_size(s.shape)

    @staticmethod
    def jvp(ctx, h_tangent: Tensor, s_tangent: Tensor) -> Tensor:
        h, s = ctx.saved_tensors
        return h_tangent * s + 0.5 * h * s_tangent


class _ScaleWithoutJvp(torch.autograd.Function):
    """``h * s`` with a backward and no jvp: forward-mode AD (implementation 2) fails on it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(h: Tensor, s: Tensor) -> Tensor:
        return h * s

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, s = ctx.saved_tensors
        return grad * s, (grad * h).sum_to_size(s.shape)


class _CustomFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 5))
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(_HalfGradientScale.apply(torch.tanh(self.linear(x)), self.scale))


class _TiedAutoencoder(nn.Module):
    """``h = x @ W.T``, ``y = h @ W``: one weight in two coordinate systems."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(6, 4) / 2)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(x @ self.weight.T) @ self.weight


class _TiedHead(nn.Module):
    """GPT-2-like: the embedding weight embeds the tokens and is the output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(11, 6)
        self.linear = nn.Linear(6, 6)

    def forward(self, tokens: Tensor) -> Tensor:
        return F.linear(torch.tanh(self.linear(self.embedding(tokens))), self.embedding.weight)


class _ForwardHook(nn.Module):
    """A forward hook adds ``x @ W[:, :4].T`` to ``linear``'s output (its weight seen twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)
        self.linear.register_forward_hook(lambda module, inputs, output: output + inputs[0] @ module.weight[:, :4].T)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.linear(x)))


CASES = {
    "clone_written_in_place": (_CloneWrittenInPlace, _normal(4)),
    "parameter_written_into_activation": (_ParameterWrittenIntoActivation, _normal(4)),
    "integer_cast": (_IntegerCast, _normal(4)),
    "scripted_helper": (_ScriptedHelper, _normal(4)),
    "hidden_bias": (_HiddenBias, _normal(4)),
    "custom_function": (_CustomFunction, _normal(4)),
    "tied_autoencoder": (_TiedAutoencoder, _normal(4)),
    "tied_head": (_TiedHead, _tokens(11, 4)),
    "forward_hook": (_ForwardHook, _normal(4)),
}
"""``case id -> (module class, input maker)``; every model maps each example on its own."""

# What the plan must say about each model: {parameter name: a phrase of its reason}.
DEMOTED = {
    "clone_written_in_place": {"linear.weight": "__setitem__"},
    "parameter_written_into_activation": {"p": "__setitem__"},
    "integer_cast": {},
    "scripted_helper": {"scale": "cannot see"},
    "hidden_bias": {"linear.bias": "differs from autograd"},
    "custom_function": {"scale": "_HalfGradientScale"},
    "tied_autoencoder": {},
    "tied_head": {},
    "forward_hook": {},
}


@functools.lru_cache(maxsize=None)
def _model(case_id: str, device: torch.device) -> tuple[ModelCase, Tensor, Tensor]:
    """The case's module and inputs on ``device`` (the run device: ``_build`` and ``ModelCase`` put them there)."""
    module_fn, make_inputs = CASES[case_id]
    module = _build(module_fn, seed=0)
    with torch.no_grad():
        shape = module(to_device(make_inputs(1, torch.Generator().manual_seed(0)))).shape
    case = ModelCase(case_id, module, make_inputs, (-1,), True, ((-1, *shape[1:]),))
    return (case, *make_x1_x2(case))


def _four_features() -> tuple[Tensor, Tensor]:
    """``N1`` and ``N2`` examples of 4 features (generators seeded 0 and 1), on the run device."""
    draw = _normal(4)
    return to_device((draw(N1, torch.Generator().manual_seed(0)), draw(N2, torch.Generator().manual_seed(1))))


def _fallback(module: nn.Module, x1, x2=None, vmap_axes=0, trace_axes=(-1,)) -> dict[str, str]:
    """What implementation 3's plan (the one AUTO prices with) sends to the Jacobian fallback, and why.

    Asked of implementation 3: AUTO makes no plan on models this small (NOTE: [What choosing may cost]).
    """
    structured = torchntk.empirical_ntk_fn(module, trace_axes=trace_axes, vmap_axes=vmap_axes, implementation=3)
    return structured.auto_choice(x1, x2).fallback_parameters


@functools.lru_cache(maxsize=None)
def _reference(case_id: str, trace: str, same: bool, device: torch.device):
    case, x1, x2 = _model(case_id, device)
    return reference_ntk(case.module, x1, None if same else x2, trace_axes=_trace_axes(case, trace))


def _trace_axes(case: ModelCase, trace: str) -> tuple:
    return () if trace == "full" else case.trace_axes


@pytest.mark.parametrize("trace", ["full", "traced"])
@pytest.mark.parametrize("vmap_axes", [0, None], ids=["vmap0", "novmap"])
@pytest.mark.parametrize("same", [False, True], ids=["x2", "x2=None"])
@pytest.mark.parametrize("implementation", [3, 0], ids=["structured", "auto"])
@pytest.mark.parametrize("case_id", sorted(CASES))
def test_matches_the_reference(case_id, implementation, same, vmap_axes, trace, device):
    case, x1, x2 = _model(case_id, device)
    ntk_fn = torchntk.empirical_ntk_fn(
        case.module, trace_axes=_trace_axes(case, trace), vmap_axes=vmap_axes, implementation=implementation
    )
    assert_kernels_close(ntk_fn(x1, None if same else x2), _reference(case_id, trace, same, device))


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_plan_names_each_parameter_sent_to_the_fallback_and_why(case_id, device):
    case, x1, x2 = _model(case_id, device)
    with mock.patch.object(auto_module, "_PROBE_EVERYTHING", True):  # else no plan on a model this small
        choice = torchntk.empirical_ntk_fn(case.module, vmap_axes=0, implementation=0).auto_choice(x1, x2)
    for name, phrase in DEMOTED[case_id].items():
        assert phrase in choice.fallback_parameters.get(name, ""), (name, choice.fallback_parameters)
    # Nothing else is demoted: what the rules cover stays with the rules.
    assert set(choice.fallback_parameters) == set(DEMOTED[case_id])
    assert all(math.isfinite(estimate.flops) for estimate in choice.estimates.values())


def test_a_joint_weight_and_bias_are_checked_one_by_one(device):
    """Only the bias of ``_HiddenBias`` has a hidden use: its weight keeps its rule (before the
    check was per parameter, the pair was compared by its norm)."""
    case, x1, x2 = _model("hidden_bias", device)
    fallback = _fallback(case.module, x1, x2)
    assert "linear.bias" in fallback and "linear.weight" not in fallback


def test_an_input_written_in_place_after_its_use_gives_autograds_error():
    """``x`` of ``F.linear(x, W)`` is the rule's operand, read after the forward. Written in place
    later, autograd refuses (it saved ``x`` for ``W``'s gradient); the structured passes, which do
    not differentiate ``W``, would not notice and used the written ``x``. The recorder notes the
    version counters of the rules' inputs, sends ``W`` to the fallback, and autograd refuses there."""

    class _WrittenAfterUse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(4, 5)
            self.second = nn.Linear(5, 3)

        def forward(self, x: Tensor) -> Tensor:
            h = self.first(x)
            y = self.second(h)
            h.mul_(2.0)
            return y + h[..., :3]

    module = _build(_WrittenAfterUse, seed=0)
    x1, x2 = _four_features()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        reference_ntk(module, x1, x2)
    for implementation in (1, 3, 0):
        for vmap_axes in (0, None):
            ntk_fn = torchntk.empirical_ntk_fn(module, vmap_axes=vmap_axes, implementation=implementation)
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                ntk_fn(x1, x2)


def test_verify_true_still_raises_instead_of_falling_back(device):
    case, x1, x2 = _model("scripted_helper", device)
    ntk_fn = torchntk.empirical_ntk_fn(case.module, vmap_axes=0, implementation=3, verify=True)
    with pytest.raises(ValueError, match="'scale'.*cannot see"):
        ntk_fn(x1, x2)


def test_auto_never_uses_forward_mode_through_a_custom_function_without_jvp():
    class _Model(_CustomFunction):
        def forward(self, x: Tensor) -> Tensor:
            return self.head(_ScaleWithoutJvp.apply(torch.tanh(self.linear(x)), self.scale))

    module = _build(_Model, seed=0)
    x1, x2 = _four_features()
    for vmap_axes in (0, None):
        for trace_axes in ((), (-1,)):
            auto = torchntk.empirical_ntk_fn(module, trace_axes=trace_axes, vmap_axes=vmap_axes, implementation=0)
            estimate = auto.auto_choice(x1, x2).estimates[NtkImplementation.NTK_VECTOR_PRODUCTS]
            assert estimate.note.startswith("double VJP")  # priced without forward mode, never run with it
            assert_kernels_close(auto(x1, x2), reference_ntk(module, x1, x2, trace_axes=trace_axes))


# --------------------------------------------------------------------------------------------
# Float32: the check's tolerance demotes nothing whose rules hold
# --------------------------------------------------------------------------------------------


def _float32(case_id: str):
    case = STRUCTURED_CASES[case_id]()
    x1, x2 = make_x1_x2(case)
    cast = lambda x: x.float() if x.is_floating_point() else x  # noqa: E731
    return case.module.float(), cast(x1), cast(x2), case.trace_axes


@pytest.mark.parametrize("case_id", ["resnet_bn_eval", "transformer_block", "cnn_stride_dilation_groups", "mlp"])
@pytest.mark.parametrize("vmap_axes", [0, None], ids=["vmap0", "novmap"])
def test_float32_rules_are_not_demoted(case_id, vmap_axes):
    module, x1, x2, trace_axes = _float32(case_id)
    fallback = _fallback(module, x1, x2, vmap_axes, trace_axes)
    assert not [name for name, reason in fallback.items() if "autograd" in reason], fallback
    structured = torchntk.empirical_ntk_fn(module, trace_axes=trace_axes, vmap_axes=vmap_axes, implementation=3)
    assert_kernels_close(structured(x1, x2), reference_ntk(module, x1, x2, trace_axes=trace_axes))


def test_float32_check_still_catches_a_hidden_use(device):
    _, x1, x2 = _model("hidden_bias", device)
    module = _build(_HiddenBias, seed=0).float()
    ntk_fn = torchntk.empirical_ntk_fn(module, vmap_axes=0, implementation=3)
    assert set(_fallback(module, x1.float())) == {"linear.bias"}
    assert_kernels_close(ntk_fn(x1.float(), x2.float()), reference_ntk(module, x1, x2))


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_float32_benchmark_models_are_not_demoted(name, device):
    choice = BENCH_MODELS[name]
    assert _fallback(choice.build().to(device), inputs(choice.input_shape, 4, torch.float32, device)) == {}


# --------------------------------------------------------------------------------------------
# AUTO's cost model on weights used in two coordinate systems
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", ["tied_autoencoder", "tied_head", "forward_hook"])
@pytest.mark.parametrize("vmap_axes", [0, None], ids=["vmap0", "novmap"])
def test_auto_prices_a_weight_seen_in_two_coordinate_systems(case_id, vmap_axes, device):
    case, x1, x2 = _model(case_id, device)
    auto = torchntk.empirical_ntk_fn(case.module, trace_axes=(), vmap_axes=vmap_axes, implementation=0)
    with mock.patch.object(auto_module, "_PROBE_EVERYTHING", True):  # else 3 is not priced on a model this small
        estimates = auto.auto_choice(x1, x2).estimates
    structured = estimates[NtkImplementation.STRUCTURED_DERIVATIVES]
    assert math.isfinite(structured.flops) and structured.flops > 0


def test_the_plan_check_judges_entries_against_the_parameters_largest_terms_too():
    """Autograd's products round relative to their largest terms: a float32 error of 3e-7 of the
    largest bound passes on an entry a thousand times smaller; an error of 1e-4 of it (a use the
    recorder missed, or a wrong rule) does not, however small the entry."""
    from torchntk._implementations.structured._verify import _compare

    bound = torch.tensor([1.0, 1e-3, 1e-3])
    expected = torch.tensor([1.0, 1e-3, -1e-3])
    assert _compare(expected + torch.tensor([0.0, 3e-7, 0.0]), bound, expected) is None
    assert _compare(expected + torch.tensor([0.0, 1e-4, 0.0]), bound, expected) is not None
    assert _compare(expected * 1.01, bound, expected) is not None  # 1% off everywhere
    assert _compare(expected.double() + 1e-10, bound.double(), expected.double()) is not None  # float64 is tight


class _LiveBytes(TorchDispatchMode):
    """The largest number of bytes held at once by storages that ops under it create (views and
    ``out=`` results of storages made before it count nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.holders: dict[int, int] = {}  # storage address -> live tensors seeing it
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
        for tensor in pytree.tree_leaves(out):
            if not isinstance(tensor, Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
            if address not in self.holders:
                if address in inputs or not storage.nbytes():
                    continue  # a view or an out= result of a storage made before
                self.holders[address] = 0
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
            self.holders[address] += 1
            weakref.finalize(tensor, self._dropped, address, storage.nbytes())
        return out

    def _dropped(self, address: int, nbytes: int) -> None:
        self.holders[address] -= 1
        if not self.holders[address]:
            del self.holders[address]
            self.now -= nbytes


def test_the_plan_check_compares_one_parameter_at_a_time():
    """NOTE: [Streamed comparisons]: the check of 3's plan against autograd forms each parameter's
    structured ``J^T v`` and its difference from autograd's as it goes, instead of every
    parameter's at once: what it allocates stays within a few copies of the largest parameter,
    where forming them all held two copies of every parameter (8 here). The same first, warm and
    later call: the check runs on the first only, and the kernel is exact on all three."""
    from torchntk._implementations import structured

    torch.manual_seed(0)
    model = nn.Sequential(*[layer for _ in range(4) for layer in (nn.Linear(128, 128), nn.Tanh())])
    x = torch.randn(6, 128, dtype=torch.float64).float()
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    peaks = []

    def measured(*args, **kwargs):
        with _LiveBytes() as mode:
            found = disagreements(*args, **kwargs)
        peaks.append(mode.peak)
        return found

    disagreements = structured.disagreements
    fn = torchntk.empirical_ntk_fn(model, implementation=3)
    with mock.patch.object(structured, "disagreements", measured):
        kernels = [fn(x) for _ in range(3)]
    assert len(peaks) == 1, peaks  # the first call's check
    assert 0 < peaks[0] <= 3 * largest, (peaks, largest)
    reference = reference_ntk(model, x)
    for kernel in kernels:
        assert_kernels_close(kernel, reference)


# NOTE: [Kernels that are constants of the inputs]


def _tanh_mlp() -> nn.Module:
    return _build(lambda: nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)), seed=0)


def _two_inputs(n1: int, n2: int, seed: int) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(to_device(torch.randn(n, 4, generator=generator, dtype=torch.float64)) for n in (n1, n2))


def _finite_difference(ntk_fn, x1: Tensor, x2: Tensor, index: tuple, eps: float = 1e-6) -> float:
    """d sum(K(x1, x2)) / d x1[index] by central differences."""
    plus, minus = x1.clone(), x1.clone()
    plus[index] += eps
    minus[index] -= eps
    with torch.no_grad():
        return ((ntk_fn(plus, x2).sum() - ntk_fn(minus, x2).sum()) / (2 * eps)).item()


@pytest.mark.parametrize(
    "options", [{}, {"check_vmap_axes": True}, {"vmap_axes": None}], ids=["whole-batch", "per-example", "unmapped"]
)
def test_a_derivative_through_3s_kernel_with_respect_to_the_inputs_raises(options):
    """Implementation 3's kernel is a constant of x1 and x2: with inputs that require grad its
    values are unchanged and a backward pass through it raises, naming implementations 1 and 2,
    on the whole-batch, the per-example and the unmapped pass, on every call (it used to return
    part of the derivative, or none, without an error); 1 and 2 give the exact derivative."""
    model = _tanh_mlp()
    x1, x2 = _two_inputs(5, 3, seed=0)
    structured = torchntk.empirical_ntk_fn(model, implementation=3, **options)
    expected = reference_ntk(model, x1, x2)
    for _ in range(3):  # the first, a second and a later call
        x = x1.clone().requires_grad_()
        kernel = structured(x, x2)
        assert_kernels_close(kernel.detach(), expected)
        with pytest.raises(RuntimeError, match="constant of x1 and x2.*implementation=1 or implementation=2"):
            torch.autograd.grad(kernel.sum(), x)
        assert not structured(x1, x2).requires_grad  # inputs without grad: a plain kernel
        with torch.no_grad():
            assert not structured(x, x2).requires_grad
    for implementation in (1, 2):
        ntk_fn = torchntk.empirical_ntk_fn(model, implementation=implementation, **options)
        x = x1.clone().requires_grad_()
        (gradient,) = torch.autograd.grad(ntk_fn(x, x2).sum(), x)
        assert gradient[0, 1].item() == pytest.approx(_finite_difference(ntk_fn, x1, x2, (0, 1)), rel=1e-6)


def test_batch_of_3s_kernel_with_inputs_that_require_grad_raises_on_backward():
    """``batch``'s blocks of implementation 3 (prepared spans) are tied to the inputs alike."""
    model = _tanh_mlp()
    x1, x2 = _two_inputs(6, 4, seed=1)
    batched = torchntk.batch(torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3), batch_size=2)
    x = x1.clone().requires_grad_()
    kernel = batched(x, x2)
    assert_kernels_close(kernel.detach(), reference_ntk(model, x1, x2))
    with pytest.raises(RuntimeError, match="constant of x1 and x2"):
        torch.autograd.grad(kernel.sum(), x)
