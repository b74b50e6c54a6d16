"""The table of closed-form rules, filled by :func:`rule` where each rule is defined.

A rule module states which ops its rules cover next to the rules themselves::

    @rule(torch.mul, Tensor.mul, Tensor.__mul__)
    def mul_rule(func, args, kwargs, ref_of): ...

so adding a rule touches one file. The table is complete once every rule module is imported,
which ``rules/__init__.py`` does (the recorder imports that package, and ``torchntk`` the
recorder). The recorder looks rules up with :func:`rule_for`.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Mapping, Optional

from .._roles import ParamRef, RuleCall

RefOf = Callable[[Any], Optional[ParamRef]]
"""``ref_of(value)``: the parameter ``value`` is (or is a view of), ``None`` for anything else."""

Rule = Callable[[Callable, tuple, dict, RefOf], Optional[RuleCall]]
"""``rule(func, args, kwargs, ref_of)``: the call's :class:`RuleCall`, or ``None`` to decline."""

_rules: dict[Callable, Rule] = {}

RULES: Mapping[Callable, Rule] = types.MappingProxyType(_rules)
"""The registered rules (read-only), keyed by the function object a function mode receives."""


def rule(*funcs: Callable) -> Callable[[Rule], Rule]:
    """Registers the decorated function as the rule of ``funcs``.

    Args:
        *funcs: every function object through which the op reaches a ``TorchFunctionMode``
            (``torch.mul``, ``Tensor.mul`` and ``Tensor.__mul__`` are three).

    Returns:
        A decorator that registers its argument and returns it unchanged.

    Raises:
        ValueError: no function is named, one is named twice, or one already has a rule; then
            none of ``funcs`` is registered (use :func:`unregister` to replace a rule).
    """
    if not funcs:
        raise ValueError("rule() needs at least one function to register the rule for")

    def register(function: Rule) -> Rule:
        seen: set[Callable] = set()
        for func in funcs:
            if func in seen:
                raise ValueError(f"{_describe(func)} is named twice for the rule {_describe(function)}")
            seen.add(func)
            if func in _rules:
                raise ValueError(
                    f"{_describe(func)} already has the derivative rule {_describe(_rules[func])}; "
                    f"cannot register {_describe(function)} for it too (unregister the first one to replace it)"
                )
        for func in funcs:
            _rules[func] = function
        return function

    return register


def unregister(*funcs: Callable) -> None:
    """Removes the rules of ``funcs``, so that the recorder sends their parameters to the fallback.

    Raises:
        KeyError: one of ``funcs`` has no rule; then none is removed.
    """
    missing = [_describe(func) for func in funcs if func not in _rules]
    if missing:
        raise KeyError(f"no derivative rule is registered for {', '.join(missing)}")
    for func in funcs:
        del _rules[func]


def rule_for(func: Callable) -> Optional[Rule]:
    """The rule registered for ``func``, or ``None``."""
    return _rules.get(func)


def _describe(func: Callable) -> str:
    """A readable name of a function for messages (``torch.matmul``, ``TensorBase.mul``)."""
    module = getattr(func, "__module__", None)
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if name is None:
        return repr(func)
    if module is None:  # methods of ``torch.Tensor``
        return name
    if module == "torch":  # not ``torch._VariableFunctionsClass.mul``
        return f"torch.{getattr(func, '__name__', name)}"
    return f"{module}.{name}"
