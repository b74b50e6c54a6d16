"""Gradient descent on the mean squared error, in closed form."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Union

import torch

from .._layout.kernel_layout import paired_matrix
from .._utils.checks import finite_tensor_argument, real_number_argument, show
from ._layout import TargetLayout, as_tensor, broadcast
from ._linalg import Cholesky, Eigenbasis, expm1_decay, expm1_decay_over_value, regularised

Prediction = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def gradient_descent_mse(
    k_train_train: torch.Tensor,
    y_train: torch.Tensor,
    learning_rate: float = 1.0,
    diag_reg: float = 0.0,
    diag_reg_absolute_scale: bool = False,
    trace_axes: Any = (-1,),
) -> Callable[..., Prediction]:
    """Predicts continuous-time gradient descent on the mean squared error from a kernel.

    Training the linearised network (or an infinitely wide one) with gradient flow on
    ``loss = ||f(x_train) - y_train||^2 / (2 * y_train.numel())`` moves its outputs as
    ``df/dt = -learning_rate * K (f - y_train) / y_train.numel()``. That is solved in closed form:
    ``f_t = y + exp(-eta t K / |y|) (f_0 - y)`` on the training set, and
    ``f_test_t = f_test_0 + K_test_train K^{-1} (exp(-eta t K / |y|) - I) (f_0 - y)`` on test
    points. Time ``t`` counts steps: the absolute time is ``learning_rate * t``. The
    eigendecomposition of ``k_train_train`` (finite ``t``) and its Cholesky factor (``t=None``)
    are computed on first use and cached.

    Args:
        k_train_train: the kernel on the training points, in the layout of this library's kernel
            functions with the same ``trace_axes`` and no ``diagonal_axes`` (see NOTE: [Kernels as
            matrices] in ``torchntk/predict/_layout.py``): ``(N, N)`` for targets ``(N, O)`` with
            the logits traced, ``(N, N, O, O)`` with ``trace_axes=()``.
        y_train: targets, shape ``(N, ...)``.
        learning_rate: the step size ``eta``. Default: 1.
        diag_reg: adds ``diag_reg * I`` to the kernel. Default: 0.
        diag_reg_absolute_scale: ``diag_reg`` is absolute (``True``) or relative to the kernel's mean
            diagonal (``False``). Default: ``False``.
        trace_axes: the axes of ``y_train`` the kernel traced; they evolve independently with
            the same kernel (``K (x) I``). Default: ``(-1,)``. For the exact dynamics of a finite
            network use ``()`` and a full kernel.

    Returns:
        ``predict_fn(t=None, fx_train_0=0., fx_test_0=None, k_test_train=None)``:

        - ``t``: ``None`` for infinite time (a linear solve instead of the eigendecomposition),
          or a number or tensor of times in steps; the predictions gain its shape as leading
          axes.
        - ``fx_train_0``: the outputs on the training points at ``t = 0`` (a tensor
          broadcastable to ``y_train``, or a number); ``None`` to predict the test points only.
        - ``fx_test_0``: the outputs on the test points at ``t = 0``; ``None`` to predict the
          training points only.
        - ``k_test_train``: the test-train kernel, needed with ``fx_test_0``: ``(N_test, N)``
          (or ``(N_test, N, O, O)``).

        It returns the training-set predictions, the test-set predictions, or both as a tuple
        ``(train, test)``, in the kernel's dtype and device.

    Raises:
        ValueError: kernels whose shapes do not fit ``y_train`` and ``trace_axes``; ``fx_test_0``
            without ``k_test_train``; outputs that do not broadcast; at ``t=None``, a kernel that is
            not positive definite (even after jitter); NaN or infinite kernels, targets, outputs,
            times, ``learning_rate`` or ``diag_reg``.
        TypeError: arguments of the wrong type (e.g. a ``learning_rate`` that is not a number).

    Example:
        >>> import torch
        >>> from torchntk.predict import gradient_descent_mse
        >>> k = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
        >>> y = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
        >>> predict = gradient_descent_mse(k, y)
        >>> start, end = predict(t=torch.tensor([0.0, 1e6]))          # from 0 to the targets
        >>> torch.equal(start, torch.zeros_like(y)), torch.allclose(end, y)
        (True, True)
        >>> k_test = torch.tensor([[1.0, 0.2]], dtype=torch.float64)
        >>> train, test = predict(None, 0.0, torch.zeros(1, 1, dtype=torch.float64), k_test)
        >>> torch.allclose(test, k_test @ torch.linalg.solve(k, y))
        True
    """
    where = "gradient_descent_mse"
    learning_rate = real_number_argument(learning_rate, "learning_rate", where)
    diag_reg = real_number_argument(diag_reg, "diag_reg", where)
    layout = TargetLayout.of(y_train, trace_axes, where)
    n = layout.shape[0]
    matrix = regularised(layout.matrix(k_train_train, "k_train_train", n, n, where), diag_reg, diag_reg_absolute_scale)
    targets = layout.flatten(y_train.to(matrix))
    size = y_train.numel()

    @functools.lru_cache(maxsize=1)
    def eigenbasis() -> Eigenbasis:
        return Eigenbasis.of(matrix)

    @functools.lru_cache(maxsize=1)
    def cholesky() -> Cholesky:
        return Cholesky.of(matrix, "k_train_train", "predict_fn")

    def predict_fn(
        t: Any = None, fx_train_0: Any = 0.0, fx_test_0: Optional[torch.Tensor] = None,
        k_test_train: Optional[torch.Tensor] = None,
    ) -> Prediction:
        call = "predict_fn"
        if fx_train_0 is None and fx_test_0 is None:
            raise ValueError(f"{call}: `fx_train_0` and `fx_test_0` are both None: there is nothing to predict.")
        start = 0.0 if fx_train_0 is None else fx_train_0
        start = layout.flatten(broadcast(as_tensor(start, matrix, "fx_train_0", call), layout.shape, "fx_train_0", call))
        residual = start - targets
        test = None
        if fx_test_0 is not None:
            test = _test_side(layout, matrix, fx_test_0, k_test_train, call)
        elif k_test_train is not None:
            raise ValueError(f"{call}: `k_test_train` was given without `fx_test_0`; pass the test outputs at t=0 too.")

        if t is None:
            train_t = layout.unflatten(targets, n)
            if test is not None:
                cross, test_start, n_test = test
                test_t = layout.unflatten(test_start - cross @ cholesky().solve(residual), n_test)
        else:
            times = as_tensor(t, matrix, "t", call) * learning_rate
            lead = tuple(times.shape)
            times = times.reshape(-1) / size
            basis = eigenbasis()
            train_t = layout.unflatten(start + basis.apply(expm1_decay(basis.values, times), residual), n, lead)
            if test is not None:
                cross, test_start, n_test = test
                change = torch.einsum("ij,mjk->mik", cross, basis.apply(expm1_decay_over_value(basis.values, times), residual))
                test_t = layout.unflatten(test_start + change, n_test, lead)
        if fx_test_0 is None:
            return train_t
        if fx_train_0 is None:
            return test_t
        return train_t, test_t

    return predict_fn


def _test_side(layout: TargetLayout, matrix: torch.Tensor, fx_test_0: Any, k_test_train: Any, where: str):
    """``(test-train matrix, flattened test outputs at 0, number of test points)``."""
    if k_test_train is None:
        raise ValueError(f"{where}: `fx_test_0` needs `k_test_train`, the kernel between the test and the training points.")
    start = as_tensor(fx_test_0, matrix, "fx_test_0", where)
    if start.ndim == 0:
        raise ValueError(f"{where}: `fx_test_0` must have a batch axis (the test points), got a scalar.")
    n_test = start.shape[0]
    shape = (n_test,) + layout.shape[1:]
    start = layout.flatten(broadcast(start, shape, "fx_test_0", where))
    cross = layout.matrix(k_test_train, "k_test_train", n_test, layout.shape[0], where).to(matrix)
    return cross, start, n_test


def max_learning_rate(
    ntk_train_train: torch.Tensor, y_train_size: Optional[int] = None, momentum: float = 0.0, eps: float = 1e-12
) -> float:
    """The largest learning rate for which gradient descent on the MSE does not diverge.

    For ``loss = ||f - y||^2 / (2 * y_train_size)`` the function-space step
    ``I - eta / y_train_size * NTK`` contracts for ``eta < 2 * y_train_size / lambda_max``, and with
    heavy-ball momentum ``m`` for ``eta < 2 (1 + m) y_train_size / lambda_max``.

    Args:
        ntk_train_train: an NTK on the training points, any layout of pairs of axes
            (``(N, N)``, ``(N, N, O, O)``, ...).
        y_train_size: ``y_train.numel()``; ``None`` takes the kernel matrix's size, which is right
            for a full kernel (``trace_axes=()``). Default: ``None``.
        momentum: the heavy-ball momentum. Default: 0.
        eps: added to ``lambda_max`` to avoid dividing by zero. Default: 1e-12.

    Returns:
        The learning rate, a Python float.

    Raises:
        ValueError: a kernel with an odd number of axes or unequal pairs, or NaN/infinite entries.
        TypeError: a kernel that is not a tensor; ``momentum`` or ``eps`` not a number.

    Example:
        >>> import torch
        >>> from torchntk.predict import max_learning_rate
        >>> round(max_learning_rate(torch.tensor([[2.0, 0.0], [0.0, 1.0]])), 6)   # 2 * 2 / lambda_max 2
        2.0
    """
    where = "max_learning_rate"
    if not isinstance(ntk_train_train, torch.Tensor):
        raise TypeError(f"{where}: `ntk_train_train` must be a tensor, got {show(ntk_train_train)}.")
    finite_tensor_argument(ntk_train_train, "ntk_train_train", where)
    momentum = real_number_argument(momentum, "momentum", where)
    eps = real_number_argument(eps, "eps", where)
    shape = tuple(ntk_train_train.shape)
    if len(shape) % 2 or shape[0::2] != shape[1::2] or not shape:
        raise ValueError(f"{where}: `ntk_train_train` must have pairs of equal axes, e.g. (N, N) or (N, N, O, O), got {shape}.")
    matrix = paired_matrix(ntk_train_train)
    rows = matrix.shape[0]
    largest = torch.linalg.eigvalsh((matrix + matrix.T).double() / 2)[-1].item()
    factor = rows if y_train_size is None else y_train_size
    return 2 * (1 + momentum) * factor / (largest + eps)
