"""Implementation 2 on models without forward-mode derivatives, and AUTO's feasibility filter.

NOTE: [NTK-vector products without forward mode] in ``ntk_vector_products.py``: a column ``J1 t``
comes from two VJPs when PyTorch has no forward-mode derivative for an operation of the model.
Every kernel here is checked against the float64 oracle :func:`torchntk.testing.reference_ntk`.
On the code before that path, implementation 2 raised on every model of ``_NO_FORWARD_MODE`` and
AUTO (with ``vmap_axes=None``) picked it and raised too. Models and inputs live on the run device
(``pytest --device``): built and drawn on the CPU, then moved, so that every device sees the same numbers.

Cost, measured on the benchmark MLP (784-512-512-10, ReLU, float32, N1 = N2 = 64, traced,
vmap_axes=0, shared 2-core CPU, best of 5, three runs): forward mode 0.66-0.72 s, double VJP
forced 0.63-0.67 s (x2 given and None alike): the backward of a ReLU network's backward pass
costs what its forward-mode pass does, and x1's reverse pass is recorded once per kernel call.
"""

from __future__ import annotations

import warnings
from typing import Callable
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils import _pytree as pytree

import torchntk
from tests.test_structured_safety import _CustomFunction as _LinearScaleHead
from tests.test_structured_safety import _ScaleWithoutJvp
from torchntk import NtkImplementation
from torchntk._implementations import auto as auto_module
from torchntk._implementations import ntk_vector_products as nvp
from torchntk._implementations.structured import StructuredDerivatives
from torchntk.testing import assert_kernels_close, reference_ntk

VECTOR_PRODUCTS = NtkImplementation.NTK_VECTOR_PRODUCTS


class _CustomFunction(_LinearScaleHead):
    """The scale goes through a custom Function with a backward and no jvp."""

    def forward(self, x: Tensor) -> Tensor:
        return self.head(_ScaleWithoutJvp.apply(torch.tanh(self.linear(x)), self.scale))


class _Attention(nn.Module):
    """Self-attention; in eval mode ``nn.MultiheadAttention`` takes its fused fast path."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        y, _ = self.attention(x, x, x, need_weights=False)
        return self.head(y.mean(1))


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        y, _ = self.lstm(x)
        return self.head(y[:, -1])


class _TwoLeaves(nn.Module):
    """A pytree output with a per-position leaf, so that layouts differ between leaves."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> dict:
        h = torch.tanh(self.linear(x))
        return {"logits": self.head(h), "hidden": h.view(-1, 3, 2)}


class _CtcLoss(nn.Module):
    """``ctc_loss``: no forward-mode derivative, and its backward pass has no derivative either."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 15)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[0]
        log_probs = self.linear(x).view(n, 5, 3).log_softmax(-1).transpose(0, 1)
        targets = torch.ones(n, 2, dtype=torch.long, device=x.device)
        return F.ctc_loss(log_probs, targets, [5] * n, [2] * n, reduction="none")[:, None]


class _DirectWeightNorm(nn.Module):
    """``torch._weight_norm`` called in ``forward``: no module that ``fused_layers`` recognises
    holds it, so its fused kernel (``_weight_norm_interface``) stays in the forward-mode passes."""

    def __init__(self) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.randn(6, 4))
        self.g = nn.Parameter(torch.rand(6, 1) + 0.5)
        self.bias = nn.Parameter(torch.zeros(6))
        self.head = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(F.linear(x, torch._weight_norm(self.v, self.g, 0), self.bias)))


class _GridSample(nn.Module):
    """``F.grid_sample`` (``grid_sampler_2d``): no forward-mode derivative, a differentiable backward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 18)
        self.head = nn.Linear(8, 2)
        self.register_buffer("grid", torch.tensor([[[[-0.7, -0.2], [0.3, -0.6]], [[0.5, 0.4], [-0.1, 0.8]]]]))

    def forward(self, x: Tensor) -> Tensor:
        image = torch.tanh(self.linear(x)).reshape(-1, 2, 3, 3)
        grid = self.grid.to(image.dtype).expand(image.shape[0], -1, -1, -1)
        sampled = F.grid_sample(image, grid, align_corners=False)
        return self.head(sampled.reshape(*x.shape[:-1], 8))


Build = Callable[[torch.device], nn.Module]
"""``build(device)``: a float64 model, its parameters drawn from a fixed seed on the CPU, on ``device``."""


def _weight_normed(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    # The old-style weight_norm is what users still bring. It is applied on the device: its `weight`
    # is a plain attribute, which `.to()` would leave behind.
    with pytest.warns(FutureWarning, match="`torch.nn.utils.weight_norm` is deprecated"):
        normed = nn.utils.weight_norm(nn.Linear(4, 6).double().to(device))
    return nn.Sequential(normed, nn.Tanh(), nn.Linear(6, 2)).double().to(device)


def _built(cls: type) -> Build:
    def build(device: torch.device) -> nn.Module:
        torch.manual_seed(0)
        return cls().double().eval().to(device)
    return build


_NO_FORWARD_MODE = {
    # name: (build, example shape, what PyTorch reports without a forward-mode derivative)
    "weight_norm": (_built(_DirectWeightNorm), (4,), "_weight_norm_interface"),
    "custom_function": (_built(_CustomFunction), (4,), "custom torch.autograd.Function without jvp"),
    "grid_sample": (_built(_GridSample), (4,), "grid_sampler_2d"),
}

_UNFUSED = {
    # name: (build, example shape): modules whose fused kernels lack forward-mode derivatives, which
    # the forward-mode passes replace (NOTE: [Unfused kernels] in torchntk/_model/unfused.py)
    "weight_norm": (_weight_normed, (4,)),
    "attention_eval": (_built(_Attention), (3, 4)),
    "lstm": (_built(_Recurrent), (3, 3)),
}


def _inputs(shape: tuple[int, ...], device: torch.device, dtype=torch.float64) -> tuple[Tensor, Tensor]:
    """5 and 3 examples of ``shape`` on ``device``, drawn on the CPU."""
    generator = torch.Generator().manual_seed(1)
    x1, x2 = (torch.randn(n, *shape, generator=generator, dtype=dtype) for n in (5, 3))
    return x1.to(device), x2.to(device)


def _reference(build: Build, x1, x2, **axes):
    """The oracle on a twin on the CPU (an old-style weight-normed module cannot be deep-copied;
    PyTorch's CUDA weight-norm kernel takes float64 square roots in float32), on ``x1``'s device."""
    twin = build(torch.device("cpu"))
    params = {name: p.detach() for name, p in twin.named_parameters()}
    cpu = (x1.cpu(), None if x2 is None else x2.cpu())
    kernel = reference_ntk(lambda p, x: torch.func.functional_call(twin, p, (x,)), *cpu, params=params, **axes)
    return pytree.tree_map(lambda leaf: leaf.to(x1.device), kernel)


def _twice_differentiable(build: Build, shape: tuple[int, ...], device: torch.device) -> bool:
    """Whether this PyTorch differentiates the model's backward pass (``grid_sampler_2d_backward``
    got a derivative in PyTorch 2.12; before, implementation 2 cannot run on it and says why)."""
    model = build(device)
    params = [p for p in model.parameters() if p.requires_grad]
    x = _inputs(shape, device)[0]
    gradients = torch.autograd.grad(model(x).sum(), params, create_graph=True)
    try:
        torch.autograd.grad(sum(g.sum() for g in gradients), params, allow_unused=True)
    except RuntimeError as error:
        if "not implemented" in str(error):
            return False
        raise
    return True


def _forced_double_vjp():
    """Implementation 2 with its double-VJP path forced on every model."""
    original = nvp.ntk_vector_products_blocks
    return mock.patch.object(nvp, "ntk_vector_products_blocks", lambda call: original(call, forward_mode=False))


def _counting_paths():
    """Counts implementation 2's forward-mode and double-VJP passes (x1 recordings)."""
    counts = {"forward mode": 0, "double VJP": 0}
    forward, transposed = nvp._forward_mode_columns, nvp._transposed_maps

    def count(key, function):
        def counted(*args):
            counts[key] += 1
            return function(*args)
        return counted

    patches = (
        mock.patch.object(nvp, "_forward_mode_columns", count("forward mode", forward)),
        mock.patch.object(nvp, "_transposed_maps", count("double VJP", transposed)),
    )
    return counts, patches


# --------------------------------------------------------------------------------------------
# Implementation 2 switches to double VJPs by itself
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trace_axes", [(-1,), ()], ids=["traced", "full"])
@pytest.mark.parametrize("vmap_axes", [0, None], ids=["vmap0", "novmap"])
@pytest.mark.parametrize("same", [False, True], ids=["x1x2", "x2None"])
@pytest.mark.parametrize("name", list(_NO_FORWARD_MODE))
def test_vector_products_without_forward_mode_match_the_reference(name, same, vmap_axes, trace_axes, device):
    build, shape, missing = _NO_FORWARD_MODE[name]
    x1, x2 = _inputs(shape, device)
    x2 = None if same else x2
    ntk_fn = torchntk.empirical_ntk_fn(build(device), trace_axes, vmap_axes=vmap_axes, implementation=2)
    if not _twice_differentiable(build, shape, device):  # an older PyTorch: a clear error instead
        with pytest.raises(ValueError, match=f"no forward-mode derivative for {missing}.*has no derivative"):
            ntk_fn(x1, x2)
        return
    counts, patches = _counting_paths()
    with patches[0], patches[1]:
        actual = ntk_fn(x1, x2)
    assert_kernels_close(actual, _reference(build, x1, x2, trace_axes=trace_axes), rtol=1e-10)
    assert counts["forward mode"] == 1, "forward mode is tried once per kernel call, then abandoned"
    assert counts["double VJP"] == 1, "x1's reverse pass is recorded once per kernel call"


@pytest.mark.parametrize(
    "name, vmap_axes",
    # nn.LSTM per example (vmap_axes): test_recurrent_model_in_float32_stays_in_forward_mode_and_accurate
    [(name, vmap_axes) for name in _UNFUSED for vmap_axes in (0, None) if not (name == "lstm" and vmap_axes == 0)],
)
def test_fused_kernels_are_replaced_in_forward_mode(name, vmap_axes, device):
    """Old-style weight norm, eval-mode attention and nn.LSTM used to take the double-VJP path."""
    build, shape = _UNFUSED[name]
    x1, x2 = _inputs(shape, device)
    counts, patches = _counting_paths()
    with patches[0], patches[1]:
        actual = torchntk.empirical_ntk_fn(build(device), trace_axes=(), vmap_axes=vmap_axes, implementation=2)(x1, x2)
    assert_kernels_close(actual, _reference(build, x1, x2, trace_axes=()), rtol=1e-10)
    assert counts["double VJP"] == 0 and counts["forward mode"] >= 1


def test_forward_mode_stays_where_it_works(device):
    model = _built(_TwoLeaves)(device)
    x1, x2 = _inputs((4,), device)
    counts, patches = _counting_paths()
    with patches[0], patches[1]:
        actual = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=2)(x1, x2)
    assert_kernels_close(actual, reference_ntk(model, x1, x2, trace_axes=()), rtol=1e-10)
    assert counts["double VJP"] == 0 and counts["forward mode"] >= 2


@pytest.mark.parametrize("vmap_axes", [0, None], ids=["vmap0", "novmap"])
def test_recurrent_model_in_float32_stays_in_forward_mode_and_accurate(vmap_axes, device):
    """Float32 ``nn.LSTM`` runs a fused kernel (on the CPU ``mkldnn_rnn_layer``, which has no
    forward-mode derivative), which the forward-mode passes replace by its decomposition on every
    device (NOTE: [Unfused kernels]); checked at float32 tolerance against the float64 oracle. Per
    example, vmap runs the decomposition too (``aten::lstm`` has no batching rule), so no example
    loop is needed."""
    torch.manual_seed(0)
    model = _Recurrent().eval().to(device)
    x1, x2 = _inputs((3, 3), device, dtype=torch.float32)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=vmap_axes, implementation=2)
    counts, patches = _counting_paths()
    with patches[0], patches[1], warnings.catch_warnings():
        warnings.simplefilter("error", torchntk.ExampleLoopWarning)
        actual = ntk_fn(x1, x2)
    assert counts["double VJP"] == 0
    assert_kernels_close(actual, reference_ntk(model, x1, x2))


# --------------------------------------------------------------------------------------------
# The double-VJP path itself, forced on models forward mode could differentiate
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "axes",
    [{"trace_axes": (-1,)}, {"trace_axes": ()}, {"trace_axes": (), "diagonal_axes": (0,)}],
    ids=["traced", "full", "diagonal"],
)
@pytest.mark.parametrize("chunk_size", [None, 2], ids=["whole", "chunk2"])
@pytest.mark.parametrize("vmap_axes", [0, None], ids=["vmap0", "novmap"])
@pytest.mark.parametrize("same", [False, True], ids=["x1x2", "x2None"])
def test_forced_double_vjp_matches_the_reference(same, vmap_axes, chunk_size, axes, device):
    """Pytree outputs, x1 cut into runs (diagonal batch axis with chunk_size) and x2 runs."""
    model = _built(_TwoLeaves)(device)
    x1, x2 = _inputs((4,), device)
    if "diagonal_axes" in axes:  # a diagonal batch axis pairs example i of x1 with example i of x2
        x2 = x1.flip(0)
    x2 = None if same else x2
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=vmap_axes, implementation=2, chunk_size=chunk_size, **axes)
    counts, patches = _counting_paths()
    with _forced_double_vjp(), patches[0], patches[1]:
        actual = ntk_fn(x1, x2)
    assert counts["forward mode"] == 0 and counts["double VJP"] >= 1
    assert_kernels_close(actual, reference_ntk(model, x1, x2, **axes), rtol=1e-10)


@pytest.mark.parametrize("vmap_axes", [0, None], ids=["vmap0", "novmap"])
def test_forced_double_vjp_on_recurrent_and_attention_models_in_float64(vmap_axes, device):
    """The double backward of ``nn.LSTM`` and of attention (MATH kernel) at float64 precision."""
    for build, shape in ((_built(_Recurrent), (3, 3)), (_built(_Attention), (3, 4))):
        if vmap_axes == 0 and build(device).__class__ is _Recurrent:
            continue  # refused by the vmap_axes check, see the float32 test above
        x1, x2 = _inputs(shape, device)
        with _forced_double_vjp():
            actual = torchntk.empirical_ntk_fn(build(device), vmap_axes=vmap_axes, implementation=2)(x1, x2)
        assert_kernels_close(actual, _reference(build, x1, x2), rtol=1e-10)


def test_neither_forward_mode_nor_double_backward_is_a_clear_value_error(device):
    model = _built(_CtcLoss)(device)
    x1, _ = _inputs((4,), device)
    with pytest.raises(ValueError, match=r"implementation 2 .*_ctc_loss.*_ctc_loss_backward.*implementation=1"):
        torchntk.empirical_ntk_fn(model, implementation=2)(x1)


def test_forced_forward_mode_keeps_the_explained_error(device):
    x1, _ = _inputs((4,), device)
    original = nvp.ntk_vector_products_blocks
    forced = mock.patch.object(nvp, "ntk_vector_products_blocks", lambda call: original(call, forward_mode=True))
    with forced, pytest.raises(ValueError, match="needs forward-mode derivatives.*_weight_norm_interface"):
        torchntk.empirical_ntk_fn(_built(_DirectWeightNorm)(device), implementation=2)(x1)


def test_missing_forward_mode_reads_only_pytorchs_forward_ad_errors():
    assert nvp.missing_forward_mode(RuntimeError("Trying to use forward AD with aten::foo that does not support it")) == "aten::foo"
    assert "custom" in nvp.missing_forward_mode(NotImplementedError(
        "You must implement the jvp function for custom autograd.Function to use it with forward mode AD."
    ))
    assert nvp.missing_forward_mode(RuntimeError("shape mismatch")) is None
    assert nvp.missing_forward_mode(ValueError("Trying to use forward AD with aten::foo that does not support it")) is None


# --------------------------------------------------------------------------------------------
# AUTO: feasibility filter and a cost model that never raises
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vmap_axes", [0, None], ids=["vmap0", "novmap"])
@pytest.mark.parametrize("name", list(_NO_FORWARD_MODE))
def test_auto_on_models_without_forward_mode(name, vmap_axes, device, monkeypatch):
    # every candidate probed: implementation 3 may be cheaper here, which leaves 2 unprobed
    monkeypatch.setattr(auto_module, "_PROBE_EVERYTHING", True)
    build, shape, missing = _NO_FORWARD_MODE[name]
    x1, x2 = _inputs(shape, device)
    for trace_axes in ((-1,), ()):
        auto = torchntk.empirical_ntk_fn(build(device), trace_axes, vmap_axes=vmap_axes, implementation=0)
        choice = auto.auto_choice(x1, x2)
        if _twice_differentiable(build, shape, device):
            assert choice.excluded == {}
            note = choice.estimates[VECTOR_PRODUCTS].note
            assert note.startswith("double VJP") and missing in note
        else:  # an older PyTorch: implementation 2 cannot run, and AUTO says why
            assert set(choice.excluded) == {VECTOR_PRODUCTS} and "has no derivative" in choice.excluded[VECTOR_PRODUCTS]
        assert_kernels_close(auto(x1, x2), _reference(build, x1, x2, trace_axes=trace_axes), rtol=1e-10)


def test_auto_on_float32_lstm(device):
    torch.manual_seed(0)
    model = _Recurrent().eval().to(device)
    x1, x2 = _inputs((3, 3), device, dtype=torch.float32)
    auto = torchntk.empirical_ntk_fn(model, vmap_axes=None, implementation=0)
    with mock.patch.object(auto_module, "_PROBE_EVERYTHING", True):  # 2 priced also where it would lose
        choice = auto.auto_choice(x1, x2)
    assert choice.estimates[VECTOR_PRODUCTS].note == ""  # mkldnn_rnn_layer is replaced
    assert_kernels_close(auto(x1, x2), reference_ntk(model, x1, x2))
    with warnings.catch_warnings():
        warnings.simplefilter("error", torchntk.ExampleLoopWarning)
        mapped = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=0)(x1, x2)
    assert_kernels_close(mapped, reference_ntk(model, x1, x2))


def test_auto_keeps_forward_mode_estimates_unmarked(device):
    model = _built(_TwoLeaves)(device)
    x1, x2 = _inputs((4,), device)
    choice = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=0).auto_choice(x1, x2)
    assert choice.estimates[VECTOR_PRODUCTS].note == "" and choice.excluded == {}


@pytest.mark.parametrize("vmap_axes", [0, None], ids=["vmap0", "novmap"])
def test_auto_excludes_implementation_2_when_it_cannot_run(vmap_axes, device, monkeypatch):
    monkeypatch.setattr(auto_module, "_PROBE_EVERYTHING", True)  # as above
    model = _built(_CtcLoss)(device)
    x1, x2 = _inputs((4,), device)
    auto = torchntk.empirical_ntk_fn(model, vmap_axes=vmap_axes, implementation=0)
    choice = auto.auto_choice(x1, x2)
    assert set(choice.excluded) == {VECTOR_PRODUCTS} and VECTOR_PRODUCTS not in choice.estimates
    assert "_ctc_loss_backward" in choice.excluded[VECTOR_PRODUCTS]
    assert choice.implementation != VECTOR_PRODUCTS
    assert_kernels_close(auto(x1, x2), reference_ntk(model, x1, x2), rtol=1e-10)


def test_auto_excludes_a_candidate_whose_pricing_fails(device):
    model = _built(_TwoLeaves)(device)
    x1, x2 = _inputs((4,), device)

    def broken(*args, **kwargs):
        raise RuntimeError("pricing broke")

    # _PROBE_EVERYTHING: on a model this small AUTO would not price 3 at all (its plan costs too much)
    with mock.patch.object(auto_module, "structured_cost", broken), \
            mock.patch.object(auto_module, "_PROBE_EVERYTHING", True):
        auto = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0)
        choice = auto.auto_choice(x1, x2)
        actual = auto(x1, x2)
    assert choice.excluded == {NtkImplementation.STRUCTURED_DERIVATIVES: "RuntimeError: pricing broke"}
    assert set(choice.estimates) == {NtkImplementation.JACOBIAN_CONTRACTION, VECTOR_PRODUCTS}
    assert_kernels_close(actual, reference_ntk(model, x1, x2, trace_axes=()), rtol=1e-10)


def test_auto_excludes_implementation_3_when_its_plan_fails(device):
    model = _built(_TwoLeaves)(device)
    x1, x2 = _inputs((4,), device)

    def no_plan(self, *args, **kwargs):
        raise RuntimeError("the probe failed")

    # _PROBE_EVERYTHING: on a model this small AUTO would not make 3's plan at all (it costs too much)
    with mock.patch.object(StructuredDerivatives, "plan", no_plan), \
            mock.patch.object(auto_module, "_PROBE_EVERYTHING", True):
        auto = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=0)
        choice = auto.auto_choice(x1, x2)
        actual = auto(x1, x2)
    assert choice.excluded == {NtkImplementation.STRUCTURED_DERIVATIVES: "RuntimeError: the probe failed"}
    assert choice.fallback_parameters == {} and choice.implementation != NtkImplementation.STRUCTURED_DERIVATIVES
    assert_kernels_close(actual, reference_ntk(model, x1, x2), rtol=1e-10)


def test_auto_with_every_candidate_excluded_runs_jacobian_contraction(device):
    model = _built(_TwoLeaves)(device)
    x1, x2 = _inputs((4,), device)

    def broken(*args, **kwargs):
        raise RuntimeError("pricing broke")

    with mock.patch.object(auto_module, "structured_cost", broken), \
            mock.patch.object(auto_module, "vector_products_method", broken), \
            mock.patch.object(auto_module, "Estimate", broken):
        auto = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=0)
        choice = auto.auto_choice(x1, x2)
        actual = auto(x1, x2)
    assert choice.implementation == NtkImplementation.JACOBIAN_CONTRACTION and choice.estimates == {}
    assert set(choice.excluded) == set(NtkImplementation) - {NtkImplementation.AUTO}
    assert_kernels_close(actual, reference_ntk(model, x1, x2), rtol=1e-10)


@pytest.mark.parametrize("implementation", [0, 2], ids=["AUTO", "NVP"])
def test_batched_kernels_without_forward_mode(implementation, device):
    """``torchntk.batch`` builds implementation 2's block plan through the implementation table."""
    build, shape, _ = _NO_FORWARD_MODE["custom_function"]
    generator = torch.Generator().manual_seed(2)
    x1, x2 = (torch.randn(n, *shape, generator=generator, dtype=torch.float64).to(device) for n in (7, 5))
    ntk_fn = torchntk.empirical_ntk_fn(build(device), vmap_axes=0, implementation=implementation)
    actual = torchntk.batch(ntk_fn, 3, cache_bytes=0)(x1, x2)
    assert_kernels_close(actual, _reference(build, x1, x2), rtol=1e-10)


class _DetachedBackward(torch.autograd.Function):
    """``h * s`` with a right first derivative computed outside autograd (detached), and no jvp:
    its backward runs, but differentiating it gives zero."""

    generate_vmap_rule = True

    @staticmethod
    def forward(h, s):
        return h * s

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, grad):
        h, s = ctx.saved_tensors
        grad = grad.detach()
        return (grad * s.detach()), (grad * h.detach()).sum_to_size(s.shape)


class _DetachedModel(_LinearScaleHead):
    def forward(self, x):
        return self.head(_DetachedBackward.apply(torch.tanh(self.linear(x)), self.scale))


def test_a_backward_that_cannot_be_differentiated_is_refused_not_wrong(device):
    """The double-VJP path differentiates the backward pass; where that derivative is wrong
    (detached), the adjoint check refuses instead of returning zero columns."""
    torch.manual_seed(0)
    model = _DetachedModel().double().to(device)
    x1 = torch.randn(4, 4, dtype=torch.float64).to(device)
    with pytest.raises(ValueError, match="derivative is wrong"):
        torchntk.empirical_ntk_fn(model, implementation=2)(x1)
    expected = reference_ntk(model, x1)
    assert_kernels_close(torchntk.empirical_ntk_fn(model, implementation=1)(x1), expected)
    auto = torchntk.empirical_ntk_fn(model, implementation=0)
    assert VECTOR_PRODUCTS in auto.auto_choice(x1).excluded
    assert_kernels_close(auto(x1), expected)
