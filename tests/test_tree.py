"""``torchntk._utils.tree.Flat``: NOTE: [None is an empty subtree], and its shortcut for a lone
tensor, against ``torch.utils._pytree``."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from torchntk._utils.tree import Flat, is_all_none

pytestmark = pytest.mark.cpu_only("pytree structure only")

_T = torch.ones(2)


@pytest.mark.parametrize(
    "tree", [_T, torch.nn.Parameter(torch.ones(2)), (_T,), [_T, None, {"a": _T}], {"x": None}, None, 3.0],
    ids=["tensor", "parameter", "tuple", "nested-with-none", "dict-of-none", "none", "number"],
)
def test_flat_keeps_the_tensor_leaves_and_rebuilds_the_tree(tree):
    flat = Flat.of(tree)
    leaves, spec = pytree.tree_flatten(tree)
    assert flat.leaves == tuple(leaf for leaf in leaves if leaf is not None)
    assert flat.spec == spec and str(flat.spec) == str(spec)  # plan keys read str(spec)
    rebuilt = flat.rebuild(flat.leaves)
    assert pytree.tree_structure(rebuilt) == spec
    assert all(a is b for a, b in zip(pytree.tree_leaves(rebuilt), leaves))
    assert flat.same_structure(Flat.of(rebuilt))
    assert is_all_none(tree) == (not flat.leaves)
