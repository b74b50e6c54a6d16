"""``groups=``: one NTK per group of parameters in one call, against the float64 brute force restricted
to each group's parameters, for every implementation and layout, through ``batch`` and Monte Carlo.
Models and inputs live on the run device (``pytest --device``), inputs drawn on the CPU and moved."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import torchntk
from tests.cases import DEVICE, to_device
from torchntk.monte_carlo import sample_seed
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_nngp, reference_ntk


class _LoraLinear(nn.Module):
    """``W x + B A x`` with a frozen ``W`` and trainable low-rank adapters."""

    def __init__(self, features: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(features, features)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, features) * 0.5)
        self.lora_b = nn.Parameter(torch.randn(features, rank) * 0.5)

    def forward(self, x):
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(_LoraLinear(4), nn.Tanh(), nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double().to(DEVICE)


# The last layer's weight and bias in different groups: structured derivatives state such a pair
# jointly, which the groups must split.
GROUPS = {"adapters": "0", "weights": "*.weight", "rest": "*"}
MEMBERS = {
    "adapters": ["0.lora_a", "0.lora_b"],
    "weights": ["2.weight", "4.weight"],
    "rest": ["2.bias", "4.bias"],
}
LAYOUTS = {
    "traced": dict(trace_axes=(-1,), diagonal_axes=()),
    "full": dict(trace_axes=(), diagonal_axes=()),
    "diagonal": dict(trace_axes=(), diagonal_axes=(-1,)),
    "diagonal batch": dict(trace_axes=(-1,), diagonal_axes=(0,)),  # the batch axis pairs x1[n] with x2[n]
    "traced batch": dict(trace_axes=(0, -1), diagonal_axes=()),
}
PAIRED = ("diagonal batch", "traced batch")  # layouts that need as many x2 examples as x1
IMPLEMENTATIONS = {"JC": 1, "NVP": 2, "SD": 3, "AUTO": 0}


def _inputs(layout: str = "traced"):
    generator = torch.Generator().manual_seed(1)
    return to_device((torch.randn(5, 4, generator=generator, dtype=torch.float64),
                      torch.randn(5 if layout in PAIRED else 3, 4, generator=generator, dtype=torch.float64)))


def _subset(model: nn.Module, names: list[str]) -> dict:
    values = dict(model.named_parameters())
    return {name: values[name] for name in names}


@functools.lru_cache(maxsize=None)
def _references(layout: str, with_x2: bool) -> tuple[dict, torch.Tensor]:
    """Per group, the float64 brute force restricted to its parameters; and the whole NTK."""
    model = _model()
    x1, x2 = _inputs(layout)
    x2 = x2 if with_x2 else None
    per_group = {
        group: reference_ntk(model, x1, x2, params=_subset(model, names), **LAYOUTS[layout])
        for group, names in MEMBERS.items()
    }
    return per_group, reference_ntk(model, x1, x2, **LAYOUTS[layout])


@pytest.mark.parametrize(
    "vmap_axes, chunk_size",
    [
        pytest.param(0, None, id="vmap0-whole"),
        pytest.param(0, 2, id="vmap0-chunk2"),  # blocks of examples
        pytest.param(None, None, id="no-vmap-whole"),
        # chunked Jacobians of whole batches: the grouped sums are those of the whole case
        pytest.param(None, 2, id="no-vmap-chunk2", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("with_x2", [True, False], ids=["x2", "x2-None"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_each_group_is_the_ntk_of_its_parameters_and_they_sum_to_the_total(
    implementation, layout, with_x2, vmap_axes, chunk_size
):
    model = _model()
    x1, x2 = _inputs(layout)
    snapshot = ModuleSnapshot.of(model)
    ntk_fn = torchntk.empirical_ntk_fn(
        model, vmap_axes=vmap_axes, implementation=IMPLEMENTATIONS[implementation], chunk_size=chunk_size,
        groups=GROUPS, **LAYOUTS[layout],
    )
    kernels = ntk_fn(x1, x2 if with_x2 else None)
    expected, total = _references(layout, with_x2)
    assert isinstance(kernels, dict) and list(kernels) == list(GROUPS)
    for group, kernel in kernels.items():
        assert_kernels_close(kernel, expected[group])
    assert_kernels_close(sum(kernels.values()), total)
    snapshot.assert_unchanged()


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_parameters_in_no_group_are_left_out(implementation):
    model = _model()
    x1, x2 = _inputs()
    groups = {"adapters": "*.lora_*", "head": "4"}  # 2.weight and 2.bias are in no group
    kernels = torchntk.empirical_ntk_fn(
        model, trace_axes=(), vmap_axes=0, implementation=IMPLEMENTATIONS[implementation], groups=groups
    )(x1, x2)
    grouped = MEMBERS["adapters"] + ["4.weight", "4.bias"]
    both = reference_ntk(model, x1, x2, params=_subset(model, grouped), trace_axes=())
    assert_kernels_close(kernels["adapters"] + kernels["head"], both)
    head = reference_ntk(model, x1, x2, params=_subset(model, ["4.weight", "4.bias"]), trace_axes=())
    assert_kernels_close(kernels["head"], head)


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_groups_split_the_parameters_chosen_by_params(implementation):
    model = _model()
    x1, x2 = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(
        model, vmap_axes=0, implementation=IMPLEMENTATIONS[implementation],
        groups={"a": "*.lora_a", "b": lambda name, parameter: name.endswith("lora_b")},
    )
    kernels = ntk_fn(x1, x2, "*.lora_*")
    for group, name in (("a", "0.lora_a"), ("b", "0.lora_b")):
        assert_kernels_close(kernels[group], reference_ntk(model, x1, x2, params=_subset(model, [name])))


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_kernel_fn_puts_the_groups_in_the_ntk_field(implementation):
    model = _model()
    x1, x2 = _inputs()
    kernel_fn = torchntk.empirical_kernel_fn(
        model, vmap_axes=0, implementation=IMPLEMENTATIONS[implementation], groups=GROUPS
    )
    both = kernel_fn(x1, x2)
    expected, _ = _references("traced", True)
    assert list(both.ntk) == list(GROUPS)
    for group in GROUPS:
        assert_kernels_close(both.ntk[group], expected[group])
        assert_kernels_close(kernel_fn(x1, x2, "ntk")[group], expected[group])
    assert_kernels_close(both.nngp, reference_nngp(model, x1, x2))
    assert_kernels_close(kernel_fn(x1, x2, "nngp"), reference_nngp(model, x1, x2))


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(3, 4)
        self.left = nn.Linear(4, 2)
        self.right = nn.Linear(4, 3)
        self.with_none = True  # the reference kernels take tensor leaves only

    def forward(self, x):
        hidden = torch.tanh(self.trunk(x))
        return {"left": self.left(hidden), "right": (self.right(hidden), None if self.with_none else hidden)}


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_every_output_leaf_gets_its_groups(implementation):
    torch.manual_seed(0)
    model = _TwoHeads().double().to(DEVICE)
    x1, x2 = to_device((torch.randn(3, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)))
    groups = {"trunk": model.trunk, "heads": ["left", "right"]}
    kernels = torchntk.empirical_ntk_fn(
        model, trace_axes=(), vmap_axes=0, implementation=IMPLEMENTATIONS[implementation], groups=groups
    )(x1, x2)
    assert kernels["right"][1] is None
    model.with_none = False
    params = dict(model.named_parameters())
    members = {"trunk": ["trunk.weight", "trunk.bias"], "heads": [n for n in params if not n.startswith("trunk")]}
    for group, names in members.items():
        expected = reference_ntk(model, x1, x2, params={n: params[n] for n in names}, trace_axes=())
        assert_kernels_close(kernels["left"][group], expected["left"])
        assert_kernels_close(kernels["right"][0][group], expected["right"][0])


def test_a_function_names_its_parameters_by_key_paths():
    model = _model()
    x1, x2 = _inputs()
    params = {"net": dict(model.named_parameters())}

    def f(p, x):
        return torch.func.functional_call(model, p["net"], (x,))

    groups = {"first": "net.0.*", "later": ["net.2.*", "net.4.*"]}
    kernels = torchntk.empirical_ntk_fn(f, vmap_axes=0, groups=groups)(x1, x2, params)
    everything = dict(model.named_parameters())  # every leaf of `params` is differentiated, frozen or not
    members = {
        "first": [n for n in everything if n.startswith("0.")],
        "later": [n for n in everything if not n.startswith("0.")],
    }
    for group, names in members.items():
        assert_kernels_close(kernels[group], reference_ntk(model, x1, x2, params={n: everything[n] for n in names}))


# -- a Hugging Face-like PEFT model: LoRA adapters named like peft's ----------------------------------


class _PeftLinear(nn.Module):
    def __init__(self, features: int, rank: int = 2):
        super().__init__()
        self.base_layer = nn.Linear(features, features)
        self.lora_A = nn.ModuleDict({"default": nn.Linear(features, rank, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(rank, features, bias=False)})
        nn.init.normal_(self.lora_B["default"].weight, std=0.5)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


class _PeftBlock(nn.Module):
    def __init__(self, features: int):
        super().__init__()
        self.q_proj = _PeftLinear(features)
        self.v_proj = _PeftLinear(features)

    def forward(self, x):
        return x + torch.tanh(self.q_proj(x)) * self.v_proj(x)


class _PeftModel(nn.Module):
    def __init__(self, features: int = 4, layers: int = 2):
        super().__init__()
        self.base_model = nn.Module()
        self.base_model.model = nn.Module()
        self.base_model.model.layers = nn.ModuleList([_PeftBlock(features) for _ in range(layers)])
        self.head = nn.Linear(features, 2)

    def forward(self, x):
        for layer in self.base_model.model.layers:
            x = layer(x)
        return self.head(x)


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_lora_adapters_by_layer_and_by_matrix(implementation):
    torch.manual_seed(0)
    model = _PeftModel().double().to(DEVICE)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lora_" in name)
    x1, x2 = to_device((torch.randn(4, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)))
    params = dict(model.named_parameters())
    by_layer = {f"layer {i}": f"base_model.model.layers.{i}" for i in range(2)}
    by_matrix = {"A": "*.lora_A.*", "B": "*.lora_B.*"}
    for groups, member in ((by_layer, lambda group, name: name.startswith(f"base_model.model.layers.{group[-1]}.")),
                           (by_matrix, lambda group, name: f".lora_{group}." in name)):
        ntk_fn = torchntk.empirical_ntk_fn(
            model, vmap_axes=0, implementation=IMPLEMENTATIONS[implementation], groups=groups
        )
        kernels = ntk_fn(x1, x2)
        for group in groups:
            names = [n for n in params if "lora_" in n and member(group, n)]
            assert names
            assert_kernels_close(kernels[group], reference_ntk(model, x1, x2, params={n: params[n] for n in names}))


# -- batch and Monte Carlo ---------------------------------------------------------------------------


@pytest.mark.parametrize("get", [None, "ntk", ("ntk",)], ids=["both", "ntk", "tuple"])
@pytest.mark.parametrize("vmap_axes", [0, None], ids=["vmap0", "no-vmap"])
@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_batch_computes_the_groups_block_by_block(implementation, vmap_axes, get):
    model = _model()
    x1, x2 = _inputs()
    kernel_fn = torchntk.empirical_kernel_fn(
        model, trace_axes=(), vmap_axes=vmap_axes, implementation=IMPLEMENTATIONS[implementation], groups=GROUPS
    )
    batched = torchntk.batch(kernel_fn, batch_size=2, devices=["cpu", "cpu"], cache_bytes=0)
    for with_x2 in (True, False):
        result = batched(x1, x2 if with_x2 else None, get)
        kernels = result if get == "ntk" else result.ntk
        expected, total = _references("full", with_x2)
        assert list(kernels) == list(GROUPS)
        for group in GROUPS:
            assert_kernels_close(kernels[group], expected[group])
        assert_kernels_close(sum(kernels.values()), total)


def test_a_rebuilt_kernel_function_groups_alike():
    """``batch`` and replicas rebuild the kernel function around a copy of the module: a group given
    as a submodule must select the copy's parameters."""
    model = _model()
    x1, x2 = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, groups={"head": model[4], "rest": "*"})
    replica = ntk_fn.spec.rebuild(copy.deepcopy(model))
    original, rebuilt = ntk_fn(x1, x2), replica(x1, x2)
    assert list(rebuilt) == ["head", "rest"]
    for group in original:
        torch.testing.assert_close(rebuilt[group], original[group], rtol=0, atol=0)


def _normal_init(module: nn.Module, generator: torch.Generator) -> dict:
    return {
        name: torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype)
        for name, parameter in module.named_parameters() if parameter.requires_grad
    }


@pytest.mark.parametrize("implementation", [1, 3])
def test_monte_carlo_averages_the_group_kernels(implementation):
    model = _model()
    x1, x2 = _inputs()
    samples, seed = 2, 3
    mc = torchntk.monte_carlo_kernel_fn(
        model, samples, seed, init_fn=_normal_init, batch_size=2, vmap_axes=0, implementation=implementation,
        groups=GROUPS,
    )
    estimate = mc(x1, x2)
    expected = {group: 0 for group in GROUPS}
    for s in range(samples):
        network = copy.deepcopy(model)  # sample s: every differentiated parameter drawn
        network.load_state_dict(_normal_init(model, torch.Generator().manual_seed(sample_seed(seed, s))), strict=False)
        for group, names in MEMBERS.items():
            expected[group] = expected[group] + reference_ntk(network, x1, x2, params=_subset(network, names)) / samples
    assert list(estimate.ntk) == list(GROUPS)
    for group in GROUPS:
        assert_kernels_close(estimate.ntk[group], expected[group])
    bare = mc(x1, x2, "ntk")
    for group in GROUPS:
        torch.testing.assert_close(bare[group], estimate.ntk[group], rtol=0, atol=0)


def test_auto_choice_and_empty_inputs_with_groups():
    model = _model()
    x1, _ = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=0, groups=GROUPS)
    assert ntk_fn.auto_choice(x1).implementation in tuple(torchntk.NtkImplementation)[1:]
    empty = ntk_fn(x1, x1[:0])
    assert list(empty) == list(GROUPS) and all(kernel.shape == (5, 0) for kernel in empty.values())


# -- errors ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "groups, error, match",
    [
        ("*.weight", TypeError, r"`groups` must be None or a mapping"),
        ({}, ValueError, r"`groups` must name at least one group"),
        ({1: "*"}, TypeError, r"`groups` keys must be non-empty strings.*got 1"),
        ({"": "*"}, TypeError, r"`groups` keys must be non-empty strings"),
        ({"a": 3}, TypeError, r"`groups` entry 'a' must be a glob pattern.*got 3"),
        ({"a": ["*.weight", 3]}, TypeError, r"`groups` entry 'a' must be .*got \['\*\.weight', 3\]"),
        ({"a": []}, ValueError, r"`groups` entry 'a' is an empty list"),
        ({"a": nn.Linear(2, 2)}, ValueError, r"`groups` entry 'a' is a Linear that is not a submodule of the model"),
    ],
    ids=[
        "not-a-mapping", "empty", "int-key", "empty-key", "int-value", "list-with-int", "empty-list", "foreign-module"
    ],
)
def test_bad_groups_are_refused_when_building(groups, error, match):
    with pytest.raises(error, match=match):
        torchntk.empirical_ntk_fn(_model(), groups=groups)


def test_a_module_group_needs_a_module_model():
    def f(p, x):
        return x @ p["w"]

    with pytest.raises(TypeError, match=r"`groups` entry 'a' is a module.*`f` is a function"):
        torchntk.empirical_kernel_fn(f, groups={"a": nn.Linear(2, 2)})


def test_monte_carlo_names_itself_in_group_errors():
    with pytest.raises(TypeError, match=r"^monte_carlo_kernel_fn: `groups` must be None or a mapping"):
        torchntk.monte_carlo_kernel_fn(_model(), 2, groups="*")


def test_a_group_selecting_nothing_is_named_with_the_parameters():
    x1, _ = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(_model(), groups={"adapters": "*.lora_*", "typo": "*.lora_c"})
    message = r"`groups` entry 'typo' \('\*\.lora_c'\) selects no differentiated parameter.*0\.lora_a"
    with pytest.raises(ValueError, match=message):
        ntk_fn(x1)


def test_a_frozen_parameter_is_no_differentiated_parameter():
    x1, _ = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(_model(), groups={"base": "*.base.*"})
    with pytest.raises(ValueError, match=r"`groups` entry 'base' .* selects no differentiated parameter"):
        ntk_fn(x1)


def test_a_group_emptied_by_earlier_groups_says_so():
    x1, _ = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(_model(), groups={"all": "*", "head": "4"})
    message = (
        r"`groups` entry 'head' \('4'\) is empty: every parameter it selects \('4\.weight', '4\.bias'\) "
        r"belongs to an earlier group"
    )
    with pytest.raises(ValueError, match=message):
        ntk_fn(x1)


def test_a_group_predicate_must_return_a_bool():
    x1, _ = _inputs()
    ntk_fn = torchntk.empirical_ntk_fn(_model(), groups={"odd": lambda name, parameter: parameter.ndim})
    message = r"the predicate of `groups` entry 'odd' must return a bool.*got 2 \(int\) for '0\.lora_a'"
    with pytest.raises(TypeError, match=message):
        ntk_fn(x1)


def test_only_the_nngp_needs_no_groups_check():
    x1, x2 = _inputs()
    kernel_fn = torchntk.empirical_kernel_fn(_model(), groups={"typo": "*.nothing"})
    assert_kernels_close(kernel_fn(x1, x2, "nngp"), reference_nngp(_model(), x1, x2))
    with pytest.raises(ValueError, match="`groups` entry 'typo'"):
        kernel_fn(x1, x2, "ntk")


class _Tied(nn.Module):
    """``l2.weight`` is ``l1.weight`` (named ``l1.weight`` by ``named_parameters()``)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.l1 = nn.Linear(4, 4)
        self.l2 = nn.Linear(4, 4)
        self.l2.weight = self.l1.weight

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
@pytest.mark.parametrize("selection", ["module", "pattern", "name", "predicate"])
def test_a_tied_parameter_is_selected_by_any_of_its_names(implementation, selection):
    """docs/groups.md: a submodule selects every parameter under it; a tied weight is under both
    modules, so ``l2`` (as a module, a pattern, a parameter name or a predicate on names) selects
    ``l1.weight`` too."""
    model = _Tied().double().to(DEVICE)
    x1, x2 = to_device(torch.randn(3, 4, dtype=torch.float64)), to_device(torch.randn(2, 4, dtype=torch.float64))
    chosen = {
        "module": model.l2, "pattern": "l2", "name": ["l2.weight", "l2.bias"],
        "predicate": lambda name, parameter: name.startswith("l2."),
    }[selection]
    snapshot = ModuleSnapshot.of(model)
    kernels = torchntk.empirical_ntk_fn(
        model, trace_axes=(), vmap_axes=0, implementation=IMPLEMENTATIONS[implementation],
        groups={"l2": chosen, "rest": "*"},
    )(x1, x2)
    expected = reference_ntk(model, x1, x2, params=_subset(model, ["l1.weight", "l2.bias"]), trace_axes=())
    assert_kernels_close(kernels["l2"], expected)
    assert_kernels_close(kernels["rest"], reference_ntk(model, x1, x2, params=_subset(model, ["l1.bias"]), trace_axes=()))
    snapshot.assert_unchanged()


def test_params_patterns_select_a_tied_parameter_by_any_of_its_names():
    model = _Tied().double().to(DEVICE)
    x = to_device(torch.randn(3, 4, dtype=torch.float64))
    ntk = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0)(x, None, "l2.*")
    expected = reference_ntk(model, x, None, params=_subset(model, ["l1.weight", "l2.bias"]), trace_axes=())
    assert_kernels_close(ntk, expected)
