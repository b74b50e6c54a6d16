"""One side of a kernel (x1 or x2): the model evaluated on a batch, whole or per example.

NOTE: [Per-example evaluation]
With ``vmap_axes`` the model is evaluated under ``torch.func.vmap`` on slices of size one: each
mapped input leaf gets its batch axis back as a size-1 axis (``unsqueeze``) before the model sees
it, and each output leaf loses it again (``squeeze``), so the model always runs on a batch of one
example. Jacobians then cost ``O`` backward passes of one example each, instead of ``O`` backward
passes over the whole batch. Without ``vmap_axes`` the model runs on the whole batch.

NOTE: [Example loops]
Some models cannot run under vmap although their examples are independent: operations without a
batching rule, or data-dependent control flow such as Hugging Face's padding-mask code. A side can
then map its examples with a Python loop instead (``Side.loop``): the same function of one example,
called once per example, its results stacked as vmap would stack them. The kernel is the same; the
price is one model call per example in every pass instead of one batched call. Kernel functions
switch to the loop by themselves, with a warning (``_call/example_loop.py``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping, Optional

import torch
from torch.func import jacrev, vjp, vmap
from torch.utils import _pytree as pytree

from .._model.functional import FunctionalModel
from .._model.unfused import Unfused, math_attention
from .._utils.tree import Flat

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class OutputAxisError(ValueError):
    """The model applied to one example returned an output without a size-1 batch axis."""

    def __init__(self, where: str, shape: tuple[int, ...], axis: int):
        self.symptom = (
            f"the model applied to one example returned an output leaf of shape {shape}, which has no "
            f"size-1 batch axis at out_axes={axis}"
        )
        super().__init__(f"{where}: with `vmap_axes`, {self.symptom}. Check `vmap_axes`, or pass vmap_axes=None.")


class PlanOutdated(ValueError):
    """A warm call's model returned outputs of other shapes than its plan was made for (NOTE:
    [Outputs that outgrow their plan])."""


# NOTE: [Outputs that outgrow their plan]
# A warm call takes the outputs' shapes from its plan's template (NOTE: [Remembered output shapes])
# and makes no whole-batch forward pass. The plan key sees the module's structure, but not an
# object the module holds changed in place (a config field that adds an output, widens a head) or
# a global switch the model reads: the model then returns outputs of other shapes than the plan's,
# and a kernel laid out and normalised by the plan's shapes (a traced kernel divided by the old
# traced size) would be wrong without an error. So a warm call's sides carry the shapes the plan
# expects (:class:`PlannedOutputs`) and every evaluation of the model by the implementations
# compares its output leaves with them (a few shape comparisons per pass, at trace time under
# vmap): a difference drops the key's plans and raises :class:`PlanOutdated` before anything is
# computed with them. A kernel function's call then prepares itself again, in full, from the model
# as it is (``NtkSettings.called``: once; a call prepared in full has no planned outputs to differ
# from), so the user sees the right kernel, at a first call's price; ``batch`` lets the error
# through, and its next call is planned anew (``auto_choice``, which evaluates nothing once its key
# is planned, reports the plan's choice until a kernel call finds the change). Like a failure of
# vmap (NOTE: [Switching to example loops]), only evaluating the model tells, and an evaluation
# that finds it cannot return a value: hence the exception.


@dataclass(frozen=True)
class PlannedOutputs:
    """The outputs a warm call's plan was made for (a warm call's sides are mapped): their tree, and
    each leaf's shape without its batch axis and dtype; ``forget`` drops the plans of the key."""

    spec: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    forget: Callable[[], None]

    @classmethod
    def of(cls, flat: Flat, leaves: tuple, out_axes: tuple[int, ...], forget: Callable[[], None]) -> "PlannedOutputs":
        shapes = tuple(_without(tuple(leaf.shape), axis) for leaf, axis in zip(leaves, out_axes))
        return cls(flat.spec, shapes, tuple(leaf.dtype for leaf in leaves), forget)

    def check(self, flat: Flat, out_axes: tuple[int, ...], where: str) -> None:
        """Raises :class:`PlanOutdated` (after ``forget``) where ``flat``, the outputs of one
        evaluation (of one example or of several, on ``out_axes``), differ from the plan's."""
        leaves = flat.leaves
        if flat.spec == self.spec and len(leaves) == len(self.shapes):
            # the pass's function modes (a recorder's, the perturbed model's) would see every read of
            # a shape or dtype, at several microseconds each: read them without
            with torch._C.DisableTorchFunction():
                planned = zip(leaves, out_axes, self.shapes, self.dtypes)
                found = [
                    index for index, (leaf, axis, shape, dtype) in enumerate(planned)
                    if leaf.dtype != dtype or leaf.ndim <= axis or _without(tuple(leaf.shape), axis) != shape
                ]
            if not found:
                return
            index = found[0]
            leaf = leaves[index]
            what = (
                f"output leaf {index} now has shape {_without(tuple(leaf.shape), out_axes[index])} per example and "
                f"dtype {leaf.dtype} where the plan has {self.shapes[index]} and {self.dtypes[index]}"
            )
        else:
            what = (
                f"the outputs now have another structure ({len(leaves)} leaves where the plan has {len(self.shapes)})"
            )
        self.forget()
        raise PlanOutdated(
            f"{where}: {what}: something the plan of calls with these input shapes does not see changed since it "
            f"was made (an object the module holds, changed in place, such as a config field; a global switch the "
            f"model reads). Nothing was computed with the old plan; calls with these input shapes are planned "
            f"anew from the next call on."
        )


def _without(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """``shape`` without ``axis`` (the whole ``shape`` where it has no such axis)."""
    return shape if axis >= len(shape) else shape[:axis] + shape[axis + 1:]


@contextlib.contextmanager
def transformed(model: FunctionalModel, where: str, unfuse: bool = True) -> Iterator[None]:
    """What a pass of ``model`` under ``torch.func`` transforms runs under: vmap's errors explained,
    the kernels vmap cannot batch computed as plain ops (the model's fused recurrent and weight-norm
    kernels, NOTE: [Unfused kernels]; ``unfuse=False`` where the pass's own function mode does it)
    and, on CUDA, the fused attention kernels (``_model/unfused.math_attention``)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(vmap_errors(where))
        if model.fused and unfuse:
            stack.enter_context(Unfused())
        if any(param.is_cuda for param in model.params):
            stack.enter_context(math_attention())
        yield


@dataclass(frozen=True)
class Side:
    """The model and the inputs of one side, plus the axes to map (or None for whole batches).

    ``name`` is ``"x1"`` or ``"x2"``; ``offset`` is the position of the first example in that input
    after :meth:`narrow`; ``loop`` maps examples with a Python loop instead of vmap (NOTE:
    [Example loops]).
    """

    model: FunctionalModel
    x: Flat
    kwargs: dict[str, Flat]
    x_axes: Optional[tuple[Optional[int], ...]]
    kwarg_axes: Optional[dict[str, tuple[Optional[int], ...]]]
    out_axes: Optional[tuple[int, ...]]
    where: str
    name: str = "x1"
    offset: int = 0
    loop: bool = False
    planned: Optional[PlannedOutputs] = None
    """A warm call's: the outputs its plan was made for (NOTE: [Outputs that outgrow their plan])."""

    @classmethod
    def build(
        cls, model: FunctionalModel, x: Any, kwargs: Mapping[str, Any], vmap_axes: Any, out_axes: Any, where: str, name: str,
        loop: bool = False,
    ) -> "Side":
        return cls(
            model,
            Flat.of(x),
            {key: Flat.of(value) for key, value in kwargs.items()},
            None if vmap_axes is None else vmap_axes.x_axes,
            None if vmap_axes is None else vmap_axes.kwarg_axes,
            None if vmap_axes is None else tuple(out_axes),
            where,
            name,
            loop=loop,
        )

    @property
    def mapped(self) -> bool:
        return self.x_axes is not None

    def looped(self) -> "Side":
        """The same side with its examples mapped by a Python loop (NOTE: [Example loops])."""
        return replace(self, loop=True)

    def _map(self, function, in_dims, out_dims=0):
        return map_examples(function, in_dims, out_dims, self.loop)

    @contextlib.contextmanager
    def _errors(self, unfuse: bool = True) -> Iterator[None]:
        """vmap's errors explained, and the kernels vmap cannot batch computed as plain ops: the
        model's fused recurrent and weight-norm kernels (NOTE: [Unfused kernels]; not where
        ``unfuse`` is False: the pass's own function mode does it) and, on CUDA, the fused
        attention kernels (``_model/unfused.math_attention``)."""
        if self.loop:
            yield
            return
        with transformed(self.model, self.where, unfuse=unfuse):
            yield

    def batch_size(self) -> int:
        for leaf, axis in self._mapped_leaves():
            return leaf.shape[axis]
        raise AssertionError("batch_size() needs vmap_axes")

    def _mapped_leaves(self):
        for leaf, axis in zip(self.x.leaves, self.x_axes or ()):
            if axis is not None:
                yield leaf, axis
        for key, flat in self.kwargs.items():
            for leaf, axis in zip(flat.leaves, (self.kwarg_axes or {}).get(key, ())):
                if axis is not None:
                    yield leaf, axis

    def probe(self, size: int) -> "Side":
        """The first ``size`` examples, or the first one repeated ``size`` times when there are fewer.

        A repeated example still gives vmap a batch of ``size``: some PyTorch batching bugs only
        show with more than one example (needs vmap_axes and at least one example).
        """
        if self.batch_size() >= size:
            return self.narrow(0, size)

        def repeat(flat: Flat, axes: tuple[Optional[int], ...]) -> Flat:
            leaves = tuple(
                leaf if axis is None else torch.cat([leaf.narrow(axis, 0, 1)] * size, dim=axis)
                for leaf, axis in zip(flat.leaves, axes)
            )
            return replace(flat, leaves=leaves)

        kwargs = {key: repeat(flat, self.kwarg_axes[key]) for key, flat in self.kwargs.items()}
        return replace(self, x=repeat(self.x, self.x_axes), kwargs=kwargs)

    def narrow(self, start: int, length: int) -> "Side":
        """The same side restricted to examples ``start .. start + length - 1`` (needs vmap_axes)."""
        def cut(flat: Flat, axes: tuple[Optional[int], ...]) -> Flat:
            leaves = tuple(
                leaf if axis is None else leaf.narrow(axis, start, length) for leaf, axis in zip(flat.leaves, axes)
            )
            return replace(flat, leaves=leaves)

        kwargs = {key: cut(flat, self.kwarg_axes[key]) for key, flat in self.kwargs.items()}
        return replace(self, x=cut(self.x, self.x_axes), kwargs=kwargs, offset=self.offset + start)

    # -- the model as a function of the parameters -------------------------------------------------

    def _call(self, params: tuple, x_leaves: tuple, kwarg_leaves: tuple) -> tuple:
        x = self.x.rebuild(x_leaves)
        kwargs = {key: flat.rebuild(leaves) for (key, flat), leaves in zip(self.kwargs.items(), kwarg_leaves)}
        output = Flat.of(self.model.apply(params, x, kwargs))
        if self.planned is not None:
            self.planned.check(output, self.out_axes, self.where)
        return tuple(output.leaves)

    def whole_batch(self):
        """``params -> output leaves`` on the whole batch (no mapping)."""
        x_leaves = self.x.leaves
        kwarg_leaves = tuple(flat.leaves for flat in self.kwargs.values())
        return lambda params: self._call(params, x_leaves, kwarg_leaves)

    def _one_example(self, params: tuple, x_leaves: tuple, kwarg_leaves: tuple) -> tuple:
        x_leaves = _unsqueeze(x_leaves, self.x_axes)
        kwarg_leaves = tuple(
            _unsqueeze(leaves, self.kwarg_axes[key]) for key, leaves in zip(self.kwargs, kwarg_leaves)
        )
        outputs = self._call(params, x_leaves, kwarg_leaves)
        squeezed = []
        for leaf, axis in zip(outputs, self.out_axes):
            if leaf.ndim <= axis or leaf.shape[axis] != 1:
                raise OutputAxisError(self.where, tuple(leaf.shape), axis)
            squeezed.append(leaf.squeeze(axis))
        return tuple(squeezed)

    def _in_dims(self) -> tuple:
        return (None, self.x_axes, tuple(self.kwarg_axes[key] for key in self.kwargs))

    def _data(self) -> tuple:
        return self.x.leaves, tuple(flat.leaves for flat in self.kwargs.values())

    def forward(self) -> tuple:
        """The output leaves, per example under ``vmap`` when mapped."""
        if not self.mapped:
            return self.whole_batch()(self.model.params)
        mapped = self._map(self._one_example, self._in_dims(), self.out_axes)
        with self._errors():
            return mapped(self.model.params, *self._data())

    def jacobians(
        self, chunk_size: Optional[int] = None, only: Optional[tuple[int, ...]] = None
    ) -> tuple[tuple[torch.Tensor, ...], ...]:
        """``J[k][p]`` of shape ``output_k.shape + param_p.shape`` for every output and parameter leaf.

        ``chunk_size`` bounds how many output entries are differentiated at once when the side is
        not mapped (passed to ``jacrev``); mapped sides are chunked by examples instead. ``only``
        restricts the parameters differentiated (``J[k]`` then follows its order).
        """
        return self._jacobians(chunk_size, only, with_outputs=False)

    def jacobians_and_outputs(self) -> tuple[tuple[tuple[torch.Tensor, ...], ...], tuple[torch.Tensor, ...]]:
        """:meth:`jacobians` of a mapped side and the per-example outputs of the same pass (the
        primal values ``jacrev`` computes anyway), for the deferred output check of NOTE:
        [Checking vmap_axes]."""
        return self._jacobians(None, None, with_outputs=True)

    def _jacobians(self, chunk_size: Optional[int], only: Optional[tuple[int, ...]], with_outputs: bool) -> Any:
        params = self.model.params
        if only is None:
            chosen, evaluate = params, self.evaluate
        else:
            chosen = tuple(params[index] for index in only)

            def evaluate(subset: tuple, *data: tuple) -> tuple:
                full = list(params)
                for index, value in zip(only, subset):
                    full[index] = value
                return self.evaluate(tuple(full), *data)

        if not self.mapped:
            return jacrev(evaluate, chunk_size=chunk_size)(chosen, *self._data())
        if with_outputs:
            def with_values(*args: Any) -> tuple:
                outputs = evaluate(*args)
                return outputs, tuple(output.detach() for output in outputs)

            mapped = self._map(jacrev(with_values, argnums=0, has_aux=True), self._in_dims(), (self.out_axes,) * 2)
        else:
            mapped = self._map(jacrev(evaluate, argnums=0), self._in_dims(), self.out_axes)
        with self._errors():
            return mapped(chosen, *self._data())

    def summed_vjps(self, cotangents: tuple[torch.Tensor, ...]) -> tuple[tuple, tuple]:
        """Per-example outputs and, for each row ``r`` of ``cotangents``, ``sum_n J_n^T v[r, n]``.

        ``cotangents`` has one tensor per output leaf, of shape ``(R, *output_leaf.shape)``. Each
        example is differentiated under ``vmap`` (or the loop; needs vmap_axes), its ``R`` products batched
        by an inner ``vmap`` as ``jacrev`` batches its basis, so that a check made with them goes
        through the same nesting of transforms as the kernels. Returns ``(outputs, products)``:
        the output leaves, and one ``(R, *param.shape)`` tensor per parameter.
        """
        def one_example(params: tuple, x_leaves: tuple, kwarg_leaves: tuple, example_cotangents: tuple):
            outputs, pullback = vjp(lambda p: self._one_example(p, x_leaves, kwarg_leaves), params)
            (products,) = vmap(pullback)(example_cotangents)
            return outputs, products

        cotangent_dims = tuple(axis + 1 for axis in self.out_axes)
        mapped = self._map(one_example, self._in_dims() + (cotangent_dims,), (self.out_axes, 0))
        with self._errors():
            outputs, products = mapped(self.model.params, *self._data(), tuple(cotangents))
        return outputs, tuple(product.sum(0) for product in products)

    @property
    def evaluate(self):
        """``(params, x_leaves, kwarg_leaves) -> output leaves``: one example when mapped, else the batch."""
        return self._one_example if self.mapped else self._call

    def per_example(self, function, extra: tuple = (), extra_dims: tuple = (), unfuse: bool = True):
        """``function(x_leaves, kwarg_leaves, *extra)``, under ``vmap`` per example when mapped.

        Mapped results gain a leading example axis; ``extra_dims`` are the mapped axes of ``extra``.
        ``unfuse=False``: ``function`` decomposes the model's fused kernels itself (a recorder's
        pass, NOTE: [The recorder unfuses]).
        """
        x_leaves, kwarg_leaves = self._data()
        if not self.mapped:
            return function(x_leaves, kwarg_leaves, *extra)
        in_dims = self._in_dims()[1:] + tuple(extra_dims)
        with self._errors(unfuse):
            return self._map(function, in_dims)(x_leaves, kwarg_leaves, *extra)


class ExampleShapesDiffer(ValueError):
    """Examples mapped by a loop gave results of different shapes (intermediate values whose
    shapes depend on the example, which only structured derivatives stack)."""

    def __init__(self, shapes: list[tuple[int, ...]]):
        self.shapes = shapes
        super().__init__(
            f"the examples, evaluated one at a time, give intermediate results of different shapes "
            f"({', '.join(map(str, shapes[:4]))}): the model's operations depend on the example (e.g. a "
            f"sequence cut to its own length), which structured derivatives (implementation 3) cannot "
            f"stack. Use implementation=1 or 2."
        )


def map_examples(function, in_dims, out_dims=0, loop: bool = False):
    """``vmap(function, in_dims, out_dims)``, or the same mapping by a Python loop over the examples.

    The loop calls ``function`` on each example (every mapped leaf indexed along its axis, so the
    function sees what vmap would show it) and stacks the results along ``out_dims``; ``in_dims``
    and ``out_dims`` are vmap's prefix trees. See NOTE: [Example loops].

    Example:
        >>> square = lambda x, y: x * y
        >>> x = torch.arange(6.0).reshape(3, 2)
        >>> looped = map_examples(square, (0, None), 0, loop=True)(x, torch.tensor(2.0))
        >>> torch.equal(looped, vmap(square, (0, None))(x, torch.tensor(2.0)))
        True
    """
    if not loop:
        return vmap(function, in_dims=in_dims, out_dims=out_dims)

    def looped(*args):
        leaves, spec = pytree.tree_flatten(args)
        dims = pytree._broadcast_to_and_flatten(in_dims, spec)
        sizes = {leaf.shape[dim] for leaf, dim in zip(leaves, dims) if dim is not None}
        if len(sizes) != 1:
            raise ValueError(f"the mapped axes must have one size, got sizes {sorted(sizes)}")
        results = []
        for index in range(sizes.pop()):
            example = [leaf if dim is None else leaf.select(dim, index) for leaf, dim in zip(leaves, dims)]
            results.append(pytree.tree_flatten(function(*pytree.tree_unflatten(example, spec))))
        out_spec = results[0][1]
        stacked_dims = pytree._broadcast_to_and_flatten(out_dims, out_spec)
        columns = list(zip(*(flat for flat, _ in results)))
        for column in columns:
            shapes = sorted({tuple(leaf.shape) for leaf in column})
            if len(shapes) > 1:
                raise ExampleShapesDiffer(shapes)
        return pytree.tree_unflatten(
            [torch.stack(column, dim=dim) for column, dim in zip(columns, stacked_dims)], out_spec
        )

    return looped


def _unsqueeze(leaves: tuple, axes: tuple[Optional[int], ...]) -> tuple:
    return tuple(leaf if axis is None else leaf.unsqueeze(axis) for leaf, axis in zip(leaves, axes))


# What PyTorch says when vmap meets an operation whose shape or control flow depends on values
# (boolean-mask indexing, nonzero, unique, masked_select, .item(), `if tensor:`, .tolist()).
_DATA_DEPENDENT_MESSAGES = (
    "dynamic shape",
    "data-dependent control flow",
    ".item()",
    "differently shaped tensor",
    "doesn't have storage",
)


def is_data_dependent_error(error: BaseException) -> bool:
    """True for the errors torch.func.vmap raises on data-dependent shapes or control flow."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(message in text for message in _DATA_DEPENDENT_MESSAGES)


class VmapLimitation(Exception):
    """Marks the errors of a model that vmap could not evaluate or differentiate per example.

    Kernel functions catch these and map the examples with a loop instead (NOTE: [Example loops]);
    whoever else sees one gets its message, which says what to do.
    """


class DataDependentError(ValueError, VmapLimitation):
    """vmap met data-dependent shapes or control flow in the model."""


class VmapRuntimeError(RuntimeError, VmapLimitation):
    """An error raised under ``vmap`` per example, with a hint; ``original`` is what was raised.

    ``original`` is PyTorch's RuntimeError, or whatever the model (or its library) raised instead:
    torch_geometric, for one, turns vmap's error into an IndexError. Either way this is a
    RuntimeError, so that every check that explains vmap's failures explains these too.
    """

    def __init__(self, where: str, original: Exception):
        self.original = original
        if type(original) is RuntimeError:
            # PyTorch's whole text comes last, for whoever recognises its wording (``_model/torch_errors.py``).
            super().__init__(
                f"{where}: evaluating or differentiating the model per example under torch.func.vmap "
                f"(`vmap_axes`) failed. If the model runs on whole batches, this is a limitation or a bug "
                f"of vmap for one of its operations (in-place writes into shared tensors; nn.PReLU's "
                f"derivative): pass vmap_axes=None, which does not evaluate the model under vmap. "
                f"PyTorch said: {original}"
            )
            return
        super().__init__(
            f"{where}: evaluating or differentiating the model per example under torch.func.vmap "
            f"(`vmap_axes`) raised {type(original).__name__}. If the model runs on whole batches, it "
            f"probably reads other examples (x[index], index_select or gather along the batch axis, as "
            f"graph networks do with their nodes), which one example alone does not hold, or one of its "
            f"operations fails under vmap: pass vmap_axes=None, which does not evaluate the model under "
            f"vmap. The model raised {type(original).__name__}: {original}"
        )


def first_line(error: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextlib.contextmanager
def vmap_errors(where: str) -> Iterator[None]:
    """Explains the errors of the model evaluated per example under vmap (``vmap_axes``).

    vmap's errors on data-dependent operations become a ValueError that says what to do; other
    plain RuntimeErrors get a hint (a :class:`VmapRuntimeError`, still a RuntimeError, as the
    cause cannot be told here). So do the other exceptions raised outside torchntk (an IndexError
    of a model that indexes other examples, or what a library turned vmap's error into): the model
    ran on the whole batch before, so they are failures of the per-example evaluation too. Running
    out of memory (``torch.OutOfMemoryError``, ``MemoryError``, or the plain RuntimeError of the
    CPU allocator) and torchntk's own errors pass unchanged.

    Raises:
        ValueError, VmapRuntimeError: chained to the original error.
    """
    try:
        yield
    except RuntimeError as error:
        if is_data_dependent_error(error):
            raise DataDependentError(
                f"{where}: the model uses data-dependent control flow or shapes (boolean-mask indexing "
                f"such as x[x > 0], torch.nonzero, .item(), `if tensor:` ...), which torch.func.vmap "
                f"cannot batch, and `vmap_axes` evaluates the model per example under vmap. Pass "
                f"vmap_axes=None (the model then sees whole batches), or write the operation with fixed "
                f"shapes (e.g. torch.where). PyTorch said: {first_line(error)}"
            ) from error
        if type(error) is RuntimeError and not is_out_of_memory(error):
            raise VmapRuntimeError(where, error) from error
        raise
    except Exception as error:
        if isinstance(error, MemoryError) or raised_by_torchntk(error):
            raise
        raise VmapRuntimeError(where, error) from error


def raised_by_torchntk(error: BaseException) -> bool:
    """Whether ``error`` is torchntk's own: of a type it defines, or raised by one of its frames
    (its checks raise plain ValueErrors inside the model's evaluation too)."""
    if type(error).__module__.split(".")[0] == "torchntk":
        return True
    frame = error.__traceback__
    if frame is None:
        return False
    while frame.tb_next is not None:
        frame = frame.tb_next
    return os.path.abspath(frame.tb_frame.f_code.co_filename).startswith(_PACKAGE)


def is_out_of_memory(error: BaseException) -> bool:
    """CPU allocation failures are plain RuntimeErrors; blaming vmap for them would mislead."""
    text = str(error)
    return "can't allocate memory" in text or "out of memory" in text
