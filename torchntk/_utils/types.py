"""Documented type aliases and the :class:`NtkImplementation` enum."""

from __future__ import annotations

import enum
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Tuple, Union

import torch

PyTree = Any
"""Nested ``tuple``/``list``/``dict``/namedtuple of tensors; ``None`` is an empty subtree."""

Axes = Union[int, Sequence[int]]
"""One output axis or several; negative values count from the end of each output leaf."""

VMapAxis = Optional[PyTree]
"""``None``, an ``int`` for every leaf, or a pytree of ``int``/``None`` matching a prefix of the data."""

VMapAxes = Union[str, VMapAxis, Tuple[VMapAxis, VMapAxis, Mapping[str, VMapAxis]]]
"""``"auto"`` (found per input structure, NOTE: [Found vmap_axes]), one :data:`VMapAxis` used for
inputs and outputs, or ``(in_axes, out_axes, kwargs_axes)``."""

ApplyFn = Callable[..., PyTree]
"""A functional model ``f(params, x, **kwargs) -> output pytree``."""

Model = Union[torch.nn.Module, ApplyFn]
"""What every kernel builder accepts: an ``nn.Module`` or an :data:`ApplyFn`."""


class NtkImplementation(enum.IntEnum):
    """How the empirical NTK is computed. Plain ints ``0``-``3`` are accepted everywhere.

    With ``N`` examples, ``O`` outputs per example, ``P`` parameters and ``F`` the cost of one
    forward pass on one example:

    * ``JACOBIAN_CONTRACTION`` (1): per-example Jacobians by reverse mode (``N O`` backward
      passes), then one contraction per parameter tensor, ``N1 N2 O1 O2 P`` multiply-adds for the
      full kernel and ``O`` times fewer when the output axis is traced. Best when ``O`` is small or
      the output axis is traced.
    * ``NTK_VECTOR_PRODUCTS`` (2): reverse mode over the ``x2`` outputs, then one forward-mode
      pass over the whole ``x1`` batch per ``x2`` output entry, ``~N1 N2 O2 F`` work, never
      contracting over ``P``. Best for the full kernel of models whose forward pass is cheap
      relative to their parameter count (wide MLPs, many outputs).
    * ``STRUCTURED_DERIVATIVES`` (3): the Jacobian of every op consuming a parameter is split into
      ``df/dy`` (``O`` backward sweeps that stop at the op's output) and a closed-form ``dy/dp``
      that is never formed; one planned contraction per pair of uses replaces the ``P``-sized
      one. For a width-``W`` dense layer that is ``N1 N2 O1 O2 W`` instead of ``N1 N2 O1 O2 W^2``.
      Best for dense, embedding and normalisation layers; convolutions cost about what 1 costs.
      Parameters consumed by ops without a rule fall back to Jacobian contraction.
    * ``AUTO`` (0): the cheapest of 1, 2, 3 for the input shapes by an analytic cost model, with a
      memory filter; the choice is cached per input shapes and reported by the kernel function's
      ``auto_choice``.
    """

    AUTO = 0
    JACOBIAN_CONTRACTION = 1
    NTK_VECTOR_PRODUCTS = 2
    STRUCTURED_DERIVATIVES = 3


def promoted(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """``torch.promote_types`` over ``dtypes`` (at least one), called only where two differ:
    each call is an ATen call, a dispatch on the host of every kernel call, for what is almost
    always one dtype."""
    found = iter(dtypes)
    result = next(found)
    for dtype in found:
        if dtype != result:
            result = torch.promote_types(result, dtype)
    return result
