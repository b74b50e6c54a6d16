"""Float32 kernels in float32: PyTorch's TF32 settings while a kernel is computed.

NOTE: [Kernel precision]
On Ampere and later NVIDIA GPUs, PyTorch may run float32 matrix products and convolutions in TF32
(a 10-bit mantissa): cuDNN convolutions do so by default, cuBLAS products when the user or a
library allowed it. A kernel is a sum of many such products, so TF32 makes float32 kernels wrong in
their third or fourth digit, silently. Every call of a torchntk kernel function therefore runs
with TF32 off (IEEE float32 products and convolutions) and restores PyTorch's settings afterwards,
whatever they were. :func:`precision` asks for a faster mode around some calls:

* ``"float32"`` (the default): IEEE float32 products and convolutions;
* ``"tf32"``: TF32 products and convolutions (about 10 bits of mantissa, several times faster);
* ``"bfloat16"``: float32 products may use bfloat16 internally (``torch.set_float32_matmul_precision
  ("medium")``), convolutions TF32; only under PyTorch's legacy precision API (below).

PyTorch has two APIs for these settings (``torch.backends.cuda.matmul.allow_tf32`` and the newer
``torch.backends.cuda.matmul.fp32_precision``) and raises once both have been used in a process, so
torchntk uses the one already in use (the legacy one unless reading it raises). The settings are
process-wide: another thread's work meanwhile runs in the kernel's precision too. Kernel functions
called inside another one (``batch``'s workers, Monte Carlo samples) keep the outer call's setting.
TF32 exists on CUDA only, but ``"bfloat16"`` reaches CPUs too: with bfloat16 units (AMX, AVX-512
BF16) PyTorch then runs float32 matrix products in bfloat16 there as well. The ``vmap_axes`` check
compares float32 results at the precision of the mode in force (``requested_mode``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import ContextManager, Iterator

import torch

from .checks import show
from .threads import WhileAnyActive

MODES = ("float32", "tf32", "bfloat16")

_LEGACY_MATMUL = {"float32": "highest", "tf32": "high", "bfloat16": "medium"}
_NEW = {"float32": "ieee", "tf32": "tf32"}

_requested = threading.local()  # NOTE: [Thread-local state] in _utils/threads.py
_active = WhileAnyActive()


@contextlib.contextmanager
def precision(mode: str) -> Iterator[None]:
    """Computes the kernels of this thread's calls inside the block in ``mode``.

    Args:
        mode: ``"float32"`` (IEEE float32 products and convolutions, the default outside any
            block), ``"tf32"`` or ``"bfloat16"`` (faster on GPUs, about 3 and 2 significant digits;
            see NOTE: [Kernel precision] in ``torchntk/_utils/precision.py``).

    Raises:
        ValueError: an unknown ``mode``; ``"bfloat16"`` under PyTorch's newer precision API
            (``torch.backends.cuda.matmul.fp32_precision``), which has no such mode for CUDA
            (raised when a kernel is computed).

    Example:
        >>> import torch, torchntk
        >>> ntk_fn = torchntk.empirical_ntk_fn(torch.nn.Linear(3, 2), vmap_axes=0)
        >>> with torchntk.precision("tf32"):
        ...     fast = ntk_fn(torch.randn(4, 3))
        >>> fast.shape
        torch.Size([4, 4])
    """
    if mode not in MODES:
        raise ValueError(f"precision: `mode` must be one of {MODES}, got {show(mode)}.")
    previous = getattr(_requested, "mode", None)
    _requested.mode = mode
    try:
        yield
    finally:
        _requested.mode = previous


def requested_mode() -> str:
    """The mode of this thread's kernel calls: that of the innermost :func:`precision` block, else
    ``"float32"``."""
    return getattr(_requested, "mode", None) or "float32"


def kernel_precision() -> ContextManager[None]:
    """PyTorch's TF32 settings for the requested mode while a kernel is computed, restored after."""
    return _active.active(lambda: _apply(requested_mode()))


def _apply(mode: str):
    """Sets ``mode``; returns the function that restores what was there."""
    backends = torch.backends
    try:
        matmul, convolutions = backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32
        legacy_precision = torch.get_float32_matmul_precision()
    except RuntimeError:  # the newer API is in use; reading the legacy flags raises then
        return _apply_new(mode)

    def restore() -> None:
        torch.set_float32_matmul_precision(legacy_precision)
        backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32 = matmul, convolutions

    torch.set_float32_matmul_precision(_LEGACY_MATMUL[mode])
    backends.cudnn.allow_tf32 = mode != "float32"
    return restore


def _apply_new(mode: str):
    if mode not in _NEW:
        raise ValueError(
            f"precision: {mode!r} needs PyTorch's legacy precision API (torch.set_float32_matmul_precision), "
            f"but this process uses the newer one (torch.backends.cuda.matmul.fp32_precision), which has no "
            f"bfloat16 mode for CUDA. Use 'tf32' or 'float32'."
        )
    settings = (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn)
    saved = [setting.fp32_precision for setting in settings]

    def restore() -> None:
        for setting, value in zip(settings, saved):
            setting.fp32_precision = value

    for setting in settings:
        setting.fp32_precision = _NEW[mode]
    return restore


def accumulation_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype long sums of ``dtype`` values are carried in (kernel contractions, NOTE: [Accurate
    contraction]; Monte Carlo running sums, NOTE: [Monte Carlo accumulation]): float64, complex128
    for complex dtypes, where ``device`` has it; MPS has no float64, so there ``dtype`` itself.

    Example:
        >>> cpu, mps = torch.device("cpu"), torch.device("mps")
        >>> accumulation_dtype(torch.float32, cpu), accumulation_dtype(torch.complex64, cpu)
        (torch.float64, torch.complex128)
        >>> accumulation_dtype(torch.float32, mps)
        torch.float32
    """
    if device.type == "mps":
        return dtype
    return torch.complex128 if dtype.is_complex else torch.float64
