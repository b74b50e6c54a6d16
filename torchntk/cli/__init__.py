"""The ``torchntk`` command (also ``python -m torchntk``).

* ``torchntk [options]``: the demo (``demo.py``): a model's NTK with every implementation.
* ``torchntk bench [options]``: the benchmarks (``bench.py``), side by side with
  neural-tangents when ``jax`` and ``neural_tangents`` are installed.
* ``torchntk env``: torch's version and build, and whether each optional model library
  (torchvision, timm, transformers, peft, e3nn) imports beside it, with what to do where one does
  not (``env.py``; exit status 1 where an installed one does not import).
* ``torchntk --version``: the installed version (``torchntk.__version__``).

Exit statuses: 0 success; 1 two implementations disagree (the demo); 2 a bad command-line
argument, with one line on standard error; 3 the user's model failed in the demo: its import, its
factory, the factory's result, its forward pass or an implementation (one line on standard error
per failure, the other models and implementations still run, ``results.md`` records it). See
``demo.py``.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from ._models import UsageError

__all__ = ["main"]


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    Example:
        >>> from torchntk.cli import main
        >>> main(["--model", "nonsense"])     # one line on standard error, exit status 2
        2
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        if arguments[:1] == ["bench"]:
            from . import bench

            return bench.main(arguments[1:])
        if arguments[:1] == ["env"]:
            from . import env

            return env.main(arguments[1:])
        from . import demo

        return demo.main(arguments)
    except (UsageError, ValueError) as error:
        # ValueError: the library's own argument checks (e.g. a trace axis out of range), which
        # name the argument, the value and what was expected.
        sys.stderr.write(f"torchntk: error: {_one_line(error)}\n")
        return 2
    except SystemExit as stop:  # argparse: --help, or a bad argument already reported in one line
        return int(stop.code or 0)


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())
