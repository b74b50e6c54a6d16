"""The documentation site builds without a single warning (``sphinx-build -W``)."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_sphinx_builds_without_warnings(tmp_path):
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q", str(ROOT / "docs"), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    for page in ("index", "quickstart", "layout", "structured", "batching", "predict", "migrating", "design", "benchmarks", "api"):
        assert (tmp_path / f"{page}.html").exists(), page
    api = (tmp_path / "api.html").read_text()
    for name in ("empirical_ntk_fn", "batch", "monte_carlo_kernel_fn", "linearize", "NtkImplementation"):
        assert f'id="torchntk.{name}"' in api, name
    assert (tmp_path / "_images" / "layout.svg").exists()
