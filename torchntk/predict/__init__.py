"""Predictions of training from kernels: linearised gradient descent and Gaussian processes.

Computing an NTK is rarely the end: these functions turn the kernels of this library into the
outputs of the linearised (or infinitely wide) network at any training time, and into Bayesian
posteriors. The semantics are those of neural-tangents' ``predict`` module; the kernels' layout
is read as NOTE: [Kernels as matrices] (``_layout.py``) says.

* :func:`gradient_descent_mse`: gradient flow on the MSE in closed form (eigendecomposition).
* :func:`gradient_descent`: any loss, with or without momentum, by an ODE solver (torchdiffeq).
* :func:`gp_inference`: exact NNGP / NTK / NTK-GP posteriors (Cholesky solves).
* :func:`gradient_descent_mse_ensemble`: mean and covariance over initialisations, from a kernel
  function.
* :func:`max_learning_rate`: the largest stable learning rate for the MSE.

Example:
    >>> import torch, torchntk
    >>> from torchntk import predict
    >>> model = torch.nn.Sequential(torch.nn.Linear(2, 256), torch.nn.Tanh(), torch.nn.Linear(256, 1)).double()
    >>> x_train, x_test = torch.randn(8, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    >>> y_train = torch.sin(x_train.sum(1, keepdim=True))
    >>> ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0)
    >>> predict_fn = predict.gradient_descent_mse(ntk_fn(x_train), y_train, trace_axes=())
    >>> with torch.no_grad():
    ...     f_train, f_test = model(x_train), model(x_test)
    >>> train_t, test_t = predict_fn(torch.tensor([10.0, 100.0]), f_train, f_test, ntk_fn(x_test, x_train))
    >>> train_t.shape, test_t.shape
    (torch.Size([2, 8, 1]), torch.Size([2, 3, 1]))
"""

from .._utils.exports import published
from ._ensemble import gradient_descent_mse_ensemble
from ._gp import Gaussian, gp_inference
from ._mse import gradient_descent_mse, max_learning_rate
from ._ode import ODEState, gradient_descent

__all__ = [
    "Gaussian",
    "ODEState",
    "gp_inference",
    "gradient_descent",
    "gradient_descent_mse",
    "gradient_descent_mse_ensemble",
    "max_learning_rate",
]

published(globals(), __name__)
