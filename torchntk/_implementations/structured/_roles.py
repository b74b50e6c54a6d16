"""What a rule says about one parameter consumed by one recorded call.

NOTE: [Roles and their factors]
A recorded call ``y = op(p, z)`` contributes ``J_p = G Y`` to the Jacobian, where
``G = df/dy`` (computed for every output entry by batched VJPs) and ``Y = dy/dp`` is structured.
A :class:`Role` states ``J_p`` as an einsum over letters local to the rule:

    J[out..., param_labels] = G[out..., g_labels] * operand_1[labels_1] * ... * scale

``G``'s ``y`` part is first viewed as ``y_shape``. Letters in ``param_labels`` index the
parameter's coordinates (viewed as ``param_shape``); every other letter is summed on its own
side. Two roles of the same parameter on the two sides are contracted by giving their parameter
letters one shared symbol, so one einsum per pair of uses computes ``J1 J2^T`` without ever
forming ``J`` (NOTE: [Pair contraction] in ``_contract.py``).

Operands are per example: when the kernel is computed per example (``vmap_axes``), every
operand gains a leading example axis which shares its symbol with the output's batch axis.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..._utils.capturing import structural

OutputSpec = tuple[tuple[int, ...], torch.dtype]
"""The shape and dtype of a rule call's output, per example (where a perturbation is added)."""

_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def letters(count: int, start: int = 0) -> str:
    """``count`` distinct einsum letters from the ``start``-th on, for a role's labels.

    Args:
        count: how many letters (rules use at most a few dozen).
        start: how many letters to skip (to keep clear of letters already used).

    Returns:
        The letters as one string, in a fixed order.
    """
    return _ALPHABET[start : start + count]


@dataclass(frozen=True)
class ParamRef:
    """A parameter tensor as a rule sees it: ``param.flatten()[index]`` (or the parameter itself).

    ``index`` is an integer tensor of the seen tensor's shape, holding flat positions in the
    parameter; ``None`` means the parameter itself. Views, slices and dtype casts between a
    parameter and its consumer give an ``index`` (see ``_views.py``).
    """

    param: int
    index: Optional[torch.Tensor] = None

    @functools.cached_property
    def injective(self) -> bool:
        """Whether no parameter entry is seen twice (a broadcast view sees some entries twice)."""
        if self.index is None:
            return True
        with structural():
            return torch.unique(self.index).numel() == self.index.numel()

    def overlaps(self, other: "ParamRef") -> bool:
        """Whether both see at least one common entry of the same parameter."""
        if self.param != other.param:
            return False
        if self.index is None or other.index is None:
            return True
        with structural():
            return bool(torch.isin(self.index, other.index).any())

    def same_coordinates(self, other: "ParamRef") -> bool:
        """Whether both see the same entries of the same parameter in the same order."""
        if self.param != other.param:
            return False
        if self.index is None or other.index is None:
            return self.index is None and other.index is None
        if self.index is other.index:
            return True
        with structural():
            return self.index.shape == other.index.shape and torch.equal(self.index, other.index)

    def scatter(self, values: torch.Tensor, size: int) -> torch.Tensor:
        """Moves values over the seen entries into the parameter's own flat coordinates.

        Args:
            values: ``(..., seen entries)``, the last axis in the order of the flat ``index``.
            size: the parameter's number of entries.

        Returns:
            ``(..., size)``: zero at entries not seen, summed over entries seen more than once
            (a broadcast view). ``values`` itself when the parameter is seen whole.
        """
        if self.index is None:
            return values
        full = values.new_zeros(*values.shape[:-1], size)
        return full.index_add_(-1, self.index.reshape(-1).to(values.device), values)


@dataclass
class Role:
    """``J_p`` of one parameter (or a weight/bias pair, see :attr:`refs`) in one recorded call.

    Attributes:
        refs: the parameter seen (one ref), or a (weight, bias) pair stated jointly so that the
            pair shares one contraction (e.g. ``[x, 1]`` as the operand of a linear layer). A
            joint role's coordinates hold the bias in the last entry of the last parameter axis
            and the weight in the others (``_verify.py`` splits them that way).
        name: the role in the op, for messages (``"weight"``, ``"bias"``, ``"weight+bias"``).
        y_shape: the shape ``G``'s per-example ``y`` part is viewed as.
        g_labels: letters of that view.
        operands: ``(tensor, letters)`` pairs; tensors are per example.
        param_labels: letters of the parameter coordinates, in order.
        param_shape: the shape of the parameter coordinates ``param_labels`` index.
        scale: a constant factor (``-1`` for ``x - p``, ``alpha`` of ``torch.add``).
        local: ``y`` as a function of the seen parameter tensor, the other inputs fixed; used to
            compute ``dy/dp`` densely when closed-form rules are switched off.
        seen: the tensor the op received for the parameter (the parameter, or a view or cast of
            it): where ``local`` is evaluated.
    """

    refs: tuple[ParamRef, ...]
    name: str
    y_shape: tuple[int, ...]
    g_labels: str
    operands: list[tuple[torch.Tensor, str]]
    param_labels: str
    param_shape: tuple[int, ...]
    scale: float = 1.0
    local: Optional[Callable[[torch.Tensor], torch.Tensor]] = field(default=None, repr=False)
    seen: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def joint(self) -> bool:
        """Whether the role states a weight and its bias together."""
        return len(self.refs) > 1

    @functools.cached_property
    def unit(self) -> tuple[int, ...]:
        """The parameter indices this role covers (asked for a few times per use and contraction
        on every call; ``refs`` is never reassigned, a changed role is a new one)."""
        return tuple(ref.param for ref in self.refs)

    def in_parameter_order(self, shape: tuple[int, ...]) -> "Role":
        """The role stated on its parameter itself (of ``shape``) where it sees the whole parameter
        through a transpose or permute (a traced backward pass's ``g @ W`` beside ``x @ W.T``), so
        that its pairs with the other uses contract by einsum (NOTE: [Unrolled derivatives]);
        otherwise the role itself."""
        from ._views import axis_permutation  # _views imports this module

        if self.joint or self.refs[0].index is None or tuple(self.param_shape) != tuple(self.refs[0].index.shape):
            return self
        with structural():
            perm = axis_permutation(self.refs[0].index, shape)
        if perm is None:
            return self
        labels = [""] * len(perm)
        for axis, target in enumerate(perm):
            labels[target] = self.param_labels[axis]
        inverse = tuple(perm.index(axis) for axis in range(len(perm)))
        local = self.local
        return dataclasses.replace(
            self, refs=(ParamRef(self.refs[0].param),), param_labels="".join(labels), param_shape=tuple(shape),
            local=None if local is None else (lambda param: local(param.permute(perm))),
            seen=None if self.seen is None else self.seen.permute(inverse),
        )

    @functools.cached_property
    def summed(self) -> Optional["Role"]:
        """The role with the letters of ``G`` that no operand and no parameter coordinate carries
        summed out, or None where there are none (NOTE: [Kept factors of operandless roles]).
        Cached: it depends on the letters and shapes alone, which :meth:`with_operands` keeps, and
        a role with operands has none to sum."""
        labels = self.g_labels
        if self.operands or len(set(labels)) != len(labels) or set(labels) <= set(self.param_labels):
            return None
        kept = [(label, size) for label, size in zip(labels, self.y_shape) if label in self.param_labels]
        return dataclasses.replace(
            self, y_shape=tuple(size for _, size in kept), g_labels="".join(label for label, _ in kept),
        )

    def with_operands(self, operands: list[tuple[torch.Tensor, str]]) -> "Role":
        """The role with other operand tensors (a whole-batch pass's, or a span of the examples):
        ``dataclasses.replace`` without its ``__init__``, a few microseconds for each of a call's
        uses on every call."""
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)  # with ``unit`` where cached: ``refs`` is the same
        twin.operands = operands
        return twin

    def on_meta(self) -> "Role":
        """A copy whose operands are meta tensors of the same shapes and dtypes, without ``local``
        and ``seen``: all of it may leave the ``torch.func`` transforms of the pass that built it."""
        operands = [
            (torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"), labels) for tensor, labels in self.operands
        ]
        return dataclasses.replace(self, operands=operands, local=None, seen=None)


@dataclass
class RuleCall:
    """What a rule returns for one call: the op's output and how to state its parameters' roles.

    ``build()`` returns the separate roles and, optionally, a ``joint`` role stating a weight and
    a bias together; the plan uses the joint one when the two are always used together. Roles are
    only built when needed.
    """

    output: torch.Tensor
    build: Callable[[], tuple[list[Role], Optional[Role]]]
    _built: Optional[tuple[list[Role], Optional[Role]]] = field(default=None, repr=False)

    def roles(self) -> tuple[list[Role], Optional[Role]]:
        """``build()``, once."""
        if self._built is None:
            self._built = self.build()
        return self._built

    def keep_shapes_only(self) -> None:
        """Builds the roles now and keeps them on meta tensors (:meth:`Role.on_meta`).

        A probe pass runs under ``torch.func`` transforms whose tensors must not outlive them; the
        plan and AUTO only need the operands' shapes. The output and ``build`` (whose closure holds
        the call's inputs and parameters) are dropped too: a cached plan keeps these calls, and
        must not keep the kernel call's copy-on-write parameters alive (NOTE: [Modules are never
        mutated] in ``_model/functional.py``).
        """
        separate, joint = self.roles()
        built = ([role.on_meta() for role in separate], None if joint is None else joint.on_meta())
        self._built = built
        self.build = lambda: built
        self.output = torch.empty(self.output.shape, dtype=self.output.dtype, device="meta")
