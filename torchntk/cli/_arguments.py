"""Argument parsing for the command line: value types, one-line errors, plain and Markdown tables."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn, Optional

import torch

from ._models import UsageError

OK, DISAGREE, USAGE, MODEL_FAILED = 0, 1, 2, 3
"""Exit statuses: all ran and agree; two implementations disagree; a bad argument (one line on
standard error); a model failed (raised while building, in its forward pass, or computing a kernel
with some implementation). A failure outranks a disagreement."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``torchntk: error: ...``), exit status 2.

    Every command has ``--version``: it prints ``torchntk`` and ``torchntk.__version__`` and exits
    with status 0.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        from .. import __version__

        self.add_argument("--version", action="version", version=f"torchntk {__version__}",
                          help="print the version of torchntk and exit")

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        raise SystemExit(USAGE)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """``"8,16,32"`` -> ``(8, 16, 32)``, every entry positive."""
    return tuple(positive_int(part) for part in text.split(",") if part.strip())


def shape(text: str) -> tuple[int, ...]:
    values = int_list(text)
    if not values:
        raise argparse.ArgumentTypeError(f"expected a shape such as 3,32,32, got {text!r}")
    return values


def axes(text: str) -> tuple[int, ...]:
    """``"-1"``, ``"0,2"``, or ``"none"``/``""`` for no axes."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers or 'none', got {text!r}") from None


def optional_int(text: str) -> Optional[int]:
    if text.strip().lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none', got {text!r}") from None


def memory(text: str) -> float:
    """``"8GB"``, ``"512MiB"``, ``"2e9"`` or ``"unlimited"``: the ``memory=`` budget of the kernel functions."""
    from .._memory import memory_argument

    try:
        return memory_argument(text, "--memory")
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"expected an amount of memory such as 8GB or 512MiB, got {text!r}") from None


def device(text: str) -> torch.device:
    try:
        chosen = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected a device such as cpu, cuda or cuda:1, got {text!r}") from None
    if chosen.type == "cuda":
        index = chosen.index or 0
        if index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    elif chosen.type != "cpu":
        raise argparse.ArgumentTypeError(f"{text!r}: only cpu and cuda devices are supported")
    return chosen


def make_output_folder(path: Path) -> None:
    """Creates ``--output`` (and its parents) if needed.

    Raises:
        UsageError: it cannot be created (a file of that name, no permission, ...).
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"--output {str(path)!r}: cannot create that folder ({error.strerror or error})") from None


def text_table(headers: list[str], body: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in [headers] + body) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in [headers] + body]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def markdown_table(headers: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(line) + " |" for line in body])

