"""Structured derivatives (``implementation=3``) against Jacobian contraction (``implementation=1``).

Every kernel here is float64 and must match implementation 1 to a relative tolerance of 1e-10
(atol 1e-10 times the kernel's largest entry), over the models of ``tests/structured_cases.py``
and every combination of trace/diagonal axes, ``x2`` given or ``None``, and ``vmap_axes`` 0 or
``None``. The batch-coupled case (BatchNorm in training mode) runs with ``vmap_axes=None`` only,
the "coupled mode", and must also match implementation 1. Implementation 1's kernels are cached,
and the case models are checked against the brute-force ``torchntk.testing.reference_ntk``, so
implementation 1 is an independently validated reference here.

Also tested: ``empirical_kernel_fn`` with ``implementation=3``; the builder's testing knobs
(``structure_rules``, ``closed_form_rules``, ``local_jacobian``, ``verify``); ``verify=True``
catching a parameter use hidden from the recorder; and ``implementation=0`` (AUTO) choosing
structured derivatives for a wide MLP.

Models and inputs live on the run device (``pytest --device``), inputs drawn on the CPU and moved.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

import torchntk
from tests.cases import DEVICE, to_device
from tests.structured_cases import N1, N2, STRUCTURED_CASES, make_x1_x2
from torchntk import NtkImplementation
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_nngp, reference_ntk

STRUCTURED = 3
REFERENCE = 1

pytestmark = [
    # BatchNorm in training mode is the point of the "batchnorm_train" case.
    pytest.mark.filterwarnings("ignore:.*batch statistics:UserWarning"),
    # conv_padding_modes uses padding='same' with an even kernel on purpose.
    pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning"),
    # functorch has no batching rule for PyTorch's fused attention kernels (vmap falls back).
    pytest.mark.filterwarnings(
        "ignore:There is a performance drop because we have not yet implemented the batching rule"
        ":UserWarning"
    ),
]

CASE_IDS = sorted(STRUCTURED_CASES)
TRACES = ["full", "traced"]  # trace_axes=() or the case's own trace axes
DIAGONALS = {"nodiag": (), "diag0": (0,)}
SAMES = {"x2": False, "x2=None": True}


# --------------------------------------------------------------------------------------------
# Cached cases, inputs and reference kernels
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _case(case_id: str):
    case = STRUCTURED_CASES[case_id]()
    x1, x2 = make_x1_x2(case)
    # A diagonal batch axis needs as many x2 examples as x1 ones: a second x2 with N1 examples.
    x2_square = case.make_inputs(N1, torch.Generator().manual_seed(1))
    return case, x1, x2, x2_square


def _inputs(case_id: str, same: bool, diagonal_axes: tuple):
    _, x1, x2, x2_square = _case(case_id)
    if same:
        return x1, None
    return x1, (x2_square if 0 in diagonal_axes else x2)


def _trace_axes(case_id: str, trace: str) -> tuple:
    return () if trace == "full" else _case(case_id)[0].trace_axes


@functools.lru_cache(maxsize=None)
def _reference(case_id: str, trace_axes: tuple, diagonal_axes: tuple, same: bool):
    """Implementation 1 without vmap_axes (valid for every case, coupled or not)."""
    case = _case(case_id)[0]
    x1, x2 = _inputs(case_id, same, diagonal_axes)
    ntk_fn = torchntk.empirical_ntk_fn(
        case.module, trace_axes=trace_axes, diagonal_axes=diagonal_axes, implementation=REFERENCE
    )
    return ntk_fn(x1, x2)


def _structured(case_id: str, trace_axes=None, diagonal_axes=(), vmap_axes=0, same=False, **knobs):
    case = _case(case_id)[0]
    trace_axes = case.trace_axes if trace_axes is None else trace_axes
    x1, x2 = _inputs(case_id, same, diagonal_axes)
    ntk_fn = torchntk.empirical_ntk_fn(
        case.module, trace_axes=trace_axes, diagonal_axes=diagonal_axes, vmap_axes=vmap_axes,
        implementation=STRUCTURED, **knobs,
    )
    snapshot = ModuleSnapshot.of(case.module)  # the models include BatchNorm in training mode
    kernel = ntk_fn(x1, x2)
    snapshot.assert_unchanged()
    return kernel


def _assert_close(actual, expected, tolerance: float) -> None:
    """Leaf by leaf: rtol = tolerance, atol = tolerance * max|expected leaf|."""
    actual_leaves, actual_spec = pytree.tree_flatten(actual)
    expected_leaves, expected_spec = pytree.tree_flatten(expected)
    assert actual_spec == expected_spec, f"structures differ: {actual_spec} vs {expected_spec}"
    for a, e in zip(actual_leaves, expected_leaves):
        scale = e.abs().max().item() if e.numel() else 1.0
        assert_kernels_close(a, e, rtol=tolerance, atol=tolerance * (scale or 1.0))


def _vmap_params():
    """(case_id, vmap_axes): vmap_axes=0 only where the case promises batch independence."""
    params = []
    for case_id in CASE_IDS:
        for vmap_axes in (None, 0):
            if vmap_axes == 0 and not _case(case_id)[0].batch_independent:
                continue
            mode = "vmap0" if vmap_axes == 0 else ("no-vmap" if _case(case_id)[0].batch_independent else "coupled")
            params.append(pytest.param(case_id, vmap_axes, id=f"{case_id}-{mode}"))
    return params


# --------------------------------------------------------------------------------------------
# The cases themselves (implementation 1 only: these run before implementation 3 exists)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_case_is_float64_and_as_described(case_id):
    case, x1, _, _ = _case(case_id)
    assert case.id == case_id
    assert all(p.dtype == torch.float64 for p in case.module.parameters())
    assert case.module.training == (case_id == "batchnorm_train")
    outputs = pytree.tree_leaves(case.module(x1))
    assert tuple(tuple(o.shape) for o in outputs) == tuple(
        tuple(N1 if d == -1 else d for d in shape) for shape in case.output_shapes
    )
    if case.batch_independent:
        singles = [case.module(pytree.tree_map(lambda v, i=i: v[i : i + 1], x1)) for i in range(N1)]
        stacked = pytree.tree_leaves(pytree.tree_map(lambda *s: torch.cat(s), *singles))
        for whole, joined in zip(outputs, stacked):
            torch.testing.assert_close(whole, joined, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_reference_implementation_matches_brute_force(case_id):
    """Implementation 1 (the reference below) equals torchntk.testing.reference_ntk."""
    case, x1, x2, _ = _case(case_id)
    for trace_axes in ((), case.trace_axes):
        expected = reference_ntk(case.module, x1, x2, trace_axes=trace_axes)
        assert_kernels_close(_reference(case_id, trace_axes, (), False), expected)


def test_transformer_case_can_take_the_fused_attention_fast_path():
    """In eval mode, a plain forward without autograd sends the self-attention through the fused
    ``torch._native_multi_head_attention`` (no derivative formulas). Under reverse mode or a
    TorchFunctionMode it does not; the case keeps q is k is v so this path stays reachable."""
    case, x1, _, _ = _case("transformer_block")
    calls = []
    fused = torch._native_multi_head_attention

    def spy(*args, **kwargs):
        calls.append(True)
        return fused(*args, **kwargs)

    torch._native_multi_head_attention = spy
    try:
        with torch.no_grad():
            case.module(x1)
        took_fast_path = bool(calls)
        calls.clear()
        with torch.no_grad(), _Recorder():
            case.module(x1)
    finally:
        torch._native_multi_head_attention = fused
    assert took_fast_path and not calls


# --------------------------------------------------------------------------------------------
# Implementation 3 against implementation 1
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("same", SAMES.values(), ids=SAMES.keys())
@pytest.mark.parametrize("diagonal", DIAGONALS.values(), ids=DIAGONALS.keys())
@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("case_id, vmap_axes", _vmap_params())
def test_structured_matches_jacobian_contraction(case_id, vmap_axes, trace, diagonal, same):
    trace_axes = _trace_axes(case_id, trace)
    actual = _structured(case_id, trace_axes, diagonal, vmap_axes, same)
    assert_kernels_close(actual, _reference(case_id, trace_axes, diagonal, same))


TRANSFORMER_MIDDLE_AXIS = {  # output (N, T, V): trace and diagonal of the token axis T too
    "trace1": ((1,), ()),
    "trace1-diag0": ((1,), (0,)),
    "trace1,2": ((1, -1), ()),
    "diag1": ((), (1,)),
    "trace2-diag1": ((-1,), (1,)),
    "diag0,1": ((), (0, 1)),
}


@pytest.mark.parametrize("same", SAMES.values(), ids=SAMES.keys())
@pytest.mark.parametrize("vmap_axes", [None, 0], ids=["no-vmap", "vmap0"])
@pytest.mark.parametrize("axes", TRANSFORMER_MIDDLE_AXIS.values(), ids=TRANSFORMER_MIDDLE_AXIS.keys())
def test_structured_transformer_token_axis(axes, vmap_axes, same):
    trace_axes, diagonal_axes = axes
    actual = _structured("transformer_block", trace_axes, diagonal_axes, vmap_axes, same)
    assert_kernels_close(actual, _reference("transformer_block", trace_axes, diagonal_axes, same))


def test_structured_rejects_vmap_axes_for_a_batch_coupled_model():
    """Like every implementation: vmap_axes promises independence that BatchNorm (train) breaks."""
    with pytest.raises(ValueError, match="BatchNorm1d at '1' normalises with batch statistics"):
        _structured("batchnorm_train", vmap_axes=0)


@pytest.mark.parametrize("case_id", ["transformer_block", "tuple_output"])
def test_structured_kernel_fn_ntk_and_nngp(case_id):
    case, x1, x2, _ = _case(case_id)
    kernel_fn = torchntk.empirical_kernel_fn(case.module, vmap_axes=0, implementation=STRUCTURED)
    result = kernel_fn(x1, x2, ("ntk", "nngp"))
    ntk = _reference(case_id, case.trace_axes, (), False)
    nngp = reference_nngp(case.module, x1, x2, trace_axes=case.trace_axes)
    if isinstance(ntk, torch.Tensor):
        assert result._fields == ("ntk", "nngp")
        assert_kernels_close(result.ntk, ntk)
        assert_kernels_close(result.nngp, nngp)
    else:  # one EmpiricalKernel per output leaf
        assert type(result) is type(ntk) and len(result) == len(ntk)
        for leaf_result, leaf_ntk, leaf_nngp in zip(result, ntk, nngp):
            assert_kernels_close(leaf_result.ntk, leaf_ntk)
            assert_kernels_close(leaf_result.nngp, leaf_nngp)
    assert_kernels_close(kernel_fn(x1, None, "ntk"), _reference(case_id, case.trace_axes, (), True))


# --------------------------------------------------------------------------------------------
# Testing knobs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("case_id", ["cnn_stride_dilation_groups", "transformer_block", "mixed_ruled_unruled"])
def test_without_structure_rules_equals_jacobian_contraction(case_id, trace):
    trace_axes = _trace_axes(case_id, trace)
    actual = _structured(case_id, trace_axes, structure_rules=False)
    _assert_close(actual, _reference(case_id, trace_axes, (), False), 1e-12)


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("case_id", ["conv_padding_modes", "resnet_bn_eval", "transformer_block"])
def test_without_closed_form_rules_equals_default(case_id, trace):
    """Op-local dense Jacobians in place of the closed forms give the same kernel."""
    trace_axes = _trace_axes(case_id, trace)
    default = _structured(case_id, trace_axes)
    assert_kernels_close(_structured(case_id, trace_axes, closed_form_rules=False), default)
    assert_kernels_close(default, _reference(case_id, trace_axes, (), False))


@pytest.mark.parametrize("local_jacobian", ["forward", "reverse"])
@pytest.mark.parametrize("case_id", ["mixed_ruled_unruled", "tied_embedding_lm"])
def test_local_jacobian_modes(case_id, local_jacobian):
    """``tied_embedding_lm``: forward-mode AD of F.embedding moves the padding row's tangent
    (reverse mode gives that row no gradient); the kernel must follow reverse mode regardless."""
    actual = _structured(case_id, (), closed_form_rules=False, local_jacobian=local_jacobian)
    assert_kernels_close(actual, _reference(case_id, (), (), False))


@pytest.mark.parametrize(
    "case_id, vmap_axes",
    [
        ("mlp", 0),
        ("resnet_bn_eval", 0),
        ("transformer_block", 0),
        ("cross_attention", 0),
        ("tied_embedding_lm", None),
        ("mixed_ruled_unruled", 0),
        ("batchnorm_train", None),
    ],
)
def test_verify_passes(case_id, vmap_axes):
    actual = _structured(case_id, vmap_axes=vmap_axes, verify=True)
    assert_kernels_close(actual, _reference(case_id, _case(case_id)[0].trace_axes, (), False))


def test_kernel_fn_takes_the_knobs():
    case, x1, x2, _ = _case("linear_twice")
    kernel_fn = torchntk.empirical_kernel_fn(
        case.module, trace_axes=(), vmap_axes=0, implementation=STRUCTURED,
        closed_form_rules=False, local_jacobian="reverse", verify=True,
    )
    assert_kernels_close(kernel_fn(x1, x2, "ntk"), _reference("linear_twice", (), (), False))
    exact = torchntk.empirical_kernel_fn(
        case.module, trace_axes=(), vmap_axes=0, implementation=STRUCTURED, structure_rules=False
    )
    _assert_close(exact(x1, x2, "ntk"), _reference("linear_twice", (), (), False), 1e-12)


class _HiddenScale(nn.Module):
    """Uses ``scale`` (and produces ``h``) under DisableTorchFunction: invisible to a mode."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)
        self.scale = nn.Parameter(torch.linspace(0.5, 2.0, 5))
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.linear(x))
        with torch._C.DisableTorchFunction():
            h = h * self.scale
        return self.head(h)


class _Recorder(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, pytree.tree_leaves((args, kwargs))))
        return func(*args, **kwargs)


def test_verify_catches_a_parameter_use_hidden_from_the_recorder():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = _HiddenScale().double().to(DEVICE).eval()
    x1 = to_device(torch.randn(N1, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    x2 = to_device(torch.randn(N2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)))
    with _Recorder() as recorder:
        module(x1)
    # The premise: a TorchFunctionMode never sees the multiplication by `scale`.
    assert recorder.calls
    assert not any(leaf is module.scale for _, leaves in recorder.calls for leaf in leaves)
    assert not any(getattr(func, "__name__", "") in ("mul", "__mul__") for func, _ in recorder.calls)

    # Autograd does see it: the model is fine, only the recorder is blind to `scale`.
    assert_kernels_close(
        torchntk.empirical_ntk_fn(module, vmap_axes=0, implementation=REFERENCE)(x1, x2),
        reference_ntk(module, x1, x2),
    )
    with pytest.raises(ValueError, match="structured derivatives disagree with autograd for parameter 'scale': "
                                         "no operation the recorder saw consumes it"):
        torchntk.empirical_ntk_fn(module, vmap_axes=0, implementation=STRUCTURED, verify=True)(x1, x2)


# --------------------------------------------------------------------------------------------
# AUTO
# --------------------------------------------------------------------------------------------


def test_auto_picks_structured_derivatives_for_a_wide_mlp():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = nn.Sequential(
            nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        ).double().to(DEVICE).eval()
    generator = torch.Generator().manual_seed(0)
    x1 = to_device(torch.randn(8, 64, dtype=torch.float64, generator=generator))
    x2 = to_device(torch.randn(8, 64, dtype=torch.float64, generator=generator))

    auto_fn = torchntk.empirical_ntk_fn(module, trace_axes=(), vmap_axes=0, implementation=0)
    choice = auto_fn.auto_choice(x1, x2)
    assert choice.implementation == NtkImplementation.STRUCTURED_DERIVATIVES
    assert isinstance(choice.implementation, NtkImplementation)
    assert auto_fn.auto_choice(x1, x2) is choice  # cached

    structured = torchntk.empirical_ntk_fn(module, trace_axes=(), vmap_axes=0, implementation=STRUCTURED)(x1, x2)
    assert_kernels_close(auto_fn(x1, x2), structured)
    assert auto_fn.auto_choice(x1, x2) is choice
    # An independent check at this width: NTK-vector products (cheap for an MLP).
    products = torchntk.empirical_ntk_fn(module, trace_axes=(), vmap_axes=0, implementation=2)(x1, x2)
    assert_kernels_close(structured, products)


# --------------------------------------------------------------------------------------------
# The plan: cached per input shapes, checked on every pass
# --------------------------------------------------------------------------------------------


def test_plan_follows_parameters_frozen_between_calls():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double().to(DEVICE)
    x1, x2 = to_device((torch.randn(3, 4, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64)))
    structured = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=3)
    structured(x1, x2)
    model[0].weight.requires_grad_(False)
    expected = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0)(x1, x2)
    assert_kernels_close(structured(x1, x2), expected)


class _DataDependentBranch(torch.nn.Module):
    """Uses ``extra`` only for batches with a positive mean, so x1 and x2 run different ops."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)
        self.extra = torch.nn.Linear(3, 3)

    def forward(self, x):
        h = torch.tanh(self.linear(x))
        return self.extra(h) if x.mean() > 0 else h


def test_operations_that_differ_between_x1_and_x2_are_re_planned():
    torch.manual_seed(0)
    model = _DataDependentBranch().double().to(DEVICE)
    x1 = to_device(-torch.rand(3, 4, dtype=torch.float64))  # plan probed here: `extra` unused
    x2 = to_device(torch.rand(2, 4, dtype=torch.float64))  # `extra` used
    expected = torchntk.empirical_ntk_fn(model, trace_axes=())(x1, x2)
    assert_kernels_close(torchntk.empirical_ntk_fn(model, trace_axes=(), implementation=3)(x1, x2), expected)


# --------------------------------------------------------------------------------------------
# Doing less work: merged uses and one pass for both sides (docs/structured.md)
# --------------------------------------------------------------------------------------------


def _recurrent_case():
    case = STRUCTURED_CASES["recurrent_cell"]()
    return case, *make_x1_x2(case)


@pytest.mark.parametrize("trace", TRACES)
def test_the_uses_of_a_recurrent_weight_are_merged_into_one_contraction(monkeypatch, trace):
    from torchntk._implementations.structured import _contract

    counts = []
    merged_factors = _contract.merged_factors

    def counting(factors, mapped, pays=None):
        merged = merged_factors(factors, mapped, pays)
        counts.append((len(factors.uses), len(merged.uses)))
        return merged

    monkeypatch.setattr(_contract, "merged_factors", counting)
    case, x1, x2 = _recurrent_case()
    trace_axes = () if trace == "full" else case.trace_axes
    kernel = torchntk.empirical_ntk_fn(case.module, trace_axes=trace_axes, vmap_axes=0, implementation=3)(x1, x2)
    # 6 steps x (input, hidden) joint weight+bias uses and the head: one use per parameter pair
    assert counts and set(counts) == {(13, 3)}
    assert_kernels_close(kernel, reference_ntk(case.module, x1, x2, trace_axes=trace_axes))


@pytest.mark.parametrize("same", list(SAMES.values()), ids=list(SAMES))
def test_uses_contracted_pair_by_pair_when_merging_does_not_pay(monkeypatch, same):
    from torchntk._implementations.structured import _contract

    monkeypatch.setattr(_contract, "merge_pays", lambda layout, out_axis: lambda single, stacked, count: False)
    case, x1, x2 = _recurrent_case()
    x2 = None if same else x2
    kernel = torchntk.empirical_ntk_fn(case.module, trace_axes=(), vmap_axes=0, implementation=3)(x1, x2)
    assert_kernels_close(kernel, reference_ntk(case.module, x1, x2, trace_axes=()))


def _counting_passes(monkeypatch) -> list[int]:
    from torchntk._implementations import structured

    sizes: list[int] = []
    side_factors = structured.side_factors

    def counting(side, *args, **kwargs):
        sizes.append(side.batch_size() if side.mapped else -1)
        return side_factors(side, *args, **kwargs)

    monkeypatch.setattr(structured, "side_factors", counting)
    return sizes


def test_x1_and_x2_share_one_pass_when_only_their_examples_differ(monkeypatch):
    passes = _counting_passes(monkeypatch)
    case, x1, x2, _ = _case("mlp")
    kernel = torchntk.empirical_ntk_fn(case.module, trace_axes=(), vmap_axes=0, implementation=3)(x1, x2)
    assert passes == [N1 + N2]
    assert_kernels_close(kernel, reference_ntk(case.module, x1, x2, trace_axes=()))


def test_x1_and_x2_of_different_shapes_take_a_pass_each(monkeypatch):
    passes = _counting_passes(monkeypatch)
    case, x1, _ = _recurrent_case()
    x2 = to_device(torch.randn(N2, 4, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64))  # 4 steps
    kernel = torchntk.empirical_ntk_fn(case.module, trace_axes=(), vmap_axes=0, implementation=3)(x1, x2)
    assert passes[-2:] == [N2, N1]
    assert_kernels_close(kernel, reference_ntk(case.module, x1, x2, trace_axes=()))


_TENSOR = torch.ones(2)
_NAMED = torch.return_types.max((torch.ones(1), torch.zeros(1, dtype=torch.long)))


@pytest.mark.parametrize(
    "args, kwargs",
    [
        ((_TENSOR, 1, [_TENSOR, _TENSOR], None), {"dim": 0}),
        ((_TENSOR, "mean", torch.float32, torch.device("cpu")), {"out": None}),
        ((_TENSOR,), {"layout": torch.strided, "memory_format": torch.contiguous_format}),
        ((_TENSOR, torch.Size([2, 1])), {}),  # a tuple subclass: pytree's way
        (([_TENSOR, (_TENSOR, 2.0)],), {"nested": {"inner": _TENSOR}}),
        ((_NAMED,), {}),
        ((), {}),
    ],
    ids=["flat", "scalars", "layout", "size", "nested", "named-tuple", "empty"],
)
def test_the_argument_leaves_the_modes_read_are_pytrees(args, kwargs):
    """The recorder's and the counting mode's walk of an op's arguments (and, as ``((result,),
    {})``, of its result) is pytree's, leaf for leaf."""
    from torchntk._utils.tree import argument_leaves

    fast, reference = argument_leaves(args, kwargs), pytree.tree_leaves((args, kwargs))
    assert len(fast) == len(reference) and all(one is two for one, two in zip(fast, reference))
    result = (args, kwargs)
    fast, reference = argument_leaves((result,), {}), pytree.tree_leaves(result)
    assert len(fast) == len(reference) and all(one is two for one, two in zip(fast, reference))
