"""The suite's ``--device`` option (``tests/conftest.py``): where the shared cases live, and its errors."""

from __future__ import annotations

import pathlib

import pytest
import torch

from tests._processes import run_python
from tests.cases import CASES, make_x1_x2

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_cases_live_on_the_run_device(device: torch.device) -> None:
    case = CASES["cnn"]()
    x1, x2 = make_x1_x2(case)
    assert {p.device.type for p in case.module.parameters()} == {device.type}
    assert x1.device.type == x2.device.type == device.type
    # The same numbers on every device: inputs are drawn from a CPU generator, then moved.
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(x1.cpu(), case.make_inputs(3, generator).cpu())


@pytest.mark.parametrize(
    "value, message",
    [("bogus", "'bogus' is not a torch device"), ("cuda:99", "CUDA device")],
)
def test_an_unusable_device_is_a_usage_error(value: str, message: str) -> None:
    done = run_python(
        "-m", "pytest", "-q", "-p", "no:cacheprovider", "--device", value,
        f"{ROOT / 'tests' / 'test_device_option.py'}::test_cases_live_on_the_run_device", timeout=120,
    )
    assert done.returncode == pytest.ExitCode.USAGE_ERROR, done.stdout + done.stderr
    assert message in done.stderr


def test_the_report_header_names_the_device() -> None:
    done = run_python(
        "-m", "pytest", "-p", "no:cacheprovider", "--device", "cpu",
        f"{ROOT / 'tests' / 'test_device_option.py'}::test_cases_live_on_the_run_device", timeout=120,
    )
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr
    assert "torchntk test device: cpu (--device)" in done.stdout
    assert "tests run on the CPU under --device" not in done.stdout  # nothing to say on the CPU


@pytest.mark.cpu_only("checks that cpu_only tests run on the CPU")
def test_cpu_only_tests_see_the_cpu(device: torch.device) -> None:
    assert device.type == "cpu"
    case = CASES["mlp"]()
    assert {p.device.type for p in case.module.parameters()} == {"cpu"}
    assert make_x1_x2(case)[0].device.type == "cpu"


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_cpu_only_tests_run_on_the_cpu_and_the_summary_says_why(workers: list[str]) -> None:
    # The meta device stands in for a GPU here: a cpu_only test must still run, on the CPU, and pass.
    # Under pytest-xdist the summary is printed by a process that ran no test: the count comes with
    # the workers' reports.
    done = run_python(
        "-m", "pytest", "-p", "no:cacheprovider", "--device", "meta", *workers,
        f"{ROOT / 'tests' / 'test_device_option.py'}::test_cpu_only_tests_see_the_cpu", timeout=120,
    )
    assert done.returncode == pytest.ExitCode.OK, done.stdout + done.stderr
    assert "torchntk test device: meta (--device)" in done.stdout
    assert "tests run on the CPU under --device meta" in done.stdout
    assert "1 test(s) ran on the CPU (cpu_only), because:" in done.stdout
    assert "1  checks that cpu_only tests run on the CPU" in done.stdout
