"""One table of the three NTK implementations, behind one small protocol, and AUTO's policy over it.

NOTE: [The implementation table]
Implementations 1, 2 and 3 compute; AUTO (0) is not one of them but a cost policy that picks one
(:class:`~torchntk._implementations.auto.AutoSelector`, built over the table: :func:`policy`).
Every implementation answers three questions about a validated
:class:`~torchntk._call.kernel_call.KernelCall` (``scope`` is the record of the call's key, where
an implementation keeps what it derived for later calls with the key, NOTE: [One record per key]
in ``_plan/scope.py``; None: nothing is kept):

* ``kernels(call, scope)``: one unnormalised kernel per output leaf (see :meth:`KernelCall.normalise`);
* ``blocks(call, scope, block)``: the same computation as a
  :class:`~torchntk._call.blocks.BlockPlan`, for ``chunk_size`` and ``batch`` (``block`` is the
  block size);
* ``choice(call, scope)``: the :class:`~torchntk.AutoChoice` reported by ``ntk_fn.auto_choice``.

With parameter groups (``call.groups``, NOTE: [Parameter groups] in ``_call/groups.py``) every kernel or
block of an output leaf is a tuple of one per group; AUTO passes the call on unchanged.

AUTO answers ``choice`` and ``blocks`` the same way (``choice`` within a memory budget too) and
plans the call's memory (:func:`memory_plan`); the kernel is then computed by the implementation
it picked. Nothing here holds state: structured derivatives (3) keep their plan, and AUTO its
choice, in the key's record. A table differs between kernel functions by 3's options only.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch

from .._call.blocks import BlockPlan
from .._call.kernel_call import KernelCall
from .._utils.types import NtkImplementation
from .auto import AutoSelector
from .choice import AutoChoice
from .jacobian_contraction import jacobian_contraction_blocks, jacobian_contraction_ntk
from .._plan.scope import Scope
from .memory import MemoryPlan, fitted_plan, result_refusal
from .ntk_vector_products import ntk_vector_products_blocks, ntk_vector_products_ntk
from .structured import StructuredDerivatives, StructuredOptions


class Implementation(Protocol):
    """See NOTE: [The implementation table]."""

    def kernels(self, call: KernelCall, scope: Optional[Scope]) -> list[torch.Tensor]: ...

    def blocks(self, call: KernelCall, scope: Optional[Scope], block: Optional[tuple] = None) -> BlockPlan: ...

    def choice(self, call: KernelCall, scope: Optional[Scope]) -> AutoChoice: ...


@dataclass(frozen=True)
class _Stateless:
    """Implementations 1 and 2: functions of the call alone."""

    implementation: NtkImplementation
    compute: Callable[[KernelCall], list[torch.Tensor]]
    plan: Callable[[KernelCall], BlockPlan]

    def kernels(self, call: KernelCall, scope: Optional[Scope]) -> list[torch.Tensor]:
        return self.compute(call)

    def blocks(self, call: KernelCall, scope: Optional[Scope], block: Optional[tuple] = None) -> BlockPlan:
        return dataclasses.replace(self.plan(call), implementation=self.implementation)

    def choice(self, call: KernelCall, scope: Optional[Scope]) -> AutoChoice:
        return AutoChoice(self.implementation)


JACOBIAN_CONTRACTION = _Stateless(
    NtkImplementation.JACOBIAN_CONTRACTION, jacobian_contraction_ntk, jacobian_contraction_blocks
)
NTK_VECTOR_PRODUCTS = _Stateless(
    NtkImplementation.NTK_VECTOR_PRODUCTS, ntk_vector_products_ntk, ntk_vector_products_blocks
)


def implementation_table(options: StructuredOptions) -> dict[NtkImplementation, Any]:
    """Implementations 1, 2 and 3 for one kernel function; ``options`` configure structured
    derivatives (AUTO prices and uses the same entry, so a plan made to price 3 is reused)."""
    return {
        NtkImplementation.JACOBIAN_CONTRACTION: JACOBIAN_CONTRACTION,
        NtkImplementation.NTK_VECTOR_PRODUCTS: NTK_VECTOR_PRODUCTS,
        NtkImplementation.STRUCTURED_DERIVATIVES: StructuredDerivatives(options),
    }


def policy(table: dict[NtkImplementation, Any], implementation: NtkImplementation) -> Any:
    """What answers ``choice`` and ``blocks`` for ``implementation``: its entry of ``table``, or for
    AUTO its cost policy over the table (stateless, so made on demand)."""
    return AutoSelector(table) if implementation == NtkImplementation.AUTO else table[implementation]


def memory_plan(
    table: dict[NtkImplementation, Any], implementation: NtkImplementation, call: KernelCall,
    scope: Optional[Scope], budget: float,
) -> MemoryPlan:
    """How ``call`` runs within ``budget`` bytes with ``implementation`` of ``table`` (AUTO: the
    implementation and ``chunk_size`` it picks). See NOTE: [Memory plans].

    Raises:
        KernelMemoryError: the result alone, or the smallest plan, exceeds the budget (before
            anything is computed).
    """
    if implementation == NtkImplementation.AUTO:
        refusal = result_refusal(call, budget) if math.isfinite(budget) else None
        if refusal is not None:  # before choosing, which probes the model
            raise refusal
        return AutoSelector(table).plan(call, scope, budget)
    structured = None
    if implementation == NtkImplementation.STRUCTURED_DERIVATIVES and math.isfinite(budget):
        structured = table[implementation].plan(call, scope)
    return fitted_plan(call, scope, implementation, budget, structured)
