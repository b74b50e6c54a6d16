"""A snapshot of everything about a module, to prove that a computation left it as it was.

Exported as :class:`torchntk.testing.ModuleSnapshot`; see NOTE: [Modules are never mutated] in
``_model/functional.py`` for the promise it checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from .._model.fingerprint import structure_fingerprint


@dataclass(frozen=True)
class _TensorRecord:
    tensor: torch.Tensor  # the object the module held
    kind: type
    values: torch.Tensor  # a copy of its values
    requires_grad: bool


@dataclass(frozen=True)
class ModuleSnapshot:
    """The state of a module and of any extra tensors (e.g. a ``params`` mapping) at one moment.

    It records, for every parameter and buffer (every name, tied ones included), the tensor
    object, its class (``nn.Parameter`` or not), a copy of its values and its ``requires_grad``
    flag; every submodule's train/eval mode; and the module's structure: classes, plain
    attributes, hooks and submodules (by identity). :meth:`assert_unchanged` compares the module
    with all of that, values bit for bit (NaN equal to NaN).

    Example:
        >>> import torch
        >>> from torchntk.testing import ModuleSnapshot
        >>> model = torch.nn.Linear(3, 2)
        >>> snapshot = ModuleSnapshot.of(model)
        >>> _ = model(torch.randn(4, 3))
        >>> snapshot.assert_unchanged()
        >>> with torch.no_grad():
        ...     _ = model.weight.mul_(2)
        >>> try:
        ...     snapshot.assert_unchanged()
        ... except AssertionError as error:
        ...     print(str(error).splitlines()[1])
          parameter 'weight': values changed
    """

    module: nn.Module
    tensors: dict
    extra: dict
    modes: tuple
    structure: tuple

    @classmethod
    def of(cls, module: nn.Module, extra: Optional[dict[str, torch.Tensor]] = None) -> "ModuleSnapshot":
        """Takes the snapshot; ``extra`` names other tensors that must stay unchanged too."""
        named = [("parameter", name, p) for name, p in module.named_parameters(remove_duplicate=False)]
        named += [("buffer", name, b) for name, b in module.named_buffers(remove_duplicate=False)]
        tensors = {(kind, name): _record(tensor) for kind, name, tensor in named}
        return cls(
            module,
            tensors,
            {name: _record(tensor) for name, tensor in (extra or {}).items()},
            tuple((path, sub.training) for path, sub in module.named_modules(remove_duplicate=False)),
            structure_fingerprint(module),
        )

    def assert_unchanged(self) -> None:
        """Raises AssertionError listing every difference between the module now and the snapshot."""
        now = ModuleSnapshot.of(self.module)
        problems = []
        if now.structure != self.structure:
            problems.append("  structure (submodules, plain attributes, hooks or tensor slots) changed")
        if now.modes != self.modes:
            problems.append("  train/eval modes changed")
        for key in sorted(set(self.tensors) | set(now.tensors)):
            label = f"{key[0]} {key[1]!r}"
            problems += _differences(label, self.tensors.get(key), now.tensors.get(key))
        for name, record in self.extra.items():
            problems += _differences(f"extra tensor {name!r}", record, _record(record.tensor))
        if problems:
            raise AssertionError("the module changed:\n" + "\n".join(problems))


def _record(tensor: torch.Tensor) -> _TensorRecord:
    return _TensorRecord(tensor, type(tensor), tensor.detach().clone(), tensor.requires_grad)


def _differences(label: str, before: Any, after: Any) -> list[str]:
    if before is None or after is None:
        return [f"  {label}: {'added' if before is None else 'removed'}"]
    problems = []
    if after.tensor is not before.tensor:
        problems.append(f"  {label}: replaced by another tensor object")
    if after.kind is not before.kind:
        problems.append(f"  {label}: class changed from {before.kind.__name__} to {after.kind.__name__}")
    if after.requires_grad != before.requires_grad:
        problems.append(f"  {label}: requires_grad changed to {after.requires_grad}")
    if not _bitwise_equal(after.values, before.values):
        problems.append(f"  {label}: values changed")
    return problems


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])
