"""NOTE: [Output notices]: a ``torchntk.OutputWarning``, once per kernel function and attributed to
the user's line, for an ``(N,)`` output whose examples the default ``trace_axes`` traces, and for
outputs far larger than a kernel usually needs; none for the usual logits.

Every kernel computed here is checked against the float64 brute force of
``torchntk.testing.reference_ntk``: a notice changes nothing in what is computed.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchntk
from tests.cases import to_device
from torchntk._layout.notices import LARGE_OUTPUT_ENTRIES
from torchntk.testing import assert_kernels_close, reference_ntk

F64 = torch.float64


def _inputs(n1: int = 5, n2: int = 4, features: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return to_device(tuple(torch.randn(n, features, dtype=F64, generator=generator) for n in (n1, n2)))


def _seeded(module: type, *args) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return to_device(module(*args).double())


class _Regression(nn.Module):
    """A regression head ending in ``.squeeze(-1)``: outputs ``(N,)``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


class _Hidden(nn.Module):
    """Like Hugging Face's encoders: a dict of every hidden state beside the pooled output."""

    def __init__(self, width: int = 1000) -> None:
        super().__init__()
        self.encoder = nn.Linear(3, width)
        self.pooler = nn.Linear(3, 4)  # from the input: small Jacobians for the reference

    def forward(self, x: torch.Tensor) -> dict:
        return {"last_hidden_state": torch.tanh(self.encoder(x)), "pooler_output": torch.tanh(self.pooler(x))}


def _notices(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, torchntk.OutputWarning)]


def _recorded(compute):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = compute()
    return result, caught


@pytest.mark.parametrize("vmap_axes", ["auto", 0, None])
@pytest.mark.parametrize("implementation", [0, 1, 2, 3], ids=["AUTO", "JC", "NVP", "SD"])
def test_traced_examples_of_an_n_output_are_warned_once(vmap_axes, implementation):
    model = _seeded(_Regression)
    x1, _ = _inputs(5, 5)
    _, x2 = _inputs(5, 5)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=vmap_axes, implementation=implementation)
    kernel, caught = _recorded(lambda: ntk_fn(x1, x2))
    [notice] = _notices(caught)
    assert notice.startswith("ntk_fn: the output has shape (5,), one entry per example, and `trace_axes`=(-1,)")
    assert "pass trace_axes=()" in notice and "no .squeeze(-1)" in notice and "trace_axes=(0,)" in notice
    [warning] = [w for w in caught if issubclass(w.category, torchntk.OutputWarning)]
    assert warning.filename == __file__  # the user's line, not torchntk's
    assert kernel.shape == ()  # neural-tangents' semantics, unchanged
    assert_kernels_close(kernel, reference_ntk(model, x1, x2), rtol=1e-10)
    # later calls of the same kernel function, the same shapes or new ones, say nothing more
    again, caught = _recorded(lambda: (ntk_fn(x1, x2), ntk_fn(x1), ntk_fn(x1[:3], x2[:3])))
    assert _notices(caught) == []
    assert_kernels_close(again[0], kernel, rtol=1e-12)
    # a new kernel function says it again
    _, caught = _recorded(lambda: torchntk.empirical_ntk_fn(model, vmap_axes=vmap_axes)(x1))
    assert len(_notices(caught)) == 1


def test_a_kernel_function_built_again_gives_its_notice_once_too():
    """NOTE: [Plans shared by kernel functions]: a kernel function built again with the same
    options binds its first call to the plans of the first one, and still gives the notice once,
    from the user's line; its later calls say nothing more."""
    model = _seeded(_Regression)
    x1, x2 = _inputs(5, 5)
    for _ in range(3):  # the first kernel function plans; the later ones bind to its plans
        ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
        kernel, caught = _recorded(lambda: ntk_fn(x1, x2))
        [warning] = [w for w in caught if issubclass(w.category, torchntk.OutputWarning)]
        assert "one entry per example" in str(warning.message) and warning.filename == __file__
        assert_kernels_close(kernel, reference_ntk(model, x1, x2), rtol=1e-10)
        _, caught = _recorded(lambda: (ntk_fn(x1, x2), ntk_fn(x1)))
        assert _notices(caught) == []


def test_what_the_notice_says_to_pass_is_not_warned():
    model = _seeded(_Regression)
    x1, x2 = _inputs()
    for trace_axes in ((), (0,), 0):
        ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=trace_axes)
        kernel, caught = _recorded(lambda: ntk_fn(x1, x2 if trace_axes == () else x1))
        assert _notices(caught) == [], trace_axes
        expected = reference_ntk(model, x1, x2 if trace_axes == () else x1, trace_axes=trace_axes)
        assert_kernels_close(kernel, expected, rtol=1e-10)
    # an output whose only axis is not the examples' (a sum over the batch, of another size)
    pooled = _seeded(nn.Linear, 3, 1)
    _, caught = _recorded(lambda: torchntk.empirical_ntk_fn(lambda p, x: torch.func.functional_call(pooled, p, x).sum(0),
                                                            vmap_axes=None)(x1, None, dict(pooled.named_parameters())))
    assert _notices(caught) == []


def test_the_nngp_warns_too_and_differently_sized_inputs_say_what_to_pass():
    model = _seeded(_Regression)
    x1, x2 = _inputs(5, 4)
    nngp_fn = torchntk.empirical_nngp_fn(model)
    with pytest.warns(torchntk.OutputWarning, match=r"^nngp_fn: the output has shape \(5,\), one entry per example"):
        assert nngp_fn(x1).shape == ()
    with pytest.raises(ValueError, match=r"traced axis 0 of size 5 for x1 but 4 for x2.*pass trace_axes=\(\) for "
                                         r"the \(N1, N2\) kernel.*no \.squeeze\(-1\)"):
        torchntk.empirical_ntk_fn(model)(x1, x2)


def test_several_large_output_leaves_name_output_fn_once():
    model = _seeded(_Hidden)
    x1, x2 = _inputs(3, 2)
    ntk_fn = torchntk.empirical_ntk_fn(model)
    kernels, caught = _recorded(lambda: ntk_fn(x1, x2))
    [notice] = _notices(caught)
    assert notice.startswith("ntk_fn: the model returns 2 output leaves (output['last_hidden_state'] (3, 1000), "
                             "output['pooler_output'] (3, 4)), 1004 entries per example in all")
    assert "output_fn=lambda o: o.pooler_output" in notice
    assert [w.filename for w in caught if issubclass(w.category, torchntk.OutputWarning)] == [__file__]
    expected = reference_ntk(model, x1, x2)
    for key in expected:
        assert_kernels_close(kernels[key], expected[key], rtol=1e-10)
    _, caught = _recorded(lambda: (ntk_fn(x1, x2), ntk_fn(x1[:2])))
    assert _notices(caught) == []  # once per kernel function
    # selecting one output is the fix, and is not warned about
    selected = torchntk.empirical_ntk_fn(model, output_fn=lambda o: o["pooler_output"])
    kernel, caught = _recorded(lambda: selected(x1, x2))
    assert _notices(caught) == []
    assert_kernels_close(kernel, expected["pooler_output"], rtol=1e-10)


def test_the_thresholds_leave_usual_outputs_alone():
    x1, x2 = _inputs(3, 2)
    # 10 and 1000 logits, traced or not; two small output leaves; 1000 entries per example in all
    quiet = [
        (_seeded(nn.Linear, 3, 10), {}),
        (_seeded(nn.Linear, 3, 10), {"trace_axes": ()}),
        (_seeded(nn.Linear, 3, LARGE_OUTPUT_ENTRIES), {}),
        (_seeded(nn.Linear, 3, LARGE_OUTPUT_ENTRIES), {"trace_axes": ()}),
        (_seeded(_Hidden, 30), {}),
        (_seeded(_Hidden, LARGE_OUTPUT_ENTRIES - 4), {}),
    ]
    for model, options in quiet:
        _, caught = _recorded(lambda: torchntk.empirical_ntk_fn(model, implementation=1, **options)(x1, x2))
        assert _notices(caught) == [], (model, options)
    # one entry more per example than the threshold: several leaves, or one leaf kept whole
    loud = [
        (_seeded(_Hidden, LARGE_OUTPUT_ENTRIES - 3), {}, "2 output leaves"),
        (_seeded(nn.Linear, 3, LARGE_OUTPUT_ENTRIES + 1), {"trace_axes": ()}, "each example keeps 1001 output coordinates"),
    ]
    for model, options, said in loud:
        _, caught = _recorded(lambda: torchntk.empirical_ntk_fn(model, implementation=1, **options)(x1, x2))
        [notice] = _notices(caught)
        assert said in notice and "output_fn" in notice, notice
