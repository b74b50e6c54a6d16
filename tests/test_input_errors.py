"""Clear errors for inputs the kernels cannot take: numpy arrays, complex NTKs, data-dependent
operations under vmap, NaN kernels and non-numeric arguments in ``torchntk.predict``.

Where a message promises that another setting works, the test computes that setting and
compares it with the float64 brute-force kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import torchntk
from torchntk import predict
from torchntk.testing import assert_kernels_close, reference_nngp, reference_ntk

pytestmark = pytest.mark.cpu_only("checks the errors for NumPy arrays and other bad inputs, as raised on the CPU")

F64 = torch.float64
ALL_IMPLEMENTATIONS = pytest.mark.parametrize("implementation", [0, 1, 2, 3], ids=["AUTO", "JC", "NVP", "SD"])
IMPLEMENTATIONS = pytest.mark.parametrize("implementation", [1, 2, 3], ids=["JC", "NVP", "SD"])


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()


# -- numpy inputs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("vmap_axes", [None, 0])
def test_numpy_x1_is_a_type_error_naming_it(vmap_axes):
    array = np.zeros((5, 4), dtype=np.float64)
    with pytest.raises(TypeError, match=r"`x1` must be a tensor .* x1 is a numpy.ndarray of shape \(5, 4\) and dtype float64"):
        torchntk.empirical_ntk_fn(_mlp(), vmap_axes=vmap_axes)(array)
    with pytest.raises(TypeError, match="torch.from_numpy"):
        torchntk.empirical_nngp_fn(_mlp())(array)


def test_numpy_x2_and_pytree_leaves_are_named():
    x1 = torch.randn(5, 4, dtype=F64)
    with pytest.raises(TypeError, match=r"`x2` must be .* x2 is a numpy.ndarray"):
        torchntk.empirical_kernel_fn(_mlp())(x1, np.zeros((3, 4)))
    f = lambda p, x: x["a"] @ p  # noqa: E731
    with pytest.raises(TypeError, match=r"x1\['a'\] is a numpy.ndarray of shape \(2, 4\)"):
        torchntk.empirical_ntk_fn(f)({"a": np.zeros((2, 4))}, None, torch.randn(4, 3))


# -- complex parameters and outputs ---------------------------------------------------------------


@ALL_IMPLEMENTATIONS
@pytest.mark.parametrize("vmap_axes", [None, 0])
def test_complex_parameters_are_rejected_by_every_implementation(implementation, vmap_axes):
    model = nn.Linear(4, 3, dtype=torch.complex128)
    x = torch.randn(5, 4, dtype=torch.complex128)
    with pytest.raises(TypeError, match=r"parameter 'weight' is complex \(torch.complex128\).* torch.view_as_real"):
        torchntk.empirical_ntk_fn(model, vmap_axes=vmap_axes, implementation=implementation)(x)


@ALL_IMPLEMENTATIONS
@pytest.mark.parametrize("vmap_axes", [None, 0])
def test_complex_outputs_are_rejected_by_every_implementation(implementation, vmap_axes):
    def f(params, x):
        return (torch.tanh(x @ params["w"]) * (1 + 2j), x @ params["v"])

    params = {"w": torch.randn(4, 3, dtype=F64), "v": torch.randn(4, 2, dtype=F64)}
    x1, x2 = torch.randn(5, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    with pytest.raises(TypeError, match=r"output leaf 0 of 2 for x1 is complex .* torch.view_as_real"):
        torchntk.empirical_ntk_fn(f, vmap_axes=vmap_axes, implementation=implementation)(x1, x2, params)
    with pytest.raises(TypeError, match="is complex"):
        torchntk.empirical_kernel_fn(f, vmap_axes=vmap_axes, implementation=implementation)(x1, x2, "ntk", params)


def test_the_nngp_keeps_complex_outputs():
    def f(params, x):
        return torch.tanh(x @ params) * (1 + 2j)

    params = torch.randn(4, 3, dtype=F64)
    x1, x2 = torch.randn(5, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    out1, out2 = f(params, x1), f(params, x2)
    expected = out1 @ out2.T / 3
    assert_kernels_close(torchntk.empirical_nngp_fn(f)(x1, x2, params), expected)
    assert_kernels_close(torchntk.empirical_kernel_fn(f)(x1, x2, "nngp", params), expected)


def test_view_as_real_suggestion_gives_the_right_kernel():
    """What the message says to do: real parameters rebuilt with view_as_complex, real outputs."""
    def f(params, x):
        weight = torch.view_as_complex(params)
        return torch.view_as_real(x.to(weight.dtype) @ weight).flatten(-2)

    params = torch.randn(4, 3, 2, dtype=F64)
    x1, x2 = torch.randn(5, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    for implementation in (1, 2, 3):
        kernel = torchntk.empirical_ntk_fn(f, vmap_axes=0, implementation=implementation)(x1, x2, params)
        assert_kernels_close(kernel, reference_ntk(f, x1, x2, params))


# -- data-dependent operations under vmap ----------------------------------------------------------


# Each is per-example independent (vmap_axes=0 is a true promise) but uses values for shapes or
# control flow, which vmap cannot batch.
def _boolean_mask(params, x):
    hidden = (x @ params).clone()
    hidden[x[:, :3] > 1.0] = 0.0
    return hidden


def _nonzero(params, x):
    return (x @ params) * (1 + torch.nonzero(x.abs() > 1e9).shape[0])


def _item(params, x):
    return (x @ params) * (1 + (x.abs().max() > 1e9).item())


DATA_DEPENDENT = {"boolean-mask": _boolean_mask, "nonzero": _nonzero, "item": _item}


@IMPLEMENTATIONS
@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("name", DATA_DEPENDENT)
def test_data_dependent_operations_under_vmap_run_in_an_example_loop(implementation, check, name):
    """NOTE: [Switching to example loops]: the right kernel, and a warning that names the cost."""
    f = DATA_DEPENDENT[name]
    params = torch.randn(4, 3, dtype=F64)
    x1 = torch.randn(5, 4, dtype=F64)
    ntk_fn = torchntk.empirical_ntk_fn(f, vmap_axes=0, implementation=implementation, check_vmap_axes=check)
    with pytest.warns(torchntk.ExampleLoopWarning, match="cannot evaluate this model per example .* Python loop"):
        kernel = ntk_fn(x1, None, params)
    assert_kernels_close(kernel, reference_ntk(f, x1, None, params))


# -- torchntk.predict ----------------------------------------------------------------------------------


def _problem():
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(4, 6, generator=generator, dtype=F64)
    k = features @ features.T / 6 + 0.1 * torch.eye(4, dtype=F64)
    y = torch.randn(4, 1, generator=generator, dtype=F64)
    k_test = torch.randn(2, 4, generator=generator, dtype=F64)
    return k, y, k_test


def _with_nan(tensor: torch.Tensor, value: float = float("nan")) -> torch.Tensor:
    changed = tensor.clone()
    changed.view(-1)[0] = value
    return changed


MSE = lambda f, y: ((f - y) ** 2).sum() / (2 * y.numel())  # noqa: E731


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_predict_rejects_non_finite_kernels_and_targets(value):
    k, y, k_test = _problem()
    bad_k, bad_y, bad_test = _with_nan(k, value), _with_nan(y, value), _with_nan(k_test, value)
    with pytest.raises(ValueError, match="`k_train_train` holds 1 NaN or infinite entry"):
        predict.gradient_descent_mse(bad_k, y)(1.0)
    with pytest.raises(ValueError, match="`y_train` holds 1 NaN or infinite entry"):
        predict.gradient_descent_mse(k, bad_y)
    with pytest.raises(ValueError, match="`k_test_train` holds"):
        predict.gradient_descent_mse(k, y)(1.0, 0.0, torch.zeros(2, 1, dtype=F64), bad_test)
    with pytest.raises(ValueError, match="`fx_train_0` holds"):
        predict.gradient_descent_mse(k, y)(1.0, _with_nan(torch.zeros(4, 1, dtype=F64), value))
    with pytest.raises(ValueError, match="`k_train_train \\(nngp\\)`|`k_train_train` holds"):
        predict.gp_inference(bad_k, y)("nngp", k_test)
    with pytest.raises(ValueError, match="`k_test_train` holds"):
        predict.gp_inference(k, y)("nngp", bad_test)
    with pytest.raises(ValueError, match="`y_train` holds"):
        predict.gp_inference(k, bad_y)
    with pytest.raises(ValueError, match="`k_train_train` holds"):
        predict.gradient_descent(MSE, bad_k, y)
    with pytest.raises(ValueError, match="`ntk_train_train` holds"):
        predict.max_learning_rate(bad_k)


def test_predict_ensemble_rejects_a_nan_kernel_from_the_kernel_function():
    model = _mlp()
    x_train, y_train = torch.randn(4, 4, dtype=F64), torch.randn(4, 3, dtype=F64)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    # a checked kernel function names the parameter itself (NOTE: [Non-finite kernels]) ...
    predict_fn = predict.gradient_descent_mse_ensemble(torchntk.empirical_kernel_fn(model), x_train, y_train)
    with pytest.raises(ValueError, match=r"NaN or infinite .* parameter '0.weight'"):
        predict_fn(1.0, get="ntk")
    # ... and the NaN kernel of an unchecked one is refused by predict
    unchecked = torchntk.empirical_kernel_fn(model, check_vmap_axes=False)
    predict_fn = predict.gradient_descent_mse_ensemble(unchecked, x_train, y_train)
    with pytest.raises(ValueError, match=r"`kernel_fn\(x_train, None\)` holds .* NaN"):
        predict_fn(1.0, get="ntk")


@pytest.mark.parametrize("bad", ["0.1", None, [0.1], 1j, True], ids=["str", "None", "list", "complex", "bool"])
def test_predict_learning_rate_must_be_a_number(bad):
    k, y, _ = _problem()
    with pytest.raises(TypeError, match="`learning_rate` must be a real number"):
        predict.gradient_descent_mse(k, y, learning_rate=bad)
    with pytest.raises(TypeError, match="`learning_rate` must be a real number"):
        predict.gradient_descent(MSE, k, y, learning_rate=bad)
    with pytest.raises(TypeError, match="`learning_rate` must be a real number"):
        predict.gradient_descent_mse_ensemble(torchntk.empirical_kernel_fn(_mlp()), torch.randn(4, 4), y, learning_rate=bad)
    with pytest.raises(TypeError, match="`diag_reg` must be a real number"):
        predict.gp_inference(k, y, diag_reg=bad)


def test_predict_learning_rate_must_be_finite_and_may_be_a_tensor():
    k, y, _ = _problem()
    with pytest.raises(ValueError, match="`learning_rate` must be a finite number"):
        predict.gradient_descent_mse(k, y, learning_rate=float("nan"))
    as_float = predict.gradient_descent_mse(k, y, learning_rate=0.5)(2.0)
    as_tensor = predict.gradient_descent_mse(k, y, learning_rate=torch.tensor(0.5))(2.0)
    torch.testing.assert_close(as_tensor, as_float)


# -- issue 25: PyTorch's errors become ours, or the right kernel -----------------------------------


def _group_norm_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.AvgPool2d(2), nn.Flatten(), nn.Linear(36, 2)
    ).double().eval()


@pytest.mark.parametrize("vmap_axes", [None, 0])
@pytest.mark.parametrize("model_format", ["contiguous", "channels_last"])
def test_channels_last_inputs_with_ntk_vector_products(vmap_axes, model_format):
    # group_norm's forward-mode derivative views a channels_last tangent ("view size is not compatible")
    model = _group_norm_cnn()
    if model_format == "channels_last":
        model = model.to(memory_format=torch.channels_last)
    generator = torch.Generator().manual_seed(1)
    x1, x2 = (torch.randn(n, 3, 6, 6, generator=generator, dtype=F64).to(memory_format=torch.channels_last) for n in (3, 2))
    kernel = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=2)(x1, x2)
    assert_kernels_close(kernel, reference_ntk(model, x1, x2, trace_axes=()))


class _LookedUp(nn.Module):
    """Rows of a table chosen by the input's values, plus a dense layer."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(5, 3, dtype=F64))
        self.scale = nn.Parameter(torch.randn(5, dtype=F64))
        self.dense = nn.Linear(5, 3, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = (x > 0).long().cumsum(-1) % 5
        return self.table[x.argmax(-1)] + self.dense(x * self.scale[positions])


@pytest.mark.parametrize("vmap_axes", [None, 0])
def test_value_dependent_indexing_with_structured_derivatives(vmap_axes):
    torch.manual_seed(0)
    model = _LookedUp().eval()
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=3)
    for seed in (1, 2):  # a plan made on one input must not be reused with its indices on another
        generator = torch.Generator().manual_seed(seed)
        x1, x2 = torch.randn(4, 5, generator=generator, dtype=F64), torch.randn(3, 5, generator=generator, dtype=F64)
        assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2, trace_axes=()))


class _LookedUpInALoop(_LookedUp):
    """``_LookedUp`` with a ``.item()`` vmap cannot evaluate, so the examples run in a Python loop."""

    def forward(self, x):
        if x.abs().sum().item() < 0:  # never true: only there to need a Python value
            return x
        return super().forward(x)


@ALL_IMPLEMENTATIONS
def test_value_dependent_indexing_in_an_example_loop(implementation):
    """In an example loop no index is batched: each example's pass would keep one example's
    indices, so implementation 3 takes the parameter's Jacobians instead (exact)."""
    torch.manual_seed(0)
    model = _LookedUpInALoop().eval()
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=implementation)
    generator = torch.Generator().manual_seed(1)
    x1, x2 = torch.randn(4, 5, generator=generator, dtype=F64), torch.randn(3, 5, generator=generator, dtype=F64)
    with pytest.warns(torchntk.ExampleLoopWarning):
        kernel = ntk_fn(x1, x2)
    assert_kernels_close(kernel, reference_ntk(model, x1, x2, trace_axes=()))


@pytest.mark.parametrize("vmap_axes", [None, 0])
def test_examples_on_the_wrong_axis_name_x1_and_its_shape(vmap_axes):
    model = nn.Linear(4, 3)
    with pytest.raises(ValueError, match=r"model failed on `x1`, of shape \(4, 6\) .* PyTorch said: mat1 and mat2") as raised:
        torchntk.empirical_ntk_fn(model, vmap_axes=vmap_axes)(torch.randn(4, 6))
    assert isinstance(raised.value, RuntimeError)  # still what PyTorch raised, for whoever catches that


def test_a_1d_input_under_vmap_axes_is_explained():
    with pytest.raises(ValueError, match=r"maps 4 examples of `x1` \(axis 0 of x1, of shape \(4,\)\).* 1-D input"):
        torchntk.empirical_ntk_fn(nn.Linear(4, 3), vmap_axes=0)(torch.randn(4))


@IMPLEMENTATIONS
def test_a_1d_input_without_vmap_axes_is_one_unbatched_example(implementation):
    model, x1, x2 = _mlp(), torch.randn(4, dtype=F64), torch.randn(4, dtype=F64)
    kernel = torchntk.empirical_ntk_fn(model, implementation=implementation)(x1, x2)
    assert kernel.shape == ()
    assert_kernels_close(kernel, reference_ntk(model, x1, x2))


@pytest.mark.parametrize("vmap_axes", [None, 0])
def test_x2_with_other_features_than_x1_is_named(vmap_axes):
    pattern = r"model failed on `x2`, of shape \(3, 5\) .*\(x1, of shape \(5, 4\) .* worked\).* mat1 and mat2"
    with pytest.raises(ValueError, match=pattern):
        torchntk.empirical_ntk_fn(_mlp(), vmap_axes=vmap_axes)(torch.randn(5, 4, dtype=F64), torch.randn(3, 5, dtype=F64))
    with pytest.raises(ValueError, match=r"`x2`, of shape \(3, 5\)"):
        torchntk.empirical_nngp_fn(_mlp())(torch.randn(5, 4, dtype=F64), torch.randn(3, 5, dtype=F64))


@pytest.mark.parametrize(("given", "expected"), [(torch.float32, F64), (F64, torch.float32)])
def test_an_input_dtype_other_than_the_parameters_is_a_type_error(given, expected):
    model = _mlp().to(expected)
    pattern = rf"`x1`: x1 has dtype {given} \(shape \(5, 4\)\) but the model's parameters are {expected}"
    with pytest.raises(TypeError, match=pattern):
        torchntk.empirical_ntk_fn(model, vmap_axes=0)(torch.randn(5, 4, dtype=given))
    with pytest.raises(TypeError, match=rf"x2 has dtype {given}"):
        torchntk.empirical_kernel_fn(model)(torch.randn(5, 4, dtype=expected), torch.randn(3, 4, dtype=given))


def test_token_ids_and_models_that_cast_their_inputs_keep_working():
    torch.manual_seed(0)
    tokens = nn.Sequential(nn.Embedding(10, 4), nn.Flatten(), nn.Linear(12, 2)).double().eval()
    ids1, ids2 = torch.randint(0, 10, (4, 3)), torch.randint(0, 10, (2, 3))
    assert_kernels_close(torchntk.empirical_ntk_fn(tokens, vmap_axes=0)(ids1, ids2), reference_ntk(tokens, ids1, ids2))
    model = _mlp()
    casting = lambda p, x: torch.func.functional_call(model, p, (x.double(),))  # noqa: E731
    params = dict(model.named_parameters())
    x1 = torch.randn(3, 4)  # float32 into a float64 model that casts it
    assert_kernels_close(torchntk.empirical_ntk_fn(casting)(x1, None, params), reference_ntk(model, x1.double()))


def test_a_list_input_is_a_type_error_naming_it():
    rows = [[1.0, 2.0, 3.0, 4.0]]
    pattern = r"`x1` must be a tensor or a pytree of tensors, got \[\[1.0, 2.0, 3.0, 4.0\]\] \(list\), which holds no tensor"
    with pytest.raises(TypeError, match=pattern):
        torchntk.empirical_ntk_fn(_mlp())(rows)
    with pytest.raises(TypeError, match=r"`x1` must be a tensor .* torch.tensor\(\.\.\.\)"):
        torchntk.empirical_nngp_fn(_mlp())(rows)
    with pytest.raises(TypeError, match=r"`x2` must be a tensor or a pytree of tensors, got \[\[1.0"):
        torchntk.empirical_kernel_fn(_mlp())(torch.randn(2, 4, dtype=F64), rows)
    with pytest.raises(TypeError, match=r"`x1` must be a tensor .* got 3.0 \(float\)"):
        torchntk.empirical_ntk_vp_fn(_mlp(), 3.0)


class _WithArgmax(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(4, 3, dtype=F64)

    def forward(self, x: torch.Tensor) -> tuple:
        y = torch.tanh(self.dense(x))
        return y, y.argmax(-1), y > 0


@ALL_IMPLEMENTATIONS
@pytest.mark.parametrize("vmap_axes", [None, 0])
def test_integer_and_boolean_output_leaves_get_no_kernel(implementation, vmap_axes):
    model = _WithArgmax().eval()
    x1, x2 = torch.randn(5, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    float_leaf = lambda p, x: torch.func.functional_call(model, p, (x,))[0]  # noqa: E731
    params = {name: p.detach() for name, p in model.named_parameters()}
    ntk = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=implementation)(x1, x2)
    assert ntk[1] is None and ntk[2] is None
    assert_kernels_close(ntk[0], reference_ntk(float_leaf, x1, x2, params, trace_axes=()))
    both = torchntk.empirical_kernel_fn(model, vmap_axes=vmap_axes, implementation=implementation)(x1, x2)
    assert both[1] is None and both[2] is None
    assert_kernels_close(both[0].nngp, reference_nngp(float_leaf, x1, x2, params))
    nngp = torchntk.empirical_nngp_fn(model)(x1, x2)
    assert nngp[1] is None and nngp[2] is None
    assert_kernels_close(nngp[0], reference_nngp(float_leaf, x1, x2, params))


def test_an_only_integer_output_is_refused():
    model = nn.Linear(4, 3, dtype=F64)
    with pytest.raises(ValueError, match="no floating-point or complex tensor"):
        torchntk.empirical_ntk_fn(lambda p, x: (x @ p).argmax(-1))(torch.randn(3, 4, dtype=F64), None, model.weight.T)


def test_ntk_vp_fn_with_integer_output_leaves_and_no_x1():
    model = _WithArgmax().eval()
    x1, x2 = torch.randn(5, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    product = torchntk.empirical_ntk_vp_fn(model, x1, x2)((torch.ones(3, 3, dtype=F64), None, None))
    full = torchntk.empirical_ntk_fn(model, trace_axes=())(x1, x2)[0]
    assert product[1] is None and product[2] is None
    torch.testing.assert_close(product[0], torch.einsum("nmab,mb->na", full, torch.ones(3, 3, dtype=F64)))
    with pytest.raises(ValueError, match=r"empirical_ntk_vp_fn: `x1` must contain at least one tensor, got None"):
        torchntk.empirical_ntk_vp_fn(nn.Linear(4, 3), None)


@pytest.mark.parametrize("kind", ["no parameter", "frozen"])
def test_the_nngp_of_a_model_without_trainable_parameters(kind):
    torch.manual_seed(0)
    model = nn.Tanh() if kind == "no parameter" else nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).double().eval()
    model.requires_grad_(False)
    x1, x2 = torch.randn(5, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    expected = reference_nngp(lambda p, x: model(x), x1, x2, {})
    assert_kernels_close(torchntk.empirical_nngp_fn(model)(x1, x2), expected)
    assert_kernels_close(torchntk.empirical_kernel_fn(model)(x1, x2, "nngp"), expected)
    assert_kernels_close(torchntk.empirical_kernel_fn(model, vmap_axes=0)(x1, None, ("nngp",)).nngp, reference_nngp(lambda p, x: model(x), x1, None, {}))
    # The NTK of such a model is still refused: it has nothing to differentiate.
    with pytest.raises(ValueError, match="no parameter with requires_grad=True"):
        torchntk.empirical_kernel_fn(model)(x1, x2)
