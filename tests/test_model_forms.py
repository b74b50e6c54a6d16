"""Models in the forms users hold them: compiled modules (NOTE: [Compiled modules]), parameters
reached around their registered names (NOTE: [Aliased parameters]) and reentrant checkpoints
(NOTE: [Checkpoints run plain]). Kernels are checked against the float64 brute force of an
equivalent plain module, and the user's objects with ModuleSnapshot."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.utils.checkpoint as checkpoint_module
from torch import nn
from torch.utils.checkpoint import checkpoint  # bound at import, as user code does

import torchntk
from tests.cases import DEVICE, BoundWrapper, to_device
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_nngp, reference_ntk

IMPLEMENTATIONS = (0, 1, 2, 3)
VMAP_AXES = (0, None)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.Tanh(), nn.Linear(6, 2)).double().to(DEVICE).eval()


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (
        to_device(torch.randn(4, 3, generator=generator, dtype=torch.float64)),
        to_device(torch.randn(3, 3, generator=generator, dtype=torch.float64)),
    )


# ---------------------------------------------------------------------------------------------
# Compiled modules
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("vmap_axes", VMAP_AXES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_compiled_module_kernel_is_that_of_the_wrapped_module(backend, implementation, vmap_axes):
    model = _mlp()
    compiled = torch.compile(model, backend=backend)
    x1, x2 = _inputs()
    snapshots = ModuleSnapshot.of(model), ModuleSnapshot.of(compiled)
    kernel = torchntk.empirical_ntk_fn(compiled, vmap_axes=vmap_axes, implementation=implementation)(x1, x2)
    assert_kernels_close(kernel, reference_ntk(model, x1, x2))
    for snapshot in snapshots:
        snapshot.assert_unchanged()


@pytest.mark.slow
def test_compiled_module_called_first_with_inductor():
    model = _mlp()
    compiled = torch.compile(model)
    x1, x2 = _inputs()
    assert_kernels_close(compiled(x1), model(x1))  # compiled by the user before the kernel
    for implementation in (1, 3):
        kernel = torchntk.empirical_ntk_fn(compiled, vmap_axes=0, implementation=implementation)(x1, x2)
        assert_kernels_close(kernel, reference_ntk(model, x1, x2))


def test_module_compiled_in_place():
    model, twin = _mlp(), _mlp()
    model.compile(backend="eager")
    x1, x2 = _inputs()
    snapshot = ModuleSnapshot.of(model)
    for implementation in (1, 2, 3):
        kernel = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)(x1, x2)
        assert_kernels_close(kernel, reference_ntk(twin, x1, x2))
    snapshot.assert_unchanged()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_compiled_function_kernel_is_that_of_the_function(implementation):
    model = _mlp()
    params = {name: p.detach() for name, p in model.named_parameters()}

    def f(p, x):
        return torch.func.functional_call(model, p, (x,))

    x1, x2 = _inputs()
    compiled = torch.compile(f, backend="eager")
    for vmap_axes in VMAP_AXES:
        kernel = torchntk.empirical_ntk_fn(compiled, vmap_axes=vmap_axes, implementation=implementation)(x1, x2, params=params)
        assert_kernels_close(kernel, reference_ntk(model, x1, x2))


def test_compiled_module_with_a_captured_kernel():
    model = _mlp()
    x1, x2 = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(torch.compile(model, backend="eager"), vmap_axes=0, implementation=3, compile="eager")
    for _ in range(2):  # eager and captured, then replayed
        assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))


def test_nested_wrappers_keep_the_wrapper_parameter_names():
    model = _mlp()
    wrapped = BoundWrapper(torch.compile(model, backend="eager"))
    x1, x2 = _inputs()
    names = [name for name, _ in wrapped.named_parameters()]
    assert names[0] == "_orig_mod._orig_mod.0.weight"
    params = {names[0]: dict(wrapped.named_parameters())[names[0]] * 2}
    expected = reference_ntk(model, x1, x2, params={"0.weight": params[names[0]]})
    assert_kernels_close(torchntk.empirical_ntk_fn(wrapped, vmap_axes=0)(x1, x2, params=params), expected)
    last = torchntk.empirical_ntk_fn(wrapped, vmap_axes=0)(x1, x2, params="*.2.*")  # a pattern on the wrapper's names
    assert_kernels_close(last, reference_ntk(model, x1, x2, params={"2.weight": model[2].weight, "2.bias": model[2].bias}))


def test_wrapper_holding_an_unregistered_module_is_the_module():
    model = _mlp()
    wrapper = nn.Module()
    object.__setattr__(wrapper, "_orig_mod", model)
    wrapper.forward = model.__call__
    x1, x2 = _inputs()
    assert_kernels_close(torchntk.empirical_ntk_fn(wrapper, vmap_axes=0)(x1, x2), reference_ntk(model, x1, x2))


def test_compiled_module_in_every_entry_point():
    model = _mlp()
    compiled = torch.compile(model, backend="eager")
    x1, x2 = _inputs()
    snapshot = ModuleSnapshot.of(model)
    ntk = reference_ntk(model, x1, x2)
    assert_kernels_close(torchntk.empirical_nngp_fn(compiled)(x1, x2), reference_nngp(model, x1, x2))
    kernels = torchntk.empirical_kernel_fn(compiled, vmap_axes=0)(x1, x2, get=("ntk", "nngp"))
    assert_kernels_close(kernels.ntk, ntk)
    full = reference_ntk(model, x1, x2, trace_axes=())
    vector = to_device(torch.randn(3, 2, dtype=torch.float64))
    product = torchntk.empirical_ntk_vp_fn(compiled, x1, x2)(vector)
    assert_kernels_close(product, torch.einsum("nmab,mb->na", full, vector))
    batched = torchntk.batch(torchntk.empirical_ntk_fn(compiled, vmap_axes=0), batch_size=2)
    assert_kernels_close(batched(x1, x2), ntk)
    exact = torchntk.sketched_ntk_fn(compiled, k=10_000, vmap_axes=0, projection="gaussian")(x1, x2)
    assert ((exact - ntk).norm() / ntk.norm()).item() < 0.1  # a sketch is an estimate; a zero NTK would give 1
    trace = torchntk.ntk_trace_estimate(compiled, x1, probes=64)
    assert abs(trace.estimate - torch.diagonal(reference_ntk(model, x1)).sum().item()) < 0.5 * abs(trace.estimate) + 1e-6
    moved = {name: p.detach() + 0.1 for name, p in compiled.named_parameters()}
    plain_moved = {name.removeprefix("_orig_mod."): value for name, value in moved.items()}
    linear = torchntk.linearize(compiled)(moved, x1)
    expected = torch.func.jvp(
        lambda p: torch.func.functional_call(model, p, (x1,)),
        ({name: p.detach() for name, p in model.named_parameters()},),
        ({name: torch.full_like(value, 0.1) for name, value in plain_moved.items()},),
    )
    assert_kernels_close(linear, expected[0] + expected[1])
    snapshot.assert_unchanged()


def test_compiled_module_monte_carlo_matches_the_wrapped_module():
    model = _mlp()
    compiled = torch.compile(model, backend="eager")
    x1, _ = _inputs()
    plain = torchntk.monte_carlo_kernel_fn(model, 2, seed=3, vmap_axes=0)(x1, get="ntk")
    wrapped = torchntk.monte_carlo_kernel_fn(compiled, 2, seed=3, vmap_axes=0)(x1, get="ntk")
    assert_kernels_close(wrapped, plain)
    assert plain.abs().max() > 0


# ---------------------------------------------------------------------------------------------
# Parameters reached around their registered names
# ---------------------------------------------------------------------------------------------


class _Honest(nn.Module):
    """The model the aliased ones compute, reading every parameter through its registered name."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.hidden, self.out = nn.Linear(3, 5), nn.Linear(5, 2)

    def weight(self) -> torch.Tensor:
        return self.out.weight

    def forward(self, x):
        return torch.tanh(self.hidden(x)) @ self.weight().T + self.out.bias


class _InList(_Honest):
    def __init__(self):
        super().__init__()
        self.cache = [self.out.weight]

    def weight(self):
        return self.cache[0]


class _InDict(_Honest):
    def __init__(self):
        super().__init__()
        self.store = {"w": self.out.weight}

    def weight(self):
        return self.store["w"]


class _InClosure(_Honest):
    def __init__(self):
        super().__init__()
        weight = self.out.weight
        self.get = lambda: weight

    def weight(self):
        return self.get()


class _Helper:
    def __init__(self, weight):
        self.weight = weight


class _InHelper(_Honest):
    def __init__(self):
        super().__init__()
        self.helper = _Helper(self.out.weight)

    def weight(self):
        return self.helper.weight


class _TransposedAtInit(_Honest):
    def __init__(self):
        super().__init__()
        self.double().to(DEVICE)  # the view below is of the float64 weight's memory on the run device
        self.transposed = self.out.weight.T

    def weight(self):
        return self.transposed.T


ALIASED = {
    "list": (_InList, "cache[0]"),
    "dict": (_InDict, "store['w']"),
    "closure": (_InClosure, "get (closure variable 'weight')"),
    "helper": (_InHelper, "helper.weight"),
    "view": (_TransposedAtInit, "transposed"),
}


@pytest.mark.parametrize("vmap_axes", VMAP_AXES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("form", sorted(ALIASED))
def test_aliased_parameter_is_refused_with_its_name_and_holder(form, implementation, vmap_axes):
    cls, holder = ALIASED[form]
    model = cls().double().to(DEVICE)
    x1, x2 = _inputs()
    snapshot = ModuleSnapshot.of(model)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=vmap_axes, implementation=implementation)
    for _ in range(2):  # a refused check is not recorded as passed
        with pytest.raises(ValueError, match=r"ntk_fn: the forward pass reads parameter 'out.weight' through") as error:
            ntk_fn(x1, x2)
        assert f"`{holder}`" in str(error.value)
    snapshot.assert_unchanged()


def test_aliased_frozen_parameter_and_nngp_are_exact():
    model, honest = _InList().double().to(DEVICE), _Honest().double().to(DEVICE)
    x1, x2 = _inputs()
    model.out.weight.requires_grad_(False)
    honest.out.weight.requires_grad_(False)
    for implementation in IMPLEMENTATIONS:
        kernel = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)(x1, x2)
        assert_kernels_close(kernel, reference_ntk(honest, x1, x2))
    model.out.weight.requires_grad_(True)
    assert_kernels_close(torchntk.empirical_nngp_fn(model)(x1, x2), reference_nngp(honest, x1, x2))
    nngp = torchntk.empirical_kernel_fn(model, vmap_axes=0)(x1, x2, get="nngp")
    assert_kernels_close(nngp, reference_nngp(honest, x1, x2))


def test_aliased_parameter_with_other_values_is_refused_for_the_nngp():
    model = _InDict().double().to(DEVICE)
    x1, _ = _inputs()
    params = {name: p.detach() * 2 for name, p in model.named_parameters()}
    with pytest.raises(ValueError, match=r"nngp_fn: the forward pass reads parameter 'out.weight' through `store\['w'\]`"):
        torchntk.empirical_nngp_fn(model)(x1, params=params)
    same = dict(model.named_parameters())
    torchntk.empirical_nngp_fn(model)(x1, params=same)  # the module's own values: harmless


def test_aliased_parameter_is_refused_by_the_other_differentiating_entry_points():
    model = _InHelper().double().to(DEVICE)
    x1, x2 = _inputs()
    pattern = r"the forward pass reads parameter 'out.weight' through `helper.weight`"
    with pytest.raises(ValueError, match="empirical_ntk_vp_fn: " + pattern):
        torchntk.empirical_ntk_vp_fn(model, x1, x2)(to_device(torch.ones(3, 2, dtype=torch.float64)))
    with pytest.raises(ValueError, match=pattern):
        torchntk.linearize(model)(dict(model.named_parameters()), x1)
    with pytest.raises(ValueError, match=pattern):
        torchntk.ntk_trace_estimate(model, x1, probes=2)
    with pytest.raises(ValueError, match=pattern):
        torchntk.sketched_ntk_fn(model, k=8, vmap_axes=0)(x1, x2)
    with pytest.raises(ValueError, match=pattern):
        torchntk.monte_carlo_kernel_fn(model, 2, vmap_axes=0)(x1, get="ntk")


def test_alias_check_runs_once_per_shapes_and_structure(monkeypatch):
    from torchntk._model import aliases

    evaluated = []
    original = aliases.AliasWatch.evaluate

    def counting(self, param_leaves, evaluate):
        evaluated.append(self.armed)
        return original(self, param_leaves, evaluate)

    monkeypatch.setattr(aliases.AliasWatch, "evaluate", counting)
    model = _Honest().double().to(DEVICE)
    x1, x2 = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1)
    assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))
    first = len(evaluated)
    assert first > 0
    ntk_fn(x1, x2)
    assert len(evaluated) == first  # recorded as passed: no watch built at all
    ntk_fn(x1[:2], x2)
    assert len(evaluated) > first  # new shapes are checked again
    model.cache = [model.out.weight]  # a new attribute changes the structure
    model.weight = lambda: model.cache[0]
    with pytest.raises(ValueError, match="through `cache\\[0\\]`"):
        ntk_fn(x1, x2)


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------


class _Checkpointed(nn.Module):
    def __init__(self, use_reentrant):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second, self.out = nn.Linear(3, 5), nn.Linear(5, 5), nn.Linear(5, 2)
        self.use_reentrant = use_reentrant

    def block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.second(torch.tanh(self.first(h))))

    def forward(self, x):
        if self.use_reentrant is None:
            return self.out(self.block(x))
        return self.out(checkpoint(self.block, x, use_reentrant=self.use_reentrant))


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("vmap_axes", VMAP_AXES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_checkpointed_model_is_exact(use_reentrant, implementation, vmap_axes):
    model = _Checkpointed(use_reentrant).double().to(DEVICE)
    plain = copy.deepcopy(model)
    plain.use_reentrant = None
    x1, x2 = _inputs()
    snapshot = ModuleSnapshot.of(model)
    original = checkpoint_module.CheckpointFunction
    kernel = torchntk.empirical_ntk_fn(model, vmap_axes=vmap_axes, implementation=implementation)(x1, x2)
    assert_kernels_close(kernel, reference_ntk(plain, x1, x2))
    assert checkpoint_module.CheckpointFunction is original
    snapshot.assert_unchanged()


def test_reentrant_checkpoints_of_other_threads_stay_reentrant():
    from torchntk._model.wrappers import plain_checkpoints

    seen = []

    def function(h):
        seen.append(torch.is_grad_enabled())
        return h * 2

    x = torch.ones(2, requires_grad=True)
    checkpoint(function, x, use_reentrant=True)  # the real one runs the forward without grad
    with plain_checkpoints():
        checkpoint(function, x, use_reentrant=True)  # this thread: a plain call
        other = threading.Thread(target=lambda: checkpoint(function, x, use_reentrant=True))
        other.start()
        other.join()
    assert seen == [False, True, False]
    assert checkpoint_module.CheckpointFunction.__name__ == "CheckpointFunction"
