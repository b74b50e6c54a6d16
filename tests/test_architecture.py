"""The package's folders are layered: no folder imports another that imports it back, directly or
through others (docs/design.md, "Where things live")."""

from __future__ import annotations

import ast
import pathlib

import pytest

import torchntk

pytestmark = pytest.mark.cpu_only("reads the package's source: nothing runs on a device")

_ROOT = pathlib.Path(torchntk.__file__).parent


def _unit(module: str) -> str:
    """The folder a module belongs to (``batching``, ``_call``, ...), or the top-level file itself
    (``empirical``, ``taylor``, ``__init__`` for the package)."""
    parts = module.split(".")[1:]
    return parts[0] if parts else "__init__"


def _imports(path: pathlib.Path) -> set[str]:
    """The torchntk modules a file imports, lazily imported ones too."""
    parts = list(path.relative_to(_ROOT.parent).with_suffix("").parts)
    package = parts[:-1]  # the package relative imports start from (also for an __init__.py)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "torchntk")
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] == "torchntk":
                found.add(target)
    return found


def _folder_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in _ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(_ROOT.parent).with_suffix("").parts)
        if module.endswith(".__init__"):
            module = module[: -len(".__init__")]
        source = _unit(module) if path.parent != _ROOT else path.stem
        graph.setdefault(source, set()).update(
            _unit(target) for target in _imports(path) if _unit(target) != source
        )
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of ``graph`` (its units in order, the first repeated at the end), or []."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(unit: str) -> list[str]:
        state[unit] = "open"
        stack.append(unit)
        for successor in sorted(graph.get(unit, ())):
            if state.get(successor) == "open":
                return stack[stack.index(successor):] + [successor]
            if successor not in state:
                found = visit(successor)
                if found:
                    return found
        state[unit] = "done"
        stack.pop()
        return []

    for unit in sorted(graph):
        if unit not in state:
            found = visit(unit)
            if found:
                return found
    return []


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_sees_relative_and_lazy_imports():
    graph = _folder_graph()
    assert {"_call", "_implementations", "_kernel"} <= graph["empirical"]
    assert "_layout" in graph["distributed"] and "distributed" in graph["batching"]
    assert "__init__" in graph["cli"]  # `import torchntk` inside a function of the command line


def test_no_two_folders_import_each_other():
    assert _cycle(_folder_graph()) == []
