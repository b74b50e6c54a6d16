"""One model through the demo: build it, run it forward, compute its NTK with each implementation.

NOTE: [Model failures]
The demo runs models users bring, and those fail in ways that say nothing about the other models
or implementations: a module that raises while it is imported, a factory that raises or returns
something other than an ``nn.Module``, a forward pass that raises, a forward pass that PyTorch
cannot vmap (implementations differ in how they differentiate, so one may fail where another
works). Any exception there is caught and recorded as a :class:`Failure` (one line on standard
error, a row of the table) and the demo goes on; the exit status (3) says a model failed. Bad
arguments are not model failures: a module or attribute that cannot be found is exit status 2
before anything runs, and the output axes are checked against the forward pass's output before
any kernel is computed, so that an axis out of range is still exit status 2.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree

import torchntk

from .._layout.kernel_layout import make_layout
from ._figures import KernelDescription
from ._inputs import Inputs, InputSpec, KeywordInputs
from ._models import ModelChoice, ModelFailure, UsageError
from ._timing import timed_calls

IMPLEMENTATION_NAMES = {
    1: "Jacobian contraction",
    2: "NTK-vector products",
    3: "structured derivatives",
}


def implementation_name(implementation: int) -> str:
    return f"{implementation} ({IMPLEMENTATION_NAMES[implementation]})"


@dataclass(frozen=True)
class Settings:
    """The demo's arguments that every model shares."""

    n: int
    trace_axes: tuple[int, ...]
    vmap_axes: Optional[int]
    implementations: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    repeats: int
    memory: Optional[float] = None  # --memory: the kernel functions' budget

    @property
    def tolerance(self) -> float:
        return 1e-9 if self.dtype == torch.float64 else 1e-4


@dataclass
class Row:
    """One line of the table; ``error`` is set (and the numbers are not) when this step failed."""

    model: str
    step: str  # the implementation, or the step that failed before any implementation ran
    shape: str = "—"
    seconds: Optional[float] = None
    difference: Optional[float] = None
    reference: Optional[int] = None
    agrees: bool = False
    error: Optional[str] = None


@dataclass(frozen=True)
class Failure:
    """A model that raised: which model, at which step, and the error, on one line."""

    model: str
    step: str
    error: str

    def line(self) -> str:
        return f"torchntk: model {self.model!r}, {self.step} failed: {self.error}"


@dataclass
class ModelRun:
    """What one model gave: table rows, notes, failures and the kernel to draw (if any)."""

    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    kernel: Any = None
    description: Optional[KernelDescription] = None

    def fail(self, model: str, step: str, error: BaseException, column: Optional[str] = None) -> None:
        """Records ``error`` of ``model`` at ``step`` (``column``: the table's implementation cell)."""
        failure = Failure(model, step, describe_error(error))
        self.failures.append(failure)
        self.rows.append(Row(model, column or step, error=failure.error))
        sys.stderr.write(failure.line() + "\n")


def describe_error(error: BaseException) -> str:
    """``"RuntimeError: message"`` on one line."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}".rstrip(": ")


def run_model(choice: ModelChoice, spec: InputSpec, settings: Settings, advance: Callable[[str], None]) -> ModelRun:
    """Runs ``choice`` on ``spec``'s inputs with every implementation of ``settings``.

    ``advance(step)`` is called after each implementation and after AUTO (the progress bar).

    Raises:
        UsageError: ``--trace-axes`` or ``--vmap-axes`` out of range for the model's output.
            Every exception of the model (its import, its factory, what the factory returns, its
            forward pass, each implementation) is recorded in the result (NOTE: [Model failures]).
    """
    run = ModelRun()
    x = spec.make(settings.n, settings.dtype, settings.device)
    try:
        model = choice.build().to(device=settings.device, dtype=settings.dtype)
    except ModelFailure as failure:
        run.fail(choice.name, failure.step, failure.error)
        return run
    except Exception as error:
        run.fail(choice.name, "building (the factory call)", error)
        return run
    if spec.keywords:
        model = KeywordInputs(model)
    try:
        with torch.no_grad():
            output = model(x)
    except Exception as error:
        run.fail(choice.name, "forward pass (before any implementation)", error)
        return run
    trace_axes = _check_output(output, settings)
    kernels = {}
    for implementation in settings.implementations:
        try:
            kernels[implementation], seconds = _kernel(model, x, implementation, settings)
        except Exception as error:
            name = implementation_name(implementation)
            run.fail(choice.name, f"implementation {name}", error, column=name)
        else:
            run.rows.append(Row(choice.name, implementation_name(implementation), _shape(kernels[implementation]), seconds))
        advance(f"{choice.name}, implementation {implementation}")
    if kernels:
        reference = next(iter(kernels))
        for row, implementation in zip((row for row in run.rows if row.error is None), kernels):
            row.difference = _relative_difference(kernels[implementation], kernels[reference])
            row.reference = reference
            row.agrees = row.difference <= settings.tolerance
        run.kernel = kernels[reference]
        if isinstance(output, torch.Tensor):
            run.description = KernelDescription(choice.name, implementation_name(reference), tuple(output.shape), trace_axes)
    # AUTO prices the implementations on the same per-example forward passes: when all of them
    # failed, asking it would only repeat their error.
    auto = _auto(model, x, settings) if kernels else "AUTO not asked (every implementation failed)"
    run.notes.append(f"{choice.name}: {choice.description}, {spec.describe(settings.n)}; {auto}.")
    advance(f"{choice.name}, AUTO")
    return run


def _check_output(output: Any, settings: Settings) -> tuple[int, ...]:
    """The canonical trace axes of the output (of its first leaf, for pytree outputs).

    Raises:
        UsageError: an axis out of range or repeated, for some output leaf.
    """
    canonical = []
    for leaf in pytree.tree_leaves(output):
        if not isinstance(leaf, torch.Tensor):
            continue  # the kernel functions reject it with their own message, a model failure
        try:
            canonical.append(make_layout(leaf.ndim, settings.trace_axes, (), "--trace-axes", "the model's output").trace_axes)
        except ValueError as error:
            raise UsageError(str(error)) from None
        if settings.vmap_axes is not None and not -leaf.ndim <= settings.vmap_axes < leaf.ndim:
            raise UsageError(f"--vmap-axes {settings.vmap_axes}: out of range for the model's output of shape "
                             f"{tuple(leaf.shape)}")
    return canonical[0] if canonical else ()


def _kernel(model: torch.nn.Module, x: Inputs, implementation: int, settings: Settings) -> tuple[Any, float]:
    ntk_fn = torchntk.empirical_ntk_fn(
        model, trace_axes=settings.trace_axes, vmap_axes=settings.vmap_axes, implementation=implementation,
        memory=settings.memory,
    )
    kernel, times = timed_calls(lambda: ntk_fn(x), settings.repeats, settings.device)
    return kernel, min(times)


def _auto(model: torch.nn.Module, x: Inputs, settings: Settings) -> str:
    """What AUTO picks, or why it could not say (a note, not a failure: no kernel is computed)."""
    auto = torchntk.empirical_ntk_fn(
        model, trace_axes=settings.trace_axes, vmap_axes=settings.vmap_axes, implementation=0, memory=settings.memory
    )
    try:
        chosen = int(auto.auto_choice(x).implementation)
    except Exception as error:
        return f"AUTO could not price it ({describe_error(error)})"
    return f"AUTO picks {implementation_name(chosen)}"


def _shape(kernel: Any) -> str:
    return ", ".join("x".join(map(str, leaf.shape)) for leaf in pytree.tree_leaves(kernel))


def _relative_difference(kernel: Any, reference: Any) -> float:
    differences = []
    for leaf, reference_leaf in zip(pytree.tree_leaves(kernel), pytree.tree_leaves(reference)):
        scale = reference_leaf.abs().max().item()
        differences.append((leaf - reference_leaf).abs().max().item() / (scale or 1.0))
    return max(differences, default=0.0)
