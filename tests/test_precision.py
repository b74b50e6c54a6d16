"""Kernels run with TF32 off unless asked (NOTE: [Kernel precision]); PyTorch's settings are
restored after every call, and the user's own settings are left as they were.

Models and inputs live on the run device (``pytest --device``), inputs drawn on the CPU and moved.
The settings are process-wide, so the tests about them hold on every device; their effect on the
numbers is checked on the run device with tolerances that hold wherever a mode is real (TF32 on
Ampere and later NVIDIA GPUs, bfloat16 products on CUDA and on CPUs with bfloat16 matrix units).
"""

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


def _randn(device: torch.device, *shape: int, seed: int = 1) -> torch.Tensor:
    """A float32 tensor on ``device``, drawn on the CPU so that every device sees the same numbers."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


_MODE_TOLERANCES = {
    # mode: (rtol, atol as a fraction of max|expected|), the rows of assert_kernels_close for the
    # significand each mode keeps: IEEE float32; TF32 keeps float16's 10-bit mantissa; bfloat16.
    None: (1e-4, 1e-5),
    "tf32": (1e-2, 1e-3),
    "bfloat16": (5e-2, 1e-2),
}


def _assert_accurate_for(mode, actual: torch.Tensor, expected: torch.Tensor) -> None:
    """``actual`` agrees with the float64 ``expected`` as closely as products in ``mode`` allow."""
    rtol, atol = _MODE_TOLERANCES[mode]
    assert_kernels_close(actual, expected, rtol=rtol, atol=atol * expected.abs().max().item())


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
def test_kernels_run_in_float32_and_restore_the_users_settings(builder, user_allows_tf32, device):
    model = Spy().to(device)
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
    kernel_fn = {"ntk": ntk_fn, "nngp": torchntk.empirical_nngp_fn(model), "batch": torchntk.batch(ntk_fn, 2)}[builder]
    kernel_fn(_randn(device, 5, 3))
    assert model.seen and set(model.seen) == {("highest", False, False)}
    assert _settings() == user_allows_tf32


@pytest.mark.parametrize("mode, expected", [("tf32", ("high", True, True)), ("bfloat16", ("medium", True, True))])
def test_faster_modes_on_request(mode, expected, device):
    model = Spy().to(device)
    before = _settings()
    x = _randn(device, 4, 3)
    with torchntk.precision(mode):
        kernel = torchntk.empirical_ntk_fn(model, vmap_axes=0)(x)
    assert set(model.seen) == {expected}
    assert _settings() == before
    _assert_accurate_for(mode, kernel, reference_ntk(model, x, None))


class _ConvolutionAndProducts(nn.Module):
    """A convolution (cuDNN's TF32 switch) and a wide matrix product (cuBLAS's): on a GPU with TF32,
    either would put errors of about 1e-3 into a float32 kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.convolution = nn.Conv2d(3, 16, 3)
        self.linear = nn.Linear(16 * 6 * 6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(self.convolution(x)).flatten(1))


@pytest.mark.parametrize("mode", [None, "tf32", "bfloat16"], ids=["default", "tf32", "bfloat16"])
@pytest.mark.parametrize("implementation", [1, 2, 3], ids=["JC", "NVP", "SD"])
def test_float32_kernels_have_the_accuracy_of_their_mode(implementation, mode, user_allows_tf32, device):
    """The user allows TF32, yet by default a float32 kernel has float32 accuracy; the faster modes,
    asked for, stay within their own significand's accuracy. Where a mode is not real (TF32 on the
    CPU), its kernel is simply more accurate than its tolerance asks."""
    torch.manual_seed(0)
    model = _ConvolutionAndProducts().to(device).eval()
    x1, x2 = _randn(device, 4, 3, 8, 8, seed=1), _randn(device, 3, 3, 8, 8, seed=2)
    expected = reference_ntk(model, x1, x2)
    # The vmap_axes check runs too: it compares a batch with single examples at the mode's precision
    # (bfloat16 on a CPU with bfloat16 units differs by about 5e-3, which float32 tolerances refused).
    ntk_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=implementation)
    if mode is None:
        actual = ntk_fn(x1, x2)
    else:
        with torchntk.precision(mode):
            actual = ntk_fn(x1, x2)
    assert actual.dtype == torch.float32 and actual.device == x1.device
    _assert_accurate_for(mode, actual, expected)
    assert _settings() == user_allows_tf32


def test_settings_are_restored_when_the_model_raises(device):
    class Failing(nn.Linear):
        def forward(self, x):
            raise RuntimeError("model failure")

    before = _settings()
    with pytest.raises(RuntimeError, match="model failure"), torchntk.precision("tf32"):
        torchntk.empirical_ntk_fn(Failing(3, 2).to(device))(_randn(device, 2, 3))
    assert _settings() == before


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="`mode` must be one of"):
        with torchntk.precision("float16"):
            pass


_NEWER_API_SCRIPT = """
import sys
import pytest, torch, torchntk
from torch import nn

device = torch.device(sys.argv[1])
seen = []
matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv


class Spy(nn.Linear):
    def forward(self, x):
        seen.append((matmul.fp32_precision, conv.fp32_precision))
        return super().forward(x)


matmul.fp32_precision = conv.fp32_precision = "tf32"
torchntk.empirical_ntk_fn(Spy(3, 2).to(device))(torch.randn(2, 3).to(device))
assert set(seen) == {("ieee", "ieee")}, seen
assert (matmul.fp32_precision, conv.fp32_precision) == ("tf32", "tf32")
with pytest.raises(ValueError, match="bfloat16 mode for CUDA"), torchntk.precision("bfloat16"):
    torchntk.empirical_ntk_fn(Spy(3, 2).to(device))(torch.randn(2, 3).to(device))
print("ok")
"""


def test_the_newer_precision_api_is_used_when_the_process_uses_it(device):
    """Once a process used PyTorch's newer precision API, reading the legacy flags raises; torchntk
    then uses the newer one. In a child process on the run device: the API a process used cannot
    be undone."""
    result = run_python("-c", _NEWER_API_SCRIPT, device)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
