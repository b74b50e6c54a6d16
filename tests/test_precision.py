"""Kernels run with TF32 off unless asked (NOTE: [Kernel precision]); PyTorch's settings are
restored after every call, and the user's own settings are left as they were."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchntk
from tests._processes import run_python
from torchntk.testing import assert_kernels_close, reference_ntk

SEEN: list = []
"""What the spies saw (module-level: torchntk runs private shells of the module, NOTE: [Modules are
never mutated], whose list attributes are copies)."""


class Spy(nn.Module):
    """Records PyTorch's precision settings each time it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.seen = SEEN
        SEEN.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN.append(_settings())
        return self.linear(x)


def _settings() -> tuple:
    backends = torch.backends
    return (torch.get_float32_matmul_precision(), backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32)


@pytest.fixture
def user_allows_tf32():
    """The user's own settings: TF32 everywhere (restored after the test)."""
    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True
    yield _settings()
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cudnn.allow_tf32 = before[1]


@pytest.mark.parametrize("builder", ["ntk", "nngp", "batch"])
def test_kernels_run_in_float32_and_restore_the_users_settings(builder, user_allows_tf32):
    model = Spy()
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
    kernel_fn = {"ntk": ntk_fn, "nngp": torchntk.empirical_nngp_fn(model), "batch": torchntk.batch(ntk_fn, 2)}[builder]
    x = torch.randn(5, 3)
    kernel_fn(x)
    assert model.seen and set(model.seen) == {("highest", False, False)}
    assert _settings() == user_allows_tf32


@pytest.mark.parametrize("mode, expected", [("tf32", ("high", True, True)), ("bfloat16", ("medium", True, True))])
def test_faster_modes_on_request(mode, expected):
    model = Spy()
    before = _settings()
    x = torch.randn(4, 3)
    with torchntk.precision(mode):
        kernel = torchntk.empirical_ntk_fn(model, vmap_axes=0)(x)
    assert set(model.seen) == {expected}
    assert _settings() == before
    assert_kernels_close(kernel, reference_ntk(model, x, None))  # on CPU the modes change nothing


def test_settings_are_restored_when_the_model_raises():
    class Failing(nn.Linear):
        def forward(self, x):
            raise RuntimeError("model failure")

    before = _settings()
    with pytest.raises(RuntimeError, match="model failure"), torchntk.precision("tf32"):
        torchntk.empirical_ntk_fn(Failing(3, 2))(torch.randn(2, 3))
    assert _settings() == before


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="`mode` must be one of"):
        with torchntk.precision("float16"):
            pass


_NEWER_API_SCRIPT = """
import pytest, torch, torchntk
from torch import nn

pytestmark = pytest.mark.cpu_only("builds its own models and inputs on the CPU (not converted to --device yet)")

seen = []
matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv


class Spy(nn.Linear):
    def forward(self, x):
        seen.append((matmul.fp32_precision, conv.fp32_precision))
        return super().forward(x)


matmul.fp32_precision = conv.fp32_precision = "tf32"
torchntk.empirical_ntk_fn(Spy(3, 2))(torch.randn(2, 3))
assert set(seen) == {("ieee", "ieee")}, seen
assert (matmul.fp32_precision, conv.fp32_precision) == ("tf32", "tf32")
with pytest.raises(ValueError, match="bfloat16 mode for CUDA"), torchntk.precision("bfloat16"):
    torchntk.empirical_ntk_fn(Spy(3, 2))(torch.randn(2, 3))
print("ok")
"""


def test_the_newer_precision_api_is_used_when_the_process_uses_it():
    """Once a process used PyTorch's newer precision API, reading the legacy flags raises; torchntk
    then uses the newer one. In a child process: the API a process used cannot be undone."""
    result = run_python("-c", _NEWER_API_SCRIPT)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
