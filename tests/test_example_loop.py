"""Kernel functions map examples with a loop when vmap cannot run the model (NOTE: [Switching to
example loops]): same kernels as the brute force, one warning, and coupling still caught."""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch
from torch import nn

import torchntk
from torchntk._call.per_example import map_examples
from torchntk.testing import ModuleSnapshot, assert_kernels_close, reference_ntk

pytestmark = pytest.mark.cpu_only(
    "checks the example loop's warnings and vmap's data-dependent errors as raised on the CPU"
)


class LongestSequence(nn.Module):
    """Zero-padded sequences, cut to the longest one in the batch: independent examples, but the
    cut reads a tensor's value (``int(...)``), which vmap refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = x.abs().sum(-1) > 0
        longest = int(keep.sum(-1).max())
        hidden = torch.tanh(self.linear(x[:, :longest])) * keep[:, :longest, None]
        return hidden.sum(1)


class PaddedSum(LongestSequence):
    """Padded sequences summed over all positions, after a check that reads a tensor's value (as
    Hugging Face's masking code does): shapes never depend on the example."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = x.abs().sum(-1) > 0
        if not bool(keep.any()):
            raise ValueError("all padding")
        return (torch.tanh(self.linear(x)) * keep[..., None]).sum(1)


class CenteredLongest(LongestSequence):
    """The same, minus the batch mean: the examples interact."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = super().forward(x)
        return output - output.mean(0)


def _sequences(batch: int) -> torch.Tensor:
    x = torch.randn(batch, 5, 3)
    for example in range(batch):
        x[example, 2 + example % 3:] = 0
    return x


def _kernel(model, implementation, x1, x2, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=implementation, **options)
        kernel = ntk_fn(x1, x2)
        again = ntk_fn(x1, x2)
    loops = [w for w in caught if issubclass(w.category, torchntk.ExampleLoopWarning)]
    return kernel, again, loops


@pytest.mark.parametrize(
    "model_type, implementation",
    [(LongestSequence, 1), (LongestSequence, 2), (LongestSequence, 0)] + [(PaddedSum, k) for k in (1, 2, 3, 0)],
)
@pytest.mark.parametrize("check_vmap_axes", [True, False])
def test_vmap_failure_switches_to_a_loop_with_one_warning(model_type, implementation, check_vmap_axes):
    model = model_type()
    x1, x2 = _sequences(4), _sequences(3)
    snapshot = ModuleSnapshot.of(model)
    kernel, again, loops = _kernel(model, implementation, x1, x2, check_vmap_axes=check_vmap_axes)
    expected = reference_ntk(model, x1, x2, trace_axes=())
    assert_kernels_close(kernel, expected)
    assert torch.equal(kernel, again)
    assert len(loops) == 1, [str(w.message) for w in loops]
    message = str(loops[0].message)
    assert "one model call per example" in message and "vmap_axes=None" in message
    snapshot.assert_unchanged()


def test_structured_derivatives_refuse_examples_of_different_shapes():
    with pytest.raises(ValueError, match="intermediate results of different shapes .* Use implementation=1 or 2"):
        _kernel(LongestSequence(), 3, _sequences(4), None)


def test_the_loop_still_catches_coupled_examples():
    with pytest.raises(ValueError, match="differs between the whole batch and a per-example evaluation"):
        _kernel(CenteredLongest(), 1, _sequences(4), None)


def test_batched_kernels_use_the_loop_too():
    model = LongestSequence()
    x = _sequences(5)
    ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0)
    with pytest.warns(torchntk.ExampleLoopWarning, match="torch.func.vmap cannot evaluate this model per example"):
        kernel = torchntk.batch(ntk_fn, batch_size=2)(x, None)
    assert_kernels_close(kernel, reference_ntk(model, x, None, trace_axes=()))


def test_map_examples_loop_matches_vmap_on_nested_axes():
    def function(params, pair, scale):
        first, second = pair
        return {"sum": first * scale + params["w"], "outer": torch.outer(second, first)}

    params = {"w": torch.randn(3)}
    pair = (torch.randn(4, 3), torch.randn(2, 4))
    scale = torch.randn(4)
    in_dims = (None, (0, 1), 0)
    out_dims = {"sum": 0, "outer": 1}
    looped = map_examples(function, in_dims, out_dims, loop=True)(params, pair, scale)
    mapped = map_examples(function, in_dims, out_dims, loop=False)(params, pair, scale)
    for key in mapped:
        torch.testing.assert_close(looped[key], mapped[key])


def test_the_warning_names_the_line_that_called_torchntk():
    ntk_fn = torchntk.empirical_ntk_fn(PaddedSum(), vmap_axes=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = inspect.currentframe().f_lineno + 1
        ntk_fn(_sequences(4))
    [loop] = [w for w in caught if issubclass(w.category, torchntk.ExampleLoopWarning)]
    assert (loop.filename, loop.lineno) == (__file__, line)


def test_under_batch_workers_the_warning_names_the_caller_or_torchntk_not_the_thread_machinery():
    ntk_fn = torchntk.empirical_ntk_fn(PaddedSum(), vmap_axes=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torchntk.batch(ntk_fn, batch_size=2, devices=["cpu", "cpu"])(_sequences(4))
    loops = [w for w in caught if issubclass(w.category, torchntk.ExampleLoopWarning)]
    package = os.path.dirname(torchntk.__file__) + os.sep
    assert loops and all(w.filename == __file__ or w.filename.startswith(package) for w in loops), [
        (w.filename, w.lineno) for w in loops
    ]
