"""Sphinx configuration: Markdown pages (MyST) and the API reference from the docstrings.

Build (nitpicky, every warning an error)::

    sphinx-build -n -W -b html docs docs/_build

Without network access, for example in CI and ``tests/test_docs.py``, build offline::

    TORCHNTK_DOCS_OFFLINE=1 sphinx-build -n -W -b html docs docs/_build

Cross-references into PyTorch, NumPy and the Python standard library resolve through
``sphinx.ext.intersphinx``, which downloads each project's ``objects.inv`` at build time. A failed
download is itself a warning (fatal under ``-W``), so ``TORCHNTK_DOCS_OFFLINE=1`` (any value but
``0`` or empty) configures no inventories, and the references into those projects, which cannot
resolve without them, are rendered as unlinked text instead of failing the nitpicky build. The
references into torchntk itself are checked in both modes.
"""

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torchntk  # noqa: E402

project = "torchntk"
author = "the torchntk authors"
copyright = "2026, the torchntk authors"
release = torchntk.__version__  # single source: torchntk/__init__.py (setup.cfg reads it too)
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "sphinx.ext.intersphinx",
]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_typehints = "description"
autodoc_member_order = "bysource"
html_theme = "alabaster"
html_static_path = ["_static"]

# --- cross-references to other projects ------------------------------------------------------

OFFLINE = os.environ.get("TORCHNTK_DOCS_OFFLINE", "") not in ("", "0")

_INVENTORIES = {
    "python": ("https://docs.python.org/3", None),  # datetime.timedelta, collections.abc in annotations
    "torch": ("https://pytorch.org/docs/stable/", None),
    "numpy": ("https://numpy.org/doc/stable/", None),
}
intersphinx_mapping = {} if OFFLINE else _INVENTORIES

# The modules whose objects the inventories above document. Offline, and only offline, a reference
# into one of them is expected to be unresolvable; ``fullmatch`` keeps ``torch`` from matching
# ``torchntk``.
_EXTERNAL_MODULES = ("torch", "numpy", "argparse", "datetime", "collections", "typing")
nitpick_ignore_regex = [(r"py:.*", rf"({'|'.join(_EXTERNAL_MODULES)})(\..+)?")] if OFFLINE else []

nitpick_ignore = [
    # KernelFunction's constructor (which only the library calls) takes the private KernelFnSpec.
    ("py:class", "KernelFnSpec"),
    # The subcommands' `main` raise the command line's private UsageError, which `torchntk.cli.main`
    # turns into exit status 2: it never reaches a caller of the library.
    ("py:exc", "UsageError"),
]

# Annotations name a class where it is defined, but PyTorch documents (and its inventory lists) it
# under its public name: ``nn.Module`` is ``torch.nn.modules.module.Module``.
_PUBLIC_NAMES = {"torch.nn.modules.module.Module": "torch.nn.Module"}


def _public_name(app, env, node, contnode):
    """Points a reference at the public name before intersphinx (priority 500) looks it up."""
    target = node.get("reftarget")
    if target in _PUBLIC_NAMES:
        node["reftarget"] = _PUBLIC_NAMES[target]
    return None


def setup(app):
    app.connect("missing-reference", _public_name, priority=400)
