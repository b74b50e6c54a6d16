"""Every bad input gets a ValueError/TypeError naming the argument (spec §16 and the issue's list)."""

from __future__ import annotations

import pytest
import torch

import torchntk

pytestmark = pytest.mark.cpu_only("checks the errors for bad arguments, as raised on the CPU")

torch.set_default_dtype(torch.float32)


def conv_model():
    return torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(3, 3, 3, padding=1)).eval()


X1, X2 = torch.randn(3, 2, 5, 6), torch.randn(2, 2, 5, 6)


def ntk(implementation=1, vmap_axes=None, **axes):
    return torchntk.empirical_ntk_fn(conv_model(), vmap_axes=vmap_axes, implementation=implementation, **axes)


BOTH = pytest.mark.parametrize("implementation", [1, 2], ids=["JC", "NVP"])


@BOTH
def test_overlapping_trace_and_diagonal_axes(implementation):
    with pytest.raises(ValueError, match=r"`trace_axes`=\(1,\) and `diagonal_axes`=\(-3,\) both contain axis 1"):
        ntk(implementation, trace_axes=(1,), diagonal_axes=(-3,))(X1, X2)
    with pytest.raises(ValueError, match="both contain"):
        torchntk.empirical_nngp_fn(conv_model(), trace_axes=(1,), diagonal_axes=(1,))(X1, X2)


@BOTH
@pytest.mark.parametrize("axes", [{"trace_axes": (0,)}, {"diagonal_axes": (0,), "trace_axes": ()}], ids=["trace", "diagonal"])
def test_traced_or_diagonal_sizes_that_differ(implementation, axes):
    kind = "traced" if "trace_axes" in axes and axes["trace_axes"] else "diagonal"
    with pytest.raises(ValueError, match=f"{kind} axis 0 of size 3 for x1 but 2 for x2"):
        ntk(implementation, **axes)(X1, X2)


@BOTH
@pytest.mark.parametrize("name", ["trace_axes", "diagonal_axes"])
def test_out_of_range_axes(implementation, name):
    with pytest.raises(ValueError, match=rf"`{name}`=\(4,\) has axis 4, out of range .* 4 axes \(expected -4..3\)"):
        ntk(implementation, **{name: (4,)})(X1, X2)
    with pytest.raises(ValueError, match="out of range"):
        ntk(implementation, **{name: (-5,)})(X1, X2)


@BOTH
def test_duplicate_axes(implementation):
    with pytest.raises(ValueError, match=r"`trace_axes`=\(1, -3\) names the same axis .* twice"):
        ntk(implementation, trace_axes=(1, -3))(X1, X2)
    with pytest.raises(ValueError, match="twice"):
        ntk(implementation, trace_axes=(), diagonal_axes=(2, 2))(X1, X2)


def test_scalar_output_with_default_trace_axes_says_what_to_do():
    f = lambda p, x: (p * x).sum()  # noqa: E731
    with pytest.raises(ValueError, match=r"Scalar outputs need `trace_axes=\(\)`"):
        torchntk.empirical_ntk_fn(f)(torch.randn(3), None, torch.randn(3))
    assert torchntk.empirical_ntk_fn(f, trace_axes=())(torch.randn(3), None, torch.randn(3)).shape == ()


@pytest.mark.parametrize("value", [4, -1, 7])
def test_implementation_outside_0_to_3(value):
    if value in (4, -1, 7):
        with pytest.raises(ValueError, match=rf"`implementation` must be one of 0 .* got {value}"):
            torchntk.empirical_ntk_fn(conv_model(), implementation=value)


@pytest.mark.parametrize("value", ["jc", 1.0, None, True])
def test_implementation_of_wrong_type(value):
    with pytest.raises(TypeError, match="`implementation` must be an NtkImplementation or an int"):
        torchntk.empirical_ntk_fn(conv_model(), implementation=value)


@pytest.mark.parametrize("builder", [torchntk.empirical_ntk_fn, torchntk.empirical_kernel_fn])
@pytest.mark.parametrize(
    "knob, value", [("structure_rules", False), ("closed_form_rules", False), ("local_jacobian", "forward"), ("verify", True)]
)
def test_structured_knobs_need_implementation_3_or_auto(builder, knob, value):
    for implementation in (1, 2):
        with pytest.raises(ValueError, match=rf"`{knob}` only apply to implementation=3 .* but implementation={implementation}"):
            builder(conv_model(), implementation=implementation, **{knob: value})
    builder(conv_model(), implementation=3, **{knob: value})
    builder(conv_model(), implementation=0, **{knob: value})


@pytest.mark.parametrize("knob", ["structure_rules", "closed_form_rules", "verify"])
def test_structured_knobs_must_be_bools(knob):
    with pytest.raises(TypeError, match=rf"`{knob}` must be True or False, got 1 \(int\)"):
        torchntk.empirical_ntk_fn(conv_model(), implementation=3, **{knob: 1})


def test_local_jacobian_must_be_a_known_mode():
    with pytest.raises(ValueError, match="`local_jacobian` must be 'auto', 'forward' or 'reverse', got 'fwd'"):
        torchntk.empirical_ntk_fn(conv_model(), implementation=3, local_jacobian="fwd")


@pytest.mark.parametrize(
    "get, error, message",
    [
        ((), ValueError, "must name at least one"),
        (("ntk", "NTK"), ValueError, "must not repeat"),
        (("ntk", "nngp", "ntk"), ValueError, "must not repeat"),
        ("cov", ValueError, "unknown kernel 'cov'"),
        (("ntk", "foo"), ValueError, "unknown kernel 'foo'"),
        ((1,), TypeError, "only strings"),
        (5, TypeError, "`get` must be None, a string or a tuple"),
    ],
)
def test_bad_get(get, error, message):
    kernel_fn = torchntk.empirical_kernel_fn(conv_model())
    with pytest.raises(error, match=message):
        kernel_fn(X1, X2, get)


@BOTH
def test_outputs_of_different_ndim_for_x1_and_x2(implementation):
    f = lambda p, x: x @ p if x.shape[0] == 3 else (x @ p)[None]  # noqa: E731
    with pytest.raises(ValueError, match=r"shape \(3, 2\) for x1 but \(1, 2, 2\) for x2; .* same number of axes"):
        torchntk.empirical_ntk_fn(f, implementation=implementation)(torch.randn(3, 4), torch.randn(2, 4), torch.randn(4, 2))


def test_outputs_of_different_structure():
    f = lambda p, x: (x @ p,) if x.shape[0] == 3 else x @ p  # noqa: E731
    with pytest.raises(ValueError, match="differently structured outputs"):
        torchntk.empirical_ntk_fn(f)(torch.randn(3, 4), torch.randn(2, 4), torch.randn(4, 2))


def test_model_with_no_parameter_to_differentiate():
    model = conv_model().requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        torchntk.empirical_ntk_fn(model)(X1, X2)
    with pytest.raises(ValueError, match="has no tensors"):
        torchntk.empirical_ntk_fn(lambda p, x: x)(X1, X2, {})
    with pytest.raises(ValueError, match="empty mapping"):
        torchntk.empirical_ntk_fn(conv_model())(X1, X2, {})


def test_bad_params():
    with pytest.raises(TypeError, match="`params` is required"):
        torchntk.empirical_ntk_fn(lambda p, x: x @ p)(torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"names \['nope'\] that are not parameters"):
        torchntk.empirical_ntk_fn(conv_model())(X1, X2, {"nope": torch.zeros(1)})
    with pytest.raises(TypeError, match="mapping from parameter name to tensor"):
        torchntk.empirical_ntk_fn(conv_model())(X1, X2, [torch.zeros(1)])
    with pytest.raises(ValueError, match=r"`params\['0.bias'\]` has shape \(2,\), but .* \(3,\)"):
        torchntk.empirical_ntk_fn(conv_model())(X1, X2, {"0.bias": torch.zeros(2)})
    with pytest.raises(TypeError, match="only floating-point parameters"):
        torchntk.empirical_ntk_fn(lambda p, x: x * p)(torch.randn(3), None, torch.arange(3))


@pytest.mark.parametrize("name", ["trace_axes", "diagonal_axes"])
@pytest.mark.parametrize("value", ["1", 1.5, (0, "a"), None, True])
def test_axes_of_wrong_type(name, value):
    with pytest.raises(TypeError, match=f"`{name}` must"):
        torchntk.empirical_ntk_fn(conv_model(), **{name: value})
    with pytest.raises(TypeError, match=f"`{name}` must"):
        torchntk.empirical_nngp_fn(conv_model(), **{name: value})


def test_int_axes_are_accepted():
    kernel = torchntk.empirical_ntk_fn(conv_model(), trace_axes=1, diagonal_axes=0)(X1)
    assert kernel.shape == (3, 5, 5, 6, 6)


@pytest.mark.parametrize("value, error", [(0, ValueError), (-2, ValueError), (1.5, TypeError), ("4", TypeError)])
def test_bad_chunk_size(value, error):
    with pytest.raises(error, match="`chunk_size` must be None or a positive int"):
        torchntk.empirical_ntk_fn(conv_model(), chunk_size=value)


def test_bad_vmap_axes():
    with pytest.raises(TypeError, match="vmap_axes"):
        torchntk.empirical_ntk_fn(conv_model(), vmap_axes="0")
    with pytest.raises(TypeError, match="kwargs part of `vmap_axes`"):
        torchntk.empirical_ntk_fn(conv_model(), vmap_axes=(0, 0, "x"))
    with pytest.raises(ValueError, match=r"`vmap_axes \(in_axes\)` gives axis 4 .* expected -4..3"):
        torchntk.empirical_ntk_fn(conv_model(), vmap_axes=4)(X1, X2)
    with pytest.raises(ValueError, match=r"names keyword arguments \['scale'\] that were not passed"):
        torchntk.empirical_ntk_fn(conv_model(), vmap_axes=(0, 0, {"scale": 0}))(X1, X2)
    f = lambda p, x, y: x @ p + y.sum()  # noqa: E731
    with pytest.raises(ValueError, match="must all have the same size"):
        torchntk.empirical_ntk_fn(f, vmap_axes=(0, 0, {"y": 0}))(torch.randn(3, 4), None, torch.randn(4, 2), y=torch.randn(2, 2))


def test_wrong_out_axes_are_reported():
    f = lambda p, x: (x @ p).T  # noqa: E731   batch axis moves to 1 in the output
    with pytest.raises(ValueError, match="no size-1 batch axis at out_axes=0"):
        torchntk.empirical_ntk_fn(f, trace_axes=(), vmap_axes=0)(torch.randn(3, 4), None, torch.randn(4, 2))


def test_two_tuple_kwarg_with_x2_none_must_have_equal_halves():
    f = lambda p, x, shift: x @ p + shift  # noqa: E731
    with pytest.raises(ValueError, match="keyword argument 'shift' is a 2-tuple.* x2 is None and the two values differ"):
        torchntk.empirical_ntk_fn(f)(torch.randn(3, 4), None, torch.randn(4, 2), shift=(1.0, 2.0))
    same = torchntk.empirical_ntk_fn(f)(torch.randn(3, 4), None, torch.randn(4, 2), shift=(1.0, 1.0))
    assert same.shape == (3, 3)


def test_model_that_is_not_callable():
    with pytest.raises(TypeError, match="`f` must be an nn.Module or a callable"):
        torchntk.empirical_ntk_fn(3)
    with pytest.raises(TypeError, match="`f` must be"):
        torchntk.linearize("model", {})


def test_cotangents_that_do_not_match_f_x2():
    ntk_vp = torchntk.empirical_ntk_vp_fn(conv_model(), X1, X2)
    with pytest.raises(ValueError, match=r"`cotangents` must have the structure and shapes of f\(x2\)"):
        ntk_vp(torch.randn(3, 3, 5, 6))


def test_taylor_expand_degree_and_point():
    with pytest.raises(ValueError, match="`degree` must be an int >= 0, got -1"):
        torchntk.taylor_expand(conv_model(), degree=-1)
    with pytest.raises(TypeError, match="`degree` must be an int"):
        torchntk.taylor_expand(conv_model(), degree=1.0)
    f_lin = torchntk.linearize(conv_model())
    with pytest.raises(ValueError, match="`p` must be a mapping with exactly the differentiated parameter names"):
        f_lin({"0.weight": torch.zeros(3, 2, 3, 3)}, X1)
    g_lin = torchntk.linearize(lambda p, x: x @ p["w"], {"w": torch.randn(4, 2)})
    with pytest.raises(ValueError, match="`p` must have the structure of `params`"):
        g_lin([torch.randn(4, 2)], torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"must be a tensor of shape \(4, 2\)"):
        g_lin({"w": torch.randn(2, 4)}, torch.randn(3, 4))


def test_x1_must_hold_a_tensor():
    with pytest.raises(ValueError, match="`x1` must contain at least one tensor"):
        ntk()(None)


@BOTH
@pytest.mark.parametrize("vmap_axes", [None, 0])
def test_empty_batches_give_empty_kernels(implementation, vmap_axes):
    model = torch.nn.Linear(3, 2)
    kernel_fn = torchntk.empirical_kernel_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=implementation)
    both = kernel_fn(torch.randn(4, 3), torch.randn(0, 3))
    assert both.ntk.shape == both.nngp.shape == (4, 0, 2, 2)
    assert kernel_fn(torch.randn(0, 3), None, "ntk").shape == (0, 0, 2, 2)
