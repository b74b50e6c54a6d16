"""``benchmarks/bench_overhead.py``: its ATen counter counts what runs, and its rows measure."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

from tests._processes import run_python

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_overhead.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_overhead", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_overhead", module)  # its dataclasses look their module up
    spec.loader.exec_module(sys.modules["bench_overhead"])
    return sys.modules["bench_overhead"]


bench = _bench()


def test_the_counter_counts_each_operation_once():
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    counter = bench.count_aten(lambda: torch.mul(torch.add(x, y), y))
    assert counter.calls == 2
    assert dict(counter.ops) == {"aten::add": 1, "aten::mul": 1}
    assert counter.copies == 0 and counter.views == 0


def test_the_counter_tells_copies_and_views_apart():
    x = torch.randn(3, 4)
    counter = bench.count_aten(lambda: x.t().contiguous().view(12) * 2)
    assert counter.ops["aten::clone"] == 1  # what .contiguous() of a transposed tensor runs
    assert counter.copies == 1
    assert counter.views == counter.ops["aten::t"] + counter.ops["aten::view"] >= 2
    assert counter.calls == counter.copies + counter.views + counter.ops["aten::mul"]


def test_python_calls_are_counted_exactly():
    """The same call counts the same; one more Python function called counts one more (or two,
    with the built-ins it calls)."""

    def inner() -> int:
        return 1

    def outer(times: int) -> None:
        for _ in range(times):
            inner()

    once, again, twice = (bench.count_python(lambda n=n: outer(n)) for n in (1, 1, 2))
    assert once == again and twice == once + 1


def test_the_counter_sees_the_operations_under_torch_func():
    """vmap and jacrev run below the mode's dispatch key: the batched and backward operations count."""
    weight = torch.randn(4, 3)
    plain = bench.count_aten(lambda: torch.randn(5, 3) @ weight.T)
    derived = bench.count_aten(lambda: torch.func.vmap(torch.func.jacrev(lambda w, x: torch.tanh(w @ x)), (None, 0))(
        weight, torch.randn(5, 3)))
    assert plain.calls >= 1 and derived.calls > plain.calls


def test_a_tiny_row_measures_every_implementation_and_agrees_with_the_tutorial():
    row = bench.bench_row("tiny", 2, False, torch.device("cpu"))
    row.implementations = (1, 2, 3, 0)
    results = bench.measure_row(row, 1, 1, True, torch.device("cpu"))
    assert set(results) == {"1", "2", "3", "AUTO", "tutorial"}
    for result in results.values():
        assert not result.error, result.error
        assert result.counter.calls > 0 and len(result.seconds) == 1
        assert result.counter.calls >= result.counter.copies + result.counter.views
        assert result.python_calls > 0
        wall, outside = result.python
        assert 0 <= outside <= wall
    assert results["AUTO"].pick in (1, 2, 3)
    table = bench.table_rows(row, results, True)
    assert [cells[1] for cells in table][-1] == "tutorial"
    headers = bench.HEADERS
    for cells in table[:-1]:
        assert float(cells[headers.index("max rel. diff from tutorial")]) < 1e-5
    assert table[-1][headers.index("ATen calls / tutorial")] == "1.00"  # the tutorial's over its own
    assert table[-1][headers.index("Python calls")] == str(results["tutorial"].python_calls)


@pytest.mark.slow
@pytest.mark.cpu_only("runs a benchmark script in a child process")
def test_the_script_writes_its_tables(tmp_path):
    markdown = tmp_path / "overhead.md"
    done = run_python(str(SCRIPT), "--rows", "tiny,mlp", "--repeats", "1", "--tiny-rounds", "1",
                      "--tiny-repeats", "2", "--markdown", str(markdown), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    text = markdown.read_text()
    assert "| mlp | AUTO (picks" in text and "| tiny | tutorial |" in text
    assert "torchntk / tutorial host time:" in text and "torchntk:" in done.stdout
