"""The decompositions of fused kernels (``torchntk/_model/unfused.py``) and their use by the kernels.

NOTE: [Unfused kernels] in ``torchntk/_model/unfused.py``. The decompositions are checked against the
fused kernels they replace (outputs, final states and gradients, float64, every call option), the
forward-mode context on the modules whose kernels lack forward-mode derivatives, and the kernel
functions on recurrent models against the float64 oracle :func:`torchntk.testing.reference_ntk`.

Modules and inputs live on the run device (``pytest --device``), random values drawn on the CPU and
moved, so every device sees the same numbers; there the fused kernels are the device's own (cuDNN
on CUDA), and the decompositions must match them just the same. Which fused kernels lack a
forward-mode derivative depends on the device: that is checked on the CPU only.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import re
import threading
import warnings
from typing import Any, Callable
from unittest import mock

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

import torchntk
from tests.cases import to_device
from torchntk import NtkImplementation
from torchntk._implementations import auto as auto_module
from torchntk._implementations import ntk_vector_products as nvp
from torchntk._model.functional import functional_model
from torchntk._model import unfused as _unfused
from torchntk._model.unfused import Unfused, forward_mode_kernels, fused_layers
from torchntk.testing import assert_kernels_close, reference_ntk

F64 = torch.float64
INPUT, HIDDEN, STEPS, BATCH = 3, 5, 4, 3

FUSED = {"lstm": torch._VF.lstm, "gru": torch._VF.gru, "rnn_tanh": torch._VF.rnn_tanh, "rnn_relu": torch._VF.rnn_relu}
DECOMPOSED = {"lstm": _unfused.lstm, "gru": _unfused.gru, "rnn_tanh": _unfused.rnn_tanh, "rnn_relu": _unfused.rnn_relu}


class _Seen(TorchFunctionMode):
    """Records the functions that reach it (put it outside :class:`Unfused` to see what that lets through)."""

    def __init__(self) -> None:
        super().__init__()
        self.functions: list[Callable] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.functions.append(func)
        return func(*args, **(kwargs or {}))


def _recurrent_module(kind: str, device: torch.device, **options: Any) -> nn.RNNBase:
    """A float64 recurrent layer on ``device``, its parameters drawn on the CPU from seed 0."""
    torch.manual_seed(0)
    if kind == "lstm":
        module = nn.LSTM(INPUT, HIDDEN, **options)
    elif kind == "gru":
        module = nn.GRU(INPUT, HIDDEN, **options)
    else:
        module = nn.RNN(INPUT, HIDDEN, nonlinearity=kind.removeprefix("rnn_"), **options)
    return module.to(F64).to(device)


def _call_arguments(module: nn.RNNBase, batch_first: bool, generator: torch.Generator) -> tuple:
    """The non-packed ``torch._VF`` call of ``module`` on random input and states (all float64,
    drawn from the CPU ``generator`` and moved to the module's device)."""
    directions = 2 if module.bidirectional else 1
    shape = (BATCH, STEPS, INPUT) if batch_first else (STEPS, BATCH, INPUT)
    x = torch.randn(shape, generator=generator, dtype=F64)
    units = module.num_layers * directions
    h0 = torch.randn(units, BATCH, module.proj_size or HIDDEN, generator=generator, dtype=F64)
    hx: Any = h0
    if isinstance(module, nn.LSTM):
        hx = (h0, torch.randn(units, BATCH, HIDDEN, generator=generator, dtype=F64))
    x, hx = (pytree.tree_map(lambda t: t.to(module.weight_ih_l0.device), part) for part in (x, hx))
    return x, hx, list(module._flat_weights), module.bias, module.num_layers, module.dropout, module.training, \
        module.bidirectional, batch_first


def _option_cases() -> list[tuple]:
    cases = []
    for kind, layers, bidirectional, batch_first, bias in itertools.product(
        FUSED, (1, 2), (False, True), (False, True), (True, False)
    ):
        projections = (0, 2) if kind == "lstm" else (0,)
        for proj_size in projections:
            cases.append((kind, layers, bidirectional, batch_first, bias, proj_size))
    return cases


def _case_id(case: tuple) -> str:
    kind, layers, bidirectional, batch_first, bias, proj_size = case
    parts = [kind, f"L{layers}", "bi" if bidirectional else "uni", "bf" if batch_first else "tm"]
    parts += ["bias" if bias else "nobias"] + ([f"proj{proj_size}"] if proj_size else [])
    return "-".join(parts)


def _differentiable(arguments: tuple) -> list[Tensor]:
    """The tensors of a ``torch._VF`` call (input, states, weights), made leaves that require grad."""
    return [t for t in pytree.tree_leaves(arguments[:3]) if isinstance(t, Tensor)]


def _with_grad(arguments: tuple) -> tuple:
    x, hx, params = (pytree.tree_map(lambda t: t.detach().requires_grad_(), part) for part in arguments[:3])
    return (x, hx, params) + tuple(arguments[3:])


def _assert_same_call(kind: str, arguments: tuple) -> None:
    """Outputs, final states and the gradients of all three with respect to every tensor agree."""
    expected_arguments, actual_arguments = _with_grad(arguments), _with_grad(arguments)
    # cuDNN's recurrent backward refuses eval mode (train=False): the fused kernel then runs
    # PyTorch's own CUDA kernels, as torchntk runs it (_model/unfused.recurrent_layers_without_cudnn)
    on_cuda = arguments[0].is_cuda and not arguments[6]
    with (_unfused.recurrent_layers_without_cudnn() if on_cuda else contextlib.nullcontext()):
        expected = FUSED[kind](*expected_arguments)
    actual = DECOMPOSED[kind](*actual_arguments)
    assert actual is not NotImplemented
    assert len(actual) == len(expected)
    for one, two in zip(actual, expected):
        torch.testing.assert_close(one, two, rtol=1e-12, atol=1e-12)
    generator = torch.Generator().manual_seed(3)
    cotangents = [torch.randn(t.shape, generator=generator, dtype=F64).to(t.device) for t in expected]
    grads_expected = torch.autograd.grad(expected, _differentiable(expected_arguments), cotangents, allow_unused=True)
    grads_actual = torch.autograd.grad(actual, _differentiable(actual_arguments), cotangents, allow_unused=True)
    for one, two in zip(grads_actual, grads_expected):
        torch.testing.assert_close(one, two, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Recurrent decompositions against the fused kernels
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", _option_cases(), ids=_case_id)
def test_recurrent_decomposition_matches_the_fused_kernel(case, device):
    kind, layers, bidirectional, batch_first, bias, proj_size = case
    extra = {"proj_size": proj_size} if proj_size else {}
    module = _recurrent_module(kind, device, num_layers=layers, bidirectional=bidirectional, bias=bias, **extra)
    arguments = _call_arguments(module, batch_first, torch.Generator().manual_seed(1))
    _assert_same_call(kind, arguments)


@pytest.mark.parametrize("kind", list(FUSED))
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_dropout_between_layers_is_decomposed_only_where_it_draws_nothing(kind, train, device):
    """``dropout > 0`` with ``train=False``, or ``dropout=0`` with ``train=True``: decomposed."""
    module = _recurrent_module(kind, device, num_layers=2, dropout=0.0 if train else 0.5)
    arguments = list(_call_arguments(module, False, torch.Generator().manual_seed(1)))
    arguments[6] = train
    _assert_same_call(kind, tuple(arguments))


@pytest.mark.parametrize("kind", list(FUSED))
def test_random_dropout_and_packed_sequences_run_the_fused_kernel(kind, device):
    module = _recurrent_module(kind, device, num_layers=2, dropout=0.5)
    arguments = list(_call_arguments(module, False, torch.Generator().manual_seed(1)))
    arguments[6] = True
    assert DECOMPOSED[kind](*arguments) is NotImplemented

    module.eval()
    lengths = torch.tensor([4, 3, 1])  # on the CPU, as pack_padded_sequence requires
    packed = nn.utils.rnn.pack_padded_sequence(to_device(torch.randn(STEPS, BATCH, INPUT, dtype=F64)), lengths)
    seen = _Seen()
    with seen, Unfused():
        output, _ = module(packed)
    assert FUSED[kind] in seen.functions, "the packed form reaches the fused kernel"
    torch.testing.assert_close(output.data, module(packed)[0].data)


_MALFORMED = {
    "hidden_state_batch": lambda x, hx: (x, hx[:, :2]),
    "input_features": lambda x, hx: (x[..., :2], hx),
    "input_dtype": lambda x, hx: (x.float(), hx),
    "unbatched_input": lambda x, hx: (x[:, 0], hx[:, 0]),  # the modules unsqueeze it; the kernel does not
}
# What the fused CPU kernel says about each (PyTorch's own messages; other devices' kernels word theirs otherwise).
_FUSED_ERRORS = {
    "hidden_state_batch": r"The size of tensor a \(2\) must match the size of tensor b \(3\)",
    "input_features": "mat1 and mat2 shapes cannot be multiplied",
    "input_dtype": "mat1 and mat2 must have the same dtype",
    "unbatched_input": "Dimension out of range",
}


def _outcome(call: Callable[[], Any]) -> Any:
    """What ``call()`` returns, or the exception it raises."""
    try:
        return call()
    except Exception as error:  # noqa: BLE001 - whatever the kernel raises is the outcome to compare
        return error


@pytest.mark.parametrize("malformed", list(_MALFORMED))
def test_calls_the_fused_kernel_rejects_give_its_own_error(malformed, device):
    """The decomposition declines these calls; under the mode the fused kernel then runs, with its own outcome."""
    module = _recurrent_module("gru", device)
    x, hx, *rest = _call_arguments(module, False, torch.Generator().manual_seed(1))
    x, hx = _MALFORMED[malformed](x, hx)
    assert _unfused.gru(x, hx, *rest) is NotImplemented
    fused = _outcome(lambda: torch._VF.gru(x, hx, *rest))
    with Unfused():
        unfused = _outcome(lambda: torch._VF.gru(x, hx, *rest))
    if device.type == "cpu":
        assert isinstance(fused, (RuntimeError, IndexError)), fused
        assert re.search(_FUSED_ERRORS[malformed], str(fused)), fused
    # Other devices' kernels (cuDNN) check their arguments their own way, or convert them: the mode must
    # give back exactly what the kernel gives.
    if isinstance(fused, Exception):
        assert type(unfused) is type(fused) and str(unfused) == str(fused), (unfused, fused)
    else:
        unfused_leaves, fused_leaves = pytree.tree_leaves(unfused), pytree.tree_leaves(fused)
        assert len(unfused_leaves) == len(fused_leaves)
        for one, two in zip(unfused_leaves, fused_leaves):
            torch.testing.assert_close(one, two, rtol=0, atol=0)


@pytest.mark.parametrize("kind", list(FUSED))
@pytest.mark.parametrize("batch_first", [False, True], ids=["tm", "bf"])
def test_modules_under_the_mode_match_including_unbatched_input(kind, batch_first, device):
    """nn.LSTM and friends accept 2-D (unbatched) input and unsqueeze it before the kernel."""
    module = _recurrent_module(kind, device, batch_first=batch_first, bidirectional=True).eval()
    for x in to_device((torch.randn(BATCH, STEPS, INPUT, dtype=F64), torch.randn(STEPS, INPUT, dtype=F64))):
        seen = _Seen()
        with seen, Unfused():
            actual = module(x)
        assert FUSED[kind] not in seen.functions and torch.nn.functional.linear in seen.functions
        for one, two in zip(pytree.tree_leaves(actual), pytree.tree_leaves(module(x))):
            torch.testing.assert_close(one, two, rtol=1e-12, atol=1e-12)


def test_keyword_arguments_are_bound_by_name(device):
    module = _recurrent_module("lstm", device)
    x, hx, params, *rest = _call_arguments(module, False, torch.Generator().manual_seed(1))
    expected = torch._VF.lstm(x, hx, params, *rest)
    actual = _unfused.lstm(x, hx, params, has_biases=rest[0], num_layers=rest[1], dropout=rest[2], train=rest[3],
                           bidirectional=rest[4], batch_first=rest[5])
    for one, two in zip(actual, expected):
        torch.testing.assert_close(one, two)


# --------------------------------------------------------------------------------------------
# Weight normalisation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, dim",
    [(shape, dim) for shape in ((6,), (4, 3), (4, 3, 2)) for dim in (0, 1, -1, -2, None)
     if dim is None or -len(shape) <= dim < len(shape)],
)
def test_weight_norm_decomposition_matches_the_op(shape, dim, device):
    """``dim=None`` is what the weight_norm helpers pass on as -1: the norm of the whole tensor."""
    op_dim = -1 if dim is None else dim
    generator = torch.Generator().manual_seed(2)
    v = torch.randn(shape, generator=generator, dtype=F64).to(device)
    norm = torch.norm_except_dim(v, 2, op_dim)
    g = norm * (1 + torch.rand(norm.shape, generator=generator, dtype=F64).to(device))
    # The fused op runs on the CPU: PyTorch's CUDA weight-norm kernel takes its float64 norms'
    # square root in float32 (relative error ~3e-8), which the decomposition does not copy.
    fused = [v.cpu().requires_grad_(), g.cpu().requires_grad_()]
    unfused = [v.clone().requires_grad_(), g.clone().requires_grad_()]
    expected = torch._weight_norm(*fused, op_dim)
    actual = _unfused.weight_norm(*unfused, op_dim)
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-12, atol=1e-12)
    cotangent = torch.randn(shape, generator=generator, dtype=F64)
    grads = (
        [grad.cpu() for grad in torch.autograd.grad(actual, unfused, cotangent.to(device))],
        torch.autograd.grad(expected, fused, cotangent),
    )
    for one, two in zip(*grads):
        torch.testing.assert_close(one, two, rtol=1e-10, atol=1e-12)


def test_weight_norm_default_dim_and_odd_calls():
    v, g = to_device((torch.randn(4, 3, dtype=F64), torch.rand(4, 1, dtype=F64)))
    torch.testing.assert_close(_unfused.weight_norm(v, g), torch._weight_norm(v, g))
    torch.testing.assert_close(_unfused.weight_norm(v, g=g), torch._weight_norm(v, g, 0))
    torch.testing.assert_close(_unfused.weight_norm(v=v, g=g, dim=-1), torch._weight_norm(v, g, -1))
    scalars = to_device((torch.tensor(2.0), torch.tensor(1.0)))
    assert _unfused.weight_norm(*scalars, 0) is NotImplemented  # 0-d: the op decides
    assert _unfused.weight_norm(v, g, 5) is NotImplemented


# --------------------------------------------------------------------------------------------
# The forward-mode context
# --------------------------------------------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(4, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attention(x, x, x, need_weights=False)[0]


class _First(nn.Module):
    """The output sequence of a recurrent layer (the first element of its output tuple)."""

    def __init__(self, recurrent: nn.Module) -> None:
        super().__init__()
        self.recurrent = recurrent

    def forward(self, x: Tensor) -> Tensor:
        return self.recurrent(x)[0]


def _weight_normed_linear() -> nn.Module:
    return nn.utils.parametrizations.weight_norm(nn.Linear(4, 3), dim=0)


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


_FORWARD_MODE_CASES = {
    # name: (build, input shape, dtype, whether plain forward mode fails on it on the CPU)
    "lstm_float32": (lambda: _First(nn.LSTM(3, 5, batch_first=True)), (2, 4, 3), torch.float32, True),
    "gru": (lambda: _First(nn.GRU(3, 5, batch_first=True)), (2, 4, 3), F64, False),
    "attention_eval": (_Attention, (2, 3, 4), F64, True),
    "encoder_eval": (_encoder, (2, 3, 4), F64, True),
    "weight_norm": (_weight_normed_linear, (2, 4), F64, True),
}


def _forward_mode_case(name: str, device: torch.device) -> tuple[nn.Module, nn.Module, dict, dict, Tensor]:
    """``(module, reference, params, tangents, x)``: the case's module in eval mode on ``device``, its
    float64 copy on the CPU, the module's parameters, tangents like them and an input (drawn on the CPU)."""
    build, shape, dtype, _ = _FORWARD_MODE_CASES[name]
    torch.manual_seed(0)
    module = build().to(dtype).eval()
    reference = copy.deepcopy(module).to(F64)
    tangents = {key: torch.randn(p.shape, dtype=dtype) for key, p in module.named_parameters()}
    x = torch.randn(shape, dtype=dtype)
    module.to(device)
    params = {key: p.detach() for key, p in module.named_parameters()}
    return module, reference, params, to_device(tangents), to_device(x)


def _cpu_float64(tree: Any) -> Any:
    """The tensors of ``tree`` as float64 CPU tensors (what the reference computations take)."""
    return pytree.tree_map(lambda t: t.detach().to("cpu", F64), tree)


@pytest.mark.parametrize("name", list(_FORWARD_MODE_CASES))
def test_jvp_inside_the_context_matches_reverse_mode(name, device):
    module, reference, params, tangents, x = _forward_mode_case(name, device)
    # cuDNN off on CUDA, as torchntk's own evaluations run recurrent layers (_model/functional.py)
    no_cudnn = _unfused.recurrent_layers_without_cudnn() if x.is_cuda else contextlib.nullcontext()
    with forward_mode_kernels(bool(fused_layers(module))), no_cudnn:
        output, tangent = jvp(lambda values: functional_call(module, values, (x,)), (params,), (tangents,))
    # Reverse mode twice (the double-VJP identity) on the float64 CPU copy: no forward-mode derivative
    # involved; the fused attention kernels' backward passes have no derivative, hence MATH; and no
    # device kernel (cuDNN's RNN backward refuses eval mode).
    names = list(params)
    params64, tangents64, x64 = _cpu_float64((params, tangents, x))
    with sdpa_kernel([SDPBackend.MATH]):
        expected_output, expected = torch.autograd.functional.jvp(
            lambda *values: functional_call(reference, dict(zip(names, values)), (x64,)),
            tuple(params64[n] for n in names), tuple(tangents64[n] for n in names),
        )
    float32 = _FORWARD_MODE_CASES[name][2] == torch.float32
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if float32 else {"rtol": 1e-10, "atol": 1e-12}
    torch.testing.assert_close(_cpu_float64(output), expected_output, **tolerance)
    torch.testing.assert_close(_cpu_float64(tangent), expected, **tolerance)


@pytest.mark.cpu_only(
    "names the CPU's fused kernels without forward-mode derivatives (mkldnn LSTM, the attention fast path, CPU "
    "flash attention); other devices fuse differently (the context's jvp is checked on every device)"
)
@pytest.mark.parametrize("name", [name for name, case in _FORWARD_MODE_CASES.items() if case[3]])
def test_plain_forward_mode_fails_on_the_fused_cpu_kernels(name, device):
    """Why the context exists: outside it, ``jvp`` meets a kernel that has no forward-mode derivative."""
    module, _, params, tangents, x = _forward_mode_case(name, device)
    with pytest.raises(RuntimeError, match="forward AD"):
        jvp(lambda values: functional_call(module, values, (x,)), (params,), (tangents,))


def _fastpath() -> bool:
    return torch.backends.mha.get_fastpath_enabled()


def test_the_context_restores_the_attention_fast_path_flag():
    assert _fastpath()
    with forward_mode_kernels(False):
        assert not _fastpath()
        with forward_mode_kernels(True):  # nested, as a batched call around a kernel call is
            assert not _fastpath()
        assert not _fastpath()
    assert _fastpath()
    with pytest.raises(KeyError, match="raised inside the context"), forward_mode_kernels(True):
        raise KeyError("raised inside the context")
    assert _fastpath()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with forward_mode_kernels(False):
            pass
        assert not _fastpath(), "a flag the user switched off stays off"
    finally:
        torch.backends.mha.set_fastpath_enabled(True)


def test_the_context_enables_the_mode_only_when_asked(device):
    module = _recurrent_module("gru", device).eval()
    x = to_device(torch.randn(STEPS, BATCH, INPUT, dtype=F64))
    for unfuse in (False, True):
        seen = _Seen()
        with seen, forward_mode_kernels(unfuse):
            module(x)
        assert (torch._VF.gru in seen.functions) is not unfuse


def test_fused_layers_names_the_modules_that_call_fused_kernels(device):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old-style weight_norm is deprecated
        old_style = nn.utils.weight_norm(nn.Linear(3, 3))
    model = nn.ModuleDict({
        "lstm": nn.LSTM(3, 3), "gru": nn.GRU(3, 3), "rnn": nn.RNN(3, 3), "plain": nn.Linear(3, 3),
        "new_style": nn.utils.parametrizations.weight_norm(nn.Linear(3, 3)), "old_style": old_style,
        "cell": nn.LSTMCell(3, 3),  # lstm_cell is composite on CPU: forward mode and vmap handle it
    }).to(device)
    assert fused_layers(model) == ("lstm", "gru", "rnn", "new_style", "old_style")
    assert fused_layers(nn.LSTM(3, 3)) == ("",)
    assert fused_layers(nn.Sequential(nn.Linear(3, 3), nn.Tanh())) == ()
    assert functional_model(model, None, "test").fused == fused_layers(model)
    assert functional_model(lambda p, x: x * p, torch.ones((), device=device), "test").fused == ()


# --------------------------------------------------------------------------------------------
# Kernels of recurrent models
# --------------------------------------------------------------------------------------------

_WRAPPERS = {
    "lstm": lambda: _First(nn.LSTM(INPUT, HIDDEN, batch_first=True)),
    "gru": lambda: _First(nn.GRU(INPUT, HIDDEN, batch_first=True)),
    "rnn": lambda: _First(nn.RNN(INPUT, HIDDEN, batch_first=True)),
    "lstm_2layer_bidirectional_proj": lambda: _First(
        nn.LSTM(INPUT, HIDDEN, num_layers=2, bidirectional=True, proj_size=2, batch_first=True)
    ),
}


@functools.lru_cache(maxsize=None)
def _wrapper_case(name: str, device: torch.device) -> tuple[nn.Module, Tensor, Any]:
    """The model in eval mode on ``device``, an input there, and the float64 reference kernel.

    The reference is computed on the CPU, before the model moves: there the recurrent layers'
    backward runs in eval mode (cuDNN's refuses to).
    """
    torch.manual_seed(0)
    model = _WRAPPERS[name]().to(F64).eval()
    x = torch.randn(BATCH, STEPS, INPUT, dtype=F64)
    expected = reference_ntk(model, x, trace_axes=())
    return model.to(device), to_device(x), expected


def _spy(function: Callable, calls: list) -> Callable:
    def spied(*args: Any, **kwargs: Any) -> Any:
        result = function(*args, **kwargs)
        calls.append(result)
        return result
    return spied


@pytest.mark.parametrize("implementation", [1, 2, 3, 0], ids=["JC", "NVP", "SD", "AUTO"])
@pytest.mark.parametrize("name", list(_WRAPPERS))
def test_recurrent_kernels_match_the_reference(name, implementation, device):
    model, x, expected = _wrapper_case(name, device)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=None, implementation=implementation)
    double_vjps: list = []
    methods: list = []
    with mock.patch.object(nvp, "_transposed_maps", _spy(nvp._transposed_maps, double_vjps)), \
            mock.patch.object(auto_module, "vector_products_method", _spy(nvp.vector_products_method, methods)), \
            mock.patch.object(auto_module, "_PROBE_EVERYTHING", True):  # AUTO probes 2 even where 1 is cheaper
        actual = ntk_fn(x)
        choice = ntk_fn.auto_choice(x) if implementation in (0, 3) else None
    assert_kernels_close(actual, expected, rtol=1e-9)
    assert not double_vjps, "implementation 2 stays in forward mode"
    if implementation == 3:
        assert choice.fallback_parameters == {}, "the structured rules state every recurrent weight"
    if implementation == 0:
        assert methods and all(method == ("forward mode", None) for method in methods)
        assert choice.estimates[NtkImplementation.NTK_VECTOR_PRODUCTS].note == ""


@pytest.mark.parametrize("name", ["lstm_float32", "weight_norm"])
def test_linearize_taylor_and_ntk_vector_products_use_the_context(name, device):
    """The other forward-mode passes of torchntk (``taylor.py``, ``empirical_ntk_vp_fn``), against the
    module's float64 copy on the CPU."""
    module, reference, params, steps, x = _forward_mode_case(name, device)
    moved = {key: p + 1e-3 * steps[key] for key, p in params.items()}
    linear = torchntk.linearize(module)(moved, x)
    quadratic = torchntk.taylor_expand(module, degree=2)(moved, x)
    exact = functional_call(reference, _cpu_float64(moved), (_cpu_float64(x),))
    tolerance = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(_cpu_float64(linear), exact, **tolerance)  # second-order terms are ~1e-6
    torch.testing.assert_close(_cpu_float64(quadratic), exact, **tolerance)

    v = to_device(torch.randn(exact.shape, dtype=x.dtype))
    product = torchntk.empirical_ntk_vp_fn(module, x)(v)
    matrix = _paired_matrix(reference_ntk(reference, _cpu_float64(x), trace_axes=()), exact.shape)
    expected = (matrix @ _cpu_float64(v).reshape(-1)).reshape(exact.shape)
    torch.testing.assert_close(_cpu_float64(product), expected, **tolerance)


def _paired_matrix(kernel: Tensor, shape: torch.Size) -> Tensor:
    """``(N1, N2, a1, a2, b1, b2, ...)`` (axes paired, x1 first) as an ``(outputs1, outputs2)`` matrix."""
    ndim = len(shape)
    order = list(range(0, 2 * ndim, 2)) + list(range(1, 2 * ndim, 2))
    size = int(torch.tensor(shape).prod())
    return kernel.permute(order).reshape(size, size)


# --------------------------------------------------------------------------------------------
# Process-wide switches: attention on MATH, cuDNN off for recurrent layers on CUDA
# --------------------------------------------------------------------------------------------


def _attention_backends() -> tuple[bool, ...]:
    cuda = torch.backends.cuda
    return (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled())


_SWITCHES = {
    # name: (context, read the setting, the value inside)
    "math_attention": (_unfused.math_attention, _attention_backends, (False, False, True)),
    "no_cudnn": (_unfused.recurrent_layers_without_cudnn, lambda: torch.backends.cudnn.enabled, False),
}


@pytest.mark.parametrize("name", sorted(_SWITCHES))
def test_overlapping_switches_of_two_threads_restore_the_setting(name):
    """Thread A enters, B enters, A leaves, B leaves: a save-and-restore per block would leave B's
    saved value (A's setting) in place for good. The setting holds until the last block ends."""
    context, read, inside = _SWITCHES[name]
    before = read()
    assert before != inside, "the test needs PyTorch's default to differ from the switched value"
    steps = [threading.Event() for _ in range(4)]
    seen = {}

    def first():
        with context():
            steps[0].set()
            steps[1].wait(10)
        seen["after first left"] = read()
        steps[2].set()

    def second():
        steps[0].wait(10)
        with context():
            seen["both inside"] = read()
            steps[1].set()
            steps[2].wait(10)
            seen["second still inside"] = read()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen == {"both inside": inside, "after first left": inside, "second still inside": inside}
    assert read() == before


def test_recurrent_models_are_evaluated_without_cudnn_on_cuda_only(device):
    """torchntk's evaluation of a module holding an nn.LSTM: cuDNN off on CUDA (its weight re-packing
    reads data pointers, which transformed tensors lack), left alone elsewhere and for other models."""
    seen = []

    class Probe(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            seen.append(torch.backends.cudnn.enabled)
            return x

    torch.manual_seed(0)
    recurrent = nn.Sequential(Probe(), _First(nn.LSTM(3, 4, batch_first=True))).double().to(device)
    plain = nn.Sequential(Probe(), nn.Linear(3, 4)).double().to(device)
    x = to_device(torch.randn(2, 5, 3, dtype=F64))
    before = torch.backends.cudnn.enabled
    torchntk.empirical_ntk_fn(recurrent, vmap_axes=0, implementation=1)(x)
    assert set(seen) == {x.device.type != "cuda"}
    seen.clear()
    torchntk.empirical_ntk_fn(plain, vmap_axes=0, implementation=1)(x)
    assert set(seen) == {True}
    assert torch.backends.cudnn.enabled == before
