"""Implementation 1 without ``vmap_axes`` in runs of traced outputs (NOTE: [Runs of traced outputs]):
a ``chunk_size`` (given, or chosen by the memory plan) bounds the Jacobian held to one run of the
traced coordinates, and the kernel is exactly the one the whole Jacobian gives."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchntk
from tests import zoo
from tests.cases import DEVICE, to_device
from torchntk._implementations import jacobian_contraction, memory
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_ntk


class Coupled(nn.Module):
    """BatchNorm in training mode (the examples coupled, so nothing maps them) and two output leaves:
    logits ``(N, 2, 7)`` and a map ``(N, 3, 4)``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh())
        self.logits = nn.Linear(6, 14)
        self.map = nn.Linear(6, 12)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.logits(h).reshape(-1, 2, 7), self.map(h).reshape(-1, 3, 4)


def _model(dtype: torch.dtype = torch.float64) -> Coupled:
    torch.manual_seed(0)
    return Coupled().to(dtype).to(DEVICE).train()


def _inputs(n: int, dtype: torch.dtype = torch.float64, seed: int = 1) -> torch.Tensor:
    return to_device(torch.randn(n, 5, generator=torch.Generator().manual_seed(seed), dtype=dtype))


def _kernel(model: nn.Module, x1, x2, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the training-mode notice
        return torchntk.empirical_ntk_fn(model, implementation=1, vmap_axes=None, **options)(x1, x2)


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 7, 10, 1000])
@pytest.mark.parametrize("same", [True, False], ids=["x2=None", "x2 given"])
@pytest.mark.parametrize(
    "trace_axes, diagonal_axes", [((-1,), ()), ((1, 2), ()), ((-1,), (1,)), ((1,), ())],
    ids=["last", "both", "last, diagonal", "first"],
)
def test_runs_of_traced_outputs_give_the_exact_kernel(chunk_size, same, trace_axes, diagonal_axes):
    model = _model()
    x1, x2 = _inputs(5), None if same else _inputs(3, seed=2)
    snapshot = ModuleSnapshot.of(model)
    kernels = _kernel(model, x1, x2, trace_axes=trace_axes, diagonal_axes=diagonal_axes, chunk_size=chunk_size)
    snapshot.assert_unchanged()  # running statistics as they were
    expected = reference_ntk(model, x1, x2, trace_axes=trace_axes, diagonal_axes=diagonal_axes)
    assert len(kernels) == 2
    for kernel, reference in zip(kernels, expected):
        assert_kernels_close(kernel, reference, rtol=1e-10, atol=1e-12 * reference.abs().max().item())


def test_a_run_holds_the_jacobian_of_its_coordinates_only(monkeypatch):
    # What is held at once: one run of coordinates of each leaf's traced axis (x2=None: one side).
    model = _model()
    held: list[int] = []
    original = jacobian_contraction._run_jacobians

    def watched(outputs, pullback, leaf, run, chunk):
        jacobians = original(outputs, pullback, leaf, run, chunk)
        held.append(jacobians[0].shape[:-2].numel())  # output entries of the run (first parameter's Jacobian)
        return jacobians

    monkeypatch.setattr(jacobian_contraction, "_run_jacobians", watched)
    _kernel(model, _inputs(5), None, chunk_size=20)
    # logits (5, 2, 7) traced along their last axis: 20 entries hold 2 of its coordinates, so runs of
    # 2, 2, 2, 1; the map (5, 3, 4): 15 entries per coordinate, so runs of 1
    assert held == [20, 20, 20, 10] + [15] * 4


def test_groups_are_summed_per_group_over_the_runs():
    model = _model()
    x1 = _inputs(4)
    groups = {"body": "body.*", "heads": "*"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        whole = torchntk.empirical_ntk_fn(model, implementation=1, vmap_axes=None, groups=groups)(x1)
        runs = torchntk.empirical_ntk_fn(model, implementation=1, vmap_axes=None, groups=groups, chunk_size=4)(x1)
    for leaf_whole, leaf_runs in zip(whole, runs):
        for name in groups:
            assert_kernels_close(leaf_runs[name], leaf_whole[name], rtol=1e-12, atol=1e-14)


def test_float32_runs_are_summed_as_accurately_as_the_whole_jacobian():
    model = _model(torch.float32)
    x1 = _inputs(6, torch.float32)
    expected = reference_ntk(model, x1)
    for kernel, reference in zip(_kernel(model, x1, None, chunk_size=6), expected):
        assert kernel.dtype == torch.float32
        assert_kernels_close(kernel.double(), reference, rtol=1e-5, atol=1e-6 * reference.abs().max().item())


def test_the_memory_model_prices_one_run_and_the_plan_cuts_runs_to_fit():
    # A budget the whole Jacobian does not fit: the plan chooses a chunk_size, the runs fit, and the
    # kernel is exact. Without a traced axis (trace_axes=()) runs do not apply, and the same budget
    # is refused.
    model = nn.Sequential(nn.Linear(5, 64), nn.BatchNorm1d(64), nn.Tanh(), nn.Linear(64, 400)).double().to(DEVICE)
    x1 = _inputs(8)
    jacobian = 8 * 400 * sum(p.numel() for p in model.parameters()) * 8  # bytes of the whole Jacobian
    budget = jacobian // 6
    ntk_fn = torchntk.empirical_ntk_fn(model, implementation=1, vmap_axes=None, memory=budget)
    with pytest.warns(torchntk.MemoryPlanWarning, match="output entries differentiated at once"):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*training mode.*")
            kernel = ntk_fn(x1)
    expected = reference_ntk(model, x1)
    assert_kernels_close(kernel, expected, rtol=1e-10, atol=1e-12 * expected.abs().max().item())

    with pytest.raises(torchntk.KernelMemoryError, match="even with one output entry differentiated at a time"):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*training mode.*")
            torchntk.empirical_ntk_fn(model, implementation=1, vmap_axes=None, trace_axes=(), memory=budget)(x1[:2])


def test_run_entries_are_whole_coordinates_of_the_longest_traced_axis():
    side = memory._SideSizes(1, 0.0, memory.Activations(1.0, 1.0), False, ((8000.0, 8.0), (60.0, 60.0)))
    assert side.run_entries(100) == 96  # 12 logits of 8 examples; the untraced leaf whole (60)
    assert side.run_entries(3) == 60  # the untraced leaf whole is the larger
    assert side.run_entries(1e9) == 8000


@pytest.mark.slow
def test_resnet18_in_training_mode_with_more_logits_than_its_jacobian_budget_holds() -> None:
    """A torchvision ResNet-18 as constructed (training mode: nothing maps the examples) whose whole
    Jacobian exceeds the budget: implementation 1 is planned in runs of the logits, AUTO picks what
    fits, and both kernels are exact; the model is unchanged."""
    torchvision = zoo.import_torchvision()
    torch.manual_seed(0)
    module = torchvision.models.resnet18(weights=None, num_classes=12).double().to(DEVICE)
    x1 = to_device(torch.randn(2, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))
    snapshot = ModuleSnapshot.of(module)
    budget = "600MB"  # the whole Jacobian: 2 x 12 x 11.2M x 8 bytes = 2.1 GB
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ones = torchntk.empirical_ntk_fn(module, implementation=1, memory=budget)(x1)
        auto_fn = torchntk.empirical_ntk_fn(module, memory=budget)
        auto = auto_fn(x1)
    snapshot.assert_unchanged()
    assert any(isinstance(warning.message, torchntk.MemoryPlanWarning) for warning in caught)
    assert any("training mode" in str(warning.message) for warning in caught)
    assert auto_fn.auto_choice(x1).vmap_axes is None
    expected = reference_ntk(module, x1)
    for kernel in (ones, auto):
        assert_kernels_close(kernel, expected, rtol=1e-8, atol=1e-10 * expected.abs().max().item())
