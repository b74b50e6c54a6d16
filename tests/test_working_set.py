"""NOTE: [Working-set runs] (``torchntk/_kernel/working_set.py``): runs of equal lengths, implementation
2's tangents per forward-mode pass, implementation 3's runs counting its cotangents, and NOTE:
[Kept factors of operandless roles] (``structured/_side.py``).

Every kernel is checked against the float64 reference on a first, a second and a later call.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

import torchntk
from torchntk._implementations import ntk_vector_products
from torchntk._implementations import structured as structured_module
from torchntk._implementations.counting import _CountingMode
from torchntk._implementations.memory import FORWARD_LIVE, kept_sizes, modelled_peak
from torchntk._kernel import working_set
from torchntk._kernel.settings import input_shape_key
from torchntk._kernel.working_set import (
    FRESH_PAGES_BYTES, WORKING_SET_BYTES, forward_mode_tangents, working_set_run_length,
)
from torchntk._layout.runs import forward_mode_passes, runs
from torchntk.testing import assert_kernels_close, reference_ntk

F64 = torch.float64


def _prepared(ntk_fn, x1, x2=None, **kwargs):
    """The kernel call a first call of ``ntk_fn`` prepares (without computing it), and its scope."""
    settings = ntk_fn._settings
    key = input_shape_key(x1, x2, None, kwargs)
    call = settings.prepare(x1, x2, None, kwargs, "ntk_fn", shape_key=key, needs_outputs=False)
    return call, settings.planner.scope(call.plan_key)


def _three_calls(ntk_fn, x1, x2, expected) -> None:
    for _ in range(3):  # a first call, a warm one, a later one
        assert_kernels_close(ntk_fn(x1, x2), expected)


# -- runs of equal lengths ---------------------------------------------------------------------------


@pytest.mark.parametrize("examples, fitting, expected", [
    (16, 13, 8), (16, 8, 8), (16, 7, 6), (17, 16, 9), (100, 1, 1), (5, 4, 3), (16, 16, None), (16, 20, None),
])
def test_working_set_runs_are_as_few_as_the_bound_allows_and_of_equal_lengths(examples, fitting, expected):
    length = working_set_run_length(examples, WORKING_SET_BYTES // fitting, 1)
    assert length == expected
    if length is not None:
        count = math.ceil(examples / length)
        assert length <= fitting  # every run fits
        assert count == math.ceil(examples / fitting)  # no more runs than the longest fitting ones make
        assert examples - (count - 1) * length >= length - count  # the last run is not a short remainder


# -- implementation 2: tangents per forward-mode pass ---------------------------------------------


CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("device", [CPU, CUDA], ids=["cpu", "cuda"])
def test_forward_mode_tangents_keep_a_pass_within_the_working_set(device):
    assert forward_mode_tangents(16, 1000, 100, 4, 24, device) is None  # small activations: 24 a pass
    largest = 256_000  # RoBERTa's logits per example at 32 tokens (an 8000-word vocabulary)
    tangents = forward_mode_tangents(16, largest, 8 * 768, 4, 24, device)
    per_tangent = 4 * (FORWARD_LIVE * 16 * largest + 8 * 768)
    # where the working set bounds the passes, the fresh-pages bound does not lower them further:
    # fewer tangents would make x2's runs shorter and evaluate x1's primal more often
    assert tangents == 10 and tangents * per_tangent <= WORKING_SET_BYTES < (tangents + 1) * per_tangent
    assert forward_mode_tangents(1, WORKING_SET_BYTES, 0, 4, 24, device) == 1  # at least one


def test_forward_mode_tangents_keep_a_cpu_pass_s_largest_activation_below_fresh_pages():
    # the grid CNN at scale 2: 32 channels of 16 x 16 per example, 64 examples of x1, float32
    activation = 4 * 64 * 32 * 16 * 16
    assert 24 * (FORWARD_LIVE * activation + 4 * 9216) <= WORKING_SET_BYTES  # the working set allows 24
    tangents = forward_mode_tangents(64, 32 * 16 * 16, 9216, 4, 24, CPU)
    assert tangents == 12 and tangents * activation <= FRESH_PAGES_BYTES < (tangents + 1) * activation
    assert forward_mode_tangents(64, 32 * 16 * 16, 9216, 4, 24, CUDA) is None  # the caching allocator reuses
    assert forward_mode_tangents(32, 32 * 16 * 16, 9216, 4, 24, CPU) is None  # 24 fit: unchanged
    assert forward_mode_tangents(64, FRESH_PAGES_BYTES, 0, 1, 24, CPU) == 1  # at least one
    assert FRESH_PAGES_BYTES < 32 * 2**20  # below glibc's largest threshold for mapping an allocation alone


class _Wide(nn.Module):
    """Few parameters, a wide activation per example (what makes a tangent costly)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(3, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        wide = torch.tanh(self.inner(x))  # (N, 64)
        return self.head(wide.repeat(1, 8).reshape(-1, 8, 64).mean(1))


def _passes(monkeypatch) -> list[tuple[int, int]]:
    """Records ``(tangents, x1 examples)`` of every forward-mode pass of implementation 2 (one
    example where x1 is not mapped: the whole batch is one)."""
    seen: list[tuple[int, int]] = []
    original = ntk_vector_products._forward_mode_columns

    def recorded(side1, leaf, tangents, chunk, examples=None):
        total = tangents[0].shape[0]
        n1 = side1.batch_size() if side1.mapped else 1
        for run in range(0, n1, examples or n1):
            seen.extend((min(chunk, total - start), min(examples or n1, n1 - run)) for start in range(0, total, chunk))
        return original(side1, leaf, tangents, chunk, examples)

    monkeypatch.setattr(ntk_vector_products, "_forward_mode_columns", recorded)
    return seen


@pytest.mark.parametrize("x2_given", [True, False], ids=["x2", "x2-None"])
@pytest.mark.parametrize("vmap_axes", [0, None], ids=["mapped", "whole-batch"])
def test_implementation_2_carries_at_most_the_bound_of_tangents_a_pass_on_every_call(x2_given, vmap_axes, monkeypatch):
    torch.manual_seed(0)
    model = _Wide().to(F64)
    x1 = torch.randn(6, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    x2 = torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(2)) if x2_given else None
    expected = reference_ntk(model, x1, x2, trace_axes=())
    # room for three tangents a pass, by the model's own count
    probe = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=2)
    call, scope = _prepared(probe, x1, x2)
    sizes = kept_sizes(call, scope)
    per_tangent = sizes.element * (FORWARD_LIVE * sizes.side1.examples * sizes.side1.activations.largest
                                   + max(sizes.param_sizes))
    monkeypatch.setattr(working_set, "WORKING_SET_BYTES", 3.5 * per_tangent)
    passes = _passes(monkeypatch)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=vmap_axes, implementation=2)
    call, scope = _prepared(ntk_fn, x1, x2)
    assert call.tangents_per_pass == 3
    _three_calls(ntk_fn, x1, x2, expected)
    n1 = 6 if vmap_axes == 0 else 1
    assert passes and max(tangents * examples for tangents, examples in passes) <= 3 * n1
    columns = (5 if x2_given else 6) * 4
    assert sum(tangents * examples for tangents, examples in passes) == 3 * columns * n1  # every column once a call
    if vmap_axes == 0:
        # NOTE: [Forward-mode passes over runs of x1]: all of a run's tangents in every pass over
        # runs of x1, so x1's primal is evaluated once per run of x2, not once per 3 tangents
        assert max(tangents for tangents, _ in passes) > 3
        primal = sum(math.ceil(length * 4 / (3 * n1)) for _, length in _runs_of_x2(call, x2_given))
        assert sum(examples for _, examples in passes) == 3 * n1 * primal
        assert primal <= 2 < columns / 3
    # the memory model prices the bounded passes
    bounded = modelled_peak(call, scope, torchntk.NtkImplementation(2), None)
    unbounded = modelled_peak(dataclasses.replace(call, tangents_per_pass=None), None,
                              torchntk.NtkImplementation(2), None)
    assert bounded.planned < unbounded.planned


class _WideTransposed(_Wide):
    def forward(self, x):
        return super().forward(x).T  # (O, N): the examples along axis 1


@pytest.mark.parametrize("out_axis", [1, -1])
def test_passes_over_runs_of_x1_join_their_columns_along_the_output_batch_axis(out_axis, monkeypatch):
    torch.manual_seed(0)
    model = _WideTransposed().to(F64)
    x1 = torch.randn(6, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    x2 = torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(2))
    expected = reference_ntk(model, x1, x2, trace_axes=())
    monkeypatch.setattr(working_set, "WORKING_SET_BYTES", 1)  # one tangent a pass over all of x1
    passes = _passes(monkeypatch)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=(0, out_axis, {}), implementation=2)
    assert _prepared(ntk_fn, x1, x2)[0].tangents_per_pass == 1
    _three_calls(ntk_fn, x1, x2, expected)
    assert {examples for _, examples in passes} == {1}  # single examples, several tangents each
    assert max(tangents for tangents, _ in passes) > 1


def _runs_of_x2(call, x2_given: bool) -> list:
    examples = (call.side2 if x2_given else call.side1).batch_size()
    return runs(examples, ntk_vector_products.default_run_length(call))


def test_forward_mode_passes_carry_every_tangent_of_a_run_over_runs_of_x1():
    for tangents, examples, per_pass in [(8, 16, 10), (32, 16, 10), (400, 16, 10), (24, 6, 3), (7, 1, 3), (30, 5, 1)]:
        carried, length = forward_mode_passes(tangents, examples, per_pass)
        length = length or examples
        assert carried * length <= per_pass * max(examples, 1)  # within the bound of a pass over all of x1
        passes_over_x1 = math.ceil(tangents / carried)
        # the primal over x1 as few times as the bound allows
        assert passes_over_x1 == max(1, math.ceil(tangents / (per_pass * examples)))
        if length < examples:
            assert carried == tangents or length == 1


def test_implementation_2_keeps_24_tangents_a_pass_where_activations_are_small(monkeypatch):
    torch.manual_seed(0)
    model = _Wide().to(F64)
    x1 = torch.randn(8, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    passes = _passes(monkeypatch)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=2)
    assert _prepared(ntk_fn, x1)[0].tangents_per_pass is None
    _three_calls(ntk_fn, x1, None, reference_ntk(model, x1, None, trace_axes=()))
    assert max(tangents for tangents, _ in passes) > 3  # 32 columns: two passes of 16
    assert all(examples == 8 for _, examples in passes)


@pytest.mark.parametrize("x2_given", [True, False], ids=["x2", "x2-None"])
def test_implementation_2_keeps_a_cpu_pass_s_largest_activation_within_fresh_pages_on_every_call(x2_given, monkeypatch):
    torch.manual_seed(0)
    model = _Wide().to(F64)
    x1 = torch.randn(8, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    x2 = torch.randn(5, 3, dtype=F64, generator=torch.Generator().manual_seed(2)) if x2_given else None
    probe = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=2)
    call, scope = _prepared(probe, x1, x2)
    assert call.tangents_per_pass is None  # the working set allows 24 a pass over all of x1
    sizes = kept_sizes(call, scope)
    per_tangent_example = sizes.element * sizes.side1.activations.largest
    # room for four tangents over all of x1 (32 tangent-examples) within the bound
    monkeypatch.setattr(working_set, "FRESH_PAGES_BYTES", 4.5 * 8 * per_tangent_example)
    passes = _passes(monkeypatch)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=2)
    assert _prepared(ntk_fn, x1, x2)[0].tangents_per_pass == 4
    _three_calls(ntk_fn, x1, x2, reference_ntk(model, x1, x2, trace_axes=()))
    assert passes and max(tangents * examples for tangents, examples in passes) <= 4 * 8
    # NOTE: [Forward-mode passes over runs of x1]: more tangents a pass, over runs of x1
    assert max(tangents for tangents, _ in passes) > 4 and min(examples for _, examples in passes) < 8
    columns = (5 if x2_given else 8) * 4
    assert sum(tangents * examples for tangents, examples in passes) == 3 * columns * 8  # every column once a call


def test_auto_prices_implementation_2_with_the_bound(monkeypatch):
    torch.manual_seed(0)
    model = _Wide().to(F64)
    x1 = torch.randn(6, 3, dtype=F64, generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(working_set, "WORKING_SET_BYTES", 1)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0)
    call, _ = _prepared(ntk_fn, x1)
    assert call.tangents_per_pass == 1
    estimates = ntk_fn.auto_choice(x1).estimates
    monkeypatch.setattr(working_set, "WORKING_SET_BYTES", 2**40)
    unbounded = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=0)
    assert _prepared(unbounded, x1)[0].tangents_per_pass is None
    products = torchntk.NtkImplementation.NTK_VECTOR_PRODUCTS
    # one pass a column costs more than one pass for all 24 columns
    assert estimates[products].flops > unbounded.auto_choice(x1).estimates[products].flops


# -- implementation 3: runs that count its cotangents ---------------------------------------------------


def test_the_count_names_the_outputs_of_operations_consuming_a_parameter():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    params = tuple(model.parameters())
    counter = _CountingMode(params)
    with torch.no_grad(), counter:
        model(torch.randn(1, 4))
    count = counter.count()
    assert count.parameter_outputs == 8 + 3  # the two linear layers' outputs, not ReLU's
    assert count.written >= count.parameter_outputs + 8


class _Biases(nn.Module):
    """Sequences (N, T, D) through linear layers and a LayerNorm, whose biases alone are
    differentiated in the tests (BitFit): every factor is a cotangent per position."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.first = nn.Linear(5, width)
        self.norm = nn.LayerNorm(width)
        self.second = nn.Linear(width, width)
        self.head = nn.Linear(width, 3)
        for name, parameter in self.named_parameters():
            parameter.requires_grad_(name.endswith("bias"))

    def forward(self, x):
        hidden = self.second(torch.tanh(self.norm(self.first(x))))
        return self.head(torch.tanh(hidden)).mean(1)


def _sequences(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 7, 5, dtype=F64, generator=torch.Generator().manual_seed(seed))


def _bias_reference(model, x1, x2):
    return reference_ntk(model, x1, x2)  # the parameters with requires_grad: the biases


def test_implementation_3s_runs_count_its_cotangents(monkeypatch):
    torch.manual_seed(0)
    model = _Biases().to(F64)
    x = _sequences(8, 1)
    one = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1)
    call, scope = _prepared(one, x)
    activations = kept_sizes(call, scope).side1.activations
    outputs = 3  # per example
    assert activations.parameter_outputs > 0
    # room for four examples' activations, two examples' activations and cotangents
    element = 8
    monkeypatch.setattr(working_set, "WORKING_SET_BYTES", 4 * activations.written * element)
    assert activations.written + outputs * activations.parameter_outputs > 2 * activations.written
    for implementation, runs in ((1, 4), (3, None), (0, 4)):
        ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)
        prepared, _ = _prepared(ntk_fn, x)
        if implementation == 3:
            per_example = activations.written + outputs * activations.parameter_outputs
            runs = working_set_run_length(8, per_example, element)
            assert runs is not None and runs < 4
        assert prepared.working_runs == runs


def test_autos_pick_of_3_runs_with_3s_runs(monkeypatch):
    torch.manual_seed(0)
    model = _Biases().to(F64)
    x = _sequences(8, 1)
    expected = _bias_reference(model, x, None)
    probe = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1)
    call, scope = _prepared(probe, x)
    activations = kept_sizes(call, scope).side1.activations
    monkeypatch.setattr(working_set, "WORKING_SET_BYTES", 4 * activations.written * 8)
    structured = torchntk.NtkImplementation.STRUCTURED_DERIVATIVES
    expected_runs = working_set_run_length(8, activations.written + 3 * activations.parameter_outputs, 8)
    assert expected_runs is not None and expected_runs < 4
    chosen = torchntk._kernel.execution.memory_plan

    def picks_3(table, implementation, *rest):  # AUTO's choice, made to be 3
        plan = chosen(table, implementation, *rest)
        return dataclasses.replace(plan, implementation=structured)

    monkeypatch.setattr(torchntk._kernel.execution, "memory_plan", picks_3)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=0, memory="64GB")
    kind = type(ntk_fn._settings.table[structured])
    seen: list = []
    original = kind.kernels

    def recorded(self, call, scope):
        seen.append(call.working_runs)
        return original(self, call, scope)

    monkeypatch.setattr(kind, "kernels", recorded)
    prepared, _ = _prepared(ntk_fn, x)
    assert (prepared.working_runs, prepared.structured_runs) == (4, expected_runs)  # 1's, and 3's for a pick of 3
    _three_calls(ntk_fn, x, None, expected)
    assert seen == [expected_runs] * 3


# -- NOTE: [Kept factors of operandless roles] ------------------------------------------------------


def _kept_uses(monkeypatch) -> list:
    """Records the uses every contraction of implementation 3 reads."""
    seen: list = []
    original = structured_module.contract_sides

    def recorded(layouts, out_axes, first, second, *rest):
        seen.append(list(first.uses) + ([] if second is first else list(second.uses)))
        return original(layouts, out_axes, first, second, *rest)

    monkeypatch.setattr(structured_module, "contract_sides", recorded)
    return seen


@pytest.mark.parametrize("x2_given", [True, False], ids=["x2", "x2-None"])
@pytest.mark.parametrize("runs", [None, 1], ids=["one-pass", "runs"])
def test_biases_keep_their_jacobians_not_a_cotangent_per_position(x2_given, runs, monkeypatch):
    torch.manual_seed(0)
    model = _Biases().to(F64)
    x1, x2 = _sequences(5, 1), (_sequences(4, 2) if x2_given else None)
    expected = _bias_reference(model, x1, x2)
    if runs is not None:
        monkeypatch.setattr(working_set, "WORKING_SET_BYTES", 1)
    seen = _kept_uses(monkeypatch)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3)
    _three_calls(ntk_fn, x1, x2, expected)
    assert len(seen) >= 3
    for uses in seen:
        assert uses
        for use in uses:
            role = use.role
            assert not role.operands  # biases only
            assert set(role.g_labels) <= set(role.param_labels), role  # summed over the positions
            for gradient in use.gradients:
                assert gradient.shape[-len(role.y_shape):] == tuple(role.y_shape) == tuple(role.param_shape)


def test_weights_keep_their_cotangents_per_position(monkeypatch):
    """A role with operands (a weight) keeps ``G`` per position: the sums over positions pair it
    with its operand."""
    torch.manual_seed(0)
    model = _Biases().to(F64)
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    x = _sequences(4, 1)
    seen = _kept_uses(monkeypatch)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3)
    _three_calls(ntk_fn, x, None, reference_ntk(model, x, None))
    with_operands = [use for use in seen[-1] if use.role.operands]
    assert with_operands and all(len(use.role.y_shape) == 2 for use in with_operands)


@pytest.mark.parametrize("implementation", [2, 3])
def test_bias_only_kernels_replay_exactly_with_compile(implementation):
    """Captured replays (``compile=``) run the same summed factors and forward-mode passes: the
    kernel is the reference on the first call and on every replay."""
    torch.manual_seed(0)
    model = _Biases().to(F64)
    x1, x2 = _sequences(5, 1), _sequences(4, 2)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation, compile="eager")
    _three_calls(ntk_fn, x1, x2, _bias_reference(model, x1, x2))
