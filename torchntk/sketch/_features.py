"""The sketch itself: per-example derivatives times seeded projections, one run of examples at a time.

NOTE: [Sketched features]
For one output leaf, let ``t`` run over the traced coordinates of one example (``T`` of them),
``a`` over the other output coordinates, ``J_{a,t}(x)`` be the gradient of that output entry with
respect to all differentiated parameters and ``Omega`` a random ``(P, k)`` Gaussian projection
(``E[Omega Omega^T] = k I``). The features are

    ``phi_{a,j}(x) = 1 / sqrt(k T) * sum_t s_{t,j} (J_{a,t}(x) Omega)_j``

with independent random signs ``s_{t,j}``. Then ``E[phi_a(x1) . phi_b(x2)] = 1/T sum_t
J_{a,t}(x1) . J_{b,t}(x2)``: the traced NTK entry of NOTE: [Kernel layout], a mean over traced
coordinates (the signs remove the cross terms ``t != t'`` in expectation). Without traced axes
``T = 1`` and no signs are used.

A CountSketch (``E[S S^T] = I``, one +-1 per row) hashes every traced coordinate on its own instead:
``phi_{a,j}(x) = 1 / sqrt(T) * sum_t (J_{a,t}(x) S_t)_j``, a CountSketch of the whole
``(T, P)`` gradient. Sharing one hash between the coordinates (with signs, as above) puts each
parameter entry into one column for all ``t``, so the sign products of a dominant entry (a
last-layer bias: 30 % of each logit's gradient norm on the benchmark ResNet) average over fewer
terms: over 50 seeds on 16 examples of that ResNet, the root-mean-square relative error at
``k = 2048`` was 0.046 with a shared hash, 0.030 with one hash per coordinate and 0.028 for the
Gaussian sketch.

``J Omega`` is computed per parameter tensor and tile (NOTE: [Sketch streams]): reverse mode gives
the per-example gradients of a run of examples (``O`` backward passes per example, ``O`` its output
entries), which are multiplied by each Gaussian tile or scattered into CountSketch buckets. For the
Kronecker projection of a linear or conv2d weight, ``Omega``'s column ``j`` is ``u_j (x) v_j``, so
``J Omega`` is ``sum_s (g_{t,s} . u_j)(x_s . v_j)`` from the layer input and the output cotangent
(NOTE: [Kronecker capture]); the weight's per-example gradient is never formed.

Reverse mode beats forward mode (``k`` JVPs per example, one per column) unless ``k`` is below
the number of output entries: on the benchmark ResNet (32 inputs of 3x32x32, torch.func) a JVP cost 4.8 ms
per example and a backward pass 5.1 ms, and ``k`` is in the thousands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch.func import jacrev

from .._call.kernel_call import KernelCall
from .._call.per_example import Side
from .._layout.runs import runs
from . import _projections as projections
from ._capture import CaptureMismatch, TapCall, Taps, verify

RUN_BYTES = 256 << 20
"""Default memory budget for the derivatives of one run of examples (per-example gradients and
layer cotangents), which sets the run length when ``chunk_size`` is None."""


@dataclass(frozen=True)
class SketchOptions:
    """Validated options of one sketch.

    Attributes:
        k: number of features.
        projection: ``"gaussian"``, ``"sparse"`` or ``"kronecker"``.
        seed: the seed of every random stream (NOTE: [Sketch streams]).
        chunk_size: examples per run (None: from :data:`RUN_BYTES`).
    """

    k: int
    projection: str
    seed: int
    chunk_size: Optional[int]


@dataclass(frozen=True)
class _Plan:
    """Which parameters get Kronecker projections, and their taps."""

    generic: tuple[int, ...]
    structured: frozenset[int]
    taps: tuple[TapCall, ...]


def sketch(call: KernelCall, options: SketchOptions) -> list[torch.Tensor]:
    """The features of every output leaf of ``call``'s x1 side (see NOTE: [Sketched features]).

    Returns one tensor per output leaf: the output leaf's shape without its traced axes, plus a
    last axis of size ``k``.
    """
    side = call.side1
    plan = _plan(side, options, call)
    length = options.chunk_size
    if side.mapped and length is None:
        length = _run_length(call, plan)
    pieces: list[list[torch.Tensor]] = []
    spans = runs(side.batch_size(), length) if side.mapped else [(0, None)]
    for start, size in spans:
        run = side.narrow(start, size) if side.mapped else side
        pieces.append(_run_features(run, call, plan, options))
    features = []
    for index, layout in enumerate(call.layouts):
        leaf_pieces = [piece[index] for piece in pieces]
        if side.mapped:
            axis = _kept_axes(layout)[1].index(side.out_axes[index])
            features.append(torch.cat(leaf_pieces, dim=axis) if len(leaf_pieces) > 1 else leaf_pieces[0])
        else:
            features.append(leaf_pieces[0])
    return features


def _kept_axes(layout) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(traced, kept)`` output axes of a leaf."""
    kept = tuple(axis for axis in range(layout.ndim) if axis not in layout.trace_axes)
    return layout.trace_axes, kept


def _plan(side: Side, options: SketchOptions, call: KernelCall) -> _Plan:
    params = call.model.params
    everything = tuple(range(len(params)))
    if options.projection != "kronecker":
        return _Plan(everything, frozenset(), ())
    candidates = frozenset(index for index, param in enumerate(params) if param.ndim >= 2)
    probe = side.narrow(0, 1) if side.mapped else side
    mode = Taps(params, candidates)

    def forward(x_leaves, kwarg_leaves):
        with mode:
            return probe.evaluate(params, x_leaves, kwarg_leaves)

    with torch.no_grad():
        probe.per_example(forward)
    structured = frozenset({tap.param for tap in mode.calls} - mode.unruled)
    taps = tuple(tap for tap in mode.calls if tap.param in structured)
    if structured:  # NOTE: [Kronecker capture]: uses hidden from the mode go to the dense path
        structured -= verify(probe, params, structured, taps, *_probe_cotangents(call, side))
        taps = tuple(tap for tap in taps if tap.param in structured)
    generic = tuple(index for index in everything if index not in structured)
    return _Plan(generic, structured, taps)


def _probe_cotangents(call: KernelCall, side: Side) -> tuple[tuple[torch.Tensor, ...], tuple]:
    """Seeded random cotangents for the probe's outputs (its first example when mapped)."""
    generator = torch.Generator().manual_seed(0)
    cotangents = []
    for index, output in enumerate(call.outputs1):
        shape = (1, *_example_shape(output.shape, side, index)) if side.mapped else tuple(output.shape)
        draw = torch.randn(shape, generator=generator, dtype=torch.float64)
        cotangents.append(draw.to(dtype=output.dtype, device=output.device))
    return tuple(cotangents), tuple(0 for _ in cotangents) if side.mapped else ()


def _example_shape(shape: torch.Size, side: Side, index: int) -> tuple[int, ...]:
    if not side.mapped:
        return tuple(shape)
    axis = side.out_axes[index]
    return tuple(size for position, size in enumerate(shape) if position != axis)


def _run_length(call: KernelCall, plan: _Plan) -> int:
    side = call.side1
    outputs = sum(math.prod(_example_shape(output.shape, side, index)) for index, output in enumerate(call.outputs1))
    params = call.model.params
    per_output = sum(params[index].numel() for index in plan.generic)
    per_output += sum(math.prod(tap.output_shape) for tap in plan.taps)
    per_example = max(1, outputs * per_output * params[0].element_size())
    return max(1, RUN_BYTES // per_example)


def _derivatives(run: Side, plan: _Plan):
    """Per-example gradients of the generic parameters, cotangents of the taps and the tapped
    layers' inputs, with a leading example axis (of size 1 for an unmapped side)."""
    params = run.model.params
    generic_values = tuple(params[index] for index in plan.generic)
    taps = tuple(torch.zeros(tap.output_shape, dtype=params[tap.param].dtype, device=params[tap.param].device)
                 for tap in plan.taps)

    def per_example(x_leaves, kwarg_leaves):
        def forward(values, tap_values):
            full = list(params)
            for index, value in zip(plan.generic, values):
                full[index] = value
            if not plan.structured:
                return run.evaluate(tuple(full), x_leaves, kwarg_leaves), ()
            mode = Taps(tuple(full), plan.structured, tap_values)
            with mode:
                outputs = run.evaluate(tuple(full), x_leaves, kwarg_leaves)
            if len(mode.calls) != len(tap_values):
                raise CaptureMismatch("the model's linear/conv2d calls differ between two evaluations")
            return outputs, tuple(mode.inputs)

        return jacrev(forward, argnums=(0, 1), has_aux=True)(generic_values, taps)

    jacobians, inputs = run.per_example(per_example)
    if not run.mapped:
        jacobians, inputs = _add_example_axis((jacobians, inputs))
    return jacobians, inputs


def _add_example_axis(tree):
    return torch.utils._pytree.tree_map(lambda tensor: tensor.unsqueeze(0), tree)


def _run_features(run: Side, call: KernelCall, plan: _Plan, options: SketchOptions) -> list[torch.Tensor]:
    """The features of one run of examples, one tensor per output leaf."""
    jacobians, inputs = _derivatives(run, plan)
    params, names = call.model.params, call.model.names
    arrangements = [
        _Arrangement.of(layout, call.outputs1[index].shape, run.out_axes[index] if run.mapped else None)
        for index, layout in enumerate(call.layouts)
    ]
    # every derivative as (c, K, T, ...) once; a contiguous (c K T, numel) matrix per generic parameter
    generic = [
        [arrange.rows(jacobian, params[position].ndim).reshape(-1, params[position].numel())
         .to(call.dtypes[index]).contiguous()
         for position, jacobian in zip(plan.generic, jacobians[index][0])]
        for index, arrange in enumerate(arrangements)
    ]
    cotangents = [
        [arrange.rows(cotangent, len(tap.output_shape), flatten=False).to(call.dtypes[index])
         for tap, cotangent in zip(plan.taps, jacobians[index][1])]
        for index, arrange in enumerate(arrangements)
    ]
    del jacobians  # the contiguous copies above replace them
    if options.projection == "sparse":
        folded = _count_sketch(generic, arrangements, plan, names, options)
    else:
        folded = _gaussian_sketch(generic, cotangents, inputs, arrangements, plan, params, names, options)
    return [arrange.finish(features.to(dtype)) for arrange, features, dtype in zip(arrangements, folded, call.dtypes)]


def _count_sketch(generic, arrangements, plan: _Plan, names, options: SketchOptions) -> list[torch.Tensor]:
    """CountSketch features ``(c, K, k)`` per leaf: every parameter entry, as the derivative of each
    traced coordinate, is added into one column with a random sign (one hashing per traced
    coordinate, so no signs fold them; NOTE: [Sketched features])."""
    results = []
    for arrange, matrices in zip(arrangements, generic):
        result = None
        for position, matrix in zip(plan.generic, matrices):
            by_coordinate = matrix.reshape(-1, arrange.traced_size, matrix.shape[-1])   # (c K, T, numel)
            if result is None:
                result = matrix.new_zeros(by_coordinate.shape[0], options.k)
            for block, start, length in projections.row_blocks(matrix.shape[-1]):
                for traced in range(arrange.traced_size):
                    buckets, signs = projections.sparse_hash(
                        options.seed, names[position], block, length, options.k, traced, matrix
                    )
                    result.index_add_(1, buckets, by_coordinate[:, traced, start:start + length] * signs)
        count = arrange.traced_size
        results.append((result / math.sqrt(count)).reshape(-1, math.prod(arrange.kept_shape), options.k))
    return results


def _gaussian_sketch(generic, cotangents, inputs, arrangements, plan: _Plan, params, names,
                     options: SketchOptions) -> list[torch.Tensor]:
    """Gaussian and Kronecker features ``(c, K, k)`` per leaf, one block of ``COLUMNS`` columns at a
    time: each tile is drawn once and applied to every leaf, then the block's traced coordinates are
    folded with their signs."""
    results: list[Optional[torch.Tensor]] = [None] * len(arrangements)
    for column_block, column_start, width in projections.column_blocks(options.k):
        blocks = [matrices[0].new_zeros(matrices[0].shape[0], width) if matrices else None for matrices in generic]
        for slot, position in enumerate(plan.generic):
            like = generic[0][slot]
            for block, start, length in projections.row_blocks(like.shape[-1]):
                tile = projections.gaussian_tile(
                    options.seed, names[position], block, length, column_block, width, like
                )
                for index, matrices in enumerate(generic):  # leaves may differ in dtype
                    blocks[index].addmm_(matrices[slot][:, start:start + length], tile.to(matrices[slot].dtype))
        for slot, (tap, layer_input) in enumerate(zip(plan.taps, inputs)):
            weight = params[tap.param]
            out_factor, in_factor = projections.kronecker_factors(
                options.seed, names[tap.param], weight.shape[0], weight[0].numel(), column_block, width, layer_input
            )
            for index in range(len(arrangements)):
                contribution = _kronecker(tap, cotangents[index][slot], layer_input, weight, out_factor, in_factor)
                contribution = contribution.reshape(-1, width)
                blocks[index] = contribution if blocks[index] is None else blocks[index].add_(contribution)
        for index, arrange in enumerate(arrangements):
            folded = _fold(blocks[index], arrange, column_block, options)
            if results[index] is None:
                results[index] = folded.new_empty(folded.shape[:-1] + (options.k,))
            results[index][..., column_start:column_start + width] = folded
    return results


def _fold(block: torch.Tensor, arrange: "_Arrangement", column_block: int, options: SketchOptions) -> torch.Tensor:
    """``(c K T, w)`` -> ``(c, K, w)``: the traced coordinates combined with random signs, all scaled."""
    count = arrange.traced_size
    block = block.reshape(-1, math.prod(arrange.kept_shape), count, block.shape[-1])
    if arrange.traced:
        signs = projections.trace_signs(options.seed, count, column_block, block.shape[-1], block)
        return torch.einsum("cktj,tj->ckj", block, signs) / math.sqrt(count * options.k)
    return block[:, :, 0] / math.sqrt(options.k)


@dataclass(frozen=True)
class _Arrangement:
    """Moves one output leaf's axes of a derivative to ``(c, K, T, rest)``, and features back.

    Attributes:
        traced, kept: the leaf's traced and other output axes (whole-output numbering).
        batch_axis: the output's batch axis for a mapped side, else None.
        kept_shape: sizes of the kept axes of one example (the batch axis left out when mapped).
        traced_size: ``T``, the number of traced coordinates.
    """

    traced: tuple[int, ...]
    kept: tuple[int, ...]
    batch_axis: Optional[int]
    kept_shape: tuple[int, ...]
    traced_size: int

    @classmethod
    def of(cls, layout, output_shape: torch.Size, batch_axis: Optional[int]) -> "_Arrangement":
        traced, kept = _kept_axes(layout)
        kept_shape = tuple(output_shape[axis] for axis in kept if axis != batch_axis)
        return cls(traced, kept, batch_axis, kept_shape, math.prod(output_shape[axis] for axis in traced))

    def _example_axes(self, axes: tuple[int, ...]) -> tuple[int, ...]:
        """Whole-output axes as axes of the per-example output (the batch axis removed)."""
        if self.batch_axis is None:
            return axes
        return tuple(axis - (axis > self.batch_axis) for axis in axes if axis != self.batch_axis)

    def rows(self, derivative: torch.Tensor, rest_ndim: int, flatten: bool = True) -> torch.Tensor:
        """``(c, *example output, *rest)`` -> ``(c, K, T, numel(rest))`` (or ``*rest`` unflattened)."""
        traced, kept = self._example_axes(self.traced), self._example_axes(self.kept)
        rest = tuple(range(derivative.ndim - rest_ndim, derivative.ndim))
        moved = derivative.permute(0, *(1 + axis for axis in kept), *(1 + axis for axis in traced), *rest)
        rest_shape = moved.shape[moved.ndim - rest_ndim:]
        rest_shape = (math.prod(rest_shape),) if flatten else tuple(rest_shape)
        return moved.reshape(moved.shape[0], math.prod(self.kept_shape), self.traced_size, *rest_shape)

    def finish(self, features: torch.Tensor) -> torch.Tensor:
        """``(c, K, k)`` features as the kept output axes, the example axis where the batch axis is."""
        shaped = features.reshape(features.shape[0], *self.kept_shape, features.shape[-1])
        if self.batch_axis is None:
            return shaped[0]
        return shaped.movedim(0, self.kept.index(self.batch_axis))


def _kronecker(tap: TapCall, cotangent: torch.Tensor, layer_input: torch.Tensor, weight: torch.Tensor,
               out_factor: torch.Tensor, in_factor: torch.Tensor) -> torch.Tensor:
    """``sum_s (g_s . u_j)(x_s . v_j)`` for one captured call (NOTE: [Kronecker capture]), ``(c, K, T, w)``.

    ``cotangent`` is ``(c, K, T, *output_shape)``, ``layer_input`` ``(c, *input_shape)``, the factors
    ``(out, w)`` and ``(in, w)``.
    """
    if tap.op == "conv2d":
        return _conv2d_contribution(tap, cotangent, layer_input, weight, out_factor, in_factor)
    c, kept, traced = cotangent.shape[:3]
    inputs = (layer_input.reshape(c, -1, in_factor.shape[0]) @ in_factor).to(cotangent.dtype)      # (c, S, w)
    outputs = cotangent.reshape(c, kept, traced, -1, out_factor.shape[0]) @ out_factor.to(cotangent.dtype)
    return torch.einsum("cktsw,csw->cktw", outputs, inputs)                                       # (c, K, T, w)


def _conv2d_contribution(tap: TapCall, cotangent, layer_input, weight, out_factor, in_factor) -> torch.Tensor:
    stride, padding, dilation, groups = tap.options
    c, kept, traced = cotangent.shape[:3]
    width = out_factor.shape[1]
    batched = len(tap.input_shape) == 4
    images = layer_input.reshape(-1, *tap.input_shape[-3:])                              # (c B, Cin, H, W)
    filters = in_factor.T.reshape(width, *weight.shape[1:]).repeat(groups, 1, 1, 1)     # (g w, Cin/g, kh, kw)
    patches = torch.nn.functional.conv2d(images, filters, None, stride, padding, dilation, groups).to(cotangent.dtype)
    height, breadth = patches.shape[-2:]
    batch = tap.input_shape[0] if batched else 1
    patches = patches.reshape(c, batch, groups, width, height * breadth).permute(0, 2, 3, 1, 4)
    patches = patches.reshape(c, groups, width, -1)                                       # (c, g, w, S)
    out_channels = weight.shape[0]
    grads = cotangent.reshape(c, kept, traced, batch, groups, out_channels // groups, height * breadth)
    grads = grads.permute(0, 1, 2, 4, 5, 3, 6).reshape(c, kept, traced, groups, out_channels // groups, -1)
    factor = out_factor.reshape(groups, out_channels // groups, width).to(cotangent.dtype)
    return torch.einsum("cktgos,goj,cgjs->cktj", grads, factor, patches)
