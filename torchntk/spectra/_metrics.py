"""Diagnostics of a built kernel: condition number, effective rank, kernel-target alignment, change.

A kernel is a 2-D ``(N, N)`` tensor, or a kernel with kept output axes in torchntk's layout
(``(N1, N2, O1, O2)``, ``(N1, N2, H1, H2, W1, W2)``, ...: axes in (x1, x2) pairs), read as the
matrix whose rows are x1's coordinates and columns x2's, both row-major (``(n, o)`` for
``(N1, N2, O1, O2)``: row ``n * O + o``). That is how ``torchntk.predict`` reads kernels too.
Every metric computes in float64 and returns a Python float.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .._layout.kernel_layout import paired_matrix
from .._utils.checks import finite_tensor_argument, show

_EFFECTIVE_RANK_KINDS = ("participation", "entropy")


def condition_number(kernel: torch.Tensor) -> float:
    """The 2-norm condition number ``|lambda|_max / |lambda|_min`` of a symmetric kernel.

    Equal to ``torch.linalg.cond(matrix)`` for a symmetric matrix (the singular values are the
    absolute eigenvalues), computed with :func:`torch.linalg.eigvalsh` in float64. A value near
    ``1 / eps`` of the dtype the kernel was computed in (about ``1e7`` for float32) means the kernel
    is singular to that precision.

    Args:
        kernel: ``(N, N)``, or ``(N, N, O, O, ...)`` with axes in (x1, x2) pairs (see the module
            docstring); symmetric and finite.

    Returns:
        The condition number; ``inf`` for a singular kernel (an eigenvalue exactly 0).

    Raises:
        TypeError: ``kernel`` is not a floating-point tensor.
        ValueError: not square, not symmetric, empty, or NaN/infinite entries.

    Example:
        >>> import torch, torchntk
        >>> torchntk.condition_number(torch.diag(torch.tensor([4.0, 2.0, 0.5])))
        8.0
    """
    eigenvalues = torch.linalg.eigvalsh(_symmetric_matrix(kernel, "kernel", "condition_number")).abs()
    smallest, largest = float(eigenvalues.min()), float(eigenvalues.max())
    if smallest == 0:
        return math.inf
    return largest / smallest


def effective_rank(kernel: torch.Tensor, kind: str = "participation") -> float:
    r"""The effective rank of a positive semi-definite kernel with eigenvalues :math:`\lambda_i`.

    * ``kind="participation"`` (default), the participation ratio
      :math:`(\sum_i \lambda_i)^2 / \sum_i \lambda_i^2 = \operatorname{tr}(K)^2 / \|K\|_F^2`:
      needs no eigendecomposition; ``r`` equal eigenvalues and zeros give ``r``.
    * ``kind="entropy"``, Roy and Vetterli's effective rank :math:`\exp(-\sum_i p_i \log p_i)`
      with :math:`p_i = \lambda_i / \sum_j \lambda_j` (and :math:`0 \log 0 = 0`); also ``r`` for
      ``r`` equal eigenvalues, and more sensitive to the small ones. Eigenvalues below zero by
      rounding (at most ``sqrt(eps) * lambda_max`` of the kernel's dtype) count as zero.

    Both lie between 1 and the matrix size for a nonzero kernel; the zero kernel has effective
    rank 0.

    Args:
        kernel: ``(N, N)``, or ``(N, N, O, O, ...)`` with axes in (x1, x2) pairs; symmetric, finite.
        kind: ``"participation"`` or ``"entropy"``. Default: ``"participation"``.

    Returns:
        The effective rank.

    Raises:
        TypeError: ``kernel`` is not a floating-point tensor.
        ValueError: not square, not symmetric, empty, NaN/infinite entries; an unknown ``kind``;
            for ``"entropy"``, an eigenvalue below ``-sqrt(eps) * lambda_max`` (not positive
            semi-definite).

    Example:
        >>> import torch, torchntk
        >>> kernel = torch.diag(torch.tensor([1.0, 1.0, 0.0]))
        >>> torchntk.effective_rank(kernel), torchntk.effective_rank(kernel, kind="entropy")
        (2.0, 2.0)
    """
    where = "effective_rank"
    if kind not in _EFFECTIVE_RANK_KINDS:
        raise ValueError(f"{where}: `kind` must be one of {_EFFECTIVE_RANK_KINDS}, got {show(kind)}.")
    matrix = _symmetric_matrix(kernel, "kernel", where)
    if kind == "participation":
        squares = float((matrix * matrix).sum())
        return float(torch.trace(matrix)) ** 2 / squares if squares else 0.0
    eigenvalues = torch.linalg.eigvalsh(matrix)
    largest = float(eigenvalues.abs().max())
    tolerance = torch.finfo(kernel.dtype).eps ** 0.5 * largest
    if float(eigenvalues.min()) < -tolerance:
        raise ValueError(
            f"{where}: `kernel` is not positive semi-definite: its smallest eigenvalue is "
            f"{float(eigenvalues.min()):.3e} against a largest of {largest:.3e} (rounding allows "
            f"{-tolerance:.1e}); the entropy effective rank needs nonnegative eigenvalues."
        )
    weights = eigenvalues.clamp(min=0)
    if float(weights.sum()) == 0:
        return 0.0
    weights = weights / weights.sum()
    return math.exp(-float(torch.special.xlogy(weights, weights).sum()))


def kernel_target_alignment(kernel: torch.Tensor, targets: torch.Tensor, *, centered: bool = True) -> float:
    r"""The alignment between a kernel and the targets' Gram matrix :math:`Y Y^\top`.

    .. math::

        A(K, Y) = \frac{\langle K_c, Y_c Y_c^\top \rangle_F}{\|K_c\|_F \, \|Y_c Y_c^\top\|_F}

    With ``centered=True`` (default; Cortes, Mohri and Rostamizadeh, 2012), :math:`K_c = H K H`
    and :math:`Y_c = H Y` with the centering matrix :math:`H = I - \mathbf{1}\mathbf{1}^\top / M`
    over the ``M`` rows; with ``centered=False`` (Cristianini et al., 2002), :math:`K_c = K`,
    :math:`Y_c = Y`. Uncentered alignment rewards the constant mode: the all-ones kernel has
    alignment 1 with any constant targets and high alignment with one-hot labels. Both lie in
    ``[-1, 1]``, and in ``[0, 1]`` for a positive semi-definite kernel.

    Args:
        kernel: ``(M, M)``, or ``(N, N, O, O, ...)`` with axes in (x1, x2) pairs (then ``M = N O``).
        targets: shape ``(*rows, *columns)``, where ``rows`` is the kernel's coordinate shape
            (``(N,)`` for an ``(N, N)`` kernel, ``(N, O)`` for ``(N, N, O, O)``) and the remaining
            axes, flattened, are the columns of ``Y``: ``(N,)`` or ``(N, C)`` targets (e.g. one-hot
            labels) for a traced kernel, ``(N, O)`` for a full one.
        centered: center the kernel and the targets first. Default: True.

    Returns:
        The alignment.

    Raises:
        TypeError: ``kernel`` or ``targets`` is not a floating-point tensor, ``centered`` not a bool.
        ValueError: ``kernel`` not square, not symmetric, empty or not finite; ``targets`` whose
            leading shape is not the kernel's coordinate shape, or not finite; a kernel or target
            Gram matrix that is zero (after centering), for which the alignment is undefined.

    Example:
        >>> import torch, torchntk
        >>> labels = torch.tensor([1.0, 1.0, -1.0, -1.0])
        >>> kernel = torch.outer(labels, labels) + torch.eye(4)
        >>> round(torchntk.kernel_target_alignment(kernel, labels), 4)   # 20 / (4 sqrt(27))
        0.9623
    """
    where = "kernel_target_alignment"
    if not isinstance(centered, bool):
        raise TypeError(f"{where}: `centered` must be a bool, got {show(centered)}.")
    matrix = _symmetric_matrix(kernel, "kernel", where)
    rows = tuple(kernel.shape[0::2])
    _floating_tensor(targets, "targets", where)
    if tuple(targets.shape[: len(rows)]) != rows:
        raise ValueError(
            f"{where}: `targets` of shape {tuple(targets.shape)} must start with the kernel's coordinate "
            f"shape {rows} (kernel of shape {tuple(kernel.shape)}); the axes after it are the target columns."
        )
    finite_tensor_argument(targets, "targets", where)
    columns = targets.detach().double().reshape(matrix.shape[0], -1).to(matrix.device)
    if centered:
        matrix = matrix - matrix.mean(0, keepdim=True)
        matrix = matrix - matrix.mean(1, keepdim=True)
        columns = columns - columns.mean(0, keepdim=True)
    gram = columns @ columns.T
    kernel_norm, gram_norm = float(torch.linalg.matrix_norm(matrix)), float(torch.linalg.matrix_norm(gram))
    for norm, name in ((kernel_norm, "kernel"), (gram_norm, "targets' Gram matrix")):
        if norm == 0:
            state = " after centering" if centered else ""
            raise ValueError(f"{where}: the {name} is zero{state}; the alignment is undefined.")
    return float((matrix * gram).sum()) / (kernel_norm * gram_norm)


def relative_change(kernel_a: Any, kernel_b: Any) -> float:
    r"""The relative change :math:`\|B - A\|_F / \|A\|_F` from ``kernel_a`` to ``kernel_b``.

    For example the kernels of two checkpoints on the same inputs, ``A`` at initialisation: the
    "lazy" regime keeps this small. Pytrees of kernels (one per output leaf, as torchntk returns
    for pytree outputs) are compared as one vector of all their entries.

    Args:
        kernel_a: a floating-point tensor of any shape, or a pytree of them; the reference.
        kernel_b: the same shapes and structure as ``kernel_a``.

    Returns:
        The relative change, in float64.

    Raises:
        TypeError: a leaf that is not a floating-point tensor.
        ValueError: different structures or shapes; NaN/infinite entries; ``kernel_a`` all zero.

    Example:
        >>> import torch, torchntk
        >>> torchntk.relative_change(torch.ones(2, 2), torch.full((2, 2), 1.5))
        0.5
    """
    where = "relative_change"
    leaves_a, spec_a = pytree.tree_flatten_with_path(kernel_a)
    leaves_b, spec_b = pytree.tree_flatten_with_path(kernel_b)
    if spec_a != spec_b:
        raise ValueError(f"{where}: `kernel_a` and `kernel_b` must have the same structure, got {spec_a} and {spec_b}.")
    if not leaves_a:
        raise ValueError(f"{where}: `kernel_a` holds no tensor.")
    difference = reference = 0.0
    for (path, a), (_, b) in zip(leaves_a, leaves_b):
        name_a, name_b = "kernel_a" + pytree.keystr(path), "kernel_b" + pytree.keystr(path)
        _floating_tensor(a, name_a, where)
        _floating_tensor(b, name_b, where)
        if a.shape != b.shape:
            raise ValueError(
                f"{where}: `{name_a}` has shape {tuple(a.shape)} but `{name_b}` has {tuple(b.shape)}; "
                f"compare kernels of the same inputs and layout."
            )
        finite_tensor_argument(a, name_a, where)
        finite_tensor_argument(b, name_b, where)
        a64, b64 = a.detach().double(), b.detach().to(device=a.device, dtype=torch.float64)
        difference += float(torch.linalg.vector_norm(b64 - a64)) ** 2
        reference += float(torch.linalg.vector_norm(a64)) ** 2
    if reference == 0:
        raise ValueError(f"{where}: `kernel_a` is all zero; the relative change is undefined.")
    return (difference / reference) ** 0.5


def kernel_matrix(kernel: Any, name: str, where: str) -> torch.Tensor:
    """A square kernel as a float64 matrix (see the module docstring), detached.

    Raises:
        TypeError: not a floating-point tensor.
        ValueError: an odd number of axes, a non-square matrix, no entries, NaN/infinite entries.
    """
    _floating_tensor(kernel, name, where)
    if kernel.ndim < 2 or kernel.ndim % 2:
        raise ValueError(
            f"{where}: `{name}` must have axes in (x1, x2) pairs, e.g. (N, N) or (N, N, O, O), got shape "
            f"{tuple(kernel.shape)}. Kernels with diagonal axes are not square matrices."
        )
    if tuple(kernel.shape[0::2]) != tuple(kernel.shape[1::2]):
        raise ValueError(
            f"{where}: `{name}` of shape {tuple(kernel.shape)} is not square: its x1 axes {tuple(kernel.shape[0::2])} "
            f"differ from its x2 axes {tuple(kernel.shape[1::2])}. Use a kernel of x with itself, K(x, x)."
        )
    if kernel.numel() == 0:
        raise ValueError(f"{where}: `{name}` of shape {tuple(kernel.shape)} has no entries.")
    finite_tensor_argument(kernel, name, where)
    return paired_matrix(kernel.detach().double())


def _symmetric_matrix(kernel: Any, name: str, where: str) -> torch.Tensor:
    """:func:`kernel_matrix`, symmetrised after checking it is symmetric to ``sqrt(eps)`` of its dtype
    (relative, in the Frobenius norm)."""
    matrix = kernel_matrix(kernel, name, where)
    asymmetry = float(torch.linalg.matrix_norm(matrix - matrix.T))
    tolerance = torch.finfo(kernel.dtype).eps ** 0.5 * float(torch.linalg.matrix_norm(matrix))
    if asymmetry > tolerance:
        raise ValueError(
            f"{where}: `{name}` is not symmetric: ||K - K^T||_F = {asymmetry:.3e}, above the {tolerance:.1e} "
            f"rounding allows. Use the kernel of x with itself, K(x, x)."
        )
    return (matrix + matrix.T) / 2


def _floating_tensor(value: Any, name: str, where: str) -> None:
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise TypeError(f"{where}: `{name}` must be a floating-point tensor, got {show(value)}.")
