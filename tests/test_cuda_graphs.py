"""Captured kernels replayed as CUDA graphs on CUDA (NOTE: [CUDA graph replays]).

On the CPU the parts that do not need a device: which mode a graph is compiled in, and what a
replay in CUDA graphs asks of torchntk (a new step before each replay, its outputs cloned before
the next replay overwrites them, inductor's skips warned, a failing mode replaced), with a stand-in
for inductor's CUDA graph trees that overwrites its outputs on every run as they do. Under
``--device cuda`` the real thing: inductor records a graph, and replays agree with eager kernels.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchntk
from tests.cases import DEVICE
from torchntk._kernel import captured as _captured
from torchntk._kernel.captured import CompileOptions
from torchntk.testing import assert_kernels_close, reference_ntk


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 3)).double().to(DEVICE).eval()


def _x(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def test_inductor_on_cuda_records_cuda_graphs_unless_a_mode_is_given():
    assert CompileOptions("inductor").mode_for(cuda=True) == "reduce-overhead"
    assert CompileOptions("inductor").mode_for(cuda=False) is None
    assert CompileOptions("eager").mode_for(cuda=True) is None
    given = CompileOptions("inductor", "max-autotune-no-cudagraphs")
    assert given.mode_for(cuda=True) == "max-autotune-no-cudagraphs"
    assert [CompileOptions.records_cuda_graphs(mode) for mode in
            ("reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs", "default", None)] == [
        True, True, False, False, False]
    assert torchntk.empirical_ntk_fn(_model(), compile={"mode": "max-autotune-no-cudagraphs"}) is not None


class _GraphTrees:
    """A stand-in for inductor's CUDA graph trees: the graph runs eagerly, and its outputs are copied
    into buffers of its own that every run overwrites, as a replay writes into the graph's pool."""

    def __init__(self, graph, skip: str = "", fail: bool = False):
        self.graph, self.skip, self.fail = graph, skip, fail
        self.buffers = None
        self.runs = 0

    def __call__(self, *inputs):
        self.runs += 1
        if self.fail:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
        if self.skip and self.runs == 1:
            from torch._dynamo.utils import counters
            from torch._inductor.cudagraph_utils import cudagraphs_log

            cudagraphs_log.warning(self.skip)
            counters["inductor"]["cudagraph_skips"] += 1
        outputs = self.graph(*inputs)
        if self.buffers is None:
            self.buffers = [output.clone() for output in outputs]
        for buffer, output in zip(self.buffers, outputs):
            buffer.copy_(output)
        return list(self.buffers)


@pytest.fixture
def on_cuda(monkeypatch):
    """The graphs' inputs taken as CUDA tensors, inductor's compilation replaced by
    :class:`_GraphTrees` in the CUDA graph modes; returns the record of what was asked."""
    record = {"modes": [], "steps": 0, "trees": [], "skip": "", "fail": False}

    def compiled(self, graph, mode):
        record["modes"].append(mode)
        if CompileOptions.records_cuda_graphs(mode):
            trees = _GraphTrees(graph, record["skip"], record["fail"])
            record["trees"].append(trees)
            return trees
        return graph

    def step():
        record["steps"] += 1

    monkeypatch.setattr(_captured, "_on_cuda", lambda inputs: True)
    monkeypatch.setattr(_captured.CapturedCalls, "_compiled", compiled)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", step)
    return record


def test_replays_begin_a_step_and_return_kernels_the_next_replay_does_not_overwrite(on_cuda):
    model = _model()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1, compile=True)
    x1, x2, x3 = _x(5, 1), _x(5, 2), _x(5, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ntk_fn(x1)  # eager, then captured: a warm-up run, the recording run, a replay
    assert on_cuda["modes"] == ["reduce-overhead"] and on_cuda["steps"] == 3
    first = ntk_fn(x2)
    second = ntk_fn(x3)
    assert on_cuda["steps"] == 5 and on_cuda["trees"][0].runs == 5
    assert_kernels_close(first, reference_ntk(model, x2), rtol=1e-10, atol=1e-12)  # not overwritten by x3's
    assert_kernels_close(second, reference_ntk(model, x3), rtol=1e-10, atol=1e-12)
    assert first.data_ptr() not in {buffer.data_ptr() for buffer in on_cuda["trees"][0].buffers}


def test_a_graph_inductor_does_not_record_is_warned_with_its_reason_and_still_replayed(on_cuda):
    on_cuda["skip"] = "skipping cudagraphs due to mutated inputs (1 instances)"
    model = _model()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1, compile=True)
    with pytest.warns(RuntimeWarning, match=r"inductor does not replay this graph as a CUDA graph \(skipping "
                                            r"cudagraphs due to mutated inputs \(1 instances\)\); it replays"):
        ntk_fn(_x(5, 1))
    x2 = _x(5, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_kernels_close(ntk_fn(x2), reference_ntk(model, x2), rtol=1e-10, atol=1e-12)
    assert on_cuda["trees"][0].runs == 4


def test_a_failing_cuda_graph_mode_is_replaced_by_the_default_mode(on_cuda):
    on_cuda["fail"] = True
    model = _model()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1, compile=True)
    with pytest.warns(RuntimeWarning, match=r"mode 'reduce-overhead' \(CUDA graphs\) failed \(RuntimeError: CUDA "
                                            r"error: operation not permitted .*compiled without CUDA graphs"):
        ntk_fn(_x(5, 1))
    assert on_cuda["modes"] == ["reduce-overhead", None]
    x2 = _x(5, 2)
    steps = on_cuda["steps"]
    assert_kernels_close(ntk_fn(x2), reference_ntk(model, x2), rtol=1e-10, atol=1e-12)
    assert on_cuda["steps"] == steps  # no CUDA graph: no steps


def test_other_backends_and_given_modes_are_compiled_as_asked(on_cuda):
    model = _model()
    x1 = _x(5, 1)
    torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1, compile="eager")(x1)
    torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1, compile={"mode": "max-autotune-no-cudagraphs"})(x1)
    assert on_cuda["modes"] == [None, "max-autotune-no-cudagraphs"] and on_cuda["steps"] == 0


@pytest.mark.cuda_only("records CUDA graphs, which exist on CUDA alone")
def test_inductor_replays_cuda_graphs_that_agree_with_eager_kernels():
    from torch._dynamo.utils import counters

    model = _model().float()
    x1, x2 = _x(8, 1).float(), _x(8, 2).float()
    skips = counters["inductor"]["cudagraph_skips"]
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1, compile=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no skip, no fallback
        ntk_fn(x1, x2)
        kernels = [ntk_fn(x1, x2), ntk_fn(x2, x1)]
    assert counters["inductor"]["cudagraph_skips"] == skips
    eager = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=1)
    assert_kernels_close(kernels[0], eager(x1, x2), rtol=1e-4, atol=1e-5)
    assert_kernels_close(kernels[1], eager(x2, x1), rtol=1e-4, atol=1e-5)
