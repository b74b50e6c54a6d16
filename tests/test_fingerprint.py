"""``structure_fingerprint``: what changes it and what does not, and its fast paths (the exact-type
branches at the top of ``_describe`` in ``torchntk/_model/fingerprint.py``) against the plain
description they shortcut."""

from __future__ import annotations

import collections
import numbers

import numpy as np
import pytest
import torch
from torch import nn

from tests import zoo
from torchntk._model.fingerprint import _LONG, _SYNCED, _TENSOR_TABLES, structure_fingerprint
from torchntk.cli._models import ResNet18

pytestmark = pytest.mark.cpu_only("describes modules in Python; no kernel is computed")


def _plain_describe(value, depth):
    """The description without fast paths: every value through the general branches."""
    if value is None or isinstance(value, (bool, str, bytes, numbers.Number, torch.dtype, torch.device)):
        return (type(value), value)
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), value._version, tuple(value.shape), value.dtype, value.device)
    if isinstance(value, (list, tuple, dict, set, frozenset)) and depth < 3 and len(value) <= _LONG:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        if isinstance(value, (set, frozenset)):
            items = enumerate(sorted(value, key=repr))
        return (type(value), tuple((_plain_describe(k, depth + 1), _plain_describe(v, depth + 1)) for k, v in items))
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return (type(value), id(value), len(value))
    return (type(value), id(value))


def _plain_fingerprint(module: nn.Module) -> tuple:
    entries = []
    for path, sub in module.named_modules(remove_duplicate=False):
        state = []
        for key, value in sub.__dict__.items():
            if key in _SYNCED:
                continue
            if key in _TENSOR_TABLES:
                state.append((key, tuple(
                    (name, None if t is None else (type(t), id(t), tuple(t.shape), t.dtype, t.device))
                    for name, t in value.items()
                )))
            elif key == "_modules":
                state.append((key, tuple((name, None if child is None else id(child)) for name, child in value.items())))
            else:
                state.append((key, _plain_describe(value, 0)))
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
