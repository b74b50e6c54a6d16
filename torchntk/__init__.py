"""torchntk: empirical neural tangent and NNGP kernels of PyTorch models."""

from . import predict as predict
from ._example_loop import ExampleLoopWarning as ExampleLoopWarning
from ._implementations._choice import AutoChoice as AutoChoice
from ._implementations._choice import Estimate as Estimate
from ._kernel_function import KernelFunction as KernelFunction
from ._precision import precision as precision
from ._types import NtkImplementation as NtkImplementation
from .batching import batch as batch
from .empirical import empirical_kernel_fn as empirical_kernel_fn
from .empirical import empirical_nngp_fn as empirical_nngp_fn
from .empirical import empirical_ntk_fn as empirical_ntk_fn
from .empirical import empirical_ntk_vp_fn as empirical_ntk_vp_fn
from .monte_carlo import monte_carlo_kernel_fn as monte_carlo_kernel_fn
from .taylor import linearize as linearize
from .taylor import taylor_expand as taylor_expand

__version__ = "0.1.0"

# Public classes report the package they are used from (``torchntk.AutoChoice``), not the private
# module that defines them.
for _public in (AutoChoice, Estimate, ExampleLoopWarning, KernelFunction, NtkImplementation):
    _public.__module__ = "torchntk"
del _public

__all__ = [
    # kernels
    "empirical_ntk_fn",
    "empirical_nngp_fn",
    "empirical_kernel_fn",
    "empirical_ntk_vp_fn",
    "NtkImplementation",
    "AutoChoice",
    "Estimate",
    "ExampleLoopWarning",
    "KernelFunction",
    "precision",
    # batching and Monte Carlo
    "batch",
    "monte_carlo_kernel_fn",
    # expansions
    "linearize",
    "taylor_expand",
    # predictions from kernels (torchntk.predict.gradient_descent_mse, ...)
    "predict",
]
