"""PyTorch's batching-rule warnings for the operations torchntk handles stay inside torchntk's calls;
every other warning, the model's own included, reaches the user (NOTE: [Known PyTorch warnings])."""

from __future__ import annotations

import contextlib
import threading
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchntk
from tests import zoo
from tests._processes import run_python
from torchntk._kernel import kernel_function
from torchntk._utils import quiet_warnings

pytestmark = pytest.mark.cpu_only("the warnings silenced are those of PyTorch's CPU attention kernels")

DROP = "There is a performance drop because we have not yet implemented the batching rule for aten::"


class Attention(nn.Module):
    """Self-attention through ``scaled_dot_product_attention`` on 4-d inputs, as Hugging Face calls
    it: per example under vmap, PyTorch takes its CPU flash kernel's batching fallback, and warns."""

    def __init__(self, renorm: bool = False):
        super().__init__()
        self.project = nn.Linear(8, 8)
        self.renorm = renorm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        warnings.warn("the model's own warning", UserWarning)
        h = self.project(x)
        if self.renorm:  # an operation without a batching rule that torchntk knows nothing about
            h = torch.renorm(h if h.ndim == 3 else h[None], 2, 0, 5.0).reshape(h.shape)  # per example
        q = h.unflatten(-1, (2, 4)).transpose(-2, -3)
        q = q if q.ndim == 4 else q[None]
        return F.scaled_dot_product_attention(q, q, q).sum((-3, -2)).reshape(*x.shape[:-2], 4)


def _recorded(compute) -> list[str]:
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        compute()
    return [str(warning.message) for warning in log]


def _dropped(messages: list[str]) -> set[str]:
    return {message[len(DROP):].split(".")[0] for message in messages if message.startswith(DROP)}


@pytest.mark.parametrize("name", ["multihead_attention", "transformer_encoder"])
def test_the_fast_paths_of_torchs_attention_layers_are_quiet(name):
    case = getattr(zoo, name)()
    assert _dropped(_recorded(lambda: torch.func.vmap(case.module)(case.x1)))  # PyTorch warns outside
    messages = _recorded(lambda: torchntk.empirical_ntk_fn(case.module, vmap_axes=0)(case.x1, case.x2))
    assert not _dropped(messages), messages


@pytest.mark.parametrize("implementation", [0, 1, 2, 3])
def test_the_attention_fallback_warning_stays_inside_and_the_models_own_warning_does_not(implementation):
    model, x = Attention().eval(), torch.randn(3, 5, 8)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)
    filters = list(warnings.filters)
    messages = _recorded(lambda: (ntk_fn(x), ntk_fn.auto_choice(x)))
    assert "the model's own warning" in messages
    assert not _dropped(messages), messages
    assert warnings.filters == filters  # nothing left behind
    # The same computation outside torchntk still warns: the model does reach the fallback, and
    # the filter is gone after the call.
    assert "_scaled_dot_product_flash_attention_for_cpu" in _dropped(_recorded(lambda: torch.func.vmap(model)(x)))


def test_without_the_hook_the_warning_would_reach_the_user(monkeypatch):
    model, x = Attention().eval(), torch.randn(3, 5, 8)
    monkeypatch.setattr(kernel_function, "known_warnings_silenced", contextlib.nullcontext)
    dropped = _dropped(_recorded(lambda: torchntk.empirical_ntk_fn(model, vmap_axes=0)(x)))
    assert dropped >= {"_scaled_dot_product_flash_attention_for_cpu",
                       "_scaled_dot_product_flash_attention_for_cpu_backward"}, dropped


def test_an_operation_torchntk_does_not_know_still_warns():
    model, x = Attention(renorm=True).eval(), torch.randn(3, 5, 8)
    dropped = _dropped(_recorded(lambda: torchntk.empirical_ntk_fn(model, vmap_axes=0)(x)))
    assert dropped == {"renorm"}, dropped


def test_sketches_and_spectra_are_quiet_too():
    model, x = Attention().eval(), torch.randn(6, 5, 8)
    messages = _recorded(lambda: (
        torchntk.sketched_ntk_features_fn(model, 16, vmap_axes=0)(x),
        torchntk.ntk_eigenpairs(model, x, 2),
    ))
    assert "the model's own warning" in messages and not _dropped(messages), messages


class _Overlapping(Attention):
    """Records how many kernel computations were under way at once while it ran."""

    depths: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.depths.append(quiet_warnings._silenced._depth)
        time.sleep(0.002)  # leaves the other thread time to enter
        return super().forward(x)


def test_threads_computing_at_once_leave_the_users_filters_as_they_are():
    model, x = _Overlapping().eval(), torch.randn(4, 5, 8)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
    barrier, errors = threading.Barrier(3), []

    def compute() -> None:
        try:
            barrier.wait(timeout=60)
            for _ in range(3):
                ntk_fn(x)
        except BaseException as error:  # re-raised below, on the test's thread
            errors.append(error)

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="the model's own warning")
        threads = [threading.Thread(target=compute) for _ in range(2)]
        for thread in threads:
            thread.start()
        barrier.wait(timeout=60)
        warnings.filterwarnings("ignore", message="a filter the user adds meanwhile")
        for thread in threads:
            thread.join(timeout=120)
        assert not errors and not any(thread.is_alive() for thread in threads), errors
        assert warnings.filters[0][1].pattern == "a filter the user adds meanwhile"
        assert not any(entry is known for entry in warnings.filters for known in quiet_warnings._FILTERS)
    assert quiet_warnings._silenced._depth == 0 and quiet_warnings._silenced._undo is None
    assert max(_Overlapping.depths) == 2  # the two threads did compute at once


def _bert_logits(output):
    warnings.warn("output_fn's own warning", UserWarning)
    return output.logits


def _gpt2_last_token_logits(output, input_ids, attention_mask):
    warnings.warn("output_fn's own warning", UserWarning)
    return zoo.last_token_logits(output, input_ids, attention_mask)


@pytest.mark.parametrize("name, output_fn", [("bert", _bert_logits), ("gpt2", _gpt2_last_token_logits)])
def test_hugging_face_kernels_are_quiet_but_the_users_output_fn_is_heard(name, output_fn):
    case = getattr(zoo, name)()
    ntk_fn = torchntk.empirical_ntk_fn(case.module, vmap_axes=case.vmap_axes, output_fn=output_fn)
    messages = _recorded(lambda: ntk_fn(case.x1, case.x2, **case.kwargs))
    assert "output_fn's own warning" in messages
    assert not _dropped(messages), messages


SCRIPTED = """
import warnings
warnings.simplefilter("always")
import torch, torchntk
model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
torchntk.empirical_ntk_fn(model, implementation=2)(torch.randn(3, 3))   # forward mode scripts decompositions
print("computed", flush=True)


def plus_one(x: torch.Tensor) -> torch.Tensor:
    return x + 1


torch.jit.script(plus_one)                                              # the user's own script
"""


def test_pytorchs_own_torch_jit_script_warning_stays_inside_torchntk_but_the_users_is_heard(tmp_path):
    # In a fresh process: forward-mode AD scripts its decompositions once per process. The warning
    # is a DeprecationWarning up to torch 2.13 and a FutureWarning from 2.14; "always" shows both.
    # A file, not -c: TorchScript reads the source of what it scripts.
    script = tmp_path / "scripted.py"
    script.write_text(SCRIPTED)
    done = run_python(script, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "computed" in done.stdout
    assert done.stderr.count("`torch.jit.script` is deprecated") == 1, done.stderr  # the user's call only
