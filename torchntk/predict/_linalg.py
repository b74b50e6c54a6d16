"""Linear algebra of ``torchntk.predict``: regularisation, Cholesky solves, the eigenbasis.

No explicit inverse is formed: positive-definite systems are solved through a Cholesky factor,
and functions of the kernel (``exp(-t K)`` and friends) go through its eigendecomposition.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .._utils.checks import user_stacklevel

JITTERS = (0.0, 1e-10, 1e-8, 1e-6)
"""Multiples of the mean diagonal tried in turn when a Cholesky factorisation fails."""


def regularised(matrix: torch.Tensor, diag_reg: float, absolute: bool) -> torch.Tensor:
    """``matrix + diag_reg * I``, with ``diag_reg`` scaled by the mean diagonal unless ``absolute``."""
    if diag_reg == 0:
        return matrix
    scale = diag_reg if absolute else diag_reg * matrix.diagonal().mean()
    return matrix + scale * torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)


@dataclass(frozen=True)
class Cholesky:
    """A lower Cholesky factor of a positive-definite matrix."""

    factor: torch.Tensor

    @classmethod
    def of(cls, matrix: torch.Tensor, name: str, where: str) -> "Cholesky":
        """Factorises ``matrix``, adding jitter (``JITTERS`` times its mean diagonal) if it must.

        Raises:
            ValueError: not positive definite even with the largest jitter.
        """
        scale = matrix.diagonal().abs().mean().clamp(min=torch.finfo(matrix.dtype).tiny)
        eye = torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)
        for jitter in JITTERS:
            factor, info = torch.linalg.cholesky_ex(matrix + jitter * scale * eye)
            if int(info) == 0:
                if jitter:
                    warnings.warn(
                        f"{where}: `{name}` is not numerically positive definite; added {jitter:g} x its mean "
                        f"diagonal to the diagonal to factorise it. Pass diag_reg > 0 to regularise on purpose.",
                        stacklevel=user_stacklevel(),
                    )
                return cls(factor)
        raise ValueError(
            f"{where}: `{name}` is not positive definite: its Cholesky factorisation failed even with "
            f"{JITTERS[-1]:g} x its mean diagonal added to the diagonal (leading minor {int(info)} of "
            f"{matrix.shape[0]}). Duplicated training points or too few parameters make the kernel "
            f"singular; pass diag_reg > 0."
        )

    def solve(self, right: torch.Tensor) -> torch.Tensor:
        """``matrix^{-1} right`` for ``right`` of shape ``(n, k)``."""
        return torch.cholesky_solve(right, self.factor)


@dataclass(frozen=True)
class Eigenbasis:
    """``matrix = vectors diag(values) vectors^T`` for a symmetric matrix; negative eigenvalues,
    which a positive semi-definite kernel has only through rounding, are clipped to 0."""

    values: torch.Tensor
    vectors: torch.Tensor

    @classmethod
    def of(cls, matrix: torch.Tensor) -> "Eigenbasis":
        values, vectors = torch.linalg.eigh((matrix + matrix.T) / 2)
        return cls(values.clamp(min=0), vectors)

    def apply(self, function_of_values: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        """``vectors diag(f) vectors^T right`` for every row of ``function_of_values`` (``(m, n)``):
        ``right`` is ``(n, k)``, the result ``(m, n, k)``."""
        coefficients = self.vectors.T @ right
        return torch.einsum("ij,mj,jk->mik", self.vectors, function_of_values, coefficients)


def expm1_decay(values: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
    """``exp(-values t) - 1`` for every time (rows) and eigenvalue (columns)."""
    return torch.expm1(-times[:, None] * values[None, :])


def expm1_decay_over_value(values: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
    """``(exp(-values t) - 1) / values``, with its limit ``-t`` at ``values = 0`` (no 0/0)."""
    product = times[:, None] * values[None, :]
    small = product.abs() < 1e-8
    safe = torch.where(values == 0, torch.ones_like(values), values)[None, :]
    return torch.where(small, -times[:, None] * (1 - product / 2), torch.expm1(-product) / safe)
