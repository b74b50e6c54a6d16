"""Look-through of views, slices and casts between a parameter and the op that consumes it.

``x @ W.T``, ``W.to(x.dtype)`` or ``nn.MultiheadAttention`` slicing its packed in-projection
would otherwise hide the parameter from the rules and send it to the (slow) Jacobian fallback.
A view of a parameter is tracked as a :class:`~._roles.ParamRef` whose ``index`` says which
parameter entry each element of the view is: the same view op applied to a tensor of flat
positions computes it exactly, whatever the op's arguments.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Optional

import torch

from ._roles import ParamRef

Tensor = torch.Tensor

_VIEW_METHODS = (
    "t", "transpose", "swapaxes", "swapdims", "permute", "view", "reshape", "flatten", "unflatten",
    "contiguous", "chunk", "split", "tensor_split", "unbind", "narrow", "select", "__getitem__",
    "squeeze", "unsqueeze", "movedim", "moveaxis", "view_as", "reshape_as", "expand", "expand_as",
)
_VIEW_FUNCTIONS = (
    "t", "transpose", "swapaxes", "swapdims", "permute", "reshape", "flatten", "chunk", "split",
    "tensor_split", "unbind", "narrow", "select", "squeeze", "unsqueeze", "movedim", "moveaxis",
)
# ``detach`` is not here: a detached parameter has no derivative, so it is left to the fallback.
_CAST_METHODS = ("to", "type", "type_as", "float", "double", "half", "bfloat16", "clone")
_VIEW_PROPERTIES = ("T", "mT")

# The ATen overloads of the same views and casts: what a traced graph calls (NOTE: [Unrolled
# derivatives] in ``_unrolled.py``).
_ATEN_VIEWS = (
    "t.default", "transpose.int", "permute.default", "view.default", "_unsafe_view.default", "reshape.default",
    "unsqueeze.default", "squeeze.dim", "squeeze.dims", "squeeze.default", "expand.default", "select.int",
    "slice.Tensor", "alias.default", "unbind.int", "split.Tensor", "narrow.default",
)
_ATEN_CASTS = ("clone.default", "_to_copy.default")


def _aten(names: tuple[str, ...]) -> list:
    overloads = []
    for name in names:
        packet, overload = name.split(".")
        packet = getattr(torch.ops.aten, packet, None)
        if packet is not None and hasattr(packet, overload):  # every one exists on the supported releases
            overloads.append(getattr(packet, overload))
    return overloads


VIEW_OPS: frozenset = frozenset(
    [getattr(Tensor, name) for name in _VIEW_METHODS]
    + [getattr(torch, name) for name in _VIEW_FUNCTIONS]
    + _aten(_ATEN_VIEWS)
)
CAST_OPS: frozenset = frozenset(
    [getattr(Tensor, name) for name in _CAST_METHODS] + [torch.clone] + _aten(_ATEN_CASTS)
)


def is_view_property(func: Callable) -> bool:
    """``W.T`` and ``W.mT`` reach a function mode as the ``__get__`` of a getset descriptor."""
    owner = getattr(func, "__self__", None)
    return getattr(func, "__name__", None) == "__get__" and getattr(owner, "__name__", None) in _VIEW_PROPERTIES


def positions(param: Tensor, ref: ParamRef) -> Tensor:
    """The flat parameter positions of the tensor ``ref`` stands for."""
    if ref.index is not None:
        return ref.index
    return torch.arange(param.numel(), device=param.device).view(param.shape)


def follow_view(func: Callable, args: tuple, kwargs: dict, source: int, index: Tensor) -> Any:
    """Applies ``func`` with ``index`` in place of positional argument ``source``."""
    moved = list(args)
    moved[source] = index
    return func(*moved, **kwargs)


def view_refs(result: Any, index_result: Any, param: int) -> list[tuple[Tensor, ParamRef]]:
    """Pairs each tensor of a view op's result with the reference its positions give."""
    if isinstance(result, Tensor):
        return [(result, ParamRef(param, index_result.contiguous()))]
    if isinstance(result, (tuple, list)):
        return [
            (one, ParamRef(param, index.contiguous()))
            for one, index in zip(result, index_result)
            if isinstance(one, Tensor)
        ]
    return []


_MAX_PERMUTED_AXES = 3
"""Parameters of up to this many axes are told apart from their transposes (6 orders to try)."""


def axis_permutation(index: Tensor, shape: tuple[int, ...]) -> Optional[tuple[int, ...]]:
    """The order ``perm`` with ``index == positions.permute(perm)`` for the positions of a
    parameter of ``shape`` (the whole parameter seen through a transpose or permute), or None.

    ``x @ W.T`` and a traced backward pass's ``g @ W`` see the same weight in two axis orders;
    stated in the parameter's own order their uses pair by einsum (NOTE: [Unrolled derivatives]).
    """
    if index.ndim != len(shape) or not 0 < index.ndim <= _MAX_PERMUTED_AXES or index.numel() != math.prod(shape):
        return None
    own = None
    for perm in itertools.permutations(range(index.ndim)):
        if tuple(shape[axis] for axis in perm) != tuple(index.shape):
            continue
        if own is None:
            own = torch.arange(index.numel(), device=index.device).view(shape)
        if torch.equal(own.permute(perm), index):
            return perm
    return None
