"""Shared test set-up: the repository root on sys.path (so ``tests.cases`` imports) and seeds."""

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


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
