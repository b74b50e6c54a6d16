"""Every Python example in README.md runs."""

import pathlib
import re

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_examples():
    assert EXAMPLES


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_readme_example_runs(index):
    exec(compile(EXAMPLES[index], f"README.md example {index}", "exec"), {})
