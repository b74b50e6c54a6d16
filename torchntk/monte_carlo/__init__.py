"""Monte Carlo estimates of the infinite-width NNGP and NTK: averages over random networks.

:func:`monte_carlo_kernel_fn` draws ``n`` networks (sample ``s`` from a seed that depends only on
``(seed, s)``), computes each one's empirical kernel with :func:`torchntk.empirical_kernel_fn`
(blocked and spread over devices by :func:`torchntk.batch`) and averages them.

NOTE: [Monte Carlo sample seeds]
Sample ``s`` (``s = 0, 1, ...``) is drawn from ``seed_s = sample_seed(seed, s)``, the first 64-bit
word of ``numpy.random.SeedSequence([seed, s]).generate_state(2, numpy.uint64)``. Unlike
neural-tangents' sequential key chain, this gives random access: sample ``s`` is the same network
whatever ``batch_size``, ``devices``, number of processes or order of work, and a process can
jump straight to the samples it owns. Parameters are always drawn on CPU, so they are also the
same whatever device the kernels are computed on (they are then moved to the device of the module's
parameter, or for a function to x1's device, before the kernel function sees them). They are
drawn in the parameters' dtype: a float64 layer redrawn by ``reset_parameters`` gets other values
than a float32 draw cast with ``.double()``.

* ``nn.Module`` without ``init_fn``: on a CPU copy of the module, inside
  ``torch.random.fork_rng(devices=[])`` with the CPU generator seeded with ``seed_s`` (only the
  CPU generator: CUDA generators are neither read nor reseeded), under a process-wide lock, every
  submodule's ``reset_parameters()`` (or, failing that, ``_reset_parameters()``, which e.g.
  ``nn.MultiheadAttention`` has) is called in post-order (children in registration order, then
  their parent), the order in which constructors run. So for the usual modules (``nn.Linear``,
  ``nn.Conv2d``, ``nn.Sequential`` of them, ...) sample ``s`` has exactly the parameters of a
  fresh ``torch.manual_seed(seed_s); make_model()``. Before the resets every differentiated
  parameter is filled with NaN; one that still holds a NaN afterwards was not redrawn (a custom
  ``nn.Parameter`` of a module without ``reset_parameters``) and raises ValueError.
* ``init_fn``: called on that CPU copy (modules: ``init_fn(module, generator)``; functions:
  ``init_fn(generator)``) with ``generator = torch.Generator('cpu').manual_seed(seed_s)``. It
  runs under the same lock and ``fork_rng`` with the global CPU generator seeded with the second
  word of the state, so an ``init_fn`` that ignores ``generator`` is still reproducible (and its
  draws are not a copy of the generator's stream).

The global random state of the caller is left as it was in both cases.


NOTE: [Sharing]
Under ``torch.distributed`` (``torchrun``, or any initialised process group of several ranks),
``distributed="auto"`` (the default) or ``"samples"`` shares the samples round-robin (rank ``r``
computes the samples ``s`` with ``s % world_size == r``) and sums the ranks' running sums with one
all-reduce per emitted estimate; every rank returns the estimate. ``"blocks"`` instead shares the
kernel blocks of every sample (``torchntk.batch`` with its ``distributed="auto"``): one
all-reduce per sample. Either way the estimates equal one process's up to rounding (the order of
the sums differs). ``"off"`` makes every rank compute everything. ``timeout`` bounds how long a
rank waits for the others at a collective; a rank that fails or hangs makes the others raise
``torchntk.distributed.DistributedError``.

NOTE: [Monte Carlo accumulation]
The running sum is kept in float64 (complex128 for complex kernels; the kernel's own dtype on MPS,
which has no float64), on the device each kernel comes back on, and divided by ``n`` only when an estimate is emitted, which is then cast back to
the kernel's dtype. Summing in double makes the estimate independent, to float32 rounding, of how
samples are split between processes and of the order they are added in; it costs one
double-precision copy of the kernel. (neural-tangents sums in the kernel's dtype.)
"""

from __future__ import annotations

import numbers
import operator
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from .._call.groups import groups_argument
from .._utils import checks as _checks
from .._utils.checks import show
from .._utils.types import Axes, Model, NtkImplementation, VMapAxes
from ..batching import batch
from ..distributed import DEFAULT_TIMEOUT
from ..empirical import DEFAULT_NTK_IMPLEMENTATION, DEFAULT_VMAP_AXES, empirical_kernel_fn
from ._draws import sample_seed as sample_seed
from ._estimates import MonteCarloKernel as MonteCarloKernel
from ._estimates import monte_carlo_kernel_type as monte_carlo_kernel_type
from ._estimates import sampled_kernel_fn

__all__ = ["monte_carlo_kernel_fn"]


def monte_carlo_kernel_fn(
    f: Model,
    n_samples: Union[int, Sequence[int]],
    seed: int = 0,
    *,
    init_fn: Optional[Callable[..., Any]] = None,
    batch_size: int = 0,
    device_count: int = -1,
    store_on_device: bool = True,
    devices: Optional[Sequence[Union[str, torch.device]]] = None,
    trace_axes: Axes = (-1,),
    diagonal_axes: Axes = (),
    vmap_axes: VMapAxes = DEFAULT_VMAP_AXES,
    implementation: Union[NtkImplementation, int] = DEFAULT_NTK_IMPLEMENTATION,
    progress: bool = False,
    distributed: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    groups: Optional[Mapping[str, Any]] = None,
) -> Callable[..., Any]:
    """Returns a function estimating the NNGP and NTK of ``f``'s architecture by Monte Carlo.

    The estimate with ``n`` samples is the average of the empirical kernels
    (:func:`~torchntk.empirical_kernel_fn`) of ``n`` networks with freshly drawn parameters.
    Sample ``s`` depends only on ``(seed, s)`` (NOTE: [Monte Carlo sample seeds] in
    ``torchntk/monte_carlo/__init__.py``), so every call, every ``batch_size`` and every device set gives
    the same networks, and estimates agree up to floating-point rounding.

    Only the differentiated parameters (``requires_grad=True``) are redrawn; frozen parameters
    and buffers keep the module's values in every sample. The module itself is never changed:
    each sample's parameters are passed to the kernel function through its ``params`` argument.
    The infinite-width limits of neural-tangents assume the NTK parameterisation (weights
    ``N(0, 1)`` scaled by ``W_std / sqrt(fan_in)`` in the forward pass); PyTorch's default
    layers (``nn.Linear``: uniform, unscaled forward) average to different kernels.

    Args:
        f: an ``nn.Module`` or a function ``f(params, x, **kwargs)`` of a pytree of parameters.
        n_samples: a positive int: the function returns the estimate with that many samples; or
            an iterable of positive ints: the function returns a generator yielding the estimates
            at those sample counts, in **ascending order with duplicates removed** (``[4, 1, 2,
            2]`` yields the estimates for 1, 2 and 4 samples), computed incrementally from one
            running sum. ``True``/``False`` are rejected (neural-tangents reads ``True`` as 1).
        seed: a non-negative int; sample ``s`` is drawn from ``sample_seed(seed, s)``. Default: 0.
        init_fn: how to draw one sample's parameters. For a module: ``None`` (default: every
            submodule's ``reset_parameters()``) or ``init_fn(module, generator) -> {name:
            tensor}`` for every differentiated parameter, called on a CPU copy of the module. For
            a function ``f``: required, ``init_fn(generator) -> params pytree``. ``generator`` is
            a seeded ``torch.Generator('cpu')``; draw from it (``torch.nn.init.normal_(t,
            generator=generator)``) and the result is reproducible and thread-safe.
        batch_size, device_count, store_on_device, devices: passed to
            :func:`torchntk.batch`, which computes each sample's kernel in blocks of
            ``batch_size`` examples (``0``: one block) on ``devices``. The running sum lives
            where the blocks are assembled (on CPU when ``store_on_device=False``).
        trace_axes, diagonal_axes, vmap_axes, implementation: as in
            :func:`~torchntk.empirical_kernel_fn` (the last two only affect the NTK).
        progress: show a ``tqdm`` progress bar over the samples. Default: ``False``.
        distributed: how ranks of an initialised ``torch.distributed`` process group share the
            work: ``"auto"`` or ``"samples"`` (samples round-robin, one all-reduce per estimate),
            ``"blocks"`` (kernel blocks shared out, one all-reduce per sample), ``"off"``.
            Ignored in a single process. See NOTE: [Sharing]. Default: ``"auto"``.
        timeout: seconds (or a ``datetime.timedelta``) a rank waits for the others at a
            collective before raising ``torchntk.distributed.DistributedError``; positive and
            finite. Default: 300.
        groups: split the NTK estimate by parameter groups, as in
            :func:`~torchntk.empirical_ntk_fn` (``docs/groups.md``): every NTK of the result is a
            dict ``{group: estimate}``, the average of the samples' group kernels. Default: ``None``.

    Returns:
        ``mc_kernel_fn(x1, x2=None, get=None, **kwargs)``; ``x2=None`` means x1 and ``kwargs``
        go to ``f`` (a 2-tuple value is split between x1 and x2) as for the empirical kernels.
        ``get`` as in :func:`~torchntk.empirical_kernel_fn`: ``"nngp"`` or ``"ntk"`` gives that
        kernel bare; a tuple gives a namedtuple ``MonteCarloKernel`` with those fields in that
        order; ``None`` gives ``MonteCarloKernel(nngp, ntk)`` (neural-tangents returns its
        ``EmpiricalKernel`` type there). For tuple/list/dict outputs the result has that
        structure, one result per output leaf. Estimates have the kernels' dtype (the sum is
        kept in float64, NOTE: [Monte Carlo accumulation]). Every call starts again from
        sample 0: two calls give identical results, and in generator mode nothing is computed
        until the generator is iterated (``get`` and the model are checked at the call).

    Raises:
        TypeError: at build time, ``n_samples`` that is a bool, a string or neither an int nor
            an iterable; a ``seed`` that is not an int; a function ``f`` without ``init_fn``;
            other arguments of the wrong type. At call time, ``params`` among ``kwargs``, or an
            ``init_fn`` result of the wrong type.
        ValueError: at build time, ``n_samples`` (or one of its entries) that is not a positive
            int, an empty ``n_samples``, a negative ``seed``. At call time, a module with
            BatchNorm using batch statistics or active dropout (call ``model.eval()``: a random or
            batch-coupled forward pass is not reproducible), a parameter not redrawn by
            ``reset_parameters`` (pass ``init_fn``), an ``init_fn`` result with wrong names or
            shapes; and the errors of the empirical kernels and of ``batch``.

    Example:
        >>> import torch, torchntk
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
        >>> x1, x2 = torch.randn(4, 3), torch.randn(2, 3)
        >>> mc = torchntk.monte_carlo_kernel_fn(model, 8, seed=1, vmap_axes=0)
        >>> k = mc(x1, x2)                                    # MonteCarloKernel(nngp, ntk)
        >>> k.nngp.shape, k.ntk.shape
        (torch.Size([4, 2]), torch.Size([4, 2]))
        >>> torch.equal(mc(x1, x2, "ntk"), k.ntk)            # same seed, same networks
        True
        >>> gen = torchntk.monte_carlo_kernel_fn(model, [4, 1, 2, 2])
        >>> [k.shape for k in gen(x1, None, "nngp")]          # for 1, 2 then 4 samples
        [torch.Size([4, 4]), torch.Size([4, 4]), torch.Size([4, 4])]
    """
    where = "monte_carlo_kernel_fn"
    _checks.callable_model_argument(f, where)
    counts, generator_mode = _canonical_n_samples(n_samples, where)
    seed = _checks.non_negative_int_argument(seed, "seed", where)
    is_module = isinstance(f, nn.Module)
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"{where}: `init_fn` must be None or a callable, got {show(init_fn)}.")
    if init_fn is None and not is_module:
        raise TypeError(
            f"{where}: `f` is a function f(params, x, **kwargs), so `init_fn(generator) -> params` is "
            f"required to draw each sample's parameters; only nn.Modules can be redrawn with their "
            f"own reset_parameters()."
        )
    _checks.bool_argument(progress, "progress", where)
    if distributed not in ("auto", "samples", "blocks", "off"):
        raise ValueError(
            f"{where}: `distributed` must be 'auto', 'samples', 'blocks' or 'off', got {show(distributed)}."
        )
    timeout = _checks.timeout_argument(timeout, where)

    parsed_groups = groups_argument(groups, f, where)
    kernel_fn = empirical_kernel_fn(f, trace_axes, diagonal_axes, vmap_axes, implementation, groups=parsed_groups)
    batched = batch(
        kernel_fn, batch_size=batch_size, device_count=device_count, store_on_device=store_on_device,
        devices=devices, progress=False, distributed="auto" if distributed == "blocks" else "off", timeout=timeout,
    )

    return sampled_kernel_fn(
        f, batched, init_fn=init_fn, seed=seed, counts=counts, generator_mode=generator_mode, progress=progress,
        distributed=distributed, timeout=timeout,
    )


# ------------------------------------------------------------------------------------------------
# Argument checks


def _canonical_n_samples(n_samples: Any, where: str) -> tuple[tuple[int, ...], bool]:
    """``(ascending unique counts, generator mode)``."""
    expected = "a positive int or an iterable of positive ints"
    if isinstance(n_samples, bool):
        raise TypeError(f"{where}: `n_samples` must be {expected}, got {show(n_samples)}; a bool is not accepted.")
    if isinstance(n_samples, (str, bytes)):
        raise TypeError(f"{where}: `n_samples` must be {expected}, got {show(n_samples)}.")
    count = _as_int(n_samples)
    if count is not None:
        if count < 1:
            raise ValueError(f"{where}: `n_samples` must be {expected}, got {show(n_samples)}.")
        return (count,), False
    try:
        items = list(n_samples)
    except TypeError:
        raise TypeError(f"{where}: `n_samples` must be {expected}, got {show(n_samples)}.") from None
    if not items:
        raise ValueError(f"{where}: `n_samples` must not be empty; expected {expected}.")
    counts = []
    for item in items:
        count = None if isinstance(item, bool) else _as_int(item)
        if count is None:
            raise ValueError(
                f"{where}: `n_samples` must contain only ints, got {show(n_samples)} with element {show(item)}."
            )
        if count < 1:
            raise ValueError(f"{where}: `n_samples` must contain only positive ints, got {show(n_samples)}.")
        counts.append(count)
    return tuple(sorted(set(counts))), True


def _as_int(value: Any) -> Optional[int]:
    """``value`` as an int if it is an integer (Python, numpy or 0-d integer tensor), else None."""
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point() and not value.is_complex():
        return int(operator.index(value))
    return None

