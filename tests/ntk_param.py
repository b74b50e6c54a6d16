"""An NTK-parameterised one-hidden-layer ReLU network and its infinite-width NNGP and NTK.

The network (neural-tangents' ``stax.serial(Dense(width, W_std1, b_std1), Relu(), Dense(k,
W_std2, b_std2))``, every weight and bias drawn from N(0, 1)):

    h = W_std1 * W1 x / sqrt(d) + b_std1 * b1        (no b1 term when b_std1 is None)
    y = W_std2 * W2 relu(h) / sqrt(width) + b_std2 * b2

Derivation of the kernels (each logit has the same kernel; traced kernels average over logits):

* Every hidden pre-activation ``(h_j(x), h_j(x'))`` is a centred Gaussian pair with covariance
  ``K0(x, x') = W_std1^2 <x, x'> / d + b_std1^2``.
* For a centred Gaussian pair ``(u, v)`` with variances ``k11, k22``, covariance ``k12`` and angle
  ``theta = arccos(k12 / sqrt(k11 k22))``, the order-1 and order-0 arc-cosine expectations are
  ``E[relu(u) relu(v)] = (sqrt(k11 k22 - k12^2) + (pi - theta) k12) / (2 pi)``
  (equivalently ``sqrt(k11 k22) (sin theta + (pi - theta) cos theta) / (2 pi)``) and
  ``E[relu'(u) relu'(v)] = (pi - theta) / (2 pi)``.
* NNGP: ``E[y(x) y(x')] = W_std2^2 E[relu(h) relu(h')] + b_std2^2`` (the 1/width sum over units
  of i.i.d. terms has this mean at every width).
* NTK: the W2 and b2 gradients give the NNGP again; the W1 and b1 gradients of unit j give
  ``W_std2^2 W2_j^2 relu'(h_j) relu'(h'_j) K0 / width``, whose mean is
  ``W_std2^2 E[relu' relu'] K0`` since ``E[W2_j^2] = 1`` independently of ``h``. So
  ``NTK = NNGP + W_std2^2 E[relu'(h) relu'(h')] K0``.

Both are also the means of the finite-width empirical kernels, so Monte Carlo averages converge
to them at any width.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


class NtkDense(nn.Module):
    """``W_std * x @ W.T / sqrt(in_features) + b_std * b`` with ``W``, ``b`` ~ N(0, 1)."""

    def __init__(self, in_features: int, out_features: int, W_std: float = 1.0, b_std: Optional[float] = None, dtype=None):
        super().__init__()
        self.W_std, self.b_std = W_std, b_std
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if b_std is not None else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if self.bias is not None:
            nn.init.normal_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight.T * (self.W_std / math.sqrt(self.weight.shape[1]))
        if self.bias is not None:
            y = y + self.b_std * self.bias
        return y


def one_hidden_relu(d: int, width: int, k: int, W_std1=1.0, b_std1=None, W_std2=2.0, b_std2=0.5, dtype=torch.float64) -> nn.Sequential:
    """``Dense(width, W_std1, b_std1) - ReLU - Dense(k, W_std2, b_std2)``; defaults are NT's MC test."""
    return nn.Sequential(
        NtkDense(d, width, W_std1, b_std1, dtype=dtype), nn.ReLU(), NtkDense(width, k, W_std2, b_std2, dtype=dtype)
    )


def _gram(x1: torch.Tensor, x2: torch.Tensor, W_std: float, b_std: Optional[float]) -> torch.Tensor:
    d = x1.shape[1]
    return W_std**2 * (x1 @ x2.T) / d + (b_std**2 if b_std is not None else 0.0)


def arccos_kernels(k11: torch.Tensor, k22: torch.Tensor, k12: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(E[relu(u) relu(v)], E[relu'(u) relu'(v)])`` for a centred Gaussian pair; broadcasting."""
    norms = torch.sqrt(k11 * k22)
    cos = torch.clamp(k12 / norms, -1.0, 1.0)
    theta = torch.arccos(cos)
    order1 = (torch.sqrt(torch.clamp(k11 * k22 - k12**2, min=0.0)) + (math.pi - theta) * k12) / (2 * math.pi)
    order0 = (math.pi - theta) / (2 * math.pi)
    return order1, order0


def closed_form(x1: torch.Tensor, x2: Optional[torch.Tensor] = None, W_std1=1.0, b_std1=None, W_std2=2.0, b_std2=0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """``(nngp, ntk)``, each ``(N1, N2)``, of :func:`one_hidden_relu` at infinite width, float64.

    ``x1``/``x2`` are ``(N, d)``; the traced kernels (any number of logits) are these.
    """
    x1 = x1.to(torch.float64)
    x2 = x1 if x2 is None else x2.to(torch.float64)
    k12 = _gram(x1, x2, W_std1, b_std1)
    k11 = torch.diagonal(_gram(x1, x1, W_std1, b_std1))[:, None]
    k22 = torch.diagonal(_gram(x2, x2, W_std1, b_std1))[None, :]
    order1, order0 = arccos_kernels(k11, k22, k12)
    nngp = W_std2**2 * order1 + b_std2**2
    ntk = nngp + W_std2**2 * order0 * k12
    return nngp, ntk
