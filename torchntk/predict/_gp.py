"""Exact Gaussian-process posteriors with NNGP and NTK kernels."""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Sequence, Union

import torch

from .._call.outputs import results_type
from .._utils.checks import real_number_argument, show
from ._layout import TargetLayout
from ._linalg import Cholesky, regularised

GP_NAMES = ("nngp", "ntk", "ntkgp")


class Gaussian(NamedTuple):
    """A mean and a covariance.

    Attributes:
        mean: the shape of the outputs, e.g. ``(N_test, O)``.
        covariance: the layout of a kernel on the test points, e.g. ``(N_test, N_test)``.
    """

    mean: torch.Tensor
    covariance: torch.Tensor


def gaussians_type(fields: tuple[str, ...]) -> type:
    """The ``Gaussians`` namedtuple class with these fields, in this order."""
    return results_type("Gaussians", fields)


def canonical_names(get: Union[None, str, Sequence[str]], allowed: tuple[str, ...], where: str) -> tuple[tuple[str, ...], bool]:
    """``(names, bare)`` as for ``get`` of the kernel functions, from ``allowed`` names."""
    if get is None:
        return ("nngp", "ntk"), False
    bare = isinstance(get, str)
    names = (get,) if bare else tuple(get) if isinstance(get, (tuple, list)) else None
    if names is None or not names or not all(isinstance(name, str) for name in names):
        raise TypeError(f"{where}: `get` must be None, a name or a tuple of names from {allowed}, got {show(get)}.")
    names = tuple(name.lower() for name in names)
    unknown = [name for name in names if name not in allowed]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"{where}: `get` must name each of {allowed} at most once, got {show(get)}.")
    return names, bare


def kernel_named(kernels: Any, name: str, argument: str, where: str) -> torch.Tensor:
    """``kernels.<name>`` for an ``EmpiricalKernel``-like namedtuple, or a bare tensor itself."""
    if isinstance(kernels, torch.Tensor):
        return kernels
    value = getattr(kernels, name, None)
    if not isinstance(value, torch.Tensor):
        raise ValueError(
            f"{where}: `{argument}` must be a tensor or hold a {name!r} kernel (an EmpiricalKernel from "
            f"kernel_fn(..., get=({name!r}, ...))), got {show(kernels)}."
        )
    return value


def gp_inference(
    k_train_train: Any,
    y_train: torch.Tensor,
    diag_reg: float = 0.0,
    diag_reg_absolute_scale: bool = False,
    trace_axes: Any = (-1,),
) -> Callable[..., Any]:
    """Posterior of a Gaussian process with NNGP or NTK covariance, on test points.

    With ``K`` the NNGP and ``T`` the NTK (``_dd`` train-train, ``_td`` test-train, ``_tt``
    test-test), ``y`` the targets and every solve a Cholesky solve:

    - ``"nngp"``: the posterior of the infinitely wide Bayesian network: mean
      ``K_td K_dd^{-1} y``, covariance ``K_tt - K_td K_dd^{-1} K_dt``;
    - ``"ntk"``: the outputs of an infinite ensemble of infinitely wide networks trained to
      convergence by gradient flow on the MSE: mean ``T_td T_dd^{-1} y``, covariance
      ``K_tt + T_td T_dd^{-1} K_dd T_dd^{-1} T_dt - (T_td T_dd^{-1} K_dt + transpose)``;
    - ``"ntkgp"``: the Gaussian process with NTK covariance: mean ``T_td T_dd^{-1} y``,
      covariance ``T_tt - T_td T_dd^{-1} T_dt``.

    Factors are computed on first use and cached.

    Args:
        k_train_train: the train-train kernel: a tensor (used for every name in ``get``) or an
            ``EmpiricalKernel`` namedtuple with ``nngp`` and/or ``ntk`` fields. The layout is that of
            NOTE: [Kernels as matrices] (``torchntk/predict/_layout.py``).
        y_train: targets ``(N, ...)``.
        diag_reg: adds ``diag_reg * I`` to the train-train kernels. Default: 0.
        diag_reg_absolute_scale: ``diag_reg`` absolute (``True``) or relative to the mean diagonal.
            Default: ``False``.
        trace_axes: the axes of ``y_train`` the kernels traced (``K (x) I`` assumed). Default:
            ``(-1,)``.

    Returns:
        ``predict_fn(get=None, k_test_train=None, k_test_test=None)``. ``get``: ``"nngp"``,
        ``"ntk"``, ``"ntkgp"`` or a tuple of them (``None``: ``("nngp", "ntk")``). The test kernels
        are tensors or namedtuples like ``k_train_train``. ``"ntk"`` with ``k_test_test`` needs
        both kernels in the train-train and test-train arguments, and the NNGP as
        ``k_test_test``. ``"ntkgp"`` needs the NTK as ``k_test_test``. Without ``k_test_train`` the
        training points are predicted: their mean is ``y_train`` and their covariance 0. Without
        ``k_test_test`` only means are returned, otherwise :class:`Gaussian` s. A name gives its
        result bare; a tuple gives a ``Gaussians`` namedtuple.

    Raises:
        ValueError: shapes that do not fit; a kernel missing for what ``get`` asks; a train-train
            kernel that is not positive definite, even after jitter; NaN or infinite kernels or
            targets.
        TypeError: arguments of the wrong type.

    Example:
        >>> import torch
        >>> from torchntk.predict import gp_inference
        >>> k = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
        >>> y = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
        >>> k_test_train = torch.tensor([[1.0, 0.2]], dtype=torch.float64)
        >>> k_test_test = torch.tensor([[1.5]], dtype=torch.float64)
        >>> posterior = gp_inference(k, y)("nngp", k_test_train, k_test_test)
        >>> torch.allclose(posterior.mean, k_test_train @ torch.linalg.solve(k, y))
        True
        >>> posterior.covariance.shape
        torch.Size([1, 1])
    """
    where = "gp_inference"
    diag_reg = real_number_argument(diag_reg, "diag_reg", where)
    layout = TargetLayout.of(y_train, trace_axes, where)
    n = layout.shape[0]

    @functools.lru_cache(maxsize=2)
    def train_matrix(name: str) -> torch.Tensor:
        return layout.matrix(kernel_named(k_train_train, name, "k_train_train", "predict_fn"), "k_train_train", n, n, "predict_fn")

    @functools.lru_cache(maxsize=2)
    def factor(name: str) -> Cholesky:
        matrix = regularised(train_matrix(name), diag_reg, diag_reg_absolute_scale)
        return Cholesky.of(matrix, f"k_train_train ({name})", "predict_fn")

    @functools.lru_cache(maxsize=2)
    def weights(name: str) -> torch.Tensor:
        return factor(name).solve(layout.flatten(y_train.to(train_matrix(name))))

    def predict_fn(get: Union[None, str, Sequence[str]] = None, k_test_train: Any = None, k_test_test: Any = None) -> Any:
        call = "predict_fn"
        names, bare = canonical_names(get, GP_NAMES, call)
        results = {}
        for name in names:
            kernel = "nngp" if name == "nngp" else "ntk"
            if k_test_train is None:
                mean = y_train.to(train_matrix(kernel))
                result: Any = mean
                if k_test_test is not None:
                    zeros = torch.zeros_like(train_matrix(kernel))
                    result = Gaussian(mean, layout.kernel(zeros, n))
                results[name] = result
                continue
            n_test = _test_size(k_test_train, kernel, call)
            cross = layout.matrix(kernel_named(k_test_train, kernel, "k_test_train", call), "k_test_train", n_test, n, call)
            mean = layout.unflatten(cross @ weights(kernel), n_test)
            if k_test_test is None:
                results[name] = mean
                continue
            if name == "ntk" and (isinstance(k_train_train, torch.Tensor) or isinstance(k_test_train, torch.Tensor)):
                raise ValueError(
                    f"{call}: the NTK posterior covariance needs both the NNGP and the NTK of the train-train and "
                    f"test-train pairs: pass EmpiricalKernel namedtuples from kernel_fn(..., get=('nngp', 'ntk')), "
                    f"not bare tensors."
                )
            results[name] = Gaussian(mean, _covariance(name, layout, factor, train_matrix, cross, k_test_train, k_test_test, n, n_test))
        if bare:
            return results[names[0]]
        return gaussians_type(names)(**results)

    return predict_fn


def _test_size(k_test_train: Any, kernel: str, where: str) -> int:
    value = kernel_named(k_test_train, kernel, "k_test_train", where)
    if value.ndim == 0:
        raise ValueError(f"{where}: `k_test_train` must have a test axis, got a scalar.")
    return value.shape[0]


def _covariance(name, layout, factor, train_matrix, cross, k_test_train, k_test_test, n, n_test) -> torch.Tensor:
    where = "predict_fn"
    prior_name = "ntk" if name == "ntkgp" else "nngp"
    prior = layout.matrix(kernel_named(k_test_test, prior_name, "k_test_test", where), "k_test_test", n_test, n_test, where)
    if name in ("nngp", "ntkgp"):
        solved = factor("nngp" if name == "nngp" else "ntk").solve(cross.T)
        return layout.kernel(prior - cross @ solved, n_test)
    nngp_cross = layout.matrix(kernel_named(k_test_train, "nngp", "k_test_train", where), "k_test_train", n_test, n, where)
    solved = factor("ntk").solve(cross.T)                         # T_dd^{-1} T_dt
    mixed = cross @ factor("ntk").solve(nngp_cross.T)             # T_td T_dd^{-1} K_dt
    covariance = prior + solved.T @ train_matrix("nngp") @ solved - mixed - mixed.T
    return layout.kernel(covariance, n_test)
