"""The running Monte Carlo estimates of :mod:`torchntk.monte_carlo`, and their result types.

NOTE: [Monte Carlo sharding hooks]
The sample loop is written for several processes (``torchntk.distributed``). Two private
keyword-only arguments of ``torchntk.monte_carlo._monte_carlo_kernel_fn`` (the builder behind
:func:`~torchntk.monte_carlo_kernel_fn`, whose public signature does not have them) change it; by
default this process computes every sample and the reduction is the identity:

* ``owned(s) -> bool``: whether this process computes global sample ``s``. The samples are
  walked in order ``0 .. max(n_samples) - 1`` and the owned ones are added to a local running
  sum (float64, NOTE: [Monte Carlo accumulation] in ``torchntk/monte_carlo.py``).
* ``reduce(local_sum) -> total_sum``: applied at every emitted checkpoint ``n`` (once in plain
  mode) to the local sum over the owned samples ``s < n``, before dividing by ``n``. It gets a
  ``list`` of tensors (the flattened kernel leaves, float64 or complex128, a fresh copy that it
  may change in place, e.g. with ``all_reduce``) and must return a list of tensors of the same
  shapes. Every process calls it at every checkpoint: a process that owns no sample below ``n``
  passes zeros, shaped by one extra kernel evaluation (sample 0's network), computed once.

Under ``torch.distributed`` the builder itself passes ``owned_samples`` and an
``all_reduce_sum`` as these hooks (NOTE: [Sharing] in ``torchntk/monte_carlo.py``); the hooks let
tests play several ranks with threads, and other schedulers share the samples their own way.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils import _pytree as pytree

from ._outputs import KERNEL_NAMES, empirical_kernel_type, results_type
from ._tree import Flat
from .distributed import failure_guard

Leaves = list[torch.Tensor]
"""The flattened kernel leaves of one sample, or of a running sum."""


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
                    running = [leaf.to(accumulation_dtype(leaf.dtype), copy=True) for leaf in leaves]
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
                    template = [torch.zeros_like(leaf, dtype=accumulation_dtype(leaf.dtype)) for leaf in leaves]
                local = [zeros.clone() for zeros in template]
            else:
                local = [total.clone() for total in running]
            summed = reduce(local)
            yield finish([(total / n).to(dtype) for total, dtype in zip(summed, dtypes)])
    finally:
        if bar is not None:
            bar.close()


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the running sum of kernels of ``dtype`` (NOTE: [Monte Carlo accumulation])."""
    return torch.complex128 if dtype.is_complex else torch.float64


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
