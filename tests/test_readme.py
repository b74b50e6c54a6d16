"""The README and docs/*.md as a user reads them: every Python example runs as written, the set-up
is the two commands CI runs, and the user pages hold no lab notes.

Examples that import an optional model library (torchvision, timm, transformers, peft, e3nn), in
any form (``import torch, timm``, ``from transformers import ...``), run where it
imports, which ``.ci/run`` makes sure of (``tests/zoo.py``), and are skipped with the reason
elsewhere. An example that cannot run inside a test (several GPUs, ``torchrun``) says so in its
page with an HTML comment on the line above its fence, ``<!-- not run by the tests: REASON -->``;
the tests allow few of them.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys
from typing import NamedTuple, Optional

import pytest
from packaging.version import Version

from tests import zoo

pytestmark = pytest.mark.cpu_only("runs the README and docs examples as written, on the CPU")

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
USER_PAGES = [page for page in PAGES if page.name != "benchmarks.md"]
"""Every page but docs/benchmarks.md, the one page of measurements (dates, machines, commands)."""

LANGUAGES = {"python", "bash", "sh", "text", "{eval-rst}", "{toctree}", ""}
NOT_RUN = re.compile(r"<!-- not run by the tests: (?P<reason>\S.*?) -->")
MOST_NOT_RUN = 3


def optional_imports(code: str) -> list[str]:
    """The optional libraries of ``zoo.OPTIONAL`` that ``code`` imports, in any form: every name of
    ``import a, b as c`` and of nested or indented imports, and the package of ``from a.b import c``
    (relative imports name no library)."""
    packages = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            packages.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            packages.add(node.module.split(".")[0])
    return sorted(packages & set(zoo.OPTIONAL))


class Block(NamedTuple):
    page: str
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    not_run: Optional[str]  # the reason of a <!-- not run by the tests: ... --> marker

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def fenced_blocks(page: pathlib.Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, in order."""
    blocks, lines = [], page.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = lines[index]
        if not opening.startswith("```"):
            index += 1
            continue
        end = next((j for j in range(index + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{page.name}:{index + 1}: a code fence that is never closed"
        previous = next((lines[j] for j in range(index - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.fullmatch(previous.strip())
        blocks.append(Block(page.name, index + 1, opening[3:].strip(), "\n".join(lines[index + 1:end]) + "\n",
                            marker["reason"] if marker else None))
        index = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in fenced_blocks(page)]
EXAMPLES = [block for block in BLOCKS if block.language == "python" and block.not_run is None]


def test_every_page_has_examples_and_every_fence_says_its_language():
    assert {block.page for block in EXAMPLES} >= {"README.md", "quickstart.md", "real_models.md"}
    # A Python example under another name (py, python3, pycon) would escape the tests.
    odd = [f"{block.name} ({block.language!r})" for block in BLOCKS if block.language not in LANGUAGES]
    assert not odd, f"code fences in a language the docs test does not know: {odd}"


def test_examples_left_out_say_why_and_are_few():
    left_out = [block for block in BLOCKS if block.not_run is not None]
    assert all(block.language == "python" for block in left_out), [block.name for block in left_out]
    assert len(left_out) <= MOST_NOT_RUN, [f"{block.name}: {block.not_run}" for block in left_out]


def test_the_marker_leaves_out_only_the_block_below_it(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Text.\n\n<!-- not run by the tests: needs 8 GPUs -->\n```python\nrun_on_8_gpus()\n```\n\n"
                    "```python\nprint(1)\n```\n")
    marked, plain = fenced_blocks(page)
    assert (marked.not_run, marked.code, marked.line) == ("needs 8 GPUs", "run_on_8_gpus()\n", 4)
    assert (plain.not_run, plain.language) == (None, "python")


def test_every_imported_optional_library_is_found():
    code = (
        "import torch, torchvision, torchntk\n"
        "from transformers.models.bert import BertModel\n"
        "import numpy as np, timm as t\n"
        "def build():\n"
        "    import peft.tuners\n"
        "    from . import e3nn\n"  # relative: the example's own package, not the library
        "from torchvisionish import x\n"
        "text = 'import e3nn'\n"
    )
    assert optional_imports(code) == ["peft", "timm", "torchvision", "transformers"]
    assert optional_imports("import torch\nfrom e3nn import o3\n") == ["e3nn"]
    assert optional_imports("import torch\n") == []


def test_an_example_importing_a_library_that_does_not_import_is_skipped_saying_why(monkeypatch, tmp_path):
    monkeypatch.delenv(zoo.REQUIRE_VARIABLE, raising=False)
    monkeypatch.setitem(sys.modules, "timm", None)  # import timm raises ImportError
    block = Block("page.md", 1, "python", "import torch, timm\nraise AssertionError('ran')\n", None)
    with pytest.raises(pytest.skip.Exception, match="optional library timm does not import"):
        test_example_runs(block, tmp_path, monkeypatch)


@pytest.mark.parametrize("block", EXAMPLES, ids=[block.name for block in EXAMPLES])
def test_example_runs(block, tmp_path, monkeypatch):
    for library in optional_imports(block.code):
        zoo.optional(library)  # skipped, saying why, where the library does not import
    monkeypatch.chdir(tmp_path)  # what an example writes stays out of the repository
    exec(compile(block.code, block.name, "exec"), {"__name__": "__main__"})


def _commands(text: str) -> list[str]:
    """The commands of a shell script or block: no comments, no blank lines."""
    lines = [line.split("  #")[0].strip() for line in text.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _section(page: pathlib.Path, title: str) -> list[Block]:
    text = page.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    first_line = text[:start].count("\n") + 2
    last_line = text[:end].count("\n") + 1 if end != -1 else float("inf")
    return [block for block in fenced_blocks(page) if first_line < block.line < last_line]


def test_the_readme_sets_up_top_to_bottom():
    """One block, in the order it runs: the CPU build of PyTorch (where wanted) before the install
    that would otherwise pull PyPI's build, then the tests."""
    [setup, *_] = _section(ROOT / "README.md", "Install and test")
    assert setup.language == "bash"
    assert _commands(setup.code) == [
        "pip install torch torchvision --index-url https://download.pytorch.org/whl/cpu",
        'pip install -e ".[test]"',
        "python -m pytest -n auto",
    ]


def _ci_matrix() -> list[dict[str, str]]:
    """The matrix of ``.ci/run``, one entry per tested torch release, as its lines say them."""
    block = re.search(r"^MATRIX=\(\n(.*?)^\)$", (ROOT / ".ci" / "run").read_text(), re.M | re.S)[1]
    entries = [line.strip().strip('"').split() for line in block.splitlines() if line.strip()]
    assert all(len(entry) == 3 for entry in entries), entries
    return [dict(zip(("torch", "torchvision", "kind"), entry)) for entry in entries]


def test_ci_runs_the_readme_set_up():
    commands = _commands((ROOT / ".ci" / "run").read_text().replace("\\\n", " "))
    installs = [i for i, command in enumerate(commands) if command.endswith('-m pip install --quiet -e ".[test]"')]
    tests, slow = commands.index('"$python" -m pytest -n auto'), commands.index('"$python" -m pytest -m slow -n auto')
    assert installs and max(installs) < tests < slow
    # torch pinned in every install that names it, so that nothing pulls another build.
    for command in commands:
        if "pip install" in command and "torch" in command.replace("torchvision", ""):
            assert '"torch==$torch_version"' in command, command
    # The zoo's libraries, installed before the tests, and required by them (tests/zoo.py).
    zoo_installs = [i for i, command in enumerate(commands) if "torchvision" in command and "timm" in command]
    assert zoo_installs and max(zoo_installs) < tests
    assert f"export {zoo.REQUIRE_VARIABLE}=1" in commands and f"export {zoo.STUB_VARIABLE}=1" in commands
    assert f"unset {zoo.STUB_VARIABLE}" in commands  # a matched torchvision runs without the stub
    # e3nn requires torch: both steps install it without its requirements, before the tests.
    e3nn = [i for i, command in enumerate(commands) if "pip install" in command and "e3nn==" in command]
    assert len(e3nn) == 2 and max(e3nn) < tests
    assert all("--no-deps" in commands[i] for i in e3nn)


def test_ci_tests_the_floor_and_the_newest_release_with_the_real_torchvision():
    matrix = _ci_matrix()
    versions = [Version(entry["torch"]) for entry in matrix]
    assert len(matrix) >= 2 and versions == sorted(versions) and len(set(versions)) == len(versions)
    assert all(entry["kind"] in ("matched", "stubbed") for entry in matrix)
    # The stub stands in for a torchvision that does not match its CPU torch: the floor only.
    assert all(entry["kind"] == "matched" for entry in matrix[1:])


def test_the_requirement_admits_the_tested_releases_from_the_floor_on():
    from packaging.requirements import Requirement

    setup = (ROOT / "setup.cfg").read_text()
    requirements = re.search(r"install_requires =\n((?:    .+\n)+)", setup)[1].split()
    [torch_requirement] = [Requirement(line) for line in requirements if Requirement(line).name == "torch"]
    matrix = [Version(entry["torch"]) for entry in _ci_matrix()]
    assert all(torch_requirement.specifier.contains(version) for version in matrix)
    # The requirement's floor is the minor release of the matrix's first line: nothing older.
    lower = [Version(spec.version) for spec in torch_requirement.specifier if spec.operator in (">=", "~=")]
    assert lower and max(lower).release[:2] == matrix[0].release[:2], (torch_requirement, matrix[0])


def test_the_supported_versions_are_the_matrix():
    text = (ROOT / "docs" / "guarantees.md").read_text()
    start = text.index("\n## Supported PyTorch versions\n")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end != -1 else None]
    rows = re.findall(r"^\| (\d+\.\d+\.\d+) \| (\d+\.\d+\.\d+) \|", section, re.M)
    assert rows == [(entry["torch"], entry["torchvision"]) for entry in _ci_matrix()]


def test_the_user_set_up_has_no_workaround_of_the_tests():
    # `pip install --no-deps torchvision` beside a CPU torch puts PyPI's CUDA-built torchvision
    # there, whose import fails; users install torchvision from their torch's index instead.
    for page in USER_PAGES:
        for block in fenced_blocks(page):
            for command in _commands(block.code) if block.language == "bash" else []:
                assert not ("--no-deps" in command and "torchvision" in command), f"{block.name}: {command}"


LAB_NOTES = {
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "a time of day": re.compile(r"\b\d\d:\d\d UTC\b"),
    "a commit hash": re.compile(r"\bcommit [0-9a-f]{7,40}\b|\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b"),
    "a source note": re.compile(r"NOTE: \["),
    "an issue number": re.compile(r"\bissue \d+\b", re.I),
    "session chronology": re.compile(r"later the same day|later that day|earlier run|this session|load average",
                                     re.I),
}


@pytest.mark.parametrize("page", USER_PAGES, ids=[page.name for page in USER_PAGES])
def test_user_pages_hold_no_lab_notes(page):
    found = [
        f"{page.name}:{text[:match.start()].count(chr(10)) + 1}: {what} ({match[0]!r})"
        for text in [page.read_text()]
        for what, pattern in LAB_NOTES.items()
        for match in pattern.finditer(text)
    ]
    assert not found, "measurements, dates and history belong in docs/benchmarks.md:\n" + "\n".join(found)


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 120
