"""The names a module's parameters go by: a tied parameter (one tensor registered in several places,
``decoder.weight = encoder.weight``) has one name per place, and ``named_parameters()`` lists it
once, under the first. Selections (``params=`` patterns, ``groups=`` patterns and submodules) match
any of them, so that a tied weight is selected by every name the user may know it by."""

from __future__ import annotations

from torch import nn


def parameter_names(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """Every parameter's names, keyed by the name ``named_parameters()`` gives it (listed first).

    Example:
        >>> import torch
        >>> model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> model[1].weight = model[0].weight
        >>> parameter_names(model)["0.weight"]
        ('0.weight', '1.weight')
    """
    by_tensor: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(parameter), []).append(name)
    return {names[0]: tuple(names) for names in by_tensor.values()}
