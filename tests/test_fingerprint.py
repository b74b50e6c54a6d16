"""``structure_fingerprint``: what changes it and what does not, and its fast paths (the exact-type
branches at the top of ``_describe`` in ``torchntk/_model/fingerprint.py``) against the plain
description they shortcut."""

from __future__ import annotations

import collections
import gc
import time
import warnings
import weakref

import numpy as np
import pytest
import torch
from torch import nn

import torchntk
from tests import zoo
from torchntk._model.fingerprint import (
    _CONTAINERS, _DEPTH, _ENTRIES, _LONG, _SYNCED, _TENSOR_TABLES, FingerprintMemo, structure_fingerprint,
)
from torchntk._plan.key import input_shape_key, plan_key
from torchntk._utils.checks import show
from torchntk._utils.tree import describe
from torchntk._utils.values import PLAIN, leaf_key, safe_repr
from torchntk.testing import assert_kernels_close, reference_ntk
from torchntk.cli._models import ResNet18

pytestmark = pytest.mark.cpu_only("describes modules in Python; no kernel is computed")


def _plain_describe(value, depth, budget):
    """The description without fast paths: every value through the general branches."""
    kind = type(value)
    if kind in PLAIN:
        return (kind, value)
    if kind in _CONTAINERS:
        if not value:
            return (kind, ())
        if depth >= _DEPTH or len(value) > _LONG:
            return (kind, id(value), len(value))
        flat = kind in (tuple, list) and all(type(item) in PLAIN for item in value)
        if budget is not None or not flat:  # a flat tuple at the top is not counted
            budget = budget if budget is not None else [_ENTRIES]
            budget[0] -= len(value)
            if budget[0] < 0:
                return (kind, id(value), len(value))
        if kind in (set, frozenset):
            return (kind, frozenset(_plain_describe(item, depth + 1, budget) for item in value))
        items = value.items() if kind in (dict, collections.OrderedDict) else enumerate(value)
        return (kind, tuple((_plain_describe(k, depth + 1, budget), _plain_describe(v, depth + 1, budget))
                            for k, v in items))
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version, tuple(value.shape), value.dtype, value.device)
    for base in (list, dict, set, frozenset, tuple):
        if isinstance(value, base):
            return (kind, id(value), base.__len__(value))
    return (kind, id(value))


def _plain_fingerprint(module: nn.Module) -> tuple:
    entries = []
    for path, sub in module.named_modules(remove_duplicate=False):
        state = []
        for key, value in sub.__dict__.items():
            if key in _SYNCED:
                continue
            if key in _TENSOR_TABLES and value:  # empty ones as any empty dict
                state.append((key, tuple(
                    (name, None if t is None else (type(t), id(t), tuple(t.shape), t.dtype, t.device))
                    for name, t in value.items()
                )))
            elif key == "_modules" and value:
                state.append((key, tuple((name, None if child is None else id(child)) for name, child in value.items())))
            else:
                state.append((key, _plain_describe(value, 0, None)))
        entries.append((path, type(sub), id(sub), tuple(state)))
    return tuple(entries)


Pair = collections.namedtuple("Pair", "a b")


def _odd_attributes() -> nn.Module:
    """A module whose plain attributes take every branch: empty and full containers of exact types
    and of subclasses, nesting past the depth limit, containers past the length limit, numbers that
    are not Python's, tensors, objects, and a hook."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Conv1d(4, 2, 3, padding=1))
    model.empty = ((), [], {}, set(), frozenset(), collections.OrderedDict(), collections.Counter())
    model.flat = (1, 2.5, "s", None, True, b"b", 3j, torch.float32, torch.device("cpu"))
    model.mixed = [1, (2, 3), {"k": [4, 5]}, {6, 7}]
    model.deep = ((((1,),),),)
    model.deep_empty = (([[]],),)  # an empty list at the depth limit: described by identity
    model.long = tuple(range(_LONG + 1))
    model.numpy = (np.float32(1.5), np.int64(3))
    model.named = Pair(1, 2)
    model.ordered = collections.OrderedDict(a=1, b=(2, 3))
    model.tensor = torch.ones(2)
    model.obj = object()
    model[0].register_forward_hook(lambda module, args, output: output)
    return model


_MODELS = {
    "odd_attributes": _odd_attributes,
    "resnet18": lambda: ResNet18(8),
    "transformer_layer": lambda: nn.TransformerEncoderLayer(8, 2, 16, batch_first=True),
    "lstm": lambda: nn.LSTM(3, 4),
    "bert": lambda: zoo.bert().module,  # skipped, saying why, where transformers does not import
}


@pytest.mark.parametrize("name", _MODELS)
def test_the_fast_paths_describe_exactly_what_the_general_branches_do(name):
    torch.manual_seed(0)
    model = _MODELS[name]()
    assert structure_fingerprint(model) == _plain_fingerprint(model)


def test_values_and_modes_leave_it_unchanged_and_structure_changes_it():
    model = _odd_attributes()
    before = structure_fingerprint(model)
    with torch.no_grad():
        model[0].weight.mul_(2.0)  # a parameter's value
    model.eval()  # train/eval modes are copied to replicas, not part of the structure
    _ = model.mixed[1], model.empty[2]  # reads
    assert structure_fingerprint(model) == before
    changes = [
        lambda: setattr(model, "flat", (1, 2.5)),
        lambda: model.mixed.append(8),
        lambda: model.empty[2].update(x=1),  # an empty dict, described by its fast path, filled
        lambda: model.empty[1].append(0),
        lambda: model[2].register_forward_pre_hook(lambda module, args: None),
        lambda: setattr(model[0], "in_features", 5),
        lambda: setattr(model[2], "padding", (2,)),  # a tuple of plain values, its fast path
        lambda: model.tensor.add_(1.0),  # a plain tensor attribute counts by in-place version
    ]
    for number, change in enumerate(changes):
        reference = structure_fingerprint(model)
        change()
        assert structure_fingerprint(model) != reference, number


# -- the memo of the last walk (NOTE: [Unchanged modules]) ------------------------------------------


def _memo_changes(model: nn.Module) -> list:
    """Changes the memo's quick path must see, each of another kind of what it compares."""

    class Tanh2(nn.Tanh):
        pass

    class Config:
        pass

    class OtherConfig:
        pass

    model.config = Config()

    def swap_data():
        model[0].weight.data = torch.zeros(5, 3)  # same Parameter object, another shape

    return [
        ("rebound plain value", lambda: setattr(model[0], "in_features", 5)),
        ("equal value, other object", lambda: setattr(model, "flat", tuple(list(model.flat)))),
        ("flat tuple replaced", lambda: setattr(model[2], "padding", (2,))),
        ("list appended in place", lambda: model.mixed.append(8)),
        ("list entry changed in place", lambda: model.mixed[2]["k"].append(9)),
        ("empty dict filled", lambda: model.empty[2].update(x=1)),
        ("hook registered", lambda: model[2].register_forward_pre_hook(lambda module, args: None)),
        ("tensor attribute written in place", lambda: model.tensor.add_(1.0)),
        ("parameter data of another shape", swap_data),
        ("parameter replaced", lambda: setattr(model[0], "bias", nn.Parameter(torch.zeros(5)))),
        ("buffer registered", lambda: model[1].register_buffer("scale", torch.ones(1))),
        ("child replaced", lambda: model.__setitem__(1, nn.Tanh())),
        ("class changed in place", lambda: setattr(model[1], "__class__", Tanh2)),
        ("attribute deleted", lambda: delattr(model, "obj")),
        ("object attribute replaced", lambda: setattr(model, "obj", object())),
        ("object's class changed in place", lambda: setattr(model.config, "__class__", OtherConfig)),
        ("numpy attribute replaced", lambda: setattr(model, "numpy", (np.float32(1.5), np.int64(3)))),
    ]


def test_the_memo_returns_what_a_full_walk_returns_after_every_kind_of_change():
    model = _odd_attributes()
    memo = FingerprintMemo()
    for name, change in _memo_changes(model):
        before = structure_fingerprint(model, memo=memo)
        assert structure_fingerprint(model, memo=memo) is before, name  # nothing changed: the same tuple
        change()
        after = structure_fingerprint(model, memo=memo)
        assert after == structure_fingerprint(model) == _plain_fingerprint(model), name
        if name != "equal value, other object":
            assert after != before, name
        assert memo.hash_of(after) == hash(after)


def test_the_memo_holds_what_it_compares_by_value_so_no_identity_is_reused():
    """A float or a tuple of plain values is described by value but compared by identity: the memo
    holds it, or a new value made right after the old one is freed could take its address."""
    model = nn.Conv1d(2, 2, 3, padding=1)
    memo = FingerprintMemo()
    state = model.__dict__
    for step in range(20):
        for name, make in (("scale", lambda value: float(f"{value}.5")), ("padding", lambda value: tuple([value]))):
            state[name] = make(step)  # held by the module alone
            structure_fingerprint(model, memo=memo)
            new = str(step + 100) if name == "scale" else [step + 100]
            state[name] = None  # the old value is freed here unless something else holds it, and the new
            state[name] = float(f"{new}.5") if name == "scale" else tuple(new)  # one takes its address
            assert structure_fingerprint(model, memo=memo) == structure_fingerprint(model), (name, step)


def test_the_memo_reports_modes_and_sees_a_mode_switch():
    model = _odd_attributes()
    memo = FingerprintMemo()
    modes, again = [], []
    first = structure_fingerprint(model, modes, memo)
    assert structure_fingerprint(model, again, memo) is first and again == modes == [True] * 4
    model[2].eval()
    switched = []
    assert structure_fingerprint(model, switched, memo) == first  # modes are not structure
    assert switched == [True, True, True, False]
    quick = []
    structure_fingerprint(model, quick, memo)
    assert quick == switched


def test_a_plan_key_with_a_memo_equals_and_hashes_as_one_without():
    model = ResNet18(8)
    memo = FingerprintMemo()
    shape_key = input_shape_key(torch.ones(2, 3, 8, 8), None, None, {})
    keys = [plan_key(model, shape_key, memo) for _ in range(3)]
    plain = plan_key(model, shape_key)
    assert all(key == plain and hash(key) == hash(plain) for key in keys)
    assert keys[1].parts[1] is keys[2].parts[1]  # the last walk's tuple: compared by identity
    model.layer1[0].relu = nn.ReLU(inplace=False)  # a child replaced deep in the tree
    changed = plan_key(model, shape_key, memo)
    assert changed != plain and changed == plan_key(model, shape_key) and hash(changed) == hash(plan_key(model, shape_key))


def test_a_kernel_function_sees_a_change_after_warm_calls_and_keeps_the_module_only_while_it_lives():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x1, x2 = torch.randn(4, 3, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    kernel_fn = torchntk.empirical_ntk_fn(model, implementation=3)
    for _ in range(3):  # first, warm, later
        assert_kernels_close(kernel_fn(x1, x2), reference_ntk(model, x1, x2))
    model[1] = nn.Sigmoid()
    for _ in range(2):
        assert_kernels_close(kernel_fn(x1, x2), reference_ntk(model, x1, x2))
    model[2].register_forward_hook(lambda module, args, output: 2.0 * output)
    assert_kernels_close(kernel_fn(x1, x2), reference_ntk(model, x1, x2))
    alive = weakref.ref(model)
    del model, kernel_fn
    gc.collect()
    assert alive() is None


# -- values whose own methods raise or take long -------------------------------------------------


class _Refuses:
    """Every protocol method the inspection could call raises, and records that it was called."""

    calls: list = []

    def _refuse(self, name):
        _Refuses.calls.append(name)
        raise NotImplementedError(name)

    def __len__(self):
        self._refuse("len")

    def __iter__(self):
        self._refuse("iter")

    def __repr__(self):
        self._refuse("repr")

    def __str__(self):
        self._refuse("str")

    def __eq__(self, other):
        self._refuse("eq")

    def __hash__(self):
        return 7  # hashable, so that it can sit in a set; its __eq__ still raises

    def __bool__(self):
        self._refuse("bool")

    def __getattr__(self, name):
        self._refuse(f"getattr {name}")


class _RefusingTuple(tuple):
    """Like e3nn's ``_MulIr``: a tuple subclass whose ``len`` raises."""

    def __len__(self):
        _Refuses.calls.append("tuple len")
        raise NotImplementedError

    def __iter__(self):
        _Refuses.calls.append("tuple iter")
        raise NotImplementedError

    def __eq__(self, other):
        _Refuses.calls.append("tuple eq")
        raise NotImplementedError

    __hash__ = tuple.__hash__


class _RefusingList(list):
    def __len__(self):
        _Refuses.calls.append("list len")
        raise NotImplementedError

    def __iter__(self):
        _Refuses.calls.append("list iter")
        raise NotImplementedError


class _Unhashable:
    def __hash__(self):
        _Refuses.calls.append("hash")
        raise TypeError("no hash")


def _refusing_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    model[0].odd = _Refuses()
    model[0].odd_tuple = _RefusingTuple((1, 2))
    model[0].odd_list = _RefusingList([1, 2])
    model[0].unhashable = _Unhashable()
    model[2].inside = [_Refuses(), {"k": _RefusingTuple((3,)), "u": _Unhashable()}, (_RefusingList(),)]
    model[2].in_a_set = {_Refuses(), 1}
    return model


def test_objects_whose_methods_raise_are_described_without_calling_them():
    model = _refusing_model()
    _Refuses.calls.clear()
    first = structure_fingerprint(model)
    assert structure_fingerprint(model) == first
    assert hash(first) == hash(structure_fingerprint(model))  # plan keys hash it
    assert _Refuses.calls == []
    assert structure_fingerprint(model) == _plain_fingerprint(model)
    model[0].odd = _Refuses()  # replaced: another object
    assert structure_fingerprint(model) != first
    second = structure_fingerprint(model)
    list.append(model[0].odd_list, 3)  # in place, through the built-in base: its length counts
    assert structure_fingerprint(model) != second
    assert _Refuses.calls == []


def test_huge_and_deep_containers_are_described_quickly_and_bounded():
    model = nn.Linear(2, 2)
    model.huge = list(range(10**6))
    model.huge_set = set(range(10**5))
    model.wide = [[list(range(_LONG)) for _ in range(_LONG)] for _ in range(_LONG)]  # 64**3 ints
    model.many_objects = [[object() for _ in range(_LONG)] for _ in range(_LONG)]
    structure_fingerprint(model)
    start = time.perf_counter()
    for _ in range(10):
        described = dict(structure_fingerprint(model)[0][3])
    assert (time.perf_counter() - start) / 10 < 0.05
    assert described["huge"] == (list, id(model.huge), 10**6)
    assert described["huge_set"] == (set, id(model.huge_set), 10**5)

    def count(description):
        return 1 + sum(count(part) for part in description) if isinstance(description, (tuple, frozenset)) else 1

    assert count(described["wide"]) < 20 * _ENTRIES
    before = structure_fingerprint(model)
    model.wide[0][0].append(1)  # within the entries described
    assert structure_fingerprint(model) != before


def test_a_set_of_descriptions_does_not_depend_on_order():
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    model.labels, other.labels = {"b", "a", 3, (1, 2)}, {(1, 2), 3, "a", "b"}
    assert dict(structure_fingerprint(model)[0][3])["labels"] == dict(structure_fingerprint(other)[0][3])["labels"]


class _WithIrreps(nn.Module):
    """A small model holding an e3nn ``Irreps`` as a plain attribute, as MACE's blocks do."""

    def __init__(self, irreps):
        super().__init__()
        self.irreps_in = irreps
        self.linear = nn.Linear(irreps.dim, 3)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def _e3nn():
    return zoo.optional("e3nn")


def test_an_e3nn_irreps_attribute():
    o3 = _e3nn().o3
    irreps = o3.Irreps("2x0e + 1x1o")
    with pytest.raises(NotImplementedError):
        len(irreps[0].ir)  # an Irrep, a tuple subclass: what made fingerprints fail
    model = _WithIrreps(irreps)
    first = structure_fingerprint(model)
    assert structure_fingerprint(model) == first == _plain_fingerprint(model)
    model.irreps_in = o3.Irreps("2x0e + 1x1o")
    assert structure_fingerprint(model) != first


@pytest.mark.parametrize("build", ["irreps_attribute", "o3_linear"])
def test_an_e3nn_model_held_as_a_module_is_exact(build):
    o3 = _e3nn().o3
    torch.manual_seed(0)
    irreps = o3.Irreps("2x0e + 1x1o")
    if build == "irreps_attribute":
        model = _WithIrreps(irreps).double()
    else:
        model = o3.Linear(irreps, o3.Irreps("3x0e + 1x1o")).double()
    x1, x2 = torch.randn(4, irreps.dim, dtype=torch.float64), torch.randn(3, irreps.dim, dtype=torch.float64)
    expected = reference_ntk(model, x1, x2, trace_axes=())
    for implementation in (0, 1, 2, 3):
        kernel_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), implementation=implementation)
        assert_kernels_close(kernel_fn(x1, x2), expected)
        assert_kernels_close(kernel_fn(x1, x2), expected)  # the second call compares fingerprints


# -- the other inspections of arguments: plan keys and messages ------------------------------------


def test_non_tensor_leaves_are_keyed_without_calling_into_them():
    odd, config = _Refuses(), _RefusingTuple((1,))
    _Refuses.calls.clear()
    x = torch.ones(2, 3)
    first = input_shape_key(x, None, None, {"flag": True, "odd": odd, "config": config})
    again = input_shape_key(x, None, None, {"flag": True, "odd": odd, "config": config})
    assert first == again and hash(first) == hash(again)
    assert input_shape_key(x, None, None, {"flag": False, "odd": odd, "config": config}) != first
    assert input_shape_key(x, None, None, {"flag": True, "odd": _Refuses(), "config": config}) != first
    assert _Refuses.calls == []


def test_a_dead_objects_key_never_matches_a_new_object_at_its_address():
    class Config:
        pass

    key = leaf_key(Config())  # the object is gone at once; its address is free for the next one
    assert all(leaf_key(Config()) != key for _ in range(100))
    kept = Config()
    assert leaf_key(kept) == leaf_key(kept)
    assert leaf_key(3) == leaf_key(3) and leaf_key(3) != leaf_key(3.0) and leaf_key("a") == leaf_key("a")


def test_a_call_with_a_keyword_argument_whose_methods_raise():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(3, 2)

        def forward(self, x, config):
            return self.linear(x) * config.scale

    class Config:
        scale = 2.0

        def __repr__(self):
            raise RuntimeError("repr")

        def __eq__(self, other):
            raise RuntimeError("eq")

        __hash__ = object.__hash__

    torch.manual_seed(0)
    model = Scaled().double()
    x1, x2 = torch.randn(3, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    config = Config()
    expected = reference_ntk(model, x1, x2, config=config)
    kernel_fn = torchntk.empirical_ntk_fn(model)
    for _ in range(2):
        assert_kernels_close(kernel_fn(x1, x2, config=(config, config)), expected)


def test_messages_show_values_whose_repr_raises():
    assert "_Refuses object at" in show(_Refuses())
    assert "_Refuses object at" in describe({"a": torch.ones(2), "b": _Refuses()})
    assert safe_repr(list(range(10**4)), limit=20) == "[0, 1, 2, 3, 4, 5..."
    with pytest.raises(TypeError, match="_Refuses object at"):
        torchntk.empirical_ntk_fn(nn.Linear(2, 2))(_Refuses())


def _mace():
    """MACE's modules, or a skip saying why. mace-torch pins an older e3nn and pulls many packages
    that CI does not install, so it is not one of ``zoo.OPTIONAL``: its absence is never a failure."""
    zoo.skip_torchvision_op_registrations()  # torchmetrics, which MACE imports, imports torchvision
    try:
        from mace import modules, tools
    except Exception as error:  # a broken install raises more than ImportError
        pytest.skip(f"{zoo.SKIP_PREFIX} mace does not import ({type(error).__name__}: {' '.join(str(error).split())})")
    return modules, tools


class _MaceEnergies(nn.Module):
    """MACE on configurations of one water molecule, fully connected: positions ``(B, 3, 3)`` in,
    MACE's output dict out (the graph batching MACE's own data loader does)."""

    def __init__(self, mace, forces: bool = False, graph: bool = False):
        super().__init__()
        self.mace = mace
        self.forces = forces  # MACE's own forces: torch.autograd.grad of the energy inside forward
        self.graph = graph  # MACE's training=True: that grad keeps its graph (create_graph=True)
        self.register_buffer("species", torch.tensor([1, 0, 0]), persistent=False)  # O H H

    def forward(self, positions):
        batch, atoms = positions.shape[:2]
        send, receive = zip(*[(i, j) for i in range(atoms) for j in range(atoms) if i != j])
        offsets = (torch.arange(batch) * atoms).repeat_interleave(len(send))
        edges = torch.stack([torch.tensor(send).repeat(batch), torch.tensor(receive).repeat(batch)]) + offsets
        zeros = positions.new_zeros(edges.shape[1], 3)
        data = {
            "positions": positions.reshape(-1, 3),
            "node_attrs": nn.functional.one_hot(self.species, 2).to(positions.dtype).repeat(batch, 1),
            "edge_index": edges, "shifts": zeros, "unit_shifts": zeros,
            "cell": positions.new_zeros(3 * batch, 3),
            "batch": torch.arange(batch).repeat_interleave(atoms),
            "ptr": torch.arange(batch + 1) * atoms,
            "weight": positions.new_ones(batch),
            "head": torch.zeros(batch, dtype=torch.long),
        }
        return self.mace(data, training=self.graph, compute_force=self.forces)


def _small_mace() -> nn.Module:
    """A float64 MACE for water (H and O, one interaction), from seed 0 (skipped where mace does not import)."""
    modules, tools = _mace()
    o3 = _e3nn().o3
    torch.manual_seed(0)
    block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
    mace = modules.MACE(
        r_max=3.0, num_bessel=4, num_polynomial_cutoff=5, max_ell=1, interaction_cls=block,
        interaction_cls_first=block, num_interactions=1, num_elements=2, hidden_irreps=o3.Irreps("4x0e + 4x1o"),
        MLP_irreps=o3.Irreps("4x0e"), gate=nn.functional.silu, atomic_energies=np.array([1.0, 3.0]),
        avg_num_neighbors=2.0, atomic_numbers=tools.AtomicNumberTable([1, 8]).zs, correlation=2,
        radial_type="bessel",
    ).double()
    return mace


@pytest.mark.slow
def test_a_mace_model_held_as_a_module_is_exact():
    mace = _small_mace()
    model = _MaceEnergies(mace)
    water = torch.tensor([[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0]], dtype=torch.float64)
    x1 = water + 0.1 * torch.randn(3, 3, 3, dtype=torch.float64)
    x2 = water + 0.1 * torch.randn(2, 3, 3, dtype=torch.float64)

    class Reference(nn.Module):  # the energies as a tensor, for the brute-force reference
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, positions):
            return self.model(positions)["energy"][:, None]

    expected = reference_ntk(Reference(), x1, x2)
    energies = lambda output: output["energy"][:, None]  # noqa: E731 - (B, 1): one entry per example
    for implementation in (0, 1, 2, 3):
        kernel_fn = torchntk.empirical_ntk_fn(model, output_fn=energies, implementation=implementation)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torchntk.ExampleLoopWarning)  # vmap cannot map scatter_add_
            assert_kernels_close(kernel_fn(x1, x2), expected)


@pytest.mark.slow
def test_the_forces_of_a_mace_model_held_as_a_module_are_exact():
    """MACE computes its forces by ``torch.autograd.grad`` of the energy inside ``forward``
    (docs/pinn.md's derivatives inside the forward pass): the kernel of the forces, traced over
    x, y, z, is exact with every implementation and the defaults. In eval mode MACE asks for no
    graph of that grad (``create_graph=training``), which would make the forces constants of the
    parameters; torchntk differentiates through it anyway, and the brute-force reference gets
    the graph by MACE's ``training=True`` (nothing else of this model depends on it)."""
    mace = _small_mace()
    model = _MaceEnergies(mace, forces=True)
    water = torch.tensor([[0.0, 0.0, 0.0], [0.96, 0.0, 0.0], [-0.24, 0.93, 0.0]], dtype=torch.float64)
    x1 = water + 0.1 * torch.randn(3, 3, 3, dtype=torch.float64)
    x2 = water + 0.1 * torch.randn(2, 3, 3, dtype=torch.float64)
    forces = lambda output: output["forces"].reshape(-1, 3, 3)  # noqa: E731 - (B, atoms, xyz)

    expected = reference_ntk(_Forces(_MaceEnergies(mace, forces=True, graph=True), forces), x1, x2)
    for implementation in (0, 1, 2, 3):
        kernel_fn = torchntk.empirical_ntk_fn(model, output_fn=forces, implementation=implementation)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torchntk.ExampleLoopWarning)  # vmap cannot map scatter_add_
            assert_kernels_close(kernel_fn(x1, x2), expected)


class _Forces(nn.Module):
    """A model's output dict read by ``select``, as a tensor for the brute-force reference."""

    def __init__(self, model, select):
        super().__init__()
        self.model, self.select = model, select

    def forward(self, positions):
        return self.select(self.model(positions))
