"""What the batcher and Monte Carlo need to know about a kernel function of this library.

Every builder in ``empirical.py`` attaches a :class:`KernelFnSpec` to the function it returns
(attribute ``_torchntk_spec``): the call signature, the axes that decide where the batch axis
lands in the kernel, and how to build the same kernel function around another copy of the model
(one per device, because ``torch.func.functional_call`` swaps a module's tensors while it runs,
so two threads must never share a module).
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
            one block at a time.
    """

    kind: str
    f: Model
    trace_axes: tuple[int, ...]
    diagonal_axes: tuple[int, ...]
    rebuild: Callable[[Model], Callable[..., Any]]
    thread_safe: bool = True

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
