"""Top eigenpairs of a symmetric operator: block Lanczos with full reorthogonalisation.

NOTE: [Block Lanczos by Rayleigh-Ritz]
The subspace is the block Krylov space of the operator ``A`` from a seeded random block of
``block_size`` orthonormal vectors: every step multiplies the newest block by ``A`` and
orthonormalises the images against the whole basis (classical Gram-Schmidt repeated until the norm
stops dropping, the DGKS criterion, so the basis stays orthonormal to working precision). Unlike
textbook Lanczos, the small projected matrix ``T = Q^T A Q`` is not read off a three-term
recurrence but accumulated from the stored images ``A Q`` (one new block row per step). That costs
one more ``size x dimension`` matrix, and buys three things:

* the Ritz pairs are those of an exact Rayleigh-Ritz projection, whatever rounding did to the
  recurrence;
* residuals ``||A v - theta v||`` are computed from ``A Q``, not estimated, so "converged" means
  the returned pairs satisfy ``A v = lambda v`` to the stated tolerance;
* a block whose images fall in the span of the basis (an invariant subspace, e.g. a kernel of low
  rank) is simply replaced by fresh random directions: any orthonormal basis is valid for
  Rayleigh-Ritz.

Single-vector Krylov methods see one copy of a repeated eigenvalue only (the Krylov space of one
start vector meets each eigenspace in one direction). A block of ``b`` vectors finds
multiplicities up to ``b``; hence ``block_size`` 2 or more by default.

The two computed copies of each entry of ``T`` (``u . A w`` and ``w . A u``) differ by rounding
only when ``A`` is symmetric; a larger difference (above ``sqrt(eps) max ||A q||``) is an error
rather than Ritz pairs of a matrix that is not the operator.

NOTE: [Lanczos convergence]
A Ritz pair ``(theta, v)`` has converged when ``||A v - theta v|| <= tol * |theta| + floor``:
relative to its own value, as ARPACK does, not to ``||A||``. An NTK's top eigenvalue often
dominates the rest (on the benchmark MLP, 11384 against 182, 178, 176, ...): a threshold relative
to ``||A||`` accepted residuals of 3 there, and eigenvalues 4% off. For a symmetric ``A`` the
eigenvalue error is at most ``min(r, r^2 / gap)`` for residual ``r``, so at most ``tol`` relative.
``floor = 100 eps max|theta|`` is the rounding level of the products: residuals of eigenvalues
near zero (a kernel of low rank) cannot go below it. The test runs at growing intervals (about
every 10% more products), so the ``dimension^3`` eigendecompositions of ``T`` stay cheap next to
the products.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

BlockProduct = Callable[[torch.Tensor], torch.Tensor]
"""``(size, b) -> (size, b)``: the operator applied to the columns of a matrix."""

# A projection pass that keeps more than this fraction of the vector's norm left it orthogonal to
# working precision (the DGKS criterion); otherwise it is repeated, at most _PASSES times.
_KEPT_NORM = 0.5
_PASSES = 4
# The residual floor of NOTE: [Lanczos convergence], in units of eps * max|theta|.
_FLOOR_EPSILONS = 100


@dataclass
class LanczosOutcome:
    """What :func:`block_lanczos` found, in the operator's dtype and device.

    Attributes:
        eigenvalues: ``(k,)``, descending.
        eigenvectors: ``(size, k)``, orthonormal columns, each with its largest entry positive.
        residuals: ``(k,)``, ``||A v - lambda v||`` per pair.
        products: the number of operator-vector products used.
        converged: every residual is within the tolerance (or the basis spans the whole space).
    """

    eigenvalues: torch.Tensor
    eigenvectors: torch.Tensor
    residuals: torch.Tensor
    products: int
    converged: bool = False


def block_lanczos(
    apply: BlockProduct, size: int, k: int, *, block_size: int, max_products: int, tol: float,
    seed: int, dtype: torch.dtype, device: torch.device, where: str,
) -> LanczosOutcome:
    """The ``k`` algebraically largest eigenpairs of the symmetric operator ``apply`` (NOTE: [Block
    Lanczos by Rayleigh-Ritz]). Arguments are validated by the caller; ``max_products`` is at least
    ``k`` and is capped at ``size`` here.

    Raises:
        ValueError: the operator returned NaN or infinite entries or a matrix of the wrong shape, or
            is not symmetric.
    """
    capacity = min(size, max_products)
    # Random directions are drawn on the CPU in float64, so a seed gives the same start (and the
    # same replacements) on every device and in every dtype.
    generator = torch.Generator().manual_seed(seed)

    def random_directions(count: int) -> torch.Tensor:
        return torch.randn(size, count, generator=generator, dtype=torch.float64).to(dtype=dtype, device=device)

    basis = torch.empty(size, capacity, dtype=dtype, device=device)
    images = torch.empty(size, capacity, dtype=dtype, device=device)
    projected = torch.zeros(capacity, capacity, dtype=torch.float64)
    filled, next_check, largest_image = 0, k, 0.0
    candidates = random_directions(min(block_size, capacity))
    while True:
        start = filled
        for column in candidates.unbind(1):
            if filled == capacity:
                break
            basis[:, filled] = _orthonormal_direction(column, basis[:, :filled], random_directions)
            filled += 1
        block = basis[:, start:filled]
        images[:, start:filled] = _checked_images(apply, block, where)
        largest_image = max(largest_image, float(torch.linalg.vector_norm(images[:, start:filled], dim=0).max()))
        asymmetry = _extend_projection(projected, basis[:, :filled], images[:, :filled], start)
        if asymmetry > torch.finfo(dtype).eps ** 0.5 * largest_image:
            raise ValueError(
                f"{where}: the operator is not symmetric: |u . A w - w . A u| = {asymmetry:.3e} for orthonormal "
                f"u, w, against ||A w|| up to {largest_image:.3e}. Lanczos needs a symmetric operator (a kernel of "
                f"x with itself, a model without randomness such as dropout in training mode)."
            )
        if filled < next_check and filled < capacity:
            candidates = images[:, start:filled]
            continue
        outcome, scale = _ritz_pairs(projected[:filled, :filled], basis[:, :filled], images[:, :filled], k)
        # NOTE: [Lanczos convergence]
        threshold = tol * outcome.eigenvalues.abs() + _FLOOR_EPSILONS * torch.finfo(dtype).eps * scale
        outcome.converged = filled == size or bool((outcome.residuals <= threshold).all())
        if outcome.converged or filled == capacity:
            return outcome
        next_check = max(filled + 1, math.ceil(filled * 1.1))
        candidates = images[:, start:filled]


def _orthonormal_direction(
    vector: torch.Tensor, basis: torch.Tensor, random_directions: Callable[[int], torch.Tensor]
) -> torch.Tensor:
    """``vector`` orthonormalised against the orthonormal columns of ``basis``; a fresh random
    direction in its place if it lies in their span (to working precision)."""
    for _ in range(3):
        projected = _project_out(vector, basis)
        if projected is not None:
            return projected
        vector = random_directions(1)[:, 0]
    # Only reachable when the basis already spans the space, which the caller never asks for.
    raise AssertionError("no direction orthogonal to the basis was found")


def _project_out(vector: torch.Tensor, basis: torch.Tensor) -> Optional[torch.Tensor]:
    """Classical Gram-Schmidt, repeated while a pass removes more than half the norm; None when
    the vector is (numerically) in the span of ``basis``."""
    original = previous = torch.linalg.vector_norm(vector)
    if original == 0 or not torch.isfinite(original):
        return None
    floor = 10 * torch.finfo(vector.dtype).eps * original
    for _ in range(_PASSES):
        if basis.shape[1]:
            vector = vector - basis @ (basis.T @ vector)
        norm = torch.linalg.vector_norm(vector)
        if norm <= floor:
            return None
        if norm > _KEPT_NORM * previous:
            return vector / norm
        previous = norm
    return None


def _checked_images(apply: BlockProduct, block: torch.Tensor, where: str) -> torch.Tensor:
    images = apply(block)
    if not isinstance(images, torch.Tensor) or images.shape != block.shape:
        got = tuple(images.shape) if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"{where}: the operator must return a tensor of shape {tuple(block.shape)}, got {got}.")
    if not torch.isfinite(images).all():
        raise ValueError(
            f"{where}: the operator returned NaN or infinite entries; its eigenpairs are undefined. "
            f"Check the model, its inputs and its parameters for NaN/Inf."
        )
    return images.to(block.dtype)


def _extend_projection(projected: torch.Tensor, basis: torch.Tensor, images: torch.Tensor, start: int) -> float:
    """Fills the rows and columns ``start:`` of ``T = Q^T A Q`` (float64, CPU) with the average of
    the two computed copies of each cross block, so that ``T`` is exactly symmetric; returns their
    largest difference, which rounding keeps small for a symmetric ``A`` and no more."""
    filled = basis.shape[1]
    new_rows = (basis[:, start:].T @ images).double().cpu()          # Q_new^T A Q
    new_columns = (basis.T @ images[:, start:]).double().cpu().T     # (Q^T A Q_new)^T
    block = (new_rows + new_columns) / 2
    projected[start:filled, :filled] = block
    projected[:filled, start:filled] = block.T
    return float((new_rows - new_columns).abs().max())


def _ritz_pairs(
    projected: torch.Tensor, basis: torch.Tensor, images: torch.Tensor, k: int
) -> tuple[LanczosOutcome, float]:
    """The top ``k`` Ritz pairs and ``max |theta|`` over all Ritz values (a lower bound on ``||A||``)."""
    values, vectors = torch.linalg.eigh(projected)
    top = torch.argsort(values, descending=True)[:k]
    coefficients = vectors[:, top].to(dtype=basis.dtype, device=basis.device)
    theta = values[top].to(dtype=basis.dtype, device=basis.device)
    eigenvectors = basis @ coefficients
    residuals = torch.linalg.vector_norm(images @ coefficients - eigenvectors * theta, dim=0)
    # Eigenvectors have no sign; fixing one (largest entry positive) makes results comparable
    # across seeds, block sizes and checkpoints.
    largest = eigenvectors.abs().argmax(dim=0)
    signs = torch.where(eigenvectors[largest, torch.arange(k, device=basis.device)] < 0, -1.0, 1.0)
    eigenvectors = eigenvectors * signs.to(basis.dtype)
    return LanczosOutcome(theta, eigenvectors, residuals, basis.shape[1]), float(values.abs().max())
