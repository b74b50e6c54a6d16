"""The ``get`` argument of kernel functions and the :class:`EmpiricalKernel` namedtuples."""

from __future__ import annotations

import collections
import functools
import inspect
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from .._utils.checks import show
from .._utils.tree import Flat
from .groups import is_group_kernels

KERNEL_NAMES = ("nngp", "ntk")


@functools.lru_cache(maxsize=None)
def results_type(type_name: str, fields: tuple[str, ...]) -> type:
    """The namedtuple class ``type_name`` with these fields, in this order: one class per name and
    order, so that results of equal requests have equal types."""
    return collections.namedtuple(type_name, fields)


def empirical_kernel_type(fields: tuple[str, ...]) -> type:
    """The ``EmpiricalKernel`` namedtuple class with these fields, in this order."""
    return results_type("EmpiricalKernel", fields)


def output_fn_argument(output_fn: Any, where: str) -> Optional[Callable[[Any, Any, Mapping[str, Any]], Any]]:
    """The user's ``output_fn`` as ``(output, x, kwargs) -> selected output`` (None stays None).

    ``output_fn`` may take the output alone (``lambda out: out.logits``) or the output, the
    inputs and the keyword arguments the model received (``def last(out, x, attention_mask)``);
    it is called the second way when it accepts two positional arguments.

    Raises:
        TypeError: ``output_fn`` is neither None nor callable.
    """
    if output_fn is None:
        return None
    if not callable(output_fn):
        raise TypeError(
            f"{where}: `output_fn` must be None or a callable output_fn(output) or "
            f"output_fn(output, x, **kwargs), got {show(output_fn)}."
        )
    try:
        inspect.signature(output_fn).bind_partial(None, None)
    except (TypeError, ValueError):  # ValueError: no signature to read (some builtins)
        return lambda output, x, kwargs: output_fn(output)
    return lambda output, x, kwargs: output_fn(output, x, **kwargs)


def canonical_get(get: Union[None, str, Sequence[str]], where: str) -> tuple[tuple[str, ...], bool]:
    """Returns ``(names, bare)``: the lower-cased kernel names and whether to return a bare tensor.

    ``None`` means all kernels (``("nngp", "ntk")``); a string means that kernel alone, returned
    bare; a tuple or list means those kernels in that order, in an ``EmpiricalKernel``.

    Raises:
        TypeError: ``get`` is not None, a string, or a sequence of strings.
        ValueError: ``get`` is empty, repeats a name, or names an unknown kernel.
    """
    if get is None:
        return KERNEL_NAMES, False
    bare = isinstance(get, str)
    items = (get,) if bare else get
    if not isinstance(items, (tuple, list)):
        raise TypeError(f"{where}: `get` must be None, a string or a tuple of strings, got {show(get)}.")
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"{where}: `get` must contain only strings, got {show(get)}.")
    names = tuple(item.lower() for item in items)
    if not names:
        raise ValueError(f"{where}: `get` must name at least one of {KERNEL_NAMES}, got {show(get)}.")
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: `get` must not repeat a kernel, got {show(get)}.")
    unknown = [name for name in names if name not in KERNEL_NAMES]
    if unknown:
        raise ValueError(f"{where}: `get` has unknown kernel {unknown[0]!r}; expected names from {KERNEL_NAMES}.")
    return names, bare


def combine(kernels: dict[str, Any], names: tuple[str, ...], bare: bool) -> Any:
    """Turns ``{name: kernel tree}`` into one tree whose leaves are ``EmpiricalKernel`` tuples.

    A single-tensor output gives one ``EmpiricalKernel``; a tuple/list/dict output gives a
    container of the same structure holding one ``EmpiricalKernel`` per output leaf. A grouped NTK's
    ``{group: kernel}`` of an output leaf stays whole (NOTE: [Parameter groups]).
    """
    if bare:
        return kernels[names[0]]
    kernel_type = empirical_kernel_type(names)
    flats = [Flat.of(kernels[name], is_leaf=is_group_kernels) for name in names]
    per_leaf = [kernel_type(*leaves) for leaves in zip(*(flat.leaves for flat in flats))]
    return flats[0].rebuild(per_leaf)
