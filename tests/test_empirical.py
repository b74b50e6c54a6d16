"""Every kernel function against the independent float64 brute force of ``torchntk.testing``, on the run device."""

from __future__ import annotations

import functools

import pytest
import torch

import torchntk
from tests.cases import CASES, make_x1_x2, to_device
from torchntk.testing import (
    ModuleSnapshot,
    assert_kernels_close,
    reference_nngp,
    reference_ntk,
    reference_ntk_vp,
)

IMPLEMENTATIONS = [1, 2, 3]
VMAP_AXES = [None, 0]


@functools.lru_cache(maxsize=None)
def _case(case_id: str):
    case = CASES[case_id]()
    return case, make_x1_x2(case)


@functools.lru_cache(maxsize=None)
def _reference(case_id: str, kind: str, same: bool, trace_axes: tuple, diagonal_axes: tuple = ()):
    case, (x1, x2) = _case(case_id)
    reference = reference_ntk if kind == "ntk" else reference_nngp
    return reference(case.module, x1, None if same else x2, trace_axes=trace_axes, diagonal_axes=diagonal_axes)


@pytest.mark.parametrize("same", [False, True], ids=["x2", "x2=None"])
@pytest.mark.parametrize("vmap_axes", VMAP_AXES, ids=["no-vmap", "vmap0"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=["JC", "NVP", "SD"])
@pytest.mark.parametrize("case_id", sorted(CASES))
def test_ntk_matches_brute_force(case_id, implementation, vmap_axes, same):
    case, (x1, x2) = _case(case_id)
    ntk_fn = torchntk.empirical_ntk_fn(
        case.module, trace_axes=case.trace_axes, vmap_axes=vmap_axes, implementation=implementation
    )
    snapshot = ModuleSnapshot.of(case.module)
    actual = ntk_fn(x1, None if same else x2)
    assert_kernels_close(actual, _reference(case_id, "ntk", same, case.trace_axes))
    snapshot.assert_unchanged()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=["JC", "NVP", "SD"])
@pytest.mark.parametrize("case_id", ["mlp", "cnn", "tuple_output", "embedding"])
def test_full_kernel_matches_brute_force(case_id, implementation):
    case, (x1, x2) = _case(case_id)
    actual = torchntk.empirical_ntk_fn(case.module, trace_axes=(), vmap_axes=0, implementation=implementation)(x1, x2)
    assert_kernels_close(actual, _reference(case_id, "ntk", False, ()))


@pytest.mark.parametrize("same", [False, True], ids=["x2", "x2=None"])
@pytest.mark.parametrize("case_id", sorted(CASES))
def test_nngp_matches_brute_force(case_id, same):
    case, (x1, x2) = _case(case_id)
    actual = torchntk.empirical_nngp_fn(case.module, trace_axes=case.trace_axes)(x1, None if same else x2)
    assert_kernels_close(actual, _reference(case_id, "nngp", same, case.trace_axes))


def test_kernel_fn_get_forms():
    case, (x1, x2) = _case("mlp")
    kernel_fn = torchntk.empirical_kernel_fn(case.module, vmap_axes=0)
    ntk = _reference("mlp", "ntk", False, (-1,))
    nngp = _reference("mlp", "nngp", False, (-1,))
    both = kernel_fn(x1, x2, ("ntk", "nngp"))
    assert type(both).__name__ == "EmpiricalKernel" and both._fields == ("ntk", "nngp")
    assert_kernels_close(both.ntk, ntk)
    assert_kernels_close(both.nngp, nngp)
    default = kernel_fn(x1, x2)
    assert default._fields == ("nngp", "ntk")
    assert_kernels_close(kernel_fn(x1, x2, "NTK"), ntk)
    assert kernel_fn(x1, x2, ["nngp"])._fields == ("nngp",)
    assert_kernels_close(kernel_fn(x1, x2, get="nngp"), nngp)


@pytest.mark.parametrize("case_id", ["tuple_output", "dict_output"])
def test_kernel_fn_pytree_outputs_hold_one_namedtuple_per_leaf(case_id):
    case, (x1, x2) = _case(case_id)
    result = torchntk.empirical_kernel_fn(case.module, vmap_axes=0)(x1, x2, ("ntk", "nngp"))
    ntk = _reference(case_id, "ntk", False, (-1,))
    nngp = _reference(case_id, "nngp", False, (-1,))
    keys = range(len(ntk)) if isinstance(ntk, tuple) else ntk.keys()
    assert type(result) is type(ntk)
    for key in keys:
        assert_kernels_close(result[key].ntk, ntk[key])
        assert_kernels_close(result[key].nngp, nngp[key])


@pytest.mark.parametrize("same", [False, True], ids=["x2", "x2=None"])
@pytest.mark.parametrize("case_id", ["mlp", "cnn", "tuple_output", "dict_input", "embedding"])
def test_ntk_vp_matches_brute_force(case_id, same):
    case, (x1, x2) = _case(case_id)
    second = x1 if same else x2
    cotangents = torch.utils._pytree.tree_map(lambda out: torch.randn_like(out), case.module(second))
    actual = torchntk.empirical_ntk_vp_fn(case.module, x1, None if same else x2)(cotangents)
    expected = reference_ntk_vp(case.module, x1, second, None, cotangents)
    assert_kernels_close(actual, expected)


def test_functional_form_equals_module_form():
    case, (x1, x2) = _case("cnn")
    module = case.module
    params = {name: p.detach() for name, p in module.named_parameters()}
    f = lambda p, x: torch.func.functional_call(module, p, (x,))  # noqa: E731
    for implementation in IMPLEMENTATIONS:
        functional = torchntk.empirical_ntk_fn(f, trace_axes=(1,), vmap_axes=0, implementation=implementation)
        assert_kernels_close(functional(x1, x2, params), _reference("cnn", "ntk", False, (1,)))


def test_kwargs_reach_the_model_and_two_tuples_are_split():
    """``scale`` is a per-example kwarg given separately for x1 and x2; ``shift`` is shared."""

    def f(params, x, scale=1.0, shift=None):
        out = torch.tanh(x @ params["w"].T) * scale
        return out if shift is None else out + shift

    params = to_device({"w": torch.randn(3, 4, dtype=torch.float64)})
    x1, x2 = to_device((torch.randn(5, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)))
    scale1, scale2 = to_device((torch.rand(5, 1, dtype=torch.float64), torch.rand(2, 1, dtype=torch.float64)))
    jacobian1 = torch.func.jacrev(lambda p: f(p, x1, scale1))(params)["w"].reshape(5, 3, -1)
    jacobian2 = torch.func.jacrev(lambda p: f(p, x2, scale2))(params)["w"].reshape(2, 3, -1)
    expected = torch.einsum("nap,map->nm", jacobian1, jacobian2) / 3
    for implementation in IMPLEMENTATIONS:
        for vmap_axes in (None, (0, 0, {"scale": 0})):
            ntk_fn = torchntk.empirical_ntk_fn(f, implementation=implementation, vmap_axes=vmap_axes)
            assert_kernels_close(ntk_fn(x1, x2, params, scale=(scale1, scale2), shift=0.5), expected)


def test_restricting_params_to_the_last_layer():
    case, (x1, x2) = _case("mlp")
    last_layer = list(dict(case.module.named_children()))[-1]
    last = {name: p for name, p in case.module.named_parameters() if name.startswith(last_layer + ".")}
    assert last
    expected = reference_ntk(case.module, x1, x2, params=last)
    for implementation in IMPLEMENTATIONS:
        actual = torchntk.empirical_ntk_fn(case.module, vmap_axes=0, implementation=implementation)(x1, x2, last)
        assert_kernels_close(actual, expected)


def test_params_override_values():
    case, (x1, x2) = _case("mlp")
    moved = {name: p.detach() + 0.1 for name, p in case.module.named_parameters()}
    expected = reference_ntk(case.module, x1, x2, params=moved)
    actual = torchntk.empirical_ntk_fn(case.module, vmap_axes=0)(x1, x2, moved)
    assert_kernels_close(actual, expected)
    assert not torch.allclose(actual, _reference("mlp", "ntk", False, (-1,)))
