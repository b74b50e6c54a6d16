"""The builders' defaults: ``implementation=0`` (AUTO) and ``vmap_axes="auto"`` (NOTE: [Found vmap_axes]).

Every kernel here is checked against the float64 brute force of ``torchntk.testing.reference_ntk``
(whole-batch Jacobians of the model as it is called, no vmap), whatever axes were found.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchntk
from tests.cases import DEVICE, to_device
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_ntk


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 16), nn.Tanh(), nn.Linear(16, 4)).double().to(DEVICE)


def _inputs(n1: int = 5, n2: int = 4, features: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return to_device(tuple(torch.randn(n, features, dtype=torch.float64, generator=generator) for n in (n1, n2)))


class _Centred(nn.Module):
    """Subtracts the batch mean: examples coupled, with no layer that says so."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        return h - h.mean(0, keepdim=True)


class _Masked(nn.Module):
    """A per-example mask as a keyword argument, and a shared scale passed whole."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2).double()

    def forward(self, x: torch.Tensor, mask: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (self.linear(x) * scale).tanh() * mask[:, :1] + mask[:, 1:]


def test_the_defaults_are_auto_and_found_axes():
    model = _mlp()
    x1, x2 = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(model)
    kernel, again, same = ntk_fn(x1, x2), ntk_fn(x1, x2), ntk_fn(x1)
    choice = ntk_fn.auto_choice(x1, x2)
    assert choice.vmap_axes == (0, 0, None) and choice.vmap_axes_reason is None
    assert choice.estimates and choice.implementation in choice.estimates  # AUTO chose
    assert_kernels_close(kernel, reference_ntk(model, x1, x2), rtol=1e-10)
    assert_kernels_close(again, kernel, rtol=1e-12)
    assert_kernels_close(same, reference_ntk(model, x1, None), rtol=1e-10)
    assert ntk_fn.auto_choice(x1).vmap_axes == (0, 0, None)


def test_explicit_arguments_behave_as_given():
    model = _mlp()
    x1, x2 = _inputs()
    unmapped = torchntk.empirical_ntk_fn(model, vmap_axes=None)
    assert unmapped.auto_choice(x1, x2).vmap_axes is None
    fixed = torchntk.empirical_ntk_fn(model, vmap_axes=None, implementation=1)
    assert fixed.auto_choice(x1, x2).estimates == {}  # a fixed implementation reports itself
    assert_kernels_close(fixed(x1, x2), reference_ntk(model, x1, x2), rtol=1e-10)
    # check_vmap_axes=False: nothing would prove the axes, so none are found
    unchecked = torchntk.empirical_ntk_fn(model, check_vmap_axes=False)
    assert unchecked.auto_choice(x1, x2).vmap_axes is None
    with pytest.raises(TypeError, match=r"`vmap_axes` must be 'auto'.*got 'first'"):
        torchntk.empirical_ntk_fn(model, vmap_axes="first")


def test_batch_statistics_in_training_mode_keep_whole_batches_and_the_buffers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 2)).double().to(DEVICE).train()
    x1, x2 = _inputs()
    snapshot = ModuleSnapshot.of(model)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernel = ntk_fn(x1, x2)
    notices = [str(w.message) for w in caught if "training mode" in str(w.message)]
    assert len(notices) == 1 and "\n" not in notices[0] and len(notices[0]) < 200, notices
    assert "BatchNorm1d at '1' (batch statistics)" in notices[0] and "model.eval()" in notices[0]
    snapshot.assert_unchanged()  # running statistics untouched
    assert_kernels_close(kernel, reference_ntk(model, x1, x2, trace_axes=()), rtol=1e-10)
    choice = ntk_fn.auto_choice(x1, x2)
    assert choice.vmap_axes is None and "BatchNorm1d at '1'" in choice.vmap_axes_reason
    # eval mode is another plan key: there the examples are independent
    model.eval()
    assert ntk_fn.auto_choice(x1, x2).vmap_axes == (0, 0, None)
    assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2, trace_axes=()), rtol=1e-10)


def test_coupling_that_only_the_output_check_sees_keeps_whole_batches():
    model = _Centred().to(DEVICE)
    x1, x2 = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=())
    kernel = ntk_fn(x1, x2)
    assert_kernels_close(kernel, reference_ntk(model, x1, x2, trace_axes=()), rtol=1e-10)
    choice = ntk_fn.auto_choice(x1, x2)
    assert choice.vmap_axes is None and choice.vmap_axes_reason


def test_keyword_arguments_of_examples_are_mapped_and_shared_ones_passed_whole():
    model = _Masked().to(DEVICE)
    x1, x2 = _inputs()
    generator = torch.Generator().manual_seed(2)
    masks = to_device(tuple(torch.rand(n, 2, dtype=torch.float64, generator=generator) for n in (5, 4)))
    scale = to_device(torch.tensor([0.5, 2.0], dtype=torch.float64))  # leading size 2, not an example axis
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=())
    kernel = ntk_fn(x1, x2, mask=masks, scale=scale)
    assert ntk_fn.auto_choice(x1, x2, mask=masks, scale=scale).vmap_axes == (0, 0, {"mask": 0})

    class Reference(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, inputs: tuple) -> torch.Tensor:
            return self.model(inputs[0], inputs[1], scale)

    expected = reference_ntk(Reference(), (x1, masks[0]), (x2, masks[1]), trace_axes=())
    assert_kernels_close(kernel, expected, rtol=1e-10)


def test_inputs_without_a_common_example_axis_are_not_mapped():
    class Pair(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(3, 2).double()

        def forward(self, inputs: tuple) -> torch.Tensor:
            x, table = inputs
            return self.linear(x) + table.sum()

    model = Pair().to(DEVICE)
    x1, x2 = _inputs()
    table = to_device(torch.ones(7, dtype=torch.float64))
    ntk_fn = torchntk.empirical_ntk_fn(model)
    kernel = ntk_fn((x1, table), (x2, table))
    choice = ntk_fn.auto_choice((x1, table), (x2, table))
    assert choice.vmap_axes is None and "leading axis" in choice.vmap_axes_reason
    assert_kernels_close(kernel, reference_ntk(model, (x1, table), (x2, table)), rtol=1e-10)


def test_batch_maps_blocks_with_the_found_axes():
    model = _mlp()
    x1, _ = _inputs(9)
    ntk_fn = torchntk.empirical_ntk_fn(model)
    kernel = torchntk.batch(ntk_fn, batch_size=4)(x1)
    assert_kernels_close(kernel, reference_ntk(model, x1, None), rtol=1e-10)


def test_the_kernel_function_of_the_kernel_builder_finds_axes_too():
    model = _mlp()
    x1, x2 = _inputs()
    kernels = torchntk.empirical_kernel_fn(model)(x1, x2, ("ntk", "nngp"))
    assert_kernels_close(kernels.ntk, reference_ntk(model, x1, x2), rtol=1e-10)
    assert_kernels_close(kernels.nngp, (model(x1) @ model(x2).T / 4).detach(), rtol=1e-10)


def test_one_dimensional_inputs_stay_one_example_and_traced_example_axes_stay_unmapped():
    model = nn.Linear(3, 2).double().to(DEVICE)
    x = to_device(torch.randn(3, dtype=torch.float64))  # one unbatched example, as without vmap_axes
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=())
    assert ntk_fn(x).shape == (2, 2) and ntk_fn.auto_choice(x).vmap_axes is None
    assert_kernels_close(ntk_fn(x), reference_ntk(model, x, None, trace_axes=()), rtol=1e-10)
    # outputs (N,): trace_axes=(-1,) traces the examples' axis; mapped, the same argument would mean
    # a kernel per pair of examples
    scalar = nn.Sequential(nn.Linear(3, 1), nn.Flatten(0)).double().to(DEVICE)
    x1, x2 = _inputs(4, 4)
    traced = torchntk.empirical_ntk_fn(scalar)
    with pytest.warns(torchntk.OutputWarning, match="one entry per example"):  # NOTE: [Output notices]
        kernel = traced(x1, x2)
    assert kernel.shape == () and traced.auto_choice(x1, x2).vmap_axes is None
    assert "leading output axis" in traced.auto_choice(x1, x2).vmap_axes_reason
    assert_kernels_close(kernel, reference_ntk(scalar, x1, x2), rtol=1e-10)


def test_a_refusal_of_an_unmapped_training_mode_model_says_why_it_is_unmapped():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 64), nn.BatchNorm1d(64), nn.Tanh(), nn.Linear(64, 4)).double().to(DEVICE)
    x1, x2 = _inputs()
    with pytest.warns(UserWarning, match="training mode"):
        with pytest.raises(torchntk.KernelMemoryError, match=r"model\.eval\(\) lets them be\) because BatchNorm1d"):
            torchntk.empirical_ntk_fn(model.train(), trace_axes=(), memory=2_000)(x1, x2)
