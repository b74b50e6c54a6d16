"""The table from :class:`~torchntk.NtkImplementation` to the function computing the NTK.

Each entry takes a validated :class:`~torchntk._call.KernelCall` and returns one unnormalised
kernel per output leaf (see :meth:`KernelCall.normalise`). Structured derivatives (3) carry
options and a plan cache per kernel function, so ``empirical.py`` adds them per builder
(``structured.StructuredDerivatives``); AUTO (0) is ``auto.AutoSelector``.
"""

from __future__ import annotations

from typing import Callable

import torch

from .._blocks import BlockPlan
from .._call import KernelCall
from .._types import NtkImplementation
from .jacobian_contraction import jacobian_contraction_blocks, jacobian_contraction_ntk
from .ntk_vector_products import ntk_vector_products_blocks, ntk_vector_products_ntk

NtkFunction = Callable[[KernelCall], list[torch.Tensor]]

IMPLEMENTATIONS: dict[NtkImplementation, NtkFunction] = {
    NtkImplementation.JACOBIAN_CONTRACTION: jacobian_contraction_ntk,
    NtkImplementation.NTK_VECTOR_PRODUCTS: ntk_vector_products_ntk,
}

BLOCK_PLANS: dict[NtkImplementation, Callable[[KernelCall], BlockPlan]] = {
    NtkImplementation.JACOBIAN_CONTRACTION: jacobian_contraction_blocks,
    NtkImplementation.NTK_VECTOR_PRODUCTS: ntk_vector_products_blocks,
}
"""The same implementations as :class:`~torchntk._blocks.BlockPlan` s, for ``batch``."""
