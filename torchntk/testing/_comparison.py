"""The leaf-by-leaf comparison report of :func:`torchntk.testing.assert_kernels_close`.

Part of the oracle, so it shares no code with the library.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._reference_model import PyTree

# dtype -> (rtol, atol as a fraction of max|expected|)
_DEFAULT_TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}
_REAL_DTYPE_OF_COMPLEX = {torch.complex128: torch.float64, torch.complex64: torch.float32}
_WORST_ENTRIES_SHOWN = 5


def structure(tree: PyTree) -> Any:
    """Hashable description: container types and keys, with every leaf written as ``*``."""
    if isinstance(tree, dict):
        return ("dict", tuple(sorted((repr(k), structure(v)) for k, v in tree.items())))
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__, tuple(structure(v) for v in tree))
    return "*"


def _least_precise(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype with the largest epsilon (complex as its real part); int64 if one is not floating."""
    real = [_REAL_DTYPE_OF_COMPLEX.get(d, d) for d in dtypes]
    if any(not d.is_floating_point for d in real):
        return torch.int64
    return max(real, key=lambda d: torch.finfo(d).eps)


def _tolerances(
    dtype: torch.dtype, expected: Tensor, rtol: float | None, atol: float | None
) -> tuple[float, float, str]:
    """``(rtol, atol, description)`` for a leaf pair whose least precise dtype is ``dtype``."""
    default_rtol, atol_fraction = _DEFAULT_TOLERANCES.get(dtype, (0.0, 0.0))
    rtol = default_rtol if rtol is None else rtol
    if atol is not None:
        return rtol, atol, f"rtol={rtol:.1e}, atol={atol:.1e}"
    magnitude = expected.abs().max().item() if expected.numel() else 0.0
    scale = magnitude if magnitude > 0 and magnitude != float("inf") else 1.0
    atol = atol_fraction * scale
    description = (
        f"rtol={rtol:.1e}, atol={atol:.1e} (= {atol_fraction:.0e} * {scale:.3g}), keyed by {dtype}"
    )
    return rtol, atol, description


def _unravel(flat_index: int, shape: torch.Size) -> tuple[int, ...]:
    """The index in a tensor of ``shape`` of the entry at ``flat_index`` of its row-major flattening."""
    index = []
    for size in reversed(shape):
        flat_index, remainder = divmod(flat_index, size)
        index.append(remainder)
    return tuple(reversed(index))


def leaf_report(
    where: str, actual: Any, expected: Any, rtol: float | None, atol: float | None
) -> str | None:
    """None when the leaves agree, otherwise a multi-line description of the mismatch."""
    actual, expected = torch.as_tensor(actual).detach(), torch.as_tensor(expected).detach()
    header = (
        f"  shapes: actual {tuple(actual.shape)} {actual.dtype}, "
        f"expected {tuple(expected.shape)} {expected.dtype}"
    )
    if actual.shape != expected.shape:
        return f"kernel {where}: shape mismatch\n{header}"
    compute_dtype = (
        torch.complex128 if actual.is_complex() or expected.is_complex() else torch.float64
    )
    a = actual.cpu().to(compute_dtype)
    e = expected.cpu().to(compute_dtype)
    dtype = _least_precise(actual.dtype, expected.dtype)
    rtol, atol, tolerance_text = _tolerances(dtype, e, rtol, atol)

    abs_error = (a - e).abs()
    allowed = atol + rtol * e.abs()
    failing = ~(abs_error <= allowed)  # NaN errors fail here...
    failing &= ~(a == e)  # ...except equal infinities
    failing &= ~(a.isnan() & e.isnan())  # ...and NaN against NaN
    if not failing.any():
        return None

    rel_error = abs_error / e.abs()
    rel_error = torch.where(abs_error == 0, torch.zeros_like(rel_error), rel_error)
    # Rank NaN errors as the worst of all.
    ranking = torch.where(abs_error.isnan(), torch.inf, abs_error).reshape(-1)
    ranking = torch.where(failing.reshape(-1), ranking, -torch.inf)
    worst = ranking.argsort(descending=True)[: min(_WORST_ENTRIES_SHOWN, int(failing.sum()))]

    lines = [
        f"kernel {where}: {int(failing.sum())} of {failing.numel()} entries differ",
        header,
        f"  tolerances: {tolerance_text}",
        f"  max abs error: {_nan_max(abs_error):.3e}, max rel error: {_nan_max(rel_error):.3e}",
        "  worst entries (index: actual vs expected | abs error, rel error):",
    ]
    for flat_index in worst.tolist():
        index = _unravel(flat_index, a.shape)
        lines.append(
            f"    {index}: {a.reshape(-1)[flat_index].item():.10g} vs "
            f"{e.reshape(-1)[flat_index].item():.10g} | "
            f"{abs_error.reshape(-1)[flat_index].item():.3e}, "
            f"{rel_error.reshape(-1)[flat_index].item():.3e}"
        )
    return "\n".join(lines)


def _nan_max(values: Tensor) -> float:
    """Max that reports NaN if any entry is NaN (torch's max over NaN is NaN already)."""
    return values.max().item() if values.numel() else 0.0
