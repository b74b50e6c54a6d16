"""The ``torchntk`` command: the demo and ``bench`` end to end on tiny configurations, and its errors."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from torchntk.cli import main


def _run(arguments: list[str]) -> int:
    return main(arguments + ["--progress", "off"])


def test_the_demo_prints_its_table_and_writes_figures_and_results(tmp_path, capsys):
    assert _run(["--n", "4", "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for text in ("kernel shape", "1 (Jacobian contraction)", "2 (NTK-vector products)", "3 (structured derivatives)",
                 "AUTO picks", "4x4"):
        assert text in out
    assert out.count(" yes") == 6  # 2 models x 3 implementations agree
    assert (tmp_path / "ntk_mlp.png").stat().st_size > 10_000
    assert (tmp_path / "ntk_cnn.png").stat().st_size > 10_000
    results = (tmp_path / "results.md").read_text()
    assert "| mlp | 3 (structured derivatives) | 4x4 |" in results


def test_full_kernels_float64_one_implementation(tmp_path, capsys):
    arguments = ["--model", "mlp", "--n", "3", "--trace-axes", "none", "--float64", "--implementation", "3"]
    assert _run(arguments + ["--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "3x3x10x10" in out and "1 (Jacobian" not in out
    assert (tmp_path / "ntk_mlp.png").exists()  # (N, N, O, O) is drawn as an (N O, N O) matrix


def test_a_user_model_factory(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_models.py").write_text(textwrap.dedent("""
        import torch
        def make():
            return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
        def not_a_module():
            return 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    output = tmp_path / "out"
    assert _run(["--model", "my_models:make", "--input-shape", "5", "--n", "3", "--output", str(output)]) == 0
    assert "my_models:make" in capsys.readouterr().out
    assert (output / "ntk_my_models_make.png").exists()
    assert _run(["--model", "my_models:not_a_module", "--input-shape", "5", "--output", str(output)]) == 2
    assert "returned int, not an nn.Module" in capsys.readouterr().err


def test_without_matplotlib_the_figure_is_skipped(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert _run(["--model", "mlp", "--n", "2", "--output", str(tmp_path)]) == 0
    assert "figure skipped: matplotlib is not installed" in capsys.readouterr().out
    assert not (tmp_path / "ntk_mlp.png").exists()
    assert (tmp_path / "results.md").exists()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--n", "0"], "argument --n: expected a positive integer, got '0'"),
        (["--model", "nonsense"], "--model 'nonsense': expected 'mlp', 'cnn' or 'module:callable'"),
        (["--model", "no_such_module_here:make", "--input-shape", "3"], "cannot import 'no_such_module_here'"),
        (["--model", "torch:no_such_factory", "--input-shape", "3"], "'torch' has no attribute 'no_such_factory'"),
        (["--model", "torch:randn"], "give the shape of one input example with --input-shape"),
        (["--model", "mlp", "--input-shape", "3,4"], "the built-in mlp takes inputs of shape 64"),
        (["--trace-axes", "x"], "expected comma-separated integers or 'none', got 'x'"),
        (["--trace-axes", "5"], "trace_axes"),
        (["--device", "gpu"], "argument --device: expected a device such as cpu, cuda or cuda:1, got 'gpu'"),
        (["--device", "cuda:7"], "this machine has"),
        (["--implementation", "4"], "argument --implementation: invalid choice: '4'"),
        (["bench", "--models", "resnet"], "--models 'resnet': expected a comma list of mlp, cnn"),
        (["bench", "--implementations", "1,5"], "--implementations: expected a comma list of 1, 2, 3, got [5]"),
        (["bench", "--sizes", "0"], "argument --sizes: expected a positive integer, got '0'"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_status_2(arguments, message, capsys, tmp_path):
    assert _run(arguments + ["--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and err.startswith("torchntk")


def test_python_dash_m_and_help():
    done = subprocess.run([sys.executable, "-m", "torchntk", "--n", "-3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["torchntk: error: argument --n: expected a positive integer, got '-3' (see --help)"]
    helped = subprocess.run([sys.executable, "-m", "torchntk", "--help"], capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0 and "torchntk bench" in helped.stdout


def test_bench_writes_its_table_and_scaling_plot(tmp_path, capsys):
    arguments = ["bench", "--models", "mlp", "--sizes", "1,2", "--implementations", "1,3", "--repeats", "1", "--no-nt"]
    assert _run(arguments + ["--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "NT      : not run (--no-nt)" in out
    table = (tmp_path / "bench.md").read_text()
    assert table.count("| mlp |") == 4  # 2 sizes x 2 implementations
    assert (tmp_path / "bench_mlp.png").stat().st_size > 10_000


def test_bench_asks_a_worker_process_for_neural_tangents(tmp_path, capsys):
    """Without jax (as in CI) the worker reports it; with it, the table gains NT's columns."""
    from torchntk.cli._neural_tangents_worker import import_neural_tangents

    arguments = ["bench", "--models", "mlp", "--sizes", "1", "--implementations", "3", "--repeats", "1"]
    assert _run(arguments + ["--output", str(tmp_path)]) == 0
    status = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("NT      :"))
    module, expected = import_neural_tangents()
    assert status == f"NT      : {expected}"
    table = (tmp_path / "bench.md").read_text()
    assert ("| mlp | 1 | 3 |" in table) and (("—" in table) == (module is None))


def test_the_console_script_is_declared():
    from importlib.metadata import entry_points

    scripts = {entry.name: entry.value for entry in entry_points(group="console_scripts")}
    assert scripts.get("torchntk") == "torchntk.cli:main"
