"""Shared test set-up: the repository root on sys.path (so ``tests.cases`` imports), seeds, and the
``--device`` option.

``python -m pytest --device cuda`` (default ``cpu``) builds the shared model cases of
``tests/cases.py`` and their inputs on that device, and the ``device`` fixture gives it to any
test that asks; the float64 references are computed from the same modules and inputs, wherever
they are. Tests that build their own CPU models run on the CPU whatever ``--device`` says.
"""

import pathlib
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

# torchvision's PyPI wheel is built against CUDA torch; beside the CPU wheel its import fails while
# registering its detection ops, and transformers and timm import it. The models use none of those
# ops (see tests/zoo.py), so the registrations are skipped for every test, docs examples included.
from tests.zoo import skip_torchvision_op_registrations  # noqa: E402 - needs the repository root on sys.path

skip_torchvision_op_registrations()

# The test models are tiny: one thread avoids OpenMP start-up and, on a busy 2-core machine,
# spinning threads that made single small ops a hundred times slower.
torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device", default="cpu",
        help="device of the shared test models and inputs (tests/cases.py), e.g. cuda or cuda:1; default: cpu",
    )


def pytest_configure(config: pytest.Config) -> None:
    from tests import cases

    cases.DEVICE = device_option(config.getoption("--device"))


def device_option(name: str) -> torch.device:
    """The ``--device`` option as a device, or a usage error saying why it cannot be used here."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as error:
        raise pytest.UsageError(f"--device: {name!r} is not a torch device ({error}).") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {name}: this PyTorch has no CUDA device available.")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise pytest.UsageError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) here.")
    return device


@pytest.fixture
def device() -> torch.device:
    """The device of the test run (``--device``)."""
    from tests import cases

    return cases.DEVICE


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
