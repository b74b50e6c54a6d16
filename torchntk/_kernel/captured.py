"""Kernel calls captured into one graph and compiled: the ``compile`` option of the NTK builders.

NOTE: [Captured kernels]
An eager kernel call pays Python and the dispatcher for every operation of every transform
(``vmap``, ``vjp``, the recorder of implementation 3, module calls): about 3 ms a call on a
784-512-512-10 MLP, where its matrix products take 0.7 ms. With ``compile`` set, a kernel function
removes that cost from repeated calls:

1. The first call for a :func:`guard_key` (argument shapes, strides, dtypes, devices, plain non-tensor
   values, other non-tensor leaves by identity, and aliasing; autocast, the default dtype and the precision mode; the module's structure
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

On CUDA, inductor's graphs replay as CUDA graphs (NOTE: [CUDA graph replays]).

What a replay does not do: the per-call output check of NOTE: [Checking vmap_axes] (made on the
capture call, once per key, like the derivative check), and the re-planning of implementation 3
when a model changes the operations it runs (its structure is part of the key). A forward pass
whose operations depend on anything else (a global variable, a closure's Python value) must not
be used with ``compile``. Where capture is refused or fails, a RuntimeWarning says why and calls
with that key stay eager; a backend that fails to compile leaves the graph uncompiled (warned).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from .._memory import NEEDS_BLOCKS
from .._model.fingerprint import FingerprintMemo, structure_fingerprint
from .._utils.bounded_cache import BoundedCache
from .._utils.capturing import CaptureRefused, capturing
from .._utils.checks import show, user_stacklevel
from .._utils.precision import requested_mode
from .._utils.values import leaf_key

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


# NOTE: [CUDA graph replays]
# A replay of a compiled graph still launches each of its kernels from the host: on a GPU, where
# the kernels of a small model take microseconds, the launches are the call. A CUDA graph records
# the launches once and replays them with one. torch.compile's inductor does this in its
# "reduce-overhead" mode (CUDA graph trees: static input buffers that each replay copies the
# call's tensors into, a private memory pool, and its own checks of what a graph cannot hold), so
# torchntk asks for that mode where the captured graph's inputs are all on CUDA and the user named
# no mode, instead of recording graphs of its own. What that mode requires of its caller:
#
# * each replay begins a new step (``torch.compiler.cudagraph_mark_step_begin``), and the outputs,
#   which live in the graph's pool and are overwritten by the next replay, are cloned before they
#   are returned (one copy of the kernel, small next to the launches saved);
# * the graph is recorded on its second run and replayed from its third, so the capture runs it
#   three times, and compares the third run, a replay, with the eager kernel;
# * where inductor does not record a CUDA graph (a CPU tensor among the inputs, an operation that
#   synchronises or cannot be captured), it runs its compiled kernels instead and says why in its
#   log: torchntk reads that (its skip counter and message) at the capture and warns once per key,
#   and a failure of the mode itself falls back to the default mode, warned, then to the graph
#   uncompiled, as for any backend.
#
# The user's ``mode`` (``compile={"mode": ...}``) is taken as given, "max-autotune-no-cudagraphs"
# being the way to keep CUDA graphs out.

_CUDA_GRAPH_OPTION = "triton.cudagraphs"


@dataclass(frozen=True)
class CompileOptions:
    """What ``compile=`` asks for: a ``torch.compile`` backend and, for inductor, a mode (None: the
    default mode, and "reduce-overhead" on CUDA, NOTE: [CUDA graph replays])."""

    backend: str
    mode: Optional[str] = None

    def mode_for(self, cuda: bool) -> Optional[str]:
        """The mode to compile with, for inputs on CUDA or not."""
        if self.mode is None and cuda and self.backend == "inductor":
            return "reduce-overhead"
        return self.mode

    @staticmethod
    def records_cuda_graphs(mode: Optional[str]) -> bool:
        """Whether inductor records CUDA graphs in ``mode``."""
        return mode is not None and bool(_inductor_modes().get(mode, {}).get(_CUDA_GRAPH_OPTION, False))


def _inductor_modes() -> dict:
    """inductor's modes and the options each sets (``torch._inductor.list_mode_options``)."""
    try:
        return dict(torch._inductor.list_mode_options())
    except (AttributeError, TypeError):  # not this PyTorch's API: the modes torch.compile documents
        return {"default": {}, "reduce-overhead": {_CUDA_GRAPH_OPTION: True}, "max-autotune-no-cudagraphs": {},
                "max-autotune": {_CUDA_GRAPH_OPTION: True}}


def compile_argument(value: Any, where: str) -> Optional[CompileOptions]:
    """What a builder's ``compile`` argument asks for, or None (eager).

    ``True`` is inductor; a string names a backend; a mapping holds ``torch.compile``'s ``backend``
    (default ``"inductor"``) and ``mode`` (inductor's).

    Raises:
        TypeError: neither a bool, a string nor a mapping; a mapping with other keys.
        ValueError: a string that names no registered ``torch.compile`` backend; a mode that is not
            inductor's, or given for another backend.
    """
    if value is False:
        return None
    if value is True:
        return CompileOptions("inductor")
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"backend", "mode"}, key=str)
        if unknown:
            raise TypeError(
                f"{where}: `compile` as a mapping takes the keys 'backend' and 'mode' of torch.compile, got "
                f"{', '.join(map(repr, unknown))}."
            )
        options = CompileOptions(_backend(value.get("backend", "inductor"), where), value.get("mode"))
        if options.mode is not None:
            modes = _inductor_modes()
            if options.backend != "inductor" or options.mode not in modes:
                raise ValueError(
                    f"{where}: `compile` mode {options.mode!r} with backend {options.backend!r}: modes are "
                    f"inductor's ({', '.join(map(repr, modes))})."
                )
        return options
    if not isinstance(value, str):
        raise TypeError(
            f"{where}: `compile` must be True, False, the name of a torch.compile backend or a mapping of its "
            f"'backend' and 'mode', got {show(value)}."
        )
    return CompileOptions(_backend(value, where))


def _backend(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{where}: `compile`'s backend must be the name of a torch.compile backend, got {show(value)}.")
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


def guard_key(model: Any, flat: _Arguments, memo: FingerprintMemo) -> tuple:
    """What a captured graph depends on besides tensor values: see NOTE: [Captured kernels].

    Which tensors are the same object is part of it: a graph traced with ``x2 is x1`` reads one
    input for both, so it must not serve calls with two different tensors.
    """
    described = tuple(
        (tuple(leaf.shape), leaf.stride() if leaf.layout == torch.strided else leaf.layout, leaf.dtype, leaf.device,
         leaf.requires_grad)
        if isinstance(leaf, torch.Tensor) else leaf_key(leaf)
        for leaf in flat.leaves
    )
    first_seen: dict[int, int] = {}
    aliases = tuple(first_seen.setdefault(id(tensor), position) for position, tensor in enumerate(flat.inputs))
    call = (str(flat.spec), described, aliases, _global_settings())
    if not isinstance(model, torch.nn.Module):
        return (*call, id(model))
    modes: list[bool] = []
    structure = structure_fingerprint(model, modes, memo)  # the modes from the same walk (or last walk)
    flags = tuple(param.requires_grad for param in flat.parameters)
    return (*call, memo.hashed(structure), tuple(modes), flags)  # NOTE: [Unchanged modules]


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
    cuda_graphs: bool = False  # replayed as a CUDA graph (NOTE: [CUDA graph replays])

    def __call__(self, inputs: list) -> list:
        """The graph's outputs on ``inputs``: the kernel leaves, then whether all are finite."""
        if not self.cuda_graphs:
            return self.run(*inputs)
        torch.compiler.cudagraph_mark_step_begin()
        *outputs, finite = self.run(*inputs)
        # in the graph's pool, overwritten by the next replay; the flag is read before that
        return [*(output.clone() for output in outputs), finite]


class CapturedCalls:
    """The captured graphs of one kernel function, keyed by :func:`guard_key`."""

    def __init__(self, options: CompileOptions, model: Any, where: str):
        self.options = options
        self.backend = options.backend
        self.model = model
        self.where = where
        self._graphs = BoundedCache(_REMEMBERED)
        self._refused = BoundedCache(_REMEMBERED)  # keys that stay eager
        self._captures = 0
        self._fingerprints = FingerprintMemo()

    def __call__(self, arguments: tuple, eager: Callable[..., Any], unchecked: Callable[..., Any]) -> Any:
        """``eager(*arguments)``, or its captured graph's replay; ``unchecked(*arguments)`` is the
        same computation without per-call checks (what is captured)."""
        flat = _Arguments.of(self.model, arguments)
        key = guard_key(self.model, flat, self._fingerprints)
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
                *outputs, finite = captured(flat.inputs)
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
        captured, outputs = self._compiled_and_run(graph, inputs, output_spec)
        difference = _largest_difference(outputs, expected_leaves)
        if difference > _agreement(expected_leaves):
            return self._refuse(
                key, f"the captured graph's kernel differs from the eager one by {difference:.1e} of its largest entry"
            )
        self._graphs[key] = captured

    def _compiled_and_run(
        self, graph: torch.fx.GraphModule, inputs: list, output_spec: pytree.TreeSpec
    ) -> tuple[_Captured, list]:
        """The graph compiled, in CUDA graphs where they apply (NOTE: [CUDA graph replays]), and the
        kernel leaves of its run on ``inputs`` (with CUDA graphs, of its first replay); on a failure,
        compiled without CUDA graphs, then uncompiled."""
        cuda = _on_cuda(inputs)
        mode = self.options.mode_for(cuda)
        if cuda and CompileOptions.records_cuda_graphs(mode):
            try:
                with _CudaGraphSkips() as skips, torch.no_grad():
                    captured = _Captured(self._compiled(graph, mode), output_spec, cuda_graphs=True)
                    for _ in range(3):  # a warm-up run, the run that records the graph, a replay
                        *outputs, _ = captured(inputs)
                if skips.reason is not None:
                    warnings.warn(
                        f"{self.where}: compile: inductor does not replay this graph as a CUDA graph ({skips.reason}); "
                        f"it replays its compiled kernels, each launched from the host.", RuntimeWarning,
                        stacklevel=user_stacklevel(),
                    )
                return captured, outputs
            except Exception as error:
                warnings.warn(
                    f"{self.where}: compile: mode {mode!r} (CUDA graphs) failed ({type(error).__name__}: {error}); "
                    f"the graph is compiled without CUDA graphs.", RuntimeWarning, stacklevel=user_stacklevel(),
                )
                mode = "max-autotune-no-cudagraphs" if mode == "max-autotune" else None
        run = self._compiled(graph, mode)
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
        return _Captured(run, output_spec), outputs

    def _compiled(self, graph: torch.fx.GraphModule, mode: Optional[str]) -> Callable[..., list]:
        return torch.compile(graph, backend=self.backend, mode=mode, dynamic=False)

    def _refuse(self, key: tuple, reason: str) -> None:
        self._refused[key] = True
        warnings.warn(
            f"{self.where}: compile: {reason}; calls with these argument shapes are computed eagerly. "
            f"A model whose operations depend on tensor values or random numbers cannot be captured "
            f"(docs/compile.md).", RuntimeWarning, stacklevel=user_stacklevel(),
        )


def _on_cuda(inputs: list) -> bool:
    """Whether a graph's inputs are all on CUDA devices (what CUDA graphs need)."""
    return bool(inputs) and all(tensor.is_cuda for tensor in inputs)


class _CudaGraphSkips:
    """Within the block, whether inductor declined to record a CUDA graph, and why: its skip counter,
    and the message it logs (NOTE: [CUDA graph replays]). ``reason`` is None where none was declined."""

    def __init__(self) -> None:
        self.reason: Optional[str] = None
        self._messages: list[str] = []
        self._log: Any = None
        self._before = 0

    def __enter__(self) -> "_CudaGraphSkips":
        try:
            from torch._dynamo.utils import counters
            from torch._inductor import cudagraph_utils

            self._counters = counters
            self._before = counters["inductor"]["cudagraph_skips"]
            self._log = cudagraph_utils.cudagraphs_log
        except (ImportError, AttributeError):  # another PyTorch's internals: nothing to read
            self._counters = None
        if self._log is not None:
            self._handler = _Collect(self._messages)
            self._log.addHandler(self._handler)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self._log is not None:
            self._log.removeHandler(self._handler)
        skipped = self._counters is not None and self._counters["inductor"]["cudagraph_skips"] > self._before
        if skipped or self._messages:
            self.reason = "; ".join(dict.fromkeys(self._messages)) or "a skip counted by inductor"


class _Collect(logging.Handler):
    """A logging handler that keeps the messages it receives."""

    def __init__(self, messages: list[str]) -> None:
        super().__init__(logging.DEBUG)
        self._messages = messages

    def emit(self, record: logging.LogRecord) -> None:
        self._messages.append(record.getMessage())


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
