"""Sketched NTKs: seeded random features ``phi(x)`` with ``E[phi(x1) phi(x2)^T] = NTK(x1, x2)``.

An exact NTK costs ``N1 N2`` inner products of parameter-sized vectors and ``N^2`` memory; a sketch
stores ``k`` numbers per example (and per kept output coordinate) and approximates every kernel
entry by one ``k``-dimensional inner product, with a relative error of about ``sqrt(2 / k)`` that
does not depend on the number of parameters. The features are reproducible: they depend only on
the seed, the model and the example, not on the batch size, the chunking or the device (NOTE:
[Sketch streams] in ``sketch/_projections.py``). The estimator is described in NOTE: [Sketched
features] (``sketch/_features.py``); ``docs/sketching.md`` measures its error against ``k``.

Example:
    >>> import torch, torchntk
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    >>> x1, x2 = torch.randn(6, 3), torch.randn(5, 3)
    >>> features_fn = torchntk.sketched_ntk_features_fn(model, k=4096, vmap_axes=0)
    >>> phi1, phi2 = features_fn(x1), features_fn(x2)            # (N1, k), (N2, k)
    >>> estimate = phi1 @ phi2.T                                 # (N1, N2), the traced NTK
    >>> exact = torchntk.empirical_ntk_fn(model, vmap_axes=0)(x1, x2)
    >>> bool((estimate - exact).norm() < 0.1 * exact.norm())
    True
"""

from __future__ import annotations

import string
from typing import Any, Callable, Optional

import torch

from .._call.kernel_call import FULL_CHECKS, NO_CHECKS, CallSpec, prepare_call
from .._call.outputs import output_fn_argument
from .._call.vmap_axes import parse_vmap_axes, split_kwargs
from .._kernel.kernel_function import KernelFnSpec, KernelFunction
from .._layout.kernel_layout import make_layout
from .._utils import checks as _checks
from .._utils.checks import show
from .._utils.precision import kernel_precision
from .._utils.quiet_warnings import known_warnings_silenced
from .._utils.tree import is_all_none
from .._utils.types import Axes, Model, PyTree, VMapAxes
from ._features import SketchOptions, sketch

__all__ = ["sketched_ntk_features_fn", "sketched_ntk_fn"]

PROJECTIONS = ("gaussian", "sparse", "kronecker")
"""The projections ``sketched_ntk_features_fn`` accepts (see its ``projection`` argument)."""

DEFAULT_PROJECTION = "sparse"
"""CountSketch: on the benchmark ResNet and MLP (``docs/sketching.md``) its error matched the dense
Gaussian sketch's at every ``k`` from 256 to 8192, and it took 2.7 s against 17 s (ResNet, k = 8192)
and 4 s against over 140 s (MLP, k = 2048), as its cost does not grow with ``k``. ``"gaussian"``
remains the reference, with the lighter tails at small ``k``."""


def sketched_ntk_features_fn(
    f: Model,
    k: int,
    trace_axes: Axes = (-1,),
    vmap_axes: VMapAxes = None,
    *,
    projection: str = DEFAULT_PROJECTION,
    seed: int = 0,
    chunk_size: Optional[int] = None,
    check_vmap_axes: bool = True,
    output_fn: Optional[Callable[..., PyTree]] = None,
) -> Callable[..., PyTree]:
    """Returns a function computing ``k`` random features per example whose inner products estimate the NTK.

    With ``J_{a,t}(x)`` the gradient of output entry ``(a, t)`` (``t`` the traced coordinates, ``T``
    of them) with respect to every differentiated parameter and ``Omega`` a seeded random
    ``(P, k)`` projection, the features are ``phi_a(x)[j] = sum_t s_{t,j} (J_{a,t}(x) Omega)_j /
    sqrt(k T)`` with random signs ``s`` (none without traced axes), so that

    ``E[phi_a(x1) . phi_b(x2)] = 1/T sum_t J_{a,t}(x1) . J_{b,t}(x2)``,

    the NTK entry of NOTE: [Kernel layout] (traced axes averaged): with the default
    ``trace_axes=(-1,)``, ``phi(x1) @ phi(x2).T`` estimates ``empirical_ntk_fn(f)(x1, x2)``. The
    estimate is unbiased; its standard deviation per entry is about ``sqrt((K11 K22 + K12^2) / k)``
    for the dense projections. :func:`torchntk.sketched_ntk_fn` does the contraction for any layout.

    The projection is never stored: it is drawn tile by tile, on CPU, from streams seeded by
    ``(seed, parameter name, tile)`` (NOTE: [Sketch streams]), so the features of an example do not
    depend on the batch it is in, on ``chunk_size`` or on the device (up to float rounding); for
    the Gaussian and Kronecker projections, the first ``k`` features with ``k' > k`` are
    ``sqrt(k / k')`` times those with ``k``.

    Args:
        f: an ``nn.Module`` (its parameters with ``requires_grad=True`` are differentiated) or a
            function ``f(params, x, **kwargs)``, as in :func:`torchntk.empirical_ntk_fn`.
        k: the number of features (the sketch dimension), a positive int. The relative error of a
            kernel entry falls like ``1 / sqrt(k)``.
        trace_axes: output axes summed into the features (the kernel's traced axes, averaged).
            Default: ``(-1,)`` (logits). With ``vmap_axes`` the batch axis cannot be traced.
        vmap_axes: as in :func:`torchntk.empirical_ntk_fn`: lets the per-example gradients be
            formed per example. ``None``: the model's output on the whole batch is differentiated
            (one backward pass per output entry of the batch). Default: ``None``.
        projection: the random projection ``Omega``:

            * ``"gaussian"``: dense standard normal entries (divided by ``sqrt(k)``), drawn tile by
              tile for every call;
            * ``"sparse"``: a CountSketch (a sparse Johnson-Lindenstrauss projection, one nonzero
              +-1 entry per parameter entry): the same variance as the Gaussian sketch for dense
              gradients, and ``P`` instead of ``P k`` random numbers and multiply-adds;
            * ``"kronecker"``: weights of ``F.linear`` and ``F.conv2d`` get the projection
              ``u_j (x) v_j`` (Gaussian factors over output and input features), computed from each
              layer's input and output cotangent without forming the weight's per-example gradient
              (much cheaper for wide dense layers; dearer for convolutions over large feature maps,
              as its cost grows with output pixels times ``k``); every other parameter, and a weight
              also used in other ways, gets the Gaussian projection. Also unbiased, with a larger
              variance than ``"gaussian"`` (up to twice the error for one dense layer).

            Default: ``"sparse"``.
        seed: the non-negative seed of the projection. Default: ``0``.
        chunk_size: with ``vmap_axes``, the number of examples whose per-example gradients are in
            memory at once (the features do not depend on it). ``None``: as many as fit in about
            256 MB. Ignored without ``vmap_axes``. Default: ``None``.
        check_vmap_axes: True or False, as in :func:`torchntk.empirical_ntk_fn`. Default: ``True``.
        output_fn: what to take the kernel of, as in :func:`torchntk.empirical_ntk_fn`.
            Default: ``None``.

    Returns:
        ``features_fn(x, params=None, **kwargs)``: ``x`` an input (tensor or pytree of tensors),
        ``params`` and ``kwargs`` as for the ``ntk_fn`` of :func:`torchntk.empirical_ntk_fn`. For
        every output leaf of shape ``S`` it returns a tensor of shape ``S`` without the traced
        axes, followed by ``k``: ``(N, k)`` for ``(N, C)`` logits traced, ``(N, C, k)`` with
        ``trace_axes=()``; in the dtype promoted from the output and the parameters.

    Raises:
        TypeError: arguments of the wrong type (a non-int ``k`` or ``seed``, a non-str
            ``projection``); at call time as :func:`torchntk.empirical_ntk_fn`.
        ValueError: ``k`` or ``chunk_size`` below 1, a negative ``seed``, an unknown
            ``projection``; at call time, axes out of range, a traced batch axis with
            ``vmap_axes``, and the errors of :func:`torchntk.empirical_ntk_fn`.
        RuntimeError: with ``"kronecker"``, a model whose layers change between two evaluations.

    Example:
        >>> import torch, torchntk
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        >>> x = torch.randn(8, 3)
        >>> features_fn = torchntk.sketched_ntk_features_fn(model, 256, vmap_axes=0, projection="sparse")
        >>> features_fn(x).shape                                     # [N, 3] -> [N, k]
        torch.Size([8, 256])
        >>> full = torchntk.sketched_ntk_features_fn(model, 256, trace_axes=(), vmap_axes=0)
        >>> full(x).shape                                            # one feature row per logit
        torch.Size([8, 4, 256])
        >>> torch.allclose(features_fn(x)[:3], features_fn(x[:3]), atol=1e-6)   # batch-independent
        True
    """
    where = "sketched_ntk_features_fn"
    settings = _Settings.validate(f, k, trace_axes, vmap_axes, projection, seed, chunk_size, check_vmap_axes,
                                  output_fn, where)

    def features_fn(x: PyTree, params: Any = None, **kwargs: Any) -> PyTree:
        # Not a KernelFunction, so it enters what KernelFunction.__call__ does itself.
        with kernel_precision(), known_warnings_silenced():  # NOTE: [Kernel precision], [Known PyTorch warnings]
            features, output_tree, _ = settings.features(x, params, kwargs, "features_fn")
        return output_tree.rebuild(features)

    features_fn.__doc__ = (
        "``features_fn(x, params=None, **kwargs)``: sketched NTK features of the model (built by\n"
        ":func:`torchntk.sketched_ntk_features_fn`, which documents every option)."
    )
    return features_fn


def sketched_ntk_fn(
    f: Model,
    k: int,
    trace_axes: Axes = (-1,),
    diagonal_axes: Axes = (),
    vmap_axes: VMapAxes = None,
    *,
    projection: str = DEFAULT_PROJECTION,
    seed: int = 0,
    chunk_size: Optional[int] = None,
    check_vmap_axes: bool = True,
    output_fn: Optional[Callable[..., PyTree]] = None,
) -> KernelFunction:
    """Returns a function estimating the empirical NTK from ``k`` sketched features per example.

    A drop-in, approximate :func:`torchntk.empirical_ntk_fn`: the kernel has the same layout (NOTE:
    [Kernel layout]) and is the contraction of the features of
    :func:`torchntk.sketched_ntk_features_fn` of x1 and x2 (built with the same arguments), an unbiased
    estimate whose relative error falls like ``1 / sqrt(k)``. Computing the features is linear in
    ``N1 + N2``; only the final contraction is ``N1 N2 k``.

    Args:
        f, k, trace_axes, vmap_axes, projection, seed, chunk_size, check_vmap_axes, output_fn: as in
            :func:`torchntk.sketched_ntk_features_fn`.
        diagonal_axes: output axes of which only the diagonal is kept, as in
            :func:`torchntk.empirical_ntk_fn`. Default: ``()``.

    Returns:
        A :class:`~torchntk.KernelFunction` ``ntk_fn(x1, x2=None, params=None, **kwargs)``, arguments
        as for the ``ntk_fn`` of :func:`torchntk.empirical_ntk_fn` (``x2=None`` reuses x1's features;
        2-tuple keyword arguments are split between x1 and x2). One kernel per output leaf. Given to
        :func:`torchntk.batch`, its blocks are contractions of the same features (each example's
        features depend on ``seed``, not on the other examples of its block).

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`torchntk.sketched_ntk_features_fn`; also axes both
            traced and diagonal, and traced or diagonal sizes that differ between x1 and x2
            (ValueError).

    Example:
        >>> import torch, torchntk
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
        >>> x1, x2 = torch.randn(5, 3), torch.randn(4, 3)
        >>> ntk_fn = torchntk.sketched_ntk_fn(model, 2048, trace_axes=(), vmap_axes=0, projection="kronecker")
        >>> ntk_fn(x1, x2).shape                                     # (N1, N2, O1, O2)
        torch.Size([5, 4, 2, 2])
        >>> exact = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0)(x1, x2)
        >>> bool((ntk_fn(x1, x2) - exact).norm() < 0.2 * exact.norm())
        True
    """
    where = "sketched_ntk_fn"
    settings = _Settings.validate(f, k, trace_axes, vmap_axes, projection, seed, chunk_size, check_vmap_axes,
                                  output_fn, where)
    diagonal = _checks.axes_argument(diagonal_axes, "diagonal_axes", where)

    def ntk_fn(x1: PyTree, x2: Optional[PyTree] = None, params: Any = None, **kwargs: Any) -> PyTree:
        reuse = is_all_none(x2)
        kwargs1, kwargs2 = split_kwargs(kwargs, x2_is_none=reuse, where="ntk_fn")
        with kernel_precision():  # NOTE: [Kernel precision]
            features1, tree1, shapes1 = settings.features(x1, params, kwargs1, "ntk_fn", "x1")
            for index, shape in enumerate(shapes1):  # bad axes raise before x2 is sketched
                make_layout(len(shape), settings.trace_axes, diagonal, "ntk_fn", _leaf_name(index, len(shapes1)))
            if reuse:
                features2, tree2, shapes2 = features1, tree1, shapes1
            else:
                features2, tree2, shapes2 = settings.features(x2, params, kwargs2, "ntk_fn", "x2")
            if not tree1.same_structure(tree2):
                raise ValueError("ntk_fn: the model returns differently structured outputs for x1 and x2.")
            kernels = [
                _contract(one, two, shape1, shape2, settings.trace_axes, diagonal, _leaf_name(index, len(shapes1)))
                for index, (one, two, shape1, shape2) in enumerate(zip(features1, features2, shapes1, shapes2))
            ]
        return tree1.rebuild(kernels)

    def rebuild(model: Model) -> KernelFunction:
        return sketched_ntk_fn(
            model, k, trace_axes, diagonal_axes, vmap_axes, projection=projection, seed=seed, chunk_size=chunk_size,
            check_vmap_axes=check_vmap_axes, output_fn=output_fn,
        )

    # Sketches use reverse mode only, so blocks may run in several threads (KernelFnSpec.thread_safe).
    spec = KernelFnSpec("ntk", f, settings.trace_axes, diagonal, rebuild, thread_safe=True)
    doc = (
        "``ntk_fn(x1, x2=None, params=None, **kwargs)``: the sketched NTK of the model (built by\n"
        ":func:`torchntk.sketched_ntk_fn`, which documents every option)."
    )
    return KernelFunction(ntk_fn, spec, doc)


class _Settings:
    """What a features function validated once, and the computation of one call's features."""

    def __init__(self, f, k, trace_axes, vmap_axes, options, check_vmap_axes, output_fn):
        self.f = f
        self.k = k
        self.trace_axes = trace_axes
        self.vmap_axes = vmap_axes
        self.options = options
        self.check_vmap_axes = check_vmap_axes
        self.output_fn = output_fn

    @classmethod
    def validate(cls, f, k, trace_axes, vmap_axes, projection, seed, chunk_size, check_vmap_axes, output_fn,
                 where: str) -> "_Settings":
        _checks.callable_model_argument(f, where)
        k = _checks.positive_int_argument(k, "k", where, meaning="the number of features")
        if not isinstance(projection, str):
            raise TypeError(f"{where}: `projection` must be one of {', '.join(map(repr, PROJECTIONS))}, "
                            f"got {show(projection)}.")
        if projection not in PROJECTIONS:
            raise ValueError(f"{where}: `projection` must be one of {', '.join(map(repr, PROJECTIONS))}, "
                             f"got {projection!r}.")
        seed = _checks.non_negative_int_argument(seed, "seed", where)
        options = SketchOptions(k, projection, seed, _checks.positive_int_argument(chunk_size, "chunk_size", where, none_allowed=True))
        traced = _checks.axes_argument(trace_axes, "trace_axes", where)
        parsed = None if vmap_axes is None else parse_vmap_axes(vmap_axes, where)
        check = _checks.bool_argument(check_vmap_axes, "check_vmap_axes", where)
        return cls(f, int(k), traced, parsed, options, check, output_fn_argument(output_fn, where))

    def features(self, x: Any, params: Any, kwargs: dict, where: str, name: str = "x"):
        """``(features per output leaf, output tree, output shapes)`` of one input, called ``name``."""
        _checks.input_argument(x, name, where)
        if is_all_none(x):
            raise ValueError(f"{where}: `{name}` must contain at least one tensor, got {show(x)}.")
        call = prepare_call(
            self.f, x, None, params, kwargs,
            CallSpec(self.trace_axes, (), vmap_axes=self.vmap_axes, output_fn=self.output_fn), where=where,
            computes_ntk=True, plan=FULL_CHECKS if self.check_vmap_axes else NO_CHECKS,
        )
        if call.side1.mapped:
            for index, (layout, axis) in enumerate(zip(call.layouts, call.side1.out_axes)):
                if axis in layout.trace_axes:
                    leaf = _leaf_name(index, len(call.layouts))
                    raise ValueError(
                        f"{where}: `trace_axes`={self.trace_axes} contains the batch axis {axis} of {leaf} "
                        f"(`vmap_axes`), but features are per example. Trace other axes, or pass vmap_axes=None."
                    )
        features = sketch(call, self.options)
        return features, call.output_tree, [tuple(output.shape) for output in call.outputs1]


def _leaf_name(index: int, leaves: int) -> str:
    return "the output" if leaves == 1 else f"output leaf {index} of {leaves}"


def _contract(one: torch.Tensor, two: torch.Tensor, shape1: tuple, shape2: tuple, trace_axes: tuple,
              diagonal_axes: tuple, leaf: str) -> torch.Tensor:
    """The kernel of one output leaf from its features: kept axes doubled, diagonal axes once."""
    if len(shape1) != len(shape2):
        raise ValueError(f"ntk_fn: {leaf} has shape {shape1} for x1 but {shape2} for x2; the outputs must have "
                         f"the same number of axes.")
    layout = make_layout(len(shape1), trace_axes, diagonal_axes, "ntk_fn", leaf)
    for axis in layout.trace_axes + layout.diagonal_axes:
        if shape1[axis] != shape2[axis]:
            kind = "traced" if axis in layout.trace_axes else "diagonal"
            raise ValueError(f"ntk_fn: {leaf} has {kind} axis {axis} of size {shape1[axis]} for x1 but "
                             f"{shape2[axis]} for x2; traced and diagonal axes must have equal sizes.")
    letters = iter(string.ascii_letters)
    feature = next(letters)
    left, right, result = [], [], []
    for axis in range(layout.ndim):
        kind = layout.kind(axis)
        if kind == "trace":
            continue
        if kind == "diagonal":
            shared = next(letters)
            left.append(shared), right.append(shared), result.append(shared)
        else:
            first, second = next(letters), next(letters)
            left.append(first), right.append(second), result.extend((first, second))
    equation = f"{''.join(left)}{feature},{''.join(right)}{feature}->{''.join(result)}"
    return torch.einsum(equation, one, two)
