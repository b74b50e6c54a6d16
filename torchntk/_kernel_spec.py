"""What the batcher and Monte Carlo need to know about a kernel function of this library.

Every builder in ``empirical.py`` attaches a :class:`KernelFnSpec` to the function it returns
(attribute ``_torchntk_spec``): the call signature, the axes that decide where the batch axis
lands in the kernel, and how to build the same kernel function around a copy of the model on
another device (a replica, refreshed by :func:`sync_replica` and rebuilt when
``_fingerprint.structure_fingerprint`` changes).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ._types import Model

SPEC_ATTRIBUTE = "_torchntk_spec"


@dataclass(frozen=True)
class KernelFnSpec:
    """Attributes:
        kind: ``"ntk"``, ``"nngp"`` or ``"kernel"`` (the last takes ``get`` after ``x2``).
        f: the model the kernel function was built for.
        trace_axes, diagonal_axes: as given to the builder.
        batch_axis_mapped: whether ``vmap_axes`` maps a batch axis (only axis 0 can be batched).
        rebuild: ``rebuild(model) -> kernel_fn`` with every other builder argument unchanged.
        thread_safe: whether blocks may run in several threads at once. Forward-mode AD keeps its
            nesting level in a process-wide variable (``torch.autograd.forward_ad``), so kernel
            functions that may use it (NTK-vector products, AUTO, op-local forward Jacobians) run
            one block at a time (NOTE: [Threads] in ``_threads.py``).
        open_blocks: ``open_blocks(request, x1, x2, *args, **kwargs)`` with the kernel function's
            arguments returns a :class:`~torchntk._block_source.BlockSource` for the call, or None
            where the call cannot be split into prepared spans (no ``vmap_axes``); ``None`` for
            kernel functions that never can. See NOTE: [Prepared spans].
    """

    kind: str
    f: Model
    trace_axes: tuple[int, ...]
    diagonal_axes: tuple[int, ...]
    rebuild: Callable[[Model], Callable[..., Any]]
    thread_safe: bool = True
    open_blocks: Optional[Callable[..., Any]] = None

    def replicate(self, device: torch.device) -> Callable[..., Any]:
        """The kernel function around a private copy of a module on ``device``.

        Functional models are shared (they must be thread-safe; their parameters arrive with
        each call and are moved to the device by the caller).
        """
        if not isinstance(self.f, torch.nn.Module):
            return self.rebuild(self.f)
        return self.rebuild(copy.deepcopy(self.f).to(device))


def spec_of(kernel_fn: Any) -> Optional[KernelFnSpec]:
    return getattr(kernel_fn, SPEC_ATTRIBUTE, None)


def attach(kernel_fn: Callable[..., Any], spec: KernelFnSpec) -> Callable[..., Any]:
    setattr(kernel_fn, SPEC_ATTRIBUTE, spec)
    return kernel_fn


def sync_replica(original: Model, replica: Model) -> bool:
    """Copies a module's parameters, buffers, ``requires_grad`` flags and train/eval modes into its
    replica; returns False (copying nothing) when their structure, shapes or dtypes differ."""
    if not isinstance(original, torch.nn.Module):
        return original is replica
    pairs = []
    for named in ("named_parameters", "named_buffers"):
        mine, theirs = list(getattr(original, named)()), list(getattr(replica, named)())
        if [name for name, _ in mine] != [name for name, _ in theirs]:
            return False
        pairs += [(a, b) for (_, a), (_, b) in zip(mine, theirs)]
    originals, copies = list(original.modules()), list(replica.modules())
    if len(originals) != len(copies):
        return False
    if any(a.shape != b.shape or a.dtype != b.dtype for a, b in pairs):
        return False
    with torch.no_grad():
        for source, target in pairs:
            target.copy_(source)
            if isinstance(target, torch.nn.Parameter):
                target.requires_grad_(source.requires_grad)
    for source, target in zip(originals, copies):
        target.training = source.training
    return True
