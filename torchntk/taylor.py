"""Linearisation and Taylor expansion of a model around fixed parameters."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable

import torch
from torch.func import jvp

from ._model.functional import FunctionalModel, functional_model
from ._model.unfused import forward_mode_kernels
from ._utils import checks as _checks
from ._utils.threads import FORWARD_MODE_LOCK
from ._utils.tree import Flat
from ._utils.types import Model, PyTree

__all__ = ["linearize", "taylor_expand"]


def _expansion_model(f: Model, params: Any, where: str) -> FunctionalModel:
    """The model with its expansion point copied, so later in-place training cannot move it."""
    _checks.callable_model_argument(f, where)
    model = functional_model(f, params, where)
    return dataclasses.replace(model, params=tuple(param.clone() for param in model.params))


def _output_leaves(model: FunctionalModel, args: tuple, kwargs: dict, structure: list) -> Callable:
    def forward(param_leaves: tuple) -> tuple:
        flat = Flat.of(model.call(param_leaves, args, kwargs))
        structure[:] = [flat]
        return flat.leaves
    return forward


def linearize(f: Model, params: Any = None) -> Callable[..., PyTree]:
    """Returns the first-order Taylor expansion of ``f`` around ``params``.

    ``f_lin(p, *args, **kwargs) = f(params, *args) + J(params) (p - params)``, evaluated with one
    forward-mode pass (``torch.func.jvp``); training ``f_lin`` is training the linearised network
    whose kernel is the empirical NTK at ``params``.

    Args:
        f: a function ``f(params, *args, **kwargs)``, or an ``nn.Module`` called as
            ``module(*args, **kwargs)``.
        params: the expansion point: the parameter pytree of ``f``; for a module, optional, a
            mapping ``name -> tensor`` (default: its parameters with ``requires_grad=True``, at
            their current values; the others stay constants).

    Returns:
        ``f_lin(p, *args, **kwargs)`` where ``p`` is structured like ``params`` (for a module: a
        mapping with the same names). Positional and keyword arguments are passed through.

    Raises:
        TypeError: ``f`` not callable, bad ``params``.
        ValueError: at call time, ``p`` structured differently from ``params``.

    Example:
        >>> import torch, torchntk
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        >>> params = {k: v.detach().clone() for k, v in model.named_parameters()}
        >>> f_lin = torchntk.linearize(model)
        >>> x = torch.randn(4, 3)
        >>> torch.allclose(f_lin(params, x), model(x))              # exact at the expansion point
        True
        >>> moved = {k: v + 1e-3 for k, v in params.items()}
        >>> f_lin(moved, x).shape
        torch.Size([4, 1])
    """
    where = "linearize"
    model = _expansion_model(f, params, where)

    def f_lin(p: Any, *args: Any, **kwargs: Any) -> PyTree:
        steps = _steps(model, p, "f_lin")
        structure: list = []
        with FORWARD_MODE_LOCK, forward_mode_kernels(bool(model.fused)):  # NOTE: [Threads], [Unfused kernels]
            values, slopes = jvp(_output_leaves(model, args, kwargs, structure), (model.params,), (steps,))
        return structure[0].rebuild([value + slope for value, slope in zip(values, slopes)])

    return f_lin


def taylor_expand(f: Model, params: Any = None, degree: int = 1) -> Callable[..., PyTree]:
    """Returns the Taylor expansion of ``f`` around ``params`` up to ``degree``.

    ``f_tayl(p, *args) = sum_{k=0..degree} D^k f(params)[dp, ..., dp] / k!`` with ``dp = p - params``.
    The directional derivatives come from nested forward-mode passes (``degree`` levels deep).
    ``degree=0`` is ``f(params, ...)``; ``degree=1`` equals :func:`linearize`.

    Args:
        f: as in :func:`linearize`.
        params: as in :func:`linearize`.
        degree: the highest order kept, an int >= 0. Default: ``1``.

    Returns:
        ``f_tayl(p, *args, **kwargs)``, with ``p`` structured like ``params``.

    Raises:
        TypeError: ``degree`` not an int; ``f`` or ``params`` of the wrong type.
        ValueError: ``degree`` negative; at call time, ``p`` structured differently from ``params``.

    Example:
        >>> import torch, torchntk
        >>> f = lambda p, x: torch.sin(p["w"] * x)
        >>> params = {"w": torch.tensor(1.0)}
        >>> f2 = torchntk.taylor_expand(f, params, degree=2)
        >>> x, p = torch.tensor(0.5), {"w": torch.tensor(1.1)}
        >>> exact = torch.sin(x) + x * torch.cos(x) * 0.1 - x**2 * torch.sin(x) * 0.1**2 / 2
        >>> torch.allclose(f2(p, x), exact)
        True
    """
    where = "taylor_expand"
    if isinstance(degree, bool) or not isinstance(degree, numbers.Integral):
        raise TypeError(f"{where}: `degree` must be an int >= 0, got {_checks.show(degree)}.")
    if degree < 0:
        raise ValueError(f"{where}: `degree` must be an int >= 0, got {degree}.")
    model = _expansion_model(f, params, where)

    def f_tayl(p: Any, *args: Any, **kwargs: Any) -> PyTree:
        steps = _steps(model, p, "f_tayl")
        structure: list = []
        forward = _output_leaves(model, args, kwargs, structure)

        def derivatives(param_leaves: tuple, order: int) -> tuple:
            """``(D^0 f, ..., D^order f)`` along ``steps``, each a tuple of output leaves."""
            if order == 0:
                return (forward(param_leaves),)
            lower, higher = jvp(lambda leaves: derivatives(leaves, order - 1), (param_leaves,), (steps,))
            return (lower[0],) + tuple(higher)

        with FORWARD_MODE_LOCK, forward_mode_kernels(bool(model.fused)):  # NOTE: [Threads], [Unfused kernels]
            terms = derivatives(model.params, degree)
        leaves = [
            sum(term[index] / math.factorial(order) for order, term in enumerate(terms))
            for index in range(len(terms[0]))
        ]
        return structure[0].rebuild(leaves)

    return f_tayl


def _steps(model: FunctionalModel, p: Any, where: str) -> tuple[torch.Tensor, ...]:
    leaves = model.leaves_like_params(p, "p", where)
    return tuple(new - old for new, old in zip(leaves, model.params))
