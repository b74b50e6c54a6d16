"""Structured derivatives' whole-batch pass (NOTE: [Whole-batch pullback] in ``structured/_side.py``).

With ``vmap_axes`` implementation 3 takes every ``G = df/dy`` from one VJP of the whole batch
instead of one per example, reading each whole-batch tensor as the per-example ones stacked; the
reading is decided from shapes and checked against the per-example pass when the plan is made
(``structured/_whole_batch.py``). These tests pin down what that check is for: models whose shapes
look right but whose tensors do not hold the examples as their shapes suggest (a time-major
recurrence with as many steps as examples, examples reordered inside the model) must stay exact,
and would not be without the check. Also: runs of examples, one-example runs, other per-example
shapes on x2, parameter groups, ``verify=True``, and the output check of ``vmap_axes``, which the
whole-batch pass must not skip. Every kernel is float64 against ``torchntk.testing.reference_ntk``.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

import torchntk
import torchntk._implementations.structured as structured
from tests.cases import DEVICE
from tests.structured_cases import STRUCTURED_CASES, make_x1_x2
from tests.test_structured_safety import _CustomFunction
from torchntk._implementations.structured import _side, _whole_batch
from torchntk._implementations.structured._plan import Fold, Plan
from torchntk.testing import assert_kernels_close, reference_ntk

pytestmark = [
    pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning"),
    pytest.mark.filterwarnings(
        "ignore:There is a performance drop because we have not yet implemented the batching rule:UserWarning"
    ),
]


class Passes:
    """What the structured passes of a test did: the plans' decisions and the passes taken."""

    def __init__(self) -> None:
        self.plans: list[Plan] = []
        self.whole_batch = 0  # passes over the whole batch the kernels used
        self.whole_batch_sizes: list[int] = []

    @property
    def plan(self) -> Plan:
        return self.plans[-1]


@pytest.fixture
def passes(monkeypatch) -> Passes:
    seen = Passes()
    decide = structured.with_whole_batch
    factors = _side.whole_batch_factors

    def recorded_decision(call, plan, checked=None, **options):
        plan = decide(call, plan, checked, **options)
        seen.plans.append(plan)
        return plan

    def recorded_factors(side, plan, layout, cotangents=None):
        result = factors(side, plan, layout, cotangents)
        if result is not None:
            seen.whole_batch += 1
            seen.whole_batch_sizes.append(side.batch_size())
        return result

    monkeypatch.setattr(structured, "with_whole_batch", recorded_decision)
    monkeypatch.setattr(_side, "whole_batch_factors", recorded_factors)
    return seen


def _build(module_type, *args) -> nn.Module:
    torch.manual_seed(0)
    return module_type(*args).double().eval().to(DEVICE)


def _assert_replays_exact(
    model: nn.Module, weight: Tensor, shape1: tuple, shape2: tuple, calls: int, eager_computations: list,
) -> None:
    """Implementation 3's full kernel of ``model`` with ``compile="eager"`` on ``calls`` pairs of
    normal inputs of ``shape1`` and ``shape2``, ``weight`` scaled in place before each: exact on the first call, its capture
    and the replays, with one eager computation and one trace in all (no capture refused, no replay
    failed)."""
    import warnings

    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, trace_axes=(), compile="eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a capture refused or a replay failed
        for seed in range(calls):
            with torch.no_grad():
                weight.mul_(1.1)
            x1, x2 = _normal(*shape1, seed=seed), _normal(*shape2, seed=seed + 10)
            assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2, trace_axes=()))
    assert len(eager_computations) == 2  # the first call's eager computation and its trace; the others replayed


def _normal(*shape: int, seed: int) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(DEVICE)


def _relative_error(kernel: Tensor, expected: Tensor) -> float:
    return ((kernel - expected).abs().max() / expected.abs().max()).item()


# --------------------------------------------------------------------------------------------
# Models whose whole-batch tensors do not hold the examples as their shapes suggest
# --------------------------------------------------------------------------------------------

STEPS = 3
"""Time steps of :class:`TimeMajorRecurrence`, as many as its examples (and as the check's)."""


class TimeMajorRecurrence(nn.Module):
    """``(N, T, F)`` examples made time-major, ``(T, N, F)``, for an ``nn.RNN`` with
    ``batch_first=False``; the last step's state through a linear head: ``(N, 2)``.

    The recurrence projects the whole ``(T, N, F)`` sequence with one ``F.linear``, whose rule
    flattens it into ``(T N, F)`` positions: the example is the *inner* factor, and with ``T == N``
    nothing in the shapes (``(T N, F)`` for ``N`` examples, ``(T, F)`` for one) tells that from the
    usual batch-first ``(N T, F)``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.RNN(3, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Tensor:
        states, _ = self.rnn(x.transpose(0, 1))
        return self.head(torch.tanh(states[-1]))


class ReversedInside(nn.Module):
    """Reverses the order of the examples, applies two layers, and restores the order: every
    example's output is its own, but inside, row ``m`` of the whole batch is example ``N - 1 - m``,
    which no shape shows (one example's rows are not reordered)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.second = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(self.first(x.flip(0)))).flip(0)


def _time_major_inputs() -> tuple[Tensor, Tensor]:
    return _normal(STEPS, STEPS, 3, seed=1), _normal(STEPS, STEPS, 3, seed=2)


@pytest.mark.parametrize("same", [False, True], ids=["x2", "x2=None"])
def test_time_major_recurrence_with_as_many_steps_as_examples_is_exact(same, passes):
    model = _build(TimeMajorRecurrence)
    x1, x2 = _time_major_inputs()
    x2 = None if same else x2
    kernel = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, trace_axes=())(x1, x2)
    assert_kernels_close(kernel, reference_ntk(model, x1, x2, trace_axes=()))
    # The check found where the projection holds the examples: the inner factor of its positions.
    layout = passes.plan.whole_batch
    assert layout is not None, passes.plan.whole_batch_reason
    assert layout.checked_on == STEPS
    assert any(fold.inner for fold in layout.operand_folds)
    assert passes.whole_batch >= 1


def test_without_the_check_the_time_major_recurrence_would_be_silently_wrong(monkeypatch, passes):
    """What the test above guards: read by the shapes alone (the example the outer factor), the
    time-major projection gives a wrong kernel and no error."""
    monkeypatch.setattr(_whole_batch, "CHECK", False)
    model = _build(TimeMajorRecurrence)
    x1, x2 = _time_major_inputs()
    kernel = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, trace_axes=())(x1, x2)
    assert passes.plan.whole_batch is not None and passes.plan.whole_batch.checked_on == 0
    assert _relative_error(kernel, reference_ntk(model, x1, x2, trace_axes=())) > 1e-3


def test_examples_reordered_inside_the_model_keep_the_per_example_pass(passes):
    model = _build(ReversedInside)
    x1, x2 = _normal(5, 4, seed=1), _normal(4, 4, seed=2)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, trace_axes=())
    for second in (x2, None):
        assert_kernels_close(ntk_fn(x1, second), reference_ntk(model, x1, second, trace_axes=()))
        assert passes.plan.whole_batch is None
        assert "no reading of the whole-batch tensor" in passes.plan.whole_batch_reason
    assert passes.whole_batch == 0


def test_without_the_check_reordered_examples_would_be_silently_wrong(monkeypatch):
    monkeypatch.setattr(_whole_batch, "CHECK", False)
    model = _build(ReversedInside)
    x1, x2 = _normal(5, 4, seed=1), _normal(4, 4, seed=2)
    kernel = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, trace_axes=())(x1, x2)
    assert _relative_error(kernel, reference_ntk(model, x1, x2, trace_axes=())) > 1e-3


# --------------------------------------------------------------------------------------------
# Where the whole-batch pass is taken, and what must keep working with it
# --------------------------------------------------------------------------------------------

WHOLE_BATCH_CASES = [
    "mlp", "cnn_stride_dilation_groups", "conv_padding_modes", "conv1d", "conv3d", "resnet_bn_eval",
    "transformer_block", "cross_attention", "tied_embedding_lm", "linear_twice", "recurrent_cell",
    "mixed_ruled_unruled", "tuple_output", "layernorm_groupnorm",
]


@pytest.mark.parametrize("case_id", WHOLE_BATCH_CASES)
def test_the_structured_cases_take_the_whole_batch_pass(case_id, passes):
    """Exactness on these models is ``tests/test_structured.py``'s; here: that they do not quietly
    fall back to the per-example pass (attention is time-major inside ``nn.MultiheadAttention``)."""
    case = STRUCTURED_CASES[case_id]()
    x1, x2 = make_x1_x2(case)
    kernel = torchntk.empirical_ntk_fn(case.module, vmap_axes=0, implementation=3, trace_axes=())(x1, x2)
    assert_kernels_close(kernel, reference_ntk(case.module, x1, x2, trace_axes=()))
    assert passes.plan.whole_batch is not None, passes.plan.whole_batch_reason
    assert passes.whole_batch >= 1


class _LeadingAxis(nn.Module):
    """A layer over the examples behind a leading axis of size 1: one example's output has two
    axes of size 1, and the whole batch holds the examples on the second."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.second = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(self.first(x.unsqueeze(0))).squeeze(0))


class _SharedRow(nn.Module):
    """A layer whose input is the same for every example (a learnt offset, as a position embedding
    of Hugging Face transformers is one row for all examples): its output does not hold the
    examples, so the passes cannot run over the whole batch."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.offset, self.second = nn.Linear(4, 6), nn.Linear(2, 6), nn.Linear(6, 3)
        self.register_buffer("ones", torch.ones(1, 2))

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(self.first(x) + self.offset(self.ones)))


_GUESSED_CASES = {
    **{case_id: lambda case_id=case_id: STRUCTURED_CASES[case_id]() for case_id in WHOLE_BATCH_CASES},
    "time_major": lambda: (_build(TimeMajorRecurrence), *_time_major_inputs()),
    "reversed_inside": lambda: (_build(ReversedInside), _normal(5, 4, seed=1), _normal(4, 4, seed=2)),
    "leading_axis": lambda: (_build(_LeadingAxis), _normal(5, 4, seed=1), _normal(4, 4, seed=2)),
    "shared_row": lambda: (_build(_SharedRow), _normal(5, 4, seed=1), _normal(4, 4, seed=2)),
}


@pytest.mark.parametrize("case_id", list(_GUESSED_CASES))
def test_the_axes_the_checks_pass_guesses_are_those_a_recording_pass_finds(case_id, monkeypatch):
    """NOTE: [The layout read from the check's own pass]: wherever the check's whole-batch pass
    completes with the axes guessed from one example's shapes, a recording pass over the same
    examples finds the same axes, and where it stops at an output that is one example's shape
    over several, the recording pass refuses the layout for the same reason; elsewhere the
    recording pass decides. The kernels stay exact on a first and a second call, with x2 and
    without."""
    found, results, recordings = _whole_batch.found_layout, [], []
    output_axes = _whole_batch._output_axes

    def recording(*args):
        recordings.append(args)
        return output_axes(*args)

    def compared(call, plan, parameters, sample=None):
        before = len(recordings)
        shapes = found(call, plan, parameters, sample)
        results.append((len(recordings) == before, shapes.done is not None))
        recorded = _whole_batch.layout_shapes(call, plan)
        assert (shapes.output_axes, shapes.reason) == (recorded.output_axes, recorded.reason)
        return shapes

    monkeypatch.setattr(_whole_batch, "_output_axes", recording)
    monkeypatch.setattr(_whole_batch, "found_layout", compared)
    monkeypatch.setattr(structured, "found_layout", compared)
    built = _GUESSED_CASES[case_id]()
    if isinstance(built, tuple):
        module, x1, x2 = built
    else:
        module, (x1, x2) = built.module, make_x1_x2(built)
    for second in (x2, None):
        ntk_fn = torchntk.empirical_ntk_fn(module, vmap_axes=0, implementation=3, trace_axes=())
        for _ in range(2):
            assert_kernels_close(ntk_fn(x1, second), reference_ntk(module, x1, second, trace_axes=()))
    assert results, "the layout was found"
    # only there does the recording pass decide; the shared row's guess is refused, and the pass
    # that stopped decides
    assert all(guessed for guessed, _ in results) == (case_id != "leading_axis"), results
    assert all(completed for _, completed in results) == (case_id not in ("leading_axis", "shared_row")), results


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 7), nn.Tanh(), nn.Linear(7, 3))


@pytest.mark.parametrize("same", [False, True], ids=["x2", "x2=None"])
def test_runs_of_examples_are_whole_batch_passes_of_their_own(same, passes):
    """``chunk_size=3`` over 7 examples: runs of 3, 3 and 1, each one whole-batch pass (the last
    of a single example)."""
    model = _build(_mlp)
    x1, x2 = _normal(7, 4, seed=1), _normal(4, 4, seed=2)
    x2 = None if same else x2
    kernel = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, trace_axes=(), chunk_size=3)(x1, x2)
    assert_kernels_close(kernel, reference_ntk(model, x1, x2, trace_axes=()))
    assert 1 in passes.whole_batch_sizes and 3 in passes.whole_batch_sizes


@pytest.mark.parametrize("same", [False, True], ids=["x2", "x2=None"])
def test_one_output_entry_per_example_is_pulled_back_without_vmap(same, passes, monkeypatch):
    """An energy-like output, one entry per example: the whole-batch pass pulls back its one basis
    vector directly, and the kernel is exact; with more entries it still goes through ``vmap``."""
    mapped = []
    vmap = _side.vmap

    def counted_vmap(function, *args, **kwargs):
        mapped.append(function)
        return vmap(function, *args, **kwargs)

    monkeypatch.setattr(_side, "vmap", counted_vmap)
    for outputs in (1, 3):
        model = _build(lambda: nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, outputs)))
        x1, x2 = _normal(5, 4, seed=1), _normal(3, 4, seed=2)
        x2 = None if same else x2
        ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, trace_axes=())
        expected = reference_ntk(model, x1, x2, trace_axes=())
        assert_kernels_close(ntk_fn(x1, x2), expected)
        mapped.clear()  # a warm call: the kernel's own pass alone
        assert_kernels_close(ntk_fn(x1, x2), expected)
        assert passes.whole_batch >= 2
        assert len(mapped) == (0 if outputs == 1 else 1), mapped


def test_one_output_entry_per_example_replays_exactly(eager_computations):
    """The same pass with ``compile=``: the graph captured from the first call replays, exact on
    other inputs and on weights written in place."""
    model = _build(lambda: nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 1)))
    _assert_replays_exact(model, model[0].weight, (5, 4), (3, 4), 3, eager_computations)


def test_an_output_shared_by_every_example_keeps_per_example_passes_on_replays(passes, eager_computations):
    """NOTE: [The layout read from the check's own pass]: the guessed pass that stops at the shared
    row decides the plan on the first call; the kernel is exact on that call, on a warm one and on
    replays of the graph ``compile=`` captured, with other inputs and weights written in place."""
    model = _build(_SharedRow)
    _assert_replays_exact(model, model.offset.weight, (5, 4), (3, 4), 4, eager_computations)
    assert passes.plan.whole_batch is None and "does not hold the examples" in passes.plan.whole_batch_reason
    assert passes.whole_batch == 0


def test_one_example_on_x1_is_checked_on_the_examples_of_x2(passes):
    model = _build(_mlp)
    x1, x2 = _normal(1, 4, seed=1), _normal(5, 4, seed=2)
    kernel = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, trace_axes=())(x1, x2)
    assert_kernels_close(kernel, reference_ntk(model, x1, x2, trace_axes=()))
    assert passes.plan.whole_batch is not None and passes.plan.whole_batch.checked_on == 3


class _FeaturesFirst(nn.Module):
    """Examples on the last axis of the input and of the output: ``(4, N) -> (3, N)``."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 6)
        self.second = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(self.first(x.T))).T


class _BatchFirst(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x.T).T


@pytest.mark.parametrize("same", [False, True], ids=["x2", "x2=None"])
def test_examples_on_other_axes_than_the_first(same, passes):
    model = _build(_FeaturesFirst)
    x1, x2 = _normal(4, 5, seed=1), _normal(4, 3, seed=2)
    x2 = None if same else x2
    kernel = torchntk.empirical_ntk_fn(model, vmap_axes=(1, 1, None), implementation=3, trace_axes=())(x1, x2)
    batch_first = _BatchFirst(model)  # the same parameters, examples on axis 0: (N1, N2, 3, 3)
    expected = reference_ntk(batch_first, x1.T, None if same else x2.T, trace_axes=())
    assert_kernels_close(kernel, expected.permute(2, 3, 0, 1))
    assert passes.whole_batch >= 1


class _PooledCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.conv(x)).mean(dim=(2, 3)))


def test_x2_with_other_per_example_shapes_takes_the_per_example_pass(passes):
    """The plan's probe saw x1's per-example shapes; x2's images are larger, so x2 is prepared by
    the per-example pass (and x1 by the whole-batch one)."""
    model = _build(_PooledCNN)
    x1, x2 = _normal(4, 2, 5, 5, seed=1), _normal(3, 2, 7, 6, seed=2)
    kernel = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, trace_axes=())(x1, x2)
    assert_kernels_close(kernel, reference_ntk(model, x1, x2, trace_axes=()))
    assert passes.whole_batch_sizes == [4]


def test_parameter_groups_and_verify(passes):
    model = _build(_mlp)
    x1, x2 = _normal(5, 4, seed=1), _normal(4, 4, seed=2)
    grouped = torchntk.empirical_ntk_fn(
        model, vmap_axes=0, implementation=3, trace_axes=(), groups={"first": "0", "rest": "*"}
    )(x1, x2)
    assert_kernels_close(sum(grouped.values()), reference_ntk(model, x1, x2, trace_axes=()))
    first = {name: param for name, param in model.named_parameters() if name.startswith("0.")}
    assert_kernels_close(grouped["first"], reference_ntk(model, x1, x2, params=first, trace_axes=()))
    assert passes.plan.whole_batch is not None
    # verify=True checks the whole-batch pass against autograd on every call
    verified = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, trace_axes=(), verify=True)(x1, x2)
    assert_kernels_close(verified, reference_ntk(model, x1, x2, trace_axes=()))


class _CoupledUnlessAlike(nn.Module):
    """Independent examples while all examples are alike; otherwise each output gains the squared
    distance of its example from the batch mean, which couples the examples."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        spread = (x - x.mean(0, keepdim=True)).pow(2).sum(-1, keepdim=True)
        return self.layer(x) + spread


@pytest.mark.parametrize("forced", [False, True], ids=["as-chosen", "whole-batch-forced"])
def test_the_output_check_of_vmap_axes_still_runs(forced, monkeypatch, passes):
    """With ``check_vmap_axes=True`` a later call's output check is the implementation's (deferred).
    Such a call takes the per-example pass, whose outputs the check compares; were its pass over the
    whole batch (``forced``), which has no per-example outputs, the check would make its own
    per-example forward pass: in neither case is it skipped."""
    if forced:
        side_factors = structured.side_factors
        monkeypatch.setattr(
            structured, "side_factors", lambda *args, whole_batch=True, **kwargs: side_factors(*args, **kwargs)
        )
    model = _build(_CoupledUnlessAlike)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, trace_axes=(), check_vmap_axes=True)
    alike = _normal(1, 4, seed=1).expand(4, 4).contiguous()
    ntk_fn(alike)  # the checks pass, the plan takes the whole-batch pass
    assert passes.plan.whole_batch is not None and passes.whole_batch == 1
    with pytest.raises(ValueError, match="differs between the whole batch and a per-example evaluation"):
        ntk_fn(_normal(4, 4, seed=2))
    assert passes.whole_batch == (2 if forced else 1)


# --------------------------------------------------------------------------------------------
# Reading whole-batch tensors per example
# --------------------------------------------------------------------------------------------


def test_readings_of_whole_batch_tensors():
    examples, steps = 3, 2
    per_example = torch.arange(examples * steps * 4.0).reshape(examples, steps, 4)
    batch_first = per_example.reshape(examples * steps, 4)
    time_major = per_example.transpose(0, 1).reshape(steps * examples, 4)
    assert _side.find_fold(batch_first.shape, (steps, 4), examples) == Fold(0)
    assert torch.equal(_side.examples_first(batch_first, Fold(0), examples), per_example)
    assert torch.equal(_side.examples_first(time_major, Fold(0, inner=True), examples), per_example)
    # a size-1 axis per example, behind a leading axis of G's basis
    gradients = torch.arange(2 * 5 * examples * 1.0).reshape(2, 5, examples)
    read = _side.examples_first(gradients, Fold(1), examples, lead=1)
    assert read.shape == (examples, 2, 5, 1) and torch.equal(read[1, :, :, 0], gradients[:, :, 1])
    # shared by every example, or not readable
    assert _side.find_fold((4, 5), (4, 5), examples) == Fold(None)
    assert _side.examples_first(torch.ones(4, 5), Fold(None), examples).shape == (examples, 4, 5)
    assert _side.find_fold((6, 5), (4, 5), examples) is None
    assert _side.find_fold((3, 3), (1, 1), examples) is None


class FrozenRecurrenceBetween(nn.Module):
    """A dense layer, a frozen ``kind`` recurrence (its fused kernel consumes no differentiated
    parameter) and a weight-normed head: ``(N, T, 3) -> (N, 2)``. ``G`` of the first layer is pulled
    back through the recurrence, and the head's ``_weight_norm`` consumes differentiated parameters
    without a rule (the fallback)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.first = nn.Linear(3, 4)
        self.recurrence = getattr(nn, kind)(4, 5, batch_first=True)
        self.recurrence.requires_grad_(False)
        self.head = nn.utils.parametrizations.weight_norm(nn.Linear(5, 2))

    def forward(self, x: Tensor) -> Tensor:
        states, _ = self.recurrence(torch.tanh(self.first(x)))
        return self.head(states[:, -1])


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_the_recorder_passes_unfuse_the_kernels_themselves(kind, passes, monkeypatch):
    """NOTE: [The recorder unfuses]: the recording passes of implementation 3 (the probe, the
    per-example pass of the plan's check, the whole-batch passes) run under no ``Unfused`` mode;
    their recorder decomposes the fused kernels (also those consuming no differentiated parameter,
    which vmap could not batch), and the kernel stays exact on a first, a second and a later call."""
    from torchntk._model import unfused

    model = _build(FrozenRecurrenceBetween, kind)
    modes_seen: dict[str, int] = {}
    decomposed: dict[str, int] = {}
    kernel = getattr(torch._VF, kind.lower())
    decomposition = unfused.DECOMPOSITIONS[kernel]
    entered = unfused.Unfused.__enter__

    def watched(name: str):
        original = getattr(_side, name)

        def spied(*args, **kwargs):
            decomposed[name] = decomposed.get(name, 0) + 1
            return decomposition(*args, **kwargs)

        def counted(self):
            modes_seen[name] = modes_seen.get(name, 0) + 1
            return entered(self)

        def run(*args, **kwargs):
            monkeypatch.setattr(unfused.Unfused, "__enter__", counted)
            monkeypatch.setitem(unfused.DECOMPOSITIONS, kernel, spied)
            try:
                return original(*args, **kwargs)
            finally:
                monkeypatch.setattr(unfused.Unfused, "__enter__", entered)
                monkeypatch.setitem(unfused.DECOMPOSITIONS, kernel, decomposition)

        return run

    names = ("probe", "per_example_factors", "whole_batch_pass")
    for name in names:
        spy = watched(name)
        for module in (_side, structured, _whole_batch):  # wherever the name is looked up
            if hasattr(module, name):
                monkeypatch.setattr(module, name, spy)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, trace_axes=())
    for seed in range(3):
        x1, x2 = _normal(4, 6, 3, seed=seed), _normal(3, 6, 3, seed=seed + 10)
        assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2, trace_axes=()))
    assert passes.plan.whole_batch is not None, passes.plan.whole_batch_reason
    assert passes.whole_batch >= 3
    assert modes_seen == {}
    assert set(decomposed) == set(names) and decomposed["whole_batch_pass"] >= 3


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_replays_of_the_unfusing_passes_stay_exact(kind, eager_computations):
    """NOTE: [The recorder unfuses] with ``compile=``: the graph captured from the first call's
    passes (with the recorder's decompositions) replays, and its kernels of other inputs and of
    weights written in place are exact."""
    model = _build(FrozenRecurrenceBetween, kind)
    _assert_replays_exact(model, model.first.weight, (4, 6, 3), (4, 6, 3), 3, eager_computations)


@pytest.mark.parametrize("case_id", [case for case in WHOLE_BATCH_CASES if case != "mixed_ruled_unruled"])
def test_the_whole_batch_checks_pass_gives_autograds_products(case_id, monkeypatch):
    """NOTE: [Autograd's products from the whole-batch check]: on a first call the check against
    autograd takes autograd's ``J^T v`` from the whole-batch check's pass (differentiated with
    respect to the parameters too) and makes no pass of its own; those products are autograd's of
    the model on the same examples and cotangents. The kernel is exact on the first, a second and
    a later call. (A plan with fallback parameters settles nothing this way: ``mixed_ruled_unruled``.)"""
    from torch.func import vjp

    made, own = [], []
    whole_batch_pass = _whole_batch.whole_batch_pass
    products = structured.whole_batch_products

    def recorded_pass(side, plan, output_axes, cotangents=None, parameters=False, **options):
        done = whole_batch_pass(side, plan, output_axes, cotangents, parameters, **options)
        # the check drops the products once compared; a pass with guessed axes that the model's
        # shapes refuse makes none (NOTE: [The layout read from the check's own pass])
        if parameters and done is not None:
            made.append((side, cotangents, done.parameter_products))
        return done

    def own_products(side, cotangents):
        own.append(side)
        return products(side, cotangents)

    monkeypatch.setattr(_whole_batch, "whole_batch_pass", recorded_pass)
    monkeypatch.setattr(structured, "whole_batch_products", own_products)
    case = STRUCTURED_CASES[case_id]()
    x1, x2 = make_x1_x2(case)
    ntk_fn = torchntk.empirical_ntk_fn(case.module, vmap_axes=0, implementation=3, trace_axes=())
    expected = reference_ntk(case.module, x1, x2, trace_axes=())
    for _ in range(3):
        assert_kernels_close(ntk_fn(x1, x2), expected)
    assert own == [] and len(made) == 1, (own, made)
    side, cotangents, products = made[0]
    _, pullback = vjp(side.whole_batch(), side.model.params)
    (autograd,) = pullback(tuple(cotangents))
    assert products is not None and len(products) == len(autograd)
    for mine, theirs in zip(products, autograd):
        torch.testing.assert_close(mine, theirs, rtol=1e-10, atol=1e-12)


class _HiddenScale(nn.Module):
    """``scale`` is also applied under DisableTorchFunction, where the recorder cannot see it."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 5)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 5))
        self.head = nn.Linear(5, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear(x) * self.scale
        with torch._C.DisableTorchFunction():
            h = h + self.scale
        return self.head(torch.tanh(h))


@pytest.mark.parametrize("implementation", [3, 0], ids=["SD", "AUTO"])
def test_a_use_hidden_from_the_recorder_shows_in_the_whole_batch_checks_products(implementation, monkeypatch):
    """NOTE: [Autograd's products from the whole-batch check]: the products come from the perturbed
    model, which the recorder runs, yet a use it cannot see still shows in them (autograd
    differentiates every op): the plan check sends ``scale`` to the Jacobian fallback and keeps
    the rest, and the kernel is exact on the first, a second and a later call."""
    monkeypatch.setattr("torchntk._implementations.auto._PROBE_EVERYTHING", True)  # 3 priced on a small model
    made = []
    whole_batch_pass = _whole_batch.whole_batch_pass

    def recorded_pass(side, plan, output_axes, cotangents=None, parameters=False, **options):
        made.append(parameters)
        return whole_batch_pass(side, plan, output_axes, cotangents, parameters, **options)

    monkeypatch.setattr(_whole_batch, "whole_batch_pass", recorded_pass)
    model = _build(_HiddenScale)
    x1, x2 = _normal(5, 4, seed=1), _normal(3, 4, seed=2)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation, trace_axes=())
    expected = reference_ntk(model, x1, x2, trace_axes=())
    for _ in range(3):
        assert_kernels_close(ntk_fn(x1, x2), expected)
    assert True in made, made  # the check's products came from the merged pass
    choice = ntk_fn.auto_choice(x1, x2)  # AUTO may then price 3 out: its pick is not the point
    assert "scale" in choice.fallback_parameters and "linear.weight" not in choice.fallback_parameters, choice


# NOTE: [The whole-batch pass by plain autograd]


def _counted_vjp(monkeypatch) -> list:
    """The ``torch.func.vjp`` calls of ``_side``'s whole-batch pass (its per-example passes call the
    same name, so only calls from ``_whole_batch_vjp`` are counted)."""
    made = []
    original = _side._whole_batch_vjp

    def counted(function, primals, custom_functions):
        vjp = _side.vjp

        def transform(*args, **kwargs):
            made.append(True)
            return vjp(*args, **kwargs)

        monkeypatch.setattr(_side, "vjp", transform)
        try:
            return original(function, primals, custom_functions)
        finally:
            monkeypatch.setattr(_side, "vjp", vjp)

    monkeypatch.setattr(_side, "_whole_batch_vjp", counted)
    return made


@pytest.mark.parametrize("context", ["grad", "no_grad", "inference_mode"])
def test_the_whole_batch_pass_runs_on_plain_autograd(context, passes, monkeypatch):
    """Outside any ``torch.func`` transform the whole-batch pass records no grad level of its own
    (plain autograd and ``vmap`` over its pullback), under the caller's ``no_grad`` too; inference
    mode, which records no graph, keeps ``torch.func.vjp``. Exact on the first, a second and a
    later call, with the weights written in place in between."""
    made = _counted_vjp(monkeypatch)
    model = _build(lambda: nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 3)))
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, trace_axes=())
    contexts = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}
    for seed in range(3):
        x1, x2 = _normal(5, 4, seed=seed), _normal(3, 4, seed=seed + 10)
        with contexts[context]():
            kernel = ntk_fn(x1, x2)
        assert_kernels_close(kernel.clone(), reference_ntk(model, x1, x2, trace_axes=()))
        with torch.no_grad():
            model[0].weight.mul_(1.1)
    assert passes.plan.whole_batch is not None and passes.whole_batch >= 3
    assert bool(made) == (context == "inference_mode")  # inference mode records no graph: torch.func.vjp


def test_a_custom_function_keeps_the_transform_of_the_probe(passes, monkeypatch):
    """A custom ``torch.autograd.Function`` reaches the recorder as one call only under a transform:
    where the probe met one, the whole-batch pass runs under ``torch.func.vjp`` as the probe did
    (plain autograd would show its forward's ops to the recorder and lose the whole batch), and
    the kernel follows the Function's own backward on every call."""
    made = _counted_vjp(monkeypatch)
    model = _build(_CustomFunction)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, trace_axes=())
    for seed in range(3):
        x1, x2 = _normal(5, 4, seed=seed), _normal(3, 4, seed=seed + 10)
        assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2, trace_axes=()))
    assert passes.plan.custom_functions and passes.plan.whole_batch is not None, passes.plan.whole_batch_reason
    assert passes.whole_batch >= 3 and made
    plain = _build(lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)))
    torchntk.empirical_ntk_fn(plain, vmap_axes=0, implementation=3)(x1, x2)
    assert not passes.plan.custom_functions


class _InputOnlyLeaf(nn.Module):
    """Two output leaves, one computed from the inputs alone: no delta reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> dict:
        return {"features": torch.tanh(self.linear(x)), "scaled": 2.0 * x[:, :2]}


class _UnusedLayer(nn.Module):
    """A layer whose output never reaches the outputs: no output depends on any delta."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        self.linear(x)
        return torch.tanh(x[:, :3])


@pytest.mark.parametrize("model_type", [_InputOnlyLeaf, _UnusedLayer], ids=["input-only leaf", "unused layer"])
def test_outputs_no_delta_reaches_keep_the_whole_batch_pass(model_type, passes):
    """Plain autograd has no graph for an output no perturbed operation reaches (its share of
    ``G`` is zero): the pass leaves it out instead of failing, keeps the whole batch, and the
    kernel is exact on every call."""
    model = _build(model_type)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, trace_axes=())
    for seed in range(3):
        x1, x2 = _normal(5, 4, seed=seed), _normal(3, 4, seed=seed + 10)
        kernels, expected = ntk_fn(x1, x2), reference_ntk(model, x1, x2, trace_axes=())
        assert len(pytree.tree_leaves(kernels)) == len(pytree.tree_leaves(expected))
        for kernel, reference in zip(pytree.tree_leaves(kernels), pytree.tree_leaves(expected)):
            assert_kernels_close(kernel, reference)
    assert passes.plan.whole_batch is not None, passes.plan.whole_batch_reason
    assert passes.whole_batch >= 3
