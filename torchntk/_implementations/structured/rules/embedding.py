"""``F.embedding(i, W)``: the weight, with ``padding_idx``.

With the indices flattened into positions ``s`` and ``E[s, v] = [i[s] = v]`` (zero on rows whose
index is ``padding_idx``, which receive no gradient):

    J_W[v, c] = sum_s E[s, v] G[s, c]

so ``J_W1 . J_W2 = sum_{s,t} [i1[s] = i2[t]] <G1[s], G2[t]>``. ``max_norm`` renormalises the weight
in place and ``scale_grad_by_freq`` changes the gradient itself; both go to the Jacobian
fallback.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .._roles import Role, RuleCall
from ._common import bind
from ._registry import RefOf, rule

_NAMES = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
_DEFAULTS = {"padding_idx": None, "max_norm": None, "norm_type": 2.0, "scale_grad_by_freq": False, "sparse": False}


@rule(F.embedding)
def embedding_rule(func: Callable, args: tuple, kwargs: dict, ref_of: RefOf) -> Optional[RuleCall]:
    """A 2-D embedding table; declines ``max_norm`` and ``scale_grad_by_freq``."""
    indices, weight, padding_idx, max_norm, _, scale_grad_by_freq, _ = bind(args, kwargs, _NAMES, _DEFAULTS)
    weight_ref = ref_of(weight)
    if weight_ref is None or ref_of(indices) is not None or max_norm is not None or scale_grad_by_freq:
        return None
    if weight.ndim != 2:
        return None
    output = func(*args, **kwargs)
    rows, features = weight.shape
    positions = indices.numel()

    def build():
        flat = indices.reshape(positions)
        # a comparison, not F.one_hot, which has no vmap rule
        one_hot = (flat.unsqueeze(-1) == torch.arange(rows, device=flat.device)).to(weight.dtype)
        if padding_idx is not None:
            one_hot = one_hot * (flat != padding_idx % rows).unsqueeze(-1).to(weight.dtype)
        role = Role(
            (weight_ref,), "weight", (positions, features), "sc", [(one_hot, "sv")], "vc", (rows, features),
            local=lambda w: func(indices, _padding_row_constant(w, padding_idx), padding_idx), seen=weight,
        )
        return [role], None

    return RuleCall(output, build)


def _padding_row_constant(weight: torch.Tensor, padding_idx: Optional[int]) -> torch.Tensor:
    """The weight with its padding row cut from differentiation.

    Reverse mode gives the padding row no gradient, but forward mode lets its tangent through;
    detaching the row makes both modes agree with the kernel's definition (reverse mode).
    """
    if padding_idx is None:
        return weight
    keep = (torch.arange(weight.shape[0], device=weight.device) != padding_idx % weight.shape[0]).unsqueeze(-1)
    return torch.where(keep, weight, weight.detach())
