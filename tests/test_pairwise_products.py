"""NOTE: [Pairwise products] (``torchntk/_implementations/structured/_contract.py``): implementation
3's contractions run opt_einsum's path one batched matrix product a step, reading operands as
the passes lay them out (permuted views). Checked against ``torch.einsum`` in float64 on random
equations and layouts, and on the traced ``G``-Gram whose summed output letter is taken as a
batch letter of the product and summed after it, without copying either side, and on the steps that
sum no letter, which are elementwise products."""

from __future__ import annotations

import string
import time

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from torchntk._implementations.structured._contract import _pairwise_steps, contract_tensors

F64 = torch.float64


class _Copies(TorchDispatchMode):
    """Counts the ATen calls that write a copy of an operand."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(name in str(func) for name in ("clone", "copy", "contiguous")):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _laid_out(shape: tuple[int, ...], order: list[int], generator: torch.Generator) -> torch.Tensor:
    """A tensor of ``shape`` whose memory runs in ``order`` (a permuted view, as passes leave them)."""
    stored = torch.randn([shape[axis] for axis in order], dtype=F64, generator=generator)
    return stored.permute([order.index(axis) for axis in range(len(shape))])


@st.composite
def _equations(draw):
    letters = string.ascii_lowercase[:6]
    sizes = {letter: draw(st.integers(1, 4)) for letter in letters}
    terms = []
    for _ in range(draw(st.integers(2, 3))):
        term = draw(st.lists(st.sampled_from(letters), min_size=1, max_size=4, unique=True))
        terms.append("".join(term))
    used = sorted(set("".join(terms)))
    output = "".join(draw(st.permutations(used))[: draw(st.integers(0, len(used)))])
    orders = [draw(st.permutations(list(range(len(term))))) for term in terms]
    return ",".join(terms) + "->" + output, sizes, orders, draw(st.integers(0, 2**16))


@settings(max_examples=150, deadline=None)
@given(_equations())
def test_pairwise_products_agree_with_einsum(case):
    equation, sizes, orders, seed = case
    generator = torch.Generator().manual_seed(seed)
    terms = equation.split("->")[0].split(",")
    tensors = [
        _laid_out(tuple(sizes[letter] for letter in term), list(order), generator) for term, order in zip(terms, orders)
    ]
    expected = torch.einsum(equation, *tensors)
    torch.testing.assert_close(contract_tensors(equation, tensors), expected, rtol=1e-12, atol=1e-12)


def test_a_traced_gram_sums_its_output_letter_after_the_product_without_copies():
    # A whole-batch pass's G: output letter outermost, then x1's and x2's examples, width innermost.
    generator = torch.Generator().manual_seed(0)
    g = torch.randn(10, 12, 16, dtype=F64, generator=generator)
    one, two = g[:, :5], g[:, 5:]
    equation = "oiw,ojw->ij"
    steps = _pairwise_steps(equation, (tuple(one.shape), tuple(two.shape)), (one.stride(), two.stride()))
    assert [step.batch_sums for step in steps.steps] == [(0,)]
    with _Copies() as copies:
        actual = contract_tensors(equation, [one, two])
    assert copies.count == 0
    torch.testing.assert_close(actual, torch.einsum(equation, one, two), rtol=1e-12, atol=1e-12)

    # Examples outermost in memory: the summed letters flatten as they lie, one product, nothing after.
    g = torch.randn(12, 10, 16, dtype=F64, generator=generator).permute(1, 0, 2)
    one, two = g[:, :5], g[:, 5:]
    steps = _pairwise_steps(equation, (tuple(one.shape), tuple(two.shape)), (one.stride(), two.stride()))
    assert [step.batch_sums for step in steps.steps] == [()]
    torch.testing.assert_close(contract_tensors(equation, [one, two]), torch.einsum(equation, one, two))


class _Calls(TorchDispatchMode):
    """Records the ATen calls made."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_step_that_sums_no_letter_is_an_elementwise_product_without_copies():
    # A full kernel's pair term: the inputs' Gram (a, b) times the G-Gram laid out (a, o, b, p) as
    # one product over both sides' outputs leaves it, with a size-1 letter the merged uses carry.
    generator = torch.Generator().manual_seed(0)
    grams = torch.randn(6, 6, dtype=F64, generator=generator).T
    g_grams = torch.randn(6, 4, 6, 4, 1, dtype=F64, generator=generator)
    for equation, operands in [("ab,aobpz->abop", [grams, g_grams]), ("aobpz,ba->aobp", [g_grams, grams.T]),
                               ("a,b->ab", [grams[0], grams[:, 1]])]:
        steps = _pairwise_steps(equation, tuple(tuple(t.shape) for t in operands), tuple(t.stride() for t in operands))
        assert [step.broadcast for step in steps.steps] == [True]
        with _Calls() as calls:
            actual = contract_tensors(equation, operands)
        assert not [name for name in calls.names if any(word in name for word in ("bmm", "clone", "copy"))]
        torch.testing.assert_close(actual, torch.einsum(equation, *operands), rtol=1e-12, atol=1e-12)


def test_pairs_through_their_jacobians_are_contracted_as_one_concatenation():
    """``_formed_terms``: the pairs a side contracts through their ``J`` are summed by one product of
    the concatenated ``J``; with one tensor on both sides of every pair the kernel stays exactly
    symmetric; above the size limit, one product per pair."""
    from unittest import mock

    from torchntk._implementations.structured import _contract
    from torchntk._layout.kernel_layout import KernelLayout

    generator = torch.Generator().manual_seed(0)
    layout = KernelLayout(2, (), ())  # (N, O) outputs, full kernel (N1, N2, O, O)
    ones = [torch.randn(5, 3, size, dtype=torch.float32, generator=generator) for size in (4, 7, 1)]
    twos = [torch.randn(6, 3, size, dtype=torch.float32, generator=generator) for size in (4, 7, 1)]
    expected = sum(torch.einsum("iap,jbp->ijab", one.double(), two.double()) for one, two in zip(ones, twos))
    with mock.patch.object(KernelLayout, "contract", autospec=True, side_effect=KernelLayout.contract) as contract:
        (term,) = _contract._formed_terms(layout, list(zip(ones, twos)))
    assert contract.call_count == 1
    torch.testing.assert_close(term.double(), expected, rtol=1e-5, atol=1e-5)

    (symmetric,) = _contract._formed_terms(layout, [(one, one) for one in ones])
    assert torch.equal(symmetric, symmetric.permute(layout.swap_permutation()))

    with mock.patch.object(_contract, "_JOINED_JACOBIAN", 10):
        terms = _contract._formed_terms(layout, list(zip(ones, twos)))
    assert len(terms) == 3
    torch.testing.assert_close(sum(term.double() for term in terms), expected, rtol=1e-5, atol=1e-5)


def test_a_linear_layer_over_tokens_is_contracted_through_grams_not_a_width_sized_intermediate():
    """NOTE: [Contraction order]: the pair of a linear layer applied to ``T`` tokens (``G`` of
    ``(N, O, T, width)``, inputs ``(N, T, in + 1)`` on each side) goes through the ``G``-Gram, whose
    ``N^2 O^2 T^2`` entries are far fewer than the ``N^2 T O width`` the order of fewest FLOPs builds
    (RoBERTa's feed-forward layer at N = 8: 262,144 against 12.6M). Executed in that order, it
    agrees with ``torch.einsum`` in float64; where the orders cost the same price, the order of
    fewest FLOPs is kept."""
    import opt_einsum

    from torchntk._implementations.structured import _contract

    equation = "aotw,ati,bpsw,bsi->abop"

    def orders(shapes, equation=equation):
        terms, output, sizes, _ = _contract._reduced(equation, shapes)
        fewest = [tuple(step) for step in opt_einsum.paths.optimal(terms, output, sizes, _contract._MAX_INTERMEDIATE)]
        return _contract._path(equation, shapes), tuple(fewest)

    roberta = ((8, 2, 32, 3072), (8, 32, 769), (8, 2, 32, 3072), (8, 32, 769))
    taken, fewest = orders(roberta)
    assert taken != fewest
    flops, largest = _contract.pair_cost(equation, roberta)
    assert largest == 8 * 8 * 2 * 2 * 32 * 32
    _, info = opt_einsum.contract_path(equation, *roberta, shapes=True, optimize="optimal")
    assert info.largest_intermediate == 8 * 32 * 3072 * 8 * 2 and flops > info.opt_cost

    small = ((4, 2, 8, 256), (4, 8, 33), (4, 2, 8, 256), (4, 8, 33))
    assert orders(small)[0] != orders(small)[1]  # the same choice at a size a test can run
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, dtype=F64, generator=generator) for shape in small]
    torch.testing.assert_close(contract_tensors(equation, tensors), torch.einsum(equation, *tensors))

    mlp = ((64, 10, 1, 10), (64, 1, 513), (64, 10, 1, 10), (64, 1, 513))  # a tie: which side's Gram first
    assert orders(mlp)[0] == orders(mlp)[1]

    # a kernel larger than _MAX_INTERMEDIATE itself (no order fits): the order of fewest FLOPs, at once
    start = time.perf_counter()
    wide = ((10, 2000, 2000), (10, 7), (10, 2000, 2000), (10, 7))
    taken, fewest = orders(wide, "aow,ai,bpw,bi->abop")
    assert taken == fewest and time.perf_counter() - start < 10


def test_the_search_for_an_order_by_price_is_skipped_where_it_could_save_less_than_one_call(monkeypatch):
    """Every order within the memory limit costs at least the fewest FLOPs and writes the result,
    so the search by price (NOTE: [Contraction order]) runs only where the order of fewest FLOPs
    writes more than that by one call's dispatch (``_CALL_COST``): it was most of the planning of
    a first call on MobileNetV3-small (120 searches, 250 ms), for no change of order there."""
    from torchntk._implementations.structured import _contract

    searched = []
    search = _contract._ORDER
    monkeypatch.setattr(_contract, "_ORDER", lambda *args: searched.append(args) or search(*args))
    equation = "aotw,ati,bpsw,bsi->abop"

    def order(shapes):
        searched.clear()
        return _contract._order(*_contract._reduced(equation, shapes)[:3]), len(searched)

    tiny = ((3, 2, 4, 16), (3, 4, 9), (3, 2, 4, 16), (3, 4, 9))
    terms, output, sizes, _ = _contract._reduced(equation, tiny)
    _, writes, _ = _contract._walked(order(tiny)[0], terms, output, sizes)
    assert _contract._WRITE_COST * writes < _contract._CALL_COST and order(tiny)[1] == 0
    assert order(((4, 2, 8, 256), (4, 8, 33), (4, 2, 8, 256), (4, 8, 33)))[1] == 1


def _every_order(count: int):
    """Every sequence of pair contractions of ``count`` terms, in opt_einsum's path format."""
    if count == 1:
        yield []
        return
    for first in range(count):
        for second in range(first + 1, count):
            for rest in _every_order(count - 1):
                yield [(first, second)] + rest


@st.composite
def _small_equations(draw):
    """An einsum of three to five terms over a few letters, with sizes up to 9 (the test reduces it
    as the pairs are: ``_reduced`` sums out the letters of one term only)."""
    letters = "abcdefg"
    count = draw(st.integers(3, 5))
    terms = [draw(st.text(letters, min_size=1, max_size=4).map(lambda text: "".join(dict.fromkeys(text))))
             for _ in range(count)]
    used = sorted(set("".join(terms)))
    output = "".join(draw(st.lists(st.sampled_from(used), unique=True, max_size=3)))
    sizes = {letter: draw(st.integers(1, 9)) for letter in used}
    equation = ",".join(terms) + "->" + output
    return equation, tuple(tuple(sizes[letter] for letter in term) for term in terms)


@settings(max_examples=60, deadline=None)
@given(_small_equations())
def test_the_search_by_price_finds_the_cheapest_of_every_order(case):
    """NOTE: [Contraction order]: the search by price takes the lowest price among every order of a
    pair's terms (each enumerated here) and never one above opt_einsum's dynamic programming's."""
    from torchntk._implementations.structured import _contract

    equation, shapes = case
    terms, output, sizes, _ = _contract._reduced(equation, shapes)
    path = _contract._ORDER(terms, output, sizes)

    def price(order):
        flops, written, largest = _contract._walked(order, list(terms), output, sizes)
        return _contract._price(flops, written) if largest <= _contract._MAX_INTERMEDIATE else float("inf")

    assert price(path) == min(price(order) for order in _every_order(len(terms)))
    assert price(path) <= price(list(_contract._DYNAMIC_PROGRAMMING(terms, output, sizes)))


def test_the_search_by_price_finds_an_order_the_dynamic_programming_left_out():
    """The linear layer of a transformer block over tokens with the tokens kept in the kernel (the
    memory grid's GIGABYTE kernel): opt_einsum's dynamic programming priced no order below the
    fewest FLOPs', which holds a 48M-element intermediate; the search by price takes one whose
    largest holds 14M (on 36 examples that kernel then took 0.68 GB and 1.7 s instead of 0.94 GB
    and 2.4 s: docs/benchmarks.md, "The search by price over every order")."""
    import opt_einsum

    from torchntk._implementations.structured import _contract

    equation = "cegtw,cti,dfgsw,dsi->cdef"
    shapes = ((18, 12, 32, 12, 32), (18, 12, 65), (18, 12, 32, 12, 32), (18, 12, 65))
    terms, output, sizes, _ = _contract._reduced(equation, shapes)
    fewest = list(opt_einsum.paths.optimal(terms, output, sizes, _contract._MAX_INTERMEDIATE))
    searched = list(_contract._DYNAMIC_PROGRAMMING(terms, output, sizes))
    price = lambda order: _contract._price(*_contract._walked(order, list(terms), output, sizes)[:2])  # noqa: E731
    assert price(searched) > price(fewest)  # the dynamic programming's order would not be taken
    taken = [tuple(step) for step in _contract._path(equation, shapes)]
    assert price(taken) < price(fewest)
    _, largest = _contract.pair_cost(equation, shapes)
    assert _contract._walked(fewest, list(terms), output, sizes)[2] == 47_775_744
    assert largest == 18 * 12 * 32 * 32 * 65  # one side's G with its inputs: (examples, tokens, 32, 32, 65)
