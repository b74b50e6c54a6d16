"""``torchntk.batch``: blocks of examples on one or several devices equal the unbatched kernel.

The models and inputs live on the run device (``pytest --device``); ``devices=["cpu"] * k`` are CPU
workers whatever it is, and a run on another device adds workers there.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

import torchntk
from tests.cases import CASES, DEVICE, make_x1_x2, to_device
from torchntk._plan.shared import forget_shared_planners
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_ntk

SIZES = [(1, 5), (5, 8), (8, 1), (13, 13)]
BATCH_SIZES = [1, 2, 3, 4, 16]
LAYOUTS = [((-1,), ()), ((), ()), ((), (0,)), ((0,), ()), ((), (1,))]


@functools.lru_cache(maxsize=None)
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double().to(DEVICE).eval()


@functools.lru_cache(maxsize=None)
def _inputs(n1: int, n2: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(n1 * 100 + n2)
    return to_device((torch.randn(n1, 3, generator=generator, dtype=torch.float64),
                      torch.randn(n2, 3, generator=generator, dtype=torch.float64)))


# CPU workers, and on a run on another device (``--device``) workers there too.
WORKERS = [["cpu"], ["cpu"] * 3] + ([[str(DEVICE)], [str(DEVICE)] * 3] if DEVICE.type != "cpu" else [])
WORKER_IDS = ["1cpu", "3cpu"] + ([f"1{DEVICE.type}", f"3{DEVICE.type}"] if DEVICE.type != "cpu" else [])


# How batch computes: prepared spans with the default cache; spans of one block and no cache
# (cache_bytes=0); a 12 KB cache, so spans hold a few examples and only some stay cached (this
# model's prepared data: ~2.2 KB per example for implementation 1, ~0.5 KB for 3); and
# a kernel function without vmap_axes, called once per block.
MODES = ["spans", "no-cache", "tight-cache", "per-block"]
_CACHE_BYTES = {"spans": torchntk.batching.DEFAULT_CACHE_BYTES, "no-cache": 0, "tight-cache": 12_000, "per-block": 0}


def _check(n1, n2, layout, implementation, same, batch_size, devices, store_on_device, mode):
    trace_axes, diagonal_axes = layout
    if (0 in trace_axes or 0 in diagonal_axes) and not same and n1 != n2:
        return
    x1, x2 = _inputs(n1, n2)
    x2 = None if same else x2
    vmap_axes = None if mode == "per-block" else 0
    kernel_fn = torchntk.empirical_kernel_fn(_model(), trace_axes, diagonal_axes, vmap_axes, implementation=implementation)
    expected = kernel_fn(x1, x2, ("ntk", "nngp"))
    batched = torchntk.batch(
        kernel_fn, batch_size, devices=devices, store_on_device=store_on_device, cache_bytes=_CACHE_BYTES[mode]
    )
    snapshot = ModuleSnapshot.of(_model())
    actual = batched(x1, x2, ("ntk", "nngp"))
    snapshot.assert_unchanged()
    assert type(actual) is type(expected)
    for got, want in zip(actual, expected):
        assert got.device.type == (torch.device(devices[0]).type if store_on_device else "cpu")
        assert_kernels_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("store_on_device", [True, False], ids=["on-device", "host"])
@pytest.mark.parametrize("devices", WORKERS, ids=WORKER_IDS)
@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("n1, n2", SIZES)
def test_batched_equals_unbatched(n1, n2, batch_size, devices, store_on_device):
    """Every size and batch size; layouts, implementations, modes and x2 rotate so the fast run stays short."""
    index = SIZES.index((n1, n2)) + BATCH_SIZES.index(batch_size)
    for same in (False, True):
        layout = LAYOUTS[(index + same) % len(LAYOUTS)]
        implementation = 1 + (index + store_on_device) % 3
        for mode in MODES:
            _check(n1, n2, layout, implementation, same, batch_size, devices, store_on_device, mode)


@pytest.mark.slow
@pytest.mark.parametrize("n1, n2", SIZES)  # one test per size, so that pytest-xdist's workers share the grid
def test_batched_equals_unbatched_full_grid(n1, n2):
    combinations = itertools.product(LAYOUTS, (1, 2, 3), (False, True), BATCH_SIZES, WORKERS, (True, False))
    for index, (layout, implementation, same, batch_size, devices, store_on_device) in enumerate(combinations):
        # Shifted every 4 so that the innermost (devices, store_on_device) pairs meet every mode.
        mode = MODES[(index + index // 4) % len(MODES)]
        _check(n1, n2, layout, implementation, same, batch_size, devices, store_on_device, mode)


def test_spans_prepare_each_example_once_and_reuse_cached_x2_spans(monkeypatch):
    """With room for everything, x1 and x2 are each prepared once (after a probe of one example,
    which measures the bytes per example); with no cache, x1 runs are prepared once per row and
    x2 runs once per block; a tight cache lies in between."""
    x1, x2 = _inputs(13, 8)
    ntk_fn = torchntk.empirical_ntk_fn(_model(), vmap_axes=0, implementation=3)
    prepared = []
    original = torchntk._kernel.block_source.BlockSource.prepare

    def counting(self, side, run):
        prepared.append((side, run))
        return original(self, side, run)

    monkeypatch.setattr(torchntk._kernel.block_source.BlockSource, "prepare", counting)
    counts = {}
    for cache in (2**30, 6_000, 0):
        prepared.clear()
        assert_kernels_close(torchntk.batch(ntk_fn, 2, cache_bytes=cache)(x1, x2), ntk_fn(x1, x2), rtol=1e-10, atol=1e-12)
        counts[cache] = sum(run[1] for _, run in prepared)
    assert counts[2**30] == 1 + 13 + 8  # the probe, then each side once
    assert counts[0] == 1 + 13 + 7 * 8  # the probe, then 7 rows of all of x2
    assert counts[2**30] < counts[6_000] < counts[0]  # ~0.5 KB per example: spans of 4, one cached


def _prepared_runs(monkeypatch) -> list:
    """The ``(start, length)`` of every span ``batch`` prepares from now on, in order."""
    prepared = []
    original = torchntk._kernel.block_source.BlockSource.prepare

    def counting(self, side, run):
        prepared.append(run)
        return original(self, side, run)

    monkeypatch.setattr(torchntk._kernel.block_source.BlockSource, "prepare", counting)
    return prepared


def test_a_span_longer_than_the_batch_size_prepares_its_examples_once(monkeypatch):
    """The bytes-per-example probe is one example, kept when x1 is a single unit: spans of several
    units no longer prepare their first unit twice (a unit of a base-size transformer's examples
    takes seconds)."""
    x1, _ = _inputs(13, 8)
    ntk_fn = torchntk.empirical_ntk_fn(_model(), vmap_axes=0, implementation=1)
    prepared = _prepared_runs(monkeypatch)
    assert_kernels_close(torchntk.batch(ntk_fn, 4)(x1), ntk_fn(x1), rtol=1e-10, atol=1e-12)
    assert prepared == [(0, 1), (0, 13)]  # one span of all 13 examples, after the probe
    prepared.clear()
    assert_kernels_close(torchntk.batch(ntk_fn, 16)(x1), ntk_fn(x1), rtol=1e-10, atol=1e-12)
    assert prepared == [(0, 13)]  # x1 is one unit: the probe is that span


def test_later_calls_of_an_ntk_run_no_forward_pass_over_the_whole_batch():
    """With the output check made once (check_vmap_axes="first"), the spans need the outputs'
    shapes only, remembered from the first call: no forward pass over all N examples, which on a
    base-size transformer took a quarter of every call."""
    model = _model()
    batches = []
    model.register_forward_pre_hook(lambda module, inputs: batches.append(inputs[0].shape[0]))
    x1, x2 = _inputs(13, 8)
    # implementation 1: implementation 3 (AUTO's pick) makes its df/dy pass over a span of examples
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1, check_vmap_axes="first")
    batched = torchntk.batch(ntk_fn, 4)
    batched(x1, x2)
    assert 13 in batches  # the first call checks the outputs on the whole batch
    batches.clear()
    kernel = batched(x1, x2)
    assert batches and 13 not in batches and 8 not in batches
    assert_kernels_close(kernel, reference_ntk(model, x1, x2), rtol=1e-10, atol=1e-12)


def test_batch_axis_anywhere_with_vmap_axes():
    """Inputs batched on axis 1 and outputs on axis 1: spans follow vmap_axes, not axis 0."""
    def f(params, x):  # x: (features, N) -> (outputs, N); thread-safe, as batch requires
        return torch.tanh(params["weight"] @ x + params["bias"][:, None])

    params = to_device({"weight": torch.randn(4, 3, dtype=torch.float64), "bias": torch.randn(4, dtype=torch.float64)})
    x1, x2 = (x.T.contiguous() for x in _inputs(13, 8))
    for trace_axes in ((0,), ()):
        kernel_fn = torchntk.empirical_ntk_fn(f, trace_axes=trace_axes, vmap_axes=1)
        for same in (False, True):
            second = None if same else x2
            expected = kernel_fn(x1, second, params)
            actual = torchntk.batch(kernel_fn, 3, devices=["cpu"] * 2, cache_bytes=0)(x1, second, params)
            assert_kernels_close(actual, expected, rtol=1e-10, atol=1e-12)


def test_auto_and_nngp_only_requests_use_spans():
    x1, x2 = _inputs(13, 8)
    auto = torchntk.empirical_kernel_fn(_model(), vmap_axes=0, implementation=0)
    for get in ("ntk", "nngp", ("nngp", "ntk")):
        expected = auto(x1, x2, get)
        actual = torchntk.batch(auto, 3, devices=["cpu"] * 2)(x1, x2, get)
        for got, want in zip(torch.utils._pytree.tree_leaves(actual), torch.utils._pytree.tree_leaves(expected)):
            assert_kernels_close(got, want, rtol=1e-10, atol=1e-12)


def test_structured_plan_is_redone_when_later_spans_run_other_operations(monkeypatch):
    """The quick plan probes x1's first example; when x2 reaches a ruled parameter through an op
    without a rule, the plan is made again from every example, once, and the spans prepared under
    the quick plan are prepared again under it (NOTE: [Plans redone within a call])."""

    def f(params, x):  # a shape-dependent branch (the only kind vmap allows)
        weight, bias = params["weight"], params["bias"]
        if x.shape[-1] == 3:
            return torch.tanh(torch.nn.functional.linear(x, weight, bias))
        return torch.tanh(torch.einsum("nf,of->no", x[..., :3], weight) + bias)

    params = to_device({"weight": torch.randn(4, 3, dtype=torch.float64), "bias": torch.randn(4, dtype=torch.float64)})
    x1 = _inputs(7, 5)[0]
    x2 = to_device(torch.randn(5, 6, dtype=torch.float64))
    expected = torchntk.empirical_ntk_fn(f, vmap_axes=0, implementation=1)(x1, x2, params)
    thorough = []
    original = torchntk._implementations.structured.plan_for

    def recording(call, options, **kwargs):
        thorough.append(kwargs.get("thorough", False))
        return original(call, options, **kwargs)

    monkeypatch.setattr(torchntk._implementations.structured, "plan_for", recording)
    ntk_fn = torchntk.empirical_ntk_fn(f, vmap_axes=0, implementation=3)
    for cache_bytes in (0, None):  # spans prepared again for every pair, or kept and prepared again once
        thorough.clear()
        batched = torchntk.batch(ntk_fn, 2, cache_bytes=cache_bytes)
        assert_kernels_close(batched(x1, x2, params), expected, rtol=1e-10, atol=1e-12)
        assert thorough == ([False, True] if cache_bytes == 0 else [])  # the thorough plan is kept for the key
        assert_kernels_close(batched(x1, x2, params), expected, rtol=1e-10, atol=1e-12)
        assert_kernels_close(ntk_fn(x1, x2, params), expected, rtol=1e-10, atol=1e-12)  # whole, after the spans
    for chunk_size in (None, 2):  # a call of its own: one block, or runs of x1 and x2 (``assemble``)
        thorough.clear()
        forget_shared_planners()  # a kernel function of its own, which plans the key anew
        direct = torchntk.empirical_ntk_fn(f, vmap_axes=0, implementation=3, chunk_size=chunk_size)
        for _ in range(3):  # first, warm, later
            assert_kernels_close(direct(x1, x2, params), expected, rtol=1e-10, atol=1e-12)
        assert thorough == [False, True]
    captured = torchntk.empirical_ntk_fn(f, vmap_axes=0, implementation=3, compile="eager")
    for _ in range(3):  # the first call (eager, the plan redone), its capture, replays
        assert_kernels_close(captured(x1, x2, params), expected, rtol=1e-10, atol=1e-12)


def _pretend_the_module_lives_elsewhere(monkeypatch):
    """CPU workers share the module's own kernel function; replicas are only made for other devices.
    Pretending the module lives on another device makes CPU workers use replicas, so that their
    refresh and rebuild can be tested on a machine without GPUs."""
    monkeypatch.setattr(torchntk.batching, "_model_device", lambda spec: torch.device("meta"))


def test_replicas_follow_the_module_between_calls(monkeypatch):
    """Replicas are made once and refreshed from the module: later calls see its new parameters,
    frozen flags and train/eval mode (and a changed structure makes new replicas)."""
    _pretend_the_module_lives_elsewhere(monkeypatch)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    model = model.double().to(DEVICE).eval()
    x1, x2 = _inputs(7, 5)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
    batched = torchntk.batch(ntk_fn, 2, devices=["cpu"] * 3)
    assert_kernels_close(batched(x1, x2), ntk_fn(x1, x2), rtol=1e-10, atol=1e-12)
    replicas = dict(torchntk.batching._settings_of(batched).replicas)
    assert len(replicas) == 1  # one per device
    with torch.no_grad():
        model[0].weight.mul_(3.0)
    model[2].bias.requires_grad_(False)
    assert_kernels_close(batched(x1, x2), ntk_fn(x1, x2), rtol=1e-10, atol=1e-12)
    assert torchntk.batching._settings_of(batched).replicas == replicas  # refreshed, not rebuilt
    model[2] = torch.nn.Linear(8, 3).double().to(DEVICE)  # other shapes: the replicas are rebuilt
    assert_kernels_close(batched(x1, x2), ntk_fn(x1, x2), rtol=1e-10, atol=1e-12)
    assert torchntk.batching._settings_of(batched).replicas != replicas


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 4)
        self.scale = 1.0

    def forward(self, x):
        return self.linear(x) * self.scale


def _changes():
    """Changes to a module that leave its parameters and buffers as they are."""
    def attribute(model):
        model.scale = 3.0

    def submodule(model):
        model.linear = torch.nn.Linear(3, 4).double().to(DEVICE)

    def hook(model):
        model.linear.register_forward_hook(lambda module, inputs, output: output.tanh())

    def pre_hook(model):
        model.register_forward_pre_hook(lambda module, inputs: (inputs[0] ** 2,))

    return {"attribute": attribute, "submodule": submodule, "hook": hook, "pre_hook": pre_hook}


@pytest.mark.parametrize("replicas", [True, False], ids=["replicas", "shared"])
@pytest.mark.parametrize("change", sorted(_changes()))
def test_workers_see_every_change_of_the_module(monkeypatch, change, replicas):
    """A plain attribute, a swapped submodule or a new hook changes the model without touching its
    tensors; workers on other devices must not keep computing the old model. The workers are on
    the module's device, so that only the pretence makes replicas."""
    if replicas:
        _pretend_the_module_lives_elsewhere(monkeypatch)
    model = _Scaled().double().to(DEVICE)
    x1, x2 = _inputs(6, 5)
    batched = torchntk.batch(torchntk.empirical_ntk_fn(model, vmap_axes=0), 2, devices=[str(DEVICE)] * 3)
    assert_kernels_close(batched(x1, x2), reference_ntk(model, x1, x2), rtol=1e-10, atol=1e-12)
    _changes()[change](model)
    assert_kernels_close(batched(x1, x2), reference_ntk(model, x1, x2), rtol=1e-10, atol=1e-12)
    assert bool(torchntk.batching._settings_of(batched).replicas) == replicas


def test_leaves_with_their_batch_axes_in_different_places_are_refused():
    def f(params, x):  # leaf 0 batched on axis 0, leaf 1 on axis 1
        y = x @ params["w"]
        return y, y.T

    params = to_device({"w": torch.randn(3, 2, dtype=torch.float64)})
    x1, x2 = _inputs(4, 4)
    ntk_fn = torchntk.empirical_ntk_fn(f, trace_axes=(0,), vmap_axes=(0, (0, 1), None))
    with pytest.raises(ValueError, match="output leaves put their batch axes in different places"):
        torchntk.batch(ntk_fn, 2)(x1, x2, params)


@pytest.mark.parametrize("case_id", ["cnn", "tuple_output", "dict_input", "dict_output", "embedding"])
def test_pytree_inputs_and_outputs(case_id):
    case = CASES[case_id]()
    x1, x2 = make_x1_x2(case)
    ntk_fn = torchntk.empirical_ntk_fn(case.module, trace_axes=case.trace_axes, vmap_axes=0)
    for x2_ in (x2, None):
        assert_kernels_close(torchntk.batch(ntk_fn, 2, devices=["cpu"] * 2)(x1, x2_), ntk_fn(x1, x2_))


def test_nngp_fn_and_functional_model_with_params():
    model = _model()
    params = {name: p.detach() for name, p in model.named_parameters()}

    def f(params, x):
        return torch.func.functional_call(model, params, (x,))

    x1, x2 = _inputs(7, 5)
    ntk_fn = torchntk.empirical_ntk_fn(f, vmap_axes=0)
    assert_kernels_close(torchntk.batch(ntk_fn, 3)(x1, x2, params), ntk_fn(x1, x2, params))
    nngp_fn = torchntk.empirical_nngp_fn(model, trace_axes=())
    assert_kernels_close(torchntk.batch(nngp_fn, 2, devices=["cpu"] * 2)(x1, None), nngp_fn(x1, None))


def test_two_tuple_kwargs_are_cut_with_the_inputs_and_single_tensors_are_shared():
    def f(params, x, scale=1.0, shift=0.0):
        return torch.tanh(x @ params["w"].T) * scale + shift

    params = to_device({"w": torch.randn(3, 3, dtype=torch.float64)})
    x1, x2 = _inputs(7, 5)
    scale1, scale2 = to_device((torch.rand(7, 1, dtype=torch.float64), torch.rand(5, 1, dtype=torch.float64)))
    shift = to_device(torch.rand(3, dtype=torch.float64))
    ntk_fn = torchntk.empirical_ntk_fn(f, vmap_axes=(0, 0, {"scale": 0, "shift": None}))
    expected = ntk_fn(x1, x2, params, scale=(scale1, scale2), shift=shift)
    actual = torchntk.batch(ntk_fn, 2, devices=["cpu"] * 3)(x1, x2, params, scale=(scale1, scale2), shift=shift)
    assert_kernels_close(actual, expected)
    # With vmap_axes the kernel function cuts the kwargs it maps and reports the mismatch itself;
    # without, batch cuts tensor 2-tuples on axis 0 and reports it.
    with pytest.raises(ValueError, match="kwarg 'scale' of shape \\(7, 1\\) \\(axis 0\\) has 7"):
        torchntk.batch(ntk_fn, 2)(x1, x2, params, scale=(scale1, scale1), shift=shift)
    unmapped = torchntk.empirical_ntk_fn(f)
    assert_kernels_close(
        torchntk.batch(unmapped, 2, devices=["cpu"] * 2)(x1, x2, params, scale=(scale1, scale2), shift=shift),
        unmapped(x1, x2, params, scale=(scale1, scale2), shift=shift),
    )
    with pytest.raises(ValueError, match="`scale` is a 2-tuple, so it is cut like x1 and x2"):
        torchntk.batch(unmapped, 2)(x1, x2, params, scale=(scale1, scale1), shift=shift)


def test_repeated_runs_over_four_devices_are_identical():
    x1, x2 = _inputs(13, 8)
    kernel_fn = torchntk.empirical_kernel_fn(_model(), trace_axes=(), vmap_axes=0)
    batched = torchntk.batch(kernel_fn, 2, devices=["cpu"] * 4)
    first = batched(x1, x2, "ntk")
    for _ in range(15):
        assert torch.equal(batched(x1, x2, "ntk"), first)


def test_the_module_is_not_mutated_and_worker_errors_reach_the_caller():
    model = _model()
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    x1, x2 = _inputs(8, 5)
    torchntk.batch(torchntk.empirical_ntk_fn(model, vmap_axes=0), 2, devices=["cpu"] * 3)(x1, x2)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name])
    wrong = to_device(torch.randn(8, 4, dtype=torch.float64))  # the model expects 3 features
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
        torchntk.batch(torchntk.empirical_ntk_fn(model), 2, devices=["cpu"] * 2)(wrong, x2)


def test_progress_bar_can_be_switched_on(capsys):
    x1, x2 = _inputs(5, 5)
    torchntk.batch(torchntk.empirical_ntk_fn(_model()), 2, progress=True)(x1, x2)
    assert "kernel blocks" in capsys.readouterr().err


@pytest.mark.parametrize("keyword, value", [("progress", True), ("batch_size", 2), ("devices", ["cpu"]),
                                            ("cache_bytes", 0), ("distributed", "off")])
def test_an_argument_of_batch_given_to_the_batched_call_is_refused(monkeypatch, keyword, value):
    """Refused before anything runs, naming the keyword; the model's own keywords still reach it."""
    x1, x2 = _inputs(5, 5)
    batched = torchntk.batch(torchntk.empirical_ntk_fn(_model(), vmap_axes=0), 2)
    monkeypatch.setattr(torchntk.batching, "_run", lambda *args: pytest.fail("computed"))
    message = (rf"^batch: `{keyword}` \(.*\) is an argument of batch\(\.\.\.\), not of the batched kernel "
               rf"function .* torchntk.batch\(kernel_fn, \.\.\., {keyword}=\.\.\.\)")
    with pytest.raises(TypeError, match=message):
        batched(x1, x2, **{keyword: value})
    monkeypatch.undo()

    class Timed(torch.nn.Module):  # a model with a keyword named like one of batch's
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 2).double().to(DEVICE)

        def forward(self, x, timeout=1.0):
            return self.linear(x) * timeout

    model = Timed()
    kernel = torchntk.batch(torchntk.empirical_ntk_fn(model), 2)(x1, x2, timeout=2.0)
    assert_kernels_close(kernel, reference_ntk(model, x1, x2, timeout=2.0), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        ({"batch_size": -1}, ValueError, "`batch_size` must be 0 .* or positive, got -1"),
        ({"batch_size": 2.0}, TypeError, "`batch_size` must be a non-negative int, got 2.0"),
        ({"batch_size": True}, TypeError, "`batch_size` must be a non-negative int"),
        ({"device_count": -2}, ValueError, "`device_count` must be -1 .* got -2"),
        ({"device_count": "all"}, TypeError, "`device_count` must be an int"),
        ({"devices": "cpu"}, TypeError, "`devices` must be None or a non-empty list"),
        ({"devices": []}, TypeError, "`devices` must be None or a non-empty list"),
        ({"devices": ["gpu"]}, ValueError, "`devices` has 'gpu'.* which is not a device"),
        ({"devices": ["cuda:7"]}, ValueError, "`devices` has cuda:7, but this machine has"),
        ({"devices": ["cpu"], "device_count": 2}, ValueError, "give either `devices` or `device_count`"),
        ({"store_on_device": 1}, TypeError, "`store_on_device` must be True or False"),
        ({"cache_bytes": -1}, ValueError, "`cache_bytes` must be 0 \\(no cache\\) or positive, got -1"),
        ({"cache_bytes": 1.5}, TypeError, "`cache_bytes` must be a non-negative int, got 1.5"),
    ],
)
def test_bad_arguments(arguments, error, message):
    with pytest.raises(error, match=message):
        torchntk.batch(torchntk.empirical_ntk_fn(_model()), **arguments)


def test_device_count_beyond_the_machine_and_foreign_kernel_functions():
    # Checked on every machine: two more GPUs than it has (device_count=1 without any GPU means
    # the inputs' device); the hint about CPU workers comes only when it has none.
    available = torch.cuda.device_count()
    hint = r" Pass devices=\['cpu'\] \* k for several CPU workers\.$" if available == 0 else "$"
    message = rf"`device_count`={available + 2}, but this machine has {available} CUDA device\(s\)\.{hint}"
    with pytest.raises(ValueError, match=message):
        torchntk.batch(torchntk.empirical_ntk_fn(_model()), 2, device_count=available + 2)(*_inputs(4, 4))
    with pytest.raises(TypeError, match="`kernel_fn` must be a kernel function of torchntk"):
        torchntk.batch(lambda x1, x2: x1 @ x2.T, 2)


def test_cuda_without_an_index_is_the_current_device(monkeypatch):
    """``devices=['cuda']`` names the current CUDA device with its index, so that it equals the
    device of a model moved there (``cuda:0``) and its workers share the model instead of a
    replica (checked on a GPU by test_workers_see_every_change_of_the_module)."""
    from torchntk.batching._devices import devices_argument

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert devices_argument(["cuda", "cuda:0", "cpu"], "batch") == (
        torch.device("cuda", 1), torch.device("cuda", 0), torch.device("cpu"),
    )


def test_traced_or_diagonal_batch_axis_needs_equal_sizes():
    x1, x2 = _inputs(5, 8)
    with pytest.raises(ValueError, match=r"the batch axis is traced or diagonal .* but x1 has 5 examples and x2 8"):
        torchntk.batch(torchntk.empirical_ntk_fn(_model(), diagonal_axes=(0,)), 2)(x1, x2)


@pytest.mark.parametrize("implementation", [1, 2, 3])
def test_a_rank_that_owns_no_span_contributes_zeros(implementation):
    """Rank 3 of 4 with two spans only: its share of the all-reduce is zeros of the kernel's shape
    (implementation 2 prepares x1 and x2 differently, so the x2 side is prepared on its own)."""
    from torchntk._kernel.block_source import BlockRequest
    from torchntk._kernel.kernel_function import spec_of
    from torchntk.batching._jobs import Job, run_spans

    x1 = _inputs(3, 1)[0]
    ntk_fn = torchntk.empirical_ntk_fn(_model(), trace_axes=(), vmap_axes=0, implementation=implementation)
    spec = spec_of(ntk_fn)
    job = Job(spec, [ntk_fn], [DEVICE], 2, False, DEVICE, False, rank=3, world_size=4)
    source = spec.open_blocks(BlockRequest(2), x1, None)
    tree, output = run_spans(job, source, lambda function, device: None, 2**30)
    (kernel,) = output.tensors
    assert kernel.shape == (3, 3, 4, 4) and torch.count_nonzero(kernel) == 0
    assert tree.rebuild(output.tensors).shape == ntk_fn(x1).shape


def test_an_empty_side_gives_the_kernel_functions_empty_kernel():
    x1 = _inputs(5, 1)[0]
    empty = to_device(torch.zeros(0, 3, dtype=torch.float64))
    for vmap_axes in (0, None):
        ntk_fn = torchntk.empirical_ntk_fn(_model(), trace_axes=(), vmap_axes=vmap_axes)
        for first, second in ((x1, empty), (empty, x1)):
            batched = torchntk.batch(ntk_fn, 2, devices=["cpu"] * 2)(first, second)
            assert batched.shape == ntk_fn(first, second).shape

    def f(params, x):  # batch on axis 1
        return torch.tanh(params["w"] @ x)

    params = to_device({"w": torch.randn(4, 3, dtype=torch.float64)})
    ntk_fn = torchntk.empirical_ntk_fn(f, trace_axes=(), vmap_axes=1)
    batched = torchntk.batch(ntk_fn, 2, devices=["cpu"] * 2)(x1.T, empty.T, params)
    assert batched.shape == ntk_fn(x1.T, empty.T, params).shape == (4, 4, 5, 0)


def test_batched_nngp_fn_evaluates_each_example_once():
    """empirical_nngp_fn has a block source: one forward pass per run of examples, not per pair of
    blocks; with keyword arguments (which may or may not hold examples) it falls back to blocks."""
    calls = []

    def f(params, x, scale=1.0):
        calls.append(x.shape[0])
        return torch.tanh(x @ params["weight"].T) * scale

    params = to_device({"weight": torch.randn(4, 3, dtype=torch.float64)})
    x1, x2 = _inputs(13, 8)
    nngp_fn = torchntk.empirical_nngp_fn(f)
    expected = nngp_fn(x1, x2, params)
    calls.clear()
    assert_kernels_close(torchntk.batch(nngp_fn, 3)(x1, x2, params), expected, rtol=1e-10, atol=1e-12)
    assert sum(calls) == 13 + 8  # each example once
    calls.clear()
    with_kwargs = torchntk.batch(nngp_fn, 3)(x1, x2, params, scale=2.0)
    assert_kernels_close(with_kwargs, 4 * expected, rtol=1e-10, atol=1e-12)
    assert sum(calls) > 13 + 8  # per pair of blocks


def test_timeouts_are_checked_as_in_torch_distributed():
    """One check for every ``timeout`` (``_checks.timeout_argument``): a number or a timedelta,
    positive and finite."""
    import datetime

    ntk_fn = torchntk.empirical_ntk_fn(_model(), vmap_axes=0)
    with pytest.raises(TypeError, match="batch: `timeout` must be seconds \\(a number\\) or a timedelta"):
        torchntk.batch(ntk_fn, 2, timeout="60")
    with pytest.raises(ValueError, match="batch: `timeout` must be a finite number of seconds"):
        torchntk.batch(ntk_fn, 2, timeout=float("inf"))
    with pytest.raises(ValueError, match="monte_carlo_kernel_fn: `timeout` must be a positive number"):
        torchntk.monte_carlo_kernel_fn(_model(), 2, timeout=0)
    x = _inputs(5, 3)[0]
    batched = torchntk.batch(ntk_fn, 2, timeout=datetime.timedelta(seconds=30))
    assert_kernels_close(batched(x), ntk_fn(x), rtol=1e-10, atol=1e-12)
