"""Tests that make the float64 reference kernels in torchntk.testing trustworthy on their own.

Every expected value here comes from somewhere other than the reference's own einsum: closed
forms (a linear model), explicit loops over output indices, Jacobians known by construction
(functions linear in their parameters), or hand-written functional versions of a module.
"""

from __future__ import annotations

import ast
import copy
import itertools
import math
import pathlib

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import torchntk.testing
from tests.cases import CASES, N1, N2, make_x1_x2
from torchntk.testing import (
    assert_kernels_close,
    reference_nngp,
    reference_ntk,
    reference_ntk_vp,
)

pytestmark = pytest.mark.cpu_only("checks torchntk.testing's float64 reference itself, against closed forms on the CPU")

F64 = torch.float64


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# ---------------------------------------------------------------------------------------------
# (a) Linear model: closed forms
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def linear_setup():
    """A float32 Linear(4, 3) (the reference must cast it) and float32 inputs."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x1, x2 = torch.randn(N1, 4), torch.randn(N2, 4)
    return model, x1, x2


def test_linear_ntk_full_layout_is_closed_form(linear_setup):
    model, x1, x2 = linear_setup
    # ∂f[n,o]/∂W[o',i] = δ_oo' x[n,i] and ∂f[n,o]/∂b[o'] = δ_oo', so K = (x1·x2 + 1) ⊗ I.
    dots = x1.double() @ x2.double().T + 1
    expected = dots[:, :, None, None] * torch.eye(3, dtype=F64)
    ntk = reference_ntk(model, x1, x2, trace_axes=())
    assert ntk.dtype == F64 and ntk.shape == (N1, N2, 3, 3)
    assert_kernels_close(ntk, expected)


def test_linear_ntk_trace_and_diagonal_are_closed_form(linear_setup):
    model, x1, x2 = linear_setup
    dots = x1.double() @ x2.double().T + 1
    assert_kernels_close(reference_ntk(model, x1, x2), dots)  # mean over 3 identical blocks
    diagonal = reference_ntk(model, x1, x2, trace_axes=(), diagonal_axes=(-1,))
    assert_kernels_close(diagonal, dots[:, :, None].expand(N1, N2, 3))


def test_linear_nngp_matches_outer_products(linear_setup):
    model, x1, x2 = linear_setup
    weight, bias = model.weight.detach().double(), model.bias.detach().double()
    f1, f2 = x1.double() @ weight.T + bias, x2.double() @ weight.T + bias
    assert_kernels_close(reference_nngp(model, x1, x2), f1 @ f2.T / 3)
    full = reference_nngp(model, x1, x2, trace_axes=())
    assert_kernels_close(full, f1[:, None, :, None] * f2[None, :, None, :])
    diagonal = reference_nngp(model, x1, x2, trace_axes=(), diagonal_axes=1)
    assert_kernels_close(diagonal, f1[:, None, :] * f2[None, :, :])


def test_x2_none_equals_x2_is_x1(linear_setup):
    model, x1, _ = linear_setup
    assert_kernels_close(reference_ntk(model, x1, None), reference_ntk(model, x1, x1.clone()))
    assert_kernels_close(reference_nngp(model, x1), reference_nngp(model, x1, x1.clone()))
    assert_kernels_close(reference_ntk(model, x1, [None, (None,)]), reference_ntk(model, x1))


def test_user_module_is_untouched(linear_setup):
    model, x1, x2 = linear_setup
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    reference_ntk(model, x1, x2)
    reference_nngp(model, x1, x2, params={"weight": torch.zeros(3, 4)})
    for name, parameter in model.named_parameters():
        assert parameter.dtype == torch.float32 and parameter.requires_grad
        assert torch.equal(parameter, before[name])


# ---------------------------------------------------------------------------------------------
# (b) Trace and diagonal axes against an explicit double loop over output indices
# ---------------------------------------------------------------------------------------------


def _as_list(axes):
    return [axes] if isinstance(axes, int) else list(axes)


def _loop_kernel(a1, a2, trace_axes, diagonal_axes):
    """Kernel by brute force: every pair of output indices, written straight from the spec.

    ``a1: (*s1, P)``, ``a2: (*s2, P)``; the last axis is summed (θ for the NTK, size 1 for NNGP).
    """
    ndim = a1.ndim - 1
    traced = {axis % ndim for axis in _as_list(trace_axes)}
    diagonal = {axis % ndim for axis in _as_list(diagonal_axes)}
    shape = []
    for axis in range(ndim):
        if axis in diagonal:
            shape.append(a1.shape[axis])
        elif axis not in traced:
            shape += [a1.shape[axis], a2.shape[axis]]
    kernel = torch.zeros(shape, dtype=F64)
    for index1 in itertools.product(*(range(s) for s in a1.shape[:-1])):
        for index2 in itertools.product(*(range(s) for s in a2.shape[:-1])):
            if any(index1[axis] != index2[axis] for axis in traced | diagonal):
                continue
            position = []
            for axis in range(ndim):
                if axis in diagonal:
                    position.append(index1[axis])
                elif axis not in traced:
                    position += [index1[axis], index2[axis]]
            kernel[tuple(position)] += torch.dot(a1[index1], a2[index2])
    return kernel / math.prod(a1.shape[axis] for axis in traced)


def _linear_in_theta(theta, x):
    """f(θ, x)[n,a,b] = Σ_p x[n,a,b,p] θ[p], so the Jacobian is x itself."""
    return torch.einsum("nabp,p->nab", x, theta)


def _nonlinear(theta, x):
    return torch.tanh(_linear_in_theta(theta, x))


# (trace_axes, diagonal_axes, x2 shape); output is (N, A, B) with x1 of shape (3, 2, 4, P).
AXES_CASES = [
    ((), (), (2, 3, 4)),
    ((-1,), (), (2, 3, 4)),
    (-1, (), (2, 2, 4)),
    ((1,), (), (2, 2, 5)),
    ((), (0,), (3, 3, 4)),
    ((-1,), (0,), (3, 2, 4)),
    ((0, 2), (), (3, 3, 4)),
    ((2, 0), (1,), (3, 2, 4)),
    ((), (0, 1, 2), (3, 2, 4)),
    ((0, 1, 2), (), (3, 2, 4)),
    ((-2,), (-1, -3), (3, 2, 4)),
    ((1,), 2, (2, 2, 4)),
    ((2, -1), (), (2, 3, 4)),  # duplicate axis: averaged once, not divided by B**2
]


@pytest.mark.parametrize("trace_axes, diagonal_axes, x2_shape", AXES_CASES, ids=str)
def test_ntk_matches_double_loop(trace_axes, diagonal_axes, x2_shape):
    x1, x2 = _randn(3, 2, 4, 5, seed=1), _randn(*x2_shape, 5, seed=2)
    theta = _randn(5, seed=3)
    ntk = reference_ntk(_linear_in_theta, x1, x2, theta, trace_axes, diagonal_axes)
    assert_kernels_close(ntk, _loop_kernel(x1, x2, trace_axes, diagonal_axes))


@pytest.mark.parametrize("trace_axes, diagonal_axes, x2_shape", AXES_CASES, ids=str)
def test_nngp_matches_double_loop(trace_axes, diagonal_axes, x2_shape):
    x1, x2 = _randn(3, 2, 4, 5, seed=1), _randn(*x2_shape, 5, seed=2)
    theta = _randn(5, seed=3)
    f1, f2 = _nonlinear(theta, x1)[..., None], _nonlinear(theta, x2)[..., None]
    nngp = reference_nngp(_nonlinear, x1, x2, theta, trace_axes, diagonal_axes)
    assert_kernels_close(nngp, _loop_kernel(f1, f2, trace_axes, diagonal_axes))


def test_nonlinear_ntk_matches_double_loop_on_analytic_jacobian():
    # ∂ tanh(x·θ)/∂θ = (1 - tanh²(x·θ)) x: a Jacobian the reference never sees.
    x1, x2 = _randn(3, 2, 4, 5, seed=4), _randn(2, 2, 4, 5, seed=5)
    theta = _randn(5, seed=6)

    def jacobian(x):
        return (1 - _nonlinear(theta, x) ** 2)[..., None] * x

    ntk = reference_ntk(_nonlinear, x1, x2, theta, (-1,), (1,))
    assert_kernels_close(ntk, _loop_kernel(jacobian(x1), jacobian(x2), (-1,), (1,)))


# ---------------------------------------------------------------------------------------------
# (c) Shape table of spec §17, re-mapped from NT's (N, H, W, C) to our (N, C, H, W)
# ---------------------------------------------------------------------------------------------

# NT axes -> ours: 0 -> 0, H 1 -> 2, W 2 -> 3, C 3/-1 -> 1 (or -3), W -2 -> 3 (or -1).
# f(x1): (3, 3, 5, 6), f(x2): (2, 3, 5, 6); "same" means x2 = None.
SHAPE_TABLE = [
    # ours trace, ours diagonal, x2, expected shape       NT row (trace; diag) -> NT shape
    ((), (), "other", (3, 2, 3, 3, 5, 5, 6, 6)),  # (); () -> (3,2,5,5,6,6,3,3)
    ((-3,), (), "other", (3, 2, 5, 5, 6, 6)),  # (-1,); ()
    ((1,), (2,), "other", (3, 2, 5, 6, 6)),  # (-1,); (1,)
    ((1,), (0,), "same", (3, 5, 5, 6, 6)),  # (-1,); (0,), x2=None
    ((), (2, 3), "other", (3, 2, 3, 3, 5, 6)),  # (); (1, 2) -> (3,2,5,6,3,3)
    ((2, 3), (), "other", (3, 2, 3, 3)),  # (1, 2); ()
    ((-3, -1), (), "other", (3, 2, 5, 5)),  # (-1, -2); ()
    ((2,), (1,), "other", (3, 2, 3, 6, 6)),  # (1,); (3,) -> (3,2,6,6,3)
    ((1, 2), (3,), "other", (3, 2, 6)),  # (3, 1); (2,)
    ((-1,), (1, 2), "other", (3, 2, 3, 5)),  # (2,); (-1, 1) -> (3,2,5,3)
    ((1,), (3, 2), "other", (3, 2, 5, 6)),  # (-1,); (2, 1)
    ((1, 2, 3, 0), (), "same", ()),  # (3, 1, 2, 0); ()
    ((0,), (), "same", (3, 3, 5, 5, 6, 6)),  # (0,); () -> (5,5,6,6,3,3)
    ((0,), (2,), "same", (3, 3, 5, 6, 6)),  # (0,); (1,) -> (5,6,6,3,3)
    ((), (0, 1, 2, 3), "same", (3, 3, 5, 6)),  # (); (0,1,2,3) -> (3,5,6,3)
]


@pytest.fixture(scope="module")
def conv_setup():
    # SAME convolutions accept any spatial size. On the CPU explicitly: this module-scoped fixture is
    # built before the autouse fixture that makes the CPU the run device of cpu_only tests.
    module = CASES["cnn"]().module.cpu()
    return module, _randn(3, 2, 5, 6, seed=7), _randn(2, 2, 5, 6, seed=8)


@pytest.mark.parametrize("trace_axes, diagonal_axes, x2_kind, shape", SHAPE_TABLE, ids=str)
def test_shape_table(conv_setup, trace_axes, diagonal_axes, x2_kind, shape):
    module, x1, x2 = conv_setup
    x2 = None if x2_kind == "same" else x2
    assert reference_nngp(module, x1, x2, None, trace_axes, diagonal_axes).shape == shape
    assert reference_ntk(module, x1, x2, None, trace_axes, diagonal_axes).shape == shape


# ---------------------------------------------------------------------------------------------
# (d) NTK-vector products
# ---------------------------------------------------------------------------------------------


def _unzip_full_kernel(kernel, ndim):
    """(a1, b1, a2, b2, ...) zipped layout -> (a1, a2, ..., b1, b2, ...)."""
    return kernel.permute(*range(0, 2 * ndim, 2), *range(1, 2 * ndim, 2))


@pytest.mark.parametrize("case_id", ["mlp", "cnn", "embedding"])
@pytest.mark.parametrize("same_inputs", [False, True], ids=["x2", "x2=None"])
def test_ntk_vp_is_full_kernel_times_vector(case_id, same_inputs):
    case = CASES[case_id]()
    x1, x2 = make_x1_x2(case)
    x2 = None if same_inputs else x2
    full = reference_ntk(case.module, x1, x2, trace_axes=())
    ndim = full.ndim // 2
    size1 = math.prod(full.shape[0::2])
    size2 = math.prod(full.shape[1::2])
    v = _randn(*full.shape[1::2], seed=9)
    expected = (_unzip_full_kernel(full, ndim).reshape(size1, size2) @ v.reshape(-1)).reshape(
        full.shape[0::2]
    )
    assert_kernels_close(reference_ntk_vp(case.module, x1, x2, None, v), expected)


def test_ntk_vp_includes_cross_terms_between_output_leaves():
    # f(θ, x) = (A θ, B θ) with A, B given per input: the Jacobians are A and B themselves.
    def two_leaves(theta, x):
        return torch.einsum("nop,p->no", x["a"], theta), torch.einsum("nijp,p->nij", x["b"], theta)

    x1 = {"a": _randn(3, 4, 6, seed=10), "b": _randn(3, 2, 3, 6, seed=11)}
    x2 = {"a": _randn(2, 4, 6, seed=12), "b": _randn(2, 2, 3, 6, seed=13)}
    v = (_randn(2, 4, seed=14), _randn(2, 2, 3, seed=15))
    j2_t_v = torch.einsum("nop,no->p", x2["a"], v[0]) + torch.einsum("nijp,nij->p", x2["b"], v[1])
    expected = (x1["a"] @ j2_t_v, x1["b"] @ j2_t_v)
    actual = reference_ntk_vp(two_leaves, x1, x2, _randn(6, seed=16), v)
    assert isinstance(actual, tuple)
    assert_kernels_close(actual, expected)


def test_ntk_vp_rejects_mismatched_cotangents():
    case = CASES["mlp"]()
    x1, x2 = make_x1_x2(case)
    with pytest.raises(ValueError, match="shape"):
        reference_ntk_vp(case.module, x1, x2, None, torch.zeros(N1, 4))
    with pytest.raises(ValueError, match="structure"):
        reference_ntk_vp(case.module, x1, x2, None, (torch.zeros(N2, 4),))


# ---------------------------------------------------------------------------------------------
# (e) assert_kernels_close
# ---------------------------------------------------------------------------------------------


def test_assert_close_reports_worst_entries():
    expected = torch.arange(6, dtype=F64).reshape(2, 3)
    actual = expected.clone()
    actual[1, 2] += 0.5
    actual[0, 1] += 1e-3
    with pytest.raises(AssertionError, match="2 of 6 entries differ") as error:
        assert_kernels_close(actual, expected)
    message = str(error.value)
    assert "2 of 6 entries differ" in message
    assert "actual (2, 3) torch.float64, expected (2, 3) torch.float64" in message
    assert "max abs error: 5.000e-01" in message
    assert "max rel error: 1.000e-01" in message  # 0.5 / 5
    worst_first = message.index("(1, 2): 5.5 vs 5")
    assert worst_first < message.index("(0, 1): 1.001 vs 1")


def test_assert_close_reports_shape_and_structure_mismatches():
    with pytest.raises(AssertionError, match=r"shape mismatch[\s\S]*\(2, 3\)[\s\S]*\(3, 2\)"):
        assert_kernels_close(torch.zeros(2, 3), torch.zeros(3, 2))
    with pytest.raises(AssertionError, match="structures differ"):
        assert_kernels_close((torch.zeros(1),), [torch.zeros(1)])
    with pytest.raises(AssertionError, match="structures differ"):
        assert_kernels_close({"a": torch.zeros(1)}, {"b": torch.zeros(1)})
    with pytest.raises(AssertionError, match=r"kernel \[1\]\['k'\]"):
        assert_kernels_close(
            (torch.zeros(1), {"k": torch.ones(1)}), (torch.zeros(1), {"k": torch.zeros(1)})
        )


def test_assert_close_dtype_keyed_tolerances():
    expected = _randn(4, 4, seed=17) * 100
    assert_kernels_close(expected.float(), expected)  # float32 rounding passes
    with pytest.raises(AssertionError, match="keyed by torch.float64"):
        assert_kernels_close(expected * (1 + 1e-7), expected)
    assert_kernels_close(expected * (1 + 1e-7), expected, rtol=1e-6)
    # Structurally zero entries are judged against the kernel's scale, not against 0.
    zeros = torch.zeros(3, dtype=F64)
    assert_kernels_close(zeros + 1e-20, zeros)
    mixed = torch.tensor([0.0, 1e3], dtype=F64)
    assert_kernels_close(mixed + torch.tensor([1e-9, 0.0], dtype=F64), mixed)


def test_assert_close_nan_handling():
    nan = torch.tensor([float("nan"), 1.0], dtype=F64)
    assert_kernels_close(nan.clone(), nan)
    with pytest.raises(AssertionError, match="nan"):
        assert_kernels_close(nan, torch.ones(2, dtype=F64))


# ---------------------------------------------------------------------------------------------
# Which parameters are differentiated
# ---------------------------------------------------------------------------------------------


def test_frozen_layer_is_constant():
    case = CASES["frozen_layer"]()
    x1, x2 = make_x1_x2(case)
    first, last = case.module[0], case.module[2]
    with torch.no_grad():
        h1, h2 = torch.tanh(first(x1)), torch.tanh(first(x2))
    # Only the last Linear is trained: its closed-form NTK on the frozen features.
    assert_kernels_close(reference_ntk(case.module, x1, x2), h1 @ h2.T + 1)
    assert last.weight.requires_grad and not first.weight.requires_grad


def test_tied_weights_are_one_parameter():
    case = CASES["tied_weights"]()
    x1, x2 = make_x1_x2(case)
    m = case.module

    def by_hand(p, x):
        hidden = torch.tanh(x @ p["w"].T + p["b1"])
        hidden = torch.tanh(hidden @ p["w"].T + p["b2"])
        return hidden @ p["hw"].T + p["hb"]

    params = {
        "w": m.first.weight, "b1": m.first.bias, "b2": m.second.bias,
        "hw": m.head.weight, "hb": m.head.bias,
    }  # fmt: skip
    expected = reference_ntk(by_hand, x1, x2, params, trace_axes=())
    assert_kernels_close(reference_ntk(m, x1, x2, trace_axes=()), expected)


def test_params_override_differentiates_exactly_those_names(linear_setup):
    model, x1, x2 = linear_setup
    weight = torch.randn(3, 4)
    # Only the weight: no "+1" from the bias.
    ntk = reference_ntk(model, x1, x2, params={"weight": weight})
    assert_kernels_close(ntk, x1.double() @ x2.double().T)
    # The override's value is used; the bias stays at the module's value.
    nngp = reference_nngp(model, x1, x2, params={"weight": weight}, trace_axes=())
    f1 = x1.double() @ weight.double().T + model.bias.double()
    f2 = x2.double() @ weight.double().T + model.bias.double()
    assert_kernels_close(nngp, f1[:, None, :, None] * f2[None, :, None, :])


def test_function_with_nested_params_and_kwargs():
    def f(params, x, scale):
        (w,), extra = params["layers"], params["extra"]
        return scale * torch.tanh(x @ w) + extra["shift"]

    params = {"layers": [_randn(4, 3, seed=18)], "extra": {"shift": _randn(3, seed=19)}}
    x1, x2 = _randn(3, 4, seed=20), _randn(2, 4, seed=21)
    ntk = reference_ntk(f, x1, x2, params, scale=2.0)
    # Shift contributes 1 per output; scale * tanh' * x contributes the rest.
    d1 = 2.0 * (1 - torch.tanh(x1 @ params["layers"][0]) ** 2)
    d2 = 2.0 * (1 - torch.tanh(x2 @ params["layers"][0]) ** 2)
    expected = torch.einsum("no,mo->nm", d1, d2) * (x1 @ x2.T) / 3 + 1
    assert_kernels_close(ntk, expected)


# ---------------------------------------------------------------------------------------------
# Every model case
# ---------------------------------------------------------------------------------------------


def _expected_shapes(case, x2_is_none):
    """Kernel shapes from the case's output shapes, traced axes removed, others doubled."""
    shapes = []
    for out_shape in case.output_shapes:
        traced = {axis % len(out_shape) for axis in case.trace_axes}
        shape = []
        for axis, size in enumerate(out_shape):
            if axis in traced:
                continue
            if axis == 0:
                shape += [N1, N1 if x2_is_none else N2]
            else:
                shape += [size, size]
        shapes.append(tuple(shape))
    return shapes


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_every_case_has_symmetric_kernels_with_expected_shapes(case_id):
    case = CASES[case_id]()
    x1, x2 = make_x1_x2(case)
    for kernel_fn in (reference_ntk, reference_nngp):
        kernels = kernel_fn(case.module, x1, x2, trace_axes=case.trace_axes)
        assert [k.shape for k in pytree.tree_leaves(kernels)] == _expected_shapes(case, False)
        same = kernel_fn(case.module, x1, None, trace_axes=case.trace_axes)
        assert [k.shape for k in pytree.tree_leaves(same)] == _expected_shapes(case, True)
        for kernel in pytree.tree_leaves(same):
            ndim = kernel.ndim // 2  # swap every (x1, x2) pair: K(x, x) is symmetric
            swapped = kernel.permute(*itertools.chain(*((2 * i + 1, 2 * i) for i in range(ndim))))
            assert_kernels_close(swapped, kernel)
            assert kernel.dtype == F64


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_batch_independent_cases_are_per_example(case_id):
    case = CASES[case_id]()
    x1, _ = make_x1_x2(case)
    if not case.batch_independent:
        pytest.skip("case is not batch independent")
    with torch.no_grad():
        whole = case.module(x1)
        for i in range(N1):
            single = case.module(pytree.tree_map(lambda t: t[i : i + 1], x1))
            assert_kernels_close(single, pytree.tree_map(lambda t: t[i : i + 1], whole))


def test_output_containers_are_preserved():
    for case_id, container in (("tuple_output", tuple), ("dict_output", dict)):
        case = CASES[case_id]()
        x1, x2 = make_x1_x2(case)
        assert type(reference_ntk(case.module, x1, x2)) is container
        assert type(reference_nngp(case.module, x1, x2)) is container
    kernels = reference_ntk(CASES["dict_output"]().module, *make_x1_x2(CASES["dict_output"]()))
    assert list(kernels) == ["mean", "scale"]


def test_output_leaf_kernel_has_no_cross_terms():
    case = CASES["tuple_output"]()
    x1, x2 = make_x1_x2(case)
    params = dict(case.module.named_parameters())

    def first_leaf(p, x):
        return torch.func.functional_call(case.module, p, (x,))[0]

    assert_kernels_close(
        reference_ntk(case.module, x1, x2)[0], reference_ntk(first_leaf, x1, x2, params)
    )


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_errors():
    case = CASES["mlp"]()
    x1, x2 = make_x1_x2(case)
    with pytest.raises(TypeError, match="params"):
        reference_ntk(lambda p, x: x, x1, x2)
    with pytest.raises(ValueError, match="disjoint"):
        reference_ntk(case.module, x1, x2, trace_axes=(-1,), diagonal_axes=(1,))
    with pytest.raises(ValueError, match="size 3 in f\\(x1\\) but 2"):
        reference_nngp(case.module, x1, x2, trace_axes=(0,))
    with pytest.raises(ValueError, match="out of range"):
        reference_nngp(case.module, x1, x2, trace_axes=(2,))
    with pytest.raises(ValueError, match="not a parameter"):
        reference_ntk(case.module, x1, x2, params={"nope": torch.zeros(1)})
    with pytest.raises(ValueError, match="same number of dimensions"):
        reference_nngp(lambda p, x: x * p, _randn(3, 2, seed=0), _randn(3, seed=0), torch.ones(1))


def test_no_differentiated_parameters_gives_zero_ntk():
    def ignores_params(params, x):
        return torch.tanh(x)

    x1, x2 = _randn(3, 4, seed=22), _randn(2, 4, seed=23)
    assert_kernels_close(reference_ntk(ignores_params, x1, x2, {}), torch.zeros(3, 2, dtype=F64))
    # Integer leaves are passed through unchanged, not differentiated.
    integer_only = {"steps": torch.tensor(3)}
    assert_kernels_close(
        reference_ntk(ignores_params, x1, x2, integer_only, trace_axes=()),
        torch.zeros(3, 2, 4, 4, dtype=F64),
    )


def test_the_oracle_shares_no_code_with_the_library():
    """torchntk.testing's kernels and report import, from torchntk, only their own private modules."""
    oracle = {"_reference_model", "_reference_layout", "_comparison"}
    root = pathlib.Path(torchntk.testing.__file__).parent
    for name in sorted(oracle | {"__init__"}):
        tree = ast.parse((root / f"{name}.py").read_text())
        imported = {
            "." * node.level + (node.module or "")
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level
        }
        allowed = {f".{module}" for module in oracle | ({"_module_snapshot"} if name == "__init__" else set())}
        assert imported <= allowed, (name, imported)


@pytest.mark.parametrize("form", ["wrapper", "in place"])
def test_the_reference_of_a_compiled_module_is_that_of_the_module(form):
    """The oracle differentiates a compiled module (a ``torch.compile`` wrapper, or compiled in
    place) as the module itself, under the wrapper's parameter names: the brute force that
    torchntk's kernels of compiled modules are checked against (``tests/test_model_forms.py``)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    compiled = copy.deepcopy(plain)
    if form == "wrapper":
        compiled = torch.compile(compiled, backend="eager")
    else:
        compiled.compile(backend="eager")
    expected = reference_ntk(plain, x, trace_axes=())
    assert expected.abs().max() > 0
    assert_kernels_close(reference_ntk(compiled, x, trace_axes=()), expected)
    if form == "wrapper":
        names = {"_orig_mod.0.weight": compiled._orig_mod[0].weight}
        assert_kernels_close(reference_ntk(compiled, x, params=names, trace_axes=()),
                             reference_ntk(plain, x, params={"0.weight": plain[0].weight}, trace_axes=()))
