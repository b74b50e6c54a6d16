"""torchntk: empirical neural tangent and NNGP kernels of PyTorch models."""

from . import predict as predict
from ._call.example_loop import ExampleLoopWarning as ExampleLoopWarning
from ._implementations.choice import AutoChoice as AutoChoice
from ._implementations.choice import Estimate as Estimate
from ._kernel.kernel_function import KernelFunction as KernelFunction
from ._layout.notices import OutputWarning as OutputWarning
from ._memory import KernelMemoryError as KernelMemoryError
from ._memory import MemoryPlanWarning as MemoryPlanWarning
from ._utils.exports import published
from ._utils.precision import precision as precision
from ._utils.types import NtkImplementation as NtkImplementation
from .batching import batch as batch
from .empirical import empirical_kernel_fn as empirical_kernel_fn
from .empirical import empirical_nngp_fn as empirical_nngp_fn
from .empirical import empirical_ntk_fn as empirical_ntk_fn
from .empirical import empirical_ntk_vp_fn as empirical_ntk_vp_fn
from .monte_carlo import monte_carlo_kernel_fn as monte_carlo_kernel_fn
from .sketch import sketched_ntk_features_fn as sketched_ntk_features_fn
from .sketch import sketched_ntk_fn as sketched_ntk_fn
from .spectra import Eigenpairs as Eigenpairs
from .spectra import TraceEstimate as TraceEstimate
from .spectra import condition_number as condition_number
from .spectra import effective_rank as effective_rank
from .spectra import kernel_target_alignment as kernel_target_alignment
from .spectra import ntk_eigenpairs as ntk_eigenpairs
from .spectra import ntk_trace_estimate as ntk_trace_estimate
from .spectra import relative_change as relative_change
from .spectra import top_eigenpairs as top_eigenpairs
from .spectra import trace_estimate as trace_estimate
from .taylor import linearize as linearize
from .taylor import taylor_expand as taylor_expand

__version__ = "0.1.0"

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
    "KernelMemoryError",
    "MemoryPlanWarning",
    "OutputWarning",
    "precision",
    # batching and Monte Carlo
    "batch",
    "monte_carlo_kernel_fn",
    # sketched kernels (random features)
    "sketched_ntk_features_fn",
    "sketched_ntk_fn",
    # expansions
    "linearize",
    "taylor_expand",
    # spectra and kernel diagnostics
    "ntk_eigenpairs",
    "ntk_trace_estimate",
    "top_eigenpairs",
    "trace_estimate",
    "Eigenpairs",
    "TraceEstimate",
    "condition_number",
    "effective_rank",
    "kernel_target_alignment",
    "relative_change",
    # predictions from kernels (torchntk.predict.gradient_descent_mse, ...)
    "predict",
]

published(globals(), "torchntk")  # torchntk.AutoChoice, not the private module that defines it
