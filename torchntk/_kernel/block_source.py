"""A kernel function's work split into prepared spans of examples, for ``batch``.

NOTE: [Prepared spans]
Calling a kernel function once per block repeats, for every block, the per-example work of both
of its runs (Jacobians, structured factors: ``N1/b + N2/b`` times too often) and a fixed cost of
a few milliseconds (checks, plan, ``vmap`` set-up). With ``vmap_axes`` a kernel function can do
better: its implementation's :class:`~torchntk._call.blocks.BlockPlan` prepares a run of examples
once and contracts any two prepared runs. A :class:`BlockSource` wraps one validated call of the
kernel function on all of x1 and x2 and exposes exactly that: ``prepare`` a span of one side,
``contract`` two prepared spans into the kernel function's result for those examples
(normalised, with the NNGP too when ``get`` asks for it); :func:`open_blocks` makes one from a
kernel function's settings. ``batch`` decides the spans, caches prepared spans of x2 and writes
the results.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree

from .._call.blocks import BlockPlan
from .._call.finite import all_finite, raise_for_non_finite_outputs
from .._call.kernel_call import KernelCall
from .._call.outputs import combine
from .._call.per_example import Side
from .._implementations import policy
from .._implementations.memory import modelled_peak
from .._implementations.nngp import nngp
from .._implementations.structured import constant_of_inputs
from .._layout.kernel_layout import KernelLayout
from .._plan import input_shape_key
from .._utils.types import NtkImplementation
from .preparation import trial

if TYPE_CHECKING:
    from .settings import NtkSettings

FORWARD_RUN = 256
"""Examples per whole-batch forward pass of a batched call (``open_blocks``), at least the block
size. A forward pass without gradients holds a small part of what an example's derivatives
need, so runs this long bound memory without paying a model call per small block (32 calls of
16 examples cost 10 ms more than 2 of 256 on the benchmark MLP)."""


@dataclass
class Prepared:
    """One side's prepared span: ``run = (start, length)`` of its examples and the plan's data."""

    side: int
    run: tuple[int, int]
    data: Any
    nbytes: int


@dataclass
class BlockSource:
    """One kernel function call on every example, ready to be computed span by span.

    Attributes:
        call: the validated call on all of x1 and x2 (its sides are mapped by ``vmap_axes``).
        plan: the NTK implementation's block plan; ``None`` when only the NNGP is asked for.
        names, bare: the kernels in the result and whether it is one bare kernel (see ``get``).
        thread_safe: whether two threads may prepare or contract at once (see
            ``KernelFnSpec.thread_safe``).
        span_memory: ``length -> bytes``: the memory model's peak of preparing and contracting a
            pair of spans of ``length`` examples (NOTE: [Memory plans]); None where unknown.
        explains_non_finite: a block that is not finite is explained by NaN/Inf outputs, as the
            kernel function's own calls are (NOTE: [Non-finite kernels]).
    """

    call: KernelCall
    plan: Optional[BlockPlan]
    names: tuple[str, ...]
    bare: bool
    thread_safe: bool
    span_memory: Optional[Callable[[int], float]] = None
    explains_non_finite: bool = False

    @property
    def reuses_x1(self) -> bool:
        return self.call.side2 is None

    def sizes(self) -> tuple[int, int]:
        n1 = self.call.side1.batch_size()
        return n1, n1 if self.call.side2 is None else self.call.side2.batch_size()

    def reuses_prepared(self) -> bool:
        """Whether a prepared x1 span serves as the same span of x2 (x2 None, same preparation)."""
        return self.reuses_x1 and (self.plan is None or self.plan.reuse_prepared)

    def prepare(self, side: int, run: tuple[int, int]) -> Prepared:
        """Prepares examples ``run = (start, length)`` of x1 (``side=1``) or x2 (``side=2``)."""
        call = self.call
        whole = call.side1 if side == 1 or call.side2 is None else call.side2
        narrowed = whole.narrow(*run)
        data = None
        if self.plan is not None:
            data = (self.plan.prepare1 if side == 1 else self.plan.prepare2)(narrowed)
        return Prepared(side, run, data, nbytes(data))

    def contract(self, first: Prepared, second: Prepared) -> Any:
        """The kernel function's result for x1 examples ``first.run`` and x2 examples ``second.run``.

        Passing the same :class:`Prepared` twice (x2 None) computes the run against itself.
        """
        same = first is second or (self.reuses_x1 and first.run == second.run)
        block = self.call.narrow(first.run, None if same else second.run)
        kernels = {}
        if "nngp" in self.names:
            kernels["nngp"] = block.normalise(self._explained(block, nngp(block)), dtypes=self.call.output_dtypes)
        if "ntk" in self.names:
            needed = [True] * len(block.layouts)
            ntk = block.normalise(self._explained(block, self.plan.contract(first.data, second.data, needed)))
            if self.plan.implementation == NtkImplementation.STRUCTURED_DERIVATIVES:
                ntk = constant_of_inputs(block, ntk)  # NOTE: [Kernels that are constants of the inputs]
            kernels["ntk"] = ntk
        return combine(kernels, self.names, self.bare)

    def _explained(self, block: KernelCall, kernels: list) -> list:
        """``kernels`` of ``block``, after NOTE: [Non-finite kernels]'s test where it applies."""
        if self.explains_non_finite and not all_finite(kernels):
            raise_for_non_finite_outputs(block.where, block.model, (block.side1, block.side2 or block.side1))
        return kernels

    def leaf_layouts(self) -> list[tuple[KernelLayout, int]]:
        """The layout and batch axis of every leaf of a result, in ``pytree`` leaf order."""
        per_output = list(zip(self.call.layouts, self.call.side1.out_axes))
        kernels = sum(self.call.kernels_of(name) for name in (self.names[:1] if self.bare else self.names))
        return [entry for entry in per_output for _ in range(kernels)]


@dataclass(frozen=True)
class BlockRequest:
    """How ``batch`` asks a kernel function for a :class:`BlockSource`.

    Attributes:
        block_size: examples per block (``None``: one block). The model's whole-batch forward
            passes run on runs this long, and AUTO chooses for blocks of this size.
    """

    block_size: Optional[int]


def nbytes(data: Any) -> int:
    """Bytes held by the tensors in ``data`` (pytrees, dataclasses and lists of them)."""
    if isinstance(data, torch.Tensor):
        return data.numel() * data.element_size()
    if isinstance(data, Side):  # inputs only: the parameters are not the run's
        return nbytes(data.x.leaves) + sum(nbytes(flat.leaves) for flat in data.kwargs.values())
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return sum(nbytes(getattr(data, field.name)) for field in dataclasses.fields(data))
    leaves = pytree.tree_leaves(data)
    if len(leaves) == 1 and leaves[0] is data:
        return 0
    return sum(nbytes(leaf) for leaf in leaves)


def open_blocks(
    settings: NtkSettings, request: BlockRequest, x1: Any, x2: Any, params: Any, kwargs: dict, *,
    names: tuple[str, ...], bare: bool, where: str,
) -> Optional[BlockSource]:
    """The call as a :class:`BlockSource` for ``batch``, or None without ``vmap_axes`` (see
    NOTE: [Prepared spans]); the NNGP's forward passes are mapped by ``vmap_axes`` too."""
    forward_runs = None if request.block_size is None else max(request.block_size, FORWARD_RUN)
    shape_key = input_shape_key(x1, x2, params, kwargs)
    if settings.finds_axes:  # NOTE: [Found vmap_axes]: the key's first call decides them
        found = settings.found(x1, x2, params, kwargs, shape_key)
        if found is settings:  # only the trial: without axes, batch computes block by block
            key = settings.key_of(shape_key)
            options = dict(
                for_ntk=True, computes_ntk="ntk" in names, forward_run_length=forward_runs, shape_key=key,
                needs_outputs="nngp" in names, admit=False, caller=None,
            )
            trial(settings, key, x1, x2, params, kwargs, where, options)
            found = settings.found(x1, x2, params, kwargs, shape_key)
        return found.open_blocks(request, x1, x2, params, kwargs, names=names, bare=bare, where=where)
    if not settings.maps_examples:
        return None  # before any forward pass: without vmap_axes the model sees whole batches
    call = settings.prepare(
        x1, x2, params, kwargs, where, computes_ntk="ntk" in names, forward_run_length=forward_runs,
        shape_key=shape_key, needs_outputs="nngp" in names,  # the NTK's spans read output shapes only
    )
    if not call.side1.mapped:
        return None
    plan = None
    spans = settings.planner.scope(call.plan_key, "blocks")  # planned apart from whole calls
    if "ntk" in names:
        n1 = call.side1.batch_size()
        n2 = n1 if call.reuses_x1 else call.side2.batch_size()
        block = (min(n1, request.block_size or n1), min(n2, request.block_size or n2))
        plan = policy(settings.table, settings.implementation).blocks(call, spans, block)
    span_memory = None
    if plan is not None and plan.implementation is not None:
        implementation, structured = plan.implementation, plan.structured

        def span_memory(length: int) -> float:
            """NOTE: [Memory plans]: two spans of ``length`` prepared and contracted (no result)."""
            peak = modelled_peak(call, spans, implementation, length, structured, cut=True)
            return peak.derivatives

    return BlockSource(
        call, plan, names, bare=bare, thread_safe=settings.thread_safe, span_memory=span_memory,
        explains_non_finite=settings.check_vmap_axes is not False,
    )
