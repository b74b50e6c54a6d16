"""The shape table of the specification (§17, adapted to NCHW), for every implementation.

Each row is checked for shape against the hand-adapted table in ``test_testing.py`` and for
values against the float64 brute force, with and without ``vmap_axes``. Models and inputs live on
the run device (``pytest --device``), inputs drawn on the CPU and moved there.
"""

from __future__ import annotations

import functools

import pytest
import torch

import torchntk
from tests.cases import CASES, to_device
from tests.test_testing import SHAPE_TABLE, _randn
from torchntk.testing import assert_kernels_close, reference_nngp, reference_ntk


def _conv_inputs():
    """``test_testing.py``'s convolution inputs, on the run device."""
    return to_device((_randn(3, 2, 5, 6, seed=7), _randn(2, 2, 5, 6, seed=8)))


@pytest.fixture
def conv_setup():
    return CASES["cnn"]().module, *_conv_inputs()


@functools.lru_cache(maxsize=None)
def _expected(kind: str, trace_axes, diagonal_axes, x2_kind):
    module = CASES["cnn"]().module
    x1, x2 = _conv_inputs()
    reference = reference_ntk if kind == "ntk" else reference_nngp
    return reference(module, x1, None if x2_kind == "same" else x2, trace_axes=trace_axes, diagonal_axes=diagonal_axes)


@pytest.mark.parametrize("vmap_axes", [None, 0], ids=["no-vmap", "vmap0"])
@pytest.mark.parametrize("implementation", [1, 2], ids=["JC", "NVP"])
@pytest.mark.parametrize("trace_axes, diagonal_axes, x2_kind, shape", SHAPE_TABLE, ids=str)
def test_ntk_shape_table(conv_setup, trace_axes, diagonal_axes, x2_kind, shape, implementation, vmap_axes):
    module, x1, x2 = conv_setup
    ntk_fn = torchntk.empirical_ntk_fn(
        module, trace_axes=trace_axes, diagonal_axes=diagonal_axes, vmap_axes=vmap_axes, implementation=implementation
    )
    kernel = ntk_fn(x1, None if x2_kind == "same" else x2)
    assert tuple(kernel.shape) == shape
    assert_kernels_close(kernel, _expected("ntk", trace_axes, diagonal_axes, x2_kind))


@pytest.mark.parametrize("trace_axes, diagonal_axes, x2_kind, shape", SHAPE_TABLE, ids=str)
def test_nngp_and_kernel_fn_shape_table(conv_setup, trace_axes, diagonal_axes, x2_kind, shape):
    module, x1, x2 = conv_setup
    second = None if x2_kind == "same" else x2
    nngp = torchntk.empirical_nngp_fn(module, trace_axes=trace_axes, diagonal_axes=diagonal_axes)(x1, second)
    assert tuple(nngp.shape) == shape
    assert_kernels_close(nngp, _expected("nngp", trace_axes, diagonal_axes, x2_kind))
    both = torchntk.empirical_kernel_fn(module, trace_axes=trace_axes, diagonal_axes=diagonal_axes, vmap_axes=0)(x1, second)
    assert tuple(both.ntk.shape) == tuple(both.nngp.shape) == shape


@pytest.mark.parametrize("implementation", [1, 2], ids=["JC", "NVP"])
@pytest.mark.parametrize(
    "vmap_axes",
    [None, 0, ({"u": 0, "v": 0}, (0, 0), {}), ({"v": 0, "u": -2}, 0, None)],
    ids=["none", "int", "triple", "dict-reordered"],
)
def test_pytree_input_and_output_shapes(implementation, vmap_axes):
    """Spec §17 pytree case: dict input, tuple output of (N, 5) and (N, 2, 3)."""

    def f(params, x):
        hidden = torch.tanh(x["u"] @ params["wu"] + x["v"] @ params["wv"])
        return hidden[:, :5], (hidden[:, 5:11] @ params["out"]).reshape(-1, 2, 3)

    generator = torch.Generator().manual_seed(3)
    params = to_device({
        "wu": torch.randn(4, 11, generator=generator, dtype=torch.float64),
        "wv": torch.randn(2, 11, generator=generator, dtype=torch.float64),
        "out": torch.randn(6, 6, generator=generator, dtype=torch.float64),
    })
    x1 = to_device({"u": torch.randn(3, 4, dtype=torch.float64), "v": torch.randn(3, 2, dtype=torch.float64)})
    x2 = to_device({"u": torch.randn(2, 4, dtype=torch.float64), "v": torch.randn(2, 2, dtype=torch.float64)})
    kernels = torchntk.empirical_ntk_fn(f, vmap_axes=vmap_axes, implementation=implementation)(x1, x2, params)
    assert isinstance(kernels, tuple)
    assert [tuple(k.shape) for k in kernels] == [(3, 2), (3, 2, 2, 2)]
    assert_kernels_close(kernels, reference_ntk(f, x1, x2, params))


def test_pytree_vmap_axes_that_do_not_fit_raise():
    f = lambda p, x: x["u"] @ p  # noqa: E731
    x = to_device({"u": torch.randn(3, 4)})
    with pytest.raises(ValueError, match="vmap_axes"):
        torchntk.empirical_ntk_fn(f, vmap_axes=(0, 0))(x, None, to_device(torch.randn(4, 2)))


@pytest.mark.parametrize("implementation", [1, 2], ids=["JC", "NVP"])
def test_batch_last_layout(implementation):
    """x of shape (4, N) and output (3, N): batch axis last, via the (in, out, kwargs) triple."""
    generator = torch.Generator().manual_seed(5)
    weight = to_device(torch.randn(3, 4, generator=generator, dtype=torch.float64))
    f = lambda p, x: torch.sin(p @ x)  # noqa: E731
    x1, x2 = to_device((torch.randn(4, 5, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)))
    expected = reference_ntk(f, x1, x2, weight, trace_axes=())
    for vmap_axes in [None, (1, 1, {}), (1, -1, {}), (-1, -1, {})]:
        ntk_fn = torchntk.empirical_ntk_fn(f, trace_axes=(), vmap_axes=vmap_axes, implementation=implementation)
        kernel = ntk_fn(x1, x2, weight)
        assert kernel.shape == (3, 3, 5, 2)
        assert_kernels_close(kernel, expected)
