"""Gradient descent (with or without momentum) on any loss, by integrating the function-space ODE.

NOTE: [Function-space ODE]
Under gradient flow with learning rate ``eta`` the outputs of the linearised network move as
``df/dt = -eta K grad_f loss(f)``: on the training points with ``K = k_train_train``, on test
points with ``K = k_test_train``, the gradient always taken at the training outputs. Heavy-ball
momentum ``m`` in continuous time, in units of ``sqrt(eta)`` steps, adds a velocity ``q``:
``df/ds = q``, ``dq/ds = -K grad_f loss(f) - (1 - m) / sqrt(eta) q`` with ``s = sqrt(eta) t``.
The ODE is integrated by ``torchdiffeq`` (an adaptive Dormand-Prince solver by default), an
optional dependency: ``pip install 'torchntk[predict]'``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Optional, Union

import torch
from torch.func import grad

from .._utils.checks import real_number_argument, show
from ._layout import TargetLayout, as_tensor, broadcast


@dataclass
class ODEState:
    """The state of the function-space ODE: outputs and (with momentum) their velocities.

    Attributes:
        fx_train, fx_test: outputs on the training and test points (``None``: not tracked).
        qx_train, qx_test: their velocities under momentum (``None`` without momentum).
    """

    fx_train: Optional[torch.Tensor] = None
    fx_test: Optional[torch.Tensor] = None
    qx_train: Optional[torch.Tensor] = None
    qx_test: Optional[torch.Tensor] = None


def gradient_descent(
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    k_train_train: torch.Tensor,
    y_train: torch.Tensor,
    learning_rate: float = 1.0,
    momentum: Optional[float] = None,
    trace_axes: Any = (-1,),
    *,
    rtol: float = 1e-7,
    atol: float = 1e-9,
    method: str = "dopri5",
) -> Callable[..., Any]:
    """Predicts gradient descent on any differentiable loss, by solving the function-space ODE.

    See NOTE: [Function-space ODE] in ``torchntk/predict/_ode.py``. Without momentum the absolute
    time is ``learning_rate * t``; with momentum it is ``sqrt(learning_rate) * t``, so ``t`` counts
    steps either way.

    Args:
        loss: ``loss(fx_train, y_train) -> scalar``, differentiable in ``fx_train`` with
            ``torch.func.grad``; it must treat the batch and output axes alike (as the MSE and
            cross-entropy averaged over both do).
        k_train_train: the train-train kernel (NOTE: [Kernels as matrices] in
            ``torchntk/predict/_layout.py``).
        y_train: targets ``(N, ...)``.
        learning_rate: the step size. Default: 1.
        momentum: the heavy-ball momentum in ``[0, 1)``, or ``None`` for plain gradient descent.
            Default: ``None``.
        trace_axes: the axes of ``y_train`` the kernel traced (``K (x) I``). Default: ``(-1,)``.
        rtol, atol: the solver's tolerances. Defaults: 1e-7, 1e-9.
        method: a ``torchdiffeq.odeint`` method. Default: ``"dopri5"``.

    Returns:
        ``predict_fn(t, fx_train_or_state_0=0., fx_test_0=None, k_test_train=None)``. ``t`` is a
        number or a tensor of times in steps, in any order; the results gain its shape as
        leading axes. Pass the outputs at ``t = 0`` as in :func:`gradient_descent_mse`, or an
        :class:`ODEState` (for momentum, e.g. to resume), which makes the result an
        :class:`ODEState` too.

    Raises:
        ImportError: ``torchdiffeq`` is not installed.
        ValueError: shapes that do not fit; ``t=None`` (the ODE has no closed-form limit:
            integrate to a large finite ``t``); negative times; ``momentum`` outside ``[0, 1)``;
            velocities in an :class:`ODEState` without ``momentum``; NaN or infinite kernels,
            targets, outputs or ``learning_rate``.
        TypeError: arguments of the wrong type.

    Example:
        >>> import torch
        >>> from torchntk.predict import gradient_descent, gradient_descent_mse
        >>> k = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
        >>> y = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
        >>> mse = lambda f, y: ((f - y) ** 2).sum() / (2 * y.numel())
        >>> ode = gradient_descent(mse, k, y, rtol=1e-10, atol=1e-12)(t=torch.tensor([1.0, 5.0]))
        >>> torch.allclose(ode, gradient_descent_mse(k, y)(t=torch.tensor([1.0, 5.0])), atol=1e-8)
        True
    """
    where = "gradient_descent"
    try:
        import torchdiffeq
    except ImportError:
        raise ImportError(
            f"{where} integrates an ODE with torchdiffeq, which is not installed: pip install 'torchntk[predict]' "
            f"(or pip install torchdiffeq). For the MSE, gradient_descent_mse needs no solver."
        ) from None
    if not callable(loss):
        raise TypeError(f"{where}: `loss` must be callable as loss(fx_train, y_train), got {show(loss)}.")
    learning_rate = real_number_argument(learning_rate, "learning_rate", where)
    if momentum is not None and not (isinstance(momentum, (int, float)) and 0 <= momentum < 1):
        raise ValueError(f"{where}: `momentum` must be None or a number in [0, 1), got {show(momentum)}.")
    layout = TargetLayout.of(y_train, trace_axes, where)
    n = layout.shape[0]
    matrix = layout.matrix(k_train_train, "k_train_train", n, n, where)
    targets = y_train.to(matrix)
    loss_gradient = grad(lambda outputs: loss(outputs, targets))
    scale = learning_rate if momentum is None else math.sqrt(learning_rate)
    friction = None if momentum is None else (1 - momentum) / scale

    def predict_fn(
        t: Any = None, fx_train_or_state_0: Union[Any, ODEState] = 0.0, fx_test_0: Optional[torch.Tensor] = None,
        k_test_train: Optional[torch.Tensor] = None,
    ) -> Any:
        call = "predict_fn"
        if t is None:
            raise ValueError(
                f"{call}: gradient_descent has no closed form at t=None (infinite time); pass a large finite t, "
                f"or use gradient_descent_mse for the MSE."
            )
        times = as_tensor(t, matrix, "t", call)
        if bool((times < 0).any()):
            raise ValueError(f"{call}: `t` must be non-negative, got {times.min().item():g}.")
        state = _initial_state(fx_train_or_state_0, fx_test_0, k_test_train, layout, matrix, momentum, call)
        cross = None
        if state.fx_test is not None:
            cross = layout.matrix(k_test_train, "k_test_train", state.fx_test.shape[0], n, call).to(matrix)
        tracked = [field.name for field in fields(ODEState) if getattr(state, field.name) is not None]
        # The solver wants increasing times starting where the state is given: integrate over
        # the sorted unique times from 0 and put the results back in the caller's order.
        unique, order = torch.unique(times.reshape(-1), sorted=True, return_inverse=True)
        skip = int(unique.numel() == 0 or unique[0] > 0)  # the solver starts at t = 0, where the state is given
        grid = torch.cat([unique.new_zeros(skip), unique]) * scale

        def derivative(_: torch.Tensor, values: tuple) -> tuple:
            current = dict(zip(tracked, values))
            push = -_apply(layout, matrix, loss_gradient(current["fx_train"]))
            changes = {"fx_train": push}
            if cross is not None:
                changes["fx_test"] = -_apply(layout, cross, loss_gradient(current["fx_train"]), current["fx_test"].shape[0])
            if friction is not None:
                changes["qx_train"] = changes.pop("fx_train") - friction * current["qx_train"]
                changes["fx_train"] = current["qx_train"]
                if cross is not None:
                    changes["qx_test"] = changes.pop("fx_test") - friction * current["qx_test"]
                    changes["fx_test"] = current["qx_test"]
            return tuple(changes[name] for name in tracked)

        solution = torchdiffeq.odeint(
            derivative, tuple(getattr(state, name) for name in tracked), grid, rtol=rtol, atol=atol, method=method
        )
        results = {
            name: values[skip:][order].reshape(*times.shape, *values.shape[1:]) for name, values in zip(tracked, solution)
        }
        final = replace(ODEState(), **results)
        if isinstance(fx_train_or_state_0, ODEState):
            return final
        if fx_test_0 is None:
            return final.fx_train
        if fx_train_or_state_0 is None:
            return final.fx_test
        return final.fx_train, final.fx_test

    return predict_fn


def _apply(layout: TargetLayout, matrix: torch.Tensor, gradient: torch.Tensor, n_rows: Optional[int] = None) -> torch.Tensor:
    """The kernel (as ``K (x) I`` over traced axes) applied to a gradient shaped like ``y_train``."""
    product = matrix @ layout.flatten(gradient)
    return layout.unflatten(product, layout.shape[0] if n_rows is None else n_rows)


def _initial_state(start, fx_test_0, k_test_train, layout, matrix, momentum, where) -> ODEState:
    if isinstance(start, ODEState):
        if fx_test_0 is not None:
            raise ValueError(f"{where}: give the test outputs inside the ODEState, not as `fx_test_0` too.")
        state = start
    else:
        state = ODEState(start, fx_test_0)
    if momentum is None and (state.qx_train is not None or state.qx_test is not None):
        raise ValueError(f"{where}: the ODEState has velocities (qx_train/qx_test), but `momentum` is None.")
    train = broadcast(as_tensor(0.0 if state.fx_train is None else state.fx_train, matrix, "fx_train_0", where),
                      layout.shape, "fx_train_0", where)
    test = None
    if state.fx_test is not None:
        if k_test_train is None:
            raise ValueError(f"{where}: test outputs need `k_test_train`, the kernel between test and training points.")
        test = as_tensor(state.fx_test, matrix, "fx_test_0", where)
        test = broadcast(test, (test.shape[0],) + layout.shape[1:], "fx_test_0", where)
    elif k_test_train is not None:
        raise ValueError(f"{where}: `k_test_train` was given without test outputs at t=0.")
    if momentum is None:
        return ODEState(train.clone(), None if test is None else test.clone())
    q_train = torch.zeros_like(train) if state.qx_train is None else broadcast(
        as_tensor(state.qx_train, matrix, "qx_train", where), layout.shape, "qx_train", where)
    q_test = None
    if test is not None:
        q_test = torch.zeros_like(test) if state.qx_test is None else broadcast(
            as_tensor(state.qx_test, matrix, "qx_test", where), tuple(test.shape), "qx_test", where)
    return ODEState(train.clone(), None if test is None else test.clone(), q_train.clone(), None if q_test is None else q_test.clone())
