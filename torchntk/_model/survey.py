"""What a walk of a module's tree tells, walked once per plan key instead of once per question.

NOTE: [Module surveys]
Building a module's functional model asks the module tree half a dozen questions: its
parameters (each name, and each tensor once), its buffers, whether it holds TorchScript or
recurrent modules, which layers couple or randomise the examples in training mode, which call
fused kernels. Asked of ``nn.Module`` one by one, each is a walk of the tree (eleven walks a
warm call on schnetpack's SchNet, 0.5 ms of a 12 ms kernel call). :class:`ModuleSurvey` answers
them from two walks, and a warm call reuses its key's survey (the plan's template keeps it): a
plan key holds the module's structure fingerprint (every submodule, parameter and buffer slot
by identity, every plain attribute) and its train/eval modes, so under one key the tree and
every answer are the same. The tensors themselves are read from the submodules' tables on
every call, so a survey holds no tensor, and values written since (an optimiser's step, a
``load_state_dict``) are seen. A plan keeps a survey with weak references to the submodules
(:class:`KeptSurvey`), so a submodule the user replaced is not kept alive by the plans of the
keys it was part of.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Iterable, Optional

import torch
from torch import nn

from .unfused import fused_layers

__all__ = ["KeptSurvey", "ModuleSurvey", "survey_of", "training_mode_layers"]


@dataclass(frozen=True)
class ModuleSurvey:
    """The answers of one walk of ``module``.

    Attributes:
        module: the module walked.
        entries: ``named_modules(remove_duplicate=False)``: every path to every submodule.
        unique: ``named_modules()``: each submodule once, under its first path.
        scripted: paths (or class names) of the TorchScript submodules.
        recurrent: whether a submodule is an ``nn.RNNBase``.
        coupled, random: :func:`training_mode_layers`.
        fused: :func:`~torchntk._model.unfused.fused_layers`.
    """

    module: nn.Module
    entries: tuple[tuple[str, nn.Module], ...]
    unique: tuple[tuple[str, nn.Module], ...]
    scripted: tuple[str, ...]
    recurrent: bool
    coupled: tuple[str, ...]
    random: tuple[str, ...]
    fused: tuple[str, ...]

    def parameters(self, remove_duplicate: bool = True) -> dict[str, torch.Tensor]:
        """``dict(module.named_parameters(remove_duplicate=...))``, without walking the tree."""
        return _named(self.unique if remove_duplicate else self.entries, "_parameters", remove_duplicate)

    def buffers(self) -> dict[str, torch.Tensor]:
        """``dict(module.named_buffers(remove_duplicate=False))``, without walking the tree."""
        return _named(self.entries, "_buffers", False)

    def kept(self) -> "KeptSurvey":
        """This survey as a plan keeps it: the modules by weak reference."""
        return KeptSurvey(
            weakref.ref(self.module), tuple((path, weakref.ref(sub)) for path, sub in self.entries),
            tuple((path, weakref.ref(sub)) for path, sub in self.unique),
            (self.scripted, self.recurrent, self.coupled, self.random, self.fused),
        )


@dataclass(frozen=True)
class KeptSurvey:
    """A :class:`ModuleSurvey` with weak references to the modules (see the module docstring)."""

    module: weakref.ref
    entries: tuple[tuple[str, weakref.ref], ...]
    unique: tuple[tuple[str, weakref.ref], ...]
    answers: tuple  # scripted, recurrent, coupled, random, fused

    def revived(self, module: nn.Module) -> Optional[ModuleSurvey]:
        """The survey of ``module`` again, or None where it was made of another module or one of its
        submodules is gone."""
        if self.module() is not module:
            return None
        entries = tuple((path, ref()) for path, ref in self.entries)
        unique = tuple((path, ref()) for path, ref in self.unique)
        if any(sub is None for _, sub in entries):
            return None
        return ModuleSurvey(module, entries, unique, *self.answers)


def survey_of(module: nn.Module, kept: Optional[KeptSurvey] = None) -> ModuleSurvey:
    """The survey ``kept`` under the call's plan key, where it is one of ``module`` (the key vouches
    for the rest: NOTE: [Module surveys]), else a new one."""
    revived = None if kept is None else kept.revived(module)
    if revived is not None:
        return revived
    entries = tuple(module.named_modules(remove_duplicate=False))
    unique = tuple(module.named_modules())
    scripted = tuple(path or type(sub).__name__ for path, sub in unique if isinstance(sub, torch.jit.ScriptModule))
    coupled, random = _training_mode_layers(unique)
    return ModuleSurvey(
        module, entries, unique, scripted, any(isinstance(sub, nn.RNNBase) for _, sub in unique), coupled, random,
        fused_layers(module, unique),
    )


def training_mode_layers(module: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(coupled, random)``: labels of the submodules using batch statistics, and of those drawing
    random numbers in training mode."""
    return _training_mode_layers(module.named_modules())


def _training_mode_layers(named: Iterable[tuple[str, nn.Module]]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    coupled, random = [], []
    for path, sub in named:
        label = f"{type(sub).__name__} at {path!r}" if path else type(sub).__name__
        if isinstance(sub, nn.modules.batchnorm._BatchNorm) and (sub.training or not sub.track_running_stats):
            coupled.append(label)
        dropout = isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0
        attention_dropout = isinstance(sub, nn.MultiheadAttention) and sub.dropout > 0
        if sub.training and (dropout or attention_dropout):
            random.append(label)
    return tuple(coupled), tuple(random)


def _named(entries: tuple[tuple[str, nn.Module], ...], table: str, remove_duplicate: bool) -> dict[str, torch.Tensor]:
    """What ``nn.Module._named_members`` gives for ``table`` over ``entries`` (the same names, order
    and duplicates)."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for prefix, sub in entries:
        for name, value in sub.__dict__[table].items():
            if value is None or id(value) in seen:
                continue
            if remove_duplicate:
                seen.add(id(value))
            found[f"{prefix}.{name}" if prefix else name] = value
    return found
