"""nn.Module handling: what is differentiated, what is constant, what is never mutated, warnings.

Models and inputs live on the run device (``pytest --device``): models are built and inputs drawn on
the CPU, then moved, so that every device sees the same numbers.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import torchntk
from torchntk.testing import assert_kernels_close, reference_ntk


def batchnorm_model(training: bool, device: torch.device) -> nn.Module:
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 2))
    model = model.double().train(training)
    with torch.no_grad():  # drawn on the CPU, before the move
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    return model.to(device)


def randn(device: torch.device, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Drawn from the global CPU generator (seeded for every test), then moved to ``device``."""
    return torch.randn(*shape, dtype=dtype).to(device)


@pytest.fixture
def images(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs of :func:`batchnorm_model` on the run device: 4 and 3 float64 images."""
    generator = torch.Generator().manual_seed(1)
    x1, x2 = (torch.randn(n, 2, 4, 4, generator=generator, dtype=torch.float64) for n in (4, 3))
    return x1.to(device), x2.to(device)


def snapshot(model: nn.Module) -> dict:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("implementation", [1, 2])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_module_parameters_and_buffers_are_never_mutated(implementation, training, images, device):
    x1, x2 = images
    model = batchnorm_model(training, device)
    before = snapshot(model)
    kernel_fn = torchntk.empirical_kernel_fn(model, implementation=implementation)
    batch_statistics = r"BatchNorm2d at '1' \(batch statistics\).*model.eval\(\)"
    with pytest.warns(UserWarning, match=batch_statistics) if training else _no_warning():
        kernel_fn(x1, x2)
        torchntk.empirical_ntk_vp_fn(model, x1, x2)(randn(device, 3, 2))
    for name, value in snapshot(model).items():
        assert torch.equal(value, before[name]), name
    assert all(p.requires_grad for p in model.parameters())


class _no_warning:
    """Fails if torchntk warns (torch's own deprecation warnings are not ours to judge)."""

    def __enter__(self):
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")

    def __exit__(self, *exc):
        self._catcher.__exit__(*exc)
        ours = [w for w in self._caught if "model.eval()" in str(w.message)]
        assert not ours, [str(w.message) for w in ours]


@pytest.mark.parametrize("implementation", [1, 2])
def test_training_mode_batchnorm_without_vmap_is_the_batch_coupled_kernel(implementation, images, device):
    x1, x2 = images
    model = batchnorm_model(True, device)
    expected = reference_ntk(copy.deepcopy(model), x1, x2)
    with pytest.warns(UserWarning, match=r"BatchNorm2d at '1' \(batch statistics\).*model.eval\(\)"):
        actual = torchntk.empirical_ntk_fn(model, implementation=implementation)(x1, x2)
    assert_kernels_close(actual, expected)


@pytest.mark.parametrize("implementation", [1, 2])
def test_batch_coupled_module_with_vmap_axes_raises(implementation, images, device):
    x1, x2 = images
    model = batchnorm_model(True, device)
    with pytest.warns(UserWarning, match=r"BatchNorm2d at '1' \(batch statistics\)"), \
            pytest.raises(ValueError, match=r"BatchNorm2d at '1' normalises with batch statistics.*model.eval\(\)"):
        torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)(x1, x2)
    no_running_stats = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False)).eval().to(device)
    with pytest.warns(UserWarning, match=r"BatchNorm1d at '1' \(batch statistics\)"), \
            pytest.raises(ValueError, match="BatchNorm1d at '1' normalises with batch statistics"):
        torchntk.empirical_ntk_fn(no_running_stats, vmap_axes=0)(randn(device, 5, 3, dtype=torch.float32))


def test_training_mode_dropout_warns_and_refuses_vmap(device):
    model = nn.Sequential(nn.Linear(3, 8), nn.Dropout(0.5), nn.Linear(8, 2)).train().to(device)
    x = randn(device, 4, 3, dtype=torch.float32)
    with pytest.warns(UserWarning, match=r"Dropout at '1' \(random in training mode\)"):
        torchntk.empirical_ntk_fn(model)(x)
    with pytest.warns(UserWarning, match=r"Dropout at '1' \(random in training mode\)"), \
            pytest.raises(ValueError, match="draws random numbers in training mode"):
        torchntk.empirical_ntk_fn(model, vmap_axes=0)(x)
    model.eval()
    with _no_warning():
        torchntk.empirical_ntk_fn(model, vmap_axes=0)(x)


class CentreOverBatch(nn.Module):
    """Couples examples without any BatchNorm layer: only the numerical check can see it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(self, x):
        hidden = self.linear(x)
        return hidden - hidden.mean(0, keepdim=True)


@pytest.mark.parametrize("implementation", [1, 2])
def test_vmap_axes_check_catches_coupling_layers_cannot_name(implementation, images, device):
    model = CentreOverBatch().double().to(device)
    x1, x2 = (x[:, 0, 0, :3] for x in images)
    with pytest.raises(ValueError, match="differs between the whole batch and a per-example evaluation"):
        torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)(x1, x2)
    without = torchntk.empirical_ntk_fn(model, implementation=implementation)(x1, x2)
    assert_kernels_close(without, reference_ntk(model, x1, x2))


def test_frozen_parameters_are_constants_and_tied_ones_count_once(device):
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double().to(device)
    model[0].requires_grad_(False)
    model[2].weight = model[4].weight if model[4].weight.shape == model[2].weight.shape else model[2].weight
    x1, x2 = randn(device, 3, 3), randn(device, 2, 3)
    trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert "0.weight" not in trainable
    expected = reference_ntk(model, x1, x2, params=trainable)
    for implementation in (1, 2):
        assert_kernels_close(torchntk.empirical_ntk_fn(model, implementation=implementation)(x1, x2), expected)


def test_tied_weights_are_differentiated_once(device):
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.Tanh(), shared).double().to(device)
    x1, x2 = randn(device, 4, 3), randn(device, 2, 3)
    expected = reference_ntk(model, x1, x2)
    for implementation in (1, 2):
        assert_kernels_close(torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)(x1, x2), expected)


def test_dtypes_follow_the_promotion_of_outputs_and_parameters(device):
    model32 = nn.Linear(3, 2).to(device)
    x32 = randn(device, 4, 3, dtype=torch.float32)
    assert torchntk.empirical_ntk_fn(model32)(x32).dtype == torch.float32
    assert torchntk.empirical_ntk_fn(model32, implementation=2)(x32).dtype == torch.float32
    assert torchntk.empirical_nngp_fn(model32)(x32).dtype == torch.float32
    model64 = nn.Linear(3, 2).double().to(device)
    for implementation in (1, 2):
        assert torchntk.empirical_ntk_fn(model64, implementation=implementation)(x32.double()).dtype == torch.float64
    # float32 parameters, float64 output: the kernel is float64
    f = lambda p, x: x @ p.double()  # noqa: E731
    weight = randn(device, 3, 2, dtype=torch.float32)
    for implementation in (1, 2):
        kernel = torchntk.empirical_ntk_fn(f, implementation=implementation)(x32.double(), None, weight)
        assert kernel.dtype == torch.float64
        assert_kernels_close(kernel, reference_ntk(f, x32.double(), None, weight), rtol=1e-5)  # float32 Jacobians


def test_kernels_are_on_the_inputs_device(device):
    model = nn.Linear(3, 2).to(device)
    x = randn(device, 4, 3, dtype=torch.float32)
    for kernel in (
        torchntk.empirical_ntk_fn(model)(x),
        torchntk.empirical_ntk_fn(model, implementation=2, vmap_axes=0)(x),
        torchntk.empirical_nngp_fn(model)(x),
    ):
        assert kernel.device == x.device == device


def test_float32_agrees_with_float64_reference(device):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 16), nn.GELU(), nn.Linear(16, 3)).to(device)
    x1, x2 = randn(device, 6, 5, dtype=torch.float32), randn(device, 4, 5, dtype=torch.float32)
    expected = reference_ntk(model, x1, x2, trace_axes=())
    for implementation in (1, 2):
        for vmap_axes in (None, 0):
            actual = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=implementation)(x1, x2)
            assert actual.dtype == torch.float32
            assert_kernels_close(actual, expected.float())


def test_params_differentiated_at_a_subset_keep_other_values(device):
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double().to(device)
    x = randn(device, 3, 3)
    only_first = {"0.bias": model[0].bias.detach() * 2}
    expected = reference_ntk(model, x, None, params=only_first)
    assert_kernels_close(torchntk.empirical_ntk_fn(model)(x, None, only_first), expected)
    jacobian = torch.func.jacrev(lambda b: torch.func.functional_call(model, {"0.bias": b}, (x,)))(only_first["0.bias"])
    assert_kernels_close(expected, torch.einsum("naj,mbj->nmab", jacobian, jacobian).diagonal(dim1=2, dim2=3).mean(-1))


def test_linearize_keeps_its_expansion_point_when_the_module_is_trained_in_place(device):
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double().to(device)
    x = randn(device, 5, 3)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    expected = model(x).detach()
    f_lin = torchntk.linearize(model)
    f_quadratic = torchntk.taylor_expand(model, degree=2)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    assert_kernels_close(f_lin(before, x), expected)
    assert_kernels_close(f_quadratic(before, x), expected)
