"""The public surface: every public module says what it exports (``__all__``), every export is in
docs/api.md, and nothing private shows through a public namespace."""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import pkgutil
import re

import pytest

import torchntk

pytestmark = pytest.mark.cpu_only("reads the package's modules and docs: nothing runs on a device")

_DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md"


def _public_modules() -> list[str]:
    """Every module of the package with no private part in its dotted name."""
    names = ["torchntk"]
    for module in pkgutil.walk_packages(torchntk.__path__, "torchntk."):
        parts = module.name.split(".")[1:]
        if not any(part.startswith("_") for part in parts):
            names.append(module.name)
    return names


def _is_private(module_name: str) -> bool:
    return any(part.startswith("_") for part in module_name.split("."))


def test_the_public_modules_are_the_expected_ones():
    """A new public module must be a deliberate decision (and then joins this list)."""
    assert sorted(_public_modules()) == sorted([
        "torchntk", "torchntk.empirical", "torchntk.taylor", "torchntk.batching", "torchntk.monte_carlo",
        "torchntk.sketch", "torchntk.spectra", "torchntk.distributed", "torchntk.testing", "torchntk.predict",
        "torchntk.cli", "torchntk.cli.bench", "torchntk.cli.demo", "torchntk.cli.env",
    ])


@pytest.mark.parametrize("name", _public_modules())
def test_a_public_module_exports_only_public_names_from_public_modules(name):
    module = importlib.import_module(name)
    assert hasattr(module, "__all__"), f"{name} has no __all__"
    exported = list(module.__all__)
    assert len(exported) == len(set(exported)), f"{name}.__all__ lists a name twice"
    for export in exported:
        assert not export.startswith("_"), f"{name}.__all__ lists the private name {export}"
        value = getattr(module, export)  # every listed name exists
        if inspect.isclass(value) or inspect.isfunction(value):
            assert not _is_private(value.__module__), f"{name}.{export} says it lives in {value.__module__}"


@pytest.mark.parametrize("name", _public_modules())
def test_every_public_function_and_class_a_public_module_defines_is_exported(name):
    """What a public module defines under a public name is part of its API, so it is in ``__all__``;
    everything else is named privately."""
    module = importlib.import_module(name)
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    defined = [
        node.name
        for node in tree.body
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_")
    ]
    assert sorted(set(defined) - set(module.__all__)) == [], f"{name} defines public names it does not export"


def _documented() -> tuple[set[str], set[str]]:
    """The dotted names docs/api.md documents, and the modules it documents with every member."""
    text = _DOCS.read_text()
    names = set(re.findall(r"^\.\. auto(?:function|class|data|module):: (torchntk[\w.]*)", text, re.M))
    whole = set()
    for module, options in re.findall(r"^\.\. automodule:: (torchntk[\w.]*)\n((?:   :.*\n)*)", text, re.M):
        members = re.search(r":members:(.*)", options)
        if members and not members.group(1).strip():
            whole.add(module)
        elif members:
            names.update(f"{module}.{member.strip()}" for member in members.group(1).split(","))
    return names, whole


@pytest.mark.parametrize("name", _public_modules())
def test_every_export_is_documented_in_the_api_page(name):
    names, whole = _documented()
    module = importlib.import_module(name)
    missing = [
        export
        for export in module.__all__
        if name not in whole and f"{name}.{export}" not in names and f"torchntk.{export}" not in names
    ]
    assert missing == [], f"docs/api.md does not document {name}: {missing}"


def test_the_documented_names_exist():
    names, whole = _documented()
    for dotted in sorted(names | whole):
        module_name, _, attribute = dotted.rpartition(".")
        try:
            importlib.import_module(dotted)
            continue
        except ImportError:
            pass
        assert hasattr(importlib.import_module(module_name), attribute), f"docs/api.md names {dotted}, which does not exist"
