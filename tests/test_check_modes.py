"""``check_vmap_axes`` True, ``"first"`` and False, and NOTE: [Remembered output shapes].

Where no output check runs on a call, an NTK call stands in for the whole-batch outputs with
their remembered shapes: the kernels must stay exact, also when the input shapes, the module's
structure or the parameter selection change between calls.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchntk
from torchntk.testing import assert_kernels_close, reference_ntk

F64 = torch.float64
IMPLEMENTATIONS = pytest.mark.parametrize("implementation", [1, 2, 3, 0], ids=["JC", "NVP", "SD", "AUTO"])

_FORWARDS: list = []


class _Counted(nn.Module):
    """An MLP that counts its forward calls outside itself (torchntk evaluates a private copy)
    and couples its examples when an input entry exceeds 10."""

    def __init__(self, width: int = 6, outputs: int = 3):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, width), nn.Tanh())
        self.head = nn.Linear(width, outputs)

    def forward(self, x):
        _FORWARDS.append(tuple(x.shape))
        hidden = self.head(self.body(x))
        large = (x.abs().amax() > 10).to(hidden.dtype)
        return hidden - large * hidden.mean(0, keepdim=True)


def _model(**sizes) -> nn.Module:
    torch.manual_seed(0)
    return _Counted(**sizes).to(F64).eval()


def _inputs(n1: int, n2: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.randn(n1, 4, generator=generator, dtype=F64), torch.randn(n2, 4, generator=generator, dtype=F64)


@IMPLEMENTATIONS
@pytest.mark.parametrize("mode", ["first", False])
@pytest.mark.parametrize("x2_given", [True, False], ids=["x2", "x2-None"])
@pytest.mark.parametrize("trace_axes", [(-1,), ()], ids=["traced", "full"])
def test_later_calls_without_the_output_check_are_exact(implementation, mode, x2_given, trace_axes):
    model = _model()
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=trace_axes, vmap_axes=0, implementation=implementation,
                                       check_vmap_axes=mode)
    x1, x2 = _inputs(5, 3)
    x2 = x2 if x2_given else None
    expected = reference_ntk(model, x1, x2, trace_axes=trace_axes)
    for _ in range(3):
        assert_kernels_close(ntk_fn(x1, x2), expected)
    # other values, same shapes: the remembered shapes serve them
    other1, other2 = _inputs(5, 3)
    other1 = other1 * 0.5
    other2 = other2 if x2_given else None
    assert_kernels_close(ntk_fn(other1, other2), reference_ntk(model, other1, other2, trace_axes=trace_axes))
    # new shapes: a whole-batch pass again
    longer = torch.cat([x1, x1[:2] + 1])
    assert_kernels_close(ntk_fn(longer, x2), reference_ntk(model, longer, x2, trace_axes=trace_axes))


@pytest.mark.parametrize(("implementation", "forwards"), [(1, 1), (3, 1), (0, 1)])
@pytest.mark.parametrize("mode", ["first", False])
def test_later_calls_make_no_whole_batch_pass(implementation, forwards, mode):
    """Jacobian contraction and structured derivatives then evaluate the model in their own
    per-example pass only (one traced call under vmap); with ``check_vmap_axes=True`` a call
    also makes the whole-batch pass."""
    model = _model()
    x1, _ = _inputs(5, 3)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation, check_vmap_axes=mode)
    ntk_fn(x1)
    _FORWARDS.clear()
    ntk_fn(x1)
    assert len(_FORWARDS) == forwards
    checked = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation, check_vmap_axes=True)
    checked(x1)
    _FORWARDS.clear()
    checked(x1)
    assert len(_FORWARDS) == forwards + 1


@IMPLEMENTATIONS
def test_first_checks_the_first_call_per_shapes(implementation):
    """``"first"`` catches coupling that the first call of some shapes shows; coupling that only
    later values show is the documented limit of the mode (``True`` catches it)."""
    model = _model()
    x1, x2 = _inputs(5, 3)
    large = x1.clone()
    large[1, 2] = 50.0
    first = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation, check_vmap_axes="first")
    with pytest.raises(ValueError, match="differs between the whole batch and a per-example evaluation"):
        first(large, x2)
    every = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation, check_vmap_axes=True)
    every(x1, x2)
    with pytest.raises(ValueError, match="differs between the whole batch and a per-example evaluation"):
        every(large, x2)


@pytest.mark.parametrize("implementation", [1, 3])
def test_a_changed_module_structure_is_evaluated_again(implementation):
    """The remembered shapes are keyed by the module's structure: a head with more outputs,
    swapped in between calls, gets its own whole-batch pass and the right kernel."""
    model = _model()
    x1, x2 = _inputs(4, 3)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=implementation,
                                       check_vmap_axes=False)
    assert ntk_fn(x1, x2).shape == (4, 3, 3, 3)
    ntk_fn(x1, x2)
    torch.manual_seed(2)
    model.head = nn.Linear(6, 5).to(F64)
    kernel = ntk_fn(x1, x2)
    assert kernel.shape == (4, 3, 5, 5)
    assert_kernels_close(kernel, reference_ntk(model, x1, x2, trace_axes=()))


def test_a_changed_parameter_selection_is_evaluated_again():
    model = _model()
    x1, x2 = _inputs(4, 3)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1, check_vmap_axes="first")
    ntk_fn(x1, x2)
    ntk_fn(x1, x2)
    model.body.requires_grad_(False)
    assert_kernels_close(ntk_fn(x1, x2), reference_ntk(model, x1, x2))


@pytest.mark.parametrize("mode", ["first", False])
def test_kernel_fn_and_groups_accept_the_modes(mode):
    model = _model()
    x1, x2 = _inputs(4, 3)
    kernel_fn = torchntk.empirical_kernel_fn(model, vmap_axes=0, check_vmap_axes=mode)
    for _ in range(2):
        both = kernel_fn(x1, x2, ("ntk", "nngp"))
    assert_kernels_close(both.ntk, reference_ntk(model, x1, x2))
    grouped = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, check_vmap_axes=mode,
                                        groups={"head": "head.*", "rest": "*"})
    for _ in range(2):
        kernels = grouped(x1, x2)
    assert_kernels_close(kernels["head"] + kernels["rest"], reference_ntk(model, x1, x2))


def test_batch_over_a_first_mode_kernel_function_is_exact():
    model = _model()
    x1, x2 = _inputs(7, 5)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, check_vmap_axes="first")
    for _ in range(2):
        kernel = torchntk.batch(ntk_fn, batch_size=3)(x1, x2)
    assert_kernels_close(kernel, reference_ntk(model, x1, x2))


@pytest.mark.parametrize("value", ["always", 1, None, "First"])
def test_other_values_are_refused(value):
    with pytest.raises(ValueError, match=r"`check_vmap_axes` must be True, 'first' or False, got"):
        torchntk.empirical_ntk_fn(_model(), vmap_axes=0, check_vmap_axes=value)


# -- NOTE: [Working-set runs] --------------------------------------------------------------------


@pytest.mark.parametrize("implementation", [1, 3], ids=["JC", "SD"])
@pytest.mark.parametrize("x2_given", [True, False], ids=["x2", "x2-None"])
@pytest.mark.parametrize("trace_axes", [(-1,), ()], ids=["traced", "full"])
def test_working_set_runs_prepare_each_run_once_and_stay_exact(implementation, x2_given, trace_axes, monkeypatch):
    """With the bound lowered so that one example fills it, a call of 5 examples runs 5 passes
    of one example per side, each prepared once, and the kernel is the reference."""
    from torchntk._kernel import working_set

    monkeypatch.setattr(working_set, "WORKING_SET_BYTES", 1)
    model = _model()
    x1, x2 = _inputs(5, 3)
    x2 = x2 if x2_given else None
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=trace_axes, vmap_axes=0, implementation=implementation,
                                       check_vmap_axes="first")
    expected = reference_ntk(model, x1, x2, trace_axes=trace_axes)
    assert_kernels_close(ntk_fn(x1, x2), expected)
    _FORWARDS.clear()
    kernel = ntk_fn(x1, x2)
    assert len(_FORWARDS) == 5 + (3 if x2_given else 0)
    assert_kernels_close(kernel, expected)


def test_working_set_runs_leave_small_passes_whole_and_a_chunk_size_alone(monkeypatch):
    from torchntk._kernel import working_set

    model = _model()
    x1, _ = _inputs(6, 3)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1, check_vmap_axes="first")
    ntk_fn(x1)
    _FORWARDS.clear()
    ntk_fn(x1)
    assert len(_FORWARDS) == 1  # a few kilobytes of activations: one pass
    monkeypatch.setattr(working_set, "WORKING_SET_BYTES", 1)
    chunked = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1, check_vmap_axes="first", chunk_size=2)
    expected = reference_ntk(model, x1, None)
    chunked(x1)
    _FORWARDS.clear()
    kernel = chunked(x1)
    assert len(_FORWARDS) == 3 + 2 + 1  # the user's chunk_size bounds the prepared data too: x1's runs again
    assert_kernels_close(kernel, expected)
