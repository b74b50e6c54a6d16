"""Compile wrappers inside a model (NOTE: [Compiled modules]): ``outer.block = torch.compile(block)``
at any depth, several of them, nested, and under a compiled top-level module. Kernels are checked
against a float64 per-example ``torch.func.jacrev`` contraction of the same model without the
wrappers, and the user's objects with ModuleSnapshot."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchntk
from tests.cases import DEVICE, BoundWrapper, to_device
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_nngp, reference_ntk

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo's notes on what it cannot trace


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(width, width), nn.Tanh())

    def forward(self, x):
        return x + self.inner(x)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(3, 5)
        self.block = _Block(5)
        self.middle = nn.Sequential(nn.Tanh(), nn.Linear(5, 4))
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.middle(self.block(torch.tanh(self.first(x))))))


def _plain() -> nn.Module:
    torch.manual_seed(0)
    return _Net().double().to(DEVICE).eval()


def _compile(module: nn.Module) -> nn.Module:
    return torch.compile(module, backend="eager")


def _one(model):
    model.middle = _compile(model.middle)
    return model


def _deep(model):
    model.block.inner = _compile(model.block.inner)
    return model


def _several(model):
    model.first, model.head = _compile(model.first), _compile(model.head)
    model.block.inner = _compile(model.block.inner)
    return model


def _nested(model):
    model.middle = BoundWrapper(_compile(model.middle))  # torch.compile of a compiled module is a function
    return model


def _compiled_top_level(model):
    model.block = _compile(model.block)
    model.block.inner = _compile(model.block.inner)  # through the wrapper, onto the wrapped block
    return _compile(model)


def _default_backend(model):
    model.block = torch.compile(model.block)  # inductor, never run: nothing is compiled before a call
    return model


FORMS = {
    "one": _one, "deep": _deep, "several": _several, "nested": _nested,
    "compiled_top_level": _compiled_top_level, "default_backend": _default_backend,
}


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (
        to_device(torch.randn(4, 3, generator=generator, dtype=torch.float64)),
        to_device(torch.randn(3, 3, generator=generator, dtype=torch.float64)),
    )


def _jacrev_ntk(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
    """The NTK traced over the last output axis (averaged), from per-example float64 Jacobians of
    the trainable parameters, computed here without torchntk."""
    params = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}

    def jacobians(x: torch.Tensor) -> list[torch.Tensor]:
        def one(example):
            return torch.func.jacrev(
                lambda p: torch.func.functional_call(model, p, (example[None],))[0]
            )(params)

        per_example = [one(example) for example in x]
        return [torch.stack([j[name].reshape(j[name].shape[0], -1) for j in per_example]) for name in params]

    total = 0
    for j1, j2 in zip(jacobians(x1), jacobians(x2)):
        total = total + torch.einsum("naq,maq->nm", j1, j2)
    return total / model(x1[:1]).shape[-1]


def _forwards(module: nn.Module) -> dict[str, object]:
    return {path: sub.__dict__.get("forward") for path, sub in module.named_modules(remove_duplicate=False)}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("implementation", (0, 1, 2, 3))
def test_compiled_submodules_are_computed_on_what_they_wrap(form, implementation):
    plain = _plain()
    model = FORMS[form](copy.deepcopy(plain))
    x1, x2 = _inputs()
    expected = _jacrev_ntk(plain, x1, x2)
    snapshot, forwards = ModuleSnapshot.of(model), _forwards(model)
    for vmap_axes in (0, None):
        ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=vmap_axes, implementation=implementation)
        for _ in range(2):  # a key's first call and a warm one
            assert_kernels_close(ntk_fn(x1, x2), expected)
    snapshot.assert_unchanged()
    assert _forwards(model) == forwards  # the wrappers keep their compiled forwards


def test_full_kernel_and_nngp_of_compiled_submodules():
    plain = _plain()
    model = _several(copy.deepcopy(plain))
    x1, x2 = _inputs()
    kernels = torchntk.empirical_kernel_fn(model, trace_axes=(), vmap_axes=0, implementation=3)(x1, x2, ("ntk", "nngp"))
    assert_kernels_close(kernels.ntk, reference_ntk(plain, x1, x2, trace_axes=()))
    assert_kernels_close(kernels.nngp, reference_nngp(plain, x1, x2, trace_axes=()))


def test_a_compiled_submodule_the_user_runs_before_and_after():
    plain = _plain()
    model = _several(copy.deepcopy(plain))
    x1, x2 = _inputs()
    with torch.no_grad():
        model(x1)  # dynamo has compiled and cached graphs of the user's modules
    assert_kernels_close(torchntk.empirical_ntk_fn(model, vmap_axes=0)(x1, x2), _jacrev_ntk(plain, x1, x2))
    with torch.no_grad():
        assert torch.allclose(model(x1), plain(x1))  # the compiled modules still serve the user


def test_params_by_the_names_the_user_object_lists():
    plain = _plain()
    model = _deep(copy.deepcopy(plain))
    x1, x2 = _inputs()
    name = "block.inner._orig_mod.0.weight"
    assert name in dict(model.named_parameters())
    value = dict(model.named_parameters())[name].detach() * 2
    kernel = torchntk.empirical_ntk_fn(model, vmap_axes=0)(x1, x2, params={name: value})
    plain_name = "block.inner.0.weight"
    assert_kernels_close(kernel, reference_ntk(plain, x1, x2, params={plain_name: value}))
    selected = torchntk.empirical_ntk_fn(model, vmap_axes=0)(x1, x2, params="block.*")
    block = {n: p for n, p in plain.named_parameters() if n.startswith("block.")}
    assert_kernels_close(selected, reference_ntk(plain, x1, x2, params=block))


def test_batch_and_linearize_with_compiled_submodules():
    plain = _plain()
    model = _several(copy.deepcopy(plain))
    x1, x2 = _inputs()
    batched = torchntk.batch(torchntk.empirical_ntk_fn(model, vmap_axes=0), batch_size=2)
    assert_kernels_close(batched(x1, x2), _jacrev_ntk(plain, x1, x2))
    moved = {name: p.detach() + 0.1 for name, p in model.named_parameters()}
    plain_moved = {name.replace("._orig_mod", ""): value for name, value in moved.items()}
    assert_kernels_close(torchntk.linearize(model)(moved, x1), torchntk.linearize(plain)(plain_moved, x1))


@pytest.mark.parametrize("top_level", (False, True))
def test_monte_carlo_draws_are_those_of_the_uncompiled_model(top_level):
    plain = _plain()
    model = _several(copy.deepcopy(plain))
    if top_level:
        plain, model = plain.head, _compile(copy.deepcopy(plain.head))  # a compiled nn.Linear: its own reset
    x1 = _inputs()[0] if not top_level else to_device(torch.randn(4, 4, dtype=torch.float64))
    expected = torchntk.monte_carlo_kernel_fn(plain, 2, seed=3, vmap_axes=0)(x1, get="ntk")
    assert_kernels_close(torchntk.monte_carlo_kernel_fn(model, 2, seed=3, vmap_axes=0)(x1, get="ntk"), expected)


# ---------------------------------------------------------------------------------------------
# Modules holding an ``_orig_mod`` whose forward is not known to call it are evaluated as they are
# ---------------------------------------------------------------------------------------------


class _Doubling(nn.Module):
    """Holds its module as ``_orig_mod`` but computes something else with it."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._orig_mod = module

    def forward(self, x):
        return 2 * self._orig_mod(x)


@pytest.mark.parametrize("top_level", (False, True))
def test_a_module_holding_orig_mod_with_a_forward_of_its_own(top_level):
    plain = _plain()
    model = copy.deepcopy(plain)
    if top_level:
        model = _Doubling(model)
    else:
        model.middle = _Doubling(model.middle)
    x1, x2 = _inputs()
    kernel = torchntk.empirical_ntk_fn(model, vmap_axes=0)(x1, x2)
    assert_kernels_close(kernel, _jacrev_ntk(model, x1, x2))  # the model as it is, not what it holds
    if top_level:
        assert_kernels_close(kernel, 4 * _jacrev_ntk(plain, x1, x2))


def test_a_forward_bound_to_something_else_is_refused_not_looked_through():
    plain = _plain()
    wrapper = nn.Module()
    wrapper._orig_mod = copy.deepcopy(plain)
    inner = wrapper._orig_mod
    wrapper.forward = lambda x: 2 * inner(x)  # reads the user's tensors, which no transform tracks
    x1, x2 = _inputs()
    with pytest.raises(ValueError, match=r"_orig_mod\.first\.weight"):
        torchntk.empirical_ntk_fn(wrapper, vmap_axes=0)(x1, x2)

