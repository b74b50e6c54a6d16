"""Hooks that ask for gradients, made harmless while torchntk evaluates a model.

NOTE: [Hooks that ask for gradients]
Training set-ups put forward hooks on a model that call ``output.requires_grad_(True)``: Hugging
Face's ``enable_input_require_grads()`` (which ``gradient_checkpointing_enable()`` calls for every
model of token ids, and which ``gradient_checkpointing_disable()`` leaves in place) and peft's
``prepare_model_for_kbit_training``, so that a reentrant checkpoint above frozen embeddings still
gets an input that requires grad. Under a ``torch.func`` transform PyTorch refuses any
``requires_grad_`` call ("You are attempting to call Tensor.requires_grad_() ... inside of a
function being transformed by a functorch transform"), so every kernel of such a model failed.

The request has no meaning for a kernel: torchntk differentiates the parameters it chose with its
own transforms, whatever ``requires_grad`` flags the tensors of the forward pass carry, and marking
a tensor as requiring grad changes no value. So, in the private shell of the module that torchntk
evaluates (``_model/shell.py``), every forward hook and forward pre-hook runs under
:class:`IgnoredGradRequests`, a ``TorchFunctionMode`` under which ``t.requires_grad_()``,
``t.requires_grad_(True)`` and ``t.requires_grad = True`` do nothing where PyTorch would refuse them
(inside a transform; ``requires_grad_`` returns ``t`` as it does). Everything else runs as it is:
the same requests outside transforms, requests for ``False``, and the requests ``torch.func`` makes
itself when a hook runs a transform of its own (it allows them for its inputs), which skipping would
turn into zero derivatives without an error. The user's module and its hook tables are not touched:
the shell has its own tables, holding wrapped hooks. Function modes are per thread, so nothing
changes for another thread, such as one running the user's own module meanwhile; nothing is patched
in PyTorch either (a stand-in for ``Tensor.requires_grad_`` itself would reach every thread and
``torch.func``'s own calls). Hooks registered on every module at once
(``nn.modules.module.register_module_forward_hook``) are in no table of the shell; while any exist,
the whole evaluation runs under the mode (:func:`ignored_by_global_hooks`). The model's own
``forward`` is left as it is.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

_REQUIRES_GRAD_ = torch.Tensor.requires_grad_
_SET_REQUIRES_GRAD = torch.Tensor.requires_grad.__set__  # type: ignore[attr-defined]


def asks_for_grad(func: Callable, args: tuple, kwargs: dict) -> Optional[bool]:
    """Whether ``func(*args, **kwargs)`` asks a tensor to require grad (True), asks something else
    of ``requires_grad`` (False) or is another call (None)."""
    if func == _REQUIRES_GRAD_:
        flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
        return bool(flag)
    if func == _SET_REQUIRES_GRAD:
        return len(args) > 1 and bool(args[1])
    return None


_FUNCTORCH = torch._C._functorch


def refused_here() -> bool:
    """Whether PyTorch refuses ``requires_grad_`` here: inside a ``torch.func`` transform, except
    where ``torch.func`` allows it for its own inputs."""
    return _FUNCTORCH.peek_interpreter_stack() is not None and not _FUNCTORCH.get_inplace_requires_grad_allowed()


class IgnoredGradRequests(TorchFunctionMode):
    """While active, requests that a tensor require grad, which PyTorch refuses inside a
    ``torch.func`` transform, do nothing there (NOTE: [Hooks that ask for gradients]); every other
    call runs untouched.

    Example:
        >>> import torch
        >>> def f(w):
        ...     y = w * 2
        ...     with IgnoredGradRequests():
        ...         y.requires_grad_(True)  # refused by PyTorch here, ignored instead
        ...     return y.sum()
        >>> torch.func.grad(f)(torch.ones(2))
        tensor([2., 2.])
    """

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if asks_for_grad(func, args, kwargs) and refused_here():
            return args[0] if func == _REQUIRES_GRAD_ else None
        return func(*args, **kwargs)


def harmless_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook`` running under :class:`IgnoredGradRequests` (a new mode per call: the mode stack is
    per thread, and one instance is not entered on two threads at once)."""

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        with IgnoredGradRequests():
            return hook(*args, **kwargs)

    return run


def ignored_by_global_hooks() -> contextlib.AbstractContextManager:
    """:class:`IgnoredGradRequests` while hooks registered on all modules exist, else nothing."""
    module_globals = nn.modules.module
    hooked = getattr(module_globals, "_global_forward_hooks", None) or getattr(
        module_globals, "_global_forward_pre_hooks", None
    )
    return IgnoredGradRequests() if hooked else contextlib.nullcontext()
