"""Parameter groups: the NTK split by groups of parameters, every group in one call.

NOTE: [Parameter groups]
The NTK is a sum over parameters, ``K = sum_p J1_p J2_p^T``, so it splits exactly into one kernel
per group of parameters: ``K_g = sum_{p in g} J1_p J2_p^T``. ``groups={name: selection}`` on
``empirical_ntk_fn`` / ``empirical_kernel_fn`` asks for every ``K_g`` at once:

* a selection is a glob pattern over parameter names (``"*.lora_*"``; a pattern naming a module,
  ``"encoder.layer.0"`` or ``"*.attention"``, also selects every parameter under it), a list of
  them, a submodule of the model (every parameter under it), a list mixing the two, or a
  predicate ``(name, parameter) -> bool``. Functions ``f(params, x)`` name their parameters by
  their key paths in ``params`` joined with dots (``{"dense": {"w": w}}`` names ``w`` ``"dense.w"``);
* a tied parameter (one tensor registered under several names) is selected by any of its names,
  and by any submodule that holds it;
* each differentiated parameter belongs to the first group (in the mapping's order) that selects
  it, so a catch-all ``"*"`` last takes the rest. Parameters in no group are not differentiated at
  all (they stay constants, which saves their work): the groups sum to the NTK of the grouped
  parameters, which is the whole NTK when every parameter is in a group;
* a group that ends up empty is a ValueError naming it (a typo in a pattern would otherwise
  give a kernel of zeros).

The kernel call differentiates the grouped parameters only and carries the partition
(``KernelCall.groups``). Every implementation returns, for each output leaf, a tuple of one block
per group instead of one block; ``KernelCall.normalise`` turns it into a :class:`GroupKernels`
(a dict ``{group: kernel}``), which takes the place of the kernel tensor of that output leaf
everywhere (``ntk_fn``'s result, ``EmpiricalKernel.ntk``, ``batch``, Monte Carlo). Jacobian
contraction (1) and structured derivatives (3) compute each per-parameter (per-use) term once, as
without groups, and add it to its group's sum: one pass. NTK-vector products (2) reuse x2's
parameter-space vectors but run the forward-mode passes over x1 once per group (each restricted to
the group's parameters), so its x1 work grows with the number of groups.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .._model.functional import FunctionalModel, predicate_verdict
from .._model.names import parameter_names
from .._utils.checks import show
from .._utils.tree import Flat, key_entry
from .._utils.values import safe_repr


class GroupKernels(dict):
    """The NTK of one output leaf split by parameter group: ``{group name: kernel}``.

    A ``dict`` (in the order of ``groups``) registered as a pytree node, so that ``batch``, Monte
    Carlo and ``torch.utils._pytree`` see its kernels as leaves.
    """


def _flatten(groups: GroupKernels) -> tuple[list, list]:
    return list(groups.values()), list(groups.keys())


def _unflatten(values: Any, keys: Any) -> GroupKernels:
    return GroupKernels(zip(keys, values))


def _flatten_with_keys(groups: GroupKernels) -> tuple[list, list]:
    return [(pytree.MappingKey(key), value) for key, value in groups.items()], list(groups.keys())


pytree.register_pytree_node(
    GroupKernels, _flatten, _unflatten, serialized_type_name="torchntk.GroupKernels",
    flatten_with_keys_fn=_flatten_with_keys,
)


def is_group_kernels(node: Any) -> bool:
    return isinstance(node, GroupKernels)


@dataclass(frozen=True)
class _Selection:
    """One group's selection: glob patterns (each also selecting what is under a module it names),
    literal module paths (from submodules given as objects), or a predicate."""

    patterns: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    predicate: Optional[Callable[[str, torch.Tensor], Any]] = None

    def selects(self, names: Sequence[str], parameter: torch.Tensor, group: str, where: str) -> bool:
        """Whether the parameter is selected under any of its ``names`` (a tied one has several)."""
        if self.predicate is not None:
            what = f"the predicate of `groups` entry {group!r}"
            return any(predicate_verdict(self.predicate, name, parameter, what, where) for name in names)
        return any(self._selects(name) for name in names)

    def _selects(self, name: str) -> bool:
        if any(path == "" or name.startswith(path + ".") for path in self.modules):
            return True
        return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, p + ".*") for p in self.patterns)


@dataclass(frozen=True)
class ParameterGroups:
    """Validated ``groups``: names in order and their selections (see NOTE: [Parameter groups])."""

    names: tuple[str, ...]
    selections: tuple[_Selection, ...]
    given: tuple[str, ...]  # each selection as the user gave it, for messages

    def split(
        self, model: FunctionalModel, module: Optional[nn.Module], where: str
    ) -> tuple[FunctionalModel, tuple[tuple[int, ...], ...]]:
        """The model differentiating the grouped parameters only, and each group's parameter indices
        in it.

        Raises:
            ValueError: a group that selects no differentiated parameter, or only parameters that
                earlier groups hold.
            TypeError: a predicate returning something other than a bool.
        """
        names = _parameter_names(model)
        own = dict(module.named_parameters(remove_duplicate=False)) if module is not None else {}
        aliases = parameter_names(module) if module is not None else {}
        members: list[list[int]] = [[] for _ in self.names]
        claimed: dict[int, list[str]] = {}  # parameters selected by a group after the one holding them
        for index, (name, value) in enumerate(zip(names, model.params)):
            parameter = own.get(name, value)
            known_as = aliases.get(name, (name,))  # a tied parameter is selected by any of its names
            owner = None
            for position, (group, selection) in enumerate(zip(self.names, self.selections)):
                if owner is None:
                    if selection.selects(known_as, parameter, group, where):
                        owner = position
                        members[position].append(index)
                elif not members[position] and selection.selects(known_as, parameter, group, where):
                    claimed.setdefault(position, []).append(name)
        for position, indices in enumerate(members):
            if not indices:
                raise _empty_group(self, position, names, claimed.get(position, []), where)
        grouped = sorted(index for indices in members for index in indices)
        positions = {index: position for position, index in enumerate(grouped)}
        restricted = model.restricted(grouped)
        return restricted, tuple(tuple(positions[index] for index in indices) for indices in members)


def _empty_group(groups: ParameterGroups, position: int, names: Sequence[str], claimed: list[str], where: str):
    group, given = groups.names[position], groups.given[position]
    if claimed:
        earlier = ", ".join(repr(name) for name in claimed[:4]) + (", ..." if len(claimed) > 4 else "")
        return ValueError(
            f"{where}: `groups` entry {group!r} ({given}) is empty: every parameter it selects ({earlier}) "
            f"belongs to an earlier group (a parameter belongs to the first group that selects it). "
            f"Reorder `groups` or narrow the earlier selections."
        )
    listing = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
    return ValueError(
        f"{where}: `groups` entry {group!r} ({given}) selects no differentiated parameter; the "
        f"differentiated parameters are {listing} (frozen parameters, and those the call's `params` "
        f"leaves out, are constants in no group)."
    )


def _parameter_names(model: FunctionalModel) -> list[str]:
    """The names groups match: a module's parameter names, or a function's key paths in ``params``."""
    if model.params_tree is None:
        return list(model.names)
    return parameter_paths(model.params_tree)


def parameter_paths(flat: Flat) -> list[str]:
    """The key path of every tensor leaf of a parameter pytree, keys joined with dots.

    Example:
        >>> parameter_paths(Flat.of({"dense": {"w": torch.ones(1)}, "scales": [torch.ones(1), None]}))
        ['dense.w', 'scales.0']
    """
    markers = flat.rebuild(list(range(len(flat.leaves))))
    names = [""] * len(flat.leaves)
    for path, leaf in pytree.tree_flatten_with_path(markers)[0]:
        if leaf is not None:
            names[leaf] = ".".join(str(key_entry(key)) for key in path)
    return names


_EXPECTED = (
    "a glob pattern over parameter names (e.g. '*.lora_*' or a module name such as 'encoder.layer.0'), a "
    "submodule of the model, a non-empty list of those, or a predicate (name, parameter) -> bool"
)


def groups_argument(groups: Any, f: Any, where: str) -> Optional[ParameterGroups]:
    """The validated ``groups`` of a builder (None stays None; a :class:`ParameterGroups` is kept).

    Submodules are turned into their paths in ``f`` here, so that a copy of the model (a replica
    on another device) is grouped alike.

    Raises:
        TypeError: ``groups`` that is not a mapping, keys that are not strings, selections of
            another type.
        ValueError: an empty mapping or key, an empty list, a submodule that is not part of ``f``.
    """
    if groups is None or isinstance(groups, ParameterGroups):
        return groups
    if not isinstance(groups, Mapping):
        raise TypeError(
            f"{where}: `groups` must be None or a mapping {{group name: selection}} with each selection "
            f"{_EXPECTED}; got {show(groups)}."
        )
    if not groups:
        raise ValueError(f"{where}: `groups` must name at least one group, got an empty mapping.")
    names, selections, given = [], [], []
    for key, value in groups.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"{where}: `groups` keys must be non-empty strings (group names), got {show(key)}.")
        names.append(key)
        selections.append(_selection(key, value, f, where))
        given.append(_describe(value))
    return ParameterGroups(tuple(names), tuple(selections), tuple(given))


def _selection(key: str, value: Any, f: Any, where: str) -> _Selection:
    if isinstance(value, str):
        return _Selection(patterns=(value,))
    if isinstance(value, nn.Module):
        return _Selection(modules=_module_paths(key, value, f, where))
    if callable(value):
        return _Selection(predicate=value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(item, (str, nn.Module)) for item in value):
        patterns = tuple(item for item in value if isinstance(item, str))
        modules = tuple(
            path for item in value if isinstance(item, nn.Module) for path in _module_paths(key, item, f, where)
        )
        return _Selection(patterns=patterns, modules=modules)
    if isinstance(value, (list, tuple)) and not value:
        raise ValueError(f"{where}: `groups` entry {key!r} is an empty list; expected {_EXPECTED}.")
    raise TypeError(f"{where}: `groups` entry {key!r} must be {_EXPECTED}; got {show(value)}.")


def _module_paths(key: str, module: nn.Module, f: Any, where: str) -> tuple[str, ...]:
    if not isinstance(f, nn.Module):
        raise TypeError(
            f"{where}: `groups` entry {key!r} is a module, which only selects parameters of an nn.Module model; "
            f"`f` is a function: select its parameters by key path patterns instead."
        )
    paths = tuple(path for path, sub in f.named_modules(remove_duplicate=False) if sub is module)
    if not paths:
        raise ValueError(
            f"{where}: `groups` entry {key!r} is a {type(module).__name__} that is not a submodule of the model."
        )
    return paths


def _describe(value: Any) -> str:
    if isinstance(value, nn.Module):
        return f"a {type(value).__name__}"
    if type(value) is list or type(value) is tuple:  # exact types: a subclass's iter may be anything
        return "[" + ", ".join(_describe(item) for item in value) + "]"
    if callable(value) and not isinstance(value, str):
        return "a predicate"
    return safe_repr(value, limit=200)
