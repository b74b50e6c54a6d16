"""NTK implementation 0 (AUTO): the cheapest of 1, 2 and 3 for the shapes at hand.

NOTE: [AUTO's cost model]
Costs are analytic, in multiply-add FLOPs, from one counted forward pass of one example, the one
the memory model counts from too (NOTE: [One counting pass] in ``counting.py``; ``F``: the
forward cost of a side's whole batch, at least two FLOPs per parameter and example, plus
``_ELEMENT_FLOPS`` per element any op writes, for the memory-bound ops the FLOP formulas ignore)
and the shapes, plus a FLOP equivalent per sequential ATen call (NOTE: [AUTO's op-call overhead]):

* backward sweeps: ``B`` basis vectors (``O`` per example with ``vmap_axes``, every output entry
  without), each a backward pass over the batch: ``2 B F`` with weight gradients (1, 2), ``B F``
  without (3, whose sweeps stop at the ops' outputs);
* Jacobian contraction (1): ``2 |K| |T| P`` for a kernel of ``|K|`` entries, ``|T|`` traced
  coordinates and ``P`` parameters; memory: both sides' Jacobians;
* NTK-vector products (2): one forward-mode pass over x1 per ``TANGENTS_PER_PASS`` x2 output
  entries (fewer where NOTE: [Working-set runs] bounds a pass's tangents; then passes over runs of
  x1 carry all of a run of x2's entries, NOTE: [Forward-mode passes over runs of x1]), which
  computes the primal once (``F1``) and a tangent per entry (``2 F1``: a matrix product's tangent is two
  products; on BERT, pricing the primal with every tangent made AUTO pick 1 at 1.23x the time
  of 2).
  Without forward-mode derivatives (NOTE: [NTK-vector products without forward mode]) it is one
  recorded reverse pass over x1 (``3 F1``) plus one backward of that backward pass per x2 output
  entry, priced ``4 F1``: measured as fast as forward mode on the benchmark MLP, whose ReLU's
  second backward is a mask; smooth activations and MATH attention cost more there;
* structured derivatives (3): the ``df/dy`` sweeps (``B F``, their ATen calls once for x1 and
  x2 when one pass serves both: NOTE: [One pass for both sides]; fewer calls where the passes run
  over the whole batch, NOTE: [Whole-batch pullback], assumed for mapped sides until the checked
  plan says otherwise, which prices 3 again), opt_einsum's planned cost of
  every pair contraction (weighted by ``_STRUCTURED_CONTRACTION_WEIGHT``), plus the
  Jacobian-contraction cost of parameters the rules do not cover, whose Jacobians take sweeps of
  their own (the plan from the probe; when 3 is picked, the plan checked against autograd, so
  demoted parameters are priced as fallback); memory: ``G``, the operands and the largest planned
  intermediate.

NOTE: [What choosing may cost]
Choosing must cost a small fraction of the kernel it picks, also for models whose kernel takes a
few milliseconds, where every probe pass is a sizeable share of the kernel. Only the count is
always made (a plain forward pass of one example plus a few microseconds of Python dispatch per
ATen call, NOTE: [One counting pass], once per key and shared with the memory model);
everything else is made when it can change the pick and can pay for itself:

* implementation 2 is priced first with forward mode assumed, its lowest price, and probed
  (NOTE: [AUTO's feasibility filter]) only when it is still the cheapest after 3 is priced: a
  candidate is never picked unprobed, and an unprobed one could not have been picked anyway (on
  ResNet-18's full kernel 2's probe, a forward-mode pass, was 20 ms of a 35 ms choice that 3 won);
* implementation 3 is priced from its probe pass (:func:`structured.probe_plan`, estimated by
  :meth:`_Prices.probe_cost`) when 3 can be cheaper than the best of 1 and 2
  (:meth:`_Prices.structured_lower_bound`, the cost of 3 without its contractions, with x1 and x2
  in one ``df/dy`` pass wherever both are mapped) and the probe can pay for itself: it costs less
  than ``_PROBE_PAYBACK`` times what 3 could save at most, or less than ``_PROBE_BUDGET`` of the
  best kernel's estimate; weighed against 2's lowest price first, and again if 2's probe raised
  it. Only when 3 is then the cheapest is its plan checked against autograd
  (NOTE: [Checking a plan against autograd], the dearest part of a plan: many forward passes on
  CNNs), reusing the probe; parameters the check demotes are priced again as fallback. Before
  that, where 3 is priced with passes over the whole batch, the check's own whole-batch pass
  over its examples tells whether the shapes allow them (``StructuredDerivatives.layout_reason``;
  a recording pass where the examples are elsewhere than one example's shapes suggest, NOTE:
  [The layout read from the check's own pass]; a position embedding of Hugging Face
  transformers, one row for all examples, does not allow them, which that pass shows where it
  stops), and 3 is priced per example where they do
  not: a BERT whose 3 then lost to 1 paid 43% of its first call for a check it did not use. The
  check reuses that pass. The probe, the layout and the check are the plan the kernel computes
  with, so they are wasted only when 3 loses.
  Pricing 3 from the probe (:func:`structured_cost`) works on shapes, not meta tensors, and plans
  each pair contraction once with opt_einsum's optimiser but not its bookkeeping
  (:func:`structured._contract.pair_cost`): the same numbers as before in 55-80% of the time
  (0.3-1.5 ms on the small zoo models at N=16, planners' caches empty).

What remains is mostly passes over the model: the count (1-2 ms on the recurrent and ViT models
of the zoo at N=16) and, when 3 is priced, its probe (0.4-4 ms). The probe cannot also count:
whether to probe is decided from the count (and the probe's own Python costs are in its
recorder, ``structured/_recorder.py``).

What was not probed or priced is reported in ``AutoChoice.unprobed``. With ``_PROBE_EVERYTHING``
(the tests' switch) every candidate is probed and priced, as before the budget.

NOTE: [AUTO's feasibility filter]
A candidate that cannot run on the model is never chosen, and ``AutoChoice.excluded`` says why:
implementation 2 is probed on x1's first example (one forward-mode column, and one double-VJP
column if PyTorch reports an operation without forward-mode derivative; excluded when neither
can differentiate the model), implementation 3 when its plan cannot be made. Any error while
pricing a candidate excludes that candidate with the error as the reason instead of reaching
the caller: the cost model never fails a kernel call. If every candidate is excluded, Jacobian
contraction (1) runs and raises the model's own error, explained.

Candidates are priced as the plans that fit the budget (NOTE: [Memory plans]: the call as given,
or with the largest chunk_size that fits, at the cost of its blocks); those that cannot fit are
dropped unless none fits (the call is then refused); among the rest the smallest cost wins, ties
going to the earlier of 1, 2, 3. The constants were fitted on the real-model zoo and the benchmark
MLP and CNN (docs/real_models.md records each pick against the fastest, and what choosing cost);
the model still knows nothing of cache sizes or GEMM shapes, so it can be wrong when two
estimates are close, and ``auto_choice`` reports the estimates behind a choice.

The module is over 400 lines: the cost model and the order in which it probes are one piece of
reasoning, calibrated together.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .._call.kernel_call import KernelCall
from .._call.per_example import Side
from .._plan.scope import Scope
from .._layout.runs import runs
from .._memory import KernelMemoryError, default_budget, format_bytes
from .._utils.types import NtkImplementation
from .choice import AutoChoice, Estimate
from .counting import Counter, ExampleCount, counted_example, counter, example_shapes, uncached
from .memory import PLAN_ADVICE, MemoryPlan, bounded_peak, fitted_plan, kept_sizes, modelled_peak, run_count
from .ntk_vector_products import TANGENTS_PER_PASS, forward_mode_pass_counts, vector_products_method
from .structured._cost import structured_cost
from .structured._joint import gradients_per_example, joinable
from .structured._plan import Plan

_JACOBIAN = NtkImplementation.JACOBIAN_CONTRACTION
_PRODUCTS = NtkImplementation.NTK_VECTOR_PRODUCTS
_STRUCTURED = NtkImplementation.STRUCTURED_DERIVATIVES
_CANDIDATES = (_JACOBIAN, _PRODUCTS, _STRUCTURED)


@dataclass(frozen=True)
class StructuredPlans:
    """Implementation 3's plans for one call, made on demand: ``unchecked`` (from the probe pass:
    what pricing needs) and ``checked`` (against autograd, reusing that probe: what the kernel
    computes with). Any error either raises excludes 3."""

    unchecked: Callable[[], Plan]
    checked: Callable[[], Plan]
    layout_reason: Callable[[], Optional[str]] = lambda: None


def choose(
    call: KernelCall, plans: StructuredPlans, budget: Optional[float] = None, scope: Optional[Scope] = None,
) -> AutoChoice:
    """Prices implementations 1, 2 and 3 for ``call`` and picks the cheapest that can run and fits.

    Never raises for the model's sake: see NOTE: [AUTO's feasibility filter]. Probes only what can
    change the pick and pay for itself: see NOTE: [What choosing may cost].

    Args:
        call: the validated kernel call.
        plans: implementation 3's plans for ``call`` (made, or returned from the cache, only when 3
            is priced; checked only when 3 is picked).
        budget: the memory budget in bytes; None: the default for the call's device.
        scope: the record of the call's key, where the counts and the memory model's sizes are
            kept (NOTE: [One record per key]; None: for this choice alone).
    """
    budget = _memory_budget(call.outputs1[0].device) if budget is None else budget
    try:
        prices = _Prices(call, counter(call, scope))
    except Exception as error:  # noqa: BLE001 - the most general implementation runs unpriced
        reason = f"not priced: the cost model failed ({type(error).__name__}: {error})"
        return AutoChoice(_JACOBIAN, {}, budget, {}, {}, {implementation: reason for implementation in _CANDIDATES})
    estimates: dict[NtkImplementation, Estimate] = {}
    excluded: dict[NtkImplementation, str] = {}
    unprobed: dict[NtkImplementation, str] = {}

    def price(implementation: NtkImplementation, estimate: Callable[[], Estimate], structured: Any = None) -> None:
        try:
            priced = estimate()
            # NOTE: [Memory plans]: the memory model's peak, chunked to fit the budget when it must be
            estimates[implementation] = _planned(call, scope, prices, implementation, priced, budget, structured)
        except Exception as error:  # noqa: BLE001 - a failure excludes the candidate, never the call
            estimates.pop(implementation, None)
            excluded[implementation] = f"{type(error).__name__}: {error}"

    price(_JACOBIAN, prices.jacobian_contraction)
    price(_PRODUCTS, lambda: prices.ntk_vector_products(None))  # forward mode assumed: 2's lowest price

    plan: Optional[Plan] = None

    def price_structured() -> None:
        """Prices 3 from its probe, when it can beat the best of the others and pay for itself."""
        nonlocal plan
        others = _pick({k: v for k, v in estimates.items() if k != _STRUCTURED}, budget)
        try:
            reason = None if _PROBE_EVERYTHING or others is None else _why_not_plan(prices, estimates[others], budget)
        except Exception:  # noqa: BLE001 - an unpriced gate prices 3 rather than fail the call
            reason = None
        if reason is not None:
            unprobed[_STRUCTURED] = reason
            return
        unprobed.pop(_STRUCTURED, None)
        try:
            plan = plans.unchecked()
            price(_STRUCTURED, lambda: prices.structured_derivatives(plan), plan)
        except Exception as error:  # noqa: BLE001 - excludes implementation 3, like a pricing error
            estimates.pop(_STRUCTURED, None)
            excluded[_STRUCTURED] = f"{type(error).__name__}: {error}"

    price_structured()
    if _PRODUCTS in estimates:
        # 2's probe can only raise its price, so it is made only where 2 is still the pick
        if _PROBE_EVERYTHING or _pick(estimates, budget) == _PRODUCTS:
            price(_PRODUCTS, lambda: prices.ntk_vector_products(vector_products_method(call.side1)))
            if _STRUCTURED in unprobed:  # 3 was weighed against 2's lowest price: weigh it again
                price_structured()
        else:
            unprobed[_PRODUCTS] = "not probed (forward mode assumed): another implementation is estimated cheaper"
    if plan is not None and _STRUCTURED in estimates and _pick(estimates, budget) == _STRUCTURED:
        # NOTE: [What choosing may cost]: where 3 wins by passes over the whole batch, one recording
        # pass tells whether its shapes allow them, before the plan's check is paid for
        try:
            priced_whole = prices.may_take_whole_batch() and plan.whole_batch_reason is None
            reason = plans.layout_reason() if priced_whole else None
        except Exception:  # noqa: BLE001 - the check finds it out, at its own price
            reason = None
        if reason is not None:
            plan = dataclasses.replace(plan, whole_batch_reason=reason)
            price(_STRUCTURED, lambda: prices.structured_derivatives(plan), plan)
    if plan is not None and _STRUCTURED in estimates and (_PROBE_EVERYTHING or _pick(estimates, budget) == _STRUCTURED):
        try:
            checked = plans.checked()
            # the check demoted parameters, or found that the passes cannot take the whole batch
            # (NOTE: [Whole-batch pullback]): 3 costs more
            if checked.fallback != plan.fallback or checked.whole_batch_reason is not None:
                price(_STRUCTURED, lambda: prices.structured_derivatives(checked), checked)
            plan = checked
        except Exception as error:  # noqa: BLE001 - excludes implementation 3, like a pricing error
            estimates.pop(_STRUCTURED, None)
            excluded[_STRUCTURED] = f"{type(error).__name__}: {error}"

    fallback = {} if plan is None else {call.model.names[index]: plan.reasons.get(index, "") for index in plan.fallback}
    best = _pick(estimates, budget)
    if best is None:  # 1 then raises the model's own error, explained
        return AutoChoice(_JACOBIAN, {}, budget, fallback, excluded, unprobed)
    return AutoChoice(best, estimates, budget, fallback, excluded, unprobed)


def estimate_of(
    table: dict[NtkImplementation, Any], implementation: NtkImplementation, call: KernelCall, scope: Optional[Scope]
) -> Estimate:
    """The cost model's estimate of ``implementation`` (1, 2 or 3) on ``call``, FLOPs only, as
    :func:`choose` prices it unplanned: what a kernel function built with that implementation
    weighs the example loop against whole batches with (NOTE: [Loop or whole batches]).

    Raises:
        Exception: whatever the count, the probe or the plan raises (the caller does without).
    """
    prices = _Prices(call, counter(call, scope))
    if implementation == _JACOBIAN:
        return prices.jacobian_contraction()
    if implementation == _PRODUCTS:
        return prices.ntk_vector_products(vector_products_method(call.side1))
    return prices.structured_derivatives(table[_STRUCTURED].unchecked_plan(call, scope))


def _pick(estimates: dict[NtkImplementation, Estimate], budget: float) -> Optional[NtkImplementation]:
    """The cheapest candidate that fits ``budget`` bytes (3 by ``_STRUCTURED_MARGIN``), or the
    smallest if none fits; ties go to the earlier implementation. None without candidates."""
    if not estimates:
        return None
    fitting = {key: value for key, value in estimates.items() if value.memory_bytes <= budget}
    if not fitting:
        return min(estimates, key=lambda key: (estimates[key].memory_bytes, int(key)))
    margin = {_STRUCTURED: _STRUCTURED_MARGIN}
    return min(fitting, key=lambda key: (fitting[key].flops * margin.get(key, 1.0), int(key)))


def _planned(
    call: KernelCall, scope: Optional[Scope], prices: "_Prices", implementation: NtkImplementation,
    estimate: Estimate, budget: float, structured: Any,
) -> Estimate:
    """``estimate`` with the memory model's peak of the call as given (NOTE: [Memory plans]), or an
    upper bound of it that fits ``budget``; over ``budget``, the plan of the largest ``chunk_size``
    that fits instead, its FLOPs raised by the derivatives its blocks prepare again. A plan that
    cannot fit keeps its smallest peak (above the budget, so that :func:`_pick` drops it); a
    failure of the memory model keeps ``estimate``."""
    try:
        # AUTO's own count bounds the elements one example writes (each costs _ELEMENT_FLOPS of its
        # work): a candidate whose bounded peak fits needs no counted pass of its own.
        written = prices.example_work / _ELEMENT_FLOPS if prices.example_work > 2.0 * prices.params else 0.0
        bound = bounded_peak(call, implementation, written, structured)
        as_given = dataclasses.replace(estimate, flops=estimate.flops + _working_set_runs(prices, implementation))
        if bound is not None and bound.planned <= budget:
            return dataclasses.replace(as_given, memory_bytes=bound.planned)
        peak = modelled_peak(call, scope, implementation, call.chunk_size, structured)
        if peak.planned <= budget or not math.isfinite(budget):
            return dataclasses.replace(as_given, memory_bytes=peak.planned)
        plan = fitted_plan(call, scope, implementation, budget, structured)
    except KernelMemoryError as refusal:
        return dataclasses.replace(estimate, memory_bytes=refusal.needed_bytes or math.inf)
    except Exception:  # noqa: BLE001 - an estimate only: the FLOP model's figure stays
        return estimate
    runs1, runs2 = run_count(kept_sizes(call, scope), implementation, plan.chunk_size)
    flops = estimate.flops + _recomputed(prices, implementation, runs1, runs2, call.reuses_x1)
    return dataclasses.replace(estimate, flops=flops, memory_bytes=plan.peak.planned, chunk_size=plan.chunk_size)


def _working_set_runs(prices: "_Prices", implementation: NtkImplementation) -> float:
    """What the call's working-set runs add (NOTE: [Working-set runs]; none with a ``chunk_size``,
    priced by :func:`_recomputed`): every run is a per-example pass of its own, its ATen calls
    made again for the same FLOPs, and every pair of runs a contraction of its own. NTK-vector
    products keep their passes whole."""
    call = prices.call
    length = call.working_runs
    if implementation == _PRODUCTS or length is None or call.chunk_size is not None or not call.side1.mapped:
        return 0.0
    runs1 = len(runs(call.side1.batch_size(), length))
    mirrored = call.side2 is None
    runs2 = runs1 if mirrored else len(runs(call.side2.batch_size(), length))
    passes = runs1 - 1 if mirrored else runs1 + runs2 - 2
    blocks = runs1 * (runs1 + 1) / 2 if mirrored else runs1 * runs2
    return _run_calls(prices, passes, blocks)


def _run_calls(prices: "_Prices", passes: float, blocks: float) -> float:
    """The ATen calls, in FLOP equivalents, of ``passes`` more per-example passes and ``blocks``
    contractions where one would do."""
    calls = _SWEEP_OPS * prices.per_example_ops[0]
    contraction_calls = _CONTRACTION_OPS * len(prices.call.model.params) * len(prices.call.layouts)
    return prices.per_op * (passes * calls + (blocks - 1) * contraction_calls)


def _recomputed(prices: "_Prices", implementation: NtkImplementation, runs1: int, runs2: int, mirrored: bool) -> float:
    """What cutting x1 into ``runs1`` runs and x2 into ``runs2`` adds to an estimate (NOTE: [Blocks of
    examples]): x1's runs are prepared again for every run of x2 (with x2 None, for every pair of runs
    on and above the diagonal), each preparation a sweep over its examples plus its ATen calls, and
    every block is a contraction of its own. NTK-vector products keep x1 whole: nothing is repeated."""
    if implementation == _PRODUCTS or runs1 * runs2 == 1:
        return 0.0
    preparations = runs1 * (runs1 - 1) / 2 if mirrored else runs1 * runs2 - runs1
    blocks = runs1 * (runs1 + 1) / 2 if mirrored else runs1 * runs2
    weight_gradients = 2.0 if implementation == _JACOBIAN else 1.0  # 3's sweeps stop at the ops' outputs
    sweep = weight_gradients * prices.basis[0] * prices.forward[0] / runs1
    return preparations * sweep + _run_calls(prices, preparations, blocks)


def _why_not_plan(prices: "_Prices", best: Estimate, budget: float) -> Optional[str]:
    """Why implementation 3 is not priced against ``best``, the cheapest of 1 and 2 (None: price
    it). See NOTE: [What choosing may cost]."""
    if best.memory_bytes > budget:
        return None  # 3 may be the only candidate that fits
    bound, probe = prices.structured_lower_bound(), prices.probe_cost()
    if bound >= best.flops:
        return f"not priced: its lower bound {bound:.3g} FLOPs exceeds the best estimate {best.flops:.3g}"
    if probe <= _PROBE_PAYBACK * (best.flops - bound) or probe <= _PROBE_BUDGET * best.flops:
        return None
    return (
        f"not priced: its probe (about {probe:.3g} FLOPs) would cost more than it can save "
        f"(at most {best.flops - bound:.3g} of the best estimate {best.flops:.3g})"
    )


class _Prices:
    """The cost model's quantities for one call (NOTE: [AUTO's cost model]), and the estimates."""

    def __init__(self, call: KernelCall, count: Optional[Counter] = None):
        """``count``: the sides' counted passes (NOTE: [One counting pass]); by default made for
        this call alone."""
        self.call = call
        count = uncached(call) if count is None else count
        sides = [(call.side1, call.outputs1)] + ([(call.side2, call.outputs2)] if call.side2 is not None else [])
        self.element = max(call.model.params[0].element_size(), max(o.element_size() for o in call.outputs1))
        self.params = sum(p.numel() for p in call.model.params)
        forward, ops, per_example_ops, basis, entries, inner = [], [], [], [], [], []
        counts: dict = {}  # x2 with x1's per-example shapes is priced from x1's count
        for side, outputs in sides:
            examples = side.batch_size() if side.mapped else 1
            shapes = example_shapes(side)
            if shapes is None or shapes not in counts:
                counts[shapes] = _forward_figures(side, count(side)), examples
            (counted, op_calls, written, derivative_calls), counted_examples = counts[shapes]
            if not forward:
                self.example_work = max(written, 2.0 * self.params)  # one counted pass of x1
            counted *= examples / counted_examples
            forward.append(max(counted, 2.0 * self.params * examples))
            ops.append(max(op_calls, 1))  # one batched (or whole-batch) pass
            inner.append(derivative_calls)
            per_example_ops.append(ops[-1] * (examples if side.loop else 1))  # an example loop repeats them
            total = sum(o.numel() for o in outputs)
            basis.append(total / examples if side.mapped else total)
            entries.append(total)
        if call.side2 is None:
            forward, ops, per_example_ops, inner = forward * 2, ops * 2, per_example_ops * 2, inner * 2
            basis, entries = basis * 2, entries * 2
            self.sweep_sides = 1
        else:
            self.sweep_sides = 2
        self.forward, self.ops, self.per_example_ops = forward, ops, per_example_ops
        self.forward_mode_ops = [
            _FORWARD_MODE_OPS * (total - derivatives) + _FORWARD_MODE_DERIVATIVE_OPS * derivatives
            for total, derivatives in zip(ops, inner)
        ]  # NOTE: [Derivatives in the counted pass]
        self.basis, self.entries = basis, entries
        self.kernel = sum(
            math.prod(shape) * layout.trace_size(o.shape)
            for shape, layout, o in zip(call.kernel_shapes(), call.layouts, call.outputs1)
        )
        self.sweeps = sum(2.0 * b * f for b, f in list(zip(basis, forward))[: self.sweep_sides])
        self.sweep_ops = _SWEEP_OPS * sum(per_example_ops[: self.sweep_sides])
        self.per_op = _op_call_flops(call.outputs1[0].device)

    def jacobian_contraction(self) -> Estimate:
        calls = self.sweep_ops + _CONTRACTION_OPS * len(self.call.model.params) * len(self.call.layouts)
        jacobians = self.params * sum(self.entries[: self.sweep_sides])
        flops = self.sweeps + 2.0 * self.kernel * self.params + self.per_op * calls + _ELEMENT_FLOPS * jacobians
        return Estimate(flops, self.element * jacobians)

    def ntk_vector_products(self, method: Optional[tuple[str, Optional[str]]]) -> Estimate:
        """Implementation 2 computing its columns by ``method`` (what ``vector_products_method``
        returns), or in forward mode, unprobed, when None."""
        forward, ops, per_example_ops = self.forward, self.ops, self.per_example_ops
        x2_vectors = 2.0 * self.basis[1] * forward[1]
        memory = self.element * self.params * 8
        if method is None or method[1] is None:
            primal, passes = forward_mode_pass_counts(self.call)
            calls = _SWEEP_OPS * per_example_ops[1] + passes * self.forward_mode_ops[0]
            columns = _TANGENT_FORWARDS * self.entries[1] * forward[0] + primal * forward[0]
            return Estimate(x2_vectors + columns + self.per_op * calls, memory)
        name, missing = method
        passes = math.ceil(self.entries[1] / (self.call.tangents_per_pass or TANGENTS_PER_PASS))
        calls = _SWEEP_OPS * (per_example_ops[1] + ops[0]) + passes * _DOUBLE_VJP_OPS * ops[0]
        flops = x2_vectors + 3.0 * forward[0] + 4.0 * self.entries[1] * forward[0] + self.per_op * calls
        return Estimate(flops, memory, f"{name}: no forward-mode derivative for {missing}")

    def structured_derivatives(self, plan: Plan) -> Estimate:
        structured = structured_cost(self.call, plan)
        side1, side2 = self.call.side1, self.call.side2
        joint = side2 is not None and joinable(side1, side2, gradients_per_example(self.call, plan))
        whole = self.may_take_whole_batch() and plan.whole_batch_reason is None
        calls = _CONTRACTION_OPS * structured.contractions + (self.sweep_ops if plan.fallback else 0)
        contractions = _STRUCTURED_CONTRACTION_WEIGHT * structured.contraction_flops
        # The fallback's Jacobians take backward sweeps of their own, through the whole model.
        # Half of a sweep is the input gradients, paid for any fallback parameter; the other half,
        # the weight gradients, in proportion to the parameters in the fallback (a model whose
        # linear layers all lacked a rule looked cheaper under 3 than under 1, at 1.9x 1's time).
        share = structured.fallback_params / max(self.params, 1)
        fallback_sweeps = self.sweeps / 2 * (1 + share) if plan.fallback else 0.0
        held = _ELEMENT_FLOPS * structured.memory_elements  # NOTE: [What is held is written]
        passes = self._structured_passes(joint, whole)
        flops = passes + fallback_sweeps + contractions + self.per_op * calls + held
        return Estimate(flops, self.element * structured.memory_elements)

    def structured_lower_bound(self) -> float:
        """:meth:`structured_derivatives` without its contractions and fallback: what 3 costs at least
        (with x1 and x2 in one pass wherever both sides are mapped, as the plan may allow, and that
        pass over the whole batch where it may be)."""
        side1, side2 = self.call.side1, self.call.side2
        may_join = side2 is not None and side1.mapped and side2.mapped and not (side1.loop or side2.loop)
        return self._structured_passes(may_join, self.may_take_whole_batch())

    def may_take_whole_batch(self) -> bool:
        """Whether 3's passes may run over the whole batch (NOTE: [Whole-batch pullback]): every side
        mapped by vmap. Whether they do is known once the plan is checked, which sets
        ``Plan.whole_batch_reason`` where they cannot (:func:`choose` prices 3 again then)."""
        sides = [self.call.side1] + ([self.call.side2] if self.call.side2 is not None else [])
        return all(side.mapped and not side.loop for side in sides)

    def _structured_passes(self, joint: bool, whole: bool) -> float:
        """The forward and ``df/dy`` passes of 3; ``joint``: x1 and x2 in one pass (NOTE: [One pass
        for both sides]), which makes the ATen calls of one side's pass for both; ``whole``: over
        the whole batch (NOTE: [AUTO's op-call overhead])."""
        per_example_ops = self.per_example_ops[:1] if joint else self.per_example_ops[: self.sweep_sides]
        calls = (_WHOLE_BATCH_OPS if whole else _SWEEP_OPS + 1) * sum(per_example_ops)
        return self.sweeps / 2 + 2.0 * sum(self.forward[: self.sweep_sides]) + self.per_op * calls

    def probe_cost(self) -> float:
        """What pricing implementation 3 costs, in the same FLOP equivalents: the recorded probe
        pass of one example (NOTE: [What choosing may cost])."""
        return _PROBE_OPS * self.per_op * self.ops[0] + _PROBE_FORWARDS * self.example_work


def _forward_figures(side: Side, count: Optional[ExampleCount]) -> tuple[float, int, float, int]:
    """The forward FLOPs of ``side``'s batch (multiply-adds), the ATen calls of one pass, the
    FLOPs of the counted pass without views' elements and the part of those calls the model's own
    derivatives made (NOTE: [Derivatives in the counted pass]), from its counted pass (NOTE: [One
    counting pass]), or zeros without one (the caller then uses lower bounds).

    A mapped side is counted on its first example as a batch of one, without vmap, and its FLOPs
    scaled by the batch size: the counter costs Python time on every call. The estimates count a
    view's elements as written, as when their constants were fitted; that prices a dense layer's
    transposed weight as work, which inflates ``F`` of dense models (refitting without views made
    2 look cheaper than it runs on GPT-2 and the small MLPs: left undone). The probe's cost
    (:meth:`_Prices.probe_cost`, fitted later) leaves views out.
    """
    if count is None:
        return 0.0, 0, 0.0, 0
    scale = side.batch_size() if counted_example(side) is not side else 1
    counted = float(count.flops) / 2 + _ELEMENT_FLOPS * count.elements  # a multiply-add counts two
    written = counted - _ELEMENT_FLOPS * count.view_elements
    return scale * counted, count.calls, written, count.derivative_calls


# NOTE: [AUTO's op-call overhead]
# Small models spend their time in the ~10-50 us each ATen call costs under torch.func (Python
# dispatch, functorch wrappers, allocation), not in FLOPs: on the zoo of docs/real_models.md,
# NTK-vector products ran at 0.3-0.5 GFLOP/s on recurrent and attention models (a forward-mode
# pass per 24 output entries of x2) where Jacobian contraction ran at 6-35. Each estimate
# therefore adds, per sequential ATen call, the FLOPs the device does in that time. The calls are
# counted on one vmapped forward pass (``ops``) and scaled by the passes each implementation makes:
_SWEEP_OPS = 3  # a forward and a backward pass (about twice the forward's calls)
_FORWARD_MODE_OPS = 2  # a forward-mode pass: primal and tangent calls
_FORWARD_MODE_DERIVATIVE_OPS = 7
"""A forward-mode pass's ATen calls per call of a derivative the model takes inside ``forward``.

NOTE: [Derivatives in the counted pass]
A model that differentiates inside ``forward`` (forces ``-dE/dx``, a PDE residual) runs a backward
pass within its forward one; the counted pass (``counting.py``) tells those calls apart, as the
calls autograd's engine makes while it runs (``torch._C._current_graph_task_id``). Implementation
2's forward-mode pass carries a tangent through each of them, and the forward-mode formulas of
backward ops are composites of several calls: on whole batches, the warm calls' ATen counts of 1
and 2 give 7.6 calls per derivative call on a Poisson residual by ``torch.autograd.grad`` and on
torchani's energies, 6.3 on the residual by ``torch.func.hessian`` and 6.7 on a pair-distance
force field (2 per call of the forward itself). Priced at 2 as every other call, 2 came out 18%
below 1 on torchani's float64 energies and ran 1.5x slower. Models without such derivatives count
none, so their prices are unchanged."""
_DOUBLE_VJP_OPS = 4  # the backward of a recorded backward pass
_CONTRACTION_OPS = 3  # an einsum (reshapes, the product, the sum into the kernel)
_WHOLE_BATCH_OPS = 2
"""Structured derivatives' passes over the whole batch (NOTE: [Whole-batch pullback]): one forward
pass and one backward sweep that stops at the ops' outputs, batched over the output basis but free
of ``vmap``'s per-example batching rules. Counted against the per-example pass (``_SWEEP_OPS + 1``):
implementation 3's ATen calls per warm call fell from 7,651 to 4,798 on ResNet-18 (3x64x64, 8
logits, N = 8, full) and from 1,719 to 927 on a 2-layer LoRA BERT (N = 8), with the passes
priced at 2 instead of 4 calls per counted call. Before, AUTO picked 1 on the base-size LoRA BERT
(13,650 calls) where 3 makes 7,713 in the same CPU time."""
_TANGENT_FORWARDS = 2  # a forward-mode tangent: two products per matrix product of the primal
_OP_CALL_FLOPS = {"cpu": 4e5, "cuda": 3e8}
"""FLOPs per ATen call: fitted on the zoo for the 2-core CPU of docs/benchmarks.md; for CUDA, about
20 us at 15 TFLOP/s, set before a GPU ran. Against the H100 timings of docs/benchmarks.md ("AUTO's
price of an operation call on CUDA") it picks the fastest implementation on 7 of 8 rows (the miss:
a noisy CNN row, 1.55x), where the CPU's price would miss two (ResNet-18 by 1.48x)."""
_STRUCTURED_CONTRACTION_WEIGHT = 0.5
"""Structured derivatives' pair contractions are few large einsums that the BLAS runs at about twice
the FLOP rate of the per-example backward sweeps of Jacobian contraction (measured on the CNNs of
docs/benchmarks.md and the zoo), so their FLOPs count half."""
_STRUCTURED_MARGIN = 1.05
"""Implementation 3 is picked only when its estimate is this much below the others': on GPT-2
with LoRA at N = 128 (working-set runs of 6 examples) its estimate tied 1's within 0.3% while 1
ran 1.26x faster (15.1 s against 19.1 s, two threads), a cost the model does not see in 3's
passes per run. Wherever the zoo picks 3, its estimate is 29-86% below the others', so no pick
there changes."""
_ELEMENT_FLOPS = 20.0
"""FLOPs per element an op writes: the FLOP formulas cover matrix products and convolutions only,
while normalisations, activations and softmax move memory at a small fraction of their speed.

NOTE: [What is held is written]
The same price applies to what an implementation holds for its contractions, every element of it
written once: implementation 1's Jacobians and 3's factors, intermediates and fallback Jacobians
(their memory estimates). Without it the two tied on a base-size transformer's LoRA and BitFit
kernels (the same forward and backward passes, within 0.2%), and AUTO picked 3, which held 6-60x
the memory of 1's Jacobians at N = 64 (3.5 GB on BitFit) for no speed."""
_PROBE_OPS = 2
_PROBE_FORWARDS = 3
"""Implementation 3's probe (one recorded forward pass of one example, :func:`structured.probe_plan`)
costs 1.0-1.9 counted passes on the zoo, plus the pass's own FLOPs a few times over (its recorder
keeps every parameter use). Converted at each model's own rate (implementation 1's estimate over
its time, two threads), the probes of BERT, BERT with LoRA, GPT-2, the transformer encoder, a
ViT and MobileNetV3-small cost 0.6-2.4 ATen-call equivalents per call of the counted pass, 0.9
at the median; 2 keeps the price on the safe side. At 4 (the first fit) BERT with LoRA was never
priced for 3, whose kernel is 20% faster than 1's there."""
_PROBE_PAYBACK = 1.5
"""The probe may cost this many times what 3 can save at most (the best estimate less 3's lower
bound): it is reused by the plan when 3 wins, and the bound leaves out the contractions, so the
saving is usually smaller than it allows."""
_PROBE_BUDGET = 0.05
"""The share of the best kernel's estimate the probe may cost even when 3 cannot save as much."""
_PROBE_EVERYTHING = False
"""Probe and price every candidate whatever it costs (the tests of the probes set it)."""


def _op_call_flops(device: torch.device) -> float:
    return _OP_CALL_FLOPS.get(device.type, _OP_CALL_FLOPS["cuda"])


def _memory_budget(device: torch.device) -> float:
    """The budget of a choice made without one (``auto_choice``, ``batch``'s blocks): NOTE: [Memory budgets]."""
    return default_budget(device)


_CHOICE = "auto choice"
"""The kind of AUTO's choice in a key's record (NOTE: [One record per key])."""


@dataclass(frozen=True)
class AutoSelector:
    """AUTO (implementation 0): the cost policy that picks one of the table's implementations per
    key (the choice kept in the key's record, reached by the ``scope`` each method is given:
    NOTE: [One record per key]). Not an entry of the table: the picked implementation computes.

    ``table`` is the kernel function's implementation table (NOTE: [The implementation table]); its
    structured derivatives are priced from, and then compute with, the same kept plan.
    """

    table: dict = field(compare=False)

    def choice(self, call: KernelCall, scope: Optional[Scope], budget: Optional[float] = None) -> AutoChoice:
        """The kept choice; made anew when the kept plan exceeds ``budget`` (a default budget
        follows the free memory, which changes between calls)."""
        choice = None if scope is None else scope.get(_CHOICE, call)
        if choice is None or (budget is not None and not _fits(choice, budget)):
            structured = self.table[_STRUCTURED]
            plans = StructuredPlans(
                lambda: structured.unchecked_plan(call, scope), lambda: structured.plan(call, scope),
                lambda: structured.layout_reason(call, scope),
            )
            choice = choose(call, plans, budget, scope)
            if scope is not None:
                scope.put(_CHOICE, call, choice)
        return choice

    def plan(self, call: KernelCall, scope: Optional[Scope], budget: float) -> MemoryPlan:
        """The plan of the implementation AUTO picks within ``budget`` (NOTE: [Memory plans]).

        Raises:
            KernelMemoryError: no candidate's plan fits.
        """
        choice = self.choice(call, scope, budget)
        estimate = choice.estimates.get(choice.implementation)
        if estimate is None:  # not priced (the cost model failed): plan it as a fixed implementation
            structured = self._structured_plan(choice, call, scope)
            return fitted_plan(call, scope, choice.implementation, budget, structured)
        if math.isfinite(budget) and estimate.memory_bytes > budget:
            needs = ", ".join(
                f"{int(implementation)} needs {format_bytes(value.memory_bytes)}"
                for implementation, value in sorted(choice.estimates.items())
            )
            raise KernelMemoryError(
                f"{call.where}: implementation 0 (AUTO): no implementation fits the memory budget of "
                f"{format_bytes(budget)} even with one example per block ({needs}). {PLAN_ADVICE}",
                min(value.memory_bytes for value in choice.estimates.values()), budget,
            )
        if not math.isfinite(budget):
            return MemoryPlan(choice.implementation, estimate.chunk_size or call.chunk_size, None, budget)
        structured = self._structured_plan(choice, call, scope)
        chunk = estimate.chunk_size if estimate.chunk_size is not None else call.chunk_size
        peak = modelled_peak(call, scope, choice.implementation, chunk, structured)
        replaced = None
        if chunk != call.chunk_size:
            replaced = modelled_peak(call, scope, choice.implementation, call.chunk_size, structured)
        return MemoryPlan(choice.implementation, chunk, peak, budget, replaced)

    def _structured_plan(self, choice: AutoChoice, call: KernelCall, scope: Optional[Scope]) -> Any:
        if choice.implementation != _STRUCTURED:
            return None
        return self.table[_STRUCTURED].plan(call, scope)

    def blocks(self, call: KernelCall, scope: Optional[Scope], block: Optional[tuple] = None) -> Any:
        """The block plan of the implementation chosen for the first block (``block``: the block
        sizes of x1 and x2), whose shapes every other block but the last shares."""
        first, choice_scope = call, scope
        if block is not None:
            first = call.narrow((0, block[0]), None if call.reuses_x1 else (0, block[1]))
            choice_scope = None if scope is None else scope.within(block)
        chosen = self.choice(first, choice_scope).implementation
        return self.table[chosen].blocks(call, scope, block)


def _fits(choice: AutoChoice, budget: float) -> bool:
    """Whether the plan ``choice`` picked fits ``budget`` (an unpriced pick is planned at the call)."""
    estimate = choice.estimates.get(choice.implementation)
    return estimate is None or estimate.memory_bytes <= budget

