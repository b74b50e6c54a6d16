"""``torchntk.predict`` against direct numerical integration, dense solves and real training.

Kernels, targets, models and inputs live on the run device (``pytest --device``): the tensor
factories below draw or build on the CPU and move there, so the numbers are the same on any device.
"""

from __future__ import annotations

import math
import sys
import warnings

import pytest
import torch

import torchntk
from tests._processes import run_python
from tests.cases import DEVICE
from torchntk import predict

F64 = torch.float64


def _on_device(factory):
    """``factory`` (a torch tensor factory) drawing or building on the CPU, then moving to the run device."""
    return lambda *arguments, **keywords: factory(*arguments, **keywords).to(DEVICE)


_randn, _eye, _zeros, _ones, _tensor, _arange = map(
    _on_device, (torch.randn, torch.eye, torch.zeros, torch.ones, torch.tensor, torch.arange)
)


def _psd(n: int, seed: int, rank: int | None = None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    a = _randn(n, rank or n + 2, generator=generator, dtype=F64)
    return a @ a.T / a.shape[1]


def _joint(n_train: int, n_test: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Train-train, test-train and test-test blocks of one PSD kernel on train + test points."""
    k = _psd(n_train + n_test, seed)
    return k[:n_train, :n_train], k[n_train:, :n_train], k[n_train:, n_train:]


def _rk4(derivative, state: tuple, t_end: float, steps: int) -> tuple:
    """Classic fixed-step Runge-Kutta 4: an integrator independent of the library's."""
    h = t_end / steps
    for _ in range(steps):
        k1 = derivative(state)
        k2 = derivative(tuple(s + h / 2 * k for s, k in zip(state, k1)))
        k3 = derivative(tuple(s + h / 2 * k for s, k in zip(state, k2)))
        k4 = derivative(tuple(s + h * k for s, k in zip(state, k3)))
        state = tuple(s + h / 6 * (a + 2 * b + 2 * c + d) for s, a, b, c, d in zip(state, k1, k2, k3, k4))
    return state


def _full(k: torch.Tensor, outputs: int) -> torch.Tensor:
    """``(N1, N2)`` -> ``(N1, N2, O, O)``: the kernel times the identity over outputs."""
    return torch.einsum("ab,ij->abij", k, torch.eye(outputs, dtype=k.dtype, device=k.device))


def _close(a, b, tolerance=1e-9):
    scale = max(b.abs().max().item(), 1e-30)
    assert (a - b).abs().max().item() <= tolerance * scale, (a - b).abs().max().item() / scale


# -- gradient_descent_mse ----------------------------------------------------------------------


@pytest.mark.parametrize("traced", [True, False], ids=["logits-traced", "full-kernel"])
@pytest.mark.parametrize("diag_reg", [0.0, 0.1])
def test_mse_closed_form_equals_integrating_the_ode(traced, diag_reg):
    n, n_test, outputs, lr = 5, 3, 2, 0.7
    k_dd, k_td, _ = _joint(n, n_test, seed=0)
    generator = torch.Generator().manual_seed(1)
    y = _randn(n, outputs, generator=generator, dtype=F64)
    f0 = _randn(n, outputs, generator=generator, dtype=F64)
    g0 = _randn(n_test, outputs, generator=generator, dtype=F64)
    regularised = k_dd + diag_reg * k_dd.diagonal().mean() * _eye(n, dtype=F64)
    if traced:
        kernels, axes = (k_dd, k_td), (-1,)
    else:
        kernels, axes = (_full(k_dd, outputs), _full(k_td, outputs)), ()
    predict_fn = predict.gradient_descent_mse(kernels[0], y, lr, diag_reg=diag_reg, trace_axes=axes)

    def derivative(state):
        train, test = state
        push = -lr * (train - y) / y.numel()
        return regularised @ push, k_td @ push

    for t in (0.3, 2.0, 11.0):
        expected = _rk4(derivative, (f0, g0), t, steps=400)
        got = predict_fn(t, f0, g0, kernels[1])
        _close(got[0], expected[0])
        _close(got[1], expected[1])


def test_infinite_time_is_a_linear_solve_and_the_limit_of_finite_time():
    n, n_test = 6, 2
    k_dd, k_td, _ = _joint(n, n_test, seed=2)
    y = _randn(n, 3, dtype=F64)
    f0, g0 = _randn(n, 3, dtype=F64), _randn(n_test, 3, dtype=F64)
    predict_fn = predict.gradient_descent_mse(k_dd, y)
    train, test = predict_fn(None, f0, g0, k_td)
    _close(train, y)
    _close(test, g0 + k_td @ torch.linalg.solve(k_dd, y - f0))
    late = predict_fn(_tensor(1e9), f0, g0, k_td)
    _close(late[0], train, 1e-6)
    _close(late[1], test, 1e-6)


def test_times_shape_the_leading_axes_and_either_side_can_be_left_out():
    k_dd, k_td, _ = _joint(4, 2, seed=3)
    y = _randn(4, 2, dtype=F64)
    predict_fn = predict.gradient_descent_mse(k_dd, y)
    g0 = _zeros(2, 2, dtype=F64)
    assert predict_fn(1.0).shape == (4, 2)
    assert predict_fn(_ones(3)).shape == (3, 4, 2)
    assert predict_fn(_ones(2, 5)).shape == (2, 5, 4, 2)
    test_only = predict_fn(_ones(3), None, g0, k_td)
    assert test_only.shape == (3, 2, 2)
    _close(test_only, predict_fn(_ones(3), 0.0, g0, k_td)[1])
    started = torch.full((4, 2), 2.5, dtype=F64, device=DEVICE)
    _close(predict_fn(0.0, 2.5), started)  # at t=0 the outputs are where they started


def test_outputs_with_more_axes_and_a_traced_middle_axis():
    """y of shape (N, C, O), C traced: the kernel has pairs for N and O."""
    n, channels, outputs = 4, 3, 2
    k_dd, k_td, _ = _joint(n, 2, seed=4)
    y = _randn(n, channels, outputs, dtype=F64)
    full_dd, full_td = _full(k_dd, outputs), _full(k_td, outputs)
    traced_middle = predict.gradient_descent_mse(full_dd, y, trace_axes=(1,))
    traced_both = predict.gradient_descent_mse(k_dd, y, trace_axes=(1, 2))
    g0 = _randn(2, channels, outputs, dtype=F64)
    for t in (0.5, None):
        a = traced_middle(t, 0.0, g0, full_td)
        b = traced_both(t, 0.0, g0, k_td)
        _close(a[0], b[0])
        _close(a[1], b[1])


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: predict.gradient_descent_mse(_eye(3), _zeros(4, 1)), ValueError, "has shape \\(3, 3\\), but targets"),
        (lambda: predict.gradient_descent_mse(_eye(4), _zeros(4, 1), trace_axes=(0,)), ValueError, "traces the batch axis"),
        (lambda: predict.gradient_descent_mse(_eye(4), _zeros(4, 1), trace_axes=(3,)), ValueError, "out of range"),
        (lambda: predict.gradient_descent_mse([[1.0]], _zeros(1, 1)), TypeError, "must be a tensor"),
        (lambda: predict.gp_inference(_eye(2), _tensor(1.0)), TypeError, "`y_train` must be a tensor with a batch axis"),
        (lambda: predict.gradient_descent_mse(_eye(2), _zeros(2, 1))(1.0, 0.0, _zeros(1, 1)), ValueError,
         "`fx_test_0` needs `k_test_train`"),
        (lambda: predict.gradient_descent_mse(_eye(2), _zeros(2, 1))(1.0, None, None), ValueError, "nothing to predict"),
        (lambda: predict.gradient_descent_mse(_eye(2), _zeros(2, 1))(1.0, _zeros(3, 1)), ValueError,
         "does not broadcast"),
        (lambda: predict.gradient_descent_mse(_eye(2), _zeros(2, 1))(1.0, 0.0, _zeros(1, 1), _zeros(2, 1)),
         ValueError, "`k_test_train` has shape \\(2, 1\\)"),
        (lambda: predict.gradient_descent_mse(-_eye(2), _zeros(2, 1))(None, 0.0, _zeros(1, 1), _ones(1, 2)),
         ValueError, "not positive definite"),
    ],
)
def test_mse_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_float32_kernels_from_the_library():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2)).to(DEVICE)
    x_train, x_test = _randn(10, 3), _randn(4, 3)
    y = _randn(10, 2)
    with torch.no_grad():
        f0, g0 = model(x_train), model(x_test)
    results = {}
    for dtype in (torch.float32, F64):
        model_d = model.to(dtype)
        for axes in ((-1,), ()):
            ntk_fn = torchntk.empirical_ntk_fn(model_d, trace_axes=axes, vmap_axes=0)
            predict_fn = predict.gradient_descent_mse(ntk_fn(x_train.to(dtype)), y.to(dtype), trace_axes=axes)
            train, test = predict_fn(_tensor([1.0, 50.0]), f0.to(dtype), g0.to(dtype), ntk_fn(x_test.to(dtype), x_train.to(dtype)))
            assert train.dtype == dtype and test.shape == (2, 4, 2)
            results[dtype, axes] = test
    for axes in ((-1,), ()):
        _close(results[torch.float32, axes].double(), results[F64, axes], 1e-3)


# -- gradient_descent (ODE) ----------------------------------------------------------------------


def _mse(f, y):
    return ((f - y) ** 2).sum() / (2 * y.numel())


def test_ode_with_the_mse_equals_the_closed_form_in_any_time_order():
    k_dd, k_td, _ = _joint(5, 2, seed=5)
    y, f0, g0 = _randn(5, 2, dtype=F64), _randn(5, 2, dtype=F64), _randn(2, 2, dtype=F64)
    times = _tensor([3.0, 0.5, 3.0, 0.0], dtype=F64)
    closed = predict.gradient_descent_mse(k_dd, y, learning_rate=0.8)(times, f0, g0, k_td)
    ode = predict.gradient_descent(_mse, k_dd, y, learning_rate=0.8, rtol=1e-11, atol=1e-13)(times, f0, g0, k_td)
    _close(ode[0], closed[0], 1e-8)
    _close(ode[1], closed[1], 1e-8)


def test_momentum_and_cross_entropy_against_integration():
    k_dd, k_td, _ = _joint(4, 2, seed=6)
    labels = torch.nn.functional.one_hot(_tensor([0, 2, 1, 2]), 3).to(F64)
    f0, g0 = _randn(4, 3, dtype=F64), _randn(2, 3, dtype=F64)

    def cross_entropy(f, y):
        return -(torch.log_softmax(f, -1) * y).mean()

    lr, momentum = 0.5, 0.9
    gradient = torch.func.grad(lambda f: cross_entropy(f, labels))
    friction = (1 - momentum) / math.sqrt(lr)

    def plain(state):
        g = gradient(state[0])
        return -lr * k_dd @ g, -lr * k_td @ g

    def heavy_ball(state):
        f, f_test, q, q_test = state
        g = gradient(f)
        return q, q_test, -k_dd @ g - friction * q, -k_td @ g - friction * q_test

    t = 4.0
    expected = _rk4(plain, (f0, g0), t, 400)
    got = predict.gradient_descent(cross_entropy, k_dd, labels, lr, rtol=1e-11, atol=1e-13)(t, f0, g0, k_td)
    _close(got[0], expected[0], 1e-8)
    _close(got[1], expected[1], 1e-8)
    zeros = torch.zeros_like(f0), torch.zeros_like(g0)
    expected = _rk4(heavy_ball, (f0, g0, *zeros), math.sqrt(lr) * t, 800)
    with_momentum = predict.gradient_descent(cross_entropy, k_dd, labels, lr, momentum, rtol=1e-11, atol=1e-13)
    state = with_momentum(t, predict.ODEState(f0, g0), None, k_td)
    for got_part, want in zip((state.fx_train, state.fx_test, state.qx_train, state.qx_test), expected):
        _close(got_part, want, 1e-7)
    # resuming from the state at t/2 for another t/2 lands on the same point
    half = with_momentum(t / 2, predict.ODEState(f0, g0), None, k_td)
    resumed = with_momentum(t / 2, half, None, k_td)
    _close(resumed.fx_test, state.fx_test, 1e-7)


def test_ode_errors():
    k, y = _eye(2, dtype=F64), _zeros(2, 1, dtype=F64)
    with pytest.raises(ValueError, match="no closed form at t=None"):
        predict.gradient_descent(_mse, k, y)(None)
    with pytest.raises(ValueError, match="must be non-negative"):
        predict.gradient_descent(_mse, k, y)(_tensor([-1.0]))
    with pytest.raises(ValueError, match="`momentum` must be None or a number in \\[0, 1\\)"):
        predict.gradient_descent(_mse, k, y, momentum=1.5)
    with pytest.raises(ValueError, match="velocities .* but `momentum` is None"):
        predict.gradient_descent(_mse, k, y)(1.0, predict.ODEState(_zeros(2, 1), qx_train=_zeros(2, 1)))
    with pytest.raises(TypeError, match="`loss` must be callable"):
        predict.gradient_descent("mse", k, y)


def test_without_torchdiffeq_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchdiffeq", None)
    with pytest.raises(ImportError, match="pip install 'torchntk\\[predict\\]'"):
        predict.gradient_descent(_mse, _eye(2), _zeros(2, 1))


# -- gp_inference --------------------------------------------------------------------------------


def test_gp_inference_against_dense_solves():
    n, n_test = 6, 3
    nngp_dd, nngp_td, nngp_tt = _joint(n, n_test, seed=7)
    ntk_dd, ntk_td, ntk_tt = _joint(n, n_test, seed=8)
    y = _randn(n, 2, dtype=F64)
    Kernel = torchntk._call.outputs.empirical_kernel_type(("nngp", "ntk"))
    k_dd, k_td, k_tt = Kernel(nngp_dd, ntk_dd), Kernel(nngp_td, ntk_td), Kernel(nngp_tt, ntk_tt)
    result = predict.gp_inference(k_dd, y)(("nngp", "ntk", "ntkgp"), k_td, k_tt)
    solve = torch.linalg.solve
    _close(result.nngp.mean, nngp_td @ solve(nngp_dd, y))
    _close(result.nngp.covariance, nngp_tt - nngp_td @ solve(nngp_dd, nngp_td.T))
    _close(result.ntk.mean, ntk_td @ solve(ntk_dd, y))
    a = ntk_td @ solve(ntk_dd, _eye(n, dtype=F64))               # T_td T^{-1}
    ntk_cov = nngp_tt + a @ nngp_dd @ a.T - a @ nngp_td.T - nngp_td @ a.T
    _close(result.ntk.covariance, ntk_cov)
    _close(result.ntkgp.mean, result.ntk.mean)
    _close(result.ntkgp.covariance, ntk_tt - ntk_td @ solve(ntk_dd, ntk_td.T))
    means = predict.gp_inference(k_dd, y)(None, k_td)
    assert type(means).__name__ == "Gaussians" and means._fields == ("nngp", "ntk")
    _close(means.ntk, result.ntk.mean)
    on_train = predict.gp_inference(ntk_dd, y)("ntk", None, True)
    _close(on_train.mean, y)
    assert torch.count_nonzero(on_train.covariance) == 0


def test_gp_inference_with_library_kernels_and_a_full_layout():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2)).double().to(DEVICE)
    kernel_fn = torchntk.empirical_kernel_fn(model, trace_axes=(), vmap_axes=0)
    x_train, x_test = _randn(5, 3, dtype=F64), _randn(2, 3, dtype=F64)
    y = _randn(5, 2, dtype=F64)
    k_dd, k_td, k_tt = kernel_fn(x_train), kernel_fn(x_test, x_train), kernel_fn(x_test)
    result = predict.gp_inference(k_dd, y, diag_reg=1e-3, trace_axes=())("ntk", k_td, k_tt)
    assert result.mean.shape == (2, 2) and result.covariance.shape == (2, 2, 2, 2)
    covariance = result.covariance.permute(0, 2, 1, 3).reshape(4, 4)
    assert torch.linalg.eigvalsh(covariance).min() > -1e-8  # a covariance is PSD


def test_gp_inference_errors_and_jitter():
    y = _zeros(3, 1, dtype=F64)
    with pytest.raises(ValueError, match="not positive definite"):
        predict.gp_inference(-_eye(3, dtype=F64), y)("nngp", _ones(1, 3, dtype=F64))
    singular = _psd(3, 9, rank=1)  # rank one: Cholesky needs jitter
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mean = predict.gp_inference(singular, y + 1)("nngp", _ones(1, 3, dtype=F64))
    assert torch.isfinite(mean).all() and any("added" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="hold a 'nngp' kernel"):
        Kernel = torchntk._call.outputs.empirical_kernel_type(("ntk",))
        predict.gp_inference(Kernel(_eye(3, dtype=F64)), y)("nngp", _ones(1, 3, dtype=F64))
    with pytest.raises(ValueError, match="needs both the NNGP and the NTK"):
        predict.gp_inference(_eye(3, dtype=F64), y)("ntk", _ones(1, 3, dtype=F64), _ones(1, 1, dtype=F64))
    with pytest.raises(ValueError, match="`get` must name each of"):
        predict.gp_inference(_eye(3, dtype=F64), y)("gp")
    with pytest.raises(ValueError, match="`k_test_test` has shape"):
        predict.gp_inference(_eye(3, dtype=F64), y)("nngp", _ones(1, 3, dtype=F64), _ones(2, 2, dtype=F64))


# -- gradient_descent_mse_ensemble ---------------------------------------------------------------


class _FixedKernels:
    """A kernel function over index inputs, returning blocks of fixed NNGP and NTK matrices."""

    def __init__(self, nngp: torch.Tensor, ntk: torch.Tensor):
        self.kernels = {"nngp": nngp, "ntk": ntk}

    def __call__(self, x1, x2=None, get=None, **kwargs):
        x2 = x1 if x2 is None else x2
        names = (get,) if isinstance(get, str) else tuple(get)
        blocks = {name: self.kernels[name][x1][:, x2] for name in names}
        if isinstance(get, str):
            return blocks[get]
        return torchntk._call.outputs.empirical_kernel_type(names)(**blocks)


def test_ensemble_against_dense_formulas():
    n, n_test = 5, 3
    nngp, ntk = _psd(n + n_test, 10), _psd(n + n_test, 11)
    train, test = _arange(n), _arange(n, n + n_test)
    y = _randn(n, 1, dtype=F64)
    predict_fn = predict.gradient_descent_mse_ensemble(_FixedKernels(nngp, ntk), train, y, learning_rate=0.9)
    t = 2.5
    tau = 0.9 * t / y.numel()
    for name in ("nngp", "ntk"):
        theta = (nngp if name == "nngp" else ntk)
        t_dd, t_td = theta[:n, :n], theta[n:, :n]
        k_dd, k_td, k_tt = nngp[:n, :n], nngp[n:, :n], nngp[n:, n:]
        decay = _eye(n, dtype=F64) - torch.linalg.matrix_exp(-tau * t_dd)
        a = t_td @ torch.linalg.solve(t_dd, decay)               # f_test(t) = f_test(0) + a (y - f(0))
        mean = a @ y
        covariance = k_tt - a @ k_td.T - k_td @ a.T + a @ k_dd @ a.T
        got = predict_fn(t, test, name, compute_cov=True)
        _close(got.mean, mean)
        _close(got.covariance, covariance, 1e-8)
        train_got = predict_fn(t, None, name, compute_cov=True)
        b = torch.linalg.matrix_exp(-tau * t_dd)                  # f(t) - y = b (f(0) - y)
        _close(train_got.mean, (_eye(n, dtype=F64) - b) @ y)
        _close(train_got.covariance, b @ k_dd @ b.T, 1e-8)
    both = predict_fn(_tensor([1.0, 2.0]), test)
    assert both._fields == ("nngp", "ntk") and both.ntk.shape == (2, n_test, 1)
    converged = predict_fn(None, test, "ntk", compute_cov=True)
    late = predict_fn(_tensor(1e9), test, "ntk", compute_cov=True)
    _close(late.mean, converged.mean, 1e-6)
    _close(late.covariance, converged.covariance, 1e-6)


def test_ensemble_with_a_monte_carlo_kernel_function():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)).double().to(DEVICE)
    kernel_fn = torchntk.monte_carlo_kernel_fn(model, 4, seed=0, vmap_axes=0)
    x_train, x_test = _randn(6, 2, dtype=F64), _randn(3, 2, dtype=F64)
    y = _randn(6, 1, dtype=F64)
    result = predict.gradient_descent_mse_ensemble(kernel_fn, x_train, y, diag_reg=1e-6)(
        _tensor([1.0, 100.0]), x_test, ("nngp", "ntk"), compute_cov=True
    )
    assert result.ntk.mean.shape == (2, 3, 1) and result.ntk.covariance.shape == (2, 3, 3)


# -- max_learning_rate ---------------------------------------------------------------------------


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_max_learning_rate_is_the_edge_of_stability(momentum):
    k = _psd(6, 12)
    y = _randn(6, 1, dtype=F64)
    lr = predict.max_learning_rate(k, y.numel(), momentum)
    assert lr == pytest.approx(2 * (1 + momentum) * 6 / torch.linalg.eigvalsh(k)[-1].item(), rel=1e-9)

    def final_error(rate: float) -> float:  # discrete heavy-ball GD in function space
        f, velocity = torch.zeros_like(y), torch.zeros_like(y)
        for _ in range(3000):
            velocity = momentum * velocity - rate / y.numel() * k @ (f - y)
            f = f + velocity
        return (f - y).norm().item()

    assert final_error(0.95 * lr) < 1e-6
    assert final_error(1.05 * lr) > 1e3


def test_max_learning_rate_errors():
    with pytest.raises(ValueError, match="pairs of equal axes"):
        predict.max_learning_rate(_ones(2, 3))


# -- the real check: trained networks ------------------------------------------------------------


def _wide_problem():
    generator = torch.Generator().manual_seed(1)
    x_train = _randn(12, 3, generator=generator, dtype=F64)
    x_test = _randn(6, 3, generator=generator, dtype=F64)
    return x_train, x_test, torch.sin(x_train.sum(1, keepdim=True))


def _wide_mlp(width: int) -> torch.nn.Module:
    from tests.ntk_param import NtkDense

    torch.manual_seed(0)
    model = torch.nn.Sequential(NtkDense(3, width, 1.5, 0.1, F64), torch.nn.Tanh(), NtkDense(width, 1, 1.5, 0.1, F64))
    return model.to(DEVICE)


def _train(model, x_train, x_test, y, lr, steps, checkpoints):
    """Full-batch gradient descent on ||f - y||^2 / (2 |y|) with plain PyTorch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    train, test = [], []
    for step in range(steps + 1):
        if step in checkpoints:
            with torch.no_grad():
                train.append(model(x_train))
                test.append(model(x_test))
        if step == steps:
            break
        optimizer.zero_grad()
        (((model(x_train) - y) ** 2).sum() / (2 * y.numel())).backward()
        optimizer.step()
    return torch.stack(train), torch.stack(test)


@pytest.mark.slow
def test_trained_wide_networks_follow_the_prediction_closer_as_width_grows():
    """A finite learning rate adds an O(lr) gap to gradient flow; training at lr and lr / 2 and
    extrapolating (2 f(lr / 2) - f(lr)) removes it, leaving the finite-width error, which must
    shrink with the width."""
    x_train, x_test, y = _wide_problem()
    steps = [0, 150, 500, 1500]
    errors = {}
    for width in (2048, 16384):
        model = _wide_mlp(width)
        ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0)
        k_dd, k_td = ntk_fn(x_train), ntk_fn(x_test, x_train)
        lr = predict.max_learning_rate(k_dd) / 500
        with torch.no_grad():
            f0, g0 = model(x_train), model(x_test)
        coarse = _train(_wide_mlp(width), x_train, x_test, y, lr, 1500, steps)
        fine = _train(_wide_mlp(width), x_train, x_test, y, lr / 2, 3000, [2 * s for s in steps])
        predicted = predict.gradient_descent_mse(k_dd, y, lr, trace_axes=())(_tensor(steps, dtype=F64), f0, g0, k_td)
        for side, (a, b, p) in enumerate(zip(coarse, fine, predicted)):
            trained = 2 * b - a
            errors[width, side] = ((p[1:] - trained[1:]).norm() / (trained[1:] - trained[:1]).norm()).item()
    for side in (0, 1):  # 0: train outputs, 1: test outputs
        assert errors[2048, side] < 1e-3
        assert errors[16384, side] < errors[2048, side] / 2, errors


def test_training_the_linearised_network_matches_to_near_machine_precision():
    """Gradient flow on the parameters of torchntk.linearize(model), integrated tightly, is the
    closed form exactly: the linearised network's function-space dynamics are linear."""
    import torchdiffeq

    x_train, x_test, y = _wide_problem()
    model = _wide_mlp(512)
    linear = torchntk.linearize(model)
    names = [name for name, _ in model.named_parameters()]
    start = tuple(p.detach().clone() for p in model.parameters())
    lr, t_end = 0.3, 400.0

    def outputs(values: tuple, x: torch.Tensor) -> torch.Tensor:
        return linear(dict(zip(names, values)), x)

    loss_gradient = torch.func.grad(lambda values: ((outputs(values, x_train) - y) ** 2).sum() / (2 * y.numel()))
    times = _tensor([0.0, 40.0, t_end], dtype=F64)
    path = torchdiffeq.odeint(
        lambda _, values: tuple(-lr * g for g in loss_gradient(values)), start, times, rtol=1e-12, atol=1e-14
    )
    trained_train = torch.stack([outputs(tuple(p[i] for p in path), x_train) for i in range(len(times))])
    trained_test = torch.stack([outputs(tuple(p[i] for p in path), x_test) for i in range(len(times))])
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0)
    with torch.no_grad():
        f0, g0 = model(x_train), model(x_test)
    predicted = predict.gradient_descent_mse(ntk_fn(x_train), y, lr, trace_axes=())(times, f0, g0, ntk_fn(x_test, x_train))
    _close(predicted[0], trained_train, 1e-9)
    _close(predicted[1], trained_test, 1e-9)


@pytest.mark.cpu_only("runs the example script in a subprocess, on the device it picks itself")
def test_the_example_script_draws_its_figure(tmp_path):
    script = __import__("pathlib").Path(__file__).resolve().parents[1] / "examples" / "predict_training_curves.py"
    output = tmp_path / "curves.png"
    done = run_python(script, "--widths", "16,256", "--steps", "100", "--output", output, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "width 256: final test loss" in done.stdout and output.stat().st_size > 10_000
