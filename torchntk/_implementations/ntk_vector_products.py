"""NTK implementation 2: NTK-vector products.

For every entry ``b`` of the x2 output, reverse mode gives the parameter-space vector
``J2[b]^T`` (per example under ``vmap_axes``, so ``O`` backward passes of one example each), and
one forward-mode pass over the whole x1 batch turns it into the kernel column
``J1 J2[b]^T = K[:, b]``. The forward-mode passes are batched over ``b`` with ``vmap``; the
parameter-space contraction of Jacobian contraction never happens, which wins when ``P`` is
large relative to the cost of a forward pass. Trace and diagonal axes are extracted from the
columns afterwards.

NOTE: [NTK-vector products are batched over the whole input]
The PyTorch tutorial vmaps the product over pairs of examples ``(x1[n], x2[m])`` with an
``O``-sized basis each, holding ``N1 N2 O`` parameter-sized vectors at once. Here each x2
output entry gives one tangent, used once for the whole x1 batch: ``N2 O`` tangents in all,
bounded further by ``chunk_size``.

NOTE: [The output check of NTK-vector products]
With ``vmap_axes``, a call whose output check is left to the implementation (``KernelCall.vmap_check``,
NOTE: [Checking vmap_axes]) compares the outputs of passes it makes anyway, like implementations 1
and 3: the reverse pass that forms x2's vectors evaluates every x2 example per example (a run of
at most ``_MIN_RUN`` examples too, see :func:`_run_jacobians`) and returns those outputs. With x2
None, these are x1's examples, and the check costs a warm call no model evaluation beyond the
whole-batch forward pass. x1's columns come from forward-mode passes over the whole x1 batch,
whose primal outputs are whole-batch outputs. Mapping those passes per example would give
per-example outputs, but it costs a vmap level in every pass, and a call makes one per 24 x2
output entries: on an 8-32-32-4 MLP each pass took 0.3 ms longer, as long as the check's own
forward pass over x1 (on the benchmark CNN the two ways were within 5%). So with x2 given, x1
keeps one per-example forward pass for the check, once per call. Against a check pass per side,
warm calls with ``check_vmap_axes=True`` (2-core CPU, one thread) took 0-6% less time on an
8-32-32-4 MLP (N = 2 to 16) and 3% less on the benchmark CNN; on the benchmark MLP, whose runs
of two x2 examples each made a check pass, 8 of 25 model evaluations went, within the noise of
its 160 ms.

NOTE: [NTK-vector products without forward mode]
Some operations have no forward-mode derivative in PyTorch: ``grid_sampler_2d``, ``_embedding_bag``,
custom ``torch.autograd.Function`` classes without ``jvp``, and the fused kernels the forward-mode
passes do not replace (NOTE: [Unfused kernels] in ``_model/unfused.py``: those of recurrent layers and
weight norm are replaced in the modules ``fused_layers`` finds, not inside a function
``f(params, x)``; those of attention always). For them the column ``J1 t`` comes from two
reverse passes instead: ``u -> J1^T u`` is linear, so its VJP with cotangent ``t`` is ``J1 t``
whatever ``u`` it is taken at (zero here). One reverse pass over x1 records ``J1^T u`` with its
graph, and every tangent then costs one backward of that backward pass.

The switch happens at most once per kernel call: the first forward-mode pass that raises
PyTorch's "no forward AD" error turns the rest of the call over to the double-VJP path. That
try costs nothing where forward mode works, and under 1 ms where it fails (the error comes at
the offending op); an up-front probe (one column of one example, what AUTO runs) cost 1-9 ms
per call on the benchmark MLP. Forward mode is kept wherever it works: it holds no recorded
graph of x1, and on the benchmark MLP the double-VJP path was no faster (timings in
``tests/test_forward_mode_free.py``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import torch
from torch.func import jacrev, jvp, vjp, vmap

from .._call.blocks import BlockPlan, assemble
from .._call.kernel_call import KernelCall
from .._call.per_example import Side
from .._layout.runs import even_length, forward_mode_passes, runs
from .._model.torch_errors import missing_forward_mode
from .._model.unfused import forward_mode_kernels, math_attention
from .._utils.threads import FORWARD_MODE_LOCK
from .jacobian_contraction import checked_jacobians

Jacobians = tuple[tuple[torch.Tensor, ...], ...]


def ntk_vector_products_ntk(call: KernelCall) -> list[torch.Tensor]:
    return assemble(call, ntk_vector_products_blocks(call))


def ntk_vector_products_blocks(call: KernelCall, forward_mode: Optional[bool] = None) -> BlockPlan:
    """The block plan of implementation 2.

    Args:
        call: the validated kernel call.
        forward_mode: ``None`` (default) uses forward mode until PyTorch reports an operation
            without a forward-mode derivative, then double VJPs for the rest of the call (NOTE:
            [NTK-vector products without forward mode]); ``True`` / ``False`` force one path
            (``False`` is how the tests and benchmarks price the double-VJP path on any model).
    """
    vector_chunk = None if call.side1.mapped else call.chunk_size
    # NOTE: [NTK-vector products of parameter groups]: one column maker per group, each keeping its
    # own forward-mode switch and recorded x1 pass.
    groups = call.groups if call.groups is not None else (None,)
    columns = [_Columns(forward_mode) for _ in groups]

    def prepare_x1(side: Side) -> Side:
        # NOTE: [The output check of NTK-vector products]: forward mode over the whole x1 batch has
        # no per-example outputs; with x2 None, prepare_x2's passes check x1's examples.
        if not call.reuses_x1:
            call.check_outputs(side)
        return side

    def prepare_x2(side: Side) -> Jacobians:
        if not side.mapped:
            return side.jacobians(chunk_size=vector_chunk)
        if side.batch_size() > _MIN_RUN:
            if call.vmap_check is None:
                return side.jacobians()
            reverse_pass = side.jacobians_and_outputs
        else:  # NOTE: [Run lengths of NTK-vector products]: rank-2 instead of rank-1 products
            reverse_pass = functools.partial(_run_jacobians, side)
            if call.vmap_check is None:
                return reverse_pass()[0]
        # NOTE: [The output check of NTK-vector products]: the pass that forms the vectors gives the
        # per-example outputs the check compares.
        return checked_jacobians(call, side, reverse_pass)

    def contract(side1: Side, jacobians2: Jacobians, needed: Sequence[bool]) -> list[Optional[Any]]:
        if call.groups is None:
            return contract_group(side1, jacobians2, needed, columns[0])
        per_group = [
            contract_group(
                replace(side1, model=side1.model.restricted(indices)),
                tuple(tuple(per_param[index] for index in indices) for per_param in jacobians2),
                needed,
                group_columns,
            )
            for indices, group_columns in zip(call.groups, columns)
        ]
        return [
            tuple(blocks[leaf] for blocks in per_group) if is_needed else None for leaf, is_needed in enumerate(needed)
        ]

    def contract_group(
        side1: Side, jacobians2: Jacobians, needed: Sequence[bool], columns: _Columns
    ) -> list[Optional[torch.Tensor]]:
        params = side1.model.params
        blocks: list[Optional[torch.Tensor]] = []
        for leaf, (layout, per_param2, is_needed) in enumerate(zip(call.layouts, jacobians2, needed)):
            if not is_needed:
                blocks.append(None)
                continue
            output2_shape = per_param2[0].shape[: layout.ndim]
            tangents = tuple(
                jacobian.reshape(-1, *param.shape) for jacobian, param in zip(per_param2, params)
            )
            count = tangents[0].shape[0]
            chunk = vector_chunk or even_length(count, call.tangents_per_pass or TANGENTS_PER_PASS)
            passes = None
            if vector_chunk is None and side1.mapped and call.tangents_per_pass is not None:
                passes = forward_mode_passes(count, side1.batch_size(), call.tangents_per_pass)
            products = columns(side1, leaf, tangents, chunk, passes)
            # products: (*output2, *output1) -> unzipped kernel (*output1, *output2)
            products = products.reshape(*output2_shape, *products.shape[1:])
            full = products.permute(*range(layout.ndim, 2 * layout.ndim), *range(layout.ndim))
            blocks.append(layout.from_full(full))
        return blocks

    return BlockPlan(
        prepare_x1, prepare_x2, contract, reuse_prepared=False, split_x1=False,
        run_length=call.chunk_size or default_run_length(call),
    )


# NOTE: [NTK-vector products of parameter groups]
# With parameter groups (NOTE: [Parameter groups] in _call/groups.py) x2's parameter-space vectors are
# formed once, for every grouped parameter, and each group's columns come from the vectors' entries
# of its parameters, pushed through a forward-mode pass over x1 that differentiates that group's
# parameters only. The x1 work is thus repeated per group: G groups cost about G times the
# forward-mode passes of one kernel (each pass carries fewer tangents), unlike implementations 1
# and 3, where a group costs no extra pass.

# NOTE: [Run lengths of NTK-vector products]
# Measured on the benchmark MLP and CNN (2-core CPU), against forming every x2 vector at once:
# * x2 in runs whose parameter-space vectors take about _RUN_BYTES (x1 whole) was 1.4-2x faster:
#   the vectors stay in cache between the reverse and the forward pass, and no multi-GB buffer is
#   allocated (fresh memory costs ~0.4 s/GB in page faults here);
# * runs of at least _MIN_RUN examples, differentiated as one small batch, were ~20% faster on the
#   MLP than per-example vmap: the weight gradients become rank-2 matrix products, which the BLAS
#   runs far better than rank-1 ones. The run's forward pass is still mapped per example
#   (:func:`_run_jacobians`): its cross-example blocks are then zero by construction, not only
#   under the vmap_axes promise, and its outputs are the per-example outputs the output check
#   compares (NOTE: [The output check of NTK-vector products]);
# * pushing a run's vectors through forward mode in equal chunks of at most TANGENTS_PER_PASS
#   avoided a small trailing chunk that cost a whole extra forward pass. Where the pass's
#   activations are large, NOTE: [Forward-mode passes over runs of x1] shapes the passes and
#   the runs of x2 instead.

# NOTE: [Forward-mode passes over runs of x1]
# Where x1's activations bound the tangents of a pass over all of x1 (``KernelCall.tangents_per_pass``,
# NOTE: [Working-set runs]), what the bound limits is tangents times examples: every activation
# of the pass is held once per tangent and example. Each pass over x1 also evaluates x1's primal
# again, which is most of a pass where the tangents reach few layers (a RoBERTa's head: its
# encoder runs on the primal alone). So a run of x2 pushes all its tangents through every pass,
# and the passes go over runs of x1 short enough to stay within the bound
# (``_layout.runs.forward_mode_passes``): x1's primal is evaluated once per run of x2, where
# passes over all of x1 evaluated it once per ``tangents_per_pass`` tangents. x2's runs are then
# as long as one such set of passes carries (``tangents_per_pass`` times x1's examples), their
# vectors within ``_BOUNDED_RUN_BYTES`` and their reverse pass within the working set (the run
# length of implementation 3, whose pass forms the same cotangents). On a RoBERTa-base-size
# model at N = 16 (32 tokens, two logits, 10 tangents a pass over all of x1) this took the head
# set from 3.7 to 2.5 s, LoRA from 21.8 to 18.5-20.2 s and BitFit from 19.8 to 18.1-18.6 s, and
# GPT-2's head from 7.6 to 5.5 s; the longer reverse passes of x2 raised the resident set by up
# to 140 MB (``docs/benchmarks.md``). The double-VJP path keeps passes over all of x1: its
# recorded reverse pass serves every tangent.
_RUN_BYTES = 32 * 2**20
_BOUNDED_RUN_BYTES = 256 * 2**20
_MIN_RUN = 2
TANGENTS_PER_PASS = 24


def _run_jacobians(side: Side) -> tuple[Jacobians, tuple[torch.Tensor, ...]]:
    """The Jacobians of a short run of ``side`` differentiated as one batch, and its outputs.

    The examples are evaluated per example (vmap, or the example loop) inside one reverse-mode
    pass over the run: the backward pass still forms the weight gradients of all the run's
    examples in one matrix product (NOTE: [Run lengths of NTK-vector products]), and the outputs
    are per-example outputs, which the output check compares with the whole batch's.
    """
    def outputs(params: tuple) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        stacked = side.per_example(lambda x, kwargs, p: side.evaluate(p, x, kwargs), (params,), (None,))
        leaves = tuple(leaf.movedim(0, axis) for leaf, axis in zip(stacked, side.out_axes))
        return leaves, tuple(leaf.detach() for leaf in leaves)

    return jacrev(outputs, has_aux=True)(side.model.params)


def default_run_length(call: KernelCall) -> Optional[int]:
    """x2's examples per run without a ``chunk_size`` (NOTE: [Run lengths of NTK-vector products]):
    as many as keep their vectors within ``_RUN_BYTES`` and, where a forward-mode pass carries
    fewer tangents than ``TANGENTS_PER_PASS`` (``call.tangents_per_pass``), as many as one pass
    carries; the runs then of equal lengths. None without ``vmap_axes``."""
    if not call.side1.mapped:
        return None
    side2 = call.side2 if call.side2 is not None else call.side1
    examples = max(1, side2.batch_size())
    outputs_per_example = sum(output.numel() for output in call.outputs2) / examples
    params = call.model.params
    vector_bytes = sum(p.numel() for p in params) * params[0].element_size()
    run_vectors = max(1.0, outputs_per_example * vector_bytes)
    length = max(_MIN_RUN, int(_RUN_BYTES // run_vectors))
    if call.tangents_per_pass is not None:
        # NOTE: [Forward-mode passes over runs of x1]: a run of x2 costs one primal pass over x1
        tangent_examples = call.tangents_per_pass * max(1, call.side1.batch_size())
        carried = tangent_examples / max(1.0, outputs_per_example)
        length = max(length, int(min(carried, _BOUNDED_RUN_BYTES // run_vectors)))
        if call.working_runs is not None:  # its reverse pass holds as many examples' activations
            length = min(length, call.working_runs)
    return even_length(examples, length)


def forward_mode_pass_counts(call: KernelCall) -> tuple[int, int]:
    """``(evaluations of x1's primal, forward-mode passes)`` that a call without ``chunk_size`` makes
    (AUTO's price): one primal a pass over all of x1, several passes a primal where they go over runs
    of x1 (NOTE: [Forward-mode passes over runs of x1])."""
    columns = sum(output.numel() for output in call.outputs2)
    if call.tangents_per_pass is None or not call.side1.mapped:
        passes = math.ceil(columns / (call.tangents_per_pass or TANGENTS_PER_PASS))
        return passes, passes
    side2 = call.side2 if call.side2 is not None else call.side1
    examples, n1 = max(1, side2.batch_size()), call.side1.batch_size()
    primal = passes = 0
    for _, length in runs(examples, default_run_length(call)):
        tangents = math.ceil(length * columns / examples)
        carried, run = forward_mode_passes(tangents, n1, call.tangents_per_pass)
        over_x1 = math.ceil(tangents / carried)
        primal += over_x1
        passes += over_x1 * math.ceil(n1 / (run or n1))
    return primal, passes


# -- the columns J1 t: forward mode, or two reverse passes --------------------------------------

_NOT_TWICE_DIFFERENTIABLE = re.compile(
    r"derivative for '?(?P<op>[\w:.]+)'? is not implemented"
    r"|(?P<once>once_differentiable)"
)


@dataclass
class _Columns:
    """``(side1, leaf, tangents, chunk) -> J1[leaf] t`` for a batch of parameter-space ``t``.

    One per block plan, i.e. per kernel call, so that the switch to double VJPs happens once per
    call (NOTE: [NTK-vector products without forward mode]). ``forward_mode``: None until the first
    forward-mode pass succeeds or fails, unless forced. ``_transposed`` keeps the last x1 run's
    reverse pass (``u -> J1^T u`` per leaf, recorded with its graph): x1 usually stays whole across
    the runs of x2, so it is recorded once per call rather than once per run of x2.
    """

    forward_mode: Optional[bool] = None
    missing: Optional[str] = None
    _transposed: dict = field(default_factory=dict)

    def __call__(
        self, side1: Side, leaf: int, tangents: tuple, chunk: int, passes: Optional[tuple[int, Optional[int]]] = None,
    ) -> torch.Tensor:
        """``passes``: the tangents and x1 examples of each forward-mode pass where x1's
        activations bound them (NOTE: [Forward-mode passes over runs of x1]); None: ``chunk``
        tangents a pass over all of x1, as the double-VJP path always makes."""
        if self.forward_mode is not False:
            try:
                products = _forward_mode_columns(side1, leaf, tangents, *(passes or (chunk, None)))
            except (RuntimeError, NotImplementedError) as error:
                missing = _missing_forward_mode(error)
                if missing is None or self.forward_mode is True:
                    raise
                self.forward_mode, self.missing = False, missing
            else:
                self.forward_mode = True
                return products
        return self._double_vjp_columns(side1, leaf, tangents, chunk)

    def _double_vjp_columns(self, side1: Side, leaf: int, tangents: tuple, chunk: int) -> torch.Tensor:
        with _twice_differentiable(side1.where, self.missing):
            # Runs of x1 are fresh Side objects each time; within one call, offset and length
            # name the same examples.
            examples = (side1.offset, side1.batch_size() if side1.mapped else None)
            if self._transposed.get("examples") != examples:
                self._transposed = {"examples": examples, "leaves": _transposed_maps(side1)}
            pullback = self._transposed["leaves"](leaf)
            return vmap(lambda tangent: pullback(tangent)[0], chunk_size=chunk)(tangents)


def _forward_mode_columns(
    side1: Side, leaf: int, tangents: tuple, chunk: int, examples: Optional[int] = None,
) -> torch.Tensor:
    """``J1[leaf] t`` for each of ``tangents``, ``chunk`` tangents a pass over runs of ``examples``
    x1 examples (None: all of x1, or x1 is not mapped)."""
    # NOTE: [Memory formats in forward mode]: contiguous inputs, parameters and tangents.
    side1 = _contiguous(side1)
    params = tuple(param.contiguous() for param in side1.model.params)
    tangents = tuple(tangent.contiguous() for tangent in tangents)

    def columns(side: Side) -> torch.Tensor:
        forward = side.whole_batch()

        def column(tangent: tuple) -> torch.Tensor:
            return jvp(forward, (params,), (tangent,))[1][leaf]

        return vmap(column, chunk_size=chunk)(tangents)

    with FORWARD_MODE_LOCK, forward_mode_kernels(bool(side1.model.fused)):  # NOTE: [Threads], [Unfused kernels]
        if examples is None or not side1.mapped or examples >= side1.batch_size():
            return columns(side1)
        axis = side1.out_axes[leaf]
        return torch.cat(
            [columns(side1.narrow(start, length)) for start, length in runs(side1.batch_size(), examples)],
            dim=axis if axis < 0 else axis + 1,  # the tangents' axis comes first
        )


# NOTE: [Memory formats in forward mode]
# Some forward-mode derivatives of PyTorch view their tangents or primals as contiguous: that of
# group_norm fails with "view size is not compatible with input tensor's size and stride" when a
# convolution before it gets channels_last inputs or weights, as does a model's own ``.view`` when
# the tangent's strides differ from the primal's. The kernel does not depend on memory formats, so
# the forward-mode passes get contiguous copies of x1's tensors, of the parameters and of the
# tangents (no copy for tensors that already are). Where an operation still makes a
# channels_last tensor that such a derivative then meets, the error switches the call to the
# double-VJP path, as for an operation without a forward-mode derivative.
_LAYOUT_BOUND = "view size is not compatible with input tensor's size and stride"


def _contiguous(side: Side) -> Side:
    """``side`` with its input and keyword tensors contiguous (NOTE: [Memory formats in forward mode])."""
    def contiguous(flat):
        leaves = tuple(leaf.contiguous() if isinstance(leaf, torch.Tensor) else leaf for leaf in flat.leaves)
        return replace(flat, leaves=leaves)

    return replace(side, x=contiguous(side.x), kwargs={key: contiguous(flat) for key, flat in side.kwargs.items()})


def _missing_forward_mode(error: BaseException) -> Optional[str]:
    """What lacks a usable forward-mode derivative according to ``error``, or None."""
    missing = missing_forward_mode(error)
    if missing is None and isinstance(error, RuntimeError) and _LAYOUT_BOUND in str(error):
        return "an operation whose forward-mode derivative needs contiguous tensors (channels_last)"
    return missing


def _transposed_maps(side1: Side) -> Callable[[int], Callable]:
    """``leaf -> VJP of (u -> J1[leaf]^T u)``, sharing one recorded reverse pass over x1.

    The VJP is taken at ``u = 0``: the map is linear in ``u``, so the point does not matter.
    """
    outputs, pullback = vjp(side1.whole_batch(), side1.model.params)
    zeros = tuple(torch.zeros_like(output) for output in outputs)
    maps: dict[int, Callable] = {}

    def for_leaf(leaf: int) -> Callable:
        if leaf not in maps:
            def transposed(u: torch.Tensor) -> tuple:
                return pullback(zeros[:leaf] + (u,) + zeros[leaf + 1:])[0]

            maps[leaf] = vjp(transposed, zeros[leaf])[1]
            _check_adjoint(side1.where, transposed, maps[leaf], zeros[leaf], side1.model.params)
        return maps[leaf]

    return for_leaf


_ADJOINT_RTOL = {torch.float64: 1e-9}
_ADJOINT_DEFAULT_RTOL = 1e-3


def _check_adjoint(where: str, transposed: Callable, columns: Callable, output: torch.Tensor, params: tuple) -> None:
    """``<J t, u> = <t, J^T u>`` for one random ``t`` and ``u``, or a ValueError.

    The double-VJP path differentiates the model's backward pass. A backward that PyTorch can
    run but not differentiate correctly (a custom ``autograd.Function`` whose backward detaches,
    or computes outside autograd) would give zero or wrong columns without any error; its first
    derivative, which implementations 1 and 3 use, is still right. One extra column per call
    tells the two apart.
    """
    generator = torch.Generator().manual_seed(0)
    u = torch.randn(output.shape, generator=generator, dtype=torch.float64).to(output)
    t = tuple(torch.randn(p.shape, generator=generator, dtype=torch.float64).to(p) for p in params)
    column = columns(t)[0]
    gradient = transposed(u)
    left = (column.double() * u.double()).sum()
    right = sum((a.double() * b.double()).sum() for a, b in zip(t, gradient))
    scale = (column.double().abs() * u.double().abs()).sum() + sum(
        (a.double().abs() * b.double().abs()).sum() for a, b in zip(t, gradient)
    )
    rtol = _ADJOINT_RTOL.get(output.dtype, _ADJOINT_DEFAULT_RTOL)
    if not abs(left - right).item() <= rtol * scale.item():
        raise ValueError(
            f"{where}: implementation 2 (NTK-vector products) computed this model's kernel columns by "
            f"differentiating its backward pass (no forward-mode derivative exists for one of its "
            f"operations), but that derivative is wrong: <J t, u> = {left.item():.6g} while <t, J^T u> = "
            f"{right.item():.6g}. A custom torch.autograd.Function whose backward is not itself "
            f"differentiable does this. Use implementation=1 (Jacobian contraction) or 3 (structured "
            f"derivatives), or give the Function a jvp."
        )


@contextlib.contextmanager
def _twice_differentiable(where: str, missing: Optional[str]):
    """Runs the double-VJP path so that its backward passes are differentiable, or says why not.

    PyTorch's fused CPU/CUDA attention kernels have backward passes without derivatives, so
    ``scaled_dot_product_attention`` is restricted to its composite MATH kernel here. That setting
    is process-wide in PyTorch: another thread's attention meanwhile also uses MATH, which changes
    its rounding, not its result.

    Raises:
        ValueError: an operation's backward pass has no derivative either (chained).
    """
    try:
        with math_attention():
            yield
    except (RuntimeError, NotImplementedError) as error:
        found = _NOT_TWICE_DIFFERENTIABLE.search(str(error))
        if found is None:
            raise
        culprit = found["op"] or "a custom torch.autograd.Function marked @once_differentiable"
        no_forward = f"PyTorch has no forward-mode derivative for {missing}, and " if missing else ""
        raise ValueError(
            f"{where}: implementation 2 (NTK-vector products) needs forward-mode derivatives or "
            f"twice-differentiable backward passes; {no_forward}the backward pass of {culprit} "
            f"(used by this model) has no derivative. Use implementation=1 (Jacobian contraction) "
            f"or 3 (structured derivatives)."
        ) from error


def vector_products_method(side: Side) -> tuple[str, Optional[str]]:
    """How implementation 2 would compute ``side``'s columns, from a pass over its first example.

    For AUTO: one forward-mode column of one example (the whole batch without ``vmap_axes``),
    then, if PyTorch reports an operation without forward-mode derivative, one double-VJP column.

    Returns:
        ``("forward mode", None)`` or ``("double VJP", what lacks a forward-mode derivative)``.

    Raises:
        ValueError: neither path can differentiate the model (see :func:`_twice_differentiable`).
        Exception: whatever the model raises on that example.
    """
    example = side.narrow(0, 1) if side.mapped and side.batch_size() > 1 else side
    tangent = tuple(torch.ones_like(param)[None] for param in side.model.params)
    try:
        _forward_mode_columns(example, 0, tangent, 1)
        return "forward mode", None
    except (RuntimeError, NotImplementedError) as error:
        missing = _missing_forward_mode(error)
        if missing is None:
            raise
    _Columns(forward_mode=False, missing=missing)(example, 0, tangent, 1)
    return "double VJP", missing
