"""Contracting two sides' factors into kernel blocks: one einsum per pair of uses.

NOTE: [Pair contraction]
For a parameter used by role ``r1`` on side 1 and role ``r2`` on side 2 the kernel gains
``J1 J2^T``, written as one einsum over

    G1[out1..., y1...]  operands1[...]  operands2[...]  G2[out2..., y2...]  ->  kernel

with the output letters of the layout (traced axes shared and summed, diagonal axes shared and
kept, other axes one letter per side), the rules' private letters renamed per side, and the
parameter letters shared between the sides. With ``vmap_axes`` the operands' example axis takes
the letter of the output's batch axis. opt_einsum picks the order (Gram of operands and Gram of
``G``, or ``J`` first, or mixed) from the shapes; the paths are cached.

Pairs whose parameter coordinates differ (a slice against the whole parameter, a view seeing
entries twice) are contracted as dense Jacobians scattered into the parameter's coordinates; pairs
seeing disjoint entries (``q`` and ``k`` slices of a packed projection) contribute nothing.
"""

from __future__ import annotations

import collections
import functools
import math
import string
from dataclasses import dataclass
from typing import Optional, Sequence

import opt_einsum
import torch
from opt_einsum.parser import convert_to_valid_einsum_chars

from ..._layout.kernel_layout import KernelLayout
from ..._layout.tiles import Placement
from ..._utils.types import promoted
from ._merge import merged_factors
from ._roles import Role
from ._side import SideFactors, Use

_MAX_INTERMEDIATE = 2**28
"""Elements of the largest intermediate opt_einsum may plan (1 GiB in float32)."""

_SIDE1, _SIDE2, _SHARED = 1000, 2000, 3000


def contract_sides(
    layouts: Sequence[KernelLayout],
    out_axes: Optional[Sequence[int]],
    side1: SideFactors,
    side2: SideFactors,
    needed: Sequence[bool],
    dtypes: Sequence[torch.dtype],
    param_sizes: Sequence[int],
) -> list[Optional[torch.Tensor]]:
    """The unnormalised kernel block of every needed output leaf."""
    mapped = out_axes is not None
    pays = merge_pays(layouts[0], None if out_axes is None else out_axes[0])
    if side1 is side2:  # NOTE: [Merged uses]
        side1 = side2 = merged_factors(side1, mapped, pays)
    else:
        side1, side2 = merged_factors(side1, mapped, pays), merged_factors(side2, mapped, pays)
    blocks: list[Optional[torch.Tensor]] = []
    for leaf, (layout, is_needed, dtype) in enumerate(zip(layouts, needed, dtypes)):
        if not is_needed:
            blocks.append(None)
            continue
        out_axis = None if out_axes is None else out_axes[leaf]
        examples = 0 if out_axis is None else side1.outputs[leaf].shape[out_axis]
        if side1 is side2 and out_axis is not None and layout.kind(out_axis) == "kept" and examples >= _MIN_HALF * 2:
            blocks.append(_mirrored_halves(layout, out_axes, leaf, side1, dtype, param_sizes, examples))
        else:
            blocks.append(_contract_leaf(layout, out_axis, side1, side2, leaf, dtype, param_sizes, {}))
    return blocks


_MIN_HALF = 16
"""Examples per half below which splitting a symmetric kernel saves less than it costs."""


def _mirrored_halves(layout, out_axes, leaf, factors: SideFactors, dtype, param_sizes, examples) -> torch.Tensor:
    """A symmetric kernel from its two diagonal blocks and one off-diagonal block (3/4 of the work)."""
    half = examples // 2
    runs = [(0, half), (half, examples - half)]
    parts = [factors.narrow(start, length, out_axes) for start, length in runs]
    out_axis = out_axes[leaf]
    placement = Placement.of(layout, out_axis)
    kernel = None
    jacobians: dict = {}
    for i, j in ((0, 0), (0, 1), (1, 1)):
        block = _contract_leaf(layout, out_axis, parts[i], parts[j], leaf, dtype, param_sizes, jacobians)
        if kernel is None:
            shape = list(block.shape)
            shape[placement.positions[0]] = shape[placement.positions[1]] = examples
            kernel = block.new_empty(shape)
        placement.put(kernel, block, runs[i], runs[j], mirror=True)
    return kernel


def _contract_leaf(
    layout, out_axis, side1: SideFactors, side2: SideFactors, leaf, dtype, param_sizes, jacobians: dict
) -> torch.Tensor:
    """``jacobians`` caches the ``J`` of uses contracted through their Jacobians (by ``id``)."""
    symmetric = side1 is side2
    total: Optional[torch.Tensor] = None
    formed: list[tuple[torch.Tensor, torch.Tensor]] = []  # pairs of J, contracted together below
    for first, second, mirror in use_pairs(side1.uses, side2.uses, symmetric):
        term = _pair(layout, out_axis, first, second, leaf, dtype, param_sizes, jacobians, None if mirror else formed)
        if term is None:
            continue
        if mirror:
            term = term + term.permute(layout.swap_permutation())
        total = term if total is None else total.add_(term)
    for term in _formed_terms(layout, formed):
        total = term if total is None else total.add_(term)
    if side1.fallback is not None:
        for one, two in zip(side1.fallback[leaf], side2.fallback[leaf]):
            first = one.reshape(*one.shape[: layout.ndim], -1).to(dtype)
            second = first if symmetric else two.reshape(*two.shape[: layout.ndim], -1).to(dtype)
            term = layout.contract(first, second)
            total = term if total is None else total.add_(term)
    if total is None:  # no parameter reaches this output leaf
        total = torch.zeros(layout.kernel_shape(side1.outputs[leaf].shape, side2.outputs[leaf].shape), dtype=dtype)
    return total


_WRITE_COST = 256.0
"""FLOPs one element of an intermediate costs: on a 2-core CPU (about 300 GFLOP/s in float32
matrix products) writing and reading back an intermediate is memory-bound, and a merged
contraction whose cheapest order by FLOPs builds an intermediate of ``T^2`` Gram blocks ran 3x
slower than the ``T^2`` pair contractions it replaced."""

_CALL_COST = 7.5e6
"""FLOPs one einsum call costs on top of its arithmetic (about 50 us of dispatch and planning)."""

_MERGE_GAIN = 0.75
"""A merge must price below this fraction of the pairs it replaces (the estimate is rough)."""


def merge_pays(layout: KernelLayout, out_axis: Optional[int]):
    """The ``pays`` of :func:`~._merge.merged_uses` for ``layout`` (NOTE: [Merged uses]), priced on
    the first output leaf with both sides shaped like the side being merged.

    Pairs contracted through ``J`` (different coordinates on the two sides) always gain: one ``J``
    per side instead of one per use. Einsum pairs are priced as FLOPs plus :data:`_WRITE_COST` per
    element of the largest intermediate plus :data:`_CALL_COST` per call.
    """

    def priced(use: Use) -> float:
        equation, tensors = pair_equation(layout, out_axis, use, use, 0)
        flops, largest = pair_cost(equation, tuple(tuple(t.shape) for t in tensors))
        return flops + _WRITE_COST * largest + _CALL_COST

    def pays(single: Use, stacked: Use, count: int) -> bool:
        if pair_kind(single.role, single.role) != "einsum":
            return True
        return priced(stacked) <= _MERGE_GAIN * count * count * priced(single)

    return pays


def use_pairs(uses1: list[Use], uses2: list[Use], symmetric: bool):
    """Pairs of uses of the same parameter unit; with one side reused, each unordered pair once.

    The uses of x2 are grouped by unit first: one pass, where comparing every pair cost 11,000
    comparisons a contraction on MobileNetV3-small. The pairs come in the same order."""
    positions: dict[tuple[int, ...], list[int]] = {}
    for j, second in enumerate(uses2):
        positions.setdefault(second.role.unit, []).append(j)
    for i, first in enumerate(uses1):
        for j in positions.get(first.role.unit, ()):
            if symmetric and j < i:
                continue
            yield first, uses2[j], symmetric and j > i


def _pair(
    layout: KernelLayout,
    out_axis: Optional[int],
    first: Use,
    second: Use,
    leaf: int,
    dtype: torch.dtype,
    param_sizes: Sequence[int],
    jacobians: dict,
    formed: Optional[list] = None,
) -> Optional[torch.Tensor]:
    """One pair's term: through the einsum of NOTE: [Pair contraction] when opt_einsum's order
    starts across the sides (Gram order), else through each use's ``J`` (formed once per use and
    reused by every pair it is in; ``J J^T`` of a use with itself is a symmetric product). Given
    ``formed``, a pair through ``J`` is appended to it instead, for :func:`_formed_terms` to
    contract with the others (None is returned)."""
    kind = pair_kind(first.role, second.role)
    if kind == "disjoint":
        return None
    scatter = kind == "dense"
    if not scatter:
        equation, tensors = pair_equation(layout, out_axis, first, second, leaf)
        shapes = tuple(tuple(t.shape) for t in tensors)
        if not _starts_within_a_side(equation, shapes, 1 + len(first.role.operands)):
            tensors = [tensor.to(dtype) for tensor in tensors]
            term = contract_tensors(equation, tensors)
            scale = first.role.scale * second.role.scale
            return term if scale == 1.0 else term * scale
    out_symbols, _, _ = output_symbols(layout)

    def jacobian(use: Use) -> torch.Tensor:
        return dense_jacobian(use, leaf, out_symbols, out_axis, param_sizes, scatter).to(dtype)

    one, two = (_cached(jacobians, use, functools.partial(jacobian, use)) for use in (first, second))
    if formed is not None:
        formed.append((one, two))
        return None
    return layout.contract(one, two)


_JOINED_JACOBIAN = 2**22
"""Elements up to which the ``J`` of a side's pairs are concatenated into one contraction."""


def _formed_terms(layout: KernelLayout, formed: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    """The terms of pairs contracted through their ``J``: one contraction of the ``J`` concatenated
    along their entries (``sum_k J1_k J2_k^T = [J1_1 ...] [J2_1 ...]^T``) where they are small (a
    model of many small parameters, such as a force field, made one product per parameter, each
    a few microseconds of work behind tens of microseconds of calls), else one per pair. A side
    whose pairs each hold one tensor twice (``x2=None``) stays an exactly symmetric product."""
    if not formed:
        return []
    size = sum(one.numel() + (0 if one is two else two.numel()) for one, two in formed)
    if len(formed) == 1 or size > 2 * _JOINED_JACOBIAN:
        return [layout.contract(one, two) for one, two in formed]
    first = torch.cat([one for one, _ in formed], -1)
    same = all(one is two for one, two in formed)
    second = first if same else torch.cat([two for _, two in formed], -1)
    return [layout.contract(first, second)]


def _cached(cache: dict, use: Use, make) -> torch.Tensor:
    if id(use) not in cache:
        cache[id(use)] = (use, make())  # the use is kept so that its id is not reused
    return cache[id(use)][1]


def _starts_within_a_side(equation: str, shapes: tuple, side1_operands: int) -> bool:
    """Whether opt_einsum's first step contracts two operands of the same side (``J`` first)."""
    step = _path(equation, shapes)[0]
    first, second = step[:2] if len(step) >= 2 else (step[0], step[0])
    return (first < side1_operands) == (second < side1_operands)


def _path(equation: str, shapes: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """The order of ``equation``'s steps (NOTE: [Contraction order])."""
    return _ordered(equation, shapes)[-1]


@functools.lru_cache(maxsize=1024)
def _ordered(
    equation: str, shapes: tuple[tuple[int, ...], ...]
) -> tuple[tuple[frozenset, ...], frozenset, dict[str, int], float, tuple[tuple[int, ...], ...]]:
    """:func:`_reduced` and the order of the steps: searched once per equation for AUTO's price
    (:func:`pair_cost`), the choice of order and the expression that follows it."""
    terms, output, sizes, summed = _reduced(equation, shapes)
    return tuple(terms), output, sizes, summed, tuple(tuple(step) for step in _order(terms, output, sizes))


# NOTE: [Contraction order]
# A pair contraction runs in the order that costs the fewest FLOPs plus ``_WRITE_COST`` per
# element of every intermediate it writes (the price merged uses are judged by), not in the order
# of fewest FLOPs. The two differ on a linear layer applied to tokens: by FLOPs alone, one side's
# ``G`` meets the inputs' Gram first, an intermediate of ``N^2 T O`` times the layer's width
# (``(8, 32, 3072, 8, 2)`` for RoBERTa's feed-forward layers at N = 8: 50 MB, and 50 MB more for
# its permuted copy), where the ``G``-Gram first writes ``N^2 O^2 T^2`` elements (1 MB) for 1.8x
# the FLOPs. On the CPU such intermediates are fresh memory on every call wherever the allocator
# returns them to the system (glibc maps anything above 32 MB anew), and faulting it in costs more
# than the FLOPs saved (docs/benchmarks.md, "Contraction order: FLOPs and the intermediates
# written"). Where no order keeps every intermediate within ``_MAX_INTERMEDIATE``, and where the
# price is no lower, the order of fewest FLOPs is kept, as opt_einsum's ``optimal`` gives it under
# that limit. The search by price runs once per equation (``_ordered``) and only where it can pay:
# every order within the limit costs at least the fewest FLOPs and writes the result, so none
# saves more than what the order of fewest FLOPs writes besides the result; where that is less
# than ``_CALL_COST``, that order is taken at once. On a MobileNetV3-small's first call 120
# searches took 250 ms; 23 remain, and no order changed on the models of
# ``benchmarks/bench_first_call.py`` (docs/benchmarks.md, "The contraction order's search, only
# where it can pay"). The search itself (:func:`_cheapest_order`) tries every order of a pair's
# few terms, as binary trees over subsets of them, within the memory limit: 43 us an equation
# (median of the 98 searched on the benchmarks' and the tests' models) where opt_einsum's dynamic
# programming (``combo``) took 365 us (0.4-1 ms on the first calls of MobileNetV3-small and an
# LSTM: 2-6% of them); and it never takes a dearer order than that search, which leaves out the
# products of two terms sharing no letter (an operand of one side with the other side's ``G``) and
# so missed a transformer block's cheaper order (docs/benchmarks.md, "The search by price over
# every order").
_EXACT_TERMS = 8
"""Terms up to which :func:`_cheapest_order` tries every order (about 3^n splits); a pair has
four, merged uses a few more. Beyond, opt_einsum's dynamic programming searches, without a memory
limit (with one, where no order fits it, its search never ends)."""

_DYNAMIC_PROGRAMMING = opt_einsum.paths.DynamicProgramming(minimize=f"combo-{int(_WRITE_COST)}")


def _cheapest_order(
    terms: list[frozenset], output: frozenset, sizes: dict[str, int]
) -> Optional[list[tuple[int, ...]]]:
    """The steps of the order of the lowest price (FLOPs plus ``_WRITE_COST`` per element written)
    whose intermediates all fit ``_MAX_INTERMEDIATE``, in opt_einsum's path format; None where
    none fits. Every binary tree over the terms, each subset's cheapest tree built from the
    cheapest trees of its two parts."""
    count = len(terms)
    if count > _EXACT_TERMS:
        return list(_DYNAMIC_PROGRAMMING(terms, output, sizes))
    full = (1 << count) - 1
    letters = [frozenset()] * (full + 1)
    for mask in range(1, full + 1):
        low = mask & -mask
        letters[mask] = letters[mask ^ low] | terms[low.bit_length() - 1]
    # a subset contracted into one tensor keeps the letters the output or another term still needs
    kept = [letters[mask] & (output | letters[full ^ mask]) for mask in range(full + 1)]
    best: dict[int, tuple[float, Optional[tuple[int, int]]]] = {1 << index: (0.0, None) for index in range(count)}
    for mask in sorted(range(1, full + 1), key=lambda mask: bin(mask).count("1")):
        if mask in best:
            continue
        size = opt_einsum.helpers.compute_size_by_dict(kept[mask], sizes)
        if size > _MAX_INTERMEDIATE:
            continue
        low, chosen = mask & -mask, None
        part = (mask - 1) & mask
        while part:  # each split once: the part holding the lowest term, and the rest
            rest = mask ^ part
            if part & low and rest and part in best and rest in best:
                involved = kept[part] | kept[rest]
                flops = opt_einsum.helpers.flop_count(involved, involved != kept[mask], 2, sizes)
                price = best[part][0] + best[rest][0] + flops + _WRITE_COST * size
                if chosen is None or price < chosen[0]:
                    chosen = (price, (part, rest))
            part = (part - 1) & mask
        if chosen is not None:
            best[mask] = chosen
    if full not in best:
        return None
    steps: list[tuple[int, ...]] = []
    current = [1 << index for index in range(count)]

    def emit(mask: int) -> None:
        split = best[mask][1]
        if split is None:
            return
        emit(split[0])
        emit(split[1])
        positions = sorted((current.index(split[0]), current.index(split[1])))
        steps.append(tuple(positions))
        for position in reversed(positions):
            del current[position]
        current.append(mask)

    emit(full)
    return steps


_ORDER = _cheapest_order


def _order(terms: list[frozenset], output: frozenset, sizes: dict[str, int]) -> list[tuple[int, ...]]:
    """The steps of NOTE: [Contraction order] over ``terms`` (sets of letters, each summed already
    over the letters no other term or the output has) to ``output``."""
    if len(terms) <= 2:
        return [tuple(range(len(terms)))]
    fewest = list(opt_einsum.paths.optimal(terms, output, sizes, _MAX_INTERMEDIATE))
    flops, writes, _ = _walked(fewest, terms, output, sizes)
    # no other order saves more than this one writes besides the result (NOTE: [Contraction order])
    if _WRITE_COST * (writes - opt_einsum.helpers.compute_size_by_dict(output, sizes)) < _CALL_COST:
        return fewest
    written = _ORDER(terms, output, sizes)
    if written is None:
        return fewest
    written_flops, written_writes, largest = _walked(written, terms, output, sizes)
    # ties (orders of the same price, e.g. which side's Gram comes first) keep the order of fewest FLOPs
    if largest <= _MAX_INTERMEDIATE and _price(written_flops, written_writes) < _price(flops, writes):
        return written
    return fewest


def _price(flops: int, written: int) -> float:
    """FLOPs plus ``_WRITE_COST`` per element written: what NOTE: [Contraction order] minimises."""
    return flops + _WRITE_COST * written


def _walked(
    path: list[tuple[int, ...]], terms: list[frozenset], output: frozenset, sizes: dict[str, int]
) -> tuple[int, int, int]:
    """The FLOPs of ``path``'s steps (opt_einsum's count), the elements they write, and the
    elements of the largest intermediate (1 for an empty path)."""
    flops, written, largest = 0, 0, 1
    for step in path:
        step = tuple(sorted(step, reverse=True))
        result, terms, removed, involved = opt_einsum.helpers.find_contraction(step, terms, output)
        size = opt_einsum.helpers.compute_size_by_dict(result, sizes)
        flops += opt_einsum.helpers.flop_count(involved, bool(removed), len(step), sizes)
        written += size
        largest = max(largest, size)
    return flops, written, largest


def _reduced(
    equation: str, shapes: tuple[tuple[int, ...], ...]
) -> tuple[list[frozenset], frozenset, dict[str, int], float]:
    """``equation``'s terms as sets of letters, without the letters of one operand only; its output;
    the letters' sizes (a size-1 axis broadcasts, as in opt_einsum); and the FLOPs of summing out
    the letters left out."""
    inputs, output = equation.split("->")
    terms = inputs.split(",")
    counts = collections.Counter(equation.replace(",", "").replace("->", ""))
    reduced_terms, sizes, summed = [], {}, 0.0
    for term, shape in zip(terms, shapes):
        kept = "".join(letter for letter in term if counts[letter] > 1)
        if len(kept) < len(term):
            summed += math.prod(shape)
        reduced_terms.append(frozenset(kept))
        for letter, size in zip(term, shape):
            if counts[letter] > 1 and sizes.get(letter, 1) == 1:
                sizes[letter] = int(size)
    return reduced_terms, frozenset(output), sizes, summed


def pair_kind(role1: Role, role2: Role) -> str:
    """``"einsum"`` (same coordinates), ``"dense"`` (different ones) or ``"disjoint"`` (no common entry)."""
    if not all(one.overlaps(two) for one, two in zip(role1.refs, role2.refs)):
        return "disjoint"
    same = role1.param_shape == role2.param_shape and all(
        one.same_coordinates(two) and one.injective for one, two in zip(role1.refs, role2.refs)
    )
    return "einsum" if same else "dense"


def pair_equation(
    layout: KernelLayout, out_axis: Optional[int], first: Use, second: Use, leaf: int
) -> tuple[str, list[torch.Tensor]]:
    """The einsum of NOTE: [Pair contraction] and its operands (which may be meta tensors)."""
    role1, role2 = first.role, second.role
    out1, out2, result = output_symbols(layout)
    shared = _shared_symbols(role1.param_labels)
    shared2 = {letter: shared[other] for letter, other in zip(role2.param_labels, role1.param_labels)}
    terms1, tensors1 = _side_terms(first, leaf, out1, out_axis, shared, _SIDE1)
    terms2, tensors2 = _side_terms(second, leaf, out2, out_axis, shared2, _SIDE2)
    return ",".join(terms1 + terms2) + "->" + "".join(result), tensors1 + tensors2


@functools.lru_cache(maxsize=1024)
def pair_cost(equation: str, shapes: tuple[tuple[int, ...], ...]) -> tuple[float, float]:
    """opt_einsum's FLOP count and largest intermediate (elements) for the order the contraction
    takes (NOTE: [Contraction order]).

    An index that appears in one operand only is summed out first (as ``torch.einsum`` does);
    opt_einsum would price it as part of the product (a bias pair sums ``G`` over positions on
    each side, which it prices as the outer product of both sides).

    The numbers are ``opt_einsum.contract_path``'s (``opt_cost`` and ``largest_intermediate``, the
    tests compare them), from its optimiser and its per-step counts, without the rest of what it
    does (parsing, BLAS checks, each step's equation, its report: about half its time on the small
    equations AUTO prices, where planning is much of what choosing costs).
    """
    terms, output, sizes, summed, path = _ordered(equation, shapes)
    flops, _, largest = _walked(path, list(terms), output, sizes)
    return summed + float(flops), float(largest)


@functools.lru_cache(maxsize=1024)
def _shared_symbols(param_labels: str) -> dict[str, str]:
    """One symbol per parameter letter, the same on both sides of a pair (and beyond the rules').
    Cached: callers only read it."""
    return {letter: opt_einsum.get_symbol(_SHARED + k) for k, letter in enumerate(param_labels)}


def _side_terms(use: Use, leaf, out_symbols, out_axis, shared, offset):
    """Einsum terms and tensors of one side: ``G`` then the operands."""
    role = use.role
    terms = _terms(
        tuple(out_symbols), out_axis, role.g_labels, tuple(labels for _, labels in role.operands),
        tuple(shared.items()), offset,
    )
    return list(terms), [use.gradients[leaf], *(tensor for tensor, _ in role.operands)]


@functools.lru_cache(maxsize=4096)
def _terms(
    out_symbols: tuple[str, ...], out_axis: Optional[int], g_labels: str, operand_labels: tuple[str, ...],
    shared: tuple[tuple[str, str], ...], offset: int,
) -> tuple[str, ...]:
    """:func:`_side_terms`' terms from the letters alone: a warm call states the same roles again,
    and stating the symbols of a force field's two dozen small uses took a tenth of its contractions."""
    symbols = dict(shared)

    def symbol(letter: str) -> str:
        return symbols.get(letter) or opt_einsum.get_symbol(offset + ord(letter))

    batch = "" if out_axis is None else out_symbols[out_axis]
    first = "".join(out_symbols) + "".join(symbol(letter) for letter in g_labels)
    return (first, *(batch + "".join(symbol(letter) for letter in labels) for labels in operand_labels))


def dense_jacobian(
    use: Use,
    leaf: int,
    out_symbols: Sequence[str],
    out_axis: Optional[int],
    param_sizes: Sequence[int],
    scatter: bool = True,
) -> torch.Tensor:
    """``J`` of one use as ``(*output, entries)``: in the coordinates the op saw, or (``scatter``)
    scattered into the parameter's own."""
    role = use.role
    if role.joint and scatter:
        raise AssertionError("joint roles always pair with roles of the same coordinates")
    equation, tensors = jacobian_equation(use, leaf, out_symbols, out_axis)
    dtype = promoted(t.dtype for t in tensors)
    tensors = [t.to(dtype) for t in tensors]
    if len(tensors) == 2:
        # torch.einsum keeps G as the left operand of its batched product, so J comes out contiguous
        # (opt_einsum would swap the operands and J would need a copy: fresh memory costs page faults)
        seen = torch.einsum(_valid_characters(equation), *tensors)
    else:
        seen = contract_tensors(equation, tensors)
    if role.scale != 1.0:
        seen = seen * role.scale
    seen = seen.reshape(*seen.shape[: len(out_symbols)], math.prod(role.param_shape))
    ref = role.refs[0]
    return ref.scatter(seen, param_sizes[ref.param]) if scatter else seen


@functools.lru_cache(maxsize=4096)
def _valid_characters(equation: str) -> str:
    return convert_to_valid_einsum_chars(equation)


def jacobian_equation(
    use: Use, leaf: int, out_symbols: Sequence[str], out_axis: Optional[int]
) -> tuple[str, list[torch.Tensor]]:
    """The einsum forming one use's ``J`` as ``(*output, *param_shape)``, and its operands."""
    shared = _shared_symbols(use.role.param_labels)
    terms, tensors = _side_terms(use, leaf, out_symbols, out_axis, shared, _SIDE1)
    return ",".join(terms) + "->" + "".join(out_symbols) + "".join(shared.values()), tensors


@functools.lru_cache(maxsize=256)
def output_symbols(layout: KernelLayout) -> tuple[list[str], list[str], list[str]]:
    """The einsum symbols of side 1's output axes, side 2's, and the kernel's.

    A traced or diagonal axis has one symbol on both sides (summed, or kept once in the kernel);
    a kept axis has one per side, both in the kernel. Any ASCII letters would do (the rules'
    letters become symbols beyond them); these are the ones ``KernelLayout`` uses for its own
    einsums, which the equations, and so opt_einsum's paths, have always been written with.
    """
    first, second, result = [], [], []
    symbols = iter(string.ascii_letters[2:])
    for axis in range(layout.ndim):
        kind = layout.kind(axis)
        one = next(symbols)
        two = next(symbols) if kind == "kept" else one
        first.append(one)
        second.append(two)
        result.extend({"trace": (), "diagonal": (one,), "kept": (one, two)}[kind])
    return first, second, result


def contract_tensors(equation: str, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``equation`` on ``tensors`` in opt_einsum's order (:func:`_path`), each step one batched
    matrix product (NOTE: [Pairwise products])."""
    shapes = tuple(tuple(tensor.shape) for tensor in tensors)
    steps = _pairwise_steps(equation, shapes, tuple(tensor.stride() for tensor in tensors))
    if steps is None:
        return _expression(equation, shapes)(*tensors, backend="torch")
    return _run_steps(steps, tensors)


@functools.lru_cache(maxsize=1024)
def _expression(equation: str, shapes: tuple[tuple[int, ...], ...]):
    return opt_einsum.contract_expression(equation, *shapes, optimize=[list(step) for step in _path(equation, shapes)])


# NOTE: [Pairwise products]
# opt_einsum's torch backend runs every step of a path through ``torch.einsum``, which views each
# operand with every letter of the step (one ``unsqueeze`` per letter it lacks), permutes, and
# permutes and reshapes again around its batched product: about 17 ATen calls per step, 43 per
# pair contraction of a normalisation layer, which made the contraction half of a warm ResNet-18
# call's ATen calls (each a host-side cost on a GPU). A step is one batched matrix product: the
# letters both operands share and a later term or the result keeps are its batch, the other
# shared letters are summed by the product, the rest are each side's own. Planned once per
# equation, shapes and strides, a step is a permute and a reshape per operand (each skipped when it
# is the identity), one ``bmm`` and one view. Within each group the letters are ordered by the
# operand's strides, and a matrix is taken transposed where its memory runs that way, so that the
# reshapes are views where the layout allows: ``G`` from a whole-batch pass is a permuted view
# (NOTE: [Whole-batch pullback] in ``_side.py``), which a fixed order of letters would copy.
# Where the summed letters still cannot flatten into one axis on either side, the outermost of
# them becomes a batch letter of the product, summed right after it (``_summed_after``): a traced
# kernel's ``G``-Gram sums the output letter, which a whole-batch ``G`` holds outside the examples
# and the width inside, so flattening them copied both sides' ``G`` on every call. Batched over
# the output letter, the product reads both as they lie (the benchmark MLP at N = 64 in one
# thread: 14.7 against 16.4 ms a call; 1000 logits at N = 32: 0.84 against 1.03 s; the fastest of
# alternating rounds, docs/benchmarks.md).
# A step that sums no letter (the product of a Gram of the operands and a Gram of the ``G``, per
# pair of examples) is an elementwise product: both operands are viewed in the result's letters,
# with size-1 axes for the letters the other brings, and multiplied with broadcasting, where a
# batched product of 1-wide matrices copied the permuted ``G``-Gram and made one tiny product per
# pair of examples.
# Equations this does not cover (a letter repeated within a term, a size-1 axis broadcast against a
# larger one, a step of more than two operands) go through opt_einsum's expression.


@dataclass(frozen=True)
class _Operand:
    """How one operand of a step becomes a matrix: summed over ``sums``, permuted by
    ``permutation`` (None: as it is), reshaped to ``matrix``, then transposed (``transposed``)."""

    sums: tuple[int, ...]
    permutation: Optional[tuple[int, ...]]
    matrix: tuple[int, ...]  # (batch, rows, columns); a step's broadcast shape where it sums nothing
    transposed: bool


@dataclass(frozen=True)
class _Step:
    """Operands ``first`` and ``second`` of the current list, whose product, viewed as ``shape``
    and summed over its leading ``batch_sums`` axes, is appended (as opt_einsum's paths say)."""

    first: int
    second: int
    operands: tuple[_Operand, _Operand]
    shape: tuple[int, ...]
    batch_sums: tuple[int, ...] = ()
    broadcast: bool = False  # no letter summed: the operands' ``matrix`` shapes broadcast to ``shape``


@dataclass(frozen=True)
class _Steps:
    steps: tuple[_Step, ...]
    final: Optional[tuple[int, ...]]  # the permutation into the result's letters


@dataclass
class _Term:
    """An operand while planning: its letters, sizes and strides."""

    letters: str
    sizes: tuple[int, ...]
    strides: tuple[int, ...]

    def size(self, letter: str) -> int:
        return self.sizes[self.letters.index(letter)]

    def stride(self, letter: str) -> int:
        return self.strides[self.letters.index(letter)]

    def summed(self, keep: set[str]) -> tuple["_Term", tuple[int, ...]]:
        sums = tuple(axis for axis, letter in enumerate(self.letters) if letter not in keep)
        if not sums:
            return self, ()
        letters = "".join(letter for letter in self.letters if letter in keep)
        sizes = tuple(self.size(letter) for letter in letters)
        return _Term(letters, sizes, _contiguous_strides(sizes)), sums


def _contiguous_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    strides, stride = [], 1
    for size in reversed(sizes):
        strides.append(stride)
        stride *= max(size, 1)
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=1024)
def _pairwise_steps(
    equation: str, shapes: tuple[tuple[int, ...], ...], strides: tuple[tuple[int, ...], ...]
) -> Optional[_Steps]:
    """The steps of NOTE: [Pairwise products] for ``equation``, or None where they do not apply."""
    inputs, output = equation.split("->")
    terms = inputs.split(",")
    sizes: dict[str, int] = {}
    for term, shape in zip(terms, shapes):
        if len(set(term)) != len(term) or len(term) != len(shape):
            return None
        for letter, size in zip(term, shape):
            if sizes.setdefault(letter, size) != size:
                return None  # a size-1 axis broadcast against a larger one
    if len(terms) < 2 or len(set(output)) != len(output) or any(letter not in sizes for letter in output):
        return None
    current = [_Term(term, shape, stride) for term, shape, stride in zip(terms, shapes, strides)]
    steps = []
    for step in _path(equation, shapes):
        if len(step) != 2:
            return None
        rest = [term for index, term in enumerate(current) if index not in step]
        keep = set(output).union(*(term.letters for term in rest))
        one, two = current[step[0]], current[step[1]]
        one, sums_one = one.summed(keep | set(two.letters))
        two, sums_two = two.summed(keep | set(one.letters))

        def by_stride(term: _Term, letters: list[str]) -> list[str]:
            return sorted(letters, key=lambda letter: -term.stride(letter))  # stable: ties keep their order

        shared = [letter for letter in one.letters if letter in two.letters]
        batch = by_stride(one, [letter for letter in shared if letter in keep])
        inner = by_stride(one, [letter for letter in shared if letter not in keep])
        rows = by_stride(one, [letter for letter in one.letters if letter not in two.letters])
        columns = by_stride(two, [letter for letter in two.letters if letter not in one.letters])
        if all(sizes[letter] == 1 for letter in inner):  # NOTE: [Pairwise products]: elementwise, broadcast
            first = _broadcast(one, sums_one, batch + rows, (1,) * len(columns), (), inner)
            second = _broadcast(two, sums_two, batch, (1,) * len(rows), columns, inner)
            shape = tuple(sizes[letter] for letter in batch + rows + columns)
            steps.append(_Step(step[0], step[1], (first, second), shape, broadcast=True))
        else:
            summed_after = _summed_after(one, two, batch, rows, inner, columns, sizes)
            if summed_after is not None:
                inner = [letter for letter in inner if letter != summed_after]
                batch = [summed_after] + batch
            first = _as_matrix(one, sums_one, batch, rows, inner)
            second = _as_matrix(two, sums_two, batch, inner, columns)
            shape = tuple(sizes[letter] for letter in batch + rows + columns)
            steps.append(_Step(step[0], step[1], (first, second), shape, () if summed_after is None else (0,)))
            if summed_after is not None:
                batch = batch[1:]
        letters = "".join(batch + rows + columns)
        result_sizes = tuple(sizes[letter] for letter in letters)
        current = rest + [_Term(letters, result_sizes, _contiguous_strides(result_sizes))]
    (result,) = current
    if sorted(result.letters) != sorted(output):
        return None
    final = tuple(result.letters.index(letter) for letter in output)
    return _Steps(tuple(steps), None if final == tuple(range(len(output))) else final)


def _broadcast(term: _Term, sums: tuple[int, ...], letters: list[str], ones: tuple[int, ...],
               after: Sequence[str], dropped: Sequence[str]) -> _Operand:
    """``term`` (summed over ``sums``) permuted into ``letters`` then ``after``, viewed with the
    size-1 axes ``ones`` between them and without its ``dropped`` letters (of size 1): one side
    of an elementwise product."""
    order = list(letters) + list(after) + list(dropped)
    permutation = tuple(term.letters.index(letter) for letter in order)
    shape = tuple(term.size(letter) for letter in letters) + ones + tuple(term.size(letter) for letter in after)
    return _Operand(sums, None if permutation == tuple(range(len(order))) else permutation, shape, False)


def _summed_after(
    one: _Term, two: _Term, batch: list[str], rows: list[str], inner: list[str], columns: list[str],
    sizes: dict[str, int],
) -> Optional[str]:
    """A summed letter to take as a batch letter of the product and sum over afterwards, or None.

    Where the summed letters of a step cannot be flattened into one axis without a copy on both
    sides (a whole-batch ``G`` of a traced kernel holds the output letter outermost, the width
    innermost and the examples between them: flattening the output and width letters of both
    sides copies each ``G``), a product batched over the outermost of them and summed after reads
    both operands as they lie. It is taken only when that product's extra output is smaller than
    what the copies would write.
    """
    if len(inner) < 2 or not (_copies(one, batch, rows, inner) and _copies(two, batch, inner, columns)):
        return None
    letter = inner[0]  # the largest stride on side one
    rest = [other for other in inner if other != letter]
    moved = [letter] + batch
    if _copies(one, moved, rows, rest) or _copies(two, moved, rest, columns):
        return None
    copied = math.prod(one.sizes) + math.prod(two.sizes)
    extra = math.prod(sizes[other] for other in moved + rows + columns)
    return letter if extra < copied else None


def _copies(term: _Term, batch: list[str], rows: list[str], columns: list[str]) -> bool:
    """Whether ``term`` becomes ``(batch, rows, columns)``, or the transpose of ``(batch, columns,
    rows)``, only through a copy (as :func:`_as_matrix` decides)."""
    return not any(_grouped(term, groups)[0] for groups in ((batch, rows, columns), (batch, columns, rows)))


def _grouped(term: _Term, groups: tuple[list[str], list[str], list[str]]) -> tuple[bool, bool]:
    """Whether flattening ``term``'s letters into the three ``groups`` (in order) is a view, and
    whether the last group then runs contiguously (a BLAS matrix's rows or columns)."""
    order = [letter for group in groups for letter in group]
    sizes = [term.size(letter) for letter in order]
    strides = [term.stride(letter) for letter in order]
    bounds = [0, len(groups[0]), len(groups[0]) + len(groups[1]), len(order)]
    spans = [list(range(bounds[index], bounds[index + 1])) for index in range(3)]
    viewed = all(_merges(sizes, strides, span) for span in spans)
    last = [axis for axis in spans[2] if sizes[axis] != 1]
    return viewed, not last or strides[last[-1]] == 1


def _as_matrix(term: _Term, sums: tuple[int, ...], batch: list[str], rows: list[str], columns: list[str]) -> _Operand:
    """How ``term`` (already summed over ``sums``) becomes ``(batch, rows, columns)``: directly, or
    as the transpose of ``(batch, columns, rows)`` where that reshape is a view and this one is not."""
    candidates = []
    for transposed, groups in ((False, (batch, rows, columns)), (True, (batch, columns, rows))):
        viewed, unit = _grouped(term, groups)
        order = [letter for group in groups for letter in group]
        candidates.append((not (viewed and unit), not viewed, transposed, order))
    _, _, transposed, order = min(candidates)
    permutation = tuple(term.letters.index(letter) for letter in order)
    matrix = tuple(math.prod(term.size(letter) for letter in group) for group in (batch, rows, columns))
    if transposed:
        matrix = (matrix[0], matrix[2], matrix[1])
    return _Operand(sums, None if permutation == tuple(range(len(order))) else permutation, matrix, transposed)


def _merges(sizes: Sequence[int], strides: Sequence[int], axes: list[int]) -> bool:
    """Whether ``axes`` (consecutive) of a tensor flatten into one without a copy."""
    kept = [axis for axis in axes if sizes[axis] != 1]
    return all(strides[outer] == strides[inner] * sizes[inner] for outer, inner in zip(kept, kept[1:]))


def _run_steps(planned: _Steps, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    current = list(tensors)
    for step in planned.steps:
        pair = (current[step.first], current[step.second])
        for index in sorted((step.first, step.second), reverse=True):
            del current[index]
        matrices = []
        for tensor, operand in zip(pair, step.operands):
            if operand.sums:
                tensor = tensor.sum(operand.sums)
            if operand.permutation is not None:
                tensor = tensor.permute(operand.permutation)
            tensor = tensor.reshape(operand.matrix)
            matrices.append(tensor.transpose(1, 2) if operand.transposed else tensor)
        if step.broadcast:
            current.append(torch.mul(*matrices))  # contiguous in the step's letters
            continue
        product = torch.bmm(*matrices).view(step.shape)
        current.append(product.sum(step.batch_sums) if step.batch_sums else product)
    (result,) = current
    return result if planned.final is None else result.permute(planned.final)
