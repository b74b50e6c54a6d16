"""Small defects, one test each: the message of a 1-D ``x2`` under ``vmap_axes=0``, the budget of an
out-of-memory error, the documented slack of a planned call, the advice of a refused kernel, and a
resume whose ``params`` are spelled differently."""

from __future__ import annotations

import pathlib
import re
from unittest import mock

import numpy as np
import pytest
import torch

import torchntk
from tests._memory_grid import BUDGET_SLACK, PREDICTION_FACTOR, PREDICTION_SLACK
from torchntk._implementations import memory as memory_module
from torchntk._memory import budget as budget_module
from torchntk._memory import format_bytes, memory_argument
from torchntk.testing import assert_kernels_close, reference_ntk

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _mlp(outputs: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(), torch.nn.Linear(5, outputs)).double()


def _x(n: int, *shape: int) -> torch.Tensor:
    return torch.randn(n, *(shape or (3,)), generator=torch.Generator().manual_seed(n), dtype=torch.float64)


# -- a. a 1-D input under vmap_axes=0 is named, on either side -------------------------------------


@pytest.mark.parametrize("implementation", (1, 3))
def test_a_one_dimensional_x2_gets_the_message_x1_gets(implementation):
    ntk_fn = torchntk.empirical_ntk_fn(_mlp(), vmap_axes=0, implementation=implementation)
    with pytest.raises(ValueError) as alone:
        ntk_fn(_x(3)[0])  # x1 of shape (3,)
    for x1, x2, name in ((_x(4), _x(3)[0], "x2"), (_x(3)[0], _x(4), "x1")):
        with pytest.raises(ValueError) as caught:
            ntk_fn(x1, x2)
        text = str(caught.value)
        assert f"`vmap_axes` maps 3 examples of `{name}` (axis 0 of {name}, of shape (3,))" in text
        assert "A 1-D input under `vmap_axes` makes each of its entries one example" in text
        assert f"give it a batch axis ({name}[None]) or pass vmap_axes=None" in text
        assert "the outputs must have the same number of axes" not in text
        # the same kind of message as x1 alone gets
        assert text.split(" but ")[0].replace(name, "x1") == str(alone.value).split(" but ")[0]


def test_a_two_dimensional_x2_whose_output_drops_the_examples_is_named():
    def f(params, x):  # on x2 (5 examples) the output loses the examples' axis: a mapped axis that is not theirs
        out = x @ params
        return out if out.shape[0] != 5 else out.sum(0)

    params = torch.randn(3, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"`vmap_axes` maps 5 examples of `x2` \(axis 0 of x2, of shape \(5, 3\)\).*"
                                         r"Put the examples on the axis"):
        torchntk.empirical_ntk_fn(f, vmap_axes=0)(_x(4), _x(5), params)


# -- b. an out-of-memory error carries its budget ---------------------------------------------------


@pytest.mark.parametrize("memory", ("5MB", None))
def test_an_out_of_memory_error_carries_the_budget_its_message_states(monkeypatch, memory):
    ntk_fn = torchntk.empirical_ntk_fn(_mlp(), vmap_axes=0, implementation=1, memory=memory)

    def fails(call, scope):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setitem(ntk_fn._settings.table, torchntk.NtkImplementation(1), mock.Mock(kernels=fails))
    with pytest.raises(torchntk.KernelMemoryError) as caught:
        ntk_fn(_x(4))
    budget = caught.value.budget_bytes
    assert budget is not None and budget > 0
    if memory is not None:
        assert budget == memory_argument(memory, "test")
    assert f"budget {format_bytes(budget)}" in str(caught.value)
    assert caught.value.needed_bytes is None and not caught.value.kernel_alone


# -- c. the slack of a planned call: the same in the docs as in the tests ---------------------------


def test_the_docs_state_the_slack_the_tests_assert():
    factor, slack = BUDGET_SLACK
    phrase = f"{factor} times its budget plus {format_bytes(slack)}"
    batching = " ".join((ROOT / "docs" / "batching.md").read_text().split())
    benchmarks = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    assert batching.count(phrase) >= 2 and phrase in benchmarks  # the budget's bullet and the model's section
    assert f"within {PREDICTION_FACTOR:g}x (or {format_bytes(PREDICTION_SLACK)})" in batching
    for text in (batching, benchmarks):  # no other statement of it
        others = re.findall(r"1\.4 ?x (?:its|the) budget(?! plus)|1\.4x its budget(?! plus)", text)
        assert not others, others


# -- d. a refused kernel suggests only what the machine can do --------------------------------------


def _refusal(monkeypatch, free: float, n: int, trace_axes=(), memory=None) -> torchntk.KernelMemoryError:
    monkeypatch.setattr(budget_module, "_cpu_available", lambda: free)
    ntk_fn = torchntk.empirical_ntk_fn(_mlp(100), vmap_axes=0, trace_axes=trace_axes, memory=memory)
    with pytest.raises(torchntk.KernelMemoryError) as caught:
        ntk_fn(_x(n))
    return caught.value


def test_a_kernel_larger_than_the_machine_is_not_told_to_raise_the_budget(monkeypatch):
    refused = _refusal(monkeypatch, free=16e9, n=20_000)  # 20,000 x 20,000 x 100 x 100 float64: 32 TB
    text = str(refused)
    assert refused.kernel_alone and refused.needed_bytes == 20_000**2 * 100**2 * 8
    assert "memory='" not in text and "too little to hold it, so a larger memory= is no way out" in text
    assert "16 GB free" in text
    assert "out=np.lib.format.open_memmap(" in text and "32 TB of disk" in text
    # the smallest layout, in numbers: every output axis traced but the examples'
    assert "10,000 entries per pair of examples" in text and f"it takes {format_bytes(20_000**2 * 8)}" in text


def test_a_kernel_that_fits_the_machine_gets_a_budget_it_can_pass(monkeypatch):
    refused = _refusal(monkeypatch, free=16e9, n=1_200, trace_axes=(-1,), memory="1MB")  # 11.5 MB
    text = str(refused)
    suggested = re.search(r"memory='([^']+)'", text)[1]
    budget = memory_argument(suggested, "test")
    assert refused.needed_bytes < budget <= 16e9 / BUDGET_SLACK[0]
    assert "entries per pair of examples" not in text  # already the smallest layout
    # with the suggestion, the kernel is no longer refused for its size
    assert memory_module.kernel_refusal(((1_200, 1_200),), (torch.float64,), 1, budget, "ntk_fn") is None


def test_a_budget_beyond_what_is_free_is_not_suggested(monkeypatch):
    refused = _refusal(monkeypatch, free=20e6, n=1_200, trace_axes=(-1,), memory="1MB")  # 11.5 MB, 20 MB free
    assert "memory='" not in str(refused) and "20 MB free" in str(refused)


@pytest.mark.parametrize("n", (2_000, 5_000))  # one call of the kernel function; spans of batch's own
@pytest.mark.parametrize("free, more", ((16e9, False), (1e13, True)))
def test_batch_suggests_more_memory_only_where_the_device_has_it(monkeypatch, free, more, n):
    monkeypatch.setattr(budget_module, "_cpu_available", lambda: free)
    batched = torchntk.batch(torchntk.empirical_ntk_fn(_mlp(100), vmap_axes=0, trace_axes=()), memory="1GB")
    with pytest.raises(torchntk.KernelMemoryError) as caught:
        batched(_x(n))
    assert caught.value.kernel_alone and caught.value.budget_bytes == 1e9
    text = str(caught.value)  # the kernel function's refusal, or batch's own for larger problems
    assert ("allow more memory (memory=" in text) is more
    assert ("too little to hold it" in text) is not more


def test_a_result_that_cannot_be_allocated_is_a_kernel_memory_error(monkeypatch):
    from torchntk.batching import _output

    original = torch.zeros

    def zeros(*shape, **kwargs):  # what the CPU allocator says of a result larger than the machine
        size = shape[0] if len(shape) == 1 and isinstance(shape[0], (list, tuple)) else shape
        if np.prod(size) > 10_000:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                               "memory: you tried to allocate 16000000000000 bytes.")
        return original(*shape, **kwargs)

    monkeypatch.setattr(_output.torch, "zeros", zeros)
    batched = torchntk.batch(torchntk.empirical_ntk_fn(_mlp(), vmap_axes=0, trace_axes=()), batch_size=4)
    with pytest.raises(torchntk.KernelMemoryError, match=r"result of shape \(60, 60, 2, 2\) .* could not be allocated "
                                                         r"on cpu\. Write it to disk .*can't allocate memory"):
        batched(_x(60))


# -- e. a resume compares the parameters selected, not how params spells them -----------------------


def _open(path, shape, fresh: bool):
    return np.lib.format.open_memmap(path, "w+" if fresh else "r+", np.float64, shape)


def test_a_resume_with_params_spelled_differently_is_the_same_problem(tmp_path, monkeypatch):
    model, x1 = _mlp(), _x(6)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
    record = tmp_path / "k.json"
    torchntk.batch(ntk_fn, 2, cache_bytes=0)(x1, out=_open(tmp_path / "k.npy", (6, 6), True), progress_file=record,
                                             params="2.*")
    contracted = []
    original = torchntk._kernel.block_source.BlockSource.contract
    monkeypatch.setattr(torchntk._kernel.block_source.BlockSource, "contract",
                        lambda self, a, b: contracted.append(1) or original(self, a, b))
    for same in (["2.weight", "2.bias"], ("2.w*", "2.b*"), lambda name, p: name.startswith("2.")):
        out = _open(tmp_path / "k.npy", (6, 6), False)
        torchntk.batch(ntk_fn, 2, cache_bytes=0)(x1, None, same, out=out, progress_file=record)
        assert len(contracted) == 1  # resumed: only the probe that checks `out`
        contracted.clear()
        expected = reference_ntk(model, x1, params={n: p for n, p in model.named_parameters() if n.startswith("2.")})
        assert_kernels_close(torch.from_numpy(np.array(out)), expected)


def test_a_resume_with_other_params_names_params(tmp_path):
    model, x1 = _mlp(), _x(6)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
    record = tmp_path / "k.json"
    torchntk.batch(ntk_fn, 2)(x1, out=_open(tmp_path / "k.npy", (6, 6), True), progress_file=record, params="2.*")
    message = (r"records another problem \(params: other parameters are differentiated \(only in the record: "
               r"none; only now: '0\.bias', '0\.weight'\)\)")
    with pytest.raises(ValueError, match=message):
        torchntk.batch(ntk_fn, 2)(x1, out=_open(tmp_path / "k.npy", (6, 6), False), progress_file=record,
                                  params=["0.*", "2.*"])
    values = {name: p.detach() * 2 for name, p in model.named_parameters() if name.startswith("2.")}
    with pytest.raises(ValueError, match=r"\(params: the parameter values given in `params` differ\)"):
        torchntk.batch(ntk_fn, 2)(x1, out=_open(tmp_path / "k.npy", (6, 6), False), progress_file=record,
                                  params=values)
