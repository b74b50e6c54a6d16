"""Pytree helpers on top of :mod:`torch.utils._pytree`.

NOTE: [None is an empty subtree]
neural-tangents inherits JAX's rule that ``None`` is a container with no leaves, so a
model may return ``(y, None)`` and an input tree may contain ``None`` placeholders.
``torch.utils._pytree`` treats ``None`` as a leaf instead. Every place in torchntk that
walks a pytree goes through :class:`Flat`, which keeps the ``None`` positions aside so that
the tensor leaves are what transforms see and the original structure can be rebuilt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch.utils import _pytree as pytree

from .values import PLAIN, safe_repr


@dataclass(frozen=True)
class Flat:
    """A pytree split into its non-``None`` leaves and a recipe to rebuild it."""

    leaves: tuple
    spec: pytree.TreeSpec
    none_positions: tuple[int, ...]

    @classmethod
    def of(cls, tree: Any, is_leaf: Optional[Callable[[Any], bool]] = None) -> "Flat":
        """``is_leaf``: nodes to keep whole as leaves (as ``pytree.tree_flatten`` takes it)."""
        if type(tree) is torch.Tensor:  # most inputs: pytree's walk costs more than the rest of this
            return cls((tree,), _LEAF, ())
        all_leaves, spec = pytree.tree_flatten(tree, is_leaf=is_leaf)
        none_positions = tuple(i for i, leaf in enumerate(all_leaves) if leaf is None)
        leaves = tuple(leaf for leaf in all_leaves if leaf is not None)
        return cls(leaves, spec, none_positions)

    def rebuild(self, leaves: Sequence[Any]) -> Any:
        """Rebuilds the tree with ``leaves`` in place of the non-``None`` leaves."""
        leaves = list(leaves)
        if len(leaves) != len(self.leaves):
            raise AssertionError(f"expected {len(self.leaves)} leaves, got {len(leaves)}")
        for position in self.none_positions:
            leaves.insert(position, None)
        return pytree.tree_unflatten(leaves, self.spec)

    def same_structure(self, other: "Flat") -> bool:
        return self.spec == other.spec and self.none_positions == other.none_positions


_LEAF = pytree.tree_flatten(torch.zeros(()))[1]
"""The spec of a tree that is one leaf."""


def is_all_none(tree: Any) -> bool:
    """True when ``tree`` has no leaves other than ``None`` (``None`` itself, ``()``, ``[None]``)."""
    return len(Flat.of(tree).leaves) == 0


def describe(tree: Any) -> str:
    """A short structural description of a pytree, shapes in place of tensors, for messages."""
    def show(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return f"Tensor{tuple(leaf.shape)}"
        return leaf if type(leaf) in PLAIN else _Shown(safe_repr(leaf))

    return str(pytree.tree_map(show, tree))


class _Shown:
    """A leaf of a described tree, shown by a repr made in advance (:func:`safe_repr`)."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text


_PLAIN_LEAVES = (
    torch.Tensor, int, float, bool, type(None), str, torch.dtype, torch.device, torch.layout, torch.memory_format,
)
"""Types that are pytree leaves (no container type is among them)."""


def argument_leaves(args: tuple, kwargs: dict) -> list:
    """``pytree.tree_leaves((args, kwargs))``, in the same order, without pytree where every
    argument is a leaf or a plain list or tuple of leaves: nearly every operation a function or
    dispatch mode sees, whose walk by pytree was a fifth of a recording pass's time and a third of a
    counted pass's (``argument_leaves((result,), {})`` gives an operation's result leaves)."""
    leaves: list = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, _PLAIN_LEAVES):
            leaves.append(value)
        elif type(value) in (list, tuple) and all(isinstance(item, _PLAIN_LEAVES) for item in value):
            leaves.extend(value)
        else:
            return pytree.tree_leaves((args, kwargs))
    return leaves


def key_entry(key: Any) -> Any:
    """The key, index or attribute name of one entry of a pytree key path (``tree_flatten_with_path``)."""
    for attribute in ("key", "idx", "name"):
        if hasattr(key, attribute):
            return getattr(key, attribute)
    return str(key)
