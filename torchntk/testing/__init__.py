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

The oracle is this module's functions and three private modules that import nothing from the
rest of torchntk: ``testing/_reference_model.py`` (the float64 view of ``f`` and its Jacobians),
``testing/_reference_layout.py`` (the einsum of the layout rule) and ``testing/_comparison.py`` (the report
of :func:`assert_kernels_close`). They can be reviewed together, independently of the library code
they check.

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

from typing import Any, Callable, Mapping

from torch import Tensor, nn
from torch.utils import _pytree as pytree

from ._comparison import leaf_report, structure
from ._module_snapshot import ModuleSnapshot
from ._reference_layout import Axes, contract
from ._reference_model import Float64Model, PyTree, check_same_structure, flatten_like, is_all_none

__all__ = [
    "ModuleSnapshot",
    "assert_kernels_close",
    "reference_nngp",
    "reference_ntk",
    "reference_ntk_vp",
]


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
            is called through :func:`torch.func.functional_call`, so parameters are
            differentiated through their registered names only: a forward pass that reads one
            through another reference (a list of weights, a closure) gets that part of the kernel
            wrong here, without an error (torchntk's kernel functions refuse such models).
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
    model = Float64Model.build(f, params, kwargs)
    side1 = model.evaluate(x1)
    side2 = side1 if is_all_none(x2) else model.evaluate(x2)
    check_same_structure(side1.spec, side2.spec)
    kernels = [
        contract(j1, j2, trace_axes, diagonal_axes)
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
    model = Float64Model.build(f, params, kwargs)
    out1 = model.outputs(x1)
    out2 = out1 if is_all_none(x2) else model.outputs(x2)
    leaves1, spec1 = pytree.tree_flatten(out1)
    leaves2, spec2 = pytree.tree_flatten(out2)
    check_same_structure(spec1, spec2)
    # A parameter axis of size 1 lets the NNGP share the NTK contraction.
    kernels = [
        contract(o1.unsqueeze(-1), o2.unsqueeze(-1), trace_axes, diagonal_axes)
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
    model = Float64Model.build(f, params, kwargs)
    side1 = model.evaluate(x1)
    side2 = side1 if is_all_none(x2) else model.evaluate(x2)
    v = flatten_like(cotangents, side2)
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
    actual_structure, expected_structure = structure(actual), structure(expected)
    if actual_structure != expected_structure:
        raise AssertionError(
            "kernel pytree structures differ:\n"
            f"  actual:   {actual_structure}\n  expected: {expected_structure}"
        )
    expected_leaves = pytree.tree_flatten_with_path(expected)[0]
    actual_by_path = dict(pytree.tree_flatten_with_path(actual)[0])
    reports = [
        leaf_report(pytree.keystr(path) or "<root>", actual_by_path[path], leaf, rtol, atol)
        for path, leaf in expected_leaves
    ]
    failures = [report for report in reports if report is not None]
    if failures:
        raise AssertionError("\n\n".join(failures))


# The oracle imports nothing of the library (not even its export helper): shown where users import it.
ModuleSnapshot.__module__ = __name__
