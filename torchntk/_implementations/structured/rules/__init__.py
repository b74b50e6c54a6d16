"""Closed-form derivative rules, one module per family of ops, each registering its own.

A rule is ``rule(func, args, kwargs, ref_of) -> RuleCall | None``. ``ref_of(value)`` returns the
:class:`~.._roles.ParamRef` of a differentiated parameter (or a view of one) and ``None`` for
anything else. A rule returns ``None`` when it does not apply (a parameter in an argument it has
no formula for, an option that changes the derivative); the recorder then sends the parameters
involved to the Jacobian fallback. Otherwise it computes the op's output itself and describes
each parameter's Jacobian factor as a :class:`~.._roles.Role`.

A rule is registered for the ops it covers by decorating it with :func:`rule` in its own module
(``_registry.py``); the recorder finds it with :func:`rule_for`. Every rule module is imported
here, so the table is complete whenever this package is (a new module needs its line below).
"""

from __future__ import annotations

from . import conv, elementwise, embedding, linear, matmul, norms  # noqa: F401  (registering is importing)
from ._registry import RULES, RefOf, Rule, rule, rule_for, unregister

__all__ = ["RULES", "RefOf", "Rule", "rule", "rule_for", "unregister"]
