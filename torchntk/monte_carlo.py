"""Monte Carlo estimates of the infinite-width NNGP and NTK: averages over random networks.

:func:`monte_carlo_kernel_fn` draws ``n`` networks (sample ``s`` from a seed that depends only on
``(seed, s)``), computes each one's empirical kernel with :func:`torchntk.empirical_kernel_fn`
(blocked and spread over devices by :func:`torchntk.batching.batch`) and averages them.

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

NOTE: [Monte Carlo sharding hooks]
The sample loop is written for several processes (``torchntk.distributed``). Two private
keyword-only arguments of :func:`monte_carlo_kernel_fn` change it; by default this process
computes every sample and the reduction is the identity:

* ``_owned(s) -> bool``: whether this process computes global sample ``s``. The samples are
  walked in order ``0 .. max(n_samples) - 1`` and the owned ones are added to a local running
  sum (float64, see below).
* ``_reduce(local_sum) -> total_sum``: applied at every emitted checkpoint ``n`` (once in plain
  mode) to the local sum over the owned samples ``s < n``, before dividing by ``n``. It gets a
  ``list`` of tensors (the flattened kernel leaves, float64 or complex128, a fresh copy that it
  may change in place, e.g. with ``all_reduce``) and must return a list of tensors of the same
  shapes. Every process calls it at every checkpoint: a process that owns no sample below ``n``
  passes zeros, shaped by one extra kernel evaluation (sample 0's network), computed once.

NOTE: [Sharing]
Under ``torch.distributed`` (``torchrun``, or any initialised process group of several ranks),
``distributed="auto"`` (the default) or ``"samples"`` shares the samples round-robin (rank ``r``
computes the samples ``s`` with ``s % world_size == r``) and sums the ranks' running sums with one
all-reduce per emitted estimate; every rank returns the estimate. ``"blocks"`` instead shares the
kernel blocks of every sample (``torchntk.batch`` with its ``distributed="auto"``): one
all-reduce per sample. Either way the estimates equal one process's up to rounding (the order of
the sums differs). ``"off"`` makes every rank
compute everything. ``timeout`` bounds how long a rank waits for the others at a collective; a
rank that fails or hangs makes the others raise ``torchntk.distributed.DistributedError``.

NOTE: [Monte Carlo accumulation]
The running sum is kept in float64 (complex128 for complex kernels), on the device each kernel
comes back on, and divided by ``n`` only when an estimate is emitted, which is then cast back to
the kernel's dtype. Summing in double makes the estimate independent, to float32 rounding, of how
samples are split between processes and of the order they are added in; it costs one
double-precision copy of the kernel. (neural-tangents sums in the kernel's dtype.)
"""

from __future__ import annotations

import copy
import numbers
import operator
import threading
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import _checks
from ._checks import show
from ._model import float_parameter, training_mode_layers
from ._outputs import KERNEL_NAMES, canonical_get, empirical_kernel_type, results_type
from ._tree import Flat
from ._types import Axes, Model, NtkImplementation, PyTree, VMapAxes
from .batching import batch
from .distributed import (
    DEFAULT_TIMEOUT,
    all_reduce_sum,
    failure_guard,
    owned_samples,
    world,
)
from .empirical import DEFAULT_NTK_IMPLEMENTATION, empirical_kernel_fn

_GLOBAL_RNG_LOCK = threading.Lock()
"""Held while the global CPU generator is reseeded to draw a sample (one lock per process)."""


def sample_seed(seed: int, s: int) -> int:
    """The seed of Monte Carlo sample ``s`` (see NOTE: [Monte Carlo sample seeds]).

    Example:
        >>> import numpy as np
        >>> sample_seed(0, 3) == int(np.random.SeedSequence([0, 3]).generate_state(2, np.uint64)[0])
        True
    """
    return int(_sample_state(seed, s)[0])


def _sample_state(seed: int, s: int) -> tuple[int, int]:
    words = np.random.SeedSequence([seed, s]).generate_state(2, np.uint64)
    return int(words[0]), int(words[1])


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
    vmap_axes: VMapAxes = None,
    implementation: Union[NtkImplementation, int] = DEFAULT_NTK_IMPLEMENTATION,
    progress: bool = False,
    distributed: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    _owned: Optional[Callable[[int], bool]] = None,
    _reduce: Optional[Callable[[list], list]] = None,
) -> Callable[..., Any]:
    """Returns a function estimating the NNGP and NTK of ``f``'s architecture by Monte Carlo.

    The estimate with ``n`` samples is the average of the empirical kernels
    (:func:`~torchntk.empirical_kernel_fn`) of ``n`` networks with freshly drawn parameters.
    Sample ``s`` depends only on ``(seed, s)`` (NOTE: [Monte Carlo sample seeds] in
    ``torchntk/monte_carlo.py``), so every call, every ``batch_size`` and every device set gives
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
            :func:`torchntk.batching.batch`, which computes each sample's kernel in blocks of
            ``batch_size`` examples (``0``: one block) on ``devices``. The running sum lives
            where the blocks are assembled (on CPU when ``store_on_device=False``).
        trace_axes, diagonal_axes, vmap_axes, implementation: as in
            :func:`~torchntk.empirical_kernel_fn` (the last two only affect the NTK).
        progress: show a ``tqdm`` progress bar over the samples. Default: ``False``.
        distributed: how ranks of an initialised ``torch.distributed`` process group share the
            work: ``"auto"`` or ``"samples"`` (samples round-robin, one all-reduce per estimate),
            ``"blocks"`` (kernel blocks shared out, one all-reduce per sample), ``"off"``.
            Ignored in a single process. See NOTE: [Sharing]. Default: ``"auto"``.
        timeout: seconds a rank waits for the others at a collective before raising
            ``torchntk.distributed.DistributedError``. Default: 300.
        _owned, _reduce: private hooks for ``torchntk.distributed``, see NOTE: [Monte Carlo
            sharding hooks].

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
    for name, hook in (("_owned", _owned), ("_reduce", _reduce)):
        if hook is not None and not callable(hook):
            raise TypeError(f"{where}: `{name}` must be None or a callable, got {show(hook)}.")
    if distributed not in ("auto", "samples", "blocks", "off"):
        raise ValueError(
            f"{where}: `distributed` must be 'auto', 'samples', 'blocks' or 'off', got {show(distributed)}."
        )
    timeout = _checks.timeout_argument(timeout, where)

    kernel_fn = empirical_kernel_fn(f, trace_axes, diagonal_axes, vmap_axes, implementation)
    batched = batch(
        kernel_fn, batch_size=batch_size, device_count=device_count, store_on_device=store_on_device,
        devices=devices, progress=False, distributed="auto" if distributed == "blocks" else "off", timeout=timeout,
    )

    def strategy() -> tuple[Callable[[int], bool], Callable[[list], list], bool]:
        """This process's samples and the reduction, decided at call time (see NOTE: [Sharing])."""
        rank, world_size = world()
        if _owned is not None or _reduce is not None or world_size == 1 or distributed in ("blocks", "off"):
            return (_owned or (lambda s: True)), (_reduce or (lambda total: total)), False
        return owned_samples(rank, world_size), lambda total: all_reduce_sum(total, timeout=timeout), True

    def mc_kernel_fn(x1: PyTree, x2: Optional[PyTree] = None, get: Union[None, str, Sequence[str]] = None, **kwargs: Any) -> Any:
        call_where = "mc_kernel_fn"
        names, bare = canonical_get(get, call_where)
        if "params" in kwargs:
            raise TypeError(
                f"{call_where}: got a `params` argument, but the parameters of every sample are drawn "
                f"by the Monte Carlo kernel function (see `init_fn` of monte_carlo_kernel_fn)."
            )
        sampler = _Sampler.for_model(f, init_fn, seed, x1, call_where)
        structure = _Structure(names, bare)

        def sample_kernel(s: int) -> list[torch.Tensor]:
            # Always a tuple `get`: every leaf is an EmpiricalKernel, renamed when emitted.
            return structure.flatten(batched(x1, x2, names, params=sampler.draw(s), **kwargs))

        owned, reduce, sharing = strategy()
        estimates = _estimates(sample_kernel, counts, owned, reduce, progress, structure.rebuild)
        if sharing:  # an exception on this rank reaches the others at their next all-reduce
            estimates = _guarded(estimates, timeout)
        if generator_mode:
            return estimates
        (estimate,) = estimates
        return estimate

    return mc_kernel_fn


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
            raise ValueError(f"{where}: `n_samples` must contain only ints, got {show(n_samples)} with element {show(item)}.")
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


# ------------------------------------------------------------------------------------------------
# Drawing parameters


class _Sampler:
    """Draws the parameters of sample ``s`` for one call (see NOTE: [Monte Carlo sample seeds])."""

    def __init__(self, draw: Callable[[int], Any]):
        self.draw = draw

    @classmethod
    def for_model(cls, f: Model, init_fn: Optional[Callable], seed: int, x1: Any, where: str) -> "_Sampler":
        """Drawn on CPU, handed over on the device of the module's parameter (functions: of x1)."""
        if not isinstance(f, nn.Module):
            inputs = [leaf for leaf in Flat.of(x1).leaves if isinstance(leaf, torch.Tensor)]
            device = inputs[0].device if inputs else torch.device("cpu")
            return cls(lambda s: _to_device(_draw_functional(init_fn, seed, s, where), device))
        names = [name for name, p in f.named_parameters() if p.requires_grad]
        if not names:
            raise ValueError(
                f"{where}: the module has no parameter with requires_grad=True, so there is nothing to "
                f"redraw or differentiate."
            )
        _reject_random_or_coupled(f, where)
        skeleton = _cpu_copy(f, where)
        devices = {name: p.device for name, p in f.named_parameters()}

        def draw(s: int) -> dict[str, torch.Tensor]:
            if init_fn is None:
                drawn = _draw_by_reset(skeleton, names, seed, s, where)
            else:
                drawn = _draw_module_init_fn(init_fn, skeleton, names, seed, s, where)
            return {name: value.to(devices[name]) for name, value in drawn.items()}

        return cls(draw)


def _to_device(tree: Any, device: torch.device) -> Any:
    flat = Flat.of(tree)
    return flat.rebuild([leaf.to(device) for leaf in flat.leaves])


def _reject_random_or_coupled(module: nn.Module, where: str) -> None:
    coupled, random = training_mode_layers(module)
    layers = [f"{layer} (uses batch statistics)" for layer in coupled]
    layers += [f"{layer} (random in training mode)" for layer in random]
    if layers:
        raise ValueError(
            f"{where}: {', '.join(layers)}: a forward pass that is random or depends on the rest of the "
            f"batch cannot be reproduced per sample or per block. Call model.eval() (BatchNorm "
            f"then needs track_running_stats=True)."
        )


def _cpu_copy(module: nn.Module, where: str) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are on CPU, never copied to its device.

    The ``memo`` of :func:`copy.deepcopy` maps every parameter and buffer to its CPU copy up
    front, so tied parameters stay tied and no device memory is allocated.
    """
    memo: dict[int, Any] = {}
    for param in module.parameters():
        memo[id(param)] = nn.Parameter(param.detach().to("cpu", copy=True), requires_grad=param.requires_grad)
    for buffer in module.buffers():
        memo[id(buffer)] = buffer.detach().to("cpu", copy=True)
    try:
        return copy.deepcopy(module, memo)
    except Exception as error:  # noqa: BLE001 - any failure means the same advice
        raise TypeError(
            f"{where}: could not copy the module to draw its parameters ({type(error).__name__}: {error}). "
            f"Pass a function model with init_fn(generator) instead."
        ) from error


def _reset_methods(module: nn.Module) -> list[Callable[[], Any]]:
    """``reset_parameters`` (else ``_reset_parameters``) of every submodule, children before parents."""
    seen: set[int] = set()
    methods: list[Callable[[], Any]] = []

    def visit(sub: nn.Module) -> None:
        if id(sub) in seen:
            return
        seen.add(id(sub))
        for child in sub.children():
            visit(child)
        method = getattr(sub, "reset_parameters", None)
        if not callable(method):
            method = getattr(sub, "_reset_parameters", None)
        if callable(method):
            methods.append(method)

    visit(module)
    return methods


def _draw_by_reset(skeleton: nn.Module, names: list[str], seed: int, s: int, where: str) -> dict[str, torch.Tensor]:
    seed_s, _ = _sample_state(seed, s)
    params = dict(skeleton.named_parameters())
    with _GLOBAL_RNG_LOCK, torch.random.fork_rng(devices=[]):
        with torch.no_grad():
            for name in names:
                params[name].fill_(float("nan"))
        torch.random.default_generator.manual_seed(seed_s)
        for reset in _reset_methods(skeleton):
            reset()
        drawn = {name: params[name].detach().clone() for name in names}
    missed = [name for name, value in drawn.items() if torch.isnan(value).any()]
    if missed:
        raise ValueError(
            f"{where}: reset_parameters() of the submodules did not redraw the parameter(s) {missed} "
            f"(no reset_parameters() covers them, or it kept part of the old values). Give their "
            f"modules a reset_parameters(), or pass init_fn(module, generator) -> {{name: tensor}} "
            f"to monte_carlo_kernel_fn."
        )
    return drawn


def _draw_module_init_fn(init_fn: Callable, skeleton: nn.Module, names: list[str], seed: int, s: int, where: str) -> dict[str, torch.Tensor]:
    values = _call_init_fn(init_fn, (skeleton,), seed, s)
    if not isinstance(values, Mapping):
        raise TypeError(
            f"{where}: `init_fn(module, generator)` must return a mapping from parameter name to "
            f"tensor, got {show(values)}."
        )
    missing = [name for name in names if name not in values]
    unknown = sorted(str(name) for name in values if name not in names)
    if missing or unknown:
        problems = []
        if missing:
            problems.append(f"no value for {missing}")
        if unknown:
            problems.append(f"names that are not differentiated parameters: {unknown}")
        raise ValueError(
            f"{where}: `init_fn(module, generator)` returned {' and '.join(problems)}; expected exactly "
            f"the parameters with requires_grad=True: {names}."
        )
    reference = dict(skeleton.named_parameters())
    drawn = {}
    for name in names:
        value = float_parameter(values[name], f"`init_fn(module, generator)[{name!r}]`", where)
        if value.shape != reference[name].shape:
            raise ValueError(
                f"{where}: `init_fn(module, generator)[{name!r}]` has shape {tuple(value.shape)}, but the "
                f"parameter has shape {tuple(reference[name].shape)}."
            )
        drawn[name] = value.detach().clone()
    return drawn


def _draw_functional(init_fn: Callable, seed: int, s: int, where: str) -> Any:
    params = _call_init_fn(init_fn, (), seed, s)
    flat = Flat.of(params)
    if not flat.leaves:
        raise ValueError(f"{where}: `init_fn(generator)` returned {show(params)}, which has no tensors.")
    for index, leaf in enumerate(flat.leaves):
        if not isinstance(leaf, torch.Tensor) or not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                f"{where}: `init_fn(generator)` must return a pytree of floating-point tensors; leaf "
                f"{index} is {show(leaf)}."
            )
    return flat.rebuild([leaf.detach() for leaf in flat.leaves])


def _call_init_fn(init_fn: Callable, args: tuple, seed: int, s: int) -> Any:
    seed_s, global_seed = _sample_state(seed, s)
    generator = torch.Generator("cpu").manual_seed(seed_s)
    with _GLOBAL_RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(global_seed)
        return init_fn(*args, generator)


# ------------------------------------------------------------------------------------------------
# The sample loop


def _guarded(estimates: Iterator[Any], timeout: float) -> Iterator[Any]:
    with failure_guard(timeout=timeout):
        yield from estimates


def _estimates(
    sample_kernel: Callable[[int], list[torch.Tensor]],
    counts: tuple[int, ...],
    owned: Callable[[int], bool],
    reduce: Callable[[list], list],
    progress: bool,
    finish: Callable[[list[torch.Tensor]], Any],
) -> Iterator[Any]:
    """Yields the estimate at every count in ``counts`` (ascending) from one running sum.

    ``finish`` turns the list of averaged leaves into the user-facing result.
    """
    total_owned = sum(1 for s in range(counts[-1]) if owned(s))
    bar = _progress_bar(total_owned) if progress else None
    running: Optional[list[torch.Tensor]] = None
    template: Optional[list[torch.Tensor]] = None
    dtypes: Optional[list[torch.dtype]] = None
    checkpoints = set(counts)
    try:
        for s in range(counts[-1]):
            if owned(s):
                leaves = sample_kernel(s)
                if running is None:
                    dtypes = [leaf.dtype for leaf in leaves]
                    running = [leaf.to(_accumulation_dtype(leaf.dtype), copy=True) for leaf in leaves]
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
                    template = [torch.zeros_like(leaf, dtype=_accumulation_dtype(leaf.dtype)) for leaf in leaves]
                local = [zeros.clone() for zeros in template]
            else:
                local = [total.clone() for total in running]
            summed = reduce(local)
            yield finish([(total / n).to(dtype) for total, dtype in zip(summed, dtypes)])
    finally:
        if bar is not None:
            bar.close()


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype.is_complex else torch.float64


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Monte Carlo samples", unit="sample")


# ------------------------------------------------------------------------------------------------
# Results


def monte_carlo_kernel_type(fields: tuple[str, ...]) -> type:
    """The ``MonteCarloKernel`` namedtuple class with these fields, in this order."""
    return results_type("MonteCarloKernel", fields)


class _Structure:
    """The tree of one call's per-sample results, to rebuild the averaged leaves."""

    def __init__(self, names: tuple[str, ...], bare: bool):
        self.names = names
        self.bare = bare
        self.flat: Optional[Flat] = None

    def flatten(self, result: Any) -> list[torch.Tensor]:
        flat = Flat.of(result)
        if self.flat is None:
            self.flat = flat
        elif not flat.same_structure(self.flat):
            raise AssertionError("the kernel function returned results of different structures for two samples")
        return list(flat.leaves)

    def rebuild(self, leaves: list[torch.Tensor]) -> Any:
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
