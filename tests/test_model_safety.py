"""The user's module is never changed, and kernel functions are safe to call from several threads.

NOTE: [Modules are never mutated] (``_model/functional.py``) and NOTE: [Threads] (``_utils/threads.py``) state the
promises; every test here checks the kernels against the float64 brute force of
``torchntk.testing`` and the module against a :class:`~torchntk.testing.ModuleSnapshot`. Models and
inputs live on the run device (``pytest --device``): built and drawn on the CPU, then moved, so
that every device sees the same numbers.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import torchntk
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_ntk

IMPLEMENTATIONS = [1, 2, 3, 0]
VMAP_AXES = [0, None]


def _mlp(seed: int, device: torch.device) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=param.dtype))
    return model.to(device)


def _randn(device: torch.device, *shape: int) -> torch.Tensor:
    """Float64, drawn from the global CPU generator (seeded for every test), then moved to ``device``."""
    return torch.randn(*shape, dtype=torch.float64).to(device)


def _tokens(device: torch.device, *shape: int) -> torch.Tensor:
    """Token ids below 10, drawn like :func:`_randn`."""
    return torch.randint(0, 10, shape).to(device)


def _right_or_refused(compute, expected, reason: str) -> None:
    """The kernel is right, or computing it raises a ValueError that names ``reason`` (spaces and
    hyphens alike: "in place" matches "in-place")."""
    try:
        actual = compute()
    except ValueError as error:
        assert reason in str(error).replace("-", " "), str(error)
        return
    assert_kernels_close(actual, expected)


def _in_threads(work, count: int = 4, repeats: int = 5) -> list:
    """Runs ``work(thread_index)`` ``repeats`` times in each of ``count`` threads started together."""
    results: list = [[] for _ in range(count)]
    errors: list = []
    start = threading.Barrier(count)

    def run(index: int) -> None:
        try:
            start.wait()
            for _ in range(repeats):
                results[index].append(work(index))
        except BaseException as error:  # re-raised below, in the test's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("vmap_axes", VMAP_AXES, ids=["vmap0", "no-vmap"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=["JC", "NVP", "SD", "AUTO"])
def test_kernel_functions_from_four_threads(implementation, vmap_axes, device):
    """Four threads share two kernel functions of two models (two threads each); every result is
    right and both modules keep their nn.Parameters and values."""
    models = [_mlp(0, device), _mlp(1, device)]
    snapshots = [ModuleSnapshot.of(model) for model in models]
    x1, x2 = _randn(device, 6, 5), _randn(device, 4, 5)
    expected = [reference_ntk(model, x1, x2, trace_axes=()) for model in models]
    functions = [
        torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=implementation)
        for model in models
    ]
    results = _in_threads(lambda index: functions[index % 2](x1, x2))
    for index, kernels in enumerate(results):
        for kernel in kernels:
            assert_kernels_close(kernel, expected[index % 2])
    for snapshot in snapshots:
        snapshot.assert_unchanged()


def test_batch_and_monte_carlo_from_threads(device):
    model = _mlp(2, device)
    snapshot = ModuleSnapshot.of(model)
    x1 = _randn(device, 7, 5)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
    batched = torchntk.batch(ntk_fn, 3)
    monte_carlo = torchntk.monte_carlo_kernel_fn(model, 3, seed=4, vmap_axes=0)
    expected_batched = reference_ntk(model, x1)
    expected_monte_carlo = monte_carlo(x1, None, "ntk")
    results = _in_threads(lambda index: batched(x1) if index % 2 else monte_carlo(x1, None, "ntk"), repeats=3)
    for index, kernels in enumerate(results):
        for kernel in kernels:
            assert_kernels_close(kernel, expected_batched if index % 2 else expected_monte_carlo)
    snapshot.assert_unchanged()


class _RenormalisedEmbedding(nn.Module):
    """``nn.Embedding(max_norm=...)`` renormalises the looked-up rows of its weight in place."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 4, max_norm=1.0)
        self.linear = nn.Linear(4, 3)

    def forward(self, tokens):
        return self.linear(self.embedding(tokens).mean(1))


def _renormalised_embedding(device: torch.device) -> nn.Module:
    torch.manual_seed(3)
    model = _RenormalisedEmbedding().double()
    with torch.no_grad():
        model.embedding.weight.mul_(3.0)  # every row longer than max_norm
    return model.to(device)


@pytest.mark.parametrize("trace_axes", [(-1,), ()], ids=["traced", "full"])
@pytest.mark.parametrize("same", [False, True], ids=["x2", "x2=None"])
@pytest.mark.parametrize("vmap_axes", VMAP_AXES, ids=["vmap0", "no-vmap"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=["JC", "NVP", "SD", "AUTO"])
def test_embedding_max_norm_leaves_the_weight_alone(implementation, vmap_axes, same, trace_axes, device):
    """The renormalisation lands in a private copy: the kernel is that of the model as called
    (rows renormalised), or a ValueError says that torch.func cannot differentiate the in-place
    write; the module's weight is never changed."""
    model = _renormalised_embedding(device)
    x1, x2 = _tokens(device, 5, 3), _tokens(device, 4, 3)
    x2 = None if same else x2
    snapshot = ModuleSnapshot.of(model)
    expected = reference_ntk(model, x1, x2, trace_axes=trace_axes)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes, vmap_axes=vmap_axes, implementation=implementation)
    _right_or_refused(lambda: ntk_fn(x1, x2), expected, "in place")
    snapshot.assert_unchanged()
    if implementation in (1, 2) and vmap_axes is None:  # these are computed, not refused
        assert_kernels_close(ntk_fn(x1, x2), expected)


@pytest.mark.parametrize("implementation", [1, 2, 3], ids=["JC", "NVP", "SD"])
def test_embedding_max_norm_leaves_params_alone(implementation, device):
    """Tensors passed in ``params`` are as much the user's as the module's own."""
    model = _renormalised_embedding(device)
    params = {"embedding.weight": model.embedding.weight.detach().clone() * 2}
    snapshot = ModuleSnapshot.of(model, extra=params)
    x1 = _tokens(device, 5, 3)
    expected = reference_ntk(model, x1, params=params)
    compute = lambda: torchntk.empirical_ntk_fn(model, implementation=implementation)(x1, None, params)  # noqa: E731
    _right_or_refused(compute, expected, "in place")
    snapshot.assert_unchanged()


class _SelfChanging(nn.Module):
    """A forward pass that writes into its own state, as real models sometimes do."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)
        self.register_buffer("calls", torch.zeros(()))
        self.seen = 0
        self.history: list = []

    def forward(self, x):
        self.seen += 1  # a plain attribute
        self.history.append(x.shape)  # a mutable attribute
        self.calls += 1  # a buffer, in place
        self.linear.weight.data.clamp_(-0.5, 0.5)  # a parameter, in place behind autograd's back
        return self.linear(x)


@pytest.mark.parametrize("trace_axes", [(-1,), ()], ids=["traced", "full"])
@pytest.mark.parametrize("same", [False, True], ids=["x2", "x2=None"])
@pytest.mark.parametrize("vmap_axes", VMAP_AXES, ids=["vmap0", "no-vmap"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS, ids=["JC", "NVP", "SD", "AUTO"])
def test_a_forward_that_writes_into_the_module_changes_nothing(implementation, vmap_axes, same, trace_axes, device):
    torch.manual_seed(0)
    model = _SelfChanging().double().to(device)
    with torch.no_grad():
        model.linear.weight.mul_(4.0)  # entries outside the clamp
    snapshot = ModuleSnapshot.of(model)
    x1, x2 = _randn(device, 5, 4), _randn(device, 3, 4)
    x2 = None if same else x2
    expected = reference_ntk(model, x1, x2, trace_axes=trace_axes)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes, vmap_axes=vmap_axes, implementation=implementation)
    _right_or_refused(lambda: ntk_fn(x1, x2), expected, "in place")
    snapshot.assert_unchanged()
    assert model.seen == 0 and model.history == []


def _weight_normed(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    # Moved before weight_norm, whose `weight` is a plain attribute that `.to()` would leave behind.
    normed = torch.nn.utils.weight_norm(nn.Linear(4, 6).double().to(device))
    return nn.Sequential(normed, nn.Tanh(), nn.Linear(6, 2)).double().to(device)


@pytest.mark.parametrize("implementation", [1, 2, 3], ids=["JC", "NVP", "SD"])
def test_old_style_weight_norm_hook_writes_into_a_private_copy(implementation, device):
    """``torch.nn.utils.weight_norm`` sets ``module.weight`` from a pre-forward hook."""
    model = _weight_normed(device)
    snapshot = ModuleSnapshot.of(model)
    weight_before = model[0].weight
    x1, x2 = _randn(device, 5, 4), _randn(device, 3, 4)
    # Such a module cannot be deep-copied, so the reference gets its own, on the CPU: PyTorch's CUDA
    # weight-norm kernel takes float64 square roots in float32.
    twin = _weight_normed(torch.device("cpu"))
    params = {name: p.detach() for name, p in twin.named_parameters()}
    expected = reference_ntk(lambda p, x: torch.func.functional_call(twin, p, (x,)), x1.cpu(), x2.cpu(), params=params)
    expected = expected.to(device)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)
    assert_kernels_close(ntk_fn(x1, x2), expected)  # 2 without forward AD: two reverse passes
    snapshot.assert_unchanged()
    assert model[0].weight is weight_before


def test_shared_submodules_stay_shared_in_the_private_copy(device):
    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared).double().to(device)
    x1 = _randn(device, 5, 4)
    actual = torchntk.empirical_ntk_fn(model, vmap_axes=0)(x1)
    assert_kernels_close(actual, reference_ntk(model, x1))


def test_snapshot_sees_every_kind_of_change(device):
    def changes():
        def values(model):
            with torch.no_grad():
                model[0].weight.add_(1.0)

        def plain_tensor(model):
            model[0]._parameters["bias"] = model[0].bias.detach()

        def attribute(model):
            model.scale = 2.0

        def hook(model):
            model.register_forward_hook(lambda module, inputs, output: output)

        def mode(model):
            model.train()

        def frozen(model):
            model[0].weight.requires_grad_(False)

        def buffer(model):
            model[1].running_mean.add_(1.0)

        return [values, plain_tensor, attribute, hook, mode, frozen, buffer]

    for change in changes():
        model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).eval().to(device)
        snapshot = ModuleSnapshot.of(model)
        snapshot.assert_unchanged()
        change(model)
        with pytest.raises(AssertionError, match="the module changed"):
            snapshot.assert_unchanged()


def test_structured_kernel_function_reports_its_fallback_parameters(device):
    """``auto_choice`` of an implementation-3 kernel function reports the plan its calls use."""
    class Hidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x):
            weight = self.linear.weight.clone()
            weight[0] = 0.0  # an in-place write the rules cannot follow
            return torch.nn.functional.linear(x, weight, self.linear.bias)

    model = Hidden().double().to(device)
    x1 = _randn(device, 5, 4)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3)
    assert_kernels_close(ntk_fn(x1), reference_ntk(model, x1))
    choice = ntk_fn.auto_choice(x1)
    assert set(choice.fallback_parameters) == {"linear.weight"}
    assert torchntk.empirical_ntk_fn(model, implementation=1).auto_choice(x1).fallback_parameters == {}


def test_torchscript_modules_are_refused_clearly(device):
    model = torch.jit.script(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double().to(device))
    with pytest.raises(TypeError, match="TorchScript"):
        torchntk.empirical_ntk_fn(model)(_randn(device, 5, 3))
