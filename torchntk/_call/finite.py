"""NaN and Inf in a call's outputs, explained by where they come from.

NOTE: [Non-finite kernels]
A kernel computed from NaN or infinite outputs is NaN or infinite, and a kernel function says
why instead of returning it: which input leaf, keyword argument or differentiated parameter holds
them, or that the model makes them. That is a promise of every checked call (any
``check_vmap_axes`` but False), not only of the first call of a key, whose checks look at the
outputs anyway: warm calls and replays of captured graphs make no whole-batch forward pass, so
they test the kernel instead (one reduction over it, and one synchronisation), and only a kernel
that is not finite pays for the explanation, a forward pass of each side without gradients. A
kernel that is not finite although the outputs are (a derivative that is NaN however it is
computed, ``sqrt`` at 0) is returned as it is, as on a first call. The converse, NaN outputs
whose derivatives are finite (``log`` of a negative number), makes a finite kernel: a first call
refuses it (its output check sees the outputs), a warm call returns it, since nothing it computes
is NaN.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Optional

import torch

from .._model.functional import FunctionalModel
from .._utils.checks import leaves_with_names, non_finite_count

__all__ = ["NonFiniteOutputs", "all_finite", "non_finite_outputs", "raise_for_non_finite_outputs"]


class NonFiniteOutputs(ValueError):
    """NaN or infinite outputs: no check of ``vmap_axes`` can tell anything from them, so the
    ``vmap_axes="auto"`` trial passes this error on instead of deciding against the axes."""


def all_finite(kernels: Iterable[Any]) -> bool:
    """Whether every tensor among ``kernels`` (tensors, or tuples of one block per parameter group)
    is finite, from the sum of its entries: one reduction per tensor and one synchronisation (a
    warm call of a small model is mostly host work). NaN and Inf always make the sum non-finite;
    a sum that overflows although every entry is finite only costs the explanation's forward
    pass, which then finds finite outputs and returns."""
    sums = []
    for kernel in kernels:
        for block in kernel if isinstance(kernel, tuple) else (kernel,):
            if isinstance(block, torch.Tensor) and (block.is_floating_point() or block.is_complex()):
                sums.append(block.sum())
    if not sums:
        return True
    total = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
    return math.isfinite(abs(total.item()))


def non_finite_outputs(
    where: str, model: FunctionalModel, side: Any, leaves: tuple[torch.Tensor, ...]
) -> Optional[NonFiniteOutputs]:
    """The error for the first output leaf of ``side`` (a ``Side``) that holds NaN or Inf, or None."""
    for index, leaf in enumerate(leaves):
        count = non_finite_count(leaf)
        if count:
            return NonFiniteOutputs(
                f"{where}: output leaf {index} for {side.name} holds {count} NaN or infinite "
                f"entr{'y' if count == 1 else 'ies'}, so its kernel would not be finite. "
                f"{_sources(model, side)}"
            )
    return None


def raise_for_non_finite_outputs(where: str, model: FunctionalModel, sides: Iterable[Any]) -> None:
    """Evaluates each side on its whole batch (no gradients) and raises :class:`NonFiniteOutputs`
    for the first output that holds NaN or Inf (NOTE: [Non-finite kernels]); a model that fails
    here raises nothing more than the kernel's own computation did."""
    for side in sides:
        try:
            with torch.no_grad():
                leaves = side.whole_batch()(model.params)
        except Exception:  # noqa: BLE001 - the explanation must not replace the kernel's result
            continue
        error = non_finite_outputs(where, model, side, tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor)))
        if error is not None:
            raise error


def _sources(model: FunctionalModel, side: Any) -> str:
    sources = []
    named = [(f"input {name}", leaf) for name, leaf in leaves_with_names(side.x.rebuild(side.x.leaves), side.name)]
    for key, flat in side.kwargs.items():
        named += leaves_with_names(flat.rebuild(flat.leaves), f"keyword argument {key!r}")
    for name, leaf in named:
        count = non_finite_count(leaf) if isinstance(leaf, torch.Tensor) else 0
        if count:
            sources.append(f"{name} ({count} entr{'y' if count == 1 else 'ies'})")
    for name, param in zip(model.names, model.params):
        count = non_finite_count(param)
        if count:
            sources.append(f"parameter {name!r} ({count} entr{'y' if count == 1 else 'ies'})")
    if sources:
        return f"They come from NaN/Inf in {', '.join(sources)}: remove them."
    return (
        "No input, keyword argument or differentiated parameter holds NaN/Inf: the model creates them "
        "(log or sqrt of a negative number, division by zero, overflow, ...) or a frozen parameter or "
        "buffer holds them."
    )
