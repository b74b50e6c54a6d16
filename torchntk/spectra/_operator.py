"""The NTK ``K(x, x)`` of a model as a symmetric operator on kernel coordinates.

NOTE: [The NTK as an operator]
For a model whose output ``f(x)`` is one tensor of shape ``S`` and traced axes ``T`` (the
``trace_axes`` of :func:`torchntk.empirical_ntk_fn`), the kernel ``empirical_ntk_fn(f,
trace_axes=T)(x)`` read as a matrix (rows and columns: the coordinates of the kept axes of ``S``,
in order, row-major; see ``paired_matrix`` in ``_layout/kernel_layout.py``) is the operator here. Its vectors
have the kept axes' shape: ``(N,)`` for an ``(N, O)`` output with ``T = (-1,)``, ``(N, O)`` with
``T = ()``.

The full kernel (``T = ()``) times ``v`` is one NTK-vector product
(:func:`torchntk.empirical_ntk_vp_fn`, cotangent ``v``). The traced kernel averages the full one
over the traced coordinates ``t``: ``K_T v = (1/|T|) sum_t [K (v (x) e_t)]_t``, i.e. ``|T|``
NTK-vector products whose cotangents put ``v`` at traced coordinate ``t`` and zero elsewhere, of
which only the entries at ``t`` are kept. Blocks of vectors (and their ``|T|`` copies) go through
the model together under ``torch.func.vmap``, in passes of at most ``chunk_size`` cotangents.

Hutchinson's estimator uses the full kernel only: ``trace K_T = trace K / |T|``, and one probe of
the full kernel costs one NTK-vector product instead of ``|T|``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from torch.func import vmap

from .._call.outputs import output_fn_argument
from .._call.vmap_axes import split_kwargs
from .._layout.kernel_layout import canonical_axes
from .._model.functional import functional_model
from .._utils import checks as _checks
from .._utils.quiet_warnings import known_warnings_silenced
from .._utils.tree import describe
from ..empirical import empirical_ntk_vp_fn

# NOTE: [Cotangents per pass]
# On the benchmark MLP (784-512-512-10, 1000 examples, 2-core CPU), pushing 20 cotangents through
# one vmapped pass took 0.065 s per product against 0.55 s one at a time, and 10 per pass 0.08 s:
# the per-example work becomes matrix-matrix products. 32 keeps that gain with bounded memory.
DEFAULT_CHUNK_SIZE = 32


@dataclass(frozen=True)
class NtkOperator:
    """``v -> K(x, x) v`` on kernel coordinates (NOTE: [The NTK as an operator]).

    Attributes:
        shape: the kernel coordinates: the kept axes of the output, in order.
        output_shape: the shape of ``f(x)``.
        traced: the traced axes of the output, non-negative and sorted.
        dtype: the output's dtype, which the products come in.
        device: the output's device.
    """

    shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    traced: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    product: Callable[[torch.Tensor], torch.Tensor]
    chunk_size: int

    @property
    def traced_size(self) -> int:
        return math.prod(self.output_shape[axis] for axis in self.traced)

    def apply(self, vectors: torch.Tensor) -> torch.Tensor:
        """``(b, *shape) -> (b, *shape)``: the kernel times each vector."""
        count, traced = vectors.shape[0], len(self.traced)
        kept_ndim = len(self.shape)
        if not traced:
            return self._products(vectors)
        size = self.traced_size
        traced_shape = tuple(self.output_shape[axis] for axis in self.traced)
        # (b, t, *kept, *traced): v placed at traced coordinate t, zero elsewhere.
        basis = torch.eye(size, dtype=self.dtype, device=self.device).reshape(1, size, *(1,) * kept_ndim, *traced_shape)
        placed = vectors.reshape(count, 1, *self.shape, *(1,) * traced) * basis
        # The traced axes at the end (after batch, copy and kept axes) or where the output has them.
        at_end = tuple(range(2 + kept_ndim, 2 + kept_ndim + traced))
        in_output = tuple(2 + axis for axis in self.traced)
        cotangents = placed.movedim(at_end, in_output).reshape(count * size, *self.output_shape)
        products = self._products(cotangents).reshape(count, size, *self.output_shape).movedim(in_output, at_end)
        # Keep entry t of the product of copy t, and average over t.
        products = products.reshape(count, size, *self.shape, size)
        return torch.diagonal(products, dim1=1, dim2=-1).sum(-1) / size

    def quadratic_forms(self, probes: torch.Tensor) -> torch.Tensor:
        """``(b, *output_shape) -> (b,)``: ``z . K z`` with the full (untraced) kernel, divided by
        ``|T|``, whose mean over Rademacher probes is the trace of the traced kernel."""
        products = self._products(probes)
        return (probes * products).flatten(1).sum(1) / self.traced_size

    def _products(self, cotangents: torch.Tensor) -> torch.Tensor:
        # A function f(params, x) drawing random numbers gets other numbers per cotangent; the
        # symmetry check of the Lanczos projection then reports it (NOTE: [Block Lanczos by
        # Rayleigh-Ritz]) instead of vmap's error about randomness flags.
        with known_warnings_silenced():  # NOTE: [Known PyTorch warnings]
            return vmap(self.product, chunk_size=self.chunk_size, randomness="different")(cotangents)


def ntk_operator(
    f: Any, x: Any, params: Any, trace_axes: Any, output_fn: Any, chunk_size: Any, kwargs: Mapping[str, Any],
    where: str,
) -> NtkOperator:
    """Builds the operator; validates the model, inputs, ``params``, ``output_fn``, ``trace_axes``
    and ``chunk_size``.

    Raises:
        TypeError: as :func:`torchntk.empirical_ntk_vp_fn`; an output that is not one floating tensor.
        ValueError: as :func:`torchntk.empirical_ntk_vp_fn`; ``trace_axes`` out of range or repeated;
            a module with random layers in training mode (dropout).
    """
    _checks.callable_model_argument(f, where)
    _checks.input_argument(x, "x", where)
    axes = _checks.axes_argument(trace_axes, "trace_axes", where)
    chunk = _chunk_size_argument(chunk_size, where)
    selected_output = output_fn_argument(output_fn, where)
    model = functional_model(f, params, where, selected_output)
    if model.random:
        raise ValueError(
            f"{where}: {', '.join(model.random)} draws random numbers in training mode, so every product "
            f"would be with another kernel and the result no spectrum. Call model.eval()."
        )
    model_kwargs, _ = split_kwargs(kwargs, x2_is_none=True, where=where)
    with torch.no_grad():
        output = model.apply(model.params, x, model_kwargs)
    if not isinstance(output, torch.Tensor) or not output.is_floating_point():
        raise TypeError(
            f"{where}: the model's output must be one floating-point tensor, got {describe(output)}"
            f"{'' if not isinstance(output, torch.Tensor) else f' of dtype {output.dtype}'}. Select one "
            f"with `output_fn`, e.g. output_fn=lambda out: out[0] or output_fn=lambda out: out.logits."
        )
    shape = tuple(output.shape)
    traced = canonical_axes(axes, len(shape), "trace_axes", where, f"the output of shape {shape}")
    product = empirical_ntk_vp_fn(f, x, None, params, output_fn=output_fn, **kwargs)
    kept = tuple(size for axis, size in enumerate(shape) if axis not in traced)
    return NtkOperator(kept, shape, traced, output.dtype, output.device, product, chunk)


def _chunk_size_argument(value: Any, where: str) -> int:
    chunk = _checks.positive_int_argument(value, "chunk_size", where, none_allowed=True)
    return DEFAULT_CHUNK_SIZE if chunk is None else chunk
