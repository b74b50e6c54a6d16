"""Mean and covariance of an ensemble trained by gradient descent on the MSE, from a kernel function."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Sequence, Union

import torch

from .._call.outputs import empirical_kernel_type
from .._utils.checks import real_number_argument, show
from ._gp import Gaussian, canonical_names, gaussians_type, gp_inference
from ._layout import TargetLayout, as_tensor
from ._linalg import Eigenbasis, expm1_decay, expm1_decay_over_value, regularised


def gradient_descent_mse_ensemble(
    kernel_fn: Callable[..., Any],
    x_train: Any,
    y_train: torch.Tensor,
    learning_rate: float = 1.0,
    diag_reg: float = 0.0,
    diag_reg_absolute_scale: bool = False,
    trace_axes: Any = (-1,),
    **kernel_fn_train_train_kwargs: Any,
) -> Callable[..., Any]:
    """Outputs of an ensemble of networks trained by gradient flow on the MSE, over initialisations.

    For networks whose outputs at initialisation are centred Gaussians with covariance ``K``
    (the NNGP) and whose training follows the NTK ``T`` (the infinite-width limit, approximated
    here by this library's empirical or Monte Carlo kernel functions), the outputs at time ``t``
    are Gaussian. Their mean and covariance follow from ``K`` and ``T`` in closed form, through
    the eigendecomposition of the train-train kernel. ``t=None`` gives the converged ensemble:
    :func:`gp_inference`. The loss and time conventions are those of
    :func:`gradient_descent_mse`.

    Args:
        kernel_fn: ``kernel_fn(x1, x2, get, **kwargs)`` returning ``EmpiricalKernel`` s (a
            tuple ``get``) or a bare kernel (a name): :func:`torchntk.empirical_kernel_fn`,
            :func:`torchntk.monte_carlo_kernel_fn`, or either wrapped in :func:`torchntk.batch`.
            Its ``trace_axes`` must be those given here, its ``diagonal_axes`` empty.
        x_train: training inputs.
        y_train: targets ``(N, ...)``.
        learning_rate, diag_reg, diag_reg_absolute_scale, trace_axes: as in
            :func:`gradient_descent_mse`.
        **kernel_fn_train_train_kwargs: passed to ``kernel_fn`` for the train-train kernels (and
            for the others, unless ``predict_fn`` overrides them).

    Returns:
        ``predict_fn(t=None, x_test=None, get=None, compute_cov=False, **kernel_fn_test_kwargs)``:
        ``t`` as in :func:`gradient_descent_mse`; ``x_test=None`` predicts the training points;
        ``get``: ``"nngp"`` (a Bayesian ensemble trained on the readout only), ``"ntk"``, or a tuple
        (``None``: both); ``compute_cov``: also return covariances (:class:`Gaussian` s, the
        covariance in the layout of a kernel on the predicted points). A name gives its result
        bare, a tuple a ``Gaussians`` namedtuple. Train-train kernels and their eigenbases are
        computed once and cached.

    Raises:
        ValueError, TypeError: as :func:`gradient_descent_mse`, and for a ``get`` other than
            ``"nngp"``/``"ntk"``.

    Example:
        >>> import torch, torchntk
        >>> from torchntk.predict import gradient_descent_mse_ensemble
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        >>> kernel_fn = torchntk.empirical_kernel_fn(model.double(), vmap_axes=0)
        >>> x_train, y_train = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
        >>> predict = gradient_descent_mse_ensemble(kernel_fn, x_train, y_train, diag_reg=1e-6)
        >>> out = predict(t=torch.tensor([1.0, 10.0]), x_test=torch.randn(4, 3, dtype=torch.float64),
        ...               get="ntk", compute_cov=True)
        >>> out.mean.shape, out.covariance.shape
        (torch.Size([2, 4, 1]), torch.Size([2, 4, 4]))
    """
    where = "gradient_descent_mse_ensemble"
    if not callable(kernel_fn):
        raise TypeError(f"{where}: `kernel_fn` must be a kernel function, got {show(kernel_fn)}.")
    learning_rate = real_number_argument(learning_rate, "learning_rate", where)
    diag_reg = real_number_argument(diag_reg, "diag_reg", where)
    layout = TargetLayout.of(y_train, trace_axes, where)
    n, size = layout.shape[0], y_train.numel()
    train_kernels: dict[str, torch.Tensor] = {}

    def train_train(names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        missing = tuple(name for name in names if name not in train_kernels)
        if missing:
            computed = kernel_fn(x_train, None, missing, **kernel_fn_train_train_kwargs)
            train_kernels.update({name: getattr(computed, name) for name in missing})
        return {name: train_kernels[name] for name in names}

    @functools.lru_cache(maxsize=2)
    def eigenbasis(name: str) -> Eigenbasis:
        matrix = layout.matrix(train_train((name,))[name], "kernel_fn(x_train, None)", n, n, where)
        return Eigenbasis.of(regularised(matrix, diag_reg, diag_reg_absolute_scale))

    def predict_fn(
        t: Any = None, x_test: Any = None, get: Union[None, str, Sequence[str]] = None, compute_cov: bool = False,
        **kernel_fn_test_kwargs: Any,
    ) -> Any:
        call = "predict_fn"
        names, bare = canonical_names(get, ("nngp", "ntk"), call)
        needed = tuple(name for name in ("nngp", "ntk") if name in names or (name == "nngp" and compute_cov))
        kwargs = {**kernel_fn_train_train_kwargs, **kernel_fn_test_kwargs}
        k_dd = train_train(needed)
        k_td = nngp_tt = None
        if x_test is not None:
            computed = kernel_fn(x_test, x_train, needed, **kwargs)
            k_td = {name: getattr(computed, name) for name in needed}
            if compute_cov:
                nngp_tt = kernel_fn(x_test, None, "nngp", **kwargs)
        if t is None:
            infinite = gp_inference(_named(k_dd), y_train, diag_reg, diag_reg_absolute_scale, tuple(layout.traced))
            # gp_inference predicts the training points (zero covariance) for any k_test_test given
            test_test = nngp_tt if x_test is not None else (True if compute_cov else None)
            return infinite(names[0] if bare else names, None if k_td is None else _named(k_td), test_test)
        n_out = n if x_test is None else k_td[needed[0]].shape[0]
        # Every kernel as a matrix, once: the means and covariances below share them.
        dd = {name: layout.matrix(k_dd[name], "kernel_fn(x_train, None)", n, n, call) for name in needed}
        td = None if k_td is None else {
            name: layout.matrix(k_td[name], "kernel_fn(x_test, x_train)", n_out, n, call) for name in needed
        }
        tt = None if nngp_tt is None else layout.matrix(nngp_tt, "kernel_fn(x_test, None)", n_out, n_out, call)
        like = dd[needed[-1]]
        times = as_tensor(t, like, "t", call) * learning_rate
        lead = tuple(times.shape)
        times = times.reshape(-1) / size
        targets = layout.flatten(y_train.to(like))
        results = {}
        for name in names:
            basis = eigenbasis(name)
            if td is None:
                mean = -basis.apply(expm1_decay(basis.values, times), targets)
            else:
                mean = -torch.einsum("ij,mjk->mik", td[name], basis.apply(expm1_decay_over_value(basis.values, times), targets))
            mean = layout.unflatten(mean, n_out, lead)
            if not compute_cov:
                results[name] = mean
                continue
            results[name] = Gaussian(mean, layout.kernel(_covariance(name, basis, times, dd, td, tt), n_out, lead))
        if bare:
            return results[names[0]]
        return gaussians_type(names)(**results)

    return predict_fn


def _named(kernels: dict[str, torch.Tensor]) -> Any:
    return empirical_kernel_type(tuple(kernels))(**kernels)


def _covariance(name: str, basis: Eigenbasis, times: torch.Tensor, dd: dict, td: Optional[dict], tt: Optional[torch.Tensor]) -> torch.Tensor:
    """``(times, rows, rows)`` covariance of the ensemble's outputs (NT's closed forms), from the
    train-train (``dd``) and test-train (``td``, ``None`` on the training points) matrices by name
    and the test-test NNGP matrix ``tt``."""
    values, vectors = basis.values, basis.vectors
    if td is None:
        if name == "nngp":
            decay = values[None, :] * torch.exp(-2 * times[:, None] * values[None, :])
            return torch.einsum("ij,mj,kj->mik", vectors, decay, vectors)
        propagator = torch.einsum("ij,mj,kj->mik", vectors, torch.exp(-times[:, None] * values[None, :]), vectors)
        return propagator @ dd["nngp"] @ propagator.transpose(1, 2)
    cross = td[name]
    if name == "nngp":
        shrink = torch.einsum("ij,mj,kj->mik", vectors, -expm1_decay_over_value(values, 2 * times), vectors)
        return tt[None] - cross @ shrink @ cross.T
    response = torch.einsum("ij,mj,kj->mik", vectors, -expm1_decay_over_value(values, times), vectors)
    reach = response @ cross.T                                     # (m, n, n_out)
    mixed = cross @ response @ td["nngp"].T                        # (m, n_out, n_out)
    return reach.transpose(1, 2) @ dd["nngp"] @ reach - mixed - mixed.transpose(1, 2) + tt[None]
