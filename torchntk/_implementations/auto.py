"""NTK implementation 0 (AUTO): the cheapest of 1, 2 and 3 for the shapes at hand.

NOTE: [AUTO's cost model]
Costs are analytic, in multiply-add FLOPs, from one forward pass counted by
``torch.utils.flop_counter.FlopCounterMode`` (``F``: the forward cost of a side's whole batch,
at least two FLOPs per parameter and example, plus ``_ELEMENT_FLOPS`` per element any op writes,
for the memory-bound ops the counter ignores) and the shapes, plus a FLOP equivalent per
sequential ATen call (NOTE: [AUTO's op-call overhead]):

* backward sweeps: ``B`` basis vectors (``O`` per example with ``vmap_axes``, every output entry
  without), each a backward pass over the batch: ``2 B F`` with weight gradients (1, 2), ``B F``
  without (3, whose sweeps stop at the ops' outputs);
* Jacobian contraction (1): ``2 |K| |T| P`` for a kernel of ``|K|`` entries, ``|T|`` traced
  coordinates and ``P`` parameters; memory: both sides' Jacobians;
* NTK-vector products (2): one forward-mode pass over x1 (about ``3 F1``) per x2 output entry.
  Without forward-mode derivatives (NOTE: [NTK-vector products without forward mode]) it is one
  recorded reverse pass over x1 (``3 F1``) plus one backward of that backward pass per x2 output
  entry, priced ``4 F1``: measured as fast as forward mode on the benchmark MLP, whose ReLU's
  second backward is a mask; smooth activations and MATH attention cost more there;
* structured derivatives (3): opt_einsum's planned cost of every pair contraction (weighted by
  ``_STRUCTURED_CONTRACTION_WEIGHT``), plus the
  Jacobian-contraction cost of parameters the rules do not cover (the plan implementation 3 would
  use, checked against autograd, so demoted parameters are priced as fallback); memory: ``G``, the
  operands and the largest planned intermediate.

NOTE: [AUTO's feasibility filter]
A candidate that cannot run on the model is never chosen, and ``AutoChoice.excluded`` says why:
implementation 2 is probed on x1's first example (one forward-mode column, and one double-VJP
column if PyTorch reports an operation without forward-mode derivative; excluded when neither
can differentiate the model), implementation 3 when its plan cannot be made. Any error while
pricing a candidate excludes that candidate with the error as the reason instead of reaching
the caller: the cost model never fails a kernel call. If every candidate is excluded, Jacobian
contraction (1) runs and raises the model's own error, explained.

Candidates whose memory estimate exceeds the budget (half the machine's RAM, or the free memory
of the CUDA device) are dropped unless none fits; among the rest the smallest cost wins, ties
going to the earlier of 1, 2, 3. The constants were fitted on the real-model zoo and the benchmark
MLP and CNN (docs/real_models.md records each pick against the fastest); the model still knows
nothing of cache sizes or GEMM shapes, so it can be wrong when two estimates are close, and
``auto_choice`` reports the estimates behind a choice.
"""

from __future__ import annotations

import math
import os
from typing import Any, Hashable, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from .._bounded_cache import BoundedCache
from .._call import KernelCall
from .._types import NtkImplementation
from .._unfused import forward_mode_kernels
from ._choice import AutoChoice, Estimate
from .ntk_vector_products import TANGENTS_PER_PASS, vector_products_method
from .structured._cost import structured_cost
from .structured._plan import Plan


def choose(call: KernelCall, plan: Plan | BaseException) -> AutoChoice:
    """Prices implementations 1, 2 and 3 for ``call`` and picks the cheapest that can run and fits.

    Never raises for the model's sake: see NOTE: [AUTO's feasibility filter].

    Args:
        call: the validated kernel call.
        plan: implementation 3's plan for ``call`` (from ``StructuredDerivatives.plan``), or the
            error making it raised (which excludes implementation 3).
    """
    sides = [(call.side1, call.outputs1)] + ([(call.side2, call.outputs2)] if call.side2 is not None else [])
    element = max(call.model.params[0].element_size(), max(o.element_size() for o in call.outputs1))
    params = sum(p.numel() for p in call.model.params)
    forward, ops, per_example_ops, basis, entries = [], [], [], [], []
    counts: dict = {}  # x2 with x1's per-example shapes is priced from x1's count
    for side, outputs in sides:
        examples = side.batch_size() if side.mapped else 1
        shapes = _per_example_shapes(side)
        if shapes is None or shapes not in counts:
            counts[shapes] = _forward_count(side), examples
        (counted, op_calls), counted_examples = counts[shapes]
        counted *= examples / counted_examples
        forward.append(max(counted, 2.0 * params * examples))
        ops.append(max(op_calls, 1))  # one batched (or whole-batch) pass
        per_example_ops.append(ops[-1] * (examples if side.loop else 1))  # an example loop repeats them
        total = sum(o.numel() for o in outputs)
        basis.append(total / examples if side.mapped else total)
        entries.append(total)
    if call.side2 is None:
        forward, ops, per_example_ops = forward * 2, ops * 2, per_example_ops * 2
        basis, entries = basis * 2, entries * 2
        sweep_sides = 1
    else:
        sweep_sides = 2
    kernel = sum(math.prod(shape) * layout.trace_size(o.shape) for shape, layout, o in zip(call.kernel_shapes(), call.layouts, call.outputs1))
    sweeps = sum(2.0 * b * f for b, f in list(zip(basis, forward))[:sweep_sides])
    sweep_ops = _SWEEP_OPS * sum(per_example_ops[:sweep_sides])
    per_op = _op_call_flops(call.outputs1[0].device)

    def jacobian_contraction() -> Estimate:
        calls = sweep_ops + _CONTRACTION_OPS * len(call.model.params) * len(call.layouts)
        return Estimate(sweeps + 2.0 * kernel * params + per_op * calls, element * params * sum(entries[:sweep_sides]))

    def ntk_vector_products() -> Estimate:
        method, missing = vector_products_method(call.side1)
        x2_vectors = 2.0 * basis[1] * forward[1]
        passes = math.ceil(entries[1] / TANGENTS_PER_PASS)
        if missing is None:
            calls = _SWEEP_OPS * per_example_ops[1] + passes * _FORWARD_MODE_OPS * ops[0]
            flops = x2_vectors + 3.0 * entries[1] * forward[0] + per_op * calls
            return Estimate(flops, element * params * 8)
        calls = _SWEEP_OPS * (per_example_ops[1] + ops[0]) + passes * _DOUBLE_VJP_OPS * ops[0]
        flops = x2_vectors + 3.0 * forward[0] + 4.0 * entries[1] * forward[0] + per_op * calls
        return Estimate(flops, element * params * 8, f"{method}: no forward-mode derivative for {missing}")

    def structured_derivatives() -> Estimate:
        if isinstance(plan, BaseException):
            raise plan
        structured = structured_cost(call, plan)
        calls = (_SWEEP_OPS + 1) * sum(per_example_ops[:sweep_sides]) + _CONTRACTION_OPS * structured.contractions
        if plan.fallback:
            calls += sweep_ops
        contractions = _STRUCTURED_CONTRACTION_WEIGHT * structured.contraction_flops
        return Estimate(
            sweeps / 2 + 2.0 * sum(forward[:sweep_sides]) + contractions + per_op * calls,
            element * structured.memory_elements,
        )

    estimates: dict[NtkImplementation, Estimate] = {}
    excluded: dict[NtkImplementation, str] = {}
    for implementation, estimate in (
        (NtkImplementation.JACOBIAN_CONTRACTION, jacobian_contraction),
        (NtkImplementation.NTK_VECTOR_PRODUCTS, ntk_vector_products),
        (NtkImplementation.STRUCTURED_DERIVATIVES, structured_derivatives),
    ):
        try:
            estimates[implementation] = estimate()
        except Exception as error:  # noqa: BLE001 - a failure excludes the candidate, never the call
            excluded[implementation] = f"{type(error).__name__}: {error}"
    budget = _memory_budget(call.outputs1[0].device)
    fallback = {} if isinstance(plan, BaseException) else {
        call.model.names[index]: plan.reasons.get(index, "") for index in plan.fallback
    }
    if not estimates:  # 1 then raises the model's own error, explained
        return AutoChoice(NtkImplementation.JACOBIAN_CONTRACTION, {}, budget, fallback, excluded)
    fitting = {key: value for key, value in estimates.items() if value.memory_bytes <= budget}
    if not fitting:
        smallest = min(estimates, key=lambda key: estimates[key].memory_bytes)
        fitting = {smallest: estimates[smallest]}
    best = min(fitting, key=lambda key: (fitting[key].flops, int(key)))
    return AutoChoice(best, estimates, budget, fallback, excluded)


class _OpCalls(TorchDispatchMode):
    """Counts the ATen calls that reach the dispatcher (one per op of a vmapped forward pass)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.elements = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.count += 1
        result = func(*args, **(kwargs or {}))
        self.elements += sum(leaf.numel() for leaf in pytree.tree_leaves(result) if isinstance(leaf, torch.Tensor))
        return result


def _forward_count(side) -> tuple[float, int]:
    """The forward FLOPs of ``side``'s batch (multiply-adds) and the ATen calls of one pass, or
    zeros if the counters cannot run the model (the caller then uses lower bounds).

    A mapped side is counted on its first example as a batch of one, without vmap, and its FLOPs
    scaled by the batch size: the counters cost Python time on every call, which on a large model
    made counting cost a third of the kernel.
    """
    flops, calls = FlopCounterMode(display=False), _OpCalls()
    example = side.narrow(0, 1) if side.mapped and side.batch_size() > 1 else side
    try:
        # Under forward_mode_kernels, attention and recurrent layers run the composite ops that the
        # differentiated passes run, not the inference fast paths a no-grad pass would take.
        with torch.no_grad(), forward_mode_kernels(bool(side.model.fused)), flops, calls:
            example.whole_batch()(side.model.params)
    except Exception:  # noqa: BLE001 - a pricing aid only; the implementations report the error
        return 0.0, 0
    scale = side.batch_size() if example is not side else 1
    counted = float(flops.get_total_flops()) / 2 + _ELEMENT_FLOPS * calls.elements  # a multiply-add counts two
    return scale * counted, calls.count


def _per_example_shapes(side) -> Optional[tuple]:
    """The shapes and dtypes of one example of a mapped side (None for whole batches)."""
    if not side.mapped or side.batch_size() == 0:
        return None
    example = side.narrow(0, 1)
    leaves = list(example.x.leaves) + [leaf for flat in example.kwargs.values() for leaf in flat.leaves]
    return tuple((tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves)


# NOTE: [AUTO's op-call overhead]
# Small models spend their time in the ~10-50 us each ATen call costs under torch.func (Python
# dispatch, functorch wrappers, allocation), not in FLOPs: on the zoo of docs/real_models.md,
# NTK-vector products ran at 0.3-0.5 GFLOP/s on recurrent and attention models (a forward-mode
# pass per 24 output entries of x2) where Jacobian contraction ran at 6-35. Each estimate
# therefore adds, per sequential ATen call, the FLOPs the device does in that time. The calls are
# counted on one vmapped forward pass (``ops``) and scaled by the passes each implementation makes:
_SWEEP_OPS = 3  # a forward and a backward pass (about twice the forward's calls)
_FORWARD_MODE_OPS = 2  # a forward-mode pass: primal and tangent calls
_DOUBLE_VJP_OPS = 4  # the backward of a recorded backward pass
_CONTRACTION_OPS = 3  # an einsum (reshapes, the product, the sum into the kernel)
_OP_CALL_FLOPS = {"cpu": 4e5, "cuda": 3e8}
_STRUCTURED_CONTRACTION_WEIGHT = 0.5
"""Structured derivatives' pair contractions are few large einsums that the BLAS runs at about twice
the FLOP rate of the per-example backward sweeps of Jacobian contraction (measured on the CNNs of
docs/benchmarks.md and the zoo), so their FLOPs count half."""
_ELEMENT_FLOPS = 20.0
"""FLOPs per element an op writes: the FLOP counter sees matrix products and convolutions only,
while normalisations, activations and softmax move memory at a small fraction of their speed."""
"""FLOPs per ATen call: fitted on the zoo for the 2-core CPU of docs/benchmarks.md; for CUDA, about
20 us at 15 TFLOP/s, not measured (no GPU was available)."""


def _op_call_flops(device: torch.device) -> float:
    return _OP_CALL_FLOPS.get(device.type, _OP_CALL_FLOPS["cuda"])


def _memory_budget(device: torch.device) -> float:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return 0.8 * free
    try:
        return 0.5 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return math.inf


class AutoSelector:
    """Implementation 0: chooses per input shapes (cached) and runs the chosen implementation.

    ``table`` is the kernel function's implementation table (NOTE: [The implementation table]); its
    structured derivatives are priced from, and then compute with, the same cached plan.
    """

    def __init__(self, table: dict[NtkImplementation, Any]):
        self._table = table
        self._choices = BoundedCache(_REMEMBERED_CHOICES)

    def choice(self, call: KernelCall, key: Hashable) -> AutoChoice:
        cache_key = call.cache_key(key)
        choice = self._choices.get(cache_key)
        if choice is None:
            try:
                plan: Plan | BaseException = self._table[NtkImplementation.STRUCTURED_DERIVATIVES].plan(call, key)
            except Exception as error:  # noqa: BLE001 - excludes implementation 3, see choose()
                plan = error
            choice = choose(call, plan)
            self._choices[cache_key] = choice
        return choice

    def kernels(self, call: KernelCall, key: Hashable) -> Any:
        return self._table[self.choice(call, key).implementation].kernels(call, key)

    def blocks(self, call: KernelCall, key: Hashable, thorough: bool = False, block: Optional[tuple] = None) -> Any:
        """The block plan of the implementation chosen for the first block (``block``: the block
        sizes of x1 and x2), whose shapes every other block but the last shares."""
        first, choice_key = call, key
        if block is not None:
            first = call.narrow((0, block[0]), None if call.reuses_x1 else (0, block[1]))
            choice_key = (key, block)
        chosen = self.choice(first, choice_key).implementation
        return self._table[chosen].blocks(call, key, thorough, block)


_REMEMBERED_CHOICES = 64
