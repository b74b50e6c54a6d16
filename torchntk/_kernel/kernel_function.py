"""The object every builder returns: :class:`KernelFunction`.

A kernel function is called like a function (``ntk_fn(x1, x2, params, **kwargs)``) and carries
what ``batch``, Monte Carlo and ``torch.distributed`` need about it, in its :class:`KernelFnSpec`:
the call signature, the axes that decide where the batch axis lands in the kernel, the block
source of NOTE: [Prepared spans], and how to build the same kernel function around a copy of the
model on another device (a replica, refreshed by :func:`sync_replica` and rebuilt when
``_fingerprint.structure_fingerprint`` changes).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch

from .._utils.precision import kernel_precision
from .._utils.quiet_warnings import known_warnings_silenced
from .._utils.types import Model


@dataclass(frozen=True)
class KernelFnSpec:
    """What a kernel function is, for the code that tiles, replicates or distributes it.

    Attributes:
        kind: ``"ntk"``, ``"nngp"`` or ``"kernel"`` (the last takes ``get`` after ``x2``).
        f: the model the kernel function was built for.
        trace_axes, diagonal_axes: as given to the builder.
        rebuild: ``rebuild(model) -> kernel_fn`` with every other builder argument unchanged.
        thread_safe: whether blocks may run in several threads at once. Forward-mode AD keeps its
            nesting level in a process-wide variable (``torch.autograd.forward_ad``), so kernel
            functions that may use it (NTK-vector products, AUTO, op-local forward Jacobians) run
            one block at a time (NOTE: [Threads] in ``_utils/threads.py``).
        open_blocks: ``open_blocks(request, x1, x2, *args, **kwargs)`` with the kernel function's
            arguments returns a :class:`~torchntk._kernel.block_source.BlockSource` for the call, or None
            where the call cannot be split into prepared spans (no ``vmap_axes``); ``None`` for
            kernel functions that never can. See NOTE: [Prepared spans].
        within: ``within(caller)`` is the kernel function planning within the budget of ``caller``
            (a ``CallerPlan``; NOTE: [Budgets of callers] in ``_memory/budget.py``): called like
            the kernel function, it returns ``NEEDS_BLOCKS`` without computing anything where
            ``caller.chunking`` is False and the call would need blocks; None for kernel functions
            that plan no memory (they are called as they are).
        options: the builder's keyword arguments besides the model and the axes above (for the
            empirical builders, ``NtkOptions``' fields as given), so that a progress record can
            tell two problems apart (NOTE: [Kernels on disk] in ``batching/_disk.py``); None where
            the builder does not say (such records cover the kind, the axes and the model only).
    """

    kind: str
    f: Model
    trace_axes: tuple[int, ...]
    diagonal_axes: tuple[int, ...]
    rebuild: Callable[[Model], Callable[..., Any]]
    thread_safe: bool = True
    open_blocks: Optional[Callable[..., Any]] = None
    options: Optional[Mapping[str, Any]] = None
    within: Optional[Callable[[Any], Callable[..., Any]]] = None

    def replicate(self, device: torch.device) -> Callable[..., Any]:
        """The kernel function around a private copy of a module on ``device``.

        Functional models are shared (they must be thread-safe; their parameters arrive with
        each call and are moved to the device by the caller).
        """
        if not isinstance(self.f, torch.nn.Module):
            return self.rebuild(self.f)
        return self.rebuild(copy.deepcopy(self.f).to(device))


class KernelFunction:
    """A kernel function built by torchntk (``empirical_ntk_fn``, ``batch``, ...).

    Call it as its builder's documentation says (``help(kernel_fn)`` shows that signature).

    Attributes:
        spec: the ``KernelFnSpec`` behind it (what `batch` and replicas need).

    Example:
        >>> import torch, torchntk
        >>> ntk_fn = torchntk.empirical_ntk_fn(torch.nn.Linear(3, 2), vmap_axes=0, implementation=1)
        >>> isinstance(ntk_fn, torchntk.KernelFunction), ntk_fn(torch.randn(4, 3)).shape
        (True, torch.Size([4, 4]))
        >>> ntk_fn.auto_choice(torch.randn(4, 3)).implementation
        <NtkImplementation.JACOBIAN_CONTRACTION: 1>
    """

    def __init__(
        self, function: Callable[..., Any], spec: KernelFnSpec, doc: str,
        auto_choice: Optional[Callable[..., Any]] = None,
    ):
        self._function = function
        self._auto_choice = auto_choice
        self.spec = spec
        self.__doc__ = doc

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with kernel_precision(), known_warnings_silenced():  # NOTE: [Kernel precision], [Known PyTorch warnings]
            return self._function(*args, **kwargs)

    def auto_choice(self, *args: Any, **kwargs: Any) -> Any:
        """The implementation used for these inputs, as an :class:`~torchntk.AutoChoice`.

        Takes the arguments of the kernel function (without ``get``) and computes no kernel. With
        ``implementation=0`` (AUTO) the choice is made from the cost model once per input shapes
        and cached; its ``estimates`` give the FLOPs and memory estimated for each candidate. With
        a fixed implementation it reports that one.

        Raises:
            TypeError: the kernel function computes no NTK (``empirical_nngp_fn``, ``batch``).
        """
        if self._auto_choice is None:
            raise TypeError(
                f"auto_choice: this {self.spec.kind!r} kernel function chooses no NTK implementation "
                f"(empirical_nngp_fn computes no NTK; ask the kernel function given to `batch`)."
            )
        with known_warnings_silenced():  # NOTE: [Known PyTorch warnings]
            return self._auto_choice(*args, **kwargs)

    def replicate(self, device: torch.device) -> "KernelFunction":
        """The same kernel function around a private copy of the module on ``device``."""
        return self.spec.replicate(device)

    def __repr__(self) -> str:
        return f"<torchntk {self.spec.kind} kernel function of {type(self.spec.f).__name__}>"


def spec_of(kernel_fn: Any) -> Optional[KernelFnSpec]:
    """The spec of a :class:`KernelFunction`, None for anything else."""
    return kernel_fn.spec if isinstance(kernel_fn, KernelFunction) else None


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
