"""Private shells of a module: new module objects that share its tensors and nothing mutable.

``torch.func.functional_call`` evaluates a module with other tensors by swapping them into the
module's ``_parameters`` and ``_buffers`` for the duration of the call. Done on the user's module,
two threads computing kernels at once see each other's tensors (wrong kernels), an exception or an
interleaving at the wrong moment leaves plain tensors where the ``nn.Parameter``\\ s were, and
hooks that ``setattr`` on the module (old-style ``weight_norm``, ``spectral_norm``) write
torchntk's tensors into it. A shell is a copy of the module tree made of new module objects whose
``__dict__`` is a shallow copy of the original's, with their own ``_parameters``, ``_buffers``,
``_modules`` and hook dictionaries (so swapping, attribute writes and hook registrations stay in
the shell), sharing the tensors, the submodule classes and every other attribute value.
Submodules shared in the original (tied modules) are shared in the shell. A module compiled in place
(``module.compile()``), and a submodule wrapped by ``torch.compile``, are shelled uncompiled (NOTE:
[Compiled modules] in ``_model/wrappers.py``).
The shell's forward hooks and forward pre-hooks are the module's, each run under a mode that makes
their requests for gradients harmless (NOTE: [Hooks that ask for gradients] in
``_model/requires_grad.py``).

TorchScript modules cannot be shelled (nor evaluated by ``functional_call`` at all);
``_model/functional.py`` refuses them before a shell is asked for.
"""

from __future__ import annotations

import collections

from torch import nn

from .requires_grad import harmless_hook
from .wrappers import uncompiled_forward

_CONTAINER_TYPES = frozenset({dict, collections.OrderedDict, list, set})
"""Attribute values copied one level deep: the tensor, submodule and hook tables, and the plain
containers a forward pass might append to."""

_FORWARD_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks")
"""The hook tables whose hooks the shell runs through :func:`harmless_hook`; their keys (which the
tables of ``with_kwargs`` and ``always_call`` hooks refer to) and order are kept."""


def private_shell(module: nn.Module) -> nn.Module:
    """A shell of ``module`` (see the module docstring); ``module`` holds no TorchScript module.

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        >>> shell = private_shell(model)
        >>> shell is model, shell[0].weight is model[0].weight
        (False, True)
    """
    copies: dict[int, nn.Module] = {}

    def copy(original: nn.Module) -> nn.Module:
        made = copies.get(id(original))
        if made is not None:
            return made
        shell = _bare_instance(type(original))
        copies[id(original)] = shell
        state = {  # ``copy()`` of the exact types: a third of the time of ``OrderedDict(table)``
            key: value.copy() if type(value) in _CONTAINER_TYPES else value
            for key, value in original.__dict__.items()
        }
        state["_modules"] = {name: None if sub is None else copy(sub) for name, sub in original._modules.items()}
        for table in _FORWARD_HOOK_TABLES:
            hooks = state.get(table)
            if isinstance(hooks, dict) and hooks:
                state[table] = type(hooks)((key, harmless_hook(hook)) for key, hook in hooks.items())
        if state.get("_compiled_call_impl") is not None:
            # ``module.compile()`` bound its compiled call to the original module, which would run
            # with the original's tensors (NOTE: [Compiled modules]); the shell runs eagerly.
            state["_compiled_call_impl"] = None
        forward = uncompiled_forward(original, state["_modules"])
        if forward is not None:  # a compile wrapper's forward calls the user's module (NOTE: [Compiled modules])
            state["forward"] = forward
        object.__setattr__(shell, "__dict__", state)
        return shell

    return copy(module)


def _bare_instance(kind: type) -> nn.Module:
    """An instance of exactly ``kind``, without running its ``__new__``: torch.fx's ``GraphModule``
    (e3nn compiles its layers into them) makes each instance a fresh subclass there, whose class
    lacks the ``forward`` that code generation set on the original's."""
    try:
        return object.__new__(kind)
    except TypeError:  # a base laid out in C that object.__new__ cannot make
        return kind.__new__(kind)
