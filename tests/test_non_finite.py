"""NOTE: [Non-finite kernels]: NaN or Inf in the outputs is explained on every call.

The promise of docs/guarantees.md holds on a key's first call, on a warm call (which makes no
whole-batch forward pass and no check) and on a replay of a captured graph (``compile=``), for
every implementation, every ``vmap_axes`` form and the three kinds of kernel a kernel function
returns. Each test computes good kernels before the bad call as many times as ``calls_before``
says, so that the bad call is the first, the second or a later one of its key.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchntk
from tests.cases import to_device
from torchntk.testing import assert_kernels_close, reference_ntk

F64 = torch.float64
IMPLEMENTATIONS = pytest.mark.parametrize("implementation", [0, 1, 2, 3], ids=["AUTO", "JC", "NVP", "SD"])
CALLS_BEFORE = pytest.mark.parametrize("calls_before", [0, 1, 3], ids=["first", "second", "later"])
VMAP_AXES = pytest.mark.parametrize("vmap_axes", ["auto", 0, None], ids=["found", "given", "none"])


def _model(device: torch.device) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double().to(device).eval()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x1 = torch.randn(5, 4, generator=generator, dtype=F64)
    return to_device((x1, torch.randn(3, 4, generator=generator, dtype=F64)))


def _with_nan(x: torch.Tensor) -> torch.Tensor:
    bad = x.clone()
    bad[1, 2] = float("nan")
    return bad


@IMPLEMENTATIONS
@VMAP_AXES
@CALLS_BEFORE
@pytest.mark.parametrize("compile", [False, "eager"], ids=["eager", "captured"])
@pytest.mark.parametrize("side", ["x1", "x2"])
def test_nan_inputs_raise_on_every_call(implementation, vmap_axes, calls_before, compile, side, device):
    model = _model(device)
    x1, x2 = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=vmap_axes, implementation=implementation, compile=compile)
    for _ in range(calls_before):
        assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))
    bad = (_with_nan(x1), x2) if side == "x1" else (x1, _with_nan(x2))
    with pytest.raises(ValueError, match=rf"output leaf 0 for {side} holds 3 NaN .* input {side} \(1 entry\)"):
        ntk_fn(*bad)
    # the key is unharmed: the next good call is exact, and "auto" still finds the axes
    assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))
    if vmap_axes == "auto":
        assert ntk_fn.auto_choice(x1, x2).vmap_axes is not None


@pytest.mark.parametrize("implementation", [0, 1, 3], ids=["AUTO", "JC", "SD"])
@CALLS_BEFORE
def test_an_infinite_parameter_is_named_on_every_call(implementation, calls_before, device):
    model = _model(device)
    x1, x2 = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(model, implementation=implementation)
    for _ in range(calls_before):
        ntk_fn(x1, x2)
    with torch.no_grad():
        model[2].weight[1, 0] = float("inf")
    with pytest.raises(ValueError, match=r"NaN or infinite .* parameter '2.weight' \(1 entry\)"):
        ntk_fn(x1, x2)


@CALLS_BEFORE
@pytest.mark.parametrize("get", ["ntk", "nngp", ("ntk", "nngp")], ids=["ntk", "nngp", "both"])
def test_kernel_fn_explains_nan_on_every_call(calls_before, get, device):
    model = _model(device)
    x1, x2 = _inputs()
    kernel_fn = torchntk.empirical_kernel_fn(model)
    for _ in range(calls_before):
        kernel_fn(x1, x2, get)
    with pytest.raises(ValueError, match=r"output leaf 0 for x1 holds 3 NaN .* input x1 \(1 entry\)"):
        kernel_fn(_with_nan(x1), x2, get)


@CALLS_BEFORE
def test_nan_made_by_the_model_says_so_on_every_call(calls_before, device):
    """``sqrt`` of negative numbers: NaN outputs and NaN derivatives. (``log`` would make NaN
    outputs with finite derivatives, hence a finite kernel, which only a first call's output check
    sees: NOTE: [Non-finite kernels].)"""
    def f(p, x):
        return torch.sqrt(x @ p)

    params = to_device(torch.randn(4, 3, dtype=F64, generator=torch.Generator().manual_seed(1)))
    x1, x2 = _inputs()
    positive = (x1.abs() + 1, x2.abs() + 1)
    ntk_fn = torchntk.empirical_ntk_fn(f)
    for _ in range(calls_before):
        ntk_fn(*positive, params.abs())
    with pytest.raises(ValueError, match="the model creates them"):
        ntk_fn(x1, x2, params)


@CALLS_BEFORE
def test_a_non_finite_derivative_of_finite_outputs_is_returned(calls_before, device):
    """``sqrt`` at 0: the output is finite, the derivative infinite however it is computed. The
    kernel is infinite and returned as on a first call, not explained as NaN outputs."""
    def f(p, x):
        return torch.sqrt((x * p).abs())

    params = to_device(torch.ones(4, dtype=F64))
    x1, x2 = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(f, implementation=1)
    for _ in range(calls_before):
        ntk_fn(x1, x2, params)
    zero = x1.clone()
    zero[0, 0] = 0.0
    kernel = ntk_fn(zero, x2, params)
    assert not torch.isfinite(kernel).all()


@CALLS_BEFORE
def test_check_vmap_axes_false_returns_the_kernel_unexplained(calls_before, device):
    model = _model(device)
    x1, x2 = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, check_vmap_axes=False)
    for _ in range(calls_before):
        ntk_fn(x1, x2)
    kernel = ntk_fn(_with_nan(x1), x2)
    assert torch.isnan(kernel).any() and torch.isfinite(kernel[0]).all()


def test_a_warm_call_pays_one_reduction_not_a_forward_pass(device, monkeypatch):
    """The explanation runs only for a kernel that is not finite: a warm good call makes no
    whole-batch forward pass."""
    from torchntk._call import finite

    model = _model(device)
    x1, x2 = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1)
    ntk_fn(x1, x2)
    explained = []
    original = finite.raise_for_non_finite_outputs
    monkeypatch.setattr(finite, "raise_for_non_finite_outputs", lambda *a: explained.append(a) or original(*a))
    from torchntk._kernel import settings as settings_module

    monkeypatch.setattr(settings_module, "raise_for_non_finite_outputs", finite.raise_for_non_finite_outputs)
    ntk_fn(x1, x2)
    assert explained == []
    with pytest.raises(ValueError, match="NaN"):
        ntk_fn(_with_nan(x1), x2)
    assert len(explained) == 1


@CALLS_BEFORE
@pytest.mark.parametrize("get", ["ntk", "nngp"])
def test_batch_explains_nan_on_every_call(calls_before, get, device):
    """``batch`` computes its blocks from prepared spans, not through the kernel function's calls:
    each block is tested like a call's kernel."""
    model = _model(device)
    x = to_device(torch.randn(10, 4, dtype=F64, generator=torch.Generator().manual_seed(2)))
    batched = torchntk.batch(torchntk.empirical_kernel_fn(model), batch_size=4)
    for _ in range(calls_before):
        batched(x, None, get)
    bad = x.clone()
    bad[7, 1] = float("nan")
    with pytest.raises(ValueError, match=r"NaN or infinite .* input x1 \(1 entry\)"):
        batched(bad, None, get)
