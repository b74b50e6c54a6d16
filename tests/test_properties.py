"""Hypothesis property tests on random small MLPs and inputs, on the run device (``pytest --device``):
the numbers are drawn on the CPU and moved there."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import torchntk
from tests.cases import DEVICE, to_device
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_nngp, reference_ntk

SETTINGS = settings(max_examples=25, deadline=None)


@st.composite
def problems(draw):
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    width, outputs, features = draw(st.integers(1, 6)), draw(st.integers(1, 4)), draw(st.integers(1, 4))
    n1, n2 = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    model = torch.nn.Sequential(
        torch.nn.Linear(features, width), torch.nn.Tanh(), torch.nn.Linear(width, outputs)
    ).double().to(DEVICE)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64))
    x1 = to_device(torch.randn(n1, features, generator=generator, dtype=torch.float64))
    x2 = to_device(torch.randn(n2, features, generator=generator, dtype=torch.float64))
    implementation = draw(st.sampled_from([1, 2, 3]))
    vmap_axes = draw(st.sampled_from([None, 0]))
    return model, x1, x2, implementation, vmap_axes


@SETTINGS
@given(problems())
def test_kernel_of_x_with_itself_is_symmetric_and_psd(problem):
    model, x1, _, implementation, vmap_axes = problem
    for fn in (
        torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=implementation),
        torchntk.empirical_nngp_fn(model, trace_axes=()),
    ):
        kernel = fn(x1)  # (N, N, O, O)
        n, outputs = kernel.shape[0], kernel.shape[2]
        matrix = kernel.permute(0, 2, 1, 3).reshape(n * outputs, n * outputs)
        assert_kernels_close(matrix, matrix.T)
        smallest = torch.linalg.eigvalsh(matrix).min()
        assert smallest >= -1e-10 * max(1.0, matrix.abs().max().item())


@SETTINGS
@given(problems())
def test_x2_none_equals_x2_is_x1(problem):
    model, x1, _, implementation, vmap_axes = problem
    for trace_axes, diagonal_axes in [((-1,), ()), ((), ()), ((-1,), (0,)), ((), (0,))]:
        fn = torchntk.empirical_ntk_fn(model, trace_axes, diagonal_axes, vmap_axes, implementation)
        assert_kernels_close(fn(x1, None), fn(x1, x1.clone()))


@SETTINGS
@given(problems())
def test_trace_of_full_kernel_is_the_traced_kernel(problem):
    model, x1, x2, implementation, vmap_axes = problem
    full = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=implementation)(x1, x2)
    traced = torchntk.empirical_ntk_fn(model, trace_axes=(-1,), vmap_axes=vmap_axes, implementation=implementation)(x1, x2)
    assert_kernels_close(traced, torch.diagonal(full, dim1=2, dim2=3).mean(-1))
    diagonal = torchntk.empirical_ntk_fn(model, trace_axes=(), diagonal_axes=(0,), vmap_axes=vmap_axes)(x1)
    full_same = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes)(x1)
    assert_kernels_close(diagonal, torch.diagonal(full_same, dim1=0, dim2=1).permute(2, 0, 1))


@SETTINGS
@given(problems())
def test_vmap_axes_and_implementations_agree(problem):
    model, x1, x2, _, _ = problem
    kernels = [
        torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=implementation)(x1, x2)
        for implementation in (1, 2, 3)
        for vmap_axes in (None, 0)
    ]
    for kernel in kernels[1:]:
        assert_kernels_close(kernel, kernels[0])


@SETTINGS
@given(problems(), st.integers(1, 5))
def test_chunked_equals_unchunked(problem, chunk_size):
    model, x1, x2, implementation, _ = problem
    for trace_axes, diagonal_axes, second in [((), (), x2), ((-1,), (), None), ((), (0,), None), ((0,), (), None)]:
        plain = torchntk.empirical_ntk_fn(model, trace_axes, diagonal_axes, 0, implementation)
        chunked = torchntk.empirical_ntk_fn(model, trace_axes, diagonal_axes, 0, implementation, chunk_size=chunk_size)
        assert_kernels_close(chunked(x1, second), plain(x1, second))


@SETTINGS
@given(problems())
def test_ntk_vp_is_kernel_times_vector(problem):
    model, x1, x2, _, _ = problem
    vector = to_device(torch.randn(x2.shape[0], model[-1].out_features, dtype=torch.float64))
    full = torchntk.empirical_ntk_fn(model, trace_axes=())(x1, x2)
    product = torchntk.empirical_ntk_vp_fn(model, x1, x2)(vector)
    assert_kernels_close(product, torch.einsum("nmab,mb->na", full, vector))


@SETTINGS
@given(problems(), st.floats(-0.5, 0.5))
def test_linearize_and_taylor_expand_match_their_definitions(problem, step):
    model, x1, _, _, _ = problem
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    direction = to_device({name: torch.randn(p.shape, dtype=p.dtype) for name, p in params.items()})
    moved = {name: p + step * direction[name] for name, p in params.items()}
    f = lambda p, x: torch.func.functional_call(model, p, (x,))  # noqa: E731
    g = lambda t: f({k: params[k] + t * direction[k] for k in params}, x1)  # noqa: E731
    zero = torch.zeros((), dtype=torch.float64, device=DEVICE)
    value, slope = torch.func.jvp(g, (zero,), (torch.ones_like(zero),))
    curvature = torch.func.jvp(lambda t: torch.func.jvp(g, (t,), (torch.ones_like(t),))[1], (zero,), (torch.ones_like(zero),))[1]
    assert_kernels_close(torchntk.linearize(f, params)(moved, x1), value + step * slope)
    assert_kernels_close(torchntk.linearize(model)(moved, x1), value + step * slope)
    assert_kernels_close(torchntk.taylor_expand(f, params, 1)(moved, x1), value + step * slope)
    second = torchntk.taylor_expand(f, params, degree=2)(moved, x1)
    assert_kernels_close(second, value + step * slope + step**2 / 2 * curvature)
    assert_kernels_close(torchntk.taylor_expand(model, degree=0)(moved, x1), model(x1))


def test_high_degree_taylor_expansion_of_a_polynomial_is_exact():
    f = lambda p, x: p["a"] ** 3 * x + p["a"] * p["b"] ** 2  # noqa: E731
    params = to_device({"a": torch.tensor(0.7, dtype=torch.float64), "b": torch.tensor(-0.3, dtype=torch.float64)})
    moved = to_device({"a": torch.tensor(1.9, dtype=torch.float64), "b": torch.tensor(0.4, dtype=torch.float64)})
    x = to_device(torch.tensor([1.0, 2.0], dtype=torch.float64))
    for degree in (3, 4):
        assert_kernels_close(torchntk.taylor_expand(f, params, degree)(moved, x), f(moved, x))
    assert not torch.allclose(torchntk.taylor_expand(f, params, 2)(moved, x), f(moved, x))
    assert math.isclose(torchntk.taylor_expand(f, params, 0)(moved, x)[0].item(), f(params, x)[0].item())


def _ntk_builders(model, x1, x2, implementation, vmap_axes):
    """``(name, compute)`` of each public NTK builder's full (trace_axes=()) kernel of ``model`` on
    (x1, x2); ``ntk_vp`` is the product with a vector of ones."""
    vector = torch.ones(x2.shape[0], _outputs(model), dtype=torch.float64, device=DEVICE)
    builders = [
        ("ntk", lambda: torchntk.empirical_ntk_fn(model, (), vmap_axes=vmap_axes, implementation=implementation)(x1, x2)),
        ("kernel", lambda: torchntk.empirical_kernel_fn(model, (), vmap_axes=vmap_axes, implementation=implementation)(
            x1, x2, get="ntk"
        )),
        ("ntk_vp", lambda: torchntk.empirical_ntk_vp_fn(model, x1, x2)(vector)),
    ]
    if vmap_axes is not None:
        ntk_fn = torchntk.empirical_ntk_fn(model, (), vmap_axes=0, implementation=implementation)
        builders.append(("batch", lambda: torchntk.batch(ntk_fn, 1)(x1, x2)))
    return builders


def _outputs(model) -> int:
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1].out_features


@SETTINGS
@given(problems())
def test_builders_compute_a_compiled_module_on_the_module_it_wraps(problem):
    model, x1, x2, implementation, vmap_axes = problem
    compiled = torch.compile(model, backend="eager")
    snapshot = ModuleSnapshot.of(model)
    full = reference_ntk(model, x1, x2, trace_axes=())
    vector = torch.ones(x2.shape[0], _outputs(model), dtype=torch.float64, device=DEVICE)
    for name, compute in _ntk_builders(compiled, x1, x2, implementation, vmap_axes):
        expected = torch.einsum("nmab,mb->na", full, vector) if name == "ntk_vp" else full
        assert_kernels_close(compute(), expected)
    assert_kernels_close(torchntk.empirical_nngp_fn(compiled, ())(x1, x2), reference_nngp(model, x1, x2, trace_axes=()))
    snapshot.assert_unchanged()


class _LastWeightAliased(torch.nn.Module):
    """``net`` with its last layer's weight read through ``holder`` instead of its registered name."""

    def __init__(self, net: torch.nn.Sequential, holder: str):
        super().__init__()
        self.net, self.holder = net, holder
        weight = net[-1].weight
        self.read = {
            "list": (lambda store: lambda: store[0])([weight]),
            "dict": (lambda store: lambda: store["w"])({"w": weight}),
            "closure": lambda: weight,
        }[holder]

    def forward(self, x):
        return torch.nn.functional.linear(self.net[:-1](x), self.read(), self.net[-1].bias)


@SETTINGS
@given(problems(), st.sampled_from(["list", "dict", "closure"]), st.booleans())
def test_builders_refuse_parameters_read_around_their_names(problem, holder, frozen):
    model, x1, x2, implementation, vmap_axes = problem
    model[-1].weight.requires_grad_(not frozen)
    aliased = _LastWeightAliased(model, holder)
    assert_kernels_close(torchntk.empirical_nngp_fn(aliased, ())(x1, x2), reference_nngp(model, x1, x2, trace_axes=()))
    if frozen:  # the module's own value of a constant is the right one
        full = reference_ntk(model, x1, x2, trace_axes=())
        vector = torch.ones(x2.shape[0], _outputs(model), dtype=torch.float64, device=DEVICE)
        for name, compute in _ntk_builders(aliased, x1, x2, implementation, vmap_axes):
            assert_kernels_close(compute(), torch.einsum("nmab,mb->na", full, vector) if name == "ntk_vp" else full)
        return
    for _, compute in _ntk_builders(aliased, x1, x2, implementation, vmap_axes):
        with pytest.raises(ValueError, match=r"reads parameter 'net.2.weight'"):
            compute()
