"""The ``torchntk`` command: the demo and ``bench`` end to end on tiny configurations, and its errors."""

from __future__ import annotations

import os
import sys
import textwrap
import types

import pytest
import torch
from torch import nn

import torchntk
from tests._processes import run_python
from torchntk.cli import main

pytestmark = pytest.mark.cpu_only("runs the torchntk command, which picks its own device (its own --device option)")


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
    assert _run(["--model", "my_models:not_a_module", "--input-shape", "5", "--output", str(output)]) == 3
    assert capsys.readouterr().err == ("torchntk: model 'my_models:not_a_module', building (the factory call) failed: "
                                       "TypeError: not_a_module() returned int, not an nn.Module\n")


_SMALL = ("import torch\n"
          "def make():\n"
          "    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))\n")


@pytest.mark.parametrize(
    "source, step, error",
    [
        ("raise RuntimeError('broken at import')\n", "importing '{name}'", "RuntimeError: broken at import"),
        ("import no_such_dependency_here\n", "importing '{name}'",
         "ModuleNotFoundError: No module named 'no_such_dependency_here'"),
        ("def make(:\n", "importing '{name}'", "SyntaxError: "),
        ("import sys\nsys.exit('parsed its own arguments')\n", "importing '{name}'", "SystemExit: parsed its own"),
        ("def make():\n    raise ValueError('no weights')\n", "building (the factory call)", "ValueError: no weights"),
        ("def make():\n    return 'a string'\n", "building (the factory call)",
         "TypeError: make() returned str, not an nn.Module"),
        ("import torch\nclass M(torch.nn.Linear):\n    def forward(self, x):\n        raise KeyError('x')\n"
         "def make():\n    return M(4, 2)\n", "forward pass (before any implementation)", "KeyError: 'x'"),
    ],
    ids=["raises-at-import", "missing-dependency", "syntax-error", "exits-at-import", "factory-raises",
         "not-a-module", "forward-raises"],
)
def test_every_failure_of_the_users_model_is_exit_status_3(source, step, error, tmp_path, monkeypatch, capsys, request):
    name = f"cli_user_model_{request.node.callspec.id.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(source)
    (tmp_path / "cli_small_model.py").write_text(_SMALL)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    arguments = ["--model", f"{name}:make", "--model", "cli_small_model:make", "--input-shape", "4", "--n", "2"]
    assert _run(arguments + ["--output", str(tmp_path / "out")]) == 3
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"torchntk: model '{name}:make', {step.format(name=name)} failed: {error}"), line
    results = (tmp_path / "out" / "results.md").read_text()
    assert f"| {name}:make | {step.format(name=name)} | — | — | — | FAILED |" in results
    assert results.count("| cli_small_model:make |") == 3  # the other model still ran


def test_a_model_file_is_found_from_the_current_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "cli_model_here.py").write_text(_SMALL)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [entry for entry in sys.path if entry not in ("", str(tmp_path))])
    assert _run(["--model", "cli_model_here:make", "--input-shape", "4", "--n", "2", "--output", "out"]) == 0
    assert (tmp_path / "out" / "results.md").exists()


def test_an_output_folder_that_cannot_be_made_is_a_bad_argument(tmp_path, capsys):
    (tmp_path / "taken").write_text("a file, not a folder")
    assert _run(["--model", "mlp", "--n", "2", "--output", str(tmp_path / "taken" / "out")]) == 2
    expected = f"torchntk: error: --output '{tmp_path / 'taken' / 'out'}': cannot create that folder"
    assert capsys.readouterr().err.startswith(expected)


def test_warnings_name_the_command_line_not_runpy(tmp_path):
    # vmap cannot index with a boolean mask, so the kernel function loops over the examples and
    # says so with an ExampleLoopWarning, raised deep in torchntk.
    (tmp_path / "cli_looped_model.py").write_text(
        "import torch\n"
        "class M(torch.nn.Linear):\n"
        "    def forward(self, x):\n"
        "        return super().forward(x[x > -1e9].reshape(x.shape))\n"
        "def make():\n"
        "    return M(4, 2)\n"
    )
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    done = run_python("-m", "torchntk", "--model", "cli_looped_model:make", "--input-shape", "4", "--n", "2",
                      "--implementation", "1", "--progress", "off", "--output", tmp_path / "out",
                      timeout=300, env={"PYTHONPATH": path})
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "Warning:" in line]
    assert warnings and all("ExampleLoopWarning" in line for line in warnings), done.stderr
    runs = os.path.join(os.path.dirname(torchntk.__file__), "cli", "_runs.py")
    assert all(line.startswith(runs + ":") for line in warnings), warnings  # the kernel's call and AUTO's


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
        (["--model", "torch:float32", "--input-shape", "3"], "'float32' is not callable"),
        (["--model", "my_models.py:make", "--input-shape", "3"],
         "give the module's name, not its file: --model my_models:make"),
        (["--model", "models/my_models.py:make", "--input-shape", "3"],
         "--model my_models:make, run from 'models' or add it to PYTHONPATH"),
        (["--model", "no_such_package_here.models:make", "--input-shape", "3"],
         "cannot import 'no_such_package_here.models'"),
        (["--model", "torch:randn"], "give the shape of one input example with --input-shape"),
        (["--model", "mlp", "--input-shape", "3,4"], "the built-in mlp takes inputs of shape 64"),
        (["--trace-axes", "x"], "expected comma-separated integers or 'none', got 'x'"),
        (["--trace-axes", "5"], "trace_axes"),
        (["--device", "gpu"], "argument --device: expected a device such as cpu, cuda or cuda:1, got 'gpu'"),
        (["--device", "cuda:7"], "this machine has"),
        (["--implementation", "4"], "argument --implementation: invalid choice: '4'"),
        (["--input-dtype", "double"], "argument --input-dtype: invalid choice: 'double'"),
        (["--model", "torch:nn.Linear", "--input-shape", "3", "--input-dtype", "long"],
         "--input-dtype long: give the range of the integers with --vocab-size"),
        (["--vocab-size", "10"], "--vocab-size: only for integer inputs"),
        (["--vocab-size", "0"], "argument --vocab-size: expected a positive integer, got '0'"),
        (["--model", "mlp", "--input-dtype", "int", "--vocab-size", "5"], "the built-in mlp takes float inputs"),
        (["--model", "mlp", "--keyword-inputs", "x"], "--keyword-inputs: the built-in mlp takes one input"),
        (["--keyword-inputs", "input_ids,,mask"], "expected NAME or NAME=ones|zeros"),
        (["--keyword-inputs", "input_ids,mask=twos"], "'mask=twos': a keyword input is random, or NAME=ones"),
        (["--keyword-inputs", "a,a=ones"], "names 'a' twice"),
        (["--model", "mlp", "--vmap-axes", "2"], "--vmap-axes 2: out of range for inputs of shape (16, 64)"),
        (["bench", "--models", "resnet"],
         "--models 'resnet': expected a comma list of mlp, wide, cnn, fcn, resnet18, resnet18-1000"),
        (["bench", "--implementations", "1,5"], "--implementations: expected a comma list of 1, 2, 3, got [5]"),
        (["bench", "--sizes", "0"], "argument --sizes: expected a positive integer, got '0'"),
        (["bench", "--compile", "nope"], "--compile 'nope': names no torch.compile backend: 'nope'; available: "),
    ],
)
def test_bad_arguments_give_one_line_and_exit_status_2(arguments, message, capsys, tmp_path):
    assert _run(arguments + ["--output", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and err.startswith("torchntk")


def test_python_dash_m_and_help():
    done = run_python("-m", "torchntk", "--n", "-3", timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["torchntk: error: argument --n: expected a positive integer, got '-3' (see --help)"]
    helped = run_python("-m", "torchntk", "--help", timeout=120)
    assert helped.returncode == 0 and "torchntk bench" in helped.stdout and "--version" in helped.stdout


def test_version_of_the_demo_and_the_bench(capsys):
    assert torchntk.__version__.count(".") >= 2
    for command in (["--version"], ["bench", "--version"], ["--model", "mlp", "--version"]):
        assert main(command) == 0, command
        assert capsys.readouterr().out == f"torchntk {torchntk.__version__}\n", command
    done = run_python("-m", "torchntk", "--version", timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"torchntk {torchntk.__version__}\n", "")


def test_bench_writes_its_table_and_scaling_plot(tmp_path, capsys):
    arguments = ["bench", "--models", "mlp", "--sizes", "1,2", "--implementations", "1,3", "--repeats", "1", "--no-nt"]
    assert _run(arguments + ["--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "NT      : not run (--no-nt)" in out
    table = (tmp_path / "bench.md").read_text()
    assert table.count("| mlp |") == 4  # 2 sizes x 2 implementations
    assert (tmp_path / "bench_mlp.png").stat().st_size > 10_000


def test_bench_compiles_when_asked(tmp_path, capsys):
    arguments = ["bench", "--models", "mlp", "--sizes", "2", "--implementations", "3", "--repeats", "1", "--no-nt",
                 "--compile", "eager"]
    assert _run(arguments + ["--output", str(tmp_path)]) == 0
    assert "device cpu, compile=eager" in capsys.readouterr().out
    assert (tmp_path / "bench.md").read_text().count("| mlp |") == 1


def _cells(table: str, model: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()
            if line.startswith(f"| {model} |")]


@pytest.mark.parametrize("trace_axes", ["-1", "none"])
def test_bench_times_the_pytorch_tutorial_in_the_same_run(tmp_path, capsys, trace_axes):
    arguments = ["bench", "--models", "mlp", "--sizes", "1,2", "--implementations", "3", "--repeats", "1", "--no-nt",
                 "--tutorial", f"--trace-axes={trace_axes}"]
    assert _run(arguments + ["--output", str(tmp_path)]) == 0
    table = (tmp_path / "bench.md").read_text()
    assert "| tutorial [s] | tutorial / torchntk | tutorial rel diff |" in table
    rows = _cells(table, "mlp")
    assert len(rows) == 2
    for row in rows:
        ours, peer, ratio, difference = float(row[3]), float(row[4]), row[5], float(row[6])
        # the cells round the seconds to 0.1 ms, the ratio is of the unrounded ones
        assert ratio.endswith("x") and float(ratio[:-1]) == pytest.approx(peer / ours, rel=0.05)
        assert difference < 1e-5  # the same kernel, float32


def test_bench_says_what_did_not_fit_instead_of_failing(tmp_path, capsys, monkeypatch):
    """A tutorial whose Jacobians exceed the free memory is not run; a torchntk run that runs out of
    memory is reported as such (both cells of the table), and the other rows are timed."""
    from torchntk.cli import bench

    monkeypatch.setattr(bench, "_free_memory", lambda device: 1.0)
    original = torchntk.empirical_ntk_fn

    def failing_for_1(model, *args, implementation=0, **kwargs):
        ntk_fn = original(model, *args, implementation=implementation, **kwargs)
        if implementation != 1:
            return ntk_fn

        def out_of_memory(*call_args, **call_kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 47.00 GiB")

        return out_of_memory

    monkeypatch.setattr(torchntk, "empirical_ntk_fn", failing_for_1)
    arguments = ["bench", "--models", "mlp", "--sizes", "1", "--implementations", "1,3", "--repeats", "1", "--no-nt",
                 "--tutorial"]
    assert _run(arguments + ["--output", str(tmp_path)]) == 0
    rows = {row[2]: row for row in _cells((tmp_path / "bench.md").read_text(), "mlp")}
    assert rows["1"][3] == "out of memory" and float(rows["3"][3]) > 0
    assert rows["1"][4].startswith("needs ") and rows["1"][4].endswith(" GiB") and rows["1"][5] == "—"


def test_the_bench_resnet18_is_torchvisions():
    """The same layers, names and numbers as torchvision's resnet18: its state dict loads, and the
    outputs agree."""
    from tests.zoo import import_torchvision
    from torchntk.cli._models import BENCH_MODELS

    ours = BENCH_MODELS["resnet18-1000"].build()
    theirs = import_torchvision().models.resnet18(num_classes=1000).eval()
    theirs.load_state_dict(ours.state_dict())
    assert sum(p.numel() for p in ours.parameters()) == 11_689_512
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))
    assert BENCH_MODELS["resnet18"].build()(x).shape == (2, 8)


@pytest.mark.parametrize("traced", [True, False])
def test_the_tutorial_peer_computes_the_ntk(traced):
    from torchntk.cli._tutorial import jacobian_bytes, tutorial_ntk_fn
    from torchntk.testing import reference_ntk

    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)).double()
    x1, x2 = torch.randn(4, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    expected = reference_ntk(model, x1, x2, trace_axes=(-1,) if traced else ())
    torch.testing.assert_close(tutorial_ntk_fn(model, traced)(x1, x2), expected, rtol=1e-12, atol=1e-12)
    assert jacobian_bytes(model, 4, 3) == (5 * 7 + 7 + 7 * 3 + 3) * 8 * 4 * 3


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


# Models as users bring them. They live in this file and are imported by the command line as
# `cli_test_models:<factory>`, a module registered in sys.modules by the `user_models` fixture.


class EmbeddingModel(nn.Module):
    """Token ids (N, T) -> embedding -> mean over positions -> 3 logits."""

    def __init__(self, vocab_size: int = 11):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(input_ids)).mean(1))


class KeywordModel(EmbeddingModel):
    """Keyword-only inputs, as a Hugging Face model's ``model(input_ids=..., attention_mask=...)``."""

    def forward(self, *, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).to(self.head.weight.dtype)
        pooled = (torch.tanh(self.embed(input_ids)) * mask).sum(1) / mask.sum(1)
        return self.head(pooled)


class RaisingModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        raise RuntimeError("broken forward\n(a second line)")


class NoVmapModel(nn.Module):
    """Runs on a batch but not under vmap (``.item()``), as some stock models do."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        return self.linear(x) * float(x.abs().max())


@pytest.fixture
def user_models(monkeypatch):
    module = types.ModuleType("cli_test_models")
    module.embedding = EmbeddingModel
    module.keywords = KeywordModel
    module.raising = RaisingModel
    module.no_vmap = NoVmapModel
    module.small = lambda: nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    monkeypatch.setitem(sys.modules, "cli_test_models", module)
    return module


@pytest.mark.parametrize("dtype", ["long", "int32"])
def test_token_ids_run_and_every_implementation_agrees(dtype, user_models, tmp_path, capsys):
    arguments = ["--model", "cli_test_models:embedding", "--input-shape", "5", "--input-dtype", dtype,
                 "--vocab-size", "11", "--n", "3", "--trace-axes", "none", "--float64"]
    assert _run(arguments + ["--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count(" yes") == 3 and "3x3x3x3" in out
    assert f"3 examples of shape (5,), {'int64' if dtype == 'long' else 'int32'} in [0, 11)" in out


def test_token_ids_are_in_range_and_fixed():
    from torchntk.cli._inputs import InputSpec

    spec = InputSpec((7,), torch.int64, 5)
    ids = spec.make(50, torch.float32, torch.device("cpu"))
    assert ids.dtype == torch.int64 and ids.shape == (50, 7)
    assert int(ids.min()) == 0 and int(ids.max()) == 4
    assert torch.equal(ids, spec.make(50, torch.float32, torch.device("cpu")))


def test_keyword_inputs(user_models, tmp_path, capsys):
    arguments = ["--model", "cli_test_models:keywords", "--input-shape", "4", "--input-dtype", "long",
                 "--vocab-size", "11", "--keyword-inputs", "input_ids,attention_mask=ones", "--n", "3"]
    assert _run(arguments + ["--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count(" yes") == 3
    assert "as keyword inputs input_ids, attention_mask=ones" in out
    assert (tmp_path / "ntk_cli_test_models_keywords.png").exists()


def test_a_failing_model_is_reported_in_one_line_and_the_others_still_run(user_models, tmp_path, capsys):
    arguments = ["--model", "cli_test_models:raising", "--model", "cli_test_models:small", "--input-shape", "4", "--n", "3"]
    assert _run(arguments + ["--output", str(tmp_path)]) == 3
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "torchntk: model 'cli_test_models:raising', forward pass (before any implementation) failed: "
        "RuntimeError: broken forward (a second line)"
    ]
    results = (tmp_path / "results.md").read_text()
    assert "| cli_test_models:raising | forward pass (before any implementation) | — | — | — | FAILED |" in results
    assert "RuntimeError: broken forward (a second line)" in results
    assert results.count("| cli_test_models:small |") == 3 and "NO" not in results
    assert (tmp_path / "ntk_cli_test_models_small.png").exists()


def test_a_model_failing_under_vmap_names_the_implementation(user_models, tmp_path, capsys):
    arguments = ["--model", "cli_test_models:no_vmap", "--input-shape", "4", "--n", "3", "--implementation", "2"]
    assert _run(arguments + ["--output", str(tmp_path)]) == 3
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert err[0].startswith("torchntk: model 'cli_test_models:no_vmap', implementation 2 (NTK-vector products) failed: ")
    assert "vmap" in err[0]
    assert "| cli_test_models:no_vmap | 2 (NTK-vector products) | — | — | — | FAILED |" in (tmp_path / "results.md").read_text()
    # The same model without the vmap promise works.
    assert _run(arguments + ["--vmap-axes", "none", "--output", str(tmp_path)]) == 0


def test_exit_statuses_are_distinct(user_models, tmp_path, monkeypatch, capsys):
    from torchntk.cli import _arguments, _runs

    statuses = (_arguments.OK, _arguments.DISAGREE, _arguments.USAGE, _arguments.MODEL_FAILED)
    assert statuses == (0, 1, 2, 3)
    small = ["--model", "cli_test_models:small", "--input-shape", "4", "--n", "2", "--output", str(tmp_path)]
    assert _run(small) == 0
    assert _run(small + ["--n", "0"]) == 2
    assert _run(["--model", "cli_test_models:raising"] + small) == 3
    monkeypatch.setattr(_runs, "_relative_difference", lambda kernel, reference: 1.0)
    assert _run(small) == 1
    assert _run(["--model", "cli_test_models:raising"] + small) == 3  # a failure outranks a disagreement
    capsys.readouterr()
    assert _run(["--help"]) == 0
    help_text = capsys.readouterr().out
    for line in ("1  two implementations disagree", "2  a bad argument", "3  a model failed"):
        assert line in help_text


def test_figure_titles_say_which_kernel(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    from torchntk.cli import _figures

    drawn, labels = [], []
    draw = _figures.draw_kernel

    def spy(plt, matrix, description):
        figure = draw(plt, matrix, description)
        drawn.append((figure._suptitle.get_text(), figure.axes[0].get_xlabel(), figure.axes[0].get_ylabel()))
        heatmap, spectrum, colour_bar = figure.axes
        labels.append((colour_bar.get_ylabel(), spectrum.get_xlabel(), spectrum.get_ylabel()))
        return figure

    monkeypatch.setattr(_figures, "draw_kernel", spy)
    assert _run(["--model", "mlp", "--n", "2", "--implementation", "3", "--trace-axes", "none", "--output", str(tmp_path)]) == 0
    assert _run(["--model", "mlp", "--n", "2", "--output", str(tmp_path)]) == 0
    (full_title, full_x, full_y), (traced_title, traced_x, traced_y) = drawn
    assert full_title == ("empirical NTK of mlp, implementation 3 (structured derivatives)\n"
                          "full kernel (no axis traced); rows and columns are (example, logit) pairs")
    assert (full_x, full_y) == ("x2 (example, logit): example*10 + logit", "x1 (example, logit): example*10 + logit")
    assert traced_title == ("empirical NTK of mlp, implementation 1 (Jacobian contraction)\n"
                            "traced (averaged) over output axis 1 (size 10)")
    assert (traced_x, traced_y) == ("x2 example", "x1 example")
    assert labels == [("kernel entry K(x1, x2)", "index (1 = largest)", "eigenvalue (log scale)")] * 2


def test_kernel_descriptions_of_other_outputs():
    from torchntk.cli._figures import KernelDescription

    sequence = KernelDescription("lm", "1 (Jacobian contraction)", (4, 5, 7), (2,))
    assert sequence.title().endswith("over output axis 2 (size 7); rows and columns are (example, output axis 1) pairs")
    assert sequence.axis_label("x1") == "x1 (example, output axis 1): example*5 + output axis 1"
    full = KernelDescription("lm", "1 (Jacobian contraction)", (4, 5, 7), ())
    assert full.axis_label("x2") == "x2 (example, output axis 1, output axis 2): example*35 + output axis 1*7 + output axis 2"


# -- torchntk env ---------------------------------------------------------------------------------


def test_env_says_which_libraries_import_and_what_to_do(tmp_path, monkeypatch, capsys):
    from torchntk.cli import env

    (tmp_path / "fine_library").mkdir()
    (tmp_path / "fine_library" / "__init__.py").write_text("__version__ = '1.2'\n")
    (tmp_path / "broken_library").mkdir()
    (tmp_path / "broken_library" / "__init__.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist\\nwhile registering fake kernels')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(env, "LIBRARIES", ("fine_library", "broken_library", "absent_library_of_this_test"))
    assert main(["env"]) == 1
    out = "\n".join(" ".join(line.split()) for line in capsys.readouterr().out.splitlines())
    assert f"torch {torch.__version__}: " in out and f"torchntk {torchntk.__version__}" in out
    assert "fine_library: 1.2, imports" in out
    assert "broken_library: installed, does not import: RuntimeError: operator torchvision::nms does not exist\n" in out
    assert "while registering" not in out  # the first line of the error only
    assert "absent_library_of_this_test" in out and "not installed (optional)" in out
    assert "broken_library: reinstall it beside this torch" in out

    monkeypatch.setattr(env, "LIBRARIES", ("fine_library", "absent_library_of_this_test"))
    assert main(["env"]) == 0  # what is not installed is optional


def test_env_advice_points_at_the_index_of_this_torch():
    from torchntk.cli import env

    fix = env._advice("torchvision", "2.13.0", "cpu", ["torchvision", "timm"])
    assert 'pip install "torch==2.13.0" torchvision --index-url https://download.pytorch.org/whl/cpu' in fix
    assert "fix torchvision first" in env._advice("timm", "2.13.0", "cpu", ["torchvision", "timm"])
    assert "reinstall it" in env._advice("timm", "2.13.0", "cpu", ["timm"])
    cuda = types.SimpleNamespace(version=types.SimpleNamespace(cuda="12.8", hip=None))
    cpu = types.SimpleNamespace(version=types.SimpleNamespace(cuda=None, hip=None))
    assert (env._torch_index(cuda), env._torch_index(cpu)) == ("cu128", "cpu")
    assert env._build(cpu) == "CPU build"


def test_env_help_and_a_bad_argument(capsys):
    assert main(["env", "--help"]) == 0
    assert "optional model libraries" in capsys.readouterr().out
    assert main(["env", "--nonsense"]) == 2
    assert "unrecognized arguments: --nonsense" in capsys.readouterr().err
