"""``torchntk env``: whether torch and the optional model libraries import beside each other.

A torchvision built for another torch (PyPI's CUDA wheel beside the CPU torch from PyTorch's
index, left there when that index could not be reached: pip still exits 0) installs but does not
import, and timm and transformers fail with it. This prints torch's version and build, then for
every optional library whether it imports, the first line of its error if not, and what to do.

Exit statuses: 0 every installed library imports (a library that is not installed is fine: none is
required); 1 one or more installed libraries do not import.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import platform
import sys
from typing import Optional, Sequence

__all__ = ["main"]

LIBRARIES = ("torchvision", "timm", "transformers", "peft", "e3nn")
"""The optional model libraries the docs and tests use, in the order they depend on each other."""
_LOADED_LAZILY = {"transformers": "transformers.modeling_utils", "peft": "transformers.modeling_utils",
                  "e3nn": "e3nn.o3"}
"""What else to import to know that a library imports: transformers imports its models (and through
them torchvision) only when they are used; e3nn's ``o3`` is where its layers are."""
_GUIDE = "docs/real_models.md, section 'Installing the model libraries'"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Prints the report (see the module docstring) and returns the exit status.

    Example:
        From a shell: ``python -m torchntk env`` (or ``torchntk env``).
    """
    argparse.ArgumentParser(
        prog="torchntk env",
        description="Whether torch and the optional model libraries (" + ", ".join(LIBRARIES) + ") import "
        "beside each other, and what to do where one does not.",
    ).parse_args(list(argv or []))
    import torch

    import torchntk

    index = _torch_index(torch)
    print(f"python {platform.python_version()} ({sys.executable})")
    print(f"torchntk {torchntk.__version__}")
    print(f"torch {torch.__version__}: {_build(torch)}")
    broken = []
    width = max(len(name) for name in LIBRARIES) + 2
    for name in LIBRARIES:
        state, detail = _import_state(name)
        print(f"{name + ':':{width}s}{detail}")
        if state == "broken":
            broken.append(name)
    if not broken:
        return 0
    print()
    for name in broken:
        print(f"{name}: {_advice(name, torch.__version__.split('+')[0], index, broken)}")
    return 1


def _build(torch) -> str:
    """Which build of torch this is, and what it finds."""
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda} build, {torch.cuda.device_count()} GPU(s) visible"
    if getattr(torch.version, "hip", None):
        return f"ROCm {torch.version.hip} build, {torch.cuda.device_count()} GPU(s) visible"
    return "CPU build"


def _torch_index(torch) -> str:
    """The PyTorch index whose wheels are built for this torch (``cpu``, ``cu128``, ...)."""
    if torch.version.cuda:
        return "cu" + torch.version.cuda.replace(".", "")
    if getattr(torch.version, "hip", None):
        return "rocm" + ".".join(torch.version.hip.split(".")[:2])
    return "cpu"


def _import_state(name: str) -> tuple[str, str]:
    """``("ok" | "missing" | "broken", one line)`` for the library ``name``."""
    if importlib.util.find_spec(name) is None:
        return "missing", "not installed (optional)"
    try:
        module = importlib.import_module(name)
        if name in _LOADED_LAZILY:
            importlib.import_module(_LOADED_LAZILY[name])
    except Exception as error:  # a broken install raises more than ImportError (RuntimeError from torch)
        lines = str(error).strip().splitlines()
        return "broken", f"{_installed(name)}, does not import: {type(error).__name__}: {lines[0] if lines else ''}"
    return "ok", f"{getattr(module, '__version__', 'installed')}, imports"


def _installed(name: str) -> str:
    try:
        return f"{importlib.metadata.version(name)} installed"
    except Exception:  # noqa: BLE001 - no distribution metadata (a source tree on sys.path)
        return "installed"


def _advice(name: str, release: str, index: str, broken: Sequence[str]) -> str:
    """What to do about ``name``, which does not import beside torch ``release`` (its PyTorch
    ``index``, :func:`_torch_index`)."""
    if name == "torchvision":
        return ("install the torchvision built for this torch, from the index this torch came from: "
                f'pip install "torch=={release}" torchvision --index-url https://download.pytorch.org/whl/{index} '
                "and check that pip reached that index (where it cannot, pip installs PyPI's torchvision, "
                f"built for PyPI's CUDA torch, and still exits 0); see {_GUIDE}.")
    if "torchvision" in broken and name in ("timm", "transformers", "peft"):
        return "it imports torchvision: fix torchvision first (above), then run `python -m torchntk env` again."
    return (f"reinstall it beside this torch (pip install --force-reinstall --no-deps {name}, then its own "
            f"requirements), or uninstall it; see {_GUIDE}.")
