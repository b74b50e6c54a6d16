"""Unit tests of KernelLayout: positions, the swap permutation and the symmetric product, with tensors
on the run device (``pytest --device``)."""

from __future__ import annotations

import pytest
import torch

from tests.cases import to_device
from torchntk._layout.kernel_layout import make_layout
from torchntk.testing import assert_kernels_close


def layout(ndim, trace=(), diagonal=()):
    return make_layout(ndim, tuple(trace), tuple(diagonal), "test", "the output")


def test_positions_and_shape():
    lay = layout(4, trace=(1,), diagonal=(2,))
    assert lay.kernel_shape((3, 5, 6, 7), (2, 5, 6, 8)) == (3, 2, 6, 7, 8)
    assert [lay.kernel_positions(axis) for axis in range(4)] == [(0, 1), (), (2,), (3, 4)]
    assert lay.trace_size((3, 5, 6, 7)) == 5
    assert lay.swap_permutation() == (1, 0, 2, 4, 3)


@pytest.mark.parametrize("rows", [7, 300, 1000])
def test_symmetric_product_equals_plain_product(rows):
    jacobian = to_device(torch.randn(rows // 10 + 1, 10, 33, dtype=torch.float64))
    lay = layout(2)
    plain = lay.contract(jacobian, jacobian.clone())
    assert_kernels_close(lay.contract(jacobian, jacobian), plain)
    diagonal = layout(2, diagonal=(1,))
    assert_kernels_close(diagonal.contract(jacobian, jacobian), diagonal.contract(jacobian, jacobian.clone()))


def test_contract_matches_einsum_for_every_kind_of_axis():
    first = to_device(torch.randn(3, 4, 5, 6, dtype=torch.float64))
    second = to_device(torch.randn(2, 4, 5, 6, dtype=torch.float64))
    lay = layout(3, trace=(1,), diagonal=(2,))
    expected = torch.einsum("aceP,bceP->abe", first, second)
    assert_kernels_close(lay.contract(first, second), expected)
    full = to_device(torch.randn(3, 4, 5, 2, 4, 5, dtype=torch.float64))
    expected = torch.zeros(3, 2, 5, dtype=torch.float64, device=full.device)
    for a in range(3):
        for b in range(2):
            for e in range(5):
                expected[a, b, e] = sum(full[a, c, e, b, c, e] for c in range(4))
    assert_kernels_close(lay.from_full(full), expected)
