"""Every Python example in README.md and docs/*.md runs."""

import pathlib
import re

import pytest

pytestmark = pytest.mark.cpu_only("runs the README and docs examples as written, on the CPU")

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = [
    (page.name, example)
    for page in PAGES
    for example in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)
]


def test_readme_has_examples():
    assert EXAMPLES


@pytest.mark.parametrize("index", range(len(EXAMPLES)), ids=[f"{page}-{i}" for i, (page, _) in enumerate(EXAMPLES)])
def test_example_runs(index):
    page, example = EXAMPLES[index]
    exec(compile(example, f"{page} example {index}", "exec"), {})
