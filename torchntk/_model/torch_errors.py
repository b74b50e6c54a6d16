"""PyTorch's errors for models that ``torch.func`` cannot transform, restated as what to do.

A model that writes in place into a tensor it did not create, or that uses an operation without a
forward-mode derivative, makes ``torch.func`` raise a RuntimeError or NotImplementedError whose
text speaks of transforms and captured tensors. :func:`explained` turns those into a ValueError
that names the operation, says why it fails and which settings compute the kernel instead, with
PyTorch's error chained. Errors it does not recognise pass through unchanged.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator, Optional

_IN_PLACE_UNDER_GRAD = re.compile(r"attempted to call in-place operation \((?P<op>[\w:.]+)\) that would mutate a captured")
_IN_PLACE_UNDER_VMAP = re.compile(r"vmap: (?P<op>[\w:.]+)\(self, \*extra_args\) is not possible")
_NO_FORWARD_MODE = re.compile(
    r"Trying to use forward AD with (?P<op>[\w:.]+) that does not support it"
    r"|(?P<custom>You must implement the jvp function for custom autograd\.Function)"
)


def missing_forward_mode(error: BaseException) -> Optional[str]:
    """What lacks a forward-mode derivative according to PyTorch's ``error``, or None.

    Returns:
        The operation's name (e.g. ``"aten::_weight_norm_interface"``), or ``"a custom
        torch.autograd.Function without jvp"``; None when ``error`` says something else.
    """
    if not isinstance(error, (RuntimeError, NotImplementedError)):
        return None
    found = _NO_FORWARD_MODE.search(str(error))
    if found is None:
        return None
    return found["op"] or "a custom torch.autograd.Function without jvp"


def _explanation(error: BaseException, where: str) -> str | None:
    text = str(error)
    found = _IN_PLACE_UNDER_GRAD.search(text)
    if found:
        return (
            f"{where}: the model writes in place into a tensor it did not create ({found['op']}; e.g. "
            f"nn.Embedding(max_norm=...) renormalising its weight, or `param.data.clamp_()` in "
            f"forward), which torch.func cannot differentiate here. The module itself is not changed "
            f"(torchntk works on private copies). Make the write out of place or apply it to the "
            f"module once before computing the kernel; implementation=1 or 2 with vmap_axes=None "
            f"differentiate some such models."
        )
    found = _IN_PLACE_UNDER_VMAP.search(text)
    if found:
        return (
            f"{where}: the model writes in place ({found['op']}) into a tensor shared by all examples, "
            f"which the per-example evaluation of `vmap_axes` (torch.func.vmap) cannot do. Pass "
            f"vmap_axes=None, or make the write out of place."
        )
    missing = missing_forward_mode(error)
    if missing:
        return (
            f"{where}: this needs forward-mode derivatives (torch.func.jvp), and PyTorch has none for "
            f"{missing} (used by this model). The kernel functions do not need them: their "
            f"implementations 1 and 3 use reverse mode only, and 2 falls back to it."
        )
    return None


@contextlib.contextmanager
def explained(where: str) -> Iterator[None]:
    """Re-raises torch.func's transform errors as a ValueError saying what to do (see module doc).

    Raises:
        ValueError: chained to the original error, when it is one of the recognised kinds.
    """
    try:
        yield
    except (RuntimeError, NotImplementedError) as error:
        message = _explanation(error, where)
        if message is None:
            raise
        raise ValueError(message) from error
