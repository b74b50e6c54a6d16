"""Shared test set-up: the repository root on sys.path (so ``tests.cases`` imports), seeds, and the
``--device`` option.

``python -m pytest --device cuda`` (default ``cpu``) builds the shared model cases of
``tests/cases.py`` and their inputs on that device, and the ``device`` fixture gives it to any
test that asks; the float64 references are computed from the same modules and inputs, wherever
they are; the test files move their own models and inputs there with ``tests.cases.to_device``.
Tests marked ``cpu_only(reason)`` (the command line, docs, several processes, NumPy errors,
CPU-only kernels, a child process's bits) run on the CPU whatever ``--device`` says: for them
the run device is the CPU, and the terminal summary of a run on another device counts them with
their reasons. Tests marked ``cuda_only(reason)`` check what exists on CUDA alone (streams' memory
statistics); other runs skip them, saying so (``pytest -rs`` lists them). Tests that need an
optional library (torchvision, timm, transformers, peft: ``tests/zoo.py``) are skipped where it does
not import, and the summary says which and why.
"""

import collections
import os
import pathlib
import sys
from typing import Any, Iterator, Optional

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

# Only where CI asks for it (TORCHNTK_TEST_STUB_TORCHVISION_OPS=1, see tests/zoo.py): PyPI's
# CUDA-built torchvision imported beside a CPU torch, for every test, docs examples included. Only
# the floor of CI's matrix needs it; the other releases install torch and torchvision together.
from tests import zoo  # noqa: E402 - needs the repository root on sys.path

zoo.skip_torchvision_op_registrations()

# The test models are tiny: one thread avoids OpenMP start-up and, on a busy 2-core machine,
# spinning threads that made single small ops a hundred times slower.
torch.set_num_threads(1)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device", default="cpu",
        help="device of the shared test models and inputs (tests/cases.py), e.g. cuda or cuda:1; default: cpu",
    )


# The memory one test process (a pytest-xdist worker, with the children it starts) is given: the
# slow run's largest was 7.3 GB, one child of the memory grid; the fast run's 3.4 GB, and most
# tests hold far less (docs/benchmarks.md, "The test suite in one process per core").
_WORKER_BYTES = 6 * 2**30


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: no error where it is not installed
def pytest_xdist_auto_num_workers(config: pytest.Config) -> Optional[int]:
    """``-n auto``: one worker per core this process may use, but no more than the available memory
    holds (:data:`_WORKER_BYTES` each), at least one. ``PYTEST_XDIST_AUTO_NUM_WORKERS`` still wins."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # pytest-xdist's own hook reads it
    from torchntk import _memory

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory = _memory.available_bytes(torch.device("cpu")) // _WORKER_BYTES
    return max(1, int(min(cores, memory)))


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
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # what tensors moved there report
    return device


def pytest_report_header(config: pytest.Config) -> list[str]:
    # Which torch ran, and whether torchvision's op registrations were stubbed: CI runs the suite on
    # several releases (.ci/run), and only the floor's step stubs them.
    stub = sys.modules.get("torchvision._meta_registrations")
    stubbed = stub is not None and getattr(stub, "__file__", None) is None
    registrations = f"stubbed ({zoo.STUB_VARIABLE}=1)" if stubbed else "not stubbed"
    return [
        f"torchntk test device: {config.getoption('--device')} (--device)",
        f"torch {torch.__version__}; torchvision's op registrations {registrations}",
    ]


_CPU_ONLY_PROPERTY = "cpu_only"


@pytest.hookimpl(trylast=True)  # after -k/-m deselection, so that only the tests that run are counted
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests import cases

    elsewhere = cases.DEVICE.type != "cpu"
    for item in items:
        cuda_marker = item.get_closest_marker("cuda_only")
        if cuda_marker is not None:
            reason = _marker_reason(item, cuda_marker)
            if cases.DEVICE.type != "cuda":
                item.add_marker(pytest.mark.skip(reason=f"needs --device cuda: {reason}"))
        if elsewhere and isinstance(item, pytest.DoctestItem):
            item.add_marker(pytest.mark.cpu_only("docstring examples run as written, on the CPU"))
        marker = item.get_closest_marker("cpu_only")
        if marker is not None:
            reason = _marker_reason(item, marker)  # checked on every run, so that CPU runs catch a missing one
            if elsewhere:
                # On the test's report, not in this process: under pytest-xdist the workers collect
                # and run the tests, and only their reports reach the process that prints the summary.
                item.user_properties.append((_CPU_ONLY_PROPERTY, reason))


def _marker_reason(item: pytest.Item, marker: pytest.Mark) -> str:
    reason = marker.args[0] if marker.args else marker.kwargs.get("reason")
    if not isinstance(reason, str) or not reason:
        raise pytest.UsageError(
            f"{item.nodeid}: {marker.name} needs a reason, e.g. pytest.mark.{marker.name}(\"what it checks\")."
        )
    return reason


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    _summarise_optional_libraries(terminalreporter)
    reasons: collections.Counter = collections.Counter(
        value
        for report in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", [])
        if report.when == "call"
        for name, value in report.user_properties
        if name == _CPU_ONLY_PROPERTY
    )
    if not reasons:
        return
    device = config.getoption("--device")
    terminalreporter.section(f"tests run on the CPU under --device {device}")
    terminalreporter.write_line(f"{sum(reasons.values())} test(s) ran on the CPU (cpu_only), because:")
    for reason, count in sorted(reasons.items()):
        terminalreporter.write_line(f"  {count:5d}  {reason}")


def _summarise_optional_libraries(terminalreporter) -> None:
    """Says which optional libraries did not import and how many tests that skipped, with why."""
    reasons: collections.Counter = collections.Counter()
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        if reason.startswith(zoo.SKIP_PREFIX):
            reasons[reason] += 1
    if not reasons:
        return
    terminalreporter.section("tests skipped: optional libraries that do not import")
    for reason, count in sorted(reasons.items()):
        terminalreporter.write_line(f"  {count:5d}  {reason}")


@pytest.fixture(autouse=True)
def _run_device(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """The run device, which is the CPU for tests marked ``cpu_only``: ``tests.cases`` builds there."""
    from tests import cases

    run_device = cases.DEVICE
    if request.node.get_closest_marker("cpu_only") is None or run_device.type == "cpu":
        yield run_device
        return
    cases.DEVICE = torch.device("cpu")
    try:
        yield cases.DEVICE
    finally:
        cases.DEVICE = run_device


@pytest.fixture
def device(_run_device: torch.device) -> torch.device:
    """The device of the test run (``--device``; the CPU for tests marked ``cpu_only``)."""
    return _run_device


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _plans_of_this_test() -> None:
    """Every test plans its models anew: kernel functions of one model built with the same options
    share their plans (NOTE: [Plans shared by kernel functions] in ``torchntk/_plan/shared.py``), and
    the models some test modules build once (``functools.lru_cache``) would otherwise come to a
    test planned by whichever test ran before it in the same process."""
    from torchntk._plan.shared import forget_shared_planners

    forget_shared_planners()


@pytest.fixture
def monkeypatch(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """pytest's ``monkeypatch``, after whose every ``setattr`` kernel functions built anew plan
    anew: tests patch a module's constant (a working-set bound, a switch) and then build a kernel
    function of a model an earlier one planned, to see what the constant changes; without this it
    would share the earlier one's plans (NOTE: [Plans shared by kernel functions])."""
    from torchntk._plan.shared import forget_shared_planners

    patch = monkeypatch.setattr

    def setattr_and_plan_anew(*args: Any, **kwargs: Any) -> None:
        patch(*args, **kwargs)
        forget_shared_planners()

    monkeypatch.setattr = setattr_and_plan_anew  # type: ignore[method-assign]
    return monkeypatch


@pytest.fixture
def eager_computations(monkeypatch):
    """A list that grows by one (the call's plan key) for every eager kernel computation, capture
    traces included: what shows that a ``compile=`` call was replayed or computed anew."""
    from torchntk._kernel.settings import NtkSettings

    calls = []
    original = NtkSettings.ntk

    def counted(self, call, caller=None):
        calls.append(call.plan_key)
        return original(self, call, caller)

    monkeypatch.setattr(NtkSettings, "ntk", counted)
    return calls
