"""Larger models (marked slow; run by the second step of ``.ci/run``), on the run device (``pytest --device``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchntk
from tests.cases import DEVICE, to_device
from torchntk.testing import assert_kernels_close, reference_ntk

pytestmark = pytest.mark.slow


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 5),
    ).double().to(DEVICE).eval()


def test_medium_cnn_full_kernel_every_route_agrees_with_brute_force():
    model = cnn()
    x1, x2 = to_device((torch.randn(10, 3, 8, 8, dtype=torch.float64), torch.randn(7, 3, 8, 8, dtype=torch.float64)))
    expected = reference_ntk(model, x1, x2, trace_axes=())
    for implementation in (1, 2, 3):
        for vmap_axes, chunk_size in [(None, None), (0, None), (0, 3), (None, 16)]:
            ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes,
                                               implementation=implementation, chunk_size=chunk_size)
            assert_kernels_close(ntk_fn(x1, x2), expected)


def test_wide_mlp_traced_kernel_float32_matches_float64():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    model = model.to(DEVICE)
    x = to_device(torch.randn(32, 64))
    expected = torchntk.empirical_ntk_fn(model.double(), vmap_axes=0)(x.double())
    model.float()
    for implementation in (1, 2, 3):
        actual = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation, chunk_size=8)(x)
        assert actual.dtype == torch.float32
        # Diagonal entries sum ~1.1M positive float32 products: ~3e-4 relative rounding is expected
        # (neural-tangents' own cross-implementation tolerance in float32 is 5e-3).
        assert_kernels_close(actual, expected.float(), rtol=1e-3, atol=1e-3 * expected.abs().max().item())


def test_wide_mlp_full_kernel_structured_equals_jacobian_contraction_in_float64():
    """The benchmark's shape of problem (wide layers, full kernel), where the rules matter most."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    model = model.double().to(DEVICE)
    x1, x2 = to_device((torch.randn(24, 96, dtype=torch.float64), torch.randn(17, 96, dtype=torch.float64)))
    for x2_ in (x2, None):
        expected = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0)(x1, x2_)
        structured = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=3, verify=True)
        assert_kernels_close(structured(x1, x2_), expected, rtol=1e-10, atol=1e-10 * expected.abs().max().item())
