"""Kernel calls captured into one graph and compiled: the ``compile`` option of the NTK builders.

NOTE: [Captured kernels]
An eager kernel call pays Python and the dispatcher for every operation of every transform
(``vmap``, ``vjp``, the recorder of implementation 3, module calls): about 3 ms a call on a
784-512-512-10 MLP, where its matrix products take 0.7 ms. With ``compile`` set, a kernel function
removes that cost from repeated calls:

1. The first call for a :func:`guard_key` (argument shapes, strides, dtypes, devices, non-tensor
   values and aliasing; autocast, the default dtype and the precision mode; the module's structure
   fingerprint, train/eval modes and ``requires_grad`` flags) runs eagerly with every check, as
   without ``compile``.
2. The same computation without the per-call checks is traced on real tensors into one graph of
   aten operations (``make_fx``). Its inputs are the module's parameters and buffers and the call's
   tensors, so later values (an optimiser step, new inputs) flow through the graph; nothing of
   them is baked in. While tracing, :class:`_ValueDependence` refuses operations whose result
   depends on tensor values (``.item()``, ``if x.sum() > 0``, ``nonzero``) or on random state
   (dropout in training mode): a graph would fix the branch taken or the random numbers drawn.
3. The graph is compiled with ``torch.compile(backend=...)``, run on the same arguments and
   compared with the eager result; it is kept only if they agree.
4. Later calls with the same key run the compiled graph. A result that is not finite is computed
   again eagerly, so NaN/Inf outputs still raise the eager path's clear error; a replay that
   raises drops its graph (warned) and the call is computed eagerly.

What a replay does not do: the per-call output check of NOTE: [Checking vmap_axes] (made on the
capture call, once per key, like the derivative check), and the re-planning of implementation 3
when a model changes the operations it runs (its structure is part of the key). A forward pass
whose operations depend on anything else (a global variable, a closure's Python value) must not
be used with ``compile``. Where capture is refused or fails, a RuntimeWarning says why and calls
with that key stay eager; a backend that fails to compile leaves the graph uncompiled (warned).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .._memory import NEEDS_BLOCKS
from .._model.fingerprint import structure_fingerprint
from .._utils.bounded_cache import BoundedCache
from .._utils.capturing import capturing
from .._utils.checks import show, user_stacklevel
from .._utils.precision import requested_mode

_REMEMBERED = 8
"""Captured graphs a kernel function keeps (the least recently used is dropped), as
``torch.compile``'s default cache of 8 graphs per function."""

_REFUSED_TAGS = {
    torch.Tag.data_dependent_output: "its result is a Python value read from a tensor",
    torch.Tag.dynamic_output_shape: "its output shape depends on tensor values",
    torch.Tag.nondeterministic_seeded: "it draws random numbers",
}

_CAPTURES = 4 * _REMEMBERED
"""Captures a kernel function makes before it stops capturing: more mean that its arguments change
every few calls in a way the key sees (a Python scalar that varies, an object without a stable
``repr``), and each capture costs a compilation."""

_AGREEMENT_EPSILONS = 1000
"""The largest difference between the captured and the eager kernel for the graph to be kept, in
machine epsilons of the kernel's dtype (at most 1e-2), relative to its largest entry: float32 1.2e-4,
far above what a compiler's reassociation changes (1e-6) and far below a graph that computes
something else."""


class CaptureRefused(Exception):
    """The computation cannot be replayed from a graph; the message says which operation and why."""


def compile_argument(value: Any, where: str) -> Optional[str]:
    """The ``torch.compile`` backend named by a builder's ``compile`` argument, or None (eager).

    Raises:
        TypeError: neither a bool nor a string.
        ValueError: a string that names no registered ``torch.compile`` backend.
    """
    if value is False:
        return None
    if value is True:
        return "inductor"
    if not isinstance(value, str):
        raise TypeError(
            f"{where}: `compile` must be True, False or the name of a torch.compile backend, got {show(value)}."
        )
    backends = torch._dynamo.list_backends(exclude_tags=())
    if value not in backends:
        raise ValueError(
            f"{where}: `compile` names no torch.compile backend: {value!r}; available: {', '.join(sorted(backends))}."
        )
    return value


@dataclass(frozen=True)
class _Arguments:
    """A call's arguments flattened once, and the graph's inputs: the module's parameters, its
    buffers, then the call's tensors."""

    leaves: list
    spec: pytree.TreeSpec
    parameters: list[torch.Tensor]
    inputs: list[torch.Tensor]
    state_size: int  # parameters and buffers, at the front of ``inputs``

    @classmethod
    def of(cls, model: Any, arguments: Any) -> "_Arguments":
        leaves, spec = pytree.tree_flatten(arguments)
        parameters, buffers = [], []
        if isinstance(model, torch.nn.Module):
            parameters = list(model.parameters())
            buffers = [buffer for buffer in model.buffers() if buffer is not None]
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        return cls(leaves, spec, parameters, [*parameters, *buffers, *tensors], len(parameters) + len(buffers))

    def rebuilt(self, inputs: tuple) -> Any:
        """The arguments with the tensors replaced by ``inputs`` (as :attr:`inputs` orders them)."""
        replacements = iter(inputs[self.state_size:])
        leaves = [next(replacements) if isinstance(leaf, torch.Tensor) else leaf for leaf in self.leaves]
        return pytree.tree_unflatten(leaves, self.spec)


def guard_key(model: Any, flat: _Arguments) -> tuple:
    """What a captured graph depends on besides tensor values: see NOTE: [Captured kernels].

    Which tensors are the same object is part of it: a graph traced with ``x2 is x1`` reads one
    input for both, so it must not serve calls with two different tensors.
    """
    described = tuple(
        (tuple(leaf.shape), leaf.stride() if leaf.layout == torch.strided else leaf.layout, leaf.dtype, leaf.device,
         leaf.requires_grad)
        if isinstance(leaf, torch.Tensor) else (type(leaf), repr(leaf))
        for leaf in flat.leaves
    )
    first_seen: dict[int, int] = {}
    aliases = tuple(first_seen.setdefault(id(tensor), position) for position, tensor in enumerate(flat.inputs))
    call = (str(flat.spec), described, aliases, _global_settings())
    if not isinstance(model, torch.nn.Module):
        return (*call, id(model))
    modes = tuple(module.training for module in model.modules())
    flags = tuple(param.requires_grad for param in flat.parameters)
    return (*call, structure_fingerprint(model), modes, flags)


def _global_settings() -> tuple:
    """PyTorch's settings that a trace fixes: autocast (its casts are recorded), the default dtype
    (factory functions) and torchntk's precision mode (inductor may choose kernels by it)."""
    return (_autocast("cpu"), _autocast("cuda"), torch.get_default_dtype(), requested_mode())


def _autocast(device_type: str) -> tuple:
    try:
        enabled, dtype = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except (TypeError, AttributeError):  # PyTorch before 2.4: per-device functions
        cpu = device_type == "cpu"
        enabled = torch.is_autocast_cpu_enabled() if cpu else torch.is_autocast_enabled()
        dtype = torch.get_autocast_cpu_dtype() if cpu else torch.get_autocast_gpu_dtype()
    return (enabled, dtype if enabled else None)


class _ValueDependence(TorchDispatchMode):
    """Raises :class:`CaptureRefused` at the first operation a graph cannot replay faithfully."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for tag, why in _REFUSED_TAGS.items():
            if tag not in func.tags:
                continue
            if tag is torch.Tag.nondeterministic_seeded and _without_dropout(func, args, kwargs):
                continue
            raise CaptureRefused(f"the computation calls {func} and {why}")
        return func(*args, **kwargs)


def _without_dropout(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a random operation draws nothing here: attention kernels called with ``dropout_p=0``."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.name == "dropout_p":
            value = args[position] if position < len(args) else kwargs.get("dropout_p", argument.default_value)
            return value == 0
    return False


@dataclass
class _Captured:
    run: Callable[..., list]  # (*state, *tensors) -> kernel leaves + [all finite]
    output_spec: pytree.TreeSpec


class CapturedCalls:
    """The captured graphs of one kernel function, keyed by :func:`guard_key`."""

    def __init__(self, backend: str, model: Any, where: str):
        self.backend = backend
        self.model = model
        self.where = where
        self._graphs = BoundedCache(_REMEMBERED)
        self._refused = BoundedCache(_REMEMBERED)  # keys that stay eager
        self._captures = 0

    def __call__(self, arguments: tuple, eager: Callable[..., Any], unchecked: Callable[..., Any]) -> Any:
        """``eager(*arguments)``, or its captured graph's replay; ``unchecked(*arguments)`` is the
        same computation without per-call checks (what is captured)."""
        flat = _Arguments.of(self.model, arguments)
        key = guard_key(self.model, flat)
        captured = self._graphs.get(key)
        if captured is None:
            result = eager(*arguments)
            if result is NEEDS_BLOCKS:  # NOTE: [Budgets of callers]: nothing was computed
                return result
            if key not in self._refused and self._captures < _CAPTURES and _all_finite(result):
                self._captures += 1
                if self._captures == _CAPTURES:
                    warnings.warn(
                        f"{self.where}: compile: {_CAPTURES} captures so far; the arguments change between "
                        f"calls in a way the capture key sees (docs/compile.md lists it: a Python value that "
                        f"varies, an object whose repr changes, new shapes). This is the last capture; calls "
                        f"with other keys are computed eagerly.", RuntimeWarning, stacklevel=user_stacklevel(),
                    )
                self._capture(key, flat, unchecked, result)
            return result
        try:
            with torch.no_grad():
                *outputs, finite = captured.run(*flat.inputs)
        except Exception as error:  # a recompilation the backend could not make: eager, as without compile
            self._graphs.pop(key, None)
            self._refuse(key, f"replaying the captured graph failed ({type(error).__name__}: {error})")
            return eager(*arguments)
        if not bool(finite):
            return eager(*arguments)  # raises the eager check's error, or returns the same non-finite kernel
        return pytree.tree_unflatten(outputs, captured.output_spec)

    def _capture(self, key: tuple, flat: _Arguments, unchecked: Callable[..., Any], expected: Any) -> None:
        from torch.fx.experimental.proxy_tensor import make_fx

        expected_leaves, output_spec = pytree.tree_flatten(expected)

        def traced(*inputs: torch.Tensor) -> list:
            with capturing(), _ValueDependence():
                outputs = pytree.tree_leaves(unchecked(*flat.rebuilt(inputs)))
            finite = torch.stack([torch.isfinite(output).all() for output in outputs]).all()
            return [*outputs, finite]

        inputs = flat.inputs
        try:
            graph = make_fx(traced, tracing_mode="real")(*inputs)
        except CaptureRefused as refusal:
            return self._refuse(key, str(refusal))
        except Exception as error:  # a failure to trace is no reason to fail the call
            return self._refuse(key, f"tracing the computation failed ({type(error).__name__}: {error})")
        graph.graph.eliminate_dead_code()
        graph.recompile()
        run = self._compiled(graph)
        with torch.no_grad():
            try:
                *outputs, _ = run(*inputs)
            except Exception as error:
                warnings.warn(
                    f"{self.where}: compile: the {self.backend!r} backend failed ({type(error).__name__}: {error}); "
                    f"the captured graph runs uncompiled.", RuntimeWarning, stacklevel=user_stacklevel(),
                )
                run = graph
                *outputs, _ = run(*inputs)
        difference = _largest_difference(outputs, expected_leaves)
        if difference > _agreement(expected_leaves):
            return self._refuse(
                key, f"the captured graph's kernel differs from the eager one by {difference:.1e} of its largest entry"
            )
        self._graphs[key] = _Captured(run, output_spec)

    def _compiled(self, graph: torch.fx.GraphModule) -> Callable[..., list]:
        return torch.compile(graph, backend=self.backend, dynamic=False)

    def _refuse(self, key: tuple, reason: str) -> None:
        self._refused[key] = True
        warnings.warn(
            f"{self.where}: compile: {reason}; calls with these argument shapes are computed eagerly. "
            f"A model whose operations depend on tensor values or random numbers cannot be captured "
            f"(docs/compile.md).", RuntimeWarning, stacklevel=user_stacklevel(),
        )


def _all_finite(result: Any) -> bool:
    """Whether every tensor of a kernel pytree is finite (a graph is compared only with such a kernel)."""
    leaves = pytree.tree_leaves(result)
    return all(bool(torch.isfinite(leaf).all()) for leaf in leaves if isinstance(leaf, torch.Tensor))


def _agreement(kernels: list) -> float:
    """The tolerance of :data:`_AGREEMENT_EPSILONS` for the least precise of ``kernels``."""
    inexact = [kernel for kernel in kernels if kernel.is_floating_point() or kernel.is_complex()]
    epsilons = [torch.finfo(kernel.dtype).eps for kernel in inexact]
    return min(_AGREEMENT_EPSILONS * max(epsilons, default=0.0), 1e-2)


def _largest_difference(outputs: list, expected: list) -> float:
    """The largest absolute difference of finite kernels, relative to the largest absolute expected
    entry; inf where the structures or shapes differ or an output is not finite."""
    if len(outputs) != len(expected):
        return float("inf")
    largest = 0.0
    for output, reference in zip(outputs, expected):
        if not isinstance(reference, torch.Tensor) or output.shape != reference.shape:
            return float("inf")
        if reference.numel() == 0:
            continue
        scale = reference.abs().max().item() or 1.0
        gap = (output - reference).abs().max().item()
        largest = max(largest, gap / scale if gap == gap else float("inf"))
    return largest
