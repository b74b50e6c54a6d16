"""Float32 accuracy of long reductions, against the float64 brute force of ``torchntk.testing``.

NOTE: [Float32 tolerances of the accuracy tests]
Errors are ``max|K - K_ref| / max|K_ref|``. Rounding the float64 kernel to float32 alone costs up
to 6e-8; implementation 2 (NTK-vector products) reaches 1.4e-7 on the wide convolution below and
the blocked float64 summation of implementation 1 (NOTE: [Accurate contraction] in
``_layout/kernel_layout.py``) 5e-8 to 9e-8, while one float32 matrix product over the whole inner dimension
was off by 2.3e-6 (full kernel) and 2.5e-3 (traced kernel: 10 logits times 2.4M weights summed
at once). ``_TOLERANCE`` sits between: a few times the accurate errors, a few times below the
inaccurate ones.

Models and inputs live on the run device (``pytest --device``), drawn on the CPU and moved there.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import torchntk
from tests.cases import DEVICE, to_device
from torchntk._layout.kernel_layout import make_layout
from torchntk.testing import assert_kernels_close, reference_nngp, reference_ntk

_TOLERANCE = 5e-7
_CLASSES = 10


def _assert_accurate(actual: torch.Tensor, expected: torch.Tensor, tolerance: float = _TOLERANCE) -> None:
    """``|actual - expected| <= tolerance * max|expected|`` everywhere, ``actual`` still float32."""
    assert actual.dtype == torch.float32
    assert_kernels_close(actual, expected, rtol=0.0, atol=tolerance * expected.abs().max().item())


class _WideConvolution(nn.Module):
    """A 3x3 convolution of 512 to 512 channels (2.4M weights, as in a ResNet-18's last stage)
    on 4x4 images, pooled into 10 logits: its traced kernel sums 24M products per entry."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(8, 512, 3, padding=1)
        self.wide = nn.Conv2d(512, 512, 3, padding=1)
        self.head = nn.Linear(512, _CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.wide(torch.relu(self.stem(x))))
        return self.head(hidden.mean((2, 3)))


@functools.lru_cache(maxsize=None)
def _wide_problem():
    """The float32 model, x1 (2 examples), x2 (1 example) and the float64 reference NTK of
    ``cat(x1, x2)`` with itself, full layout ``(3, 3, 10, 10)``: one oracle call serves every case."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = _WideConvolution().to(DEVICE).eval()
        x1, x2 = to_device((torch.randn(2, 8, 4, 4), torch.randn(1, 8, 4, 4)))
    full = reference_ntk(model, torch.cat([x1, x2]), trace_axes=())
    return model, x1, x2, full


@pytest.mark.parametrize("implementation", [1, 3], ids=["JC", "SD"])
@pytest.mark.parametrize("vmap_axes", [None, 0], ids=["no-vmap", "vmap0"])
@pytest.mark.parametrize("same", [False, True], ids=["x2", "x2=None"])
@pytest.mark.parametrize("trace_axes", [(), (-1,)], ids=["full", "traced"])
def test_float32_kernel_of_a_wide_convolution_is_accurate(trace_axes, same, vmap_axes, implementation):
    model, x1, x2, full = _wide_problem()
    columns = slice(0, 2) if same else slice(2, 3)
    expected = full[:2, columns]
    if trace_axes:
        expected = torch.einsum("ijaa->ij", expected) / _CLASSES  # the trace is a mean over logits
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=trace_axes, vmap_axes=vmap_axes, implementation=implementation)
    # Implementation 3 contracts its factors in float32: 2e-6 to 4e-6 on this model (summing its terms and
    # long Gram steps in float64 reached 4e-8 but cost the benchmark CNN about 25%, see
    # docs/guarantees.md), at the level of implementation 1 on resnet18 (1.4e-7).
    tolerance = _TOLERANCE if implementation == 1 else 6e-6
    _assert_accurate(ntk_fn(x1, None if same else x2), expected, tolerance)


class _Scale(nn.Module):
    """``x * w`` with one scalar weight: the NNGP of ``x`` itself."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def test_float32_nngp_over_a_long_traced_axis_is_accurate():
    x1 = to_device(torch.rand(3, 2_000_000) + 0.5)  # positive: every product adds, as in a kernel's diagonal
    x2 = to_device(torch.rand(2, 2_000_000) + 0.5)
    model = _Scale().to(DEVICE)
    nngp_fn = torchntk.empirical_nngp_fn(model, trace_axes=(-1,))
    _assert_accurate(nngp_fn(x1, x2), reference_nngp(model, x1, x2, trace_axes=(-1,)))
    _assert_accurate(nngp_fn(x1, None), reference_nngp(model, x1, None, trace_axes=(-1,)))


def test_float32_kernel_summed_over_many_runs_of_a_traced_batch_axis_is_accurate():
    # 512 runs of 8 examples, each adding one block to the traced kernel; a large first example
    # makes every later float32 addition round.
    generator = torch.Generator().manual_seed(0)
    x1, x2 = torch.rand(4096, 4, generator=generator) + 1, torch.rand(4096, 4, generator=generator) + 1
    x1[0] *= 30
    x1, x2 = to_device((x1, x2))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Linear(4, 1).to(DEVICE)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(0, 1), vmap_axes=0, implementation=1, chunk_size=8)
    expected = reference_ntk(model, x1, x2, trace_axes=(0, 1))
    _assert_accurate(ntk_fn(x1, x2), expected, tolerance=1.5e-7)


def _layout(ndim, trace=(), diagonal=()):
    return make_layout(ndim, tuple(trace), tuple(diagonal), "test", "the output")


@pytest.mark.parametrize(
    "shape, trace, diagonal",
    [
        ((3, 10, 300_000), (1,), ()),  # few rows: several blocks per matrix product
        ((30, 10, 100_000), (), ()),  # 300 rows: one block per product, symmetric in row blocks
        ((3, 4, 5, 50_000), (1,), (2,)),  # a diagonal axis: a batch of products
    ],
    ids=["traced", "full-300-rows", "diagonal"],
)
def test_long_float32_contraction_matches_float64(shape, trace, diagonal):
    generator = torch.Generator().manual_seed(0)
    first = to_device(torch.randn(shape, generator=generator) + 0.5)
    second = to_device(torch.randn(shape, generator=generator) + 0.5)
    layout = _layout(len(shape) - 1, trace, diagonal)
    for one, two in [(first, second), (first, first)]:
        expected = layout.contract(one.double(), two.double())
        _assert_accurate(layout.contract(one, two), expected, tolerance=4e-7)
        wide = layout.contract(one, two, wide=True)
        assert wide.dtype == torch.float64
        assert_kernels_close(wide, expected, rtol=0.0, atol=4e-7 * expected.abs().max().item())


def test_long_float32_symmetric_contraction_is_exactly_symmetric():
    jacobian = to_device(torch.randn(30, 10, 50_000, generator=torch.Generator().manual_seed(0)))
    kernel = _layout(2).contract(jacobian, jacobian)  # (30, 30, 10, 10)
    assert torch.equal(kernel, kernel.permute(1, 0, 3, 2))
