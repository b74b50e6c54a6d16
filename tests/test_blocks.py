"""``chunk_size``: kernels assembled from blocks of examples equal the kernel computed at once, on the
run device (``pytest --device``)."""

from __future__ import annotations

import pytest
import torch

import torchntk
from tests.cases import to_device
from torchntk.testing import assert_kernels_close, reference_ntk


def two_headed(params, x):
    """Outputs (N, 2, 3) with the batch first and (3, N) with the batch last."""
    hidden = torch.tanh(x @ params["w"])
    return (hidden @ params["a"]).reshape(-1, 2, 3), (hidden @ params["b"]).T


# Drawn on the CPU, then moved to the run device (``pytest --device``).
PARAMS = to_device({
    "w": torch.randn(4, 5, dtype=torch.float64),
    "a": torch.randn(5, 6, dtype=torch.float64),
    "b": torch.randn(5, 3, dtype=torch.float64),
})
VMAP_AXES = (0, (0, 1), {})
X1, X2 = to_device((torch.randn(7, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)))


@pytest.mark.parametrize("implementation", [1, 2, 3], ids=["JC", "NVP", "SD"])
@pytest.mark.parametrize("chunk_size", [1, 2, 3, 5, 100])
@pytest.mark.parametrize(
    "trace_axes, diagonal_axes, same",
    [((), (), False), ((), (), True), ((-1,), (), True), ((), (0,), True), ((0,), (), True), ((1,), (0,), True)],
    ids=["full", "full-x2=None", "traced-x2=None", "diag0", "trace0", "trace1-diag0"],
)
def test_chunked_kernels_equal_the_brute_force(implementation, chunk_size, trace_axes, diagonal_axes, same):
    second = None if same else X2
    ntk_fn = torchntk.empirical_ntk_fn(
        two_headed, trace_axes, diagonal_axes, VMAP_AXES, implementation, chunk_size=chunk_size
    )
    expected = reference_ntk(two_headed, X1, second, PARAMS, trace_axes=trace_axes, diagonal_axes=diagonal_axes)
    assert_kernels_close(ntk_fn(X1, second, PARAMS), expected)


@pytest.mark.parametrize("implementation", [1, 2, 3], ids=["JC", "NVP", "SD"])
def test_chunk_size_without_vmap_axes_bounds_vectors_not_examples(implementation):
    ntk_fn = torchntk.empirical_ntk_fn(two_headed, (), (), None, implementation, chunk_size=4)
    assert_kernels_close(ntk_fn(X1, X2, PARAMS), reference_ntk(two_headed, X1, X2, PARAMS, trace_axes=()))


def test_chunked_kernel_fn_returns_both_kernels():
    kernel_fn = torchntk.empirical_kernel_fn(two_headed, (), (), VMAP_AXES, chunk_size=2)
    both = kernel_fn(X1, X2, ("ntk", "nngp"), PARAMS)
    expected = reference_ntk(two_headed, X1, X2, PARAMS, trace_axes=())
    assert_kernels_close(tuple(leaf.ntk for leaf in both), expected)


@pytest.mark.parametrize(
    "trace_axes, diagonal_axes, same",
    [((), (), False), ((), (), True), ((-1,), (), True), ((), (0,), True), ((0,), (), True)],
    ids=["full", "full-x2=None", "traced-x2=None", "diag0", "trace0"],
)
def test_ntk_vector_products_default_runs(monkeypatch, trace_axes, diagonal_axes, same):
    """With a tiny byte budget every x2 example is its own run (see NOTE: [Run lengths ...])."""
    from torchntk._implementations import ntk_vector_products

    monkeypatch.setattr(ntk_vector_products, "_RUN_BYTES", 1)
    monkeypatch.setattr(ntk_vector_products, "TANGENTS_PER_PASS", 3)
    second = None if same else X2
    ntk_fn = torchntk.empirical_ntk_fn(two_headed, trace_axes, diagonal_axes, VMAP_AXES, 2)
    expected = reference_ntk(two_headed, X1, second, PARAMS, trace_axes=trace_axes, diagonal_axes=diagonal_axes)
    assert_kernels_close(ntk_fn(X1, second, PARAMS), expected)
