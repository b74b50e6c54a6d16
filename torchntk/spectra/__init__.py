"""Spectra of the NTK without building it, and diagnostics of a built kernel.

Without the kernel, from NTK-vector products (:func:`torchntk.empirical_ntk_vp_fn`):

* :func:`ntk_eigenpairs`: the top ``k`` eigenpairs of ``K(x, x)`` by block Lanczos;
* :func:`ntk_trace_estimate`: Hutchinson's estimate of ``trace K(x, x)``;
* :func:`top_eigenpairs` and :func:`trace_estimate`: the same for any symmetric operator given as
  a function ``v -> A v``.

From a built kernel (``(N, N)``, or ``(N, N, O, O, ...)`` read as an ``(N O, N O)`` matrix):
:func:`condition_number`, :func:`effective_rank`, :func:`kernel_target_alignment` and
:func:`relative_change` (e.g. between two checkpoints), defined in ``spectra/_metrics.py``. The
algorithms live in ``spectra/_lanczos.py``, ``spectra/_hutchinson.py`` and
``spectra/_operator.py``; this module is their public front (argument checks and docstrings).

NOTE: [Which kernel the spectra are of]
The eigenpairs and traces are those of the kernel ``empirical_ntk_fn(f, trace_axes=...)(x)`` with
the same ``trace_axes``, read as a matrix over the kept output coordinates (NOTE: [The NTK as an
operator] in ``spectra/_operator.py``). The default ``trace_axes=(-1,)`` is the library's default:
for an ``(N, O)`` output, the ``(N, N)`` kernel averaged over the logits, eigenvectors of shape
``(N,)``. ``trace_axes=()`` is the full ``(N O, N O)`` kernel, eigenvectors of shape ``(N, O)``:
the operator of the linearised training dynamics under MSE. A traced product costs ``O``
NTK-vector products (evaluated together under ``vmap``), a full one costs one.

Example:
    >>> import torch, torchntk
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    >>> x = torch.randn(30, 3)
    >>> pairs = torchntk.ntk_eigenpairs(model, x, k=3)
    >>> pairs.eigenvalues.shape, pairs.eigenvectors.shape, pairs.converged
    (torch.Size([3]), torch.Size([30, 3]), True)
    >>> kernel = torchntk.empirical_ntk_fn(model)(x)                  # (30, 30), built for the check
    >>> torch.allclose(pairs.eigenvalues, torch.linalg.eigvalsh(kernel).flip(0)[:3], rtol=1e-4)
    True
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Sequence, Union

import torch

from .._utils.checks import (
    non_negative_int_argument,
    positive_int_argument,
    real_number_argument,
    show,
    user_stacklevel,
)
from .._utils.types import Axes, Model, PyTree
from ._hutchinson import TraceEstimate, hutchinson
from ._lanczos import block_lanczos
from ._metrics import condition_number, effective_rank, kernel_target_alignment, relative_change
from ._operator import ntk_operator

__all__ = [
    "Eigenpairs",
    "TraceEstimate",
    "ntk_eigenpairs",
    "ntk_trace_estimate",
    "top_eigenpairs",
    "trace_estimate",
    "condition_number",
    "effective_rank",
    "kernel_target_alignment",
    "relative_change",
]

DEFAULT_BLOCK_SIZE = 2
"""Vectors per Lanczos block: 2 finds eigenvalues of multiplicity 2 that a single vector would
miss (NOTE: [Block Lanczos by Rayleigh-Ritz]) for a few more products."""

DEFAULT_PROBES = 100
"""Hutchinson probes: a standard error of at most ``sqrt(2 / 100) = 14%`` of ``||K||_F``."""


@dataclass(frozen=True)
class Eigenpairs:
    """The top eigenpairs of a symmetric operator, found by block Lanczos.

    Attributes:
        eigenvalues: ``(k,)``, descending, in the operator's dtype (at least float32 for the NTK).
        eigenvectors: ``(*shape, k)``: ``eigenvectors[..., i]`` is the unit eigenvector of
            ``eigenvalues[i]``, in kernel coordinates (``(N, k)`` for a traced ``(N, N)`` kernel,
            ``(N, O, k)`` for a full one), its entry of largest magnitude positive.
        residuals: ``(k,)``, ``||A v - lambda v||`` of each pair, computed (not estimated).
        products: the number of operator-vector products used; for a traced NTK each costs ``|T|``
            NTK-vector products (``|T|``: the number of traced coordinates, e.g. ``O``).
        converged: every residual is at most ``tol * |lambda|`` plus a rounding floor of
            ``100 eps lambda_max`` (NOTE: [Lanczos convergence]), or the subspace spans the whole
            space. A warning is raised when not.
    """

    eigenvalues: torch.Tensor
    eigenvectors: torch.Tensor
    residuals: torch.Tensor
    products: int
    converged: bool


for _public in (Eigenpairs, TraceEstimate, condition_number, effective_rank, kernel_target_alignment, relative_change):
    _public.__module__ = "torchntk"
del _public


def ntk_eigenpairs(
    f: Model, x: PyTree, k: int, params: Any = None, *, trace_axes: Axes = (-1,),
    output_fn: Optional[Callable[..., PyTree]] = None, block_size: int = DEFAULT_BLOCK_SIZE,
    max_products: Optional[int] = None, tol: Optional[float] = None, seed: int = 0,
    chunk_size: Optional[int] = None, **kwargs: Any,
) -> Eigenpairs:
    """The ``k`` largest eigenpairs of the NTK ``K(x, x)``, from NTK-vector products.

    The kernel is that of ``empirical_ntk_fn(f, trace_axes=trace_axes)(x)`` read as a matrix over
    the kept output coordinates (NOTE: [Which kernel the spectra are of]); it is never built. The
    method is block Lanczos with full reorthogonalisation and exact residuals (NOTE: [Block Lanczos
    by Rayleigh-Ritz]). Memory: two ``(size, max_products)`` matrices besides the model's passes.

    Args:
        f: an ``nn.Module`` or a function ``f(params, x, **kwargs)`` whose output (after
            ``output_fn``) is one floating-point tensor.
        x: the inputs: a tensor or a pytree of tensors.
        k: how many eigenpairs, ``1 <= k <=`` the number of kernel coordinates.
        params: as in :func:`torchntk.empirical_ntk_vp_fn`. Default: None.
        trace_axes: output axes averaged away, as in :func:`torchntk.empirical_ntk_fn`; ``()`` for
            the full kernel. Default: ``(-1,)``.
        output_fn: selects the output, as in :func:`torchntk.empirical_ntk_fn`. Default: None.
        block_size: vectors per Lanczos block; eigenvalues of higher multiplicity can be missed.
            Default: 2.
        max_products: the most kernel-vector products (the largest subspace); a warning says when
            it is reached before convergence. Default: ``max(100, 20 k)``, capped at the size.
        tol: convergence threshold on ``||K v - lambda v|| / |lambda|``: each eigenvalue is then
            within ``tol`` (relative) of one of ``K``'s, and within about ``tol^2 lambda / gap``
            of its own. Default: ``sqrt(eps)`` of the output dtype.
        seed: seeds the random start block. Default: 0.
        chunk_size: cotangents per vmapped pass through the model (bounds memory). Default: None
            (32).
        **kwargs: passed to ``f``.

    Returns:
        The :class:`Eigenpairs`, eigenvectors shaped like the kept output axes plus ``k``.

    Raises:
        TypeError: a bad model, input, ``params``, ``output_fn``, an output that is not one
            floating tensor, or non-int ``k``, ``block_size``, ``max_products``, ``seed``.
        ValueError: ``k`` out of range, ``trace_axes`` out of range, ``max_products < k``,
            ``block_size`` or ``chunk_size`` below 1, ``tol`` not positive, NaN products, products
            that are not symmetric (e.g. dropout in training mode).

    Example:
        >>> import torch, torchntk
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        >>> pairs = torchntk.ntk_eigenpairs(model, torch.randn(20, 3), k=2, trace_axes=())
        >>> pairs.eigenvectors.shape                                  # (N, O, k): full kernel
        torch.Size([20, 2, 2])
    """
    where = "ntk_eigenpairs"
    settings = _LanczosSettings.of(k, block_size, max_products, tol, seed, where)
    operator = ntk_operator(f, x, params, trace_axes, output_fn, chunk_size, kwargs, where)
    shape = operator.shape

    def apply(block: torch.Tensor) -> torch.Tensor:
        vectors = block.T.reshape(block.shape[1], *shape)
        return operator.apply(vectors).reshape(block.shape[1], -1).T

    # Half-precision outputs: the basis is kept in float32 (orthogonality needs it), the default
    # tolerance follows the precision of the products.
    if settings.tol is None:
        settings = replace(settings, tol=torch.finfo(operator.dtype).eps ** 0.5)
    working = torch.promote_types(operator.dtype, torch.float32)
    return _eigenpairs(apply, shape, settings, working, operator.device, where)


def top_eigenpairs(
    matvec: Callable[[torch.Tensor], torch.Tensor], shape: Union[int, Sequence[int]], k: int, *,
    dtype: Optional[torch.dtype] = None, device: Union[str, torch.device, None] = None,
    block_size: int = DEFAULT_BLOCK_SIZE, max_products: Optional[int] = None, tol: Optional[float] = None,
    seed: int = 0,
) -> Eigenpairs:
    """The ``k`` algebraically largest eigenpairs of a symmetric operator ``v -> A v``.

    Block Lanczos with full reorthogonalisation (NOTE: [Block Lanczos by Rayleigh-Ritz]); ``A``
    must be symmetric: the two computed copies ``u . A w`` and ``w . A u`` of every entry of the
    projected matrix are compared, and a ValueError says when they differ by more than rounding.

    Args:
        matvec: ``A v`` for a tensor ``v`` of shape ``shape``, returned with that shape.
        shape: the shape of the vectors (an int for 1-D).
        k: how many eigenpairs, ``1 <= k <= prod(shape)``.
        dtype: the vectors' dtype. Default: ``torch.get_default_dtype()``.
        device: the vectors' device. Default: CPU.
        block_size, max_products, tol, seed: as in :func:`ntk_eigenpairs`.

    Returns:
        The :class:`Eigenpairs`, eigenvectors of shape ``(*shape, k)``.

    Raises:
        TypeError: ``matvec`` not callable, non-int sizes or counts.
        ValueError: as :func:`ntk_eigenpairs`; ``matvec`` returning a wrong shape or NaN, or not
            symmetric.

    Example:
        >>> import torch, torchntk
        >>> a = torch.diag(torch.arange(1.0, 11.0))
        >>> pairs = torchntk.top_eigenpairs(lambda v: a @ v, 10, k=3)
        >>> [round(value, 4) for value in pairs.eigenvalues.tolist()], pairs.eigenvectors.shape
        ([10.0, 9.0, 8.0], torch.Size([10, 3]))
    """
    where = "top_eigenpairs"
    settings = _LanczosSettings.of(k, block_size, max_products, tol, seed, where)
    shape = _shape_argument(shape, where)
    if not callable(matvec):
        raise TypeError(f"{where}: `matvec` must be a callable v -> A v, got {show(matvec)}.")
    dtype = _dtype_argument(dtype, where)
    device = torch.device("cpu" if device is None else device)

    def apply(block: torch.Tensor) -> torch.Tensor:
        columns = [_checked_vector(matvec(column.reshape(shape)), shape, where).reshape(-1) for column in block.T]
        return torch.stack(columns, dim=1)

    return _eigenpairs(apply, shape, settings, dtype, device, where)


def ntk_trace_estimate(
    f: Model, x: PyTree, params: Any = None, *, probes: int = DEFAULT_PROBES, trace_axes: Axes = (-1,),
    output_fn: Optional[Callable[..., PyTree]] = None, seed: int = 0, chunk_size: Optional[int] = None,
    **kwargs: Any,
) -> TraceEstimate:
    """Hutchinson's estimate of ``trace K(x, x)``, from NTK-vector products.

    The kernel is that of :func:`ntk_eigenpairs`. Every probe is a Rademacher vector shaped like
    ``f(x)`` on the *full* kernel, whose trace is ``|T|`` times the traced one's, so a probe costs
    one NTK-vector product whatever ``trace_axes``. The exact trace needs one backward pass per
    output entry (``N O``); the estimate pays off when ``probes`` is well below that (outputs with
    many entries: images, sequences, large vocabularies).

    Args:
        f, x, params, trace_axes, output_fn, chunk_size: as in :func:`ntk_eigenpairs`.
        probes: the number of probes, at least 2. Default: 100.
        seed: seeds the probes (the same seed gives the same probes). Default: 0.
        **kwargs: passed to ``f``.

    Returns:
        The :class:`TraceEstimate`.

    Raises:
        TypeError, ValueError: as :func:`ntk_eigenpairs`; ``probes`` below 2.

    Example:
        >>> import torch, torchntk
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        >>> x = torch.randn(10, 3)
        >>> estimate = torchntk.ntk_trace_estimate(model, x, probes=400)
        >>> exact = torch.trace(torchntk.empirical_ntk_fn(model)(x)).item()
        >>> abs(estimate.estimate - exact) < 5 * estimate.standard_error
        True
    """
    where = "ntk_trace_estimate"
    count, seed = _probes_argument(probes, where), _seed_argument(seed, where)
    operator = ntk_operator(f, x, params, trace_axes, output_fn, chunk_size, kwargs, where)
    return hutchinson(
        operator.quadratic_forms, operator.output_shape, count, seed=seed, chunk_size=operator.chunk_size,
        dtype=operator.dtype, device=operator.device,
    )


def trace_estimate(
    matvec: Callable[[torch.Tensor], torch.Tensor], shape: Union[int, Sequence[int]], probes: int = DEFAULT_PROBES,
    *, dtype: Optional[torch.dtype] = None, device: Union[str, torch.device, None] = None, seed: int = 0,
) -> TraceEstimate:
    """Hutchinson's estimate of ``trace A`` for a symmetric operator ``v -> A v``.

    Args:
        matvec: ``A v`` for a tensor ``v`` of shape ``shape``, returned with that shape.
        shape: the shape of the vectors (an int for 1-D).
        probes: the number of Rademacher probes, at least 2. Default: 100.
        dtype: the probes' dtype. Default: ``torch.get_default_dtype()``.
        device: the probes' device. Default: CPU.
        seed: seeds the probes. Default: 0.

    Returns:
        The :class:`TraceEstimate`.

    Raises:
        TypeError: ``matvec`` not callable; non-int ``shape``, ``probes`` or ``seed``.
        ValueError: ``probes`` below 2; ``matvec`` returning a wrong shape or NaN.

    Example:
        >>> import torch, torchntk
        >>> a = torch.diag(torch.arange(1.0, 5.0))
        >>> torchntk.trace_estimate(lambda v: a @ v, 4, probes=10).estimate   # exact for a diagonal
        10.0
    """
    where = "trace_estimate"
    shape = _shape_argument(shape, where)
    if not callable(matvec):
        raise TypeError(f"{where}: `matvec` must be a callable v -> A v, got {show(matvec)}.")
    count, seed = _probes_argument(probes, where), _seed_argument(seed, where)
    dtype = _dtype_argument(dtype, where)

    def quadratic_forms(probes: torch.Tensor) -> torch.Tensor:
        return torch.stack([(z * _checked_vector(matvec(z), shape, where)).sum() for z in probes])

    return hutchinson(
        quadratic_forms, shape, count, seed=seed, chunk_size=count, dtype=dtype,
        device=torch.device("cpu" if device is None else device),
    )


# -- shared argument handling ---------------------------------------------------------------------


@dataclass(frozen=True)
class _LanczosSettings:
    k: int
    block_size: int
    max_products: Optional[int]
    tol: Optional[float]
    seed: int

    @classmethod
    def of(cls, k: Any, block_size: Any, max_products: Any, tol: Any, seed: Any, where: str) -> "_LanczosSettings":
        """Checks what can be checked before the operator's size is known."""
        k = positive_int_argument(k, "k", where)
        block_size = positive_int_argument(block_size, "block_size", where)
        if max_products is not None:
            max_products = positive_int_argument(max_products, "max_products", where)
            if max_products < k:
                raise ValueError(
                    f"{where}: `max_products`={max_products} is below `k`={k}; at least k products are needed."
                )
        if tol is not None:
            tol = real_number_argument(tol, "tol", where)
            if tol <= 0:
                raise ValueError(f"{where}: `tol` must be positive, got {tol}.")
        return cls(k, block_size, max_products, tol, _seed_argument(seed, where))


def _eigenpairs(
    apply: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...], settings: _LanczosSettings,
    dtype: torch.dtype, device: torch.device, where: str,
) -> Eigenpairs:
    size, k = math.prod(shape), settings.k
    if k > size:
        raise ValueError(f"{where}: `k`={k} exceeds the number of kernel coordinates {size} (shape {shape}).")
    max_products = min(size, max(100, 20 * k)) if settings.max_products is None else settings.max_products
    tol = torch.finfo(dtype).eps ** 0.5 if settings.tol is None else settings.tol
    outcome = block_lanczos(
        apply, size, k, block_size=min(settings.block_size, size), max_products=max_products, tol=tol,
        seed=settings.seed, dtype=dtype, device=device, where=where,
    )
    if not outcome.converged:
        warnings.warn(
            f"{where}: not converged after {outcome.products} products: the largest residual "
            f"||A v - lambda v|| / |lambda| is {float((outcome.residuals / outcome.eigenvalues.abs()).max()):.3e}, "
            f"above tol={tol:.1e}. Raise `max_products` or `tol`.",
            RuntimeWarning, stacklevel=user_stacklevel(),
        )
    vectors = outcome.eigenvectors.reshape(*shape, k)
    return Eigenpairs(outcome.eigenvalues, vectors, outcome.residuals, outcome.products, outcome.converged)


def _dtype_argument(value: Any, where: str) -> torch.dtype:
    if value is None:
        return torch.get_default_dtype()
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"{where}: `dtype` must be None or a floating-point torch.dtype, got {show(value)}.")
    return value


def _probes_argument(value: Any, where: str) -> int:
    count = non_negative_int_argument(value, "probes", where)
    if count < 2:
        raise ValueError(f"{where}: `probes` must be at least 2 (a standard error needs two samples), got {count}.")
    return count


def _seed_argument(value: Any, where: str) -> int:
    return non_negative_int_argument(value, "seed", where)


def _shape_argument(value: Any, where: str) -> tuple[int, ...]:
    sizes = (value,) if isinstance(value, numbers.Integral) and not isinstance(value, bool) else value
    try:
        shape = tuple(sizes)
    except TypeError:
        shape = None
    if shape is None or any(isinstance(s, bool) or not isinstance(s, numbers.Integral) for s in shape):
        raise TypeError(f"{where}: `shape` must be an int or a sequence of ints, got {show(value)}.")
    if not shape or any(s <= 0 for s in shape):
        raise ValueError(f"{where}: `shape` must be non-empty with positive sizes, got {shape}.")
    return tuple(int(s) for s in shape)


def _checked_vector(value: Any, shape: tuple[int, ...], where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape:
        got = tuple(value.shape) if isinstance(value, torch.Tensor) else show(value)
        raise ValueError(f"{where}: `matvec` must return a tensor of shape {shape}, like its argument, got {got}.")
    return value
