"""Sphinx configuration: Markdown pages (MyST) and the API reference from the docstrings.

Build: ``sphinx-build -W -b html docs docs/_build`` (``tests/test_docs.py`` runs it).
"""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import torchntk  # noqa: E402

project = "torchntk"
author = "the torchntk authors"
copyright = "2026, the torchntk authors"
release = torchntk.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.viewcode"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_typehints = "description"
autodoc_member_order = "bysource"
html_theme = "alabaster"
html_static_path = ["_static"]
