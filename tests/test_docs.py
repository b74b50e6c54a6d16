"""The documentation site builds without a single warning, nitpicky: ``sphinx-build -n -W``.

Offline (``TORCHNTK_DOCS_OFFLINE=1``, see ``docs/conf.py``): the tests cannot reach PyTorch's,
NumPy's and Python's sites for their intersphinx inventories, and a failed download is a warning.
"""

import pathlib
import re
import runpy

import pytest

import torchntk
from tests._processes import run_python

pytestmark = pytest.mark.cpu_only("builds the documentation")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_sphinx_builds_without_warnings(tmp_path):
    done = run_python("-m", "sphinx", "-n", "-W", "--keep-going", "-b", "html", "-q", ROOT / "docs", tmp_path,
                      timeout=600, env={"TORCHNTK_DOCS_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    pages = ("index", "quickstart", "layout", "structured", "batching", "predict", "migrating", "design", "benchmarks",
             "guarantees", "real_models", "pinn", "scientific", "groups", "sketching", "spectra", "api")
    for page in pages:
        assert (tmp_path / f"{page}.html").exists(), page
    api = (tmp_path / "api.html").read_text()
    for name in ("empirical_ntk_fn", "batch", "monte_carlo_kernel_fn", "linearize", "NtkImplementation",
                 "sketched_ntk_fn", "ntk_eigenpairs"):
        assert f'id="torchntk.{name}"' in api, name
    assert (tmp_path / "_images" / "layout.svg").exists()
    assert f"torchntk {torchntk.__version__} documentation" in (tmp_path / "index.html").read_text()


@pytest.mark.parametrize("offline", ["1", "0", ""])
def test_intersphinx_is_configured_unless_offline(offline, monkeypatch):
    monkeypatch.setenv("TORCHNTK_DOCS_OFFLINE", offline)
    conf = runpy.run_path(str(ROOT / "docs" / "conf.py"))
    assert conf["release"] == torchntk.__version__ and torchntk.__version__.startswith(conf["version"])
    assert "sphinx.ext.intersphinx" in conf["extensions"]
    if offline == "1":
        assert conf["intersphinx_mapping"] == {}
        [(types, targets)] = conf["nitpick_ignore_regex"]
        assert re.fullmatch(targets, "torch.nn.Module")
        assert not re.fullmatch(targets, "torchntk.batch")
    else:
        assert conf["intersphinx_mapping"]["torch"][0] == "https://pytorch.org/docs/stable/"
        assert conf["intersphinx_mapping"]["numpy"][0] == "https://numpy.org/doc/stable/"
        assert conf["nitpick_ignore_regex"] == []
