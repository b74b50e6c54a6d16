"""``vmap_axes`` canonicalisation and the split of keyword arguments between x1 and x2.

NOTE: [vmap_axes contract]
``vmap_axes`` certifies that ``f(params, x, **kwargs)`` is the concatenation, along the output
axes, of ``f`` applied to size-1 slices of ``x`` (and of the kwargs listed in ``kwargs_axes``)
along the input axes. It is either ``(in_axes, out_axes, kwargs_axes)`` (a tuple of exactly three
elements) or a single value used for both inputs and outputs. An ``int`` applies to every leaf of
the tree it describes; a pytree of ``int``/``None`` matches the data tree (dicts by key, so key
order does not matter). Each axis is taken modulo the ndim of its own leaf, so ``-1`` works.
``None`` for an input leaf means "shared by every example". Kwargs not named in ``kwargs_axes``
are passed whole to every per-example call.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import torch

from .._utils.checks import show
from .._utils.tree import Flat


@dataclass(frozen=True)
class ParsedVmapAxes:
    """``vmap_axes`` split into its three parts, checked for type but not yet matched to data."""

    in_axes: Any
    out_axes: Any
    kwargs_axes: Any  # None, an int, or a mapping kwarg name -> axis tree


@dataclass(frozen=True)
class ResolvedVmapAxes:
    """Per-leaf axes resolved against concrete inputs (``None`` when nothing is vmapped)."""

    x_axes: tuple[Optional[int], ...]
    kwarg_axes: dict[str, tuple[Optional[int], ...]]


def parse_vmap_axes(vmap_axes: Any, where: str) -> ParsedVmapAxes:
    if isinstance(vmap_axes, tuple) and len(vmap_axes) == 3:
        in_axes, out_axes, kwargs_axes = vmap_axes
    else:
        in_axes, out_axes, kwargs_axes = vmap_axes, vmap_axes, None
    for name, tree in (("in_axes", in_axes), ("out_axes", out_axes)):
        _check_axis_tree(tree, f"vmap_axes ({name})", where)
    if kwargs_axes is not None and not isinstance(kwargs_axes, (numbers.Integral, Mapping)) or isinstance(
        kwargs_axes, bool
    ):
        raise TypeError(
            f"{where}: the kwargs part of `vmap_axes` must be None, an int or a dict "
            f"{{kwarg name: axes}}, got {show(kwargs_axes)}."
        )
    if isinstance(kwargs_axes, Mapping):
        for key, tree in kwargs_axes.items():
            _check_axis_tree(tree, f"vmap_axes (kwargs_axes[{key!r}])", where)
    return ParsedVmapAxes(in_axes, out_axes, kwargs_axes)


FOUND = "auto"
"""The default ``vmap_axes`` of the kernel builders: the axes are found per input structure
(NOTE: [Found vmap_axes])."""


def candidate_vmap_axes(x1: Any, x2: Any, kwargs: Mapping[str, Any]) -> Optional[ParsedVmapAxes]:
    """The ``vmap_axes`` that ``vmap_axes="auto"`` tries on these inputs, or None where none can apply.

    NOTE: [Found vmap_axes]
    Without ``vmap_axes`` the user promises nothing, and the kernel is computed on whole batches:
    exact for any model, but ``O(N^2)`` in derivatives where independent examples need ``O(N)``.
    The builders' default ``"auto"`` looks for the axes the user would most likely have given: the
    leading axis of every input leaf and output leaf, and of every keyword argument whose tensor
    leaves all lead with the examples (an attention mask), the others passed whole. They are tried
    only where every input leaf is a tensor of at least two dimensions whose leading size is its
    side's number of examples, and adopted only when NOTE: [Checking vmap_axes] passes on the first
    call of a key (``_kernel/preparation.py``) and the kernel's layout keeps the leading output axis
    (so that the same ``trace_axes`` mean the same kernel with and without axes): structural
    coupling (batch statistics, dropout in training mode), per-example outputs that differ from
    the whole batch's, or derivatives that differ, keep the whole-batch computation for that key,
    whose values are the same. ``check_vmap_axes=False`` finds nothing
    (nothing would prove the axes). The decision is a fact of the plan key (``_plan``): a change of
    shapes, structure or train/eval mode decides again.
    """
    sizes = []
    for x in (x1,) if x2 is None else (x1, x2):
        leaves = Flat.of(x).leaves
        # A 1-D input is one unbatched example to some models (nn.Linear) and many scalar examples to
        # others; without a promise it stays one, as with vmap_axes=None
        if not leaves or any(not isinstance(leaf, torch.Tensor) or leaf.ndim < 2 for leaf in leaves):
            return None
        if len({leaf.shape[0] for leaf in leaves}) != 1:
            return None
        sizes.append(leaves[0].shape[0])
    halves = split_kwargs(kwargs, x2_is_none=False, where="")
    mapped = {}
    for key in kwargs:
        leads = []
        for half, size in zip(halves, sizes):
            leaves = [leaf for leaf in Flat.of(half[key]).leaves if isinstance(leaf, torch.Tensor)]
            leads.append(bool(leaves) and all(leaf.ndim > 0 and leaf.shape[0] == size for leaf in leaves))
        if all(leads):
            mapped[key] = 0
    return ParsedVmapAxes(0, 0, mapped or None)


def _check_axis_tree(tree: Any, name: str, where: str) -> None:
    if tree is None:
        return
    if isinstance(tree, bool) or not isinstance(tree, (numbers.Integral, Mapping, list, tuple)):
        raise TypeError(f"{where}: `{name}` must be None, an int or a pytree of ints, got {show(tree)}.")
    if isinstance(tree, Mapping):
        for value in tree.values():
            _check_axis_tree(value, name, where)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            _check_axis_tree(value, name, where)


def broadcast_axes(axes: Any, data: Any, name: str, where: str) -> tuple[Optional[int], ...]:
    """Matches an axis tree to ``data`` and returns one axis per leaf of ``Flat.of(data)``.

    Axes are reduced modulo each leaf's ndim; non-tensor leaves are never mapped.
    """
    per_leaf: list[Optional[int]] = []

    def walk(axes_node: Any, data_node: Any, path: str) -> None:
        if data_node is None:
            return
        if axes_node is None or isinstance(axes_node, numbers.Integral):
            for leaf in Flat.of(data_node).leaves:
                per_leaf.append(_leaf_axis(axes_node, leaf, name, path, where))
            return
        if isinstance(axes_node, Mapping):
            if not isinstance(data_node, Mapping) or set(axes_node) != set(data_node):
                raise ValueError(
                    f"{where}: `{name}` has a dict with keys {sorted(map(str, axes_node))} at {path or 'the root'}, "
                    f"but the data there is {_kind(data_node)}."
                )
            for key in data_node:
                walk(axes_node[key], data_node[key], f"{path}[{key!r}]")
            return
        if not isinstance(data_node, (list, tuple)) or len(data_node) != len(axes_node):
            raise ValueError(
                f"{where}: `{name}` has a {type(axes_node).__name__} of {len(axes_node)} axes at "
                f"{path or 'the root'}, but the data there is {_kind(data_node)}."
            )
        for index, (axes_child, data_child) in enumerate(zip(axes_node, data_node)):
            walk(axes_child, data_child, f"{path}[{index}]")

    walk(axes, data, "")
    return tuple(per_leaf)


def _kind(node: Any) -> str:
    if isinstance(node, torch.Tensor):
        return f"a tensor of shape {tuple(node.shape)}"
    if isinstance(node, Mapping):
        return f"a dict with keys {sorted(map(str, node))}"
    if isinstance(node, (list, tuple)):
        return f"a {type(node).__name__} of length {len(node)}"
    return f"a {type(node).__name__}"


def _leaf_axis(axis: Optional[int], leaf: Any, name: str, path: str, where: str) -> Optional[int]:
    if axis is None or not isinstance(leaf, torch.Tensor):
        return None
    ndim = leaf.ndim
    if not -ndim <= axis < ndim:
        raise ValueError(
            f"{where}: `{name}` gives axis {axis} for the leaf at {path or 'the root'} of shape "
            f"{tuple(leaf.shape)}; expected -{ndim}..{ndim - 1}."
        )
    return int(axis) % ndim


def resolve_inputs(parsed: ParsedVmapAxes, x: Any, kwargs: Mapping[str, Any], where: str) -> Optional[ResolvedVmapAxes]:
    """Resolves the input and kwarg axes against ``x`` and ``kwargs``; None when nothing is mapped."""
    x_axes = broadcast_axes(parsed.in_axes, x, "vmap_axes (in_axes)", where)
    kwarg_axes: dict[str, tuple[Optional[int], ...]] = {}
    kwargs_axes = parsed.kwargs_axes
    if isinstance(kwargs_axes, Mapping):
        unknown = sorted(set(kwargs_axes) - set(kwargs))
        if unknown:
            raise ValueError(
                f"{where}: `vmap_axes` names keyword arguments {unknown} that were not passed "
                f"(passed: {sorted(kwargs)})."
            )
    for key, value in kwargs.items():
        axes = kwargs_axes.get(key) if isinstance(kwargs_axes, Mapping) else kwargs_axes
        kwarg_axes[key] = broadcast_axes(axes, value, f"vmap_axes (kwargs_axes[{key!r}])", where)
    if all(axis is None for axis in x_axes) and all(
        axis is None for axes in kwarg_axes.values() for axis in axes
    ):
        return None
    sizes = {}
    for leaf, axis in zip(Flat.of(x).leaves, x_axes):
        if axis is not None:
            sizes[f"x leaf of shape {tuple(leaf.shape)} (axis {axis})"] = leaf.shape[axis]
    for key, axes in kwarg_axes.items():
        for leaf, axis in zip(Flat.of(kwargs[key]).leaves, axes):
            if axis is not None:
                sizes[f"kwarg {key!r} of shape {tuple(leaf.shape)} (axis {axis})"] = leaf.shape[axis]
    if len(set(sizes.values())) > 1:
        listing = ", ".join(f"{where_} has {size}" for where_, size in sizes.items())
        raise ValueError(f"{where}: the vmapped axes must all have the same size, but {listing}.")
    return ResolvedVmapAxes(x_axes, kwarg_axes)


def resolve_outputs(parsed: ParsedVmapAxes, output: Any, where: str) -> tuple[int, ...]:
    """One output axis per output leaf; every output leaf must carry the batch axis."""
    axes = broadcast_axes(parsed.out_axes, output, "vmap_axes (out_axes)", where)
    for leaf, axis in zip(Flat.of(output).leaves, axes):
        if axis is None:
            raise ValueError(
                f"{where}: `vmap_axes` maps the inputs but gives no output axis (out_axes) for "
                f"the output leaf of shape {tuple(getattr(leaf, 'shape', ()))}; every output leaf "
                f"must have a batch axis."
            )
    return tuple(int(axis) for axis in axes)  # type: ignore[arg-type]


def split_kwargs(kwargs: Mapping[str, Any], *, x2_is_none: bool, where: str) -> tuple[dict, dict]:
    """Splits every 2-tuple keyword argument ``(for_x1, for_x2)``; others go to both sides.

    When ``x2`` is None the x1 computation is reused for x2, so both halves must be equal.
    """
    first: dict = {}
    second: dict = {}
    for key, value in kwargs.items():
        if isinstance(value, tuple) and len(value) == 2:
            if x2_is_none and not _same(value[0], value[1]):
                raise ValueError(
                    f"{where}: keyword argument {key!r} is a 2-tuple, i.e. separate values for x1 "
                    f"and x2, but x2 is None and the two values differ. Pass x2 explicitly, or "
                    f"pass a single value."
                )
            first[key], second[key] = value
        else:
            first[key] = second[key] = value
    return first, second


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    flat_a, flat_b = Flat.of(a), Flat.of(b)
    if not flat_a.same_structure(flat_b):
        return False
    for leaf_a, leaf_b in zip(flat_a.leaves, flat_b.leaves):
        if isinstance(leaf_a, torch.Tensor) or isinstance(leaf_b, torch.Tensor):
            if not (
                isinstance(leaf_a, torch.Tensor)
                and isinstance(leaf_b, torch.Tensor)
                and leaf_a.shape == leaf_b.shape
                and torch.equal(leaf_a, leaf_b)
            ):
                return False
        elif leaf_a != leaf_b:
            return False
    return True


@dataclass(frozen=True)
class UnmappedKwarg:
    """A keyword argument that ``vmap_axes`` passes whole to every per-example call although one
    of its axes has the batch size, so it probably holds one entry per example.

    Attributes:
        name: the keyword.
        shapes: the shapes of its tensor leaves.
        axes: the axis tree to map it with (its pytree structure, an int for a single tensor).
    """

    name: str
    shapes: tuple[tuple[int, ...], ...]
    axes: Any


def unmapped_batch_sized_kwargs(
    kwargs: Mapping[str, Flat], kwarg_axes: Mapping[str, tuple[Optional[int], ...]], batch_size: int
) -> list[UnmappedKwarg]:
    """The keyword arguments with an unmapped tensor leaf having an axis of size ``batch_size``.

    The suggested axis of such a leaf is its first axis of that size; mapped leaves keep theirs.
    """
    found = []
    for name, flat in kwargs.items():
        axes = list(kwarg_axes.get(name, (None,) * len(flat.leaves)))
        suspicious = False
        for index, leaf in enumerate(flat.leaves):
            if axes[index] is not None or not isinstance(leaf, torch.Tensor):
                continue
            sizes = list(leaf.shape)
            if batch_size in sizes:
                axes[index] = sizes.index(batch_size)
                suspicious = True
        if suspicious:
            shapes = tuple(tuple(leaf.shape) for leaf in flat.leaves if isinstance(leaf, torch.Tensor))
            single = len(flat.leaves) == 1 and not flat.none_positions and isinstance(flat.leaves[0], torch.Tensor)
            tree = axes[0] if single and flat.spec.num_leaves == 1 else flat.rebuild(axes)
            found.append(UnmappedKwarg(name, shapes, tree))
    return found


def suggested_vmap_axes(parsed: ParsedVmapAxes, additions: list[UnmappedKwarg]) -> str:
    """``vmap_axes=(in_axes, out_axes, {...})``: what was given, plus ``additions`` mapped."""
    kwargs_axes = dict(parsed.kwargs_axes) if isinstance(parsed.kwargs_axes, Mapping) else {}
    for addition in additions:
        kwargs_axes[addition.name] = addition.axes
    return f"vmap_axes=({parsed.in_axes!r}, {parsed.out_axes!r}, {kwargs_axes!r})"
