"""One side of a kernel (x1 or x2): the model evaluated on a batch, whole or per example.

NOTE: [Per-example evaluation]
With ``vmap_axes`` the model is evaluated under ``torch.func.vmap`` on slices of size one: each
mapped input leaf gets its batch axis back as a size-1 axis (``unsqueeze``) before the model sees
it, and each output leaf loses it again (``squeeze``), so the model always runs on a batch of one
example. Jacobians then cost ``O`` backward passes of one example each, instead of ``O`` backward
passes over the whole batch. Without ``vmap_axes`` the model runs on the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

import torch
from torch.func import jacrev, vmap

from ._model import FunctionalModel
from ._tree import Flat


@dataclass(frozen=True)
class Side:
    """The model and the inputs of one side, plus the axes to map (or None for whole batches).

    ``name`` is ``"x1"`` or ``"x2"``; ``offset`` is the position of the first example in that input
    after :meth:`narrow`.
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

    @classmethod
    def build(
        cls, model: FunctionalModel, x: Any, kwargs: Mapping[str, Any], vmap_axes: Any, out_axes: Any, where: str, name: str
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
        )

    @property
    def mapped(self) -> bool:
        return self.x_axes is not None

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
        output = self.model.apply(params, x, kwargs)
        return tuple(Flat.of(output).leaves)

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
                raise ValueError(
                    f"{self.where}: with `vmap_axes`, the model applied to one example returned an "
                    f"output leaf of shape {tuple(leaf.shape)}, which has no size-1 batch axis at "
                    f"out_axes={axis}. Check `vmap_axes`, or pass vmap_axes=None."
                )
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
        mapped = vmap(self._one_example, in_dims=self._in_dims(), out_dims=self.out_axes)
        return mapped(self.model.params, *self._data())

    def jacobians(
        self, chunk_size: Optional[int] = None, only: Optional[tuple[int, ...]] = None
    ) -> tuple[tuple[torch.Tensor, ...], ...]:
        """``J[k][p]`` of shape ``output_k.shape + param_p.shape`` for every output and parameter leaf.

        ``chunk_size`` bounds how many output entries are differentiated at once when the side is
        not mapped (passed to ``jacrev``); mapped sides are chunked by examples instead. ``only``
        restricts the parameters differentiated (``J[k]`` then follows its order).
        """
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
        mapped = vmap(jacrev(evaluate, argnums=0), in_dims=self._in_dims(), out_dims=self.out_axes)
        return mapped(chosen, *self._data())

    @property
    def evaluate(self):
        """``(params, x_leaves, kwarg_leaves) -> output leaves``: one example when mapped, else the batch."""
        return self._one_example if self.mapped else self._call

    def per_example(self, function, extra: tuple = (), extra_dims: tuple = ()):
        """``function(x_leaves, kwarg_leaves, *extra)``, under ``vmap`` per example when mapped.

        Mapped results gain a leading example axis; ``extra_dims`` are the mapped axes of ``extra``.
        """
        x_leaves, kwarg_leaves = self._data()
        if not self.mapped:
            return function(x_leaves, kwarg_leaves, *extra)
        in_dims = self._in_dims()[1:] + tuple(extra_dims)
        return vmap(function, in_dims=in_dims)(x_leaves, kwarg_leaves, *extra)

def _unsqueeze(leaves: tuple, axes: tuple[Optional[int], ...]) -> tuple:
    return tuple(leaf if axis is None else leaf.unsqueeze(axis) for leaf, axis in zip(leaves, axes))
