"""``torchntk.batch``: blocks of examples on one or several (CPU) devices equal the unbatched kernel."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

import torchntk
from tests.cases import CASES, make_x1_x2
from torchntk.testing import assert_kernels_close

SIZES = [(1, 5), (5, 8), (8, 1), (13, 13)]
BATCH_SIZES = [1, 2, 3, 4, 16]
LAYOUTS = [((-1,), ()), ((), ()), ((), (0,)), ((0,), ()), ((), (1,))]


@functools.lru_cache(maxsize=None)
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)).double().eval()


@functools.lru_cache(maxsize=None)
def _inputs(n1: int, n2: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(n1 * 100 + n2)
    return (torch.randn(n1, 3, generator=generator, dtype=torch.float64),
            torch.randn(n2, 3, generator=generator, dtype=torch.float64))


def _check(n1, n2, layout, implementation, same, batch_size, devices, store_on_device):
    trace_axes, diagonal_axes = layout
    if (0 in trace_axes or 0 in diagonal_axes) and not same and n1 != n2:
        return
    x1, x2 = _inputs(n1, n2)
    x2 = None if same else x2
    kernel_fn = torchntk.empirical_kernel_fn(_model(), trace_axes, diagonal_axes, vmap_axes=0, implementation=implementation)
    expected = kernel_fn(x1, x2, ("ntk", "nngp"))
    batched = torchntk.batch(kernel_fn, batch_size, devices=devices, store_on_device=store_on_device)
    actual = batched(x1, x2, ("ntk", "nngp"))
    assert type(actual) is type(expected)
    for got, want in zip(actual, expected):
        assert got.device.type == "cpu"
        assert_kernels_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("store_on_device", [True, False], ids=["on-device", "host"])
@pytest.mark.parametrize("devices", [["cpu"], ["cpu"] * 3], ids=["1cpu", "3cpu"])
@pytest.mark.parametrize("batch_size", BATCH_SIZES)
@pytest.mark.parametrize("n1, n2", SIZES)
def test_batched_equals_unbatched(n1, n2, batch_size, devices, store_on_device):
    """Every size and batch size; layouts, implementations and x2 rotate so the fast run stays short."""
    index = SIZES.index((n1, n2)) + BATCH_SIZES.index(batch_size)
    for same in (False, True):
        layout = LAYOUTS[(index + same) % len(LAYOUTS)]
        implementation = 1 + (index + store_on_device) % 3
        _check(n1, n2, layout, implementation, same, batch_size, devices, store_on_device)


@pytest.mark.slow
def test_batched_equals_unbatched_full_grid():
    for n1, n2 in SIZES:
        for layout, implementation, same, batch_size, devices, store_on_device in itertools.product(
            LAYOUTS, (1, 2, 3), (False, True), BATCH_SIZES, (["cpu"], ["cpu"] * 3), (True, False)
        ):
            _check(n1, n2, layout, implementation, same, batch_size, devices, store_on_device)


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

    params = {"w": torch.randn(3, 3, dtype=torch.float64)}
    x1, x2 = _inputs(7, 5)
    scale1, scale2 = torch.rand(7, 1, dtype=torch.float64), torch.rand(5, 1, dtype=torch.float64)
    shift = torch.rand(3, dtype=torch.float64)
    ntk_fn = torchntk.empirical_ntk_fn(f, vmap_axes=(0, 0, {"scale": 0, "shift": None}))
    expected = ntk_fn(x1, x2, params, scale=(scale1, scale2), shift=shift)
    actual = torchntk.batch(ntk_fn, 2, devices=["cpu"] * 3)(x1, x2, params, scale=(scale1, scale2), shift=shift)
    assert_kernels_close(actual, expected)
    with pytest.raises(ValueError, match="`scale` is a 2-tuple, so it is cut like x1 and x2"):
        torchntk.batch(ntk_fn, 2)(x1, x2, params, scale=(scale1, scale1), shift=shift)


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
    wrong = torch.randn(8, 4, dtype=torch.float64)  # the model expects 3 features
    with pytest.raises(RuntimeError):
        torchntk.batch(torchntk.empirical_ntk_fn(model), 2, devices=["cpu"] * 2)(wrong, x2)


def test_progress_bar_can_be_switched_on(capsys):
    x1, x2 = _inputs(5, 5)
    torchntk.batch(torchntk.empirical_ntk_fn(_model()), 2, progress=True)(x1, x2)
    assert "kernel blocks" in capsys.readouterr().err


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
    ],
)
def test_bad_arguments(arguments, error, message):
    with pytest.raises(error, match=message):
        torchntk.batch(torchntk.empirical_ntk_fn(_model()), **arguments)


def test_device_count_beyond_the_machine_and_foreign_kernel_functions():
    if torch.cuda.device_count() == 0:
        with pytest.raises(ValueError, match=r"`device_count`=2, but this machine has 0 CUDA .*devices=\['cpu'\] \* k"):
            torchntk.batch(torchntk.empirical_ntk_fn(_model()), 2, device_count=2)(*_inputs(4, 4))
    with pytest.raises(TypeError, match="`kernel_fn` must be a kernel function of torchntk"):
        torchntk.batch(lambda x1, x2: x1 @ x2.T, 2)


def test_traced_or_diagonal_batch_axis_needs_equal_sizes():
    x1, x2 = _inputs(5, 8)
    with pytest.raises(ValueError):
        torchntk.batch(torchntk.empirical_ntk_fn(_model(), diagonal_axes=(0,)), 2)(x1, x2)
