"""Figures of the command line: a kernel's heatmap and spectrum, and time against N.

matplotlib is optional (``pip install 'torchntk[plot]'``). Without it every function returns a
sentence saying the figure was skipped, and the commands go on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from .._layout.kernel_layout import paired_matrix

_SKIPPED = "figure skipped: matplotlib is not installed (pip install 'torchntk[plot]')"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # files only: works without a display
    import matplotlib.pyplot as plt

    return plt


MAX_MATRIX = 4096
"""Largest side of a heatmap: beyond it the eigenvalues alone take minutes and the pixels blur."""


@dataclass(frozen=True)
class KernelDescription:
    """What a kernel figure shows, for its title and axis labels.

    Attributes:
        model: the model's name on the command line.
        implementation: e.g. ``"3 (structured derivatives)"``.
        output_shape: the shape of the model's output on the examples, examples on axis 0.
        trace_axes: the traced output axes, non-negative (as canonicalised by ``make_layout``).
    """

    model: str
    implementation: str
    output_shape: tuple[int, ...]
    trace_axes: tuple[int, ...]

    @property
    def kept_axes(self) -> tuple[int, ...]:
        """The output axes the kernel keeps, in the order of its (x1, x2) axis pairs."""
        return tuple(axis for axis in range(len(self.output_shape)) if axis not in self.trace_axes)

    def axis_name(self, axis: int) -> str:
        if axis == 0:
            return "example"
        # A classifier's (N, O) output: its last axis holds the logits. Other axes are named by
        # number: "logit" would be wrong for e.g. a sequence position or an image row.
        if len(self.output_shape) == 2:
            return "logit"
        return f"output axis {axis}"

    def title(self) -> str:
        """Two lines: the model and implementation, then what the kernel's entries are."""
        first = f"empirical NTK of {self.model}, implementation {self.implementation}"
        if self.trace_axes:
            traced = ", ".join(f"{axis} (size {self.output_shape[axis]})" for axis in self.trace_axes)
            second = f"traced (averaged) over output axis {traced}"
        else:
            second = "full kernel (no axis traced)"
        kept = self.kept_axes
        if len(kept) > 1:
            second += f"; rows and columns are ({', '.join(map(self.axis_name, kept))}) pairs"
        return f"{first}\n{second}"

    def axis_label(self, side: str) -> str:
        """E.g. ``"x1 example"`` or ``"x1 (example, logit): example*10 + logit"`` (row-major)."""
        kept = self.kept_axes
        names = [self.axis_name(axis) for axis in kept]
        if len(kept) == 1:
            return f"{side} {names[0]}"
        index = names[-1]
        for axis, name in zip(kept[-2::-1], names[-2::-1]):
            index = f"{name}*{_size_after(self.output_shape, kept, axis)} + {index}"
        return f"{side} ({', '.join(names)}): {index}"


def _size_after(shape: tuple[int, ...], kept: tuple[int, ...], axis: int) -> int:
    return math.prod(shape[later] for later in kept if later > axis)


def kernel_matrix(kernel: torch.Tensor) -> Optional[torch.Tensor]:
    """The kernel of x1 against itself as a square matrix: ``(N, N)`` as is, ``(N, N, O, O)`` as
    ``(N O, N O)`` and so on for every (x1, x2) axis pair; None for other shapes."""
    if kernel.ndim < 2 or kernel.ndim % 2 or kernel.shape[0::2] != kernel.shape[1::2]:
        return None
    return paired_matrix(kernel)


def kernel_figure(kernel: Any, path: Path, description: KernelDescription) -> str:
    """Writes the heatmap and the eigenvalue spectrum of ``kernel`` to ``path``; returns what it did."""
    if not isinstance(kernel, torch.Tensor):
        return "figure skipped: the model has several outputs, hence several kernels"
    matrix = kernel_matrix(kernel)
    if matrix is None:
        return f"figure skipped: a kernel of shape {tuple(kernel.shape)} is not a square matrix"
    if matrix.shape[0] > MAX_MATRIX:
        return f"figure skipped: the kernel is a {matrix.shape[0]}x{matrix.shape[0]} matrix, over {MAX_MATRIX}"
    plt = _pyplot()
    if plt is None:
        return _SKIPPED
    figure = draw_kernel(plt, matrix, description)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"figure: {path}"


def draw_kernel(plt, matrix: torch.Tensor, description: KernelDescription):
    """The matplotlib figure of :func:`kernel_figure`: heatmap left, spectrum right."""
    from matplotlib.ticker import MaxNLocator

    matrix = matrix.detach().to("cpu", torch.float64)
    eigenvalues = torch.linalg.eigvalsh((matrix + matrix.T) / 2).flip(0)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    image = left.imshow(matrix.numpy(), cmap="viridis")
    colour_bar = figure.colorbar(image, ax=left, fraction=0.046)
    colour_bar.set_label("kernel entry K(x1, x2)", fontsize=8)
    figure.suptitle(description.title(), fontsize=10)
    left.set_title("kernel")
    left.xaxis.set_major_locator(MaxNLocator(integer=True))
    left.yaxis.set_major_locator(MaxNLocator(integer=True))
    left.set_xlabel(description.axis_label("x2"), fontsize=8)
    left.set_ylabel(description.axis_label("x1"), fontsize=8)
    positive = eigenvalues.clamp(min=eigenvalues.max().item() * 1e-16)
    right.semilogy(range(1, len(positive) + 1), positive.numpy(), marker=".")
    right.set_title("eigenvalues (descending)")
    right.set_xlabel("index (1 = largest)")
    right.set_ylabel("eigenvalue (log scale)")
    right.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    return figure


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
