"""Per-rule tests of structured derivatives (``implementation=3``): closed-form factors against
dense op-local Jacobians.

Each case runs one op once under :class:`Recorder` with a tuple of float64 parameters. The single
recorded :class:`RuleCall` states every parameter's Jacobian as a :class:`Role` (NOTE: [Roles and
their factors] in ``_roles.py``). For a random cotangent ``g`` shaped like the output ``y``:

* the closed form ``J^T g = einsum(g viewed as role.y_shape, *operands -> role.param_labels) *
  role.scale`` must equal ``torch.func.jacrev`` of the op with respect to the parameter,
  contracted with ``g`` over the ``y`` axes (after scattering through ``ref.index`` when the op
  sees a view of the parameter);
* it must also equal the contraction of ``jacrev(role.local)(role.seen)`` (the op as a function of
  the tensor it received), and ``role.local(role.seen)`` must reproduce ``y``;
* the joint (weight, bias) role must equal the layout its rule documents, built from the two
  separate oracles: linear ``[dW, db]`` as ``(C, I + 1)``, conv ``[dW, db]`` per group as
  ``(g, C_out / g, Q + 1)``, norms ``[dgamma, dbeta]`` as ``(C, 2)``.

Also tested: rules that must decline (the parameter goes to the Jacobian fallback, listed in
``recorder.unruled``), metadata-only uses of a parameter (nothing recorded, nothing unruled),
the ``ParamRef.index`` of views, slices and casts between a parameter and its consumer, and the
registry: a rule registered with ``@rule`` is found by the recorder, a function gets one rule,
and importing ``torchntk`` registers every rule module.

Parameters, inputs and cotangents live on the run device (``pytest --device``): they are drawn from
the seeded global CPU generator and moved, so every device sees the same numbers.
"""

from __future__ import annotations

import functools
import math
import pathlib
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import pytest
import torch
import torch.nn.functional as F
from torch.func import jacrev
from torch.overrides import handle_torch_function, has_torch_function_variadic

from tests.cases import to_device
from torchntk._implementations.structured import rules as rules_package
from torchntk._implementations.structured._recorder import Recorder
from torchntk._implementations.structured._roles import ParamRef, Role, RuleCall
from torchntk._implementations.structured.rules import RULES, rule, rule_for, unregister
from torchntk._implementations.structured._views import axis_permutation
from torchntk._implementations.structured.rules.conv import convolution_input_gradient

aten = torch.ops.aten

pytestmark = [
    pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning"),
]

DT = torch.float64
TOL = dict(rtol=1e-12, atol=1e-12)


def rand(*shape: int, dtype: torch.dtype = DT) -> torch.Tensor:
    """Standard normal entries from the global CPU generator, on the run device."""
    return to_device(torch.randn(*shape, dtype=dtype))


def nonzero(*shape: int) -> torch.Tensor:
    """A random tensor kept away from zero (a denominator)."""
    values = rand(*shape)
    return values.sign() * (values.abs() + 0.5)


@dataclass
class Case:
    """One op on the parameters: ``fn(*params)`` (the other inputs captured by ``fn``).

    ``joint``: the documented joint layout of ``(weight oracle, bias oracle)``, or ``None`` when
    the rule must state no joint role. ``index``: for view cases, the expected ``ref.index`` of
    each parameter as a function of its flat positions (``None``: the parameter itself).
    """

    fn: Callable[..., torch.Tensor]
    params: tuple[torch.Tensor, ...]
    joint: Optional[Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = None
    index: Optional[dict[int, Callable[[torch.Tensor], Optional[torch.Tensor]]]] = None
    tol: Optional[dict] = None


# --------------------------------------------------------------------------------------------
# Mechanics
# --------------------------------------------------------------------------------------------


def record(fn: Callable, params: tuple[torch.Tensor, ...]) -> tuple[Recorder, torch.Tensor]:
    recorder = Recorder(params)
    with torch.no_grad(), recorder:
        y = fn(*params)
    return recorder, y


def contract(g: torch.Tensor, jacobian: torch.Tensor) -> torch.Tensor:
    """``sum_y g[y] J[y, ...]`` for ``J`` of shape ``y.shape + p.shape``."""
    return torch.tensordot(g.to(jacobian.dtype), jacobian, dims=g.ndim)


def oracle(fn: Callable, params: tuple[torch.Tensor, ...], position: int, g: torch.Tensor) -> torch.Tensor:
    """``J^T g`` of ``fn`` with respect to ``params[position]`` by dense ``jacrev``."""

    def of_one(param: torch.Tensor) -> torch.Tensor:
        return fn(*params[:position], param, *params[position + 1 :])

    return contract(g, jacrev(of_one)(params[position]))


def closed_form(role: Role, g: torch.Tensor) -> torch.Tensor:
    """``J^T g`` from the role's factors, shaped by ``role.param_labels``."""
    spec = ",".join([role.g_labels, *(labels for _, labels in role.operands)]) + "->" + role.param_labels
    tensors = [g.reshape(role.y_shape), *(tensor for tensor, _ in role.operands)]
    # operands may be integer, bool or lower precision (``p * mask``): the contraction promotes
    dtype = functools.reduce(torch.promote_types, [tensor.dtype for tensor in tensors])
    return torch.einsum(spec, *(tensor.to(dtype) for tensor in tensors)) * role.scale


def flat_positions(param: torch.Tensor, index: Optional[torch.Tensor]) -> torch.Tensor:
    return torch.arange(param.numel(), device=param.device).view(param.shape) if index is None else index


def check_rule(case: Case) -> None:
    fn, params = case.fn, case.params
    tol = case.tol or TOL
    recorder, y = record(fn, params)
    assert recorder.unruled == set()
    assert len(recorder.calls) == 1
    call = recorder.calls[0]
    assert call.output is y
    torch.testing.assert_close(y, fn(*params), rtol=0, atol=0)

    separate, joint = call.roles()
    g = torch.randn(y.shape, dtype=y.dtype).to(y.device)  # drawn on the CPU: the same on every device
    assert sorted(role.refs[0].param for role in separate) == list(range(len(params)))

    seen_vjp: dict[str, torch.Tensor] = {}
    separate_refs: dict[str, object] = {}
    for role in separate:
        assert not role.joint and len(role.refs) == 1
        ref = role.refs[0]
        param = params[ref.param]
        seen = role.seen
        assert seen is not None and role.local is not None

        closed = closed_form(role, g)
        assert tuple(closed.shape) == tuple(role.param_shape)
        assert math.prod(role.param_shape) == seen.numel()

        # The reference: which entries of the parameter the op received.
        index = flat_positions(param, ref.index)
        assert index.shape == seen.shape
        assert torch.equal(param.detach().flatten()[index].to(seen.dtype), seen)
        if case.index is not None:
            expected = case.index[ref.param](torch.arange(param.numel(), device=param.device).view(param.shape))
            if expected is None or axis_permutation(expected, tuple(param.shape)) is not None:
                # the whole parameter, or its transpose: a role states it in the parameter's own axis
                # order (NOTE: [Unrolled derivatives]), and the checks below hold on the parameter
                assert ref.index is None and tuple(role.param_shape) == tuple(param.shape)
            else:
                assert ref.index is not None and torch.equal(ref.index, expected)

        # ``local`` is the op as a function of the seen tensor.
        torch.testing.assert_close(role.local(seen), y, rtol=0, atol=0)
        local_vjp = contract(g, jacrev(role.local)(seen))
        torch.testing.assert_close(closed.reshape(seen.shape).to(local_vjp.dtype), local_vjp, **tol)

        # The oracle with respect to the parameter itself, through the view's positions.
        scattered = torch.zeros(param.numel(), dtype=DT, device=param.device)
        scattered.index_add_(0, index.reshape(-1), closed.reshape(-1).to(DT))
        param_vjp = oracle(fn, params, ref.param, g)
        torch.testing.assert_close(scattered.view(param.shape), param_vjp, **tol)

        # the joint layout is over the seen tensors: the parameters themselves unless viewed (a
        # transpose seen is stated on the parameter by the separate role, not by the joint one)
        seen_vjp[role.name] = param_vjp if ref.index is None else local_vjp
        separate_refs[role.name] = ref
        if case.index is not None and expected is not None and ref.index is None:
            view_order = axis_permutation(expected, tuple(param.shape))
            seen_vjp[role.name] = param_vjp.permute(view_order)
            separate_refs[role.name] = ParamRef(ref.param, expected)

    if case.joint is None:
        assert joint is None
        return
    assert joint is not None and joint.joint
    weight_ref, bias_ref = separate_refs["weight"], separate_refs["bias"]
    assert [ref.param for ref in joint.refs] == [weight_ref.param, bias_ref.param]
    assert joint.refs[0].same_coordinates(weight_ref) and joint.refs[1].same_coordinates(bias_ref)
    closed = closed_form(joint, g)
    assert tuple(closed.shape) == tuple(joint.param_shape)
    expected = case.joint(seen_vjp["weight"], seen_vjp["bias"])
    assert closed.shape == expected.shape
    torch.testing.assert_close(closed, expected, **tol)


def linear_joint(dW: torch.Tensor, db: torch.Tensor) -> torch.Tensor:
    return torch.cat([dW, db[:, None]], 1)


def norm_joint(dgamma: torch.Tensor, dbeta: torch.Tensor) -> torch.Tensor:
    return torch.stack([dgamma.flatten(), dbeta.flatten()], -1)


# --------------------------------------------------------------------------------------------
# F.linear
# --------------------------------------------------------------------------------------------

LEADS = {"x(I)": (), "x(N,I)": (3,), "x(N,T,I)": (2, 3)}
LINEAR_PARAMS = ["weight+bias", "weight-nobias", "weight-constbias", "bias-constweight", "weight+bias-kw"]


def linear_case(lead: tuple[int, ...], which: str) -> Case:
    features, channels = 4, 3
    x, W, b = rand(*lead, features), rand(channels, features), rand(channels)
    if which == "weight+bias":
        return Case(lambda W, b: F.linear(x, W, b), (W, b), joint=linear_joint)
    if which == "weight+bias-kw":
        return Case(lambda W, b: F.linear(x, weight=W, bias=b), (W, b), joint=linear_joint)
    if which == "weight-nobias":
        return Case(lambda W: F.linear(x, W), (W,))
    if which == "weight-constbias":
        return Case(lambda W: F.linear(x, W, b), (W,))
    return Case(lambda b: F.linear(x, W, b), (b,))


@pytest.mark.parametrize("which", LINEAR_PARAMS)
@pytest.mark.parametrize("lead", list(LEADS.values()), ids=list(LEADS))
def test_linear(lead, which):
    check_rule(linear_case(lead, which))


# --------------------------------------------------------------------------------------------
# matmul: x @ W, W @ x
# --------------------------------------------------------------------------------------------

RIGHT_FORMS = {
    "x@W": lambda x, W: x @ W,
    "torch.matmul(x,W)": lambda x, W: torch.matmul(x, W),
    "x.matmul(W)": lambda x, W: x.matmul(W),
}
MM_RIGHT_FORMS = {"torch.mm(x,W)": lambda x, W: torch.mm(x, W), "x.mm(W)": lambda x, W: x.mm(W)}
LEFT_FORMS = {
    "W@x": lambda W, x: W @ x,
    "torch.matmul(W,x)": lambda W, x: torch.matmul(W, x),
    "W.matmul(x)": lambda W, x: W.matmul(x),
}
MM_LEFT_FORMS = {"torch.mm(W,x)": lambda W, x: torch.mm(W, x), "W.mm(x)": lambda W, x: W.mm(x)}


def _matmul_cases():
    features, columns = 4, 3
    cases = []
    for lead_id, lead in LEADS.items():
        for form_id, form in RIGHT_FORMS.items():
            cases.append(pytest.param(form, lead + (features,), (features, columns), id=f"{form_id}-W2d-{lead_id}"))
            cases.append(pytest.param(form, lead + (features,), (features,), id=f"{form_id}-w1d-{lead_id}"))
    for form_id, form in MM_RIGHT_FORMS.items():
        cases.append(pytest.param(form, (5, features), (features, columns), id=f"{form_id}-W2d-x(N,I)"))
    return cases


def _matmul_left_cases():
    rows, features, columns = 3, 4, 2
    shapes = {"x(I)": (features,), "x(I,K)": (features, columns), "x(N,I,K)": (2, features, columns),
              "x(N,M,I,K)": (2, 3, features, columns)}
    cases = []
    for shape_id, shape in shapes.items():
        for form_id, form in LEFT_FORMS.items():
            cases.append(pytest.param(form, (rows, features), shape, id=f"{form_id}-W2d-{shape_id}"))
    for form_id, form in MM_LEFT_FORMS.items():
        cases.append(pytest.param(form, (rows, features), (features, columns), id=f"{form_id}-W2d-x(I,K)"))
    return cases


@pytest.mark.parametrize("form, x_shape, w_shape", _matmul_cases())
def test_matmul_parameter_on_the_right(form, x_shape, w_shape):
    x, W = rand(*x_shape), rand(*w_shape)
    check_rule(Case(lambda W: form(x, W), (W,)))


@pytest.mark.parametrize("form, w_shape, x_shape", _matmul_left_cases())
def test_matmul_parameter_on_the_left(form, w_shape, x_shape):
    W, x = rand(*w_shape), rand(*x_shape)
    check_rule(Case(lambda W: form(W, x), (W,)))


ADDMM_CASES = {
    # Hugging Face's Conv1D (GPT-2): torch.addmm(self.bias, x.view(-1, nx), self.weight)
    "weight+bias": lambda x, W, b: (lambda W, b: torch.addmm(b, x, W), (W, b)),
    "weight+bias-method": lambda x, W, b: (lambda W, b: b.addmm(x, W), (W, b)),
    "weight+bias-scaled": lambda x, W, b: (lambda W, b: torch.addmm(b, x, W, beta=0.5, alpha=-2.0), (W, b)),
    "weight-constbias": lambda x, W, b: (lambda W: torch.addmm(b, x, W, alpha=3), (W,)),
    "weight-const2dbias": lambda x, W, b: (lambda W: torch.addmm(b.expand(x.shape[0], -1) * 2, x, W), (W,)),
    "bias-constweight": lambda x, W, b: (lambda b: torch.addmm(b, x, W, beta=2.0), (b,)),
    "bias-keywords": lambda x, W, b: (lambda b: torch.addmm(input=b, mat1=x, mat2=W), (b,)),
}


@pytest.mark.parametrize("which", list(ADDMM_CASES))
def test_addmm(which):
    fn, params = ADDMM_CASES[which](rand(5, 4), rand(4, 3), rand(3))
    check_rule(Case(fn, params))


# --------------------------------------------------------------------------------------------
# conv1d / conv2d / conv3d
# --------------------------------------------------------------------------------------------

SPATIAL = {1: (9,), 2: (6, 7), 3: (6, 5, 6)}

# id -> keyword arguments of conv_case; ``kernel`` is per axis (3 by default).
CONV_CONFIGS = {
    "plain": {},
    "stride2": {"stride": 2},
    "stride-tuple": {"stride": (2, 1, 3)},
    "pad1": {"padding": 1},
    "pad-tuple": {"padding": (2, 0, 1)},
    "same-odd": {"padding": "same", "kernel": 3},
    "same-even": {"padding": "same", "kernel": 2},
    "same-even4": {"padding": "same", "kernel": 4},
    "same-odd-dil2": {"padding": "same", "kernel": 3, "dilation": 2},
    "same-even-dil3": {"padding": "same", "kernel": 2, "dilation": 3},
    "same-even-dil2": {"padding": "same", "kernel": 2, "dilation": 2},
    "same-dil-tuple": {"padding": "same", "kernel": 2, "dilation": (1, 2, 3)},
    "valid": {"padding": "valid"},
    "dil2": {"dilation": 2},
    "groups2": {"groups": 2},
    "depthwise": {"groups": 4},
    "depthwise-x2": {"groups": 4, "out": 8},
    "nobias": {"bias": "none"},
    "weight-constbias": {"bias": "const"},
    "bias-constweight": {"bias": "only"},
    "unbatched": {"batched": False},
    "unbatched-groups2-stride2": {"batched": False, "groups": 2, "stride": 2},
    "mixed": {"stride": 2, "padding": 1, "dilation": 2, "groups": 2, "kernel": 2},
    "keywords": {"keywords": True, "stride": 2, "padding": 1},
}


def conv_case(dim, kernel=3, stride=1, padding=0, dilation=1, groups=1, out=4, bias="param", batched=True,
              keywords=False) -> Case:
    in_channels = 4

    def per_axis(value):
        return value[:dim] if isinstance(value, tuple) else value

    stride, padding, dilation = per_axis(stride), per_axis(padding), per_axis(dilation)
    kernel_shape = (kernel,) * dim if dim != 2 or kernel != 3 else (3, 2)  # a non-square 2-D kernel
    x = rand(*((2,) if batched else ()), in_channels, *SPATIAL[dim])
    W, b = rand(out, in_channels // groups, *kernel_shape), rand(out)
    conv = getattr(F, f"conv{dim}d") if keywords else getattr(torch, f"conv{dim}d")
    options = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)

    def op(weight, bias_):
        if keywords:
            return conv(x, weight, bias=bias_, **options)
        return conv(x, weight, bias_, stride, padding, dilation, groups)

    if bias == "param":
        return Case(op, (W, b))  # convolutions state weight and bias separately (no joint role)
    if bias == "none":
        return Case(lambda W: op(W, None), (W,))
    if bias == "const":
        return Case(lambda W: op(W, b), (W,))
    return Case(lambda b: op(W, b), (b,))


@pytest.mark.parametrize("config", list(CONV_CONFIGS.values()), ids=list(CONV_CONFIGS))
@pytest.mark.parametrize("dim", [1, 2, 3], ids=["conv1d", "conv2d", "conv3d"])
def test_conv(dim, config):
    check_rule(conv_case(dim, **config))


# A graph holds explicit padding: 'same' and 'valid' reach it as numbers.
EXPLICIT_CONV_CONFIGS = {name: config for name, config in CONV_CONFIGS.items() if not isinstance(config.get("padding"), str)}


@pytest.mark.parametrize("config", list(EXPLICIT_CONV_CONFIGS.values()), ids=list(EXPLICIT_CONV_CONFIGS))
@pytest.mark.parametrize("dim", [1, 2, 3], ids=["conv1d", "conv2d", "conv3d"])
def test_the_input_gradient_of_a_convolution(dim, config):
    # NOTE: [Convolutions through derivatives]: dL/dx = conv_transpose(g, W), a use of W in the
    # derivative a model takes; every stride, padding, dilation and group count, and spatial sizes
    # a strided convolution does not cover exactly (the input's last positions get no gradient)
    config = {key: value for key, value in config.items() if key not in ("keywords", "bias", "batched")}
    forward = conv_case(dim, bias="none", **config)
    (weight,) = forward.params
    x = rand(2, 4, *(size + 1 for size in SPATIAL[dim]))
    spatial = dim
    stride, padding, dilation = (
        [config.get(name, default)] * spatial if not isinstance(config.get(name, default), tuple)
        else list(config[name][:spatial])
        for name, default in (("stride", 1), ("padding", 0), ("dilation", 1))
    )
    groups = config.get("groups", 1)
    y = torch.ops.aten.convolution.default(x, weight, None, stride, padding, dilation, False, [0] * spatial, groups)
    g = rand(*y.shape)

    def input_gradient(W):
        return convolution_input_gradient(g, W, list(x.shape), stride, padding, dilation, groups)

    expected = torch.autograd.grad(
        torch.ops.aten.convolution.default(x.requires_grad_(), weight, None, stride, padding, dilation, False,
                                           [0] * spatial, groups), x, g,
    )[0]
    torch.testing.assert_close(input_gradient(weight), expected)
    check_rule(Case(input_gradient, (weight,)))


@pytest.mark.parametrize("groups,stride,padding,dilation", [(1, 1, 0, 1), (2, 2, 1, 2)], ids=["plain", "mixed"])
def test_the_aten_convolution_of_a_traced_graph(groups, stride, padding, dilation):
    # NOTE: [Unrolled derivatives]: a graph calls aten.convolution with explicit lists; not transposed
    x, W, b = rand(2, 4, 7, 6), rand(4, 4 // groups, 3, 2), rand(4)

    def op(weight, bias):
        return aten.convolution.default(x, weight, bias, [stride] * 2, [padding] * 2, [dilation] * 2, False, [0, 0], groups)

    check_rule(Case(op, (W, b)))
    def transposed(weight):
        return aten.convolution.default(x, weight, None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1)

    recorder, _ = record(transposed, (rand(4, 2, 3, 3),))
    assert recorder.unruled == {0} and recorder.calls == []  # a transposed convolution has no rule


# --------------------------------------------------------------------------------------------
# F.embedding
# --------------------------------------------------------------------------------------------

INDICES = {"i(S)": torch.tensor([0, 2, 5, 2, 3, 5, 1]), "i(N,S)": torch.tensor([[4, 2, 2, 5], [0, 5, 1, 2]])}
PADDING = {"nopad": None, "pad2": 2, "pad-1": -1, "pad-5": -5}


@pytest.mark.parametrize("keyword", [False, True], ids=["positional", "keyword"])
@pytest.mark.parametrize("padding_idx", list(PADDING.values()), ids=list(PADDING))
@pytest.mark.parametrize("indices", list(INDICES.values()), ids=list(INDICES))
def test_embedding(indices, padding_idx, keyword):
    indices, W = to_device(indices), rand(6, 3)
    if keyword:
        fn = lambda W: F.embedding(indices, W, padding_idx=padding_idx)  # noqa: E731
    else:
        fn = lambda W: F.embedding(indices, W, padding_idx)  # noqa: E731
    check_rule(Case(fn, (W,)))


# --------------------------------------------------------------------------------------------
# layer_norm, group_norm, batch_norm
# --------------------------------------------------------------------------------------------

AFFINE = ["weight+bias", "weight-only", "weight-constbias", "bias-only"]


def affine_case(op: Callable, shape: tuple[int, ...], which: str) -> Case:
    gamma, beta = 1 + 0.3 * rand(*shape), 0.3 * rand(*shape)
    if which == "weight+bias":
        return Case(lambda w, b: op(w, b), (gamma, beta), joint=norm_joint)
    if which == "weight-only":
        return Case(lambda w: op(w, None), (gamma,))
    if which == "weight-constbias":
        return Case(lambda w: op(w, beta), (gamma,))
    return Case(lambda b: op(gamma, b), (beta,))


LAYER_NORMS = {
    "x(N,T,D)-over(D)": ((2, 3, 4), (4,)),
    "x(N,H,W)-over(H,W)": ((2, 3, 4), (3, 4)),
    "x(N,C,H,W)-over(H,W)": ((2, 3, 4, 5), (4, 5)),
    "x(D)-over(D)": ((5,), (5,)),
}


@pytest.mark.parametrize("which", AFFINE)
@pytest.mark.parametrize("x_shape, normalized", list(LAYER_NORMS.values()), ids=list(LAYER_NORMS))
def test_layer_norm(x_shape, normalized, which):
    x = rand(*x_shape)
    check_rule(affine_case(lambda w, b: F.layer_norm(x, normalized, w, b, eps=1e-3), normalized, which))


GROUP_NORMS = {"x(N,C)": (3, 4), "x(N,C,L)": (3, 4, 5), "x(N,C,H,W)": (2, 4, 3, 3)}


@pytest.mark.parametrize("which", AFFINE)
@pytest.mark.parametrize("groups", [1, 2, 4], ids=["groups1", "groups2", "groups4"])
@pytest.mark.parametrize("x_shape", list(GROUP_NORMS.values()), ids=list(GROUP_NORMS))
def test_group_norm(x_shape, groups, which):
    x = rand(*x_shape)
    check_rule(affine_case(lambda w, b: F.group_norm(x, groups, w, b), (x_shape[1],), which))


BATCH_NORMS = {"x(N,C)": (5, 3), "x(N,C,L)": (3, 3, 4), "x(N,C,H,W)": (2, 3, 4, 5)}
BN_MODES = ["eval", "train-running", "train-nostats"]


@pytest.mark.parametrize("which", AFFINE)
@pytest.mark.parametrize("mode", BN_MODES)
@pytest.mark.parametrize("x_shape", list(BATCH_NORMS.values()), ids=list(BATCH_NORMS))
def test_batch_norm(x_shape, mode, which):
    channels = x_shape[1]
    x = rand(*x_shape)
    mean, var = rand(channels), 0.5 + rand(channels).abs()

    def op(w, b):
        if mode == "eval":
            return F.batch_norm(x, mean, var, w, b, False, 0.1, 1e-3)
        if mode == "train-running":
            # fresh copies: every call updates the running statistics it is given
            return F.batch_norm(x, mean.clone(), var.clone(), w, b, training=True, momentum=0.2)
        return F.batch_norm(x, None, None, w, b, training=True)

    check_rule(affine_case(op, (channels,), which))


# --------------------------------------------------------------------------------------------
# Elementwise
# --------------------------------------------------------------------------------------------

X_SHAPE = (2, 3, 4, 5)
P_SHAPES = {
    "p(1)": ((1,), X_SHAPE),
    "p(C,1,1)": ((3, 1, 1), X_SHAPE),
    "p(1,C,1,1)": ((1, 3, 1, 1), X_SHAPE),
    "p-full": (X_SHAPE, X_SHAPE),
    "p(H,W)-leading-missing": ((4, 5), X_SHAPE),
    "p(W)": ((5,), X_SHAPE),
    "p(3,1)-x(2,1,5)-both-broadcast": ((3, 1), (2, 1, 5)),
    "p-larger-than-x(4,5)": (X_SHAPE, (4, 5)),
}
TENSOR_OPS = {
    "x*p": lambda x, p: x * p,
    "p*x": lambda x, p: p * x,
    "torch.mul(x,p)": lambda x, p: torch.mul(x, p),
    "p.mul(x)": lambda x, p: p.mul(x),
    "p/x": lambda x, p: p / x,
    "torch.div(p,x)": lambda x, p: torch.div(p, x),
    "x+p": lambda x, p: x + p,
    "p+x": lambda x, p: p + x,
    "x-p": lambda x, p: x - p,
    "p-x": lambda x, p: p - x,
    "torch.add(x,p,alpha=2.5)": lambda x, p: torch.add(x, p, alpha=2.5),
    "torch.add(p,x,alpha=2.5)": lambda x, p: torch.add(p, x, alpha=2.5),
    "torch.sub(x,p,alpha=0.5)": lambda x, p: torch.sub(x, p, alpha=0.5),
    "torch.sub(p,x,alpha=0.5)": lambda x, p: torch.sub(p, x, alpha=0.5),
    "x.sub(p,alpha=-2)": lambda x, p: x.sub(p, alpha=-2),
}
NUMBER_OPS = {
    "p*3.0": lambda p: p * 3.0,
    "p*3": lambda p: p * 3,
    "torch.mul(p,-1.5)": lambda p: torch.mul(p, -1.5),
    "p/4.0": lambda p: p / 4.0,
    "p+1.5": lambda p: p + 1.5,
    "p-2.0": lambda p: p - 2.0,
    "torch.sub(p,2.0,alpha=3)": lambda p: torch.sub(p, 2.0, alpha=3),
}


@pytest.mark.parametrize("p_shape, x_shape", list(P_SHAPES.values()), ids=list(P_SHAPES))
@pytest.mark.parametrize("op", list(TENSOR_OPS.values()), ids=list(TENSOR_OPS))
def test_elementwise_tensor(op, p_shape, x_shape):
    x, p = nonzero(*x_shape), rand(*p_shape)
    check_rule(Case(lambda p: op(x, p), (p,)))


@pytest.mark.parametrize("p_shape", [(1,), (3, 1, 1), X_SHAPE], ids=["p(1)", "p(C,1,1)", "p-full"])
@pytest.mark.parametrize("op", list(NUMBER_OPS.values()), ids=list(NUMBER_OPS))
def test_elementwise_number(op, p_shape):
    check_rule(Case(op, (rand(*p_shape),)))


OTHER_DTYPES = {
    "x-int64": lambda shape: to_device(torch.randint(1, 9, shape)),
    "x-float32": lambda shape: nonzero(*shape).to(torch.float32),
    "x-float32-0dim": lambda shape: to_device(torch.tensor(3.0, dtype=torch.float32)),
}
MIXED_OPS = {"x*p": TENSOR_OPS["x*p"], "p*x": TENSOR_OPS["p*x"], "p/x": TENSOR_OPS["p/x"], "x+p": TENSOR_OPS["x+p"]}


@pytest.mark.parametrize("make_x", list(OTHER_DTYPES.values()), ids=list(OTHER_DTYPES))
@pytest.mark.parametrize("op", list(MIXED_OPS.values()), ids=list(MIXED_OPS))
def test_elementwise_other_dtype(op, make_x):
    """A float64 parameter with an integer or float32 other operand: ``y`` is float64 (type
    promotion), so the factors must be exact in float64 too."""
    x, p = make_x((2, 3)), rand(3)
    check_rule(Case(lambda p: op(x, p), (p,)))


def test_elementwise_bool_mask():
    mask = to_device(torch.tensor([[True, False, True], [False, True, True]]))
    check_rule(Case(lambda p: p * mask, (rand(3),)))


# --------------------------------------------------------------------------------------------
# Rules that must decline, and metadata-only uses
# --------------------------------------------------------------------------------------------


def _declines():
    x, p, W = nonzero(2, 3), nonzero(2, 3), rand(6, 3)
    indices = to_device(torch.tensor([0, 2, 5, 2]))
    image, kernel = rand(2, 3, 5, 5), rand(4, 3, 3, 3)
    signal, kernel1d, weight, batch, W3 = rand(2, 3, 6), rand(2, 3, 2), rand(4, 3), rand(2, 5, 3), rand(2, 3, 4)
    return {
        "x/p": (lambda p: x / p, (p,), 0),
        "torch.div(x,p)": (lambda p: torch.div(x, p), (p,), 0),
        "p/x-rounding": (lambda p: torch.div(p, x, rounding_mode="floor"), (p,), 0),
        "p*p": (lambda p: p * p, (p,), 0),
        "p+p": (lambda p: p + p, (p,), 0),
        "embedding-max_norm": (lambda W: F.embedding(indices, W, max_norm=1.0), (W,), 0),
        "embedding-scale_grad_by_freq": (lambda W: F.embedding(indices, W, scale_grad_by_freq=True), (W,), 0),
        "torch.exp(p)": (lambda p: torch.exp(p), (p,), 0),
        "p.pow(2)": (lambda p: p.pow(2), (p,), 0),
        "conv2d-input-param": (lambda image: F.conv2d(image, kernel), (image,), 0),
        "conv1d-input-param": (lambda signal: torch.conv1d(signal, kernel1d), (signal,), 0),
        "conv2d-input-and-weight": (lambda image, kernel: F.conv2d(image, kernel), (image, kernel), 0),
        "linear-input-param": (lambda x: F.linear(x, weight), (x,), 0),
        "matmul-both-sides": (lambda W: W.T @ W, (W,), 0),
        "matmul-W3d": (lambda W3: batch @ W3, (W3,), 0),
        "addmm-mat1-param": (lambda x: torch.addmm(weight[0, :2], x, weight[:3, :2]), (x,), 0),
        "addmm-2d-bias-param": (lambda p: torch.addmm(p, x, W[:3]), (p,), 0),
        "addmm-broadcast-bias-param": (lambda p: torch.addmm(p[:1, :1].reshape(1), x, W[:3]), (p,), 0),
        "layer_norm-input-param": (lambda x: F.layer_norm(x, (3,)), (x,), 0),
    }


DECLINES = _declines()


@pytest.mark.parametrize("name", list(DECLINES))
def test_rule_declines(name):
    fn, params, position = _declines()[name]
    recorder, y = record(fn, params)
    assert recorder.calls == []
    assert position in recorder.unruled
    torch.testing.assert_close(y, fn(*params))


METADATA = {
    "p.shape": lambda x, p: (x * 2).reshape(p.shape),
    "p.dim()": lambda x, p: x.sum(dim=p.dim() - 1),
    "p.size(0)/p.numel()": lambda x, p: x[: p.size(0)] * p.numel(),
    "x.view_as(p)": lambda x, p: x.view_as(p) + 1,
    "x.reshape_as(p)": lambda x, p: x.reshape_as(p),
    "x.to(p)": lambda x, p: x.to(p),
}


@pytest.mark.parametrize("use", list(METADATA.values()), ids=list(METADATA))
def test_metadata_only_uses(use):
    x, p = rand(2, 3), rand(3, 2)
    recorder, y = record(lambda p: use(x, p), (p,))
    assert recorder.calls == []
    assert recorder.unruled == set()
    torch.testing.assert_close(y, use(x, p))


# --------------------------------------------------------------------------------------------
# Views, slices and casts between a parameter and its consumer
# --------------------------------------------------------------------------------------------


def _views():
    features, channels = 4, 3
    x = rand(5, features)
    x32 = x.to(torch.float32)
    a = rand(5, channels * features)
    return {
        # consumer F.linear
        "linear(x,W.T)": Case(lambda W: F.linear(x, W.T), (rand(features, channels),), index={0: lambda i: i.T}),
        "linear(x,W.t())": Case(lambda W: F.linear(x, W.t()), (rand(features, channels),), index={0: lambda i: i.t()}),
        "linear(x,W[1:])": Case(
            lambda W: F.linear(x, W[1:]), (rand(channels + 1, features),), index={0: lambda i: i[1:]}
        ),
        "linear(x,W.chunk(2)[1])": Case(
            lambda W: F.linear(x, W.chunk(2)[1]), (rand(2 * channels, features),), index={0: lambda i: i.chunk(2)[1]}
        ),
        "linear(x,W.split([1,2])[0])": Case(
            lambda W: F.linear(x, W.split([1, 2])[0]), (rand(3, features),), index={0: lambda i: i[:1]}
        ),
        "linear(x,W.split([1,2])[1])": Case(
            lambda W: F.linear(x, W.split([1, 2])[1]), (rand(3, features),), index={0: lambda i: i[1:]}
        ),
        "linear(x32,W.to(float32))": Case(
            lambda W: F.linear(x32, W.to(torch.float32)), (rand(channels, features),), index={0: lambda i: None},
            tol=dict(rtol=1e-5, atol=1e-5),
        ),
        "linear(x,W.reshape(-1).view(C,I))": Case(
            lambda W: F.linear(x, W.reshape(-1).view(channels, features)), (rand(channels * features),),
            index={0: lambda i: i.view(channels, features)},
        ),
        "linear(x,W.T[1:])": Case(
            lambda W: F.linear(x, W.T[1:]), (rand(features, channels + 1),), index={0: lambda i: i.T[1:]}
        ),
        "linear(x,W.T,b[1:])-joint": Case(
            lambda W, b: F.linear(x, W.T, b[1:]), (rand(features, channels), rand(channels + 1)),
            joint=linear_joint, index={0: lambda i: i.T, 1: lambda i: i[1:]},
        ),
        # consumer matmul
        "x@W.T": Case(lambda W: x @ W.T, (rand(channels, features),), index={0: lambda i: i.T}),
        "torch.matmul(x,W[1:])": Case(
            lambda W: torch.matmul(x, W[1:]), (rand(features + 1, channels),), index={0: lambda i: i[1:]}
        ),
        "x.matmul(W.chunk(2)[1])": Case(
            lambda W: x.matmul(W.chunk(2)[1]), (rand(2 * features, channels),), index={0: lambda i: i[features:]}
        ),
        "W.t()@xT": Case(lambda W: W.t() @ x.T, (rand(features, channels),), index={0: lambda i: i.t()}),
        "W.split([1,2])[1]@xT": Case(
            lambda W: W.split([1, 2])[1] @ x.T, (rand(3, features),), index={0: lambda i: i[1:]}
        ),
        "x@W.reshape(-1)": Case(lambda W: x @ W.reshape(-1), (rand(2, 2),), index={0: lambda i: i.reshape(-1)}),
        "x32@W.to(float32)": Case(
            lambda W: x32 @ W.to(torch.float32), (rand(features, channels),), index={0: lambda i: None},
            tol=dict(rtol=1e-5, atol=1e-5),
        ),
        # consumer mul
        "x*W.reshape(-1)": Case(
            lambda W: a * W.reshape(-1), (rand(channels, features),), index={0: lambda i: i.reshape(-1)}
        ),
        "x*W.T": Case(lambda W: x * W.T, (rand(features, 5),), index={0: lambda i: i.T}),
        "x*W[1:]": Case(lambda W: x * W[1:], (rand(6, features),), index={0: lambda i: i[1:]}),
        "x*W.chunk(2)[1]": Case(lambda W: x * W.chunk(2)[1], (rand(2, features),), index={0: lambda i: i[1:]}),
        "x*W.split([1,2])[1]": Case(
            lambda W: x[:2, :2] * W.split([1, 2])[1], (rand(3, 2),), index={0: lambda i: i[1:]}
        ),
        # a broadcast view sees entries twice: ``index_add`` sums them, as the chain rule does
        "x*W.expand": Case(
            lambda W: x * W[None].expand(5, features), (rand(features),),
            index={0: lambda i: i[None].expand(5, features)},
        ),
        # the ATen overloads a traced graph calls (NOTE: [Unrolled derivatives])
        "aten.mm(x,aten.t(W))": Case(
            lambda W: aten.mm.default(x, aten.t.default(W)), (rand(channels, features),), index={0: lambda i: i.T}
        ),
        "aten.mm(g,aten.t(aten.t(W)))": Case(
            lambda W: aten.mm.default(a[:, :channels], aten.t.default(aten.t.default(W))),
            (rand(channels, features),), index={0: lambda i: None},
        ),
        "aten.addmm(b,x,aten.t(W))": Case(
            lambda W, b: aten.addmm.default(b, x, aten.t.default(W)), (rand(channels, features), rand(channels)),
            index={0: lambda i: i.T, 1: lambda i: None},
        ),
        "aten.mul(x,aten.view(W))": Case(
            lambda W: aten.mul.Tensor(a, aten.view.default(W, [channels * features])), (rand(channels, features),),
            index={0: lambda i: i.reshape(-1)},
        ),
        "aten.add(x,aten.unsqueeze(b))": Case(
            lambda b: aten.add.Tensor(x, aten.unsqueeze.default(b, 0)), (rand(features),),
            index={0: lambda i: i[None]},
        ),
    }


VIEWS = _views()


@pytest.mark.parametrize("name", list(VIEWS))
def test_views(name):
    case = _views()[name]
    check_rule(case)


# --------------------------------------------------------------------------------------------
# The rule registry
# --------------------------------------------------------------------------------------------


def custom_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w``, overridable like ``torch.nn.functional``'s functions: a function mode sees the call whole."""
    if has_torch_function_variadic(x, w):
        return handle_torch_function(custom_product, (x, w), x, w)
    return x @ w


@pytest.fixture
def custom_rule() -> Iterator[Callable]:
    """A rule for :func:`custom_product`, registered with the decorator for one test."""

    @rule(custom_product)
    def custom_product_rule(func, args, kwargs, ref_of):
        x, w = args
        ref = ref_of(w)
        if ref is None or ref_of(x) is not None:
            return None
        output = func(*args, **kwargs)

        def build():
            role = Role(
                (ref,), "custom weight", tuple(output.shape), "sj", [(x.detach().clone(), "si")], "ij", tuple(w.shape),
                local=lambda w: func(x, w), seen=w,
            )
            return [role], None

        return RuleCall(output, build)

    yield custom_product_rule
    if rule_for(custom_product) is custom_product_rule:  # the test may have unregistered it
        unregister(custom_product)


def test_registered_rule_is_found_by_the_recorder(custom_rule):
    assert rule_for(custom_product) is custom_rule and RULES[custom_product] is custom_rule
    x = rand(5, 4)
    case = Case(lambda w: custom_product(x, w), (rand(4, 3),))
    check_rule(case)
    recorder, _ = record(case.fn, case.params)
    assert [role.name for role in recorder.calls[0].roles()[0]] == ["custom weight"]

    unregister(custom_product)
    assert rule_for(custom_product) is None and custom_product not in RULES
    # without its rule the function is entered like any Python composite: its ``@`` meets the matmul rule
    recorder, _ = record(case.fn, case.params)
    assert [role.name for role in recorder.calls[0].roles()[0]] == ["matmul operand"]


def test_registering_a_function_twice_is_an_error(custom_rule):
    def another_rule(func, args, kwargs, ref_of):
        return None

    message = r"custom_product already has the derivative rule \S*custom_product_rule; cannot register \S*another_rule"
    with pytest.raises(ValueError, match=message + r" for it too \(unregister the first one to replace it\)"):
        rule(custom_product)(another_rule)
    with pytest.raises(ValueError, match=r"^torch\.matmul already has the derivative rule .*\.matmul\.matmul_rule"):
        rule(torch.exp, torch.matmul)(another_rule)
    assert rule_for(torch.exp) is None, "a failed registration registers none of its functions"
    with pytest.raises(ValueError, match=r"torch\.exp is named twice"):
        rule(torch.exp, torch.exp)(another_rule)
    assert rule_for(torch.exp) is None
    with pytest.raises(ValueError, match="at least one function"):
        rule()
    with pytest.raises(KeyError, match=r"no derivative rule is registered for torch\.exp"):
        unregister(custom_product, torch.exp)
    assert rule_for(custom_product) is custom_rule, "a failed unregistration removes none of its functions"
    with pytest.raises(TypeError, match="does not support item assignment"):
        RULES[torch.exp] = another_rule  # the table is read-only: rules are registered with rule()


@pytest.mark.cpu_only("runs a fresh Python process that only imports torchntk: no tensors, nothing on a device")
def test_importing_torchntk_registers_every_rule_module():
    """Each module of ``rules/`` registers its rules on import; ``import torchntk`` must import them all."""
    package = pathlib.Path(rules_package.__file__).parent
    modules = sorted(f"{rules_package.__name__}.{path.stem}" for path in package.glob("[!_]*.py"))
    code = (
        "import sys, torchntk; "
        "registry = sys.modules['torchntk._implementations.structured.rules._registry']; "
        "print(sorted({rule.__module__ for rule in registry.RULES.values()}))"
    )
    root = pathlib.Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip() == str(modules)
