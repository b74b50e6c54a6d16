"""The sample loop of :mod:`torchntk.monte_carlo`: the running estimates and their result types.

:func:`sampled_kernel_fn` is the private builder behind :func:`torchntk.monte_carlo_kernel_fn`:
given the checked arguments and the batched empirical kernel function, it returns the Monte Carlo
kernel function, which draws each sample (``torchntk/monte_carlo/_draws.py``) and adds its kernel
to a running sum (:func:`estimates`).

NOTE: [Monte Carlo sharding hooks]
The sample loop is written for several processes (``torchntk.distributed``). Two private
keyword-only arguments of :func:`sampled_kernel_fn` (not of the public
:func:`~torchntk.monte_carlo_kernel_fn`) change it; by default this process computes every sample
and the reduction is the identity:

* ``owned(s) -> bool``: whether this process computes global sample ``s``. The samples are
  walked in order ``0 .. max(n_samples) - 1`` and the owned ones are added to a local running
  sum (float64, NOTE: [Monte Carlo accumulation] in ``torchntk/monte_carlo/__init__.py``).
* ``reduce(local_sum) -> total_sum``: applied at every emitted checkpoint ``n`` (once in plain
  mode) to the local sum over the owned samples ``s < n``, before dividing by ``n``. It gets a
  ``list`` of tensors (the flattened kernel leaves, float64 or complex128, a fresh copy that it
  may change in place, e.g. with ``all_reduce``) and must return a list of tensors of the same
  shapes. Every process calls it at every checkpoint: a process that owns no sample below ``n``
  passes zeros, shaped by one extra kernel evaluation (sample 0's network), computed once.

Without hooks, under ``torch.distributed`` with ``distributed="auto"`` or ``"samples"``, the
builder uses ``torchntk.distributed.owned_samples`` and ``all_reduce_sum`` as these hooks (NOTE:
[Sharing] in ``torchntk/monte_carlo/__init__.py``). Passing hooks lets tests play several ranks with
threads, and lets another scheduler share the samples its own way.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from torch.utils import _pytree as pytree

from .._call.outputs import KERNEL_NAMES, canonical_get, empirical_kernel_type, results_type
from .._utils.checks import show
from .._utils.precision import accumulation_dtype
from .._utils.tree import Flat
from .._utils.types import Model, PyTree
from ..distributed import DEFAULT_TIMEOUT, all_reduce_sum, failure_guard, owned_samples, world
from ._draws import Sampler

Leaves = list[torch.Tensor]
"""The flattened kernel leaves of one sample, or of a running sum."""


def sampled_kernel_fn(
    f: Model,
    batched: Callable[..., Any],
    *,
    init_fn: Optional[Callable[..., Any]],
    seed: int,
    counts: tuple[int, ...],
    generator_mode: bool,
    progress: bool = False,
    distributed: str = "off",
    timeout: float = DEFAULT_TIMEOUT,
    owned: Optional[Callable[[int], bool]] = None,
    reduce: Optional[Callable[[Leaves], Leaves]] = None,
) -> Callable[..., Any]:
    """The Monte Carlo kernel function ``mc_kernel_fn`` of :func:`torchntk.monte_carlo_kernel_fn`.

    Args:
        f: the model, as given to ``monte_carlo_kernel_fn``.
        batched: the empirical kernel function of ``f``, batched with
            :func:`torchntk.batch`; it is called with a tuple ``get`` and each sample's ``params``.
        init_fn, seed, progress, distributed, timeout: the checked arguments of
            ``monte_carlo_kernel_fn``.
        counts: the sample counts to emit an estimate at, ascending, without duplicates.
        generator_mode: whether ``mc_kernel_fn`` returns a generator of the estimates (else the
            one estimate).
        owned, reduce: the private hooks of NOTE: [Monte Carlo sharding hooks]; either one
            replaces the sharing of ``distributed``.

    Returns:
        ``mc_kernel_fn(x1, x2=None, get=None, **kwargs)``, documented by ``monte_carlo_kernel_fn``.

    Raises:
        TypeError: a hook that is neither None nor a callable.
    """
    for name, hook in (("owned", owned), ("reduce", reduce)):
        if hook is not None and not callable(hook):
            raise TypeError(f"monte_carlo_kernel_fn: `{name}` must be None or a callable, got {show(hook)}.")

    def strategy() -> tuple[Callable[[int], bool], Callable[[Leaves], Leaves], bool]:
        """This process's samples and the reduction, decided at call time (see NOTE: [Sharing])."""
        rank, world_size = world()
        if owned is not None or reduce is not None or world_size == 1 or distributed in ("blocks", "off"):
            return (owned or (lambda s: True)), (reduce or (lambda total: total)), False
        return owned_samples(rank, world_size), lambda total: all_reduce_sum(total, timeout=timeout), True

    def mc_kernel_fn(
        x1: PyTree, x2: Optional[PyTree] = None, get: Union[None, str, Sequence[str]] = None, **kwargs: Any
    ) -> Any:
        call_where = "mc_kernel_fn"
        names, bare = canonical_get(get, call_where)
        if "params" in kwargs:
            raise TypeError(
                f"{call_where}: got a `params` argument, but the parameters of every sample are drawn "
                f"by the Monte Carlo kernel function (see `init_fn` of monte_carlo_kernel_fn)."
            )
        sampler = Sampler.for_model(f, init_fn, seed, x1, call_where)
        structure = Structure(names, bare)

        def sample_kernel(s: int) -> Leaves:
            # Always a tuple `get`: every leaf is an EmpiricalKernel, renamed when emitted.
            return structure.flatten(batched(x1, x2, names, params=sampler.draw(s), **kwargs))

        owns, reduction, sharing = strategy()
        results = estimates(sample_kernel, counts, owns, reduction, progress, structure.rebuild)
        if sharing:  # an exception on this rank reaches the others at their next all-reduce
            results = guarded(results, timeout)
        if generator_mode:
            return results
        (estimate,) = results
        return estimate

    return mc_kernel_fn


def guarded(estimates: Iterator[Any], timeout: float) -> Iterator[Any]:
    """``estimates``, with an exception on this rank reported to the others at their next all-reduce."""
    with failure_guard(timeout=timeout):
        yield from estimates


def estimates(
    sample_kernel: Callable[[int], Leaves],
    counts: tuple[int, ...],
    owned: Callable[[int], bool],
    reduce: Callable[[Leaves], Leaves],
    progress: bool,
    finish: Callable[[Leaves], Any],
) -> Iterator[Any]:
    """Yields the estimate at every count in ``counts`` (ascending) from one running sum.

    Args:
        sample_kernel: the flattened kernel leaves of sample ``s``.
        counts: the sample counts to emit an estimate at, ascending, without duplicates.
        owned, reduce: the hooks of NOTE: [Monte Carlo sharding hooks].
        progress: show a ``tqdm`` bar over this process's samples.
        finish: turns the list of averaged leaves into the user-facing result.

    Yields:
        ``finish(leaves)`` for every count, the leaves in the kernels' dtypes.
    """
    total_owned = sum(1 for s in range(counts[-1]) if owned(s))
    bar = progress_bar(total_owned) if progress else None
    running: Optional[Leaves] = None
    template: Optional[Leaves] = None
    dtypes: Optional[list[torch.dtype]] = None
    checkpoints = set(counts)
    try:
        for s in range(counts[-1]):
            if owned(s):
                leaves = sample_kernel(s)
                if running is None:
                    dtypes = [leaf.dtype for leaf in leaves]
                    running = [leaf.to(accumulation_dtype(leaf.dtype, leaf.device), copy=True) for leaf in leaves]
                else:
                    for total, leaf in zip(running, leaves):
                        total.add_(leaf)
                if bar is not None:
                    bar.update(1)
            n = s + 1
            if n not in checkpoints:
                continue
            if running is None:
                # See NOTE: [Monte Carlo sharding hooks]: nothing owned yet, contribute zeros.
                if template is None:
                    leaves = sample_kernel(0)
                    dtypes = [leaf.dtype for leaf in leaves]
                    template = [torch.zeros_like(leaf, dtype=accumulation_dtype(leaf.dtype, leaf.device)) for leaf in leaves]
                local = [zeros.clone() for zeros in template]
            else:
                local = [total.clone() for total in running]
            summed = reduce(local)
            yield finish([(total / n).to(dtype) for total, dtype in zip(summed, dtypes)])
    finally:
        if bar is not None:
            bar.close()


def progress_bar(total: int) -> Any:
    """A ``tqdm`` bar over ``total`` samples; tqdm is imported only when a bar is asked for."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Monte Carlo samples", unit="sample")


def monte_carlo_kernel_type(fields: tuple[str, ...]) -> type:
    """The ``MonteCarloKernel`` namedtuple class with these fields, in this order."""
    return results_type("MonteCarloKernel", fields)


class Structure:
    """The tree of one call's per-sample results, to rebuild the averaged leaves.

    Attributes:
        names: the kernels asked for, in order.
        bare: whether ``get`` named one kernel bare (``"ntk"``) rather than a tuple.
        flat: the structure of the first sample's result, once one was flattened.
    """

    def __init__(self, names: tuple[str, ...], bare: bool):
        self.names = names
        self.bare = bare
        self.flat: Optional[Flat] = None

    def flatten(self, result: Any) -> Leaves:
        """The leaves of one sample's result; every sample must have the first one's structure."""
        flat = Flat.of(result)
        if self.flat is None:
            self.flat = flat
        elif not flat.same_structure(self.flat):
            raise AssertionError("the kernel function returned results of different structures for two samples")
        return list(flat.leaves)

    def rebuild(self, leaves: Leaves) -> Any:
        """The user-facing result: ``EmpiricalKernel`` leaves become ``MonteCarloKernel`` or bare tensors."""
        empirical = empirical_kernel_type(self.names)
        monte_carlo = monte_carlo_kernel_type(self.names)

        def convert(node: Any) -> Any:
            if isinstance(node, empirical):
                return node[0] if self.bare else monte_carlo(*node)
            return node

        tree = self.flat.rebuild(leaves)
        return pytree.tree_map(convert, tree, is_leaf=lambda node: isinstance(node, empirical) or node is None)


MonteCarloKernel = monte_carlo_kernel_type(KERNEL_NAMES)
"""The result type for ``get=None``: ``MonteCarloKernel(nngp, ntk)``."""
