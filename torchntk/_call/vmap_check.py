"""The check behind ``vmap_axes``: per-example outputs and derivatives against the whole batch.

See NOTE: [Checking vmap_axes] (in :class:`VmapAxesCheck`) for what is compared and how a
failure is explained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.func import vjp

from .._layout.runs import runs
from .._model.functional import FunctionalModel
from .._utils.checks import leaves_with_names
from .._utils.precision import requested_mode
from .finite import non_finite_outputs
from .per_example import OutputAxisError, Side, VmapLimitation, VmapRuntimeError, first_line, is_out_of_memory
from .vmap_axes import ParsedVmapAxes, suggested_vmap_axes, unmapped_batch_sized_kwargs

_PER_EXAMPLE_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.complex128: 1e-9, torch.complex64: 1e-4}
_DERIVATIVE_RTOL = {torch.float64: 1e-8, torch.float32: 1e-3}
_LOW_PRECISION_RTOL = 1e-2
_REDUCED_FLOAT32_RTOL = {"tf32": 1e-2, "bfloat16": 5e-2}
"""Float32 tolerances under the faster kernel precisions (``torchntk.precision``): TF32 keeps 10 bits
of mantissa and bfloat16 8, so the whole batch and single examples may differ in the third digit
(or the second) wherever products are reduced, and that is no vmap bug."""
_ROUNDING_MULTIPLE = 10
"""A failed check whose difference is within this multiple of the tolerance may be rounding; only
then does the message offer ``check_vmap_axes=False``."""

PROBE_EXAMPLES = 2
_PROBE_COTANGENTS = 1
_COTANGENT_SEED = 0


@dataclass(frozen=True)
class _Difference:
    """The largest difference between two tensors, and the largest magnitude it is relative to."""

    error: float
    scale: float
    tolerance: float

    @classmethod
    def of(cls, want: torch.Tensor, have: torch.Tensor, rtol: float, scale_floor: float = 0.0) -> "_Difference":
        error, scale = _measure(want, have)
        return cls(error, scale, rtol * max(scale, scale_floor))

    @property
    def fails(self) -> bool:
        return not self.error <= self.tolerance  # NaN fails

    @property
    def may_be_rounding(self) -> bool:
        return self.error <= _ROUNDING_MULTIPLE * self.tolerance

    def describe(self) -> str:
        return f"max abs difference {self.error:.3g}, max abs value {self.scale:.3g}"

    def rounding_note(self) -> str:
        if not self.may_be_rounding:
            return ""
        return (
            " The difference is within a small multiple of the rounding tolerance: if it is the expected "
            "rounding of this model, pass check_vmap_axes=False."
        )


def _measure(want: torch.Tensor, have: torch.Tensor) -> tuple[float, float]:
    """``(largest |want - have|, largest finite |want| or |have|)``, with one synchronisation."""
    if want.numel() == 0:
        return 0.0, 0.0
    # Derivatives are parameter-sized: one temporary, and min/max reductions instead of abs(),
    # whose fresh memory cost more than the arithmetic (measured on the benchmark MLP).
    def largest(tensor: torch.Tensor) -> torch.Tensor:
        low, high = torch.aminmax(tensor)
        return torch.maximum(-low, high)

    gap = want - have
    magnitudes = torch.maximum(largest(want), largest(have))
    error = largest(gap)
    if not bool(torch.isfinite(error) & torch.isfinite(magnitudes)):
        # Entries that are the same NaN or infinity on both sides agree (e.g. a derivative that is
        # NaN however it is computed): the kernel is then NaN, which no user mistakes for a number.
        same = (want == have) | (torch.isnan(want) & torch.isnan(have))
        gap = torch.where(same, torch.zeros((), dtype=gap.dtype, device=gap.device), gap.abs())
        error = gap.max()  # NaN where only one side is NaN: a failure
        finite = lambda t: torch.nan_to_num(t.abs(), nan=0.0, posinf=0.0).max()  # noqa: E731
        magnitudes = torch.maximum(finite(want), finite(have))
    error, scale = torch.stack([error.to(magnitudes.dtype), magnitudes]).tolist()
    return error, scale


def _measure_all(wants: tuple[torch.Tensor, ...], haves: tuple[torch.Tensor, ...]) -> list[tuple[float, float]]:
    """:func:`_measure` of every pair with one synchronisation for all of them instead of one per
    pair (a ResNet-18 has 62 parameters); pairs with NaN or infinite entries are measured again one
    by one, as :func:`_measure` says. Per-tensor ``aminmax`` stays: on the CPU, fused norms
    (``torch._foreach_norm``) took six times as long."""
    if not wants:
        return []
    if any(want.numel() == 0 for want in wants):
        return [_measure(want, have) for want, have in zip(wants, haves)]

    def largest(tensor: torch.Tensor) -> torch.Tensor:
        low, high = torch.aminmax(tensor)
        return torch.maximum(-low, high)

    errors = torch.stack([largest(want - have) for want, have in zip(wants, haves)])
    scales = torch.stack([torch.maximum(largest(want), largest(have)) for want, have in zip(wants, haves)])
    measured = list(zip(*torch.stack([errors.to(scales.dtype), scales]).tolist()))
    return [
        pair if math.isfinite(pair[0]) and math.isfinite(pair[1]) else _measure(want, have)
        for pair, want, have in zip(measured, wants, haves)
    ]


def _agrees(want: torch.Tensor, have: torch.Tensor) -> bool:
    return want.shape == have.shape and not _output_difference(want, have).fails


def computations_agree(wants: tuple, haves: tuple, derivatives: bool = False) -> bool:
    """Whether two evaluations of one computation agree leaf by leaf, to the rounding this check
    allows between a per-example and a whole-batch evaluation (``derivatives``: the looser one of
    derivatives), in shape, dtype and values (NaN disagrees)."""
    return len(wants) == len(haves) and all(
        want.shape == have.shape and want.dtype == have.dtype and not _Difference.of(
            want, have, (_derivative_rtol if derivatives else _output_rtol)(want.dtype)
        ).fails
        for want, have in zip(wants, haves)
    )


def _output_rtol(dtype: torch.dtype) -> float:
    return _in_precision(dtype, _PER_EXAMPLE_RTOL.get(dtype, _LOW_PRECISION_RTOL))


def _derivative_rtol(dtype: torch.dtype) -> float:
    return _in_precision(dtype, _DERIVATIVE_RTOL.get(dtype, _LOW_PRECISION_RTOL))


def _in_precision(dtype: torch.dtype, rtol: float) -> float:
    """``rtol``, loosened for float32 under a faster kernel precision (NOTE: [Kernel precision])."""
    if dtype in (torch.float32, torch.complex64):
        return max(rtol, _REDUCED_FLOAT32_RTOL.get(requested_mode(), 0.0))
    return rtol


def _output_difference(want: torch.Tensor, have: torch.Tensor) -> _Difference:
    return _Difference.of(want, have, _output_rtol(want.dtype))


def _coupled_outputs_message(where: str, index: int, name: str, difference: _Difference, without_vmap: bool = False) -> str:
    also = ", also when the example is evaluated without vmap" if without_vmap else ""
    return (
        f"{where}: `vmap_axes` says examples are independent, but output leaf {index} for "
        f"{name} differs between the whole batch and a per-example evaluation ({difference.describe()})"
        f"{also}. The model couples examples (batch statistics, "
        f"attention across the batch, ...) or `vmap_axes` names the wrong axes. Pass vmap_axes=None "
        f"(exact for any model) or fix the axes.{difference.rounding_note()}"
    )


def _first_line(error: BaseException) -> str:
    """``Type: first line`` of an error, PyTorch's own for a :class:`VmapRuntimeError`."""
    if isinstance(error, VmapRuntimeError):
        error = error.original
    return f"{type(error).__name__}: {first_line(error)}"


@dataclass(frozen=True)
class VmapAxesCheck:
    """The checks of ``vmap_axes`` for one call, and the diagnosis of their failures.

    NOTE: [Checking vmap_axes]
    ``vmap_axes`` is a promise that examples do not interact. Breaking it (batch statistics,
    attention across the batch, a wrong axis, a per-example keyword argument left unmapped) makes
    every implementation return silently wrong kernels; so does a bug of ``torch.func.vmap`` in
    the derivative of an operation (``nn.PReLU`` in PyTorch 2.x: the forward pass is right, the
    per-example Jacobians are not). Two checks guard it:

    * outputs: the per-example outputs (under vmap) are compared with the whole-batch outputs,
      on a key's first call (``check_vmap_axes="first"``, the default; NOTE: [The planning
      stage]) or on every call (``True``). Jacobian contraction and NTK-vector products compare
      the outputs of the per-example passes they make anyway (``jacrev``'s and ``vjp``'s primal
      values), at no cost, except NTK-vector products' x1 with x2 given (NOTE: [The output check
      of NTK-vector products]); kernels without an NTK pay one more forward pass;
    * derivatives: on a probe of the first two examples of x1 (of x2 too if x1 has one example),
      ``R = 1`` random vector-Jacobian product is computed per example under vmap, batched by an
      inner vmap exactly as ``jacrev`` batches its basis (one level of vmap more, of size one),
      and its sum over the examples is compared with the same product of the whole probe batch.
      A random projection shows coupling of the examples for almost every cotangent, and a vmap
      bug of a derivative (``nn.PReLU``) shows with one; a second cotangent made the inner level
      batch two and cost 2.3 times as much on a ResNet-18 (nested vmaps of weight gradients
      are the slowest part of a first call), for no fault the suite's models showed. That is two
      backward passes of two examples, whatever the batch size; a kernel function runs it once
      per input shapes and module structure.

    A failure is explained by its cause, in this order: NaN/Inf in the outputs (which input or
    parameter holds them; checked before comparing anything); keyword arguments left unmapped
    although an axis has the batch size (with the ``vmap_axes`` to pass); a vmap bug, when the
    same example differentiated (or evaluated) without vmap agrees with the whole batch (a
    :class:`VmapUnsupported`, on which kernel functions evaluate the examples in a loop instead,
    NOTE: [Switching to example loops]); otherwise a genuine coupling of the examples.
    ``check_vmap_axes=False`` is offered only when the difference may be rounding.
    """

    model: FunctionalModel
    vmap_axes: ParsedVmapAxes
    where: str

    # -- (a) NaN/Inf ----------------------------------------------------------------------------

    def finite_outputs(self, side: Side, leaves: tuple[torch.Tensor, ...]) -> None:
        """Raises :class:`NonFiniteOutputs` naming where NaN/Inf come from when an output leaf holds
        some (NOTE: [Non-finite kernels])."""
        error = non_finite_outputs(self.where, self.model, side, leaves)
        if error is not None:
            raise error

    # -- outputs of every example -----------------------------------------------------------------

    def outputs(self, side: Side, leaves: tuple[torch.Tensor, ...], run_length: Optional[int]) -> None:
        """Per-example outputs (under vmap) against the whole-batch ``leaves``, run by run."""
        for start, length in runs(side.batch_size(), run_length):
            run = side.narrow(start, length)
            # An output without the batch size on its batch axis is left whole: the shape
            # comparison then reports it.
            expected = tuple(
                leaf.narrow(axis, start, length) if leaf.ndim > axis and leaf.shape[axis] == side.batch_size() else leaf
                for leaf, axis in zip(leaves, side.out_axes)
            )
            try:
                with torch.no_grad():
                    got = run.forward()
            except (RuntimeError, OutputAxisError) as error:
                if isinstance(error, RuntimeError):
                    self._raise_for_miscounted_examples(side, leaves, error)
                self._raise_for_failure(side, run, expected, error)
                raise
            self._compare_outputs(side, run, expected, got)

    def per_example_outputs(self, side: Side, expected: tuple, got: tuple) -> None:
        """The output check for an implementation that evaluates ``side`` per example anyway
        (structured derivatives): its outputs ``got`` against the whole-batch ``expected``."""
        self._compare_outputs(side, side, expected, got)

    def _compare_outputs(self, side: Side, run: Side, expected: tuple, got: tuple) -> None:
        for index, (want, have) in enumerate(zip(expected, got)):
            if want.shape != have.shape:
                symptom = (
                    f"output leaf {index} for {side.name} has shape {tuple(have.shape)} when evaluated per "
                    f"example but {tuple(want.shape)} for the whole batch"
                )
                self._raise_unmapped_kwargs(side, symptom)
                raise ValueError(f"{self.where}: with `vmap_axes`, {symptom}. Check `vmap_axes`.")
            if want.numel() == 0:
                continue
            difference = _output_difference(want, have)
            if not difference.fails:
                continue
            symptom = (
                f"output leaf {index} for {side.name} differs between the whole batch and a per-example "
                f"evaluation ({difference.describe()})"
            )
            self._raise_unmapped_kwargs(side, symptom)
            axis = run.out_axes[index]
            gaps = (want - have).abs().nan_to_num(nan=float("inf")).movedim(axis, 0).reshape(want.shape[axis], -1)
            worst = int(gaps.max(dim=1).values.argmax())
            plain = self._plain_outputs(run, worst)
            if plain is not None and _agrees(want.narrow(axis, worst, 1), plain[index]):
                raise VmapUnsupported(
                    f"{self.where}: `vmap_axes` gives wrong outputs for this model, from a bug of PyTorch's "
                    f"torch.func.vmap in one of its operations: {symptom}, but the same example evaluated "
                    f"without vmap agrees with the whole batch. Pass vmap_axes=None, which gives the right kernel."
                )
            raise ValueError(_coupled_outputs_message(self.where, index, side.name, difference, plain is not None))

    def _plain_outputs(self, run: Side, index: int) -> Optional[tuple]:
        """The outputs of example ``index`` of ``run`` as a batch of one, without vmap (None if that fails)."""
        try:
            with torch.no_grad():
                return run.narrow(index, 1).whole_batch()(self.model.params)
        except Exception:  # noqa: BLE001 - a model failing on one example is diagnosed as coupling
            return None

    # -- derivatives on the probe -----------------------------------------------------------------

    def derivatives(self, side: Side) -> None:
        """Summed per-example VJPs (under vmap) against whole-batch VJPs on the probe of ``side``."""
        if side.batch_size() == 0:
            return
        probe = side.probe(PROBE_EXAMPLES)
        params = self.model.params
        try:
            expected, pullback = vjp(probe.whole_batch(), params)
        except (RuntimeError, ValueError) as error:
            symptom = f"the model fails on a batch of the first {PROBE_EXAMPLES} examples of {side.name} ({_first_line(error)})"
            self._raise_unmapped_kwargs(side, symptom, error)
            raise
        if not all(leaf.is_floating_point() for leaf in expected):
            return  # no derivative to check; the implementations reject such outputs themselves
        cotangents = _random_cotangents(expected)
        whole = _stack_products([pullback(tuple(c[r] for c in cotangents))[0] for r in range(_PROBE_COTANGENTS)])
        try:
            got, summed = probe.summed_vjps(cotangents)
        except (RuntimeError, OutputAxisError) as error:
            self._raise_for_failure(side, probe, expected, error, cotangents, whole)
            raise
        self._compare_outputs(side, probe, expected, got)
        self._compare_derivatives(side, probe, cotangents, whole, summed)

    def _compare_derivatives(self, side: Side, probe: Side, cotangents: tuple, whole: tuple, summed: tuple) -> None:
        difference = self._worst_parameter(whole, summed)
        if difference is None:
            return
        name, gap = difference
        symptom = (
            f"on the first {PROBE_EXAMPLES} examples of {side.name}, the derivatives with respect to parameter "
            f"{name!r} differ between the whole batch and a per-example evaluation ({gap.describe()})"
        )
        self._raise_unmapped_kwargs(side, symptom)
        plain = self._plain_products(probe, cotangents)
        if plain is not None and self._worst_parameter(whole, plain) is None:
            raise VmapUnsupported(
                f"{self.where}: `vmap_axes` gives wrong derivatives for this model, from a bug of PyTorch's "
                f"torch.func.vmap in the derivative of one of its operations (nn.PReLU is one): {symptom} when "
                f"computed under vmap, while the outputs agree and the same per-example derivatives computed "
                f"without vmap agree with the whole batch. The examples are independent, but a kernel computed "
                f"with vmap_axes would be wrong. Pass vmap_axes=None, which gives the right kernel."
            )
        raise ValueError(
            f"{self.where}: `vmap_axes` says examples are independent, but {symptom}, also without vmap. The "
            f"model couples examples through its derivatives, or `vmap_axes` names the wrong axes. Pass "
            f"vmap_axes=None (exact for any model) or fix the axes.{gap.rounding_note()}"
        )

    def _worst_parameter(self, want: tuple, have: tuple) -> Optional[tuple[str, _Difference]]:
        """The parameter whose products differ most relative to the tolerance, or None if all agree.

        Each parameter is compared at its own scale, floored at a hundredth of the largest, so that
        rounding in a parameter with tiny derivatives does not count as a difference.
        """
        measured = _measure_all(tuple(want), tuple(have))
        floor = 0.01 * max((scale for _, scale in measured), default=0.0)
        worst, worst_ratio = None, 0.0
        for name, a, (error, scale) in zip(self.model.names, want, measured):
            gap = _Difference(error, scale, _derivative_rtol(a.dtype) * max(scale, floor))
            ratio = error / gap.tolerance if gap.tolerance > 0 else float("inf")
            if gap.fails and (worst is None or not ratio <= worst_ratio):
                worst, worst_ratio = (name, gap), ratio
        return worst

    def _plain_products(self, probe: Side, cotangents: tuple) -> Optional[tuple]:
        """The summed VJPs of the probe, one example at a time without vmap (None if that fails)."""
        try:
            total = None
            for example in range(probe.batch_size()):
                single = probe.narrow(example, 1)
                _, pullback = vjp(single.whole_batch(), self.model.params)
                rows = []
                for r in range(_PROBE_COTANGENTS):
                    row = tuple(c[r].narrow(axis, example, 1) for c, axis in zip(cotangents, probe.out_axes))
                    rows.append(pullback(row)[0])
                products = _stack_products(rows)
                total = products if total is None else tuple(a + b for a, b in zip(total, products))
            return total
        except Exception:  # noqa: BLE001 - a model failing on one example is diagnosed as coupling
            return None

    # -- failures -----------------------------------------------------------------------------------

    def _raise_for_failure(
        self, side: Side, run: Side, expected: tuple, error: BaseException,
        cotangents: Optional[tuple] = None, whole: Optional[tuple] = None,
    ) -> None:
        """Explains an error raised by the per-example (vmapped) evaluation of ``run``, if it can:
        unmapped keyword arguments, a vmap limitation (:class:`VmapUnsupported`) when the examples
        alone without vmap agree with the whole batch, else coupled examples (ValueError), as the
        whole batch ran where single examples fail or differ. Running out of memory explains nothing."""
        if isinstance(error, OutputAxisError):
            self._raise_unmapped_kwargs(side, error.symptom, error)
            return
        if isinstance(error, torch.OutOfMemoryError) or is_out_of_memory(error):
            return
        symptom = f"evaluating the model per example under vmap raised {_first_line(error)}"
        self._raise_unmapped_kwargs(side, symptom, error)
        plain_agrees = all(
            (plain := self._plain_outputs(run, example)) is not None
            and all(
                _agrees(want.narrow(axis, example, 1), have) for want, have, axis in zip(expected, plain, run.out_axes)
            )
            for example in range(min(run.batch_size(), PROBE_EXAMPLES))
        )
        if plain_agrees and cotangents is not None:
            plain = self._plain_products(run, cotangents)
            plain_agrees = plain is not None and self._worst_parameter(whole, plain) is None
        if plain_agrees:
            raise VmapUnsupported(
                f"{self.where}: `vmap_axes` cannot be used with this model: {symptom}, while without vmap "
                f"the same examples agree with the whole batch. The examples are independent, but vmap cannot "
                f"evaluate one of the model's operations per example (a limitation or a bug of PyTorch's "
                f"torch.func.vmap: in-place writes into tensors shared by all examples, nn.PReLU's "
                f"derivative, ...). Pass vmap_axes=None, which gives the right kernel."
            ) from error
        raise ValueError(
            f"{self.where}: `vmap_axes` says examples are independent, but the model fails when evaluated per "
            f"example under vmap, and the same examples evaluated alone without vmap fail or differ from the "
            f"whole batch, on which it runs. The model couples examples (it reads other examples with x[index], "
            f"index_select or gather along the batch axis, as graph networks do with their nodes; batch "
            f"statistics; ...) or `vmap_axes` names the wrong axes. Pass vmap_axes=None (exact for any model) or "
            f"fix the axes. Under vmap it raised {_first_line(error)}"
        ) from error

    def _raise_for_miscounted_examples(self, side: Side, leaves: tuple[torch.Tensor, ...], error: RuntimeError) -> None:
        """Raises ValueError when the per-example evaluation failed and the whole-batch output does
        not hold one entry per example either: the inputs are not batched along the mapped axis
        (a 1-D input whose entries became examples, a batch axis elsewhere than `vmap_axes` says)."""
        for index, (leaf, axis) in enumerate(zip(leaves, side.out_axes)):
            message = miscounted_examples(
                side.name, side.x.rebuild(side.x.leaves), side.x_axes, side.batch_size(), index, leaf, axis,
                self.where, "and the model fails on one example", f" PyTorch said: {_first_line(error)}",
            )
            if message is not None:
                raise ValueError(message) from error


    def _raise_unmapped_kwargs(self, side: Side, symptom: str, error: Optional[BaseException] = None) -> None:
        """Raises ValueError when keyword arguments left unmapped probably hold one entry per example."""
        batch_size = side.batch_size()
        found = unmapped_batch_sized_kwargs(side.kwargs, side.kwarg_axes, batch_size)
        if not found:
            return
        listing = ", ".join(
            f"{item.name!r} (shape{'s' if len(item.shapes) > 1 else ''} {', '.join(map(str, item.shapes))})"
            for item in found
        )
        plural = len(found) > 1
        raise ValueError(
            f"{self.where}: with `vmap_axes`, {symptom}. The likely cause: keyword argument{'s' if plural else ''} "
            f"{listing} {'are' if plural else 'is'} not mapped by `vmap_axes`, so every per-example call receives "
            f"all of {'them' if plural else 'it'}, although {'they have' if plural else 'it has'} an axis of the "
            f"batch size {batch_size} (an int `vmap_axes` maps no keyword argument). Pass "
            f"{suggested_vmap_axes(self.vmap_axes, found)} to map {'them' if plural else 'it'} with the examples."
        ) from error


def miscounted_examples(
    name: str, x: Any, x_axes: Optional[tuple[Optional[int], ...]], count: int, index: int, leaf: torch.Tensor,
    axis: int, where: str, symptom: str, said: str = "",
) -> Optional[str]:
    """The message for an input whose mapped axis does not hold its examples: ``vmap_axes`` maps
    ``count`` examples of ``name`` (``x``, with input axes ``x_axes``), but output leaf ``index``
    (``leaf``) has no ``count`` entries on its out axis ``axis``. None when it has them.
    ``symptom`` says what else went wrong, ``said`` ends the message (PyTorch's error)."""
    if leaf.ndim > axis and leaf.shape[axis] == count:
        return None
    named = dict(leaves_with_names(x, name))
    mapped = [
        (leaf_name, value, leaf_axis)
        for (leaf_name, value), leaf_axis in zip(named.items(), x_axes or ())
        if leaf_axis is not None and isinstance(value, torch.Tensor)
    ]
    listing = ", ".join(
        f"axis {leaf_axis} of {leaf_name}, of shape {tuple(value.shape)}" for leaf_name, value, leaf_axis in mapped
    )
    if any(value.ndim == 1 for _, value, _ in mapped):
        hint = (
            f"A 1-D input under `vmap_axes` makes each of its entries one example. For a single example "
            f"of a model that takes unbatched inputs, give it a batch axis ({name}[None]) or pass "
            f"vmap_axes=None"
        )
    else:
        hint = "Put the examples on the axis `vmap_axes` maps (or map the axis that holds them)"
    return (
        f"{where}: `vmap_axes` maps {count} examples of `{name}` ({listing or 'keyword arguments'}), "
        f"but the model's output leaf {index} on {name} has shape {tuple(leaf.shape)}, without "
        f"{count} entries on its out axis {axis}, {symptom}. {hint}.{said}"
    )


@dataclass(eq=False)
class PendingDerivatives:
    """The derivative check of a call's first preparation, left to its plan.

    NOTE: [The derivative check within a plan's check]
    The derivative check of NOTE: [Checking vmap_axes] compares per-example derivatives under
    vmap with the whole batch's; implementation 3's plan is checked against autograd on a few
    examples with random cotangents (NOTE: [Checking a plan against autograd]). Both run the
    model's weight gradients per example under vmap, the dearest part of a first call (a
    ResNet-18 on the CPU: 90 ms for two examples under vmap, 35 ms for the same two as one batch).
    Where 3's check can run (``check_sample``) and the plan leaves no parameter to the Jacobian
    fallback, it compares the structured ``J^T v`` with autograd's ``J^T v`` of the sampled
    examples as one batch instead (from the pass of the whole-batch check where that runs: NOTE:
    [Autograd's products from the whole-batch check] in ``structured/_whole_batch.py``):
    agreement shows at once that the rules hold and that the per-example derivatives 3 computes
    with are the whole batch's (no coupling, no vmap bug), and settles this check. Where they
    disagree, nothing is concluded from it: 3's check compares with per-example autograd as before, and the derivative check runs as it always did
    (:meth:`settle`), so every failure is still found and explained by the same messages.

    A kernel function defers the check this way only on calls that compute the NTK right after
    with AUTO or implementation 3 (``_kernel/preparation.py``, ``_settle_derivatives``), and settles
    it before the call goes on, on the first call of a key: later calls never see it.
    """

    check: VmapAxesCheck
    side1: Side
    side2: Optional[Side]
    ran: bool = False
    vouched_by_3: bool = False  # 3's plan check agreed with the whole batch's derivatives

    @property
    def open(self) -> bool:
        """Neither run nor vouched for: what 3's plan check may still settle."""
        return not (self.ran or self.vouched_by_3)

    def settle(self, computed_by_3: bool = False) -> None:
        """Runs the derivative check, unless it ran, or 3's plan check vouched for it and 3
        computes the kernel (``computed_by_3``): it vouches for 3's derivatives only."""
        if self.ran or (self.vouched_by_3 and computed_by_3):
            return
        self.check.derivatives(self.side1)
        side2 = self.side2
        if side2 is not None and self.side1.batch_size() < PROBE_EXAMPLES <= side2.batch_size():
            self.check.derivatives(side2)  # a batch of one hides vmap bugs that mix examples up
        self.ran = True


class VmapUnsupported(ValueError, VmapLimitation):
    """vmap fails on the model per example, while the same examples one at a time agree with the batch."""


def _random_cotangents(outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """``(R, *output.shape)`` standard normal cotangents per output leaf, from a fixed seed (the
    user's random stream is left alone)."""
    generator = torch.Generator().manual_seed(_COTANGENT_SEED)
    return tuple(
        torch.randn((_PROBE_COTANGENTS, *leaf.shape), generator=generator).to(dtype=leaf.dtype, device=leaf.device)
        for leaf in outputs
    )


def _stack_products(rows: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """Per-cotangent products (one tuple per cotangent) -> one ``(R, *param.shape)`` tensor per parameter."""
    return tuple(torch.stack(column) for column in zip(*rows))
