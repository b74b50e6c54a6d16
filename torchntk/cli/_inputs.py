"""The command line's synthetic inputs: float examples, token ids, and keyword inputs.

A model is called either as ``model(x)`` with one tensor of ``N`` examples, or, with
``--keyword-inputs``, as ``model(input_ids=..., attention_mask=...)``. Keyword calls go through
:class:`KeywordInputs`, a module taking the dict of inputs as its one argument, because kernel
functions differentiate a module called on one input pytree; the dict's tensors all carry the
examples on axis 0, so ``--vmap-axes 0`` maps every one of them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

INPUT_SEED = 1

INPUT_DTYPES: dict[str, Optional[torch.dtype]] = {
    "float": None,  # float32, or float64 with --float64: the models' own dtype
    "long": torch.int64,
    "int64": torch.int64,
    "int": torch.int32,
    "int32": torch.int32,
}
"""``--input-dtype`` choices. Integer inputs (token ids) are not differentiated: kernels only
differentiate parameters, so they need no special handling beyond being generated."""

FILLS = ("ones", "zeros")

Inputs = Union[torch.Tensor, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class KeywordInput:
    """One ``--keyword-inputs`` entry: ``name`` (random, like ``x``) or ``name=ones``/``name=zeros``."""

    name: str
    fill: Optional[str] = None


def keyword_inputs(text: str) -> tuple[KeywordInput, ...]:
    """``"input_ids,attention_mask=ones"`` -> the entries; an argparse type (errors exit 2)."""
    entries = []
    for part in (part.strip() for part in text.split(",")):
        name, equals, fill = part.partition("=")
        name, fill = name.strip(), fill.strip()
        if not name.isidentifier():
            raise argparse.ArgumentTypeError(f"expected NAME or NAME=ones|zeros, comma-separated, got {part!r} in {text!r}")
        if equals and fill not in FILLS:
            raise argparse.ArgumentTypeError(f"{part!r}: a keyword input is random, or NAME=ones or NAME=zeros")
        entries.append(KeywordInput(name, fill if equals else None))
    names = [entry.name for entry in entries]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{text!r} names {repeated[0]!r} twice")
    return tuple(entries)


@dataclass(frozen=True)
class InputSpec:
    """What one call of the model receives.

    Attributes:
        shape: shape of one example of each input (the same for every keyword input).
        dtype: an integer dtype for token ids, or None for floats in the models' dtype.
        vocab_size: integer inputs are drawn uniformly from ``[0, vocab_size)``.
        keywords: empty for ``model(x)``; else the keyword inputs of ``model(**inputs)``.
    """

    shape: tuple[int, ...]
    dtype: Optional[torch.dtype] = None
    vocab_size: Optional[int] = None
    keywords: tuple[KeywordInput, ...] = ()

    def make(self, n: int, float_dtype: torch.dtype, device: torch.device) -> Inputs:
        """``n`` examples, the same for every run (a fixed seed, independent of global state)."""
        generator = torch.Generator().manual_seed(INPUT_SEED)
        if not self.keywords:
            return self._random(n, float_dtype, generator).to(device)
        made = {}
        for entry in self.keywords:
            if entry.fill is None:
                made[entry.name] = self._random(n, float_dtype, generator)
            else:
                fill = torch.ones if entry.fill == "ones" else torch.zeros
                made[entry.name] = fill((n, *self.shape), dtype=self.dtype or float_dtype)
        return {name: tensor.to(device) for name, tensor in made.items()}

    def describe(self, n: int) -> str:
        """E.g. ``"16 examples of shape (8,), int64 in [0, 100)"`` (plus the keyword inputs)."""
        kind = f"{str(self.dtype).replace('torch.', '')} in [0, {self.vocab_size})" if self.dtype else "standard normal"
        text = f"{n} examples of shape {tuple(self.shape)}, {kind}"
        if self.keywords:
            names = ", ".join(entry.name if entry.fill is None else f"{entry.name}={entry.fill}" for entry in self.keywords)
            text += f", as keyword inputs {names}"
        return text

    def _random(self, n: int, float_dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
        if self.dtype is None:
            return torch.randn((n, *self.shape), generator=generator, dtype=float_dtype)
        return torch.randint(0, self.vocab_size, (n, *self.shape), generator=generator, dtype=self.dtype)


class KeywordInputs(nn.Module):
    """``model`` called as ``model(**inputs)`` on a dict of inputs.

    Example:
        >>> import torch
        >>> class Net(torch.nn.Module):
        ...     def forward(self, input_ids, attention_mask):
        ...         return (input_ids * attention_mask).float()
        >>> KeywordInputs(Net())({"input_ids": torch.tensor([2]), "attention_mask": torch.tensor([1])})
        tensor([2.])
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, inputs: dict[str, torch.Tensor]):
        return self.model(**inputs)
