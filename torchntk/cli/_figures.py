"""Figures of the command line: a kernel's heatmap and spectrum, and time against N.

matplotlib is optional (``pip install 'torchntk[plot]'``). Without it every function returns a
sentence saying the figure was skipped, and the commands go on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from .._layout import paired_matrix

_SKIPPED = "figure skipped: matplotlib is not installed (pip install 'torchntk[plot]')"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt

    return plt


def kernel_matrix(kernel: torch.Tensor) -> Optional[torch.Tensor]:
    """The kernel as a square matrix: ``(N, N)`` as is, ``(N, N, O, O)`` as ``(N O, N O)``; else None."""
    if kernel.ndim == 2 and kernel.shape[0] == kernel.shape[1]:
        return kernel
    if kernel.ndim == 4 and kernel.shape[0] == kernel.shape[1] and kernel.shape[2] == kernel.shape[3]:
        return paired_matrix(kernel)
    return None


def kernel_figure(kernel: torch.Tensor, path: Path, title: str) -> str:
    """Writes the heatmap and the eigenvalue spectrum of ``kernel`` to ``path``; returns what it did."""
    matrix = kernel_matrix(kernel)
    if matrix is None:
        return f"figure skipped: a kernel of shape {tuple(kernel.shape)} is not a square matrix (use x2=None layouts)"
    plt = _pyplot()
    if plt is None:
        return _SKIPPED
    from matplotlib.ticker import MaxNLocator

    matrix = matrix.detach().to("cpu", torch.float64)
    eigenvalues = torch.linalg.eigvalsh((matrix + matrix.T) / 2).flip(0)
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    image = left.imshow(matrix.numpy(), cmap="viridis")
    figure.colorbar(image, ax=left, fraction=0.046)
    left.set_title(f"empirical NTK: {title}")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.yaxis.set_major_locator(MaxNLocator(integer=True))
    left.set_xlabel("x2 example" if kernel.ndim == 2 else "x2 (example, output)")
    left.set_ylabel("x1 example" if kernel.ndim == 2 else "x1 (example, output)")
    positive = eigenvalues.clamp(min=eigenvalues.max().item() * 1e-16)
    right.semilogy(range(1, len(positive) + 1), positive.numpy(), marker=".")
    right.set_title("eigenvalues (descending)")
    right.set_xlabel("index")
    right.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"figure: {path}"


def scaling_figure(times: dict[tuple[str, int], dict[int, float]], path: Path, title: str) -> str:
    """Writes seconds against N on log-log axes, one line per ``(library, implementation)``: a
    colour per implementation, solid for torchntk and dashed for the others. Returns what it did."""
    plt = _pyplot()
    if plt is None:
        return _SKIPPED
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    figure, axes = plt.subplots(figsize=(6, 4.2))
    sizes = sorted({n for by_n in times.values() for n in by_n})
    for (library, implementation), by_n in sorted(times.items(), key=lambda item: (item[0][1], item[0][0] != "torchntk")):
        points = sorted(by_n)
        axes.loglog(points, [by_n[n] for n in points], marker="o", color=f"C{implementation - 1}",
                    linestyle="-" if library == "torchntk" else "--", label=f"{library} {implementation}")
    axes.set_xticks(sizes)
    axes.xaxis.set_major_formatter(ScalarFormatter())
    axes.xaxis.set_minor_formatter(NullFormatter())
    axes.set_xlabel("N (examples in x1 and in x2)")
    axes.set_ylabel("seconds per kernel")
    axes.set_title(title)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"figure: {path}"
