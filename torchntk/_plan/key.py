"""What a kernel call's plan depends on: its key.

NOTE: [Plan keys]
Two calls of one kernel function share a plan exactly when nothing a decision reads differs
between them: the structure, shapes, dtypes and device types of every argument
(:func:`input_shape_key`), a module's structure (its structure fingerprint: classes, attributes,
hooks, parameter and buffer slots; see ``_model/fingerprint.py``) and its train/eval modes
(which a replica refresh copies and the fingerprint therefore leaves out, but which decide
whether batch statistics couple the examples), or a function's identity. Tensor values are never
part of a key: what depends on them (the kernel, the NaN check, the output check where it runs
on every call) is computed by every call.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._model.fingerprint import FingerprintMemo, hashed, structure_fingerprint
from .._utils.tree import Flat, is_all_none
from .._utils.types import Model
from .._utils.values import leaf_key

__all__ = ["PlanKey", "input_shape_key", "plan_key"]


def input_shape_key(x1: Any, x2: Any, params: Any, kwargs: dict) -> tuple:
    """The structure, shapes, dtypes and device types of every argument of a call (what AUTO's
    choice and the implementations' cached plans may depend on); other leaves by
    :func:`~torchntk._utils.values.leaf_key` (plain values by value, objects by identity)."""
    def describe_leaves(tree: Any) -> tuple:
        flat = Flat.of(tree)
        leaves = tuple(
            (tuple(leaf.shape), leaf.dtype, leaf.device.type) if isinstance(leaf, torch.Tensor) else leaf_key(leaf)
            for leaf in flat.leaves
        )
        return (str(flat.spec), flat.none_positions, leaves)

    return (describe_leaves(x1), is_all_none(x2), describe_leaves(x2), describe_leaves(params), describe_leaves(kwargs))


class PlanKey:
    """The key of NOTE: [Plan keys], hashed once: a module's structure fingerprint is a deep tuple
    (about 1,400 entries for a ResNet-18) that a call looks up in several caches, and Python
    tuples hash their entries anew every time (55 us for a ResNet-18's)."""

    __slots__ = ("parts", "_hash")

    def __init__(self, parts: tuple):
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PlanKey) and self._hash == other._hash and self.parts == other.parts

    def __repr__(self) -> str:
        return f"PlanKey({self._hash:#x})"


def plan_key(f: Model, shape_key: tuple, memo: Optional[FingerprintMemo] = None) -> PlanKey:
    """The key of NOTE: [Plan keys] for a call whose :func:`input_shape_key` is ``shape_key``;
    ``memo``: the last walk of ``f`` by the same caller (NOTE: [Unchanged modules])."""
    if not isinstance(f, torch.nn.Module):
        return PlanKey((shape_key, id(f), None))
    modes: list[bool] = []
    structure = structure_fingerprint(f, modes, memo)  # one walk for both
    # hashed once (NOTE: [Unchanged modules]): the last walk's where nothing changed
    return PlanKey((shape_key, hashed(structure) if memo is None else memo.hashed(structure), tuple(modes)))
