"""The float64 view of a model that the reference kernels of :mod:`torchntk.testing` differentiate.

Part of the oracle: like ``torchntk/testing/__init__.py`` it shares no code with the library, so that the
library's kernels are checked against something computed independently. A model ``f`` becomes a
float64 function of one flat parameter vector ``theta``, whose dense Jacobians
:func:`torch.autograd.functional.jacobian` builds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

PyTree = Any
"""A tensor, or a nesting of dict/list/tuple whose leaves are tensors."""


@dataclass
class Evaluated:
    """Outputs of ``f`` at one input and their Jacobians with respect to the flat theta.

    Attributes:
        spec: pytree structure of the output.
        jacobians: one tensor per output leaf, shape ``(*leaf.shape, P)``.
    """

    spec: pytree.TreeSpec
    jacobians: list[Tensor]

    def flat_jacobian(self) -> Tensor:
        """All output leaves flattened and concatenated: shape ``(total output size, P)``."""
        return torch.cat([j.reshape(-1, j.shape[-1]) for j in self.jacobians])


@dataclass
class Float64Model:
    """``f`` as a float64 function of a single flat parameter vector ``theta``.

    Attributes:
        theta: 1-D float64 tensor, the concatenation of every differentiated parameter entry.
        apply: ``apply(theta, x)`` evaluates ``f`` at the parameters encoded by ``theta``.
    """

    theta: Tensor
    apply: Callable[[Tensor, PyTree], PyTree]

    @staticmethod
    def build(
        f: nn.Module | Callable[..., PyTree],
        params: PyTree | Mapping[str, Tensor] | None,
        kwargs: Mapping[str, Any],
    ) -> Float64Model:
        """Dispatch on the kind of ``f`` (module or ``f(params, x)`` function)."""
        if isinstance(f, nn.Module):
            return _module_model(f, params, kwargs)
        if params is None:
            raise TypeError(
                "reference kernels: `params` is required when `f` is a function "
                "f(params, x, **kwargs); pass the parameter pytree."
            )
        return _function_model(f, params, kwargs)

    def outputs(self, x: PyTree) -> PyTree:
        """``f(x)`` in float64, without building a graph."""
        with torch.no_grad():
            return self.apply(self.theta, _float64_inputs(x))

    def evaluate(self, x: PyTree) -> Evaluated:
        """Dense Jacobians of every output leaf with respect to ``theta``."""
        x = _float64_inputs(x)
        captured: dict[str, pytree.TreeSpec] = {}

        def output_leaves(theta: Tensor) -> tuple[Tensor, ...]:
            leaves, captured["spec"] = pytree.tree_flatten(self.apply(theta, x))
            _check_output_leaves(leaves)
            return tuple(leaves)

        # On CUDA without cuDNN: its recurrent layers re-pack their weights from data pointers and
        # refuse backward passes in eval mode, while PyTorch's own CUDA kernels differentiate
        # every layer (float64 has no TF32, so nothing else changes).
        enabled = torch.backends.cudnn.enabled
        if self.theta.is_cuda:
            torch.backends.cudnn.enabled = False
        try:
            jacobians = torch.autograd.functional.jacobian(output_leaves, self.theta)
        finally:
            torch.backends.cudnn.enabled = enabled
        return Evaluated(spec=captured["spec"], jacobians=list(jacobians))


class _FlatPacking:
    """Packs a list of tensors into one flat vector and back (shapes remembered)."""

    def __init__(self, tensors: Sequence[Tensor]):
        self.shapes = [t.shape for t in tensors]

    def pack(self, tensors: Sequence[Tensor]) -> Tensor:
        """``tensors`` flattened and concatenated (an empty float64 vector for none)."""
        if not tensors:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([t.reshape(-1) for t in tensors])

    def unpack(self, theta: Tensor) -> list[Tensor]:
        """The tensors that :meth:`pack` made ``theta`` from, in their shapes."""
        sizes = [shape.numel() for shape in self.shapes]
        # Clones, not views of theta: a forward pass may write into its parameters in place
        # (nn.Embedding with max_norm renormalises rows), which autograd forbids on split views.
        return [chunk.reshape(shape).clone() for chunk, shape in zip(theta.split(sizes), self.shapes)]


def _module_model(
    module: nn.Module, params: Mapping[str, Tensor] | None, kwargs: Mapping[str, Any]
) -> Float64Model:
    """Float64 view of a module; the user's module is deep-copied so it is never touched."""
    module64 = copy.deepcopy(module).to(torch.float64)
    names, values = _differentiated_module_parameters(module64, params)
    # Everything not in `names` must be a constant: stop autograd from tracking it at all.
    for parameter in module64.parameters():
        parameter.requires_grad_(False)
    packing = _FlatPacking(values)

    def apply(theta: Tensor, x: PyTree) -> PyTree:
        overrides = dict(zip(names, packing.unpack(theta)))
        return torch.func.functional_call(module64, overrides, (x,), dict(kwargs))

    return Float64Model(theta=packing.pack(values), apply=apply)


def _differentiated_module_parameters(
    module64: nn.Module, params: Mapping[str, Tensor] | None
) -> tuple[list[str], list[Tensor]]:
    """Names and float64 values of the parameters to differentiate."""
    if params is None:
        # named_parameters() lists a tied parameter once, under its first name.
        trainable = [(n, p) for n, p in module64.named_parameters() if p.requires_grad]
        return [n for n, _ in trainable], [p.detach().clone() for _, p in trainable]
    known = dict(module64.named_parameters(remove_duplicate=False))
    names, values = [], []
    for name, value in params.items():
        if name not in known:
            raise ValueError(
                f"reference kernels: `params` names {name!r}, which is not a parameter of the "
                f"module; expected names from named_parameters(), e.g. {list(known)[:5]}."
            )
        value = torch.as_tensor(value).detach().to(torch.float64)
        if value.shape != known[name].shape:
            raise ValueError(
                f"reference kernels: `params[{name!r}]` has shape {tuple(value.shape)}, but the "
                f"module's parameter has shape {tuple(known[name].shape)}."
            )
        names.append(name)
        values.append(value.clone())
    return names, values


def _function_model(
    f: Callable[..., PyTree], params: PyTree, kwargs: Mapping[str, Any]
) -> Float64Model:
    """Float64 view of ``f(params, x, **kwargs)``: floating tensor leaves are differentiated."""
    leaves, spec = pytree.tree_flatten(params)
    leaves = [
        leaf.detach().to(torch.float64) if _is_floating_tensor(leaf) else leaf for leaf in leaves
    ]
    differentiated = [i for i, leaf in enumerate(leaves) if _is_floating_tensor(leaf)]
    packing = _FlatPacking([leaves[i] for i in differentiated])

    def apply(theta: Tensor, x: PyTree) -> PyTree:
        current = list(leaves)
        for i, value in zip(differentiated, packing.unpack(theta)):
            current[i] = value
        return f(pytree.tree_unflatten(current, spec), x, **kwargs)

    return Float64Model(theta=packing.pack([leaves[i] for i in differentiated]), apply=apply)


def _is_floating_tensor(value: Any) -> bool:
    """Whether ``value`` is a real floating-point tensor: what is differentiated and cast."""
    return isinstance(value, Tensor) and value.is_floating_point()


def _float64_inputs(x: PyTree) -> PyTree:
    """Cast floating tensors to float64; integer inputs such as token ids must stay integer."""
    return pytree.tree_map(lambda v: v.to(torch.float64) if _is_floating_tensor(v) else v, x)


def is_all_none(x2: PyTree | None) -> bool:
    """True for ``None``, a pytree made only of ``None``, or an empty container (means x1)."""
    return all(leaf is None for leaf in pytree.tree_leaves(x2))


def _check_output_leaves(leaves: Sequence[Any]) -> None:
    """Raises TypeError unless every output leaf is a floating tensor (one has a Jacobian)."""
    for leaf in leaves:
        if not _is_floating_tensor(leaf):
            raise TypeError(
                "reference kernels: every output leaf of `f` must be a floating tensor, got "
                f"{type(leaf).__name__}"
                + (f" of dtype {leaf.dtype}" if isinstance(leaf, Tensor) else "")
                + "."
            )


def check_same_structure(spec1: pytree.TreeSpec, spec2: pytree.TreeSpec) -> None:
    """Raises ValueError when ``f(x1)`` and ``f(x2)`` are different pytrees (no leaf pairing)."""
    if spec1 != spec2:
        raise ValueError(
            "reference kernels: f(x1) and f(x2) have different pytree structures:\n"
            f"  f(x1): {spec1}\n  f(x2): {spec2}"
        )


def flatten_like(cotangents: PyTree, side: Evaluated) -> Tensor:
    """Flatten ``cotangents`` in the leaf order of ``f(x2)``, checking structure and shapes."""
    leaves, spec = pytree.tree_flatten(cotangents)
    if spec != side.spec:
        raise ValueError(
            "reference_ntk_vp: `cotangents` must have the pytree structure of f(x2):\n"
            f"  cotangents: {spec}\n  f(x2):      {side.spec}"
        )
    flat = []
    for leaf, jacobian in zip(leaves, side.jacobians):
        leaf = torch.as_tensor(leaf)
        if leaf.shape != jacobian.shape[:-1]:
            raise ValueError(
                f"reference_ntk_vp: a cotangent leaf has shape {tuple(leaf.shape)}, but the "
                f"matching leaf of f(x2) has shape {tuple(jacobian.shape[:-1])}."
            )
        flat.append(leaf.to(torch.float64).reshape(-1))
    return torch.cat(flat)

