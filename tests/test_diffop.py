"""Models that take derivatives inside their forward pass: PINN residuals and force fields.

NOTE: [Derivatives inside the forward pass] (``torchntk/_model/inner_derivatives.py``). Every
kernel is checked against an independent float64 reference: the residual (or the forces) written
here again as a pure function of raw parameter tensors with ``torch.func`` (``hessian`` or ``grad``
with respect to the input), its per-example Jacobian over the parameters by ``vmap(jacrev)``, and
the kernel contracted from those Jacobians. The models are written the two ways users write them:
``torch.autograd.grad(..., create_graph=True)`` inside ``forward`` (on ``x.clone().requires_grad_()``,
``x.requires_grad_()``, ``x.detach().requires_grad_()`` or an input that requires grad already) and
``torch.func`` transforms inside ``forward``; each through implementations 1, 2, 3 and AUTO, with
``vmap_axes`` 0, None and the default. Small networks and few points keep the default run short;
the whole grid is ``slow``.
"""

from __future__ import annotations

import itertools
import threading

import pytest
import torch
from torch import nn
from torch.func import grad, hessian, jacrev, vmap

import torchntk
from tests.cases import DEVICE
from torchntk._implementations.structured import _unrolled as unrolled
from torchntk._model.inner_derivatives import InnerBackwardError, takes_derivatives

pytestmark = pytest.mark.filterwarnings("ignore::torchntk.ExampleLoopWarning")

IMPLEMENTATIONS = (1, 2, 3, 0)
VMAP_AXES = {"0": 0, "None": None, "default": "default"}
WIDTH = 8


def _ntk_fn(model, implementation, vmap_axes, **options):
    if vmap_axes != "default":
        options["vmap_axes"] = vmap_axes
    return torchntk.empirical_ntk_fn(model, implementation=implementation, **options)


def _mlp(inputs: int, dtype: torch.dtype) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(inputs, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1)
    ).to(DEVICE, dtype)


# -- the models, as users write them -------------------------------------------------------------


class PoissonAutograd(nn.Module):
    """``(u, u_xx + u_yy)`` by ``torch.autograd.grad(create_graph=True)``; ``mark`` says how the
    input comes to require grad."""

    def __init__(self, dtype: torch.dtype, mark: str = "clone"):
        super().__init__()
        self.net = _mlp(2, dtype)
        self.mark = mark

    def forward(self, x: torch.Tensor, which: str = "both"):
        if which == "u":
            return self.net(x)
        if self.mark == "clone":
            x = x.clone().requires_grad_()
        elif self.mark == "in place":
            x.requires_grad_()
        elif self.mark == "detach":
            x = x.detach().requires_grad_()
        # "given": the input requires grad already
        u = self.net(x)
        du = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)[0]
        laplacian = sum(torch.autograd.grad(du[:, i].sum(), x, create_graph=True)[0][:, i] for i in range(2))
        residual = laplacian.unsqueeze(-1)
        return residual if which == "r" else (u, residual)


class PoissonFunc(nn.Module):
    """``(u, u_xx + u_yy)`` by ``torch.func`` inside ``forward``."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.net = _mlp(2, dtype)

    def forward(self, x: torch.Tensor, which: str = "both"):
        u = self.net(x)
        if which == "u":
            return u
        hessians = vmap(hessian(lambda point: self.net(point).squeeze(-1)))(x)
        residual = hessians.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True)
        return residual if which == "r" else (u, residual)


def _poisson(style: str, dtype: torch.dtype) -> nn.Module:
    return PoissonFunc(dtype) if style == "torch.func" else PoissonAutograd(dtype, style)


ATOMS = 4


def _inverse_distances(positions: torch.Tensor) -> torch.Tensor:
    first, second = torch.triu_indices(ATOMS, ATOMS, 1, device=positions.device)
    return 1.0 / (positions[..., first, :] - positions[..., second, :]).norm(dim=-1)


class ForcesAutograd(nn.Module):
    """Forces ``-dE/dx`` of an energy network of inverse pair distances, with ``create_graph`` only
    in training mode, as force-field codes write it: in eval mode PyTorch would return constants."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(ATOMS * (ATOMS - 1) // 2, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 1))
        self.net.to(DEVICE, dtype)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        positions = positions.clone().requires_grad_()
        energy = self.net(_inverse_distances(positions)).sum()
        return -torch.autograd.grad(energy, positions, create_graph=self.training)[0]


class ForcesFunc(ForcesAutograd):
    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return -vmap(grad(lambda one: self.net(_inverse_distances(one)).squeeze(-1)))(positions)


# -- the independent float64 reference -----------------------------------------------------------


def _raw(module: nn.Module) -> list[torch.Tensor]:
    return [param.detach().to(torch.float64) for param in module.parameters()]


def _mlp_value(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The MLP as a pure function of its weights and biases, in order, on one point."""
    h = x
    for index in range(0, len(params), 2):
        h = h @ params[index].T + params[index + 1]
        if index + 2 < len(params):
            h = torch.tanh(h)
    return h.squeeze(-1)


def _u(params, point):
    return _mlp_value(params, point)


def _residual(params, point):
    return torch.diagonal(hessian(_mlp_value, argnums=1)(params, point)).sum()


def _forces(params, positions):
    return -grad(lambda one: _mlp_value(params, _inverse_distances(one)), argnums=0)(positions)


def _jacobian(function, params, x):
    """Per-example Jacobians over the parameters, flattened: ``(N, *output, P)``."""
    per_param = vmap(jacrev(function), (None, 0))(params, x.detach().to(torch.float64))
    n = x.shape[0]
    output = per_param[0].shape[1 : per_param[0].ndim - params[0].ndim]
    return torch.cat([j.reshape(n, *output, -1) for j in per_param], dim=-1)


def reference(function, params, x1, x2, function2=None):
    """``J(x1) J(x2)^T`` of a scalar function of one point: ``(N1, N2)``; with ``function2``, the
    cross-kernel of ``function`` on x1 and ``function2`` on x2."""
    return _jacobian(function, params, x1) @ _jacobian(function2 or function, params, x2).T


def force_reference(params, x1, x2):
    """The full kernel of the forces, laid out as torchntk lays ``(N, A, 3)`` outputs out:
    ``(N1, N2, A, A, 3, 3)``."""
    return torch.einsum("naip,mbjp->nmabij", _jacobian(_forces, params, x1), _jacobian(_forces, params, x2))


def _assert_close(kernel: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = 1e-10 if dtype == torch.float64 else 1e-4
    assert kernel.shape == expected.shape
    scale = expected.abs().max()
    assert (kernel.double() - expected).abs().max() <= tolerance * scale, (kernel, expected)


def _points(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, 2, generator=generator, dtype=dtype).to(DEVICE)


def _check_poisson(style: str, implementation: int, vmap_axes, dtype: torch.dtype, calls: int = 1) -> tuple:
    """Checks ``calls`` calls of one kernel function; returns it and its inputs."""
    torch.manual_seed(0)
    model = _poisson(style, dtype)
    x1, x2 = _points(5, dtype, 1), _points(4, dtype, 2)
    if style == "given":
        x1.requires_grad_()
        x2.requires_grad_()
    params = _raw(model)
    ntk_fn = _ntk_fn(model, implementation, vmap_axes)
    for _ in range(calls):
        u, residual = ntk_fn(x1, x2)
        _assert_close(u, reference(_u, params, x1, x2), dtype)
        _assert_close(residual, reference(_residual, params, x1, x2), dtype)
    return ntk_fn, x1, x2


# -- PINN residuals --------------------------------------------------------------------------------


@pytest.mark.parametrize("vmap_axes", VMAP_AXES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("style", ["clone", "torch.func"])
def test_the_poisson_residual_and_the_values_are_exact_with_every_implementation(style, implementation, vmap_axes):
    _check_poisson(style, implementation, VMAP_AXES[vmap_axes], torch.float64)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("style", ["clone", "torch.func"])
def test_float32_kernels_match_the_float64_reference(style, implementation):
    _check_poisson(style, implementation, "default", torch.float32)


@pytest.mark.parametrize("style", ["in place", "detach", "given"])
def test_every_way_of_marking_the_input_gives_the_exact_kernel(style):
    _check_poisson(style, 0, "default", torch.float64)


@pytest.mark.slow
@pytest.mark.parametrize(
    "style,implementation,vmap_axes,dtype",
    list(itertools.product(
        ["clone", "in place", "detach", "given", "torch.func"], IMPLEMENTATIONS, VMAP_AXES, ["float32", "float64"]
    )),
)
def test_the_whole_grid_of_styles_implementations_axes_and_dtypes(style, implementation, vmap_axes, dtype):
    _check_poisson(style, implementation, VMAP_AXES[vmap_axes], getattr(torch, dtype))


@pytest.mark.parametrize("vmap_axes", ["0", "None"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_cross_kernel_of_values_and_residual_from_keyword_arguments_per_side(implementation, vmap_axes):
    # K_ur of the PINN paper: boundary values on x1, the residual on x2, one 2-tuple keyword argument
    torch.manual_seed(0)
    model = PoissonAutograd(torch.float64)
    boundary, collocation = _points(5, torch.float64, 3), _points(6, torch.float64, 4)
    ntk_fn = _ntk_fn(model, implementation, VMAP_AXES[vmap_axes])
    params = _raw(model)
    _assert_close(
        ntk_fn(boundary, collocation, which=("u", "r")), reference(_u, params, boundary, collocation, _residual),
        torch.float64,
    )
    _assert_close(ntk_fn(collocation, which="r"), reference(_residual, params, collocation, collocation), torch.float64)


def test_a_model_that_takes_its_derivatives_only_for_some_arguments_is_found_when_it_does():
    # Its first call takes none ("u"), so it is evaluated as it is; a later call that does ("r") is
    # found, evaluated in its own level, and exact.
    torch.manual_seed(0)
    model = PoissonAutograd(torch.float64)
    x = _points(4, torch.float64, 5)
    ntk_fn = torchntk.empirical_ntk_fn(model)
    params = _raw(model)
    _assert_close(ntk_fn(x, which="u"), reference(_u, params, x, x), torch.float64)
    assert takes_derivatives(model) is None
    _assert_close(ntk_fn(x, which="r"), reference(_residual, params, x, x), torch.float64)
    assert takes_derivatives(model) == "torch.autograd.grad"


def test_a_function_of_params_that_differentiates_inside():
    torch.manual_seed(0)
    params = [torch.randn(WIDTH, 2, dtype=torch.float64), torch.randn(WIDTH, dtype=torch.float64),
              torch.randn(1, WIDTH, dtype=torch.float64), torch.randn(1, dtype=torch.float64)]
    params = [param.to(DEVICE) for param in params]

    def f(params, x):
        x = x.clone().requires_grad_()
        u = _mlp_value(params, x)
        du = torch.autograd.grad(u.sum(), x, create_graph=True)[0]
        return sum(torch.autograd.grad(du[:, i].sum(), x, create_graph=True)[0][:, i] for i in range(2))

    x1, x2 = _points(5, torch.float64, 6), _points(3, torch.float64, 7)
    kernel = torchntk.empirical_ntk_fn(f, vmap_axes=0, trace_axes=())(x1, x2, params)
    _assert_close(kernel, reference(_residual, params, x1, x2), torch.float64)


class PoissonAutogradFunctional(nn.Module):
    """The residual by ``torch.autograd.functional.hessian(create_graph=True)`` per point, inside an
    ``enable_grad`` block: two more ways tutorials write it (the Hessian calls autograd.grad itself)."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.net = _mlp(2, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            hessians = torch.stack([
                torch.autograd.functional.hessian(lambda point: self.net(point).squeeze(-1), one, create_graph=True)
                for one in x
            ])
        return hessians.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True)


@pytest.mark.parametrize("vmap_axes", ["0", "None"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_torch_autograd_functional_inside_the_forward_pass(implementation, vmap_axes):
    torch.manual_seed(0)
    model = PoissonAutogradFunctional(torch.float64)
    x1, x2 = _points(4, torch.float64, 8), _points(3, torch.float64, 9)
    kernel = _ntk_fn(model, implementation, VMAP_AXES[vmap_axes])(x1, x2)
    _assert_close(kernel, reference(_residual, _raw(model), x1, x2), torch.float64)


# -- force fields ----------------------------------------------------------------------------------


def _molecules(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(n, ATOMS, 3, generator=generator, dtype=dtype) * 2).to(DEVICE)


def _check_forces(model_class, implementation: int, vmap_axes) -> None:
    torch.manual_seed(0)
    model = model_class(torch.float64).eval()  # ForcesAutograd: create_graph=False in eval mode
    x1, x2 = _molecules(3, torch.float64, 1), _molecules(2, torch.float64, 2)
    kernel = _ntk_fn(model, implementation, vmap_axes, trace_axes=())(x1, x2)
    _assert_close(kernel, force_reference(_raw(model), x1, x2), torch.float64)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("model_class", [ForcesAutograd, ForcesFunc], ids=["autograd", "torch.func"])
def test_the_force_field_kernel_is_exact(model_class, implementation):
    _check_forces(model_class, implementation, "default")


@pytest.mark.slow
@pytest.mark.parametrize("vmap_axes", ["0", "None"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("model_class", [ForcesAutograd, ForcesFunc], ids=["autograd", "torch.func"])
def test_the_force_field_kernel_is_exact_with_explicit_axes(model_class, implementation, vmap_axes):
    _check_forces(model_class, implementation, VMAP_AXES[vmap_axes])


# -- what implementation 3 does, and what stays as it was -------------------------------------------


def test_implementation_3_leaves_what_the_model_differentiates_to_its_exact_fallback_and_says_why():
    torch.manual_seed(0)
    model = PoissonAutograd(torch.float64)
    x = _points(4, torch.float64, 8)
    choice = torchntk.empirical_ntk_fn(model, implementation=3).auto_choice(x)
    assert set(choice.fallback_parameters) == {name for name, _ in model.named_parameters()}
    assert all("takes derivatives inside its forward pass" in reason for reason in choice.fallback_parameters.values())


class _HeadAfterResidual(PoissonFunc):
    """A dense head on the residual: its weights are used outside any derivative the model takes."""

    def __init__(self, dtype: torch.dtype):
        super().__init__(dtype)
        self.head = nn.Linear(1, 3).to(DEVICE, dtype)

    def forward(self, x):
        return self.head(super().forward(x, which="r"))


@pytest.mark.parametrize("vmap_axes", ["0", "None"])
def test_implementation_3_keeps_its_rules_outside_the_models_own_transforms(vmap_axes):
    torch.manual_seed(0)
    model = _HeadAfterResidual(torch.float64)
    x1, x2 = _points(4, torch.float64, 9), _points(3, torch.float64, 10)
    ntk_fn = _ntk_fn(model, 3, VMAP_AXES[vmap_axes], trace_axes=())
    assert set(ntk_fn.auto_choice(x1, x2).fallback_parameters) == {name for name, _ in model.net.named_parameters(prefix="net")}
    expected = _ntk_fn(model, 1, VMAP_AXES[vmap_axes], trace_axes=())(x1, x2)
    _assert_close(ntk_fn(x1, x2), expected, torch.float64)
    params = _raw(model)  # and implementation 1 against the reference, the head included

    def outputs(params, point):
        return _residual(params[:-2], point) * params[-2].squeeze(-1) + params[-1]

    _assert_close(
        expected, torch.einsum("nap,mbp->nmab", _jacobian(outputs, params, x1), _jacobian(outputs, params, x2)),
        torch.float64,
    )


def test_ordinary_models_and_hooks_asking_for_gradients_stay_as_they_are():
    # A forward hook that marks the output as requiring grad (as Hugging Face's
    # enable_input_require_grads does) is no derivative: implementation 3 keeps its rules.
    torch.manual_seed(0)
    model = _mlp(2, torch.float64)
    model[0].register_forward_hook(lambda module, args, output: output.requires_grad_(True))
    x = _points(4, torch.float64, 11)
    choice = torchntk.empirical_ntk_fn(model, implementation=3).auto_choice(x)
    assert choice.fallback_parameters == {}
    assert takes_derivatives(model) is None


def test_the_users_inputs_keep_their_requires_grad_flag_and_values():
    torch.manual_seed(0)
    model = PoissonAutograd(torch.float64, "in place")
    x, given = _points(4, torch.float64, 12), _points(4, torch.float64, 13).requires_grad_()
    before = x.clone()
    torchntk.empirical_ntk_fn(model)(x)
    torchntk.empirical_ntk_fn(model, implementation=2)(given)
    assert not x.requires_grad and torch.equal(x, before) and given.requires_grad and given.grad is None
    assert all(param.grad is None for param in model.parameters())


class _Backward(ForcesAutograd):
    def forward(self, positions):
        positions = positions.clone().requires_grad_()
        self.net(_inverse_distances(positions)).sum().backward(create_graph=True)
        return -positions.grad


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_backward_inside_the_forward_pass_is_refused_with_the_cause_and_the_rewrite(implementation):
    model = _Backward(torch.float64)
    with pytest.raises(InnerBackwardError, match="takes derivatives inside its forward pass with Tensor.backward") as info:
        _ntk_fn(model, implementation, "default")(_molecules(2, torch.float64, 3))
    assert isinstance(info.value, ValueError) and "torch.autograd.grad(outputs, inputs, create_graph=True)" in str(info.value)
    assert all(param.grad is None for param in model.parameters())


def test_threads_computing_kernels_of_one_model_at_once():
    torch.manual_seed(0)
    model = PoissonAutograd(torch.float64)
    x = _points(4, torch.float64, 14)
    expected = reference(_residual, _raw(model), x, x)
    results, errors = [], []

    def run():
        try:
            results.append(torchntk.empirical_ntk_fn(model)(x)[1])
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for kernel in results:
        _assert_close(kernel, expected, torch.float64)


def test_kronecker_sketches_project_what_the_model_differentiates_from_gradients():
    # The capture of linear layers cannot see the derivative the model takes: those weights are
    # projected from their per-example gradients, which is unbiased (no internal assert either).
    torch.manual_seed(0)
    model = PoissonFunc(torch.float64)
    x = _points(6, torch.float64, 15)
    expected = reference(_residual, _raw(model), x, x)
    sketched = torchntk.sketched_ntk_fn(_ResidualOnly(model), k=8192, projection="kronecker", seed=0)(x)
    assert sketched.shape == expected.shape
    assert (sketched - expected).abs().max() <= 0.2 * expected.abs().max()


class _ResidualOnly(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x, which="r")


# -- derivatives with respect to the parameters (a MAML inner step) ---------------------------------


class InnerStep(nn.Module):
    """One gradient step on a loss of the batch, then the adapted network's output: the model
    differentiates with respect to its own parameters (MAML's inner loop), which couples the examples."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.net = _mlp(2, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = dict(self.net.named_parameters())
        loss = (self.net(x) ** 2).mean()
        grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
        adapted = {name: param - 0.1 * g for (name, param), g in zip(params.items(), grads)}
        return torch.func.functional_call(self.net, adapted, (x,))


def _inner_step(params, x):
    """The same, as a pure function of the batch: ``(N,)``."""
    inner = grad(lambda p: (_mlp_value(p, x) ** 2).mean())(params)
    return _mlp_value([param - 0.1 * g for param, g in zip(params, inner)], x)


def _batch_reference(params, x):
    jacobians = jacrev(_inner_step)(params, x.detach().to(torch.float64))
    flat = torch.cat([j.reshape(x.shape[0], -1) for j in jacobians], dim=-1)
    return flat @ flat.T


@pytest.mark.parametrize("vmap_axes", ["None", "default"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_model_that_differentiates_with_respect_to_its_parameters_is_exact(implementation, vmap_axes):
    torch.manual_seed(0)
    model = InnerStep(torch.float64)
    x = _points(5, torch.float64, 16)
    kernel = _ntk_fn(model, implementation, VMAP_AXES[vmap_axes])(x)
    _assert_close(kernel, _batch_reference(_raw(model), x), torch.float64)
    assert all(not param.grad_fn and param.grad is None for param in model.parameters())


def test_implementation_3_knows_the_parameters_a_model_differentiates_and_leaves_them_to_its_fallback():
    torch.manual_seed(0)
    model = InnerStep(torch.float64)
    choice = torchntk.empirical_ntk_fn(model, implementation=3).auto_choice(_points(4, torch.float64, 17))
    assert set(choice.fallback_parameters) == {name for name, _ in model.named_parameters()}
    assert all("takes derivatives inside its forward pass" in reason for reason in choice.fallback_parameters.values())


# -- implementation 3 through the derivatives: the traced forward pass (NOTE: [Unrolled derivatives])


@pytest.fixture
def unrolled_always(monkeypatch):
    """Implementation 3 unrolls wherever the trace stands for the model, whatever the cost: small
    models then take the path that wide ones take by their price."""
    monkeypatch.setattr(unrolled, "_ALWAYS", True)


def _fallback(ntk_fn, *args, **kwargs) -> dict:
    return ntk_fn.auto_choice(*args, **kwargs).fallback_parameters


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("vmap_axes", VMAP_AXES)
@pytest.mark.parametrize("style", ["clone", "in place", "detach", "given", "torch.func"])
def test_implementation_3_through_the_derivatives_is_exact_and_leaves_nothing_to_its_fallback(
    unrolled_always, style, vmap_axes, dtype
):
    # the first call, a warm one and a later one
    ntk_fn, x1, x2 = _check_poisson(style, 3, VMAP_AXES[vmap_axes], getattr(torch, dtype), calls=3)
    assert _fallback(ntk_fn, x1, x2) == {}


@pytest.mark.parametrize("implementation", [3, 0])
def test_the_cross_kernel_through_the_derivatives_traces_each_side(unrolled_always, implementation):
    torch.manual_seed(0)
    model = PoissonAutograd(torch.float64)
    boundary, collocation = _points(5, torch.float64, 3), _points(6, torch.float64, 4)
    ntk_fn = _ntk_fn(model, implementation, "default")
    params = _raw(model)
    for _ in range(2):
        _assert_close(
            ntk_fn(boundary, collocation, which=("u", "r")),
            reference(_u, params, boundary, collocation, _residual), torch.float64,
        )
    if implementation == 3:
        assert _fallback(ntk_fn, boundary, collocation, which=("u", "r")) == {}


@pytest.mark.parametrize("vmap_axes", ["0", "default"])
@pytest.mark.parametrize("model_class", [ForcesAutograd, ForcesFunc], ids=["autograd", "torch.func"])
def test_the_force_field_through_its_derivatives_is_exact(unrolled_always, model_class, vmap_axes):
    torch.manual_seed(0)
    model = model_class(torch.float64).eval()
    x1, x2 = _molecules(3, torch.float64, 1), _molecules(2, torch.float64, 2)
    ntk_fn = _ntk_fn(model, 3, VMAP_AXES[vmap_axes], trace_axes=())
    for _ in range(2):
        _assert_close(ntk_fn(x1, x2), force_reference(_raw(model), x1, x2), torch.float64)
    assert _fallback(ntk_fn, x1, x2) == {}


class _Scaled(PoissonAutograd):
    """A residual scaled by a plain Python number the module holds, which a trace freezes."""

    def __init__(self, dtype: torch.dtype):
        super().__init__(dtype)
        self.scale = 1.0

    def forward(self, x, which="r"):
        return super().forward(x, which) * self.scale


def test_a_changed_model_is_traced_again_and_its_kernel_stays_exact(unrolled_always):
    torch.manual_seed(0)
    model = _Scaled(torch.float64)
    x = _points(5, torch.float64, 18)
    ntk_fn = _ntk_fn(model, 3, "default")
    _assert_close(ntk_fn(x), reference(_residual, _raw(model), x, x), torch.float64)
    with torch.no_grad():  # new values of the parameters: the graph's inputs
        model.net[2].weight.mul_(1.5)
    _assert_close(ntk_fn(x), reference(_residual, _raw(model), x, x), torch.float64)
    model.scale = 3.0  # a number the trace froze: the outputs differ, so the model is traced again
    _assert_close(ntk_fn(x), 9.0 * reference(_residual, _raw(model), x, x), torch.float64)
    assert _fallback(ntk_fn, x) == {}


class _DetachedScale(PoissonAutograd):
    """A residual divided by its own size with the size detached: a stop-gradient of the model's own
    that the trace's ``detach`` (an alias to autograd's saved tensors) would differentiate through."""

    def forward(self, x, which="r"):
        residual = super().forward(x, which)
        return residual / residual.detach().abs().mean().clamp_min(1e-3)


def _normalised_residual(params, point):
    residual = _residual(params, point)
    return residual / residual.detach().abs().clamp_min(1e-3)


def test_a_detach_of_the_models_own_keeps_the_exact_fallback_and_says_why(unrolled_always):
    torch.manual_seed(0)
    model = _DetachedScale(torch.float64)
    x = _points(1, torch.float64, 19)  # one point: the batch mean is the point's own size
    ntk_fn = _ntk_fn(model, 3, "default")
    _assert_close(ntk_fn(x), reference(_normalised_residual, _raw(model), x, x), torch.float64)
    reasons = _fallback(ntk_fn, x)
    assert set(reasons) == {name for name, _ in model.named_parameters()}
    assert all("takes derivatives inside its forward pass" in reason for reason in reasons.values())
    decision = [value for key, value in _records(ntk_fn) if key[0] == unrolled._KIND]
    assert [type(value).__name__ for value in decision] == ["NotUnrolled"]
    assert "other derivatives than the model" in decision[0].reason


class _Branching(PoissonAutograd):
    """A Python branch on a value of the input batch: a trace would freeze one side of it."""

    def forward(self, x, which="r"):
        residual = super().forward(x, which)
        return residual * 2.0 if bool(x.sum() > 1.0) else residual


def test_a_branch_on_a_value_fails_the_trace_and_keeps_the_exact_fallback(unrolled_always):
    torch.manual_seed(0)
    model = _Branching(torch.float64)
    ntk_fn = _ntk_fn(model, 3, "default")
    params = _raw(model)
    for seed in (20, 22):  # the branch taken, and not
        x = _points(5, torch.float64, seed) * (0.1 if seed == 22 else 1.0)
        factor = 2.0 if bool(x.sum() > 1.0) else 1.0
        _assert_close(ntk_fn(x), factor**2 * reference(_residual, params, x, x), torch.float64)
    decision = [value for key, value in _records(ntk_fn) if key[0] == unrolled._KIND]
    assert [type(value).__name__ for value in decision] == ["NotUnrolled"]
    assert "tracing its forward pass failed" in decision[0].reason


def test_small_models_keep_the_fallback_where_it_costs_less_than_tracing():
    torch.manual_seed(0)
    model = PoissonAutograd(torch.float64)
    x = _points(8, torch.float64, 21)
    ntk_fn = _ntk_fn(model, 3, "default")
    _assert_close(ntk_fn(x)[1], reference(_residual, _raw(model), x, x), torch.float64)
    decision = [value for key, value in _records(ntk_fn) if key[0] == unrolled._KIND]
    assert [type(value).__name__ for value in decision] == ["NotUnrolled"]
    assert "costs less than tracing" in decision[0].reason


@pytest.mark.parametrize("width,unrolls", [(128, True), (16, False)])
def test_implementation_3_goes_through_the_derivatives_where_its_contractions_are_priced_cheaper(
    monkeypatch, width, unrolls
):
    # The price of tracing aside (every kernel here is small), the rules' contractions through the
    # derivatives are priced against the fallback's: about T^2 (in + out) against in * out per layer
    monkeypatch.setattr(unrolled, "_MIN_FALLBACK_FLOPS", {False: 0.0, True: 0.0})
    torch.manual_seed(0)
    model = PoissonAutograd(torch.float64)
    model.net = nn.Sequential(
        nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 1)
    ).to(DEVICE, torch.float64)
    x = _points(16, torch.float64, 25)
    ntk_fn = _ntk_fn(model, 3, "default")
    for _ in range(2):
        _assert_close(ntk_fn(x, which="r"), reference(_residual, _raw(model), x, x), torch.float64)
    decision = [value for key, value in _records(ntk_fn) if key[0] == unrolled._KIND]
    assert [type(value).__name__ for value in decision] == ["Unrolled" if unrolls else "NotUnrolled"]
    if not unrolls:
        assert "cost more than the fallback's" in decision[0].reason
    assert (_fallback(ntk_fn, x, which="r") == {}) == unrolls


def _records(ntk_fn) -> list:
    """``(key, value)`` of every entry the kernel function's implementations keep in its plan
    records (NOTE: [One record per key])."""
    return [
        (key, value)
        for record in ntk_fn._settings.planner._records._entries.values()
        for key, value in record.derived._entries.items()
    ]


def test_compile_leaves_calls_through_the_derivatives_eager_with_a_warning(unrolled_always):
    torch.manual_seed(0)
    model = PoissonAutograd(torch.float64)
    x = _points(5, torch.float64, 23)
    ntk_fn = _ntk_fn(model, 3, "default", compile="eager")
    expected = reference(_residual, _raw(model), x, x)
    with pytest.warns(RuntimeWarning, match="through a graph traced from the derivatives"):
        _assert_close(ntk_fn(x, which="r"), expected, torch.float64)
    for _ in range(2):  # the calls stay eager, exact, and say nothing more
        _assert_close(ntk_fn(x, which="r"), expected, torch.float64)
    assert _fallback(ntk_fn, x, which="r") == {}


def test_spans_of_batch_without_vmap_axes_trace_each_size(unrolled_always):
    torch.manual_seed(0)
    model = PoissonAutograd(torch.float64)
    x = _points(7, torch.float64, 24)
    params = _raw(model)
    ntk_fn = _ntk_fn(model, 3, None)
    kernel = torchntk.batch(ntk_fn, batch_size=3)(x, which="r")
    _assert_close(kernel, reference(_residual, params, x, x), torch.float64)


class _ConvForces(nn.Module):
    """``-dE/dx`` of a convolutional energy of a field: the convolution's weight is consumed again
    in the input gradient of ``convolution_backward`` (NOTE: [Convolutions through derivatives])."""

    def __init__(self, dtype: torch.dtype, conv: nn.Module, shape: tuple[int, ...]):
        super().__init__()
        self.conv = conv.to(DEVICE, dtype)
        self.shape = shape
        size = self.conv(torch.zeros(1, *shape, dtype=dtype, device=DEVICE)).numel()
        self.head = nn.Linear(size, 1).to(DEVICE, dtype)

    def forward(self, field: torch.Tensor) -> torch.Tensor:  # (N, *shape) -> (N, *shape)
        field = field.clone().requires_grad_()
        energy = self.head(torch.tanh(self.conv(field)).flatten(1)).sum()
        return -torch.autograd.grad(energy, field, create_graph=True)[0]


CONVOLUTIONS = {
    "conv1d": (lambda: nn.Conv1d(1, 3, 3, padding=1), (1, 6)),
    "conv2d-strided-grouped": (lambda: nn.Conv2d(2, 4, 3, stride=2, padding=1, dilation=1, groups=2), (2, 5, 6)),
    "conv2d-dilated": (lambda: nn.Conv2d(2, 3, 2, dilation=2), (2, 5, 5)),
}


@pytest.mark.parametrize("name", list(CONVOLUTIONS))
def test_a_convolution_inside_a_derivative_follows_the_rules(unrolled_always, name):
    make, shape = CONVOLUTIONS[name]
    torch.manual_seed(0)
    model = _ConvForces(torch.float64, make(), shape)
    generator = torch.Generator().manual_seed(26)
    x1, x2 = (torch.randn(n, *shape, generator=generator, dtype=torch.float64).to(DEVICE) for n in (4, 3))
    expected = _ntk_fn(model, 1, "default", trace_axes=())(x1, x2)
    ntk_fn = _ntk_fn(model, 3, "default", trace_axes=())
    for _ in range(2):
        _assert_close(ntk_fn(x1, x2), expected, torch.float64)
    assert _fallback(ntk_fn, x1, x2) == {}


def test_a_transposed_convolution_inside_a_derivative_keeps_the_fallback_and_says_why(unrolled_always):
    torch.manual_seed(0)
    model = _ConvForces(torch.float64, nn.ConvTranspose1d(1, 2, 3, stride=2), (1, 5))
    generator = torch.Generator().manual_seed(27)
    x1, x2 = (torch.randn(n, 1, 5, generator=generator, dtype=torch.float64).to(DEVICE) for n in (4, 3))
    expected = _ntk_fn(model, 1, "default", trace_axes=())(x1, x2)
    ntk_fn = _ntk_fn(model, 3, "default", trace_axes=())
    _assert_close(ntk_fn(x1, x2), expected, torch.float64)
    reasons = _fallback(ntk_fn, x1, x2)
    # a transposed convolution has no rule, in the forward pass or in its derivative
    assert set(reasons) == {"conv.weight", "conv.bias"} and "convolution" in reasons["conv.weight"]


class _WithNone(PoissonAutograd):
    """An output with a None leaf beside the tensors: the graph gives the tensors back in place."""

    def forward(self, x):
        return None, super().forward(x, "r"), {"nothing": None}


def test_outputs_with_none_leaves_come_back_in_place(unrolled_always):
    torch.manual_seed(0)
    model = _WithNone(torch.float64)
    x = _points(5, torch.float64, 28)
    ntk_fn = _ntk_fn(model, 3, "default")
    for _ in range(2):
        _, residual, nothing = ntk_fn(x)
        _assert_close(residual, reference(_residual, _raw(model), x, x), torch.float64)
    assert _fallback(ntk_fn, x) == {}


@pytest.mark.parametrize("vmap_axes", ["None", "default"])
def test_a_gradient_step_inside_the_model_follows_the_rules_through_its_trace(unrolled_always, vmap_axes):
    # MAML's inner step differentiates with respect to the parameters: traced, the step's products
    # with the weights are rule calls like the forward pass's
    torch.manual_seed(0)
    model = InnerStep(torch.float64)
    x = _points(5, torch.float64, 29)
    ntk_fn = _ntk_fn(model, 3, VMAP_AXES[vmap_axes])
    for _ in range(2):
        _assert_close(ntk_fn(x), _batch_reference(_raw(model), x), torch.float64)
    assert _fallback(ntk_fn, x) == {}
