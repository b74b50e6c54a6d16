"""Float64 brute-force reference kernels and a kernel comparison helper.

This module is the independent oracle that torchntk's fast kernels are tested against. Its kernels
share no code with the library: every kernel here is computed the slow, obvious way, in float64:

1. build the full Jacobian ``J[a, θ] = ∂f(x)[a]/∂θ`` of every output leaf with
   :func:`torch.autograd.functional.jacobian`, where θ is the flat concatenation of all
   differentiated parameter entries;
2. contract ``J1`` with ``J2`` (or ``f(x1)`` with ``f(x2)`` for the NNGP) with one explicit
   :func:`torch.einsum` whose letters follow the kernel layout rule below.

Kernel layout (for one output leaf with ``d`` axes): walk the output axes ``i = 0..d-1`` in order;
a traced axis emits nothing and is averaged over, a diagonal axis emits one axis, and any other
axis emits two adjacent axes, the x1 one first. For example an output of shape ``(N, C)`` with
``trace_axes=(-1,)`` gives an ``(N1, N2)`` kernel, and ``trace_axes=()`` gives ``(N1, N2, C, C)``.

Use these functions in tests and debugging only: they cost one backward pass per output entry.
:class:`ModuleSnapshot` checks that a computation left a module (and any extra tensors) exactly
as it was.

The module is longer than most in torchntk on purpose: keeping the whole oracle (model handling,
layout contraction and comparison report) in one file keeps it self-contained and reviewable
independently of the library code it checks.

Example:
    >>> import torch
    >>> from torch import nn
    >>> from torchntk.testing import assert_kernels_close, reference_ntk
    >>> model = nn.Linear(4, 3)
    >>> x1, x2 = torch.randn(5, 4), torch.randn(2, 4)
    >>> ntk = reference_ntk(model, x1, x2)  # [5, 4], [2, 4] -> [5, 2]
    >>> assert_kernels_close(ntk, x1.double() @ x2.double().T + 1)  # closed form for a Linear
"""

from __future__ import annotations

import copy
import string
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, Union

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ._module_snapshot import ModuleSnapshot

__all__ = [
    "ModuleSnapshot",
    "assert_kernels_close",
    "reference_nngp",
    "reference_ntk",
    "reference_ntk_vp",
]

PyTree = Any
"""A tensor, or a nesting of dict/list/tuple whose leaves are tensors."""

Axes = Union[int, Sequence[int]]
"""An output axis or a sequence of output axes; negative axes count from the end of each leaf."""


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def reference_ntk(
    f: nn.Module | Callable[..., PyTree],
    x1: PyTree,
    x2: PyTree | None = None,
    params: PyTree | Mapping[str, Tensor] | None = None,
    trace_axes: Axes = (-1,),
    diagonal_axes: Axes = (),
    **kwargs: Any,
) -> PyTree:
    r"""Empirical NTK from dense float64 Jacobians.

    For every output leaf, with ``t``, ``dd`` and ``r`` the traced, diagonal and remaining output
    coordinates and ``|T|`` the product of the traced sizes:

    .. math::

        K[r_1, r_2, dd] = \frac{1}{|T|} \sum_t \sum_\theta
            J_1[(t, dd, r_1), \theta] \, J_2[(t, dd, r_2), \theta]

    Args:
        f: an ``nn.Module`` called as ``f(x, **kwargs)``, or a function ``f(params, x, **kwargs)``.
            For a module, the differentiated parameters are those with ``requires_grad=True``,
            each tied parameter counted once (as ``named_parameters()`` does); frozen parameters
            and buffers are constants. The module itself is never modified: a float64 deep copy
            is called through :func:`torch.func.functional_call`.
        x1: input pytree for the first kernel argument, batch size ``N1``. Floating tensors are
            cast to float64; integer tensors (e.g. token ids) are passed unchanged.
        x2: input pytree for the second argument, batch size ``N2``. ``None`` (or a pytree made
            only of ``None``) means ``x2 = x1``. Default: ``None``.
        params: for a function ``f``, the parameter pytree (required); every floating tensor leaf
            is differentiated, other leaves are passed unchanged. For a module, an optional
            mapping ``name -> tensor``: exactly those parameters are differentiated, at those
            values, and every other parameter is a constant. Default: ``None``.
        trace_axes: output axes averaged over. Default: ``(-1,)``.
        diagonal_axes: output axes on which only the diagonal ``x1 index == x2 index`` is kept.
            Default: ``()``.
        **kwargs: passed unchanged to ``f`` for both ``x1`` and ``x2``.

    Returns:
        A float64 kernel per output leaf, in the output's pytree structure (no cross terms between
        leaves). Each kernel's shape follows the layout rule in the module docstring.

    Raises:
        TypeError: ``f`` is a function and ``params`` is missing, or an output leaf is not a
            floating tensor.
        ValueError: an axis is out of range or both traced and diagonal, traced or diagonal sizes
            differ between ``f(x1)`` and ``f(x2)``, the outputs' structures or ndims differ, or a
            ``params`` name is not a parameter of the module.

    Example:
        >>> import torch
        >>> from torchntk.testing import reference_ntk
        >>> def f(params, x):
        ...     return torch.tanh(x @ params["w"]) @ params["v"]
        >>> params = {"w": torch.randn(4, 8), "v": torch.randn(8, 2)}
        >>> x1, x2 = torch.randn(5, 4), torch.randn(3, 4)
        >>> reference_ntk(f, x1, x2, params).shape  # [5, 4], [3, 4] -> [5, 3]
        torch.Size([5, 3])
        >>> reference_ntk(f, x1, None, params, trace_axes=()).shape  # x2 = x1
        torch.Size([5, 5, 2, 2])
        >>> reference_ntk(f, x1, None, params, trace_axes=(), diagonal_axes=0).shape
        torch.Size([5, 2, 2])
    """
    model = _Float64Model.build(f, params, kwargs)
    side1 = model.evaluate(x1)
    side2 = side1 if _is_all_none(x2) else model.evaluate(x2)
    _check_same_structure(side1.spec, side2.spec)
    kernels = [
        _contract(j1, j2, trace_axes, diagonal_axes)
        for j1, j2 in zip(side1.jacobians, side2.jacobians)
    ]
    return pytree.tree_unflatten(kernels, side1.spec)


def reference_nngp(
    f: nn.Module | Callable[..., PyTree],
    x1: PyTree,
    x2: PyTree | None = None,
    params: PyTree | Mapping[str, Tensor] | None = None,
    trace_axes: Axes = (-1,),
    diagonal_axes: Axes = (),
    **kwargs: Any,
) -> PyTree:
    r"""Empirical NNGP (output covariance) in float64.

    Same layout and arguments as :func:`reference_ntk`, with the outputs in place of the
    Jacobians:

    .. math::

        K[r_1, r_2, dd] = \frac{1}{|T|} \sum_t f(x_1)[(t, dd, r_1)] \, f(x_2)[(t, dd, r_2)]

    Args:
        f: module or function ``f(params, x, **kwargs)``; see :func:`reference_ntk`.
        x1: first input pytree.
        x2: second input pytree; ``None`` means ``x2 = x1``. Default: ``None``.
        params: parameters, as in :func:`reference_ntk`. Default: ``None``.
        trace_axes: output axes averaged over. Default: ``(-1,)``.
        diagonal_axes: output axes kept only on their diagonal. Default: ``()``.
        **kwargs: passed unchanged to ``f`` on both sides.

    Returns:
        A float64 kernel per output leaf, in the output's pytree structure.

    Raises:
        TypeError: as :func:`reference_ntk`.
        ValueError: as :func:`reference_ntk`.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from torchntk.testing import reference_nngp
        >>> model = nn.Linear(4, 3)
        >>> x1, x2 = torch.randn(5, 4), torch.randn(2, 4)
        >>> nngp = reference_nngp(model, x1, x2)  # [5, 4], [2, 4] -> [5, 2]
        >>> f1, f2 = model(x1).double(), model(x2).double()
        >>> torch.allclose(nngp, f1 @ f2.T / 3)  # trace = mean over the 3 outputs
        True
    """
    model = _Float64Model.build(f, params, kwargs)
    out1 = model.outputs(x1)
    out2 = out1 if _is_all_none(x2) else model.outputs(x2)
    leaves1, spec1 = pytree.tree_flatten(out1)
    leaves2, spec2 = pytree.tree_flatten(out2)
    _check_same_structure(spec1, spec2)
    # A parameter axis of size 1 lets the NNGP share the NTK contraction.
    kernels = [
        _contract(o1.unsqueeze(-1), o2.unsqueeze(-1), trace_axes, diagonal_axes)
        for o1, o2 in zip(leaves1, leaves2)
    ]
    return pytree.tree_unflatten(kernels, spec1)


def reference_ntk_vp(
    f: nn.Module | Callable[..., PyTree],
    x1: PyTree,
    x2: PyTree | None,
    params: PyTree | Mapping[str, Tensor] | None,
    cotangents: PyTree,
    **kwargs: Any,
) -> PyTree:
    r"""NTK-vector product ``J1 J2ᵀ v`` over the fully flattened outputs, in float64.

    Every output leaf is flattened and all leaves are concatenated, so cross terms between output
    leaves *are* included, there is no trace or diagonal, and no normalisation:

    .. math::

        \mathrm{out}[a] = \sum_b \sum_\theta J_1[a, \theta] \, J_2[b, \theta] \, v[b]

    Args:
        f: module or function ``f(params, x, **kwargs)``; see :func:`reference_ntk`.
        x1: first input pytree; the result is shaped like ``f(x1)``.
        x2: second input pytree, or ``None`` for ``x2 = x1``.
        params: parameters, as in :func:`reference_ntk`.
        cotangents: ``v``, a pytree with the structure and shapes of ``f(x2)``.
        **kwargs: passed unchanged to ``f`` on both sides.

    Returns:
        A float64 pytree with the structure and shapes of ``f(x1)``.

    Raises:
        TypeError: as :func:`reference_ntk`.
        ValueError: ``cotangents`` does not match ``f(x2)`` in structure or shapes.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from torchntk.testing import reference_ntk_vp
        >>> model = nn.Linear(4, 3)
        >>> x1, x2 = torch.randn(5, 4), torch.randn(2, 4)
        >>> v = torch.randn(2, 3)
        >>> out = reference_ntk_vp(model, x1, x2, None, v)  # shaped like f(x1)
        >>> out.shape
        torch.Size([5, 3])
        >>> torch.allclose(out, (x1.double() @ x2.double().T + 1) @ v.double())
        True
    """
    model = _Float64Model.build(f, params, kwargs)
    side1 = model.evaluate(x1)
    side2 = side1 if _is_all_none(x2) else model.evaluate(x2)
    v = _flatten_like(cotangents, side2)
    j1, j2 = side1.flat_jacobian(), side2.flat_jacobian()
    flat_out = j1 @ (j2.T @ v)
    sizes = [j.shape[:-1].numel() for j in side1.jacobians]
    leaves = [
        chunk.reshape(j.shape[:-1])
        for chunk, j in zip(flat_out.split(sizes), side1.jacobians)
    ]
    return pytree.tree_unflatten(leaves, side1.spec)


def assert_kernels_close(
    actual: PyTree,
    expected: PyTree,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Assert that two kernel pytrees agree in structure, shapes and values.

    An entry passes when ``|actual - expected| <= atol + rtol * |expected|`` (NaNs pass only
    against NaNs, infinities only against the same infinity). Default tolerances are keyed by the
    less precise dtype of the pair, and ``atol`` scales with the kernel's magnitude so that
    entries that should be exactly zero are judged relative to the kernel's size:

    ============  ========  ==========================
    dtype         rtol      atol
    ============  ========  ==========================
    float64       1e-10     1e-10 * max|expected|
    float32       1e-4      1e-5 * max|expected|
    float16       1e-2      1e-3 * max|expected|
    bfloat16      5e-2      1e-2 * max|expected|
    ============  ========  ==========================

    (``max|expected|`` is replaced by 1 for an all-zero kernel; integer dtypes compare exactly.)

    Args:
        actual: kernel pytree under test (tensors, or anything ``torch.as_tensor`` accepts).
        expected: reference kernel pytree, e.g. from :func:`reference_ntk`.
        rtol: relative tolerance overriding the dtype default. Default: ``None``.
        atol: *absolute* (unscaled) tolerance overriding the dtype default. Default: ``None``.

    Raises:
        AssertionError: the structures differ, or some leaf differs in shape or values. The
            message names each failing leaf by its pytree path and gives both shapes and dtypes,
            the tolerances, the number of failing entries, the max abs/rel errors and the indices
            and values of the worst entries.

    Example:
        >>> import torch
        >>> from torchntk.testing import assert_kernels_close
        >>> expected = torch.eye(2, dtype=torch.float64)
        >>> assert_kernels_close(expected.float(), expected)  # float32 tolerances apply
        >>> try:
        ...     assert_kernels_close(expected + 1e-3, expected)
        ... except AssertionError as error:
        ...     print(str(error).splitlines()[0])
        kernel <root>: 4 of 4 entries differ
    """
    actual_structure, expected_structure = _structure(actual), _structure(expected)
    if actual_structure != expected_structure:
        raise AssertionError(
            "kernel pytree structures differ:\n"
            f"  actual:   {actual_structure}\n  expected: {expected_structure}"
        )
    expected_leaves = pytree.tree_flatten_with_path(expected)[0]
    actual_by_path = dict(pytree.tree_flatten_with_path(actual)[0])
    reports = [
        _leaf_report(pytree.keystr(path) or "<root>", actual_by_path[path], leaf, rtol, atol)
        for path, leaf in expected_leaves
    ]
    failures = [report for report in reports if report is not None]
    if failures:
        raise AssertionError("\n\n".join(failures))


# ---------------------------------------------------------------------------------------------
# A float64 functional view of f: theta (one flat vector) -> output pytree
# ---------------------------------------------------------------------------------------------


@dataclass
class _Evaluated:
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
class _Float64Model:
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
    ) -> _Float64Model:
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

    def evaluate(self, x: PyTree) -> _Evaluated:
        """Dense Jacobians of every output leaf with respect to ``theta``."""
        x = _float64_inputs(x)
        captured: dict[str, pytree.TreeSpec] = {}

        def output_leaves(theta: Tensor) -> tuple[Tensor, ...]:
            leaves, captured["spec"] = pytree.tree_flatten(self.apply(theta, x))
            _check_output_leaves(leaves)
            return tuple(leaves)

        jacobians = torch.autograd.functional.jacobian(output_leaves, self.theta)
        return _Evaluated(spec=captured["spec"], jacobians=list(jacobians))


class _FlatPacking:
    """Packs a list of tensors into one flat vector and back (shapes remembered)."""

    def __init__(self, tensors: Sequence[Tensor]):
        self.shapes = [t.shape for t in tensors]

    def pack(self, tensors: Sequence[Tensor]) -> Tensor:
        if not tensors:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat([t.reshape(-1) for t in tensors])

    def unpack(self, theta: Tensor) -> list[Tensor]:
        sizes = [shape.numel() for shape in self.shapes]
        # Clones, not views of theta: a forward pass may write into its parameters in place
        # (nn.Embedding with max_norm renormalises rows), which autograd forbids on split views.
        return [chunk.reshape(shape).clone() for chunk, shape in zip(theta.split(sizes), self.shapes)]


def _module_model(
    module: nn.Module, params: Mapping[str, Tensor] | None, kwargs: Mapping[str, Any]
) -> _Float64Model:
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

    return _Float64Model(theta=packing.pack(values), apply=apply)


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
) -> _Float64Model:
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

    return _Float64Model(theta=packing.pack([leaves[i] for i in differentiated]), apply=apply)


def _is_floating_tensor(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_floating_point()


def _float64_inputs(x: PyTree) -> PyTree:
    """Cast floating tensors to float64; integer inputs such as token ids must stay integer."""
    return pytree.tree_map(lambda v: v.to(torch.float64) if _is_floating_tensor(v) else v, x)


def _is_all_none(x2: PyTree | None) -> bool:
    """True for ``None``, a pytree made only of ``None``, or an empty container (means x1)."""
    return all(leaf is None for leaf in pytree.tree_leaves(x2))


def _check_output_leaves(leaves: Sequence[Any]) -> None:
    for leaf in leaves:
        if not _is_floating_tensor(leaf):
            raise TypeError(
                "reference kernels: every output leaf of `f` must be a floating tensor, got "
                f"{type(leaf).__name__}"
                + (f" of dtype {leaf.dtype}" if isinstance(leaf, Tensor) else "")
                + "."
            )


def _check_same_structure(spec1: pytree.TreeSpec, spec2: pytree.TreeSpec) -> None:
    if spec1 != spec2:
        raise ValueError(
            "reference kernels: f(x1) and f(x2) have different pytree structures:\n"
            f"  f(x1): {spec1}\n  f(x2): {spec2}"
        )


def _flatten_like(cotangents: PyTree, side: _Evaluated) -> Tensor:
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


# ---------------------------------------------------------------------------------------------
# The layout contraction: one einsum per output leaf
# ---------------------------------------------------------------------------------------------


def _canonical_axes(axes: Axes, ndim: int, argument: str) -> list[int]:
    """Non-negative, deduplicated, sorted axes (the user's order and repeats are irrelevant)."""
    axes = [axes] if isinstance(axes, int) else list(axes)
    for axis in axes:
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"reference kernels: `{argument}` contains axis {axis}, out of range for an "
                f"output leaf with {ndim} dimensions."
            )
    return sorted({axis % ndim for axis in axes})


def _contract(a1: Tensor, a2: Tensor, trace_axes: Axes, diagonal_axes: Axes) -> Tensor:
    """Kernel of one output leaf from ``a1: (*s1, P)`` and ``a2: (*s2, P)``.

    The last axis (parameters θ, or a dummy size-1 axis for the NNGP) is always summed. Output
    axis ``i`` gets letter ``x_i`` in ``a1`` and ``y_i`` in ``a2``: traced axes use one shared
    letter that the result omits, diagonal axes a shared letter the result keeps once, and the
    others distinct letters ``x_i y_i`` placed next to each other in the result.
    """
    if a1.ndim != a2.ndim:
        raise ValueError(
            "reference kernels: f(x1) and f(x2) leaves must have the same number of dimensions, "
            f"got shapes {tuple(a1.shape[:-1])} and {tuple(a2.shape[:-1])}."
        )
    ndim = a1.ndim - 1
    traced = _canonical_axes(trace_axes, ndim, "trace_axes")
    diagonal = _canonical_axes(diagonal_axes, ndim, "diagonal_axes")
    if set(traced) & set(diagonal):
        raise ValueError(
            f"reference kernels: axes {sorted(set(traced) & set(diagonal))} are both traced and "
            "diagonal; `trace_axes` and `diagonal_axes` must be disjoint."
        )
    for axis in traced + diagonal:
        if a1.shape[axis] != a2.shape[axis]:
            raise ValueError(
                f"reference kernels: traced or diagonal axis {axis} has size {a1.shape[axis]} in "
                f"f(x1) but {a2.shape[axis]} in f(x2); these sizes must match."
            )

    letters = iter(string.ascii_letters)
    theta = next(letters)
    lhs, rhs, result = [], [], []
    for axis in range(ndim):
        x_letter = next(letters)
        if axis in traced:
            lhs.append(x_letter)
            rhs.append(x_letter)
        elif axis in diagonal:
            lhs.append(x_letter)
            rhs.append(x_letter)
            result.append(x_letter)
        else:
            y_letter = next(letters)
            lhs.append(x_letter)
            rhs.append(y_letter)
            result += [x_letter, y_letter]
    equation = f"{''.join(lhs)}{theta},{''.join(rhs)}{theta}->{''.join(result)}"
    traced_size = 1
    for axis in traced:
        traced_size *= a1.shape[axis]
    return torch.einsum(equation, a1, a2) / traced_size


# ---------------------------------------------------------------------------------------------
# Comparison report
# ---------------------------------------------------------------------------------------------

# dtype -> (rtol, atol as a fraction of max|expected|)
_DEFAULT_TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-4, 1e-5),
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (5e-2, 1e-2),
}
_REAL_DTYPE_OF_COMPLEX = {torch.complex128: torch.float64, torch.complex64: torch.float32}
_WORST_ENTRIES_SHOWN = 5


def _structure(tree: PyTree) -> Any:
    """Hashable description: container types and keys, with every leaf written as ``*``."""
    if isinstance(tree, dict):
        return ("dict", tuple(sorted((repr(k), _structure(v)) for k, v in tree.items())))
    if isinstance(tree, (list, tuple)):
        return (type(tree).__name__, tuple(_structure(v) for v in tree))
    return "*"


def _least_precise(*dtypes: torch.dtype) -> torch.dtype:
    real = [_REAL_DTYPE_OF_COMPLEX.get(d, d) for d in dtypes]
    if any(not d.is_floating_point for d in real):
        return torch.int64
    return max(real, key=lambda d: torch.finfo(d).eps)


def _tolerances(
    dtype: torch.dtype, expected: Tensor, rtol: float | None, atol: float | None
) -> tuple[float, float, str]:
    """``(rtol, atol, description)`` for a leaf pair whose least precise dtype is ``dtype``."""
    default_rtol, atol_fraction = _DEFAULT_TOLERANCES.get(dtype, (0.0, 0.0))
    rtol = default_rtol if rtol is None else rtol
    if atol is not None:
        return rtol, atol, f"rtol={rtol:.1e}, atol={atol:.1e}"
    magnitude = expected.abs().max().item() if expected.numel() else 0.0
    scale = magnitude if magnitude > 0 and magnitude != float("inf") else 1.0
    atol = atol_fraction * scale
    description = (
        f"rtol={rtol:.1e}, atol={atol:.1e} (= {atol_fraction:.0e} * {scale:.3g}), keyed by {dtype}"
    )
    return rtol, atol, description


def _unravel(flat_index: int, shape: torch.Size) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        flat_index, remainder = divmod(flat_index, size)
        index.append(remainder)
    return tuple(reversed(index))


def _leaf_report(
    where: str, actual: Any, expected: Any, rtol: float | None, atol: float | None
) -> str | None:
    """None when the leaves agree, otherwise a multi-line description of the mismatch."""
    actual, expected = torch.as_tensor(actual).detach(), torch.as_tensor(expected).detach()
    header = (
        f"  shapes: actual {tuple(actual.shape)} {actual.dtype}, "
        f"expected {tuple(expected.shape)} {expected.dtype}"
    )
    if actual.shape != expected.shape:
        return f"kernel {where}: shape mismatch\n{header}"
    compute_dtype = (
        torch.complex128 if actual.is_complex() or expected.is_complex() else torch.float64
    )
    a = actual.cpu().to(compute_dtype)
    e = expected.cpu().to(compute_dtype)
    dtype = _least_precise(actual.dtype, expected.dtype)
    rtol, atol, tolerance_text = _tolerances(dtype, e, rtol, atol)

    abs_error = (a - e).abs()
    allowed = atol + rtol * e.abs()
    failing = ~(abs_error <= allowed)  # NaN errors fail here...
    failing &= ~(a == e)  # ...except equal infinities
    failing &= ~(a.isnan() & e.isnan())  # ...and NaN against NaN
    if not failing.any():
        return None

    rel_error = abs_error / e.abs()
    rel_error = torch.where(abs_error == 0, torch.zeros_like(rel_error), rel_error)
    # Rank NaN errors as the worst of all.
    ranking = torch.where(abs_error.isnan(), torch.inf, abs_error).reshape(-1)
    ranking = torch.where(failing.reshape(-1), ranking, -torch.inf)
    worst = ranking.argsort(descending=True)[: min(_WORST_ENTRIES_SHOWN, int(failing.sum()))]

    lines = [
        f"kernel {where}: {int(failing.sum())} of {failing.numel()} entries differ",
        header,
        f"  tolerances: {tolerance_text}",
        f"  max abs error: {_nan_max(abs_error):.3e}, max rel error: {_nan_max(rel_error):.3e}",
        "  worst entries (index: actual vs expected | abs error, rel error):",
    ]
    for flat_index in worst.tolist():
        index = _unravel(flat_index, a.shape)
        lines.append(
            f"    {index}: {a.reshape(-1)[flat_index].item():.10g} vs "
            f"{e.reshape(-1)[flat_index].item():.10g} | "
            f"{abs_error.reshape(-1)[flat_index].item():.3e}, "
            f"{rel_error.reshape(-1)[flat_index].item():.3e}"
        )
    return "\n".join(lines)


def _nan_max(values: Tensor) -> float:
    """Max that reports NaN if any entry is NaN (torch's max over NaN is NaN already)."""
    return values.max().item() if values.numel() else 0.0
