"""What a public module shows of the names it exports."""

from __future__ import annotations

import inspect
from typing import Any


def published(namespace: dict[str, Any], module: str) -> None:
    """Makes every class and function that ``namespace["__all__"]`` lists and a private module of
    torchntk defines report ``module`` as its module: ``help()``, reprs, pickles and the API pages
    then show the path users import from (``torchntk.predict.Gaussian``), never a private file."""
    for name in namespace["__all__"]:
        value = namespace[name]
        if not (inspect.isclass(value) or inspect.isfunction(value)):
            continue
        home = getattr(value, "__module__", "") or ""
        if home.startswith("torchntk.") and any(part.startswith("_") for part in home.split(".")):
            value.__module__ = module
