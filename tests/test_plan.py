"""The planning stage (NOTE: [The planning stage] in ``torchntk/_plan/plan.py``).

A warm call binds its tensors to the template its key's plan keeps, instead of validating the call
again. What makes that safe is the key (NOTE: [Plan keys]): anything a decision reads must change
the key or send the call back to a full preparation. Each test below changes one such thing between
calls and checks the kernel against the float64 reference, or the error the change must give.
"""

from __future__ import annotations

import gc
import weakref
from unittest import mock

import pytest
import torch
from torch import nn

import torchntk
from torchntk import _implementations as implementations
from torchntk._call import kernel_call
from torchntk._plan import Purpose
from torchntk.testing import assert_kernels_close, reference_ntk

F64 = torch.float64
IMPLEMENTATIONS = pytest.mark.parametrize("implementation", [1, 2, 3, 0], ids=["JC", "NVP", "SD", "AUTO"])


def _mlp(width: int = 6) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3)).to(F64).eval()


def _inputs(*sizes: int, seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(size, 4, generator=generator, dtype=F64) for size in sizes]


class _PreparedInFull:
    """Counts the calls that :func:`prepare_call` validates in full (the others are bound)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.count = 0
        original = kernel_call.prepare_call

        def counted(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr("torchntk._kernel.preparation.prepare_call", counted)


@IMPLEMENTATIONS
@pytest.mark.parametrize("x2_given", [True, False], ids=["x2", "x2-None"])
def test_warm_calls_are_bound_and_exact(implementation, x2_given, monkeypatch):
    """The first call is prepared in full; later calls with the key are bound to its template, with
    other values, and stay exact."""
    prepared = _PreparedInFull(monkeypatch)
    model = _mlp()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, trace_axes=(), implementation=implementation)
    for seed in range(4):
        x1, x2 = _inputs(5, 3, seed=seed)
        x2 = x2 if x2_given else None
        assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2, trace_axes=()))
    assert prepared.count == 1


def test_a_new_key_is_planned_again(monkeypatch):
    """New shapes, a changed module structure or new train/eval modes are new keys."""
    prepared = _PreparedInFull(monkeypatch)
    model = _mlp()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
    x1, x2 = _inputs(5, 3)
    ntk_fn(x1, x2)
    ntk_fn(x1, x2)
    assert prepared.count == 1
    longer = torch.cat([x1, x1[:2]])
    assert_kernels_close(ntk_fn(longer, x2), reference_ntk(model, longer, x2))
    assert prepared.count == 2
    model[0].scale = 2.0  # an attribute: the structure fingerprint changes
    assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))
    assert prepared.count == 3
    model.train()  # nothing couples the examples here, but the decision is made again
    assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))
    assert prepared.count == 4


def test_training_mode_after_warm_calls_is_refused():
    """Batch statistics couple the examples: a warm plan made in eval mode must not serve a call
    after ``model.train()``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).to(F64).eval()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
    x1, x2 = _inputs(5, 3)
    ntk_fn(x1, x2)
    ntk_fn(x1, x2)
    model.train()
    with pytest.raises(ValueError, match="batch statistics"):
        ntk_fn(x1, x2)


@IMPLEMENTATIONS
def test_frozen_parameters_after_warm_calls(implementation, monkeypatch):
    """``requires_grad`` flags are not part of the key: the bound call sees that the differentiated
    parameters changed and is prepared in full, with the kernel of the parameters left."""
    prepared = _PreparedInFull(monkeypatch)
    model = _mlp()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)
    x1, x2 = _inputs(5, 3)
    ntk_fn(x1, x2)
    ntk_fn(x1, x2)
    model[0].weight.requires_grad_(False)
    try:
        assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))
        assert prepared.count == 2
    finally:
        model[0].weight.requires_grad_(True)


def test_a_plan_holds_no_tensor_of_its_calls():
    """A kept template has stand-ins for the outputs and no inputs or private copies: the inputs
    of the call that made it can be freed."""
    model = _mlp()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
    x1, x2 = _inputs(5, 3)
    ntk_fn(x1, x2)
    ntk_fn(x1, x2)
    watched = [weakref.ref(x1), weakref.ref(x2)]
    del x1, x2
    gc.collect()
    assert all(reference() is None for reference in watched)


def test_the_default_checks_once_per_key():
    """``check_vmap_axes="first"`` (the default): coupling that the first call with a key shows is
    an error; a warm call with that key runs no check (``True`` checks every call)."""
    torch.manual_seed(0)

    class CoupledWhenLarge(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x):
            hidden = self.linear(x)
            large = (x.abs().amax() > 10).to(hidden.dtype)
            return hidden - large * hidden.mean(0, keepdim=True)

    model = CoupledWhenLarge().to(F64).eval()
    x1, x2 = _inputs(5, 3)
    large = x1.clone()
    large[2, 1] = 50.0
    with pytest.raises(ValueError, match="differs between the whole batch and a per-example evaluation"):
        torchntk.empirical_ntk_fn(model, vmap_axes=0)(large, x2)
    every_call = torchntk.empirical_ntk_fn(model, vmap_axes=0, check_vmap_axes=True)
    every_call(x1, x2)
    with pytest.raises(ValueError, match="differs between the whole batch and a per-example evaluation"):
        every_call(large, x2)


def test_an_example_loop_is_a_fact_of_the_key(monkeypatch):
    """A model vmap cannot evaluate switches its key to the example loop once; warm calls then loop
    without trying vmap again."""
    torch.manual_seed(0)

    class CheckedPadding(nn.Module):
        """Independent examples behind a check that reads a tensor's value, which vmap refuses."""

        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 3)

        def forward(self, x):
            if not bool((x.abs().sum(-1) > 0).all()):
                raise ValueError("all padding")
            return torch.tanh(self.linear(x))

    model = CheckedPadding().to(F64).eval()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
    x1, x2 = _inputs(5, 3)
    with pytest.warns(torchntk.ExampleLoopWarning):
        ntk_fn(x1, x2)
    prepared = _PreparedInFull(monkeypatch)
    for seed in range(3):
        x1, x2 = _inputs(5, 3, seed=seed)
        assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))
    assert prepared.count <= 1  # the plan with the loop, then its template


def test_purposes_do_not_share_plans():
    """The NTK alone stands in for the outputs; a call that needs their values (the NNGP) runs the
    forward pass whatever the NTK's plan says."""
    model = _mlp()
    kernel_fn = torchntk.empirical_kernel_fn(model, vmap_axes=0)
    x1, x2 = _inputs(5, 3)
    for _ in range(3):
        kernels = kernel_fn(x1, x2, ("ntk", "nngp"))
    assert_kernels_close(kernels.ntk, reference_ntk(model, x1, x2))
    with torch.no_grad():
        nngp = model(x1) @ model(x2).T / 3
    assert_kernels_close(kernels.nngp, nngp)
    assert Purpose(needs_outputs=True) != Purpose(needs_outputs=False)


def test_a_caller_asks_the_plan_whether_the_call_fits_whole(monkeypatch):
    """NOTE: [Budgets of callers]: ``spec.within(CallerPlan(budget, chunking=False))`` computes the
    kernel where its memory plan needs no blocks, else returns ``NEEDS_BLOCKS`` having computed
    nothing; with ``chunking=True`` it cuts the call into blocks to fit the caller's budget."""
    from torchntk._memory import NEEDS_BLOCKS, CallerPlan

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 256), nn.Tanh(), nn.Linear(256, 3)).to(F64).eval()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1)
    x1, x2 = _inputs(32, 32)
    expected = reference_ntk(model, x1, x2)
    within = ntk_fn.spec.within
    assert_kernels_close(within(CallerPlan(1e12, chunking=False))(x1, x2), expected)
    computed = []
    original = implementations._Stateless.kernels

    def counted(self, call, scope):
        computed.append(call.chunk_size)
        return original(self, call, scope)

    monkeypatch.setattr(implementations._Stateless, "kernels", counted)
    assert within(CallerPlan(1e6, chunking=False))(x1, x2) is NEEDS_BLOCKS
    assert computed == []
    with pytest.warns(torchntk.MemoryPlanWarning):
        assert_kernels_close(within(CallerPlan(1e6))(x1, x2), expected)
    assert computed and computed[-1] is not None and computed[-1] < 32
    assert_kernels_close(ntk_fn(x1, x2), expected)  # the kernel function itself plans its own budget
    assert computed[-1] is None


class _Walks:
    """Counts the walks of a module tree that start at its root (``named_modules`` from the top)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: nn.Module):
        self.count = 0
        original = nn.Module.named_modules

        def counted(module, memo=None, prefix="", remove_duplicate=True):
            if module is root and memo is None and prefix == "":
                self.count += 1
            return original(module, memo, prefix, remove_duplicate)

        monkeypatch.setattr(nn.Module, "named_modules", counted)


@IMPLEMENTATIONS
def test_a_warm_call_walks_the_module_once_and_reads_its_tensors_anew(implementation, monkeypatch):
    """NOTE: [Module surveys]: a warm call walks the module tree at most once (its structure
    fingerprint, with the train/eval modes; none at all where the key's last walk finds nothing
    changed, NOTE: [Unchanged modules]), takes the rest from its key's survey, and reads the tensors
    from the module on every call: values written in place and a replaced parameter give their
    kernels."""
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(4, 3)).to(F64).eval()  # tied
    ntk_fn = torchntk.empirical_ntk_fn(model, implementation=implementation)
    x1, x2 = _inputs(5, 3)
    ntk_fn(x1, x2)
    ntk_fn(x1, x2)
    walks = _Walks(monkeypatch, model)
    for step in range(3):
        with torch.no_grad():
            shared.weight.mul_(1.1)  # in place: the same key
            model[4].bias.add_(0.5)
        assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))
        assert walks.count == 0  # the fingerprint compares the last walk's submodules instead
    model[4].weight = nn.Parameter(torch.randn(3, 4, dtype=F64))  # a new tensor: a new key
    assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))
    assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))


def test_two_names_of_one_tied_parameter_are_refused():
    """Every name of a tied parameter gets the value given for it; two names of it in ``params``
    would be two values for one tensor."""
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared).to(F64).eval()
    x1, x2 = _inputs(5, 3)
    given = {"0.weight": shared.weight.detach().clone()}
    expected = reference_ntk(model, x1, x2, params={"0.weight": shared.weight})
    ntk_fn = torchntk.empirical_ntk_fn(model)
    assert_kernels_close(ntk_fn(x1, x2, given), expected)
    both = {"0.weight": shared.weight.detach().clone(), "2.weight": shared.weight.detach().clone()}
    with pytest.raises(ValueError, match=r"`params` names '0\.weight' and '2\.weight', which are one tied"):
        ntk_fn(x1, x2, both)


def test_a_plan_keeps_no_replaced_submodule_alive():
    """NOTE: [Module surveys]: the survey a template keeps holds the submodules weakly; a head the
    user replaced (a new key) is freed, and the new head's kernel is exact on its first and later
    calls."""
    model = _mlp()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
    x1, x2 = _inputs(5, 3)
    ntk_fn(x1, x2)
    ntk_fn(x1, x2)
    replaced = weakref.ref(model[2])
    torch.manual_seed(3)
    model[2] = nn.Linear(6, 3).to(F64)
    gc.collect()
    assert replaced() is None
    for _ in range(3):
        assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))


def test_replays_of_a_tied_module_read_its_tensors_anew(eager_computations):
    """NOTE: [Module surveys] with ``compile=``: a tied module's captured graph replays exact
    kernels after its weights are written in place, and a replaced parameter (a new key) is
    computed anew."""
    import warnings

    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.Tanh(), shared, nn.Tanh(), nn.Linear(4, 3)).to(F64).eval()
    ntk_fn = torchntk.empirical_ntk_fn(model, implementation=3, compile="eager")
    x1, x2 = _inputs(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a capture refused or a replay failed
        for _ in range(3):
            with torch.no_grad():
                shared.weight.mul_(1.1)
            assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))
    assert len(eager_computations) == 2  # the first call's eager computation and its trace; the others replayed
    model[4].weight = nn.Parameter(torch.randn(3, 4, dtype=F64))
    assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))
    assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))


@IMPLEMENTATIONS
def test_a_key_keeps_what_its_implementations_derived_in_its_record(implementation, monkeypatch):
    """NOTE: [One record per key]: the implementations hold no state; what they derive (3's plan,
    AUTO's choice, the counted pass) is kept in the key's one record, so a module whose structure
    changed (the same parameters, another activation: another key) is planned anew, and a key's
    first call alone plans."""
    from torchntk._implementations import auto as auto_module
    from torchntk._implementations import structured as structured_module

    model = _mlp(width=16)
    (x,) = _inputs(5)
    ntk_fn = torchntk.empirical_ntk_fn(model, implementation=implementation)
    choices, plans = [], []
    choose, plan_for = auto_module.choose, structured_module.plan_for
    monkeypatch.setattr(auto_module, "choose", lambda *args, **kwargs: choices.append(1) or choose(*args, **kwargs))
    monkeypatch.setattr(
        structured_module, "plan_for", lambda *args, **kwargs: plans.append(1) or plan_for(*args, **kwargs)
    )
    for _ in range(3):
        assert_kernels_close(ntk_fn(x), reference_ntk(model, x))
    planned = (len(choices), len(plans))
    assert planned == ((1, int(plans != [])) if implementation == 0 else (0, int(implementation == 3)))
    model[1] = nn.ReLU()  # the parameters unchanged: only the structure fingerprint tells
    for _ in range(3):
        assert_kernels_close(ntk_fn(x), reference_ntk(model, x))
    assert (len(choices), len(plans)) == (2 * planned[0], 2 * planned[1])

    records = list(ntk_fn._settings.planner._records._entries.values())
    assert len(records) == 2
    for record in records:
        kinds = {entry[0] for entry in record.derived._entries}
        assert ("structured plan" in kinds) == (implementation == 3 or (implementation == 0 and plans != []))
        assert ("auto choice" in kinds) == (implementation == 0)
        assert record.facts.derivatives_checked
    table = ntk_fn._settings.table
    assert set(table) == {1, 2, 3}  # AUTO is a policy over the table, not one of its entries
    for entry in table.values():  # nothing of a call kept outside the records
        assert all(not hasattr(value, "_entries") for value in vars(entry).values())


# NOTE: [Plans shared by kernel functions]: a kernel function built again plans nothing again.


@IMPLEMENTATIONS
@pytest.mark.parametrize("x2_given", [True, False], ids=["x2", "x2-None"])
def test_a_kernel_function_built_again_shares_the_plans_of_the_first(implementation, x2_given, monkeypatch):
    """A second kernel function of the model with the same options binds its first call to the plan
    the first one made (no preparation in full), with other inputs and weights changed in place in
    between, and stays exact on its first, second and later calls."""
    prepared = _PreparedInFull(monkeypatch)
    model = _mlp()

    def build():
        return torchntk.empirical_ntk_fn(model, vmap_axes="auto", trace_axes=(), implementation=implementation)

    x1, x2 = _inputs(5, 3)
    first = build()
    assert_kernels_close(first(x1, x2 if x2_given else None), reference_ntk(model, x1, x2 if x2_given else x1, trace_axes=()))
    assert prepared.count == 1
    del first
    with torch.no_grad():
        model[0].weight.mul_(1.5)
    again = build()
    for seed in range(2, 5):  # its first, second and a later call
        x1, x2 = _inputs(5, 3, seed=seed)
        x2 = x2 if x2_given else None
        assert_kernels_close(again(x1, x2), reference_ntk(model, x1, x2, trace_axes=()))
    assert prepared.count == 1


class _Head(nn.Module):
    def forward(self, out: torch.Tensor) -> torch.Tensor:
        return out[:, :2]


def test_kernel_functions_of_other_options_models_or_builders_plan_anew(monkeypatch):
    """Options compare by value where plain and by identity otherwise: another ``trace_axes``, a
    new ``output_fn`` object (the same code), a copy of the model or the other builder plan their
    first call in full; the same ``output_fn`` object shares."""
    prepared = _PreparedInFull(monkeypatch)
    model = _mlp()
    x1, x2 = _inputs(5, 3)
    torchntk.empirical_ntk_fn(model, vmap_axes=0)(x1, x2)
    assert prepared.count == 1
    torchntk.empirical_ntk_fn(model, vmap_axes=0, trace_axes=())(x1, x2)
    assert prepared.count == 2
    torchntk.empirical_ntk_fn(model, vmap_axes=0)(x1, x2)  # the same options as the first: shared
    assert prepared.count == 2

    def head(out):
        return out[:, :2]

    def same_code(out):
        return out[:, :2]

    for output_fn, count in ((head, 3), (head, 3), (same_code, 4)):
        kernel = torchntk.empirical_ntk_fn(model, vmap_axes=0, output_fn=output_fn)(x1, x2)
        assert_kernels_close(kernel, reference_ntk(nn.Sequential(model, _Head()), x1, x2))
        assert prepared.count == count
    copy = _mlp()
    assert_kernels_close(torchntk.empirical_ntk_fn(copy, vmap_axes=0)(x1, x2), reference_ntk(copy, x1, x2))
    assert prepared.count == 5
    kernels = torchntk.empirical_kernel_fn(model, vmap_axes=0)(x1, x2, get="ntk")
    assert_kernels_close(kernels, reference_ntk(model, x1, x2))
    assert prepared.count == 6


def test_options_written_otherwise_with_one_meaning_share_plans(monkeypatch):
    """``implementation`` as an int or a member, the axes as an int, a list or a tuple: the
    builder parses them to one value, and kernel functions built with any of them share."""
    prepared = _PreparedInFull(monkeypatch)
    model = _mlp()
    x1, x2 = _inputs(5, 3)
    spellings = (
        {}, {"implementation": 0}, {"implementation": torchntk.NtkImplementation.AUTO},
        {"trace_axes": [-1]}, {"trace_axes": -1, "diagonal_axes": []},
    )
    for options in spellings:
        kernel = torchntk.empirical_ntk_fn(model, vmap_axes=0, **options)(x1, x2)
        assert_kernels_close(kernel, reference_ntk(model, x1, x2))
    assert prepared.count == 1
    for options in ({"implementation": 3}, {"implementation": torchntk.NtkImplementation.STRUCTURED_DERIVATIVES}):
        assert_kernels_close(torchntk.empirical_ntk_fn(model, vmap_axes=0, **options)(x1, x2), reference_ntk(model, x1, x2))
    assert prepared.count == 2


def test_a_kernel_function_built_again_keeps_every_guarantee_of_a_warm_call(monkeypatch):
    """The NaN explanation on the rebuilt function's first call, the output check on every call with
    ``check_vmap_axes=True``, and a new key (a hook registered between the builds) planned in full."""
    prepared = _PreparedInFull(monkeypatch)
    model = _mlp()
    x1, x2 = _inputs(5, 3)
    torchntk.empirical_ntk_fn(model, vmap_axes=0)(x1, x2)
    bad = x1.clone()
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"output leaf 0 for x1 holds 3 NaN"):
        torchntk.empirical_ntk_fn(model, vmap_axes=0)(bad, x2)
    assert prepared.count == 1  # bound to the first one's plan, and explained all the same

    checked = torchntk.empirical_ntk_fn(model, vmap_axes=0, check_vmap_axes=True)
    checked(x1, x2)
    ran = []
    check = torchntk._call.vmap_check.VmapAxesCheck

    def spied(name):
        original = getattr(check, name)
        return mock.patch.object(check, name, lambda self, *args, **kwargs: ran.append(name) or original(self, *args, **kwargs))

    with spied("_compare_outputs"), spied("derivatives"):  # (mock.patch: the conftest's monkeypatch would unshare)
        again = torchntk.empirical_ntk_fn(model, vmap_axes=0, check_vmap_axes=True)
        assert_kernels_close(again(x1, x2), reference_ntk(model, x1, x2))
    # the output check of check_vmap_axes=True on the rebuilt function's first call; the derivative
    # check, once per key, ran on the first function's
    assert "_compare_outputs" in ran and "derivatives" not in ran

    count = prepared.count
    model[2].register_forward_hook(lambda module, args, out: out * 2.0)
    assert_kernels_close(torchntk.empirical_ntk_fn(model, vmap_axes=0)(x1, x2), reference_ntk(model, x1, x2))
    assert prepared.count == count + 1


def test_shared_plans_keep_no_model_and_no_option_alive():
    """The registry holds the model and identity-compared options weakly: both are freed with the
    kernel functions, a planner whose option object is gone is dropped, and a freed option's
    address, reused, matches nothing."""
    from torchntk._plan import shared

    model = _mlp()
    x1, x2 = _inputs(5, 3)

    def head(out):
        return out[:, :2]

    torchntk.empirical_ntk_fn(model, vmap_axes=0, output_fn=head)(x1, x2)
    torchntk.empirical_ntk_fn(model, vmap_axes=0)(x1, x2)
    watched = (weakref.ref(model), weakref.ref(head))
    identity = id(model)
    assert len(shared._MODELS[identity][1]) == 2
    for _ in range(3):  # an output_fn written anew for each kernel function, as in a training loop
        torchntk.empirical_ntk_fn(model, vmap_axes=0, output_fn=lambda out: out[:, :2])(x1, x2)
    gc.collect()
    torchntk.empirical_ntk_fn(model, vmap_axes=0)(x1, x2)  # builds drop the planners of options gone
    assert len(shared._MODELS[identity][1]) == 2  # the default options' and head's
    del model, head
    gc.collect()
    assert all(reference() is None for reference in watched)
    assert identity not in shared._MODELS


def test_options_that_would_hold_their_objects_and_captured_kernels_are_not_shared(monkeypatch):
    """An option that takes no weak reference (a tuple subclass) would have to be held, and may hold
    the model: its kernel functions plan alone, like captured ones (``compile=``), which keep
    their planner beside their graphs."""
    from torchntk._plan import Planner, shared
    from torchntk._plan.shared import shared_planner

    model = _mlp()

    class Pair(tuple):
        pass

    held = ("empirical_ntk_fn", (("groups", Pair((model,))),))
    made = [shared_planner(model, held, lambda: Planner(False, True)) for _ in range(2)]
    assert made[0] is not made[1]
    plain = ("empirical_ntk_fn", (("trace_axes", (0, 1)),))
    assert shared_planner(model, plain, lambda: Planner(False, True)) is shared_planner(model, plain, lambda: 1 / 0)
    sized = [("empirical_ntk_fn", (("chunk_size", size),)) for size in range(1, 12)]
    last = [shared_planner(model, options, lambda: Planner(False, True)) for options in sized][-1]
    assert len(shared._MODELS[id(model)][1]) == shared._OPTION_SETS  # the least recently built dropped
    assert shared_planner(model, sized[-1], lambda: 1 / 0) is last

    prepared = _PreparedInFull(monkeypatch)
    x1, x2 = _inputs(5, 3)
    counts = []
    for _ in range(2):
        captured = torchntk.empirical_ntk_fn(model, vmap_axes=0, compile="eager")
        assert_kernels_close(captured(x1, x2), reference_ntk(model, x1, x2))
        counts.append(prepared.count)
    assert counts[0] > 0 and counts[1] == 2 * counts[0]  # the second prepares all that the first did


@pytest.mark.parametrize("implementation", [0, 3], ids=["AUTO", "SD"])
def test_facts_learnt_again_leave_the_plans_in_place(implementation, monkeypatch):
    """``auto_choice`` prepares its own call, which learns what the first call learnt; the kernel
    calls after it stay bound, and a second ``auto_choice`` is bound too."""
    prepared = _PreparedInFull(monkeypatch)
    model = _mlp()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)
    x1, x2 = _inputs(5, 3)
    ntk_fn(x1, x2)
    choice = ntk_fn.auto_choice(x1, x2)
    assert prepared.count == 2
    for seed in range(2, 5):
        x1, x2 = _inputs(5, 3, seed=seed)
        assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))
        assert ntk_fn.auto_choice(x1, x2).implementation == choice.implementation
    assert prepared.count == 2


@pytest.mark.parametrize("implementation", [1, 3], ids=["JC", "SD"])
def test_kernel_functions_built_in_threads_share_one_planner_and_stay_exact(implementation):
    """Threads building kernel functions of one model at once get one planner (made under a lock)
    and exact kernels on their first and later calls."""
    import concurrent.futures

    model = _mlp()
    inputs = [_inputs(5, 3, seed=seed) for seed in range(4)]
    expected = [reference_ntk(model, x1, x2) for x1, x2 in inputs]

    def build_and_call(index: int):
        ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)
        kernels = [ntk_fn(*inputs[(index + step) % 4]) for step in range(3)]
        return ntk_fn._settings.planner, kernels

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(build_and_call, range(4)))
    assert len({id(planner) for planner, _ in results}) == 1
    for index, (_, kernels) in enumerate(results):
        for step, kernel in enumerate(kernels):
            assert_kernels_close(kernel, expected[(index + step) % 4])


class _Configured(nn.Module):
    """Its output follows fields of an object it holds (as Hugging Face models follow their
    config), which a plan key sees by identity only: changed in place, the key stays the same."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 3).to(F64)
        self.config = type("Config", (), {})()
        self.config.wide = False
        self.config.extra = False

    def forward(self, x: torch.Tensor):
        y = torch.tanh(self.layer(x))
        y = torch.cat([y, 2.0 * y], -1) if self.config.wide else y
        return (y, y[..., :1] ** 2) if self.config.extra else y


@IMPLEMENTATIONS
@pytest.mark.parametrize("x2_given", [True, False], ids=["x2", "x2-None"])
def test_outputs_that_outgrow_their_plan_are_planned_anew(implementation, x2_given, monkeypatch):
    """NOTE: [Outputs that outgrow their plan]: a field changed in place widens the output or adds
    one; the next call (warm by its key) is prepared in full again and exact, and so are the later
    ones, in this kernel function and in one built again (which shares its plans)."""
    prepared = _PreparedInFull(monkeypatch)
    model = _Configured()
    ntk_fn = torchntk.empirical_ntk_fn(model, implementation=implementation)  # vmap_axes found: the default
    x1, x2 = _inputs(5, 3)
    x2 = x2 if x2_given else None
    for _ in range(2):
        assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))
    assert prepared.count == 1
    for count, (wide, extra) in enumerate([(True, False), (True, True), (False, False)], start=2):
        model.config.wide, model.config.extra = wide, extra
        for kernel_fn in (ntk_fn, ntk_fn, torchntk.empirical_ntk_fn(model, implementation=implementation)):
            assert_kernels_close(kernel_fn(x1, x2), reference_ntk(model, x1, x2))
        assert prepared.count == count


def test_batch_reports_outputs_that_outgrew_their_plan(monkeypatch):
    """``batch``'s spans raise the clear error instead of a wrong kernel, and the call after it is
    planned anew and exact."""
    model = _Configured()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1)
    x1, x2 = _inputs(5, 3)
    batched = torchntk.batch(ntk_fn, 2)
    assert_kernels_close(batched(x1, x2), reference_ntk(model, x1, x2))
    assert_kernels_close(batched(x1, x2), reference_ntk(model, x1, x2))
    model.config.wide = True
    with pytest.raises(ValueError, match=r"output leaf 0 now has shape \(6,\) per example .* where the plan has \(3,\)"):
        batched(x1, x2)
    assert_kernels_close(batched(x1, x2), reference_ntk(model, x1, x2))
