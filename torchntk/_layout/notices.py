"""Notices about outputs whose kernel the user probably did not mean.

NOTE: [Output notices]
Two layouts are legal but are seldom what a user asked for, and each gets a :class:`OutputWarning`
once per kernel function, attributed to the user's line:

* traced examples: an output with one entry per example, ``(N,)`` (a regression head ending in
  ``.squeeze(-1)``), under the default ``trace_axes=(-1,)``: its last axis is the examples' axis,
  so the kernel is one number (the mean over ``n`` of the kernel between example ``n`` of x1 and
  example ``n`` of x2: neural-tangents' semantics), not an ``(N1, N2)`` matrix. The examples' axis
  is known exactly where ``vmap_axes`` (given or found) maps the examples: its out axis. Without
  them, an output of one axis whose size is x1's number of examples (the leading size its tensor
  leaves share) is taken for one. Only a negative entry of ``trace_axes`` landing on the
  examples' axis warns: ``trace_axes=(0,)`` names that axis on purpose and is left alone;
* large outputs: several output leaves holding more than :data:`LARGE_OUTPUT_ENTRIES` entries per
  example in all (Hugging Face's ``BertModel`` returns its last hidden state beside the pooled
  output, and every leaf's Jacobian is computed), or more than :data:`LARGE_OUTPUT_ENTRIES`
  coordinates per example left after tracing (the kernel holds the square of that per pair of
  examples). Not given when ``output_fn`` already selects what the kernel is taken of. 10 or 1000
  logits, traced or not, stay below both.
"""

from __future__ import annotations

import math
import threading
import warnings
from typing import Any, Optional, Sequence

import torch

from .._utils.checks import leaves_with_names, user_stacklevel
from .._utils.tree import Flat
from .kernel_layout import KernelLayout

LARGE_OUTPUT_ENTRIES = 1000
"""Output entries per example above which a kernel function says how to select fewer (NOTE:
[Output notices]); ImageNet's 1000 logits, even with ``trace_axes=()``, do not exceed it."""


class OutputWarning(UserWarning):
    """A kernel function's output is probably not what was meant: the default trace over the
    examples of an ``(N,)`` output, or outputs far larger than a kernel usually needs. Given once
    per kernel function.

    Silence it with ``warnings.filterwarnings("ignore", category=torchntk.OutputWarning)``.
    """


class OutputNotices:
    """A kernel function's notices about its outputs (NOTE: [Output notices]), each given once."""

    def __init__(self) -> None:
        self._given: set[str] = set()
        self._lock = threading.Lock()

    def _first(self, notice: str) -> bool:
        with self._lock:
            if notice in self._given:
                return False
            self._given.add(notice)
            return True

    def give(self, notices: Sequence[tuple[str, str]]) -> None:
        """Warns each of ``notices`` (``(kind, message)``, from :func:`found_notices`) that this
        kernel function has not given yet: on a first call, and on the first call of a kernel
        function bound to plans another one made (NOTE: [Plans shared by kernel functions])."""
        for kind, message in notices:
            if self._first(kind):
                _warn(message)


def found_notices(
    output: Flat, layouts: Sequence[KernelLayout], out_axes: Optional[Sequence[int]], x1: Any,
    trace_axes: tuple[int, ...], selected: bool, where: str,
) -> tuple[tuple[str, str], ...]:
    """The notices of NOTE: [Output notices] that the layouts of ``output`` (x1's output) call for,
    as ``(kind, message)``.

    ``out_axes``: the examples' axis of every output leaf where ``vmap_axes`` maps the examples,
    else None. ``trace_axes``: as the user gave them. ``selected``: ``output_fn`` was given.
    """
    found = []
    leaves = output.leaves
    names = _leaf_names(output)
    examples_axes = [
        _examples_axis(leaf, None if out_axes is None else out_axes[index], x1) for index, leaf in enumerate(leaves)
    ]
    for leaf, name, layout, axis in zip(leaves, names, layouts, examples_axes):
        if axis is None or layout.kind(axis) != "trace":
            continue
        if not any(entry < 0 and entry % leaf.ndim == axis for entry in trace_axes):
            continue  # the examples' axis named by its index: on purpose
        found.append(("traced examples", _traced_examples_message(name, tuple(leaf.shape), axis, trace_axes, where)))
        break
    if selected:
        return tuple(found)
    entries = kept = 0
    for leaf, layout, examples in zip(leaves, layouts, _leading(leaves, out_axes)):
        sizes = [(axis, size) for axis, size in enumerate(leaf.shape) if axis != examples]
        entries += math.prod(size for _, size in sizes)
        kept += math.prod(size for axis, size in sizes if layout.kind(axis) != "trace")
    several = len(leaves) > 1 and entries > LARGE_OUTPUT_ENTRIES
    if several or kept > LARGE_OUTPUT_ENTRIES:
        found.append(("large outputs", _large_outputs_message(names, leaves, entries, kept, several, where)))
    return tuple(found)


def _warn(message: str) -> None:
    warnings.warn(message, OutputWarning, stacklevel=user_stacklevel())


def _leaf_names(output: Flat) -> list[str]:
    named = [name for name, leaf in leaves_with_names(output.rebuild(output.leaves), "output")
             if isinstance(leaf, torch.Tensor)]
    if len(named) != len(output.leaves):
        return [f"output leaf {index}" for index in range(len(output.leaves))]
    return ["the output" if name == "output" else name for name in named]


def _examples_axis(leaf: torch.Tensor, out_axis: Optional[int], x1: Any) -> Optional[int]:
    """The examples' axis of an output leaf: its out axis under ``vmap_axes``; without them, axis 0
    of a one-axis output whose size is x1's number of examples; else None (not known)."""
    if out_axis is not None:
        return out_axis % leaf.ndim if leaf.ndim else None
    if leaf.ndim != 1:
        return None
    sizes = {value.shape[0] for value in Flat.of(x1).leaves if isinstance(value, torch.Tensor) and value.ndim}
    return 0 if sizes == {leaf.shape[0]} else None


def _leading(leaves: Sequence[torch.Tensor], out_axes: Optional[Sequence[int]]) -> list[Optional[int]]:
    """The axis counted as the examples' when sizing outputs: the out axis, else the leading one."""
    if out_axes is not None:
        return [axis % leaf.ndim if leaf.ndim else None for leaf, axis in zip(leaves, out_axes)]
    return [0 if leaf.ndim else None for leaf in leaves]


def _traced_examples_message(name: str, shape: tuple[int, ...], axis: int, trace_axes: tuple[int, ...], where: str) -> str:
    if len(shape) == 1:
        held, result = "one entry per example", "is one number"
    else:
        held, result = f"its examples on axis {axis}", "has no axes of examples"
    return (
        f"{where}: {name} has shape {shape}, {held}, and `trace_axes`={trace_axes} traces axis {axis}, the "
        f"examples' axis: the kernel {result} (the mean over n of the kernel between example n of x1 and "
        f"example n of x2, as neural-tangents defines it), not a matrix over pairs of examples. For the "
        f"(N1, N2) kernel pass trace_axes=(), or keep a trailing output axis (shape (N, 1): no .squeeze(-1)). "
        f"To mean the trace over the examples, pass trace_axes=({axis},), which is not warned about. Shown "
        f"once per kernel function."
    )


def _large_outputs_message(
    names: list[str], leaves: Sequence[torch.Tensor], entries: int, kept: int, several: bool, where: str
) -> str:
    if several:
        listing = ", ".join(f"{name} {tuple(leaf.shape)}" for name, leaf in zip(names[:6], leaves[:6]))
        more = f" and {len(leaves) - 6} more" if len(leaves) > 6 else ""
        what = (
            f"the model returns {len(leaves)} output leaves ({listing}{more}), {entries} entries per example in "
            f"all, and a kernel is computed for every one"
        )
    else:
        what = (
            f"each example keeps {kept} output coordinates after `trace_axes`, so the kernel holds {kept}x{kept} "
            f"entries per pair of examples"
        )
    return (
        f"{where}: {what}, which costs time and memory in proportion. If you meant one output, select it "
        f"with output_fn, e.g. output_fn=lambda o: o.pooler_output (a Hugging Face model's pooled output) or "
        f"the logits of a head; or trace more axes with `trace_axes`. Shown once per kernel function "
        f"(more than {LARGE_OUTPUT_ENTRIES} entries per example)."
    )
