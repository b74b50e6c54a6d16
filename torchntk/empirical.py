"""Empirical NNGP and NTK kernels of ``nn.Module`` and functional models.

Every builder takes the model ``f``: an ``nn.Module`` (its parameters with
``requires_grad=True`` are differentiated; frozen parameters and buffers are constants) or a
function ``f(params, x, **kwargs)`` of a pytree of parameter tensors. The kernel functions they
return take ``(x1, x2=None, params=None, **kwargs)``; ``x2=None`` means ``x2 = x1`` and reuses the
x1 work. Keyword arguments given as a 2-tuple are split: the first element goes with x1, the
second with x2.

Kernel shapes follow NOTE: [Kernel layout] in ``torchntk/_layout.py`` and the "Kernel layout"
page of the documentation: output axes in order, kept axes doubled (x1 then x2), diagonal axes
once, traced axes averaged away. Pytree outputs give one kernel per output leaf.

Example:
    >>> import torch, torchntk
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    >>> x1, x2 = torch.randn(5, 3), torch.randn(4, 3)
    >>> torchntk.empirical_ntk_fn(model, vmap_axes=0)(x1, x2).shape           # traced logits
    torch.Size([5, 4])
    >>> torchntk.empirical_ntk_fn(model, trace_axes=())(x1, x2).shape         # full kernel
    torch.Size([5, 4, 2, 2])
    >>> torchntk.empirical_nngp_fn(model, diagonal_axes=(0,))(x1).shape      # per-example
    torch.Size([5])
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch.func import jvp, vjp

from . import _checks
from ._block_source import BlockRequest, BlockSource
from ._bounded_cache import BoundedCache
from ._call import KernelCall, prepare_call
from ._example_loop import ExampleLoops
from ._fingerprint import structure_fingerprint
from ._implementations import BLOCK_PLANS, IMPLEMENTATIONS
from ._implementations.auto import AutoChoice, AutoSelector
from ._implementations.nngp import nngp
from ._implementations.structured import StructuredDerivatives, StructuredOptions
from ._kernel_spec import KernelFnSpec, attach
from ._model import functional_model, warn_training_mode
from ._outputs import canonical_get, combine, output_fn_argument
from ._per_example import VmapLimitation
from ._threads import FORWARD_MODE_LOCK, serialised
from ._torch_errors import explained
from ._tree import Flat, describe, is_all_none
from ._types import Axes, Model, NtkImplementation, PyTree, VMapAxes
from ._unfused import forward_mode_kernels
from ._vmap_axes import ParsedVmapAxes, parse_vmap_axes, split_kwargs

DEFAULT_NTK_IMPLEMENTATION = NtkImplementation.JACOBIAN_CONTRACTION
"""Jacobian contraction: exact, general, and the fastest of 1 and 2 for traced kernels."""

KernelFn = Callable[..., PyTree]

_CHECKED_SHAPES = 64
"""Input shapes (and module structures) whose derivatives were checked, kept per kernel function."""

_FORWARD_RUN = 256
"""Examples per whole-batch forward pass of a batched call (``open_blocks``), at least the block
size. A forward pass without gradients holds a small part of what an example's derivatives
need, so runs this long bound memory without paying a model call per small block (32 calls of
16 examples cost 10 ms more than 2 of 256 on the benchmark MLP)."""


@dataclass(frozen=True)
class _NtkSettings:
    """Builder arguments, validated once when the kernel function is built."""

    f: Model
    trace_axes: tuple[int, ...]
    diagonal_axes: tuple[int, ...]
    vmap_axes: ParsedVmapAxes
    implementation: NtkImplementation
    chunk_size: Optional[int]
    check_vmap_axes: bool
    structured: StructuredDerivatives
    auto: Optional[AutoSelector]
    arguments: dict  # as given, to build the same kernel function around another copy of the model
    derivatives_checked: BoundedCache = field(default_factory=lambda: BoundedCache(_CHECKED_SHAPES))
    example_loops: ExampleLoops = field(default_factory=ExampleLoops)
    output_fn: Optional[Callable] = None  # normalised by output_fn_argument

    @classmethod
    def validate(
        cls, f, trace_axes, diagonal_axes, vmap_axes, implementation, chunk_size, check_vmap_axes, structured, output_fn,
        where,
    ):
        _checks.callable_model_argument(f, where)
        chosen = _checks.implementation_argument(implementation, where)
        arguments = dict(
            trace_axes=trace_axes, diagonal_axes=diagonal_axes, vmap_axes=vmap_axes, implementation=implementation,
            chunk_size=chunk_size, check_vmap_axes=check_vmap_axes, output_fn=output_fn, **structured,
        )
        options = _structured_options(structured, chosen, where)
        structured = StructuredDerivatives(options)
        implementations = dict(IMPLEMENTATIONS)
        implementations[NtkImplementation.STRUCTURED_DERIVATIVES] = structured
        auto = AutoSelector(implementations) if chosen == NtkImplementation.AUTO else None
        return cls(
            f,
            _checks.axes_argument(trace_axes, "trace_axes", where),
            _checks.axes_argument(diagonal_axes, "diagonal_axes", where),
            parse_vmap_axes(vmap_axes, where),
            chosen,
            _checks.chunk_size_argument(chunk_size, where),
            _checks.bool_argument(check_vmap_axes, "check_vmap_axes", where),
            structured,
            auto,
            arguments,
            output_fn=output_fn_argument(output_fn, where),
        )

    def prepare(
        self, x1: Any, x2: Any, params: Any, kwargs: dict, where: str, *, for_ntk: bool = True,
        computes_ntk: bool = True, forward_run_length: Optional[int] = None, shape_key: Optional[tuple] = None,
    ) -> KernelCall:
        """Validates one call; ``vmap_axes`` only matter (and are only checked) for the NTK
        (``for_ntk``), or for a batched NNGP (``computes_ntk=False``: the check cannot wait for
        the structured pass, which will not run).

        The derivative part of NOTE: [Checking vmap_axes] runs once per input shapes and module
        structure: what it catches (a PyTorch vmap bug, coupling in the backward pass) does not
        depend on the values, and it costs as much as a small kernel (about 4 ms on the benchmark
        MLP). The output check runs on every call. ``shape_key``: the caller's
        :func:`_shape_key` of these arguments, if it has one."""
        key = loop_key = None
        if for_ntk and self.maps_examples:
            shape_key = shape_key or _shape_key(x1, x2, params, kwargs)
            loop_key = shape_key
            if self.check_vmap_axes:
                key = (shape_key, _structure_key(self.f))

        def prepare(example_loop: bool) -> KernelCall:
            return prepare_call(
                self.f, x1, x2, params, kwargs, where=where, trace_axes=self.trace_axes,
                diagonal_axes=self.diagonal_axes, vmap_axes=self.vmap_axes if for_ntk else None,
                check_vmap_axes=self.check_vmap_axes, chunk_size=self.chunk_size,
                defer_vmap_check=computes_ntk and self.implementation == NtkImplementation.STRUCTURED_DERIVATIVES,
                forward_run_length=forward_run_length, for_ntk=for_ntk and computes_ntk,
                check_derivatives=key is not None and key not in self.derivatives_checked,
                example_loop=example_loop, output_fn=self.output_fn,
            )

        looped = loop_key is not None and self.example_loops.needed(loop_key)
        try:
            call = prepare(looped)
        except VmapLimitation as error:  # NOTE: [Switching to example loops]
            if loop_key is None or looped:
                raise
            self.example_loops.switch(loop_key, error, where)
            call = prepare(True)
        if key is not None:
            self.derivatives_checked[key] = True
        return call

    def computed(self, call: KernelCall, key: tuple, compute: Callable[[KernelCall], Any]) -> Any:
        """``compute(call)``, again with an example loop if vmap fails on the model (NOTE:
        [Switching to example loops]); ``key`` is the call's shape key."""
        try:
            return compute(call)
        except VmapLimitation as error:
            if not call.side1.mapped or call.side1.loop:
                raise
            self.example_loops.switch(key, error, call.where)
            return compute(call.looped())

    def open_blocks(
        self, request: BlockRequest, x1: Any, x2: Any, params: Any, kwargs: dict, names: tuple[str, ...], bare: bool,
        where: str,
    ) -> Optional[BlockSource]:
        """The call as a :class:`BlockSource` for ``batch``, or None without ``vmap_axes`` (see
        NOTE: [Prepared spans]); the NNGP's forward passes are mapped by ``vmap_axes`` too."""
        if not self.maps_examples:
            return None  # before any forward pass: without vmap_axes the model sees whole batches
        forward_runs = None if request.block_size is None else max(request.block_size, _FORWARD_RUN)
        shape_key = _shape_key(x1, x2, params, kwargs)
        call = self.prepare(
            x1, x2, params, kwargs, where, computes_ntk="ntk" in names, forward_run_length=forward_runs,
            shape_key=shape_key,
        )
        if not call.side1.mapped:
            return None
        plan = None
        if "ntk" in names:
            key = ("blocks", shape_key)
            chosen = self.implementation
            if self.auto is not None:
                n1 = call.side1.batch_size()
                n2 = n1 if call.reuses_x1 else call.side2.batch_size()
                block = (min(n1, request.block_size or n1), min(n2, request.block_size or n2))
                first = call.narrow((0, block[0]), None if call.reuses_x1 else (0, block[1]))
                chosen = self.auto.choice(first, key + (block,)).implementation
            if chosen == NtkImplementation.STRUCTURED_DERIVATIVES:
                plan = self.structured.block_plan(call, key, request.thorough)
            else:
                plan = BLOCK_PLANS[chosen](call)
        return BlockSource(call, plan, names, bare, self.thread_safe)

    @property
    def maps_examples(self) -> bool:
        """Whether ``vmap_axes`` can map anything (an axis for some input or keyword argument)."""
        return not (is_all_none(self.vmap_axes.in_axes) and self.vmap_axes.kwargs_axes is None)

    @property
    def thread_safe(self) -> bool:
        """See ``KernelFnSpec.thread_safe``: forward-mode AD is not thread-safe in PyTorch."""
        forward_mode = self.implementation in (NtkImplementation.AUTO, NtkImplementation.NTK_VECTOR_PRODUCTS)
        local = self.implementation == NtkImplementation.STRUCTURED_DERIVATIVES and not self.structured.options.closed_form_rules
        return not (forward_mode or local)

    def choice(self, call: KernelCall, key: tuple) -> AutoChoice:
        if self.auto is not None:
            return self.auto.choice(call, key)
        if self.implementation == NtkImplementation.STRUCTURED_DERIVATIVES:
            fallback = self.structured.fallback_parameters(call, key)  # the kernel call's cached plan
            return AutoChoice(self.implementation, fallback_parameters=fallback)
        return AutoChoice(self.implementation)

    def ntk(self, call: KernelCall, key: tuple) -> PyTree:
        shapes = call.kernel_shapes()
        if all(math.prod(shape) == 0 for shape in shapes):
            # Empty kernels (e.g. x2 with no examples): transforms cannot map over size 0.
            return call.normalise([torch.zeros(shape, device=out.device) for shape, out in zip(shapes, call.outputs1)])
        def compute(call: KernelCall) -> PyTree:
            if self.auto is not None:
                return self.auto.compute(call, key)
            if self.implementation == NtkImplementation.STRUCTURED_DERIVATIVES:
                return self.structured(call, key)
            return IMPLEMENTATIONS[self.implementation](call)

        with serialised(self.thread_safe), explained(call.where):  # NOTE: [Threads]
            return call.normalise(self.computed(call, key, compute))

    def publish(
        self, kernel_fn: KernelFn, kind: str, builder: Callable[..., KernelFn], open_blocks: Callable[..., Any], where: str
    ) -> KernelFn:
        """Attaches the :class:`KernelFnSpec` (for ``batch``) and ``auto_choice`` to a kernel function."""
        rebuild = functools.partial(builder, **self.arguments)
        spec = KernelFnSpec(kind, self.f, self.trace_axes, self.diagonal_axes, rebuild, self.thread_safe, open_blocks)
        attach(kernel_fn, spec)
        return self.attach_auto_choice(kernel_fn, where)

    def attach_auto_choice(self, kernel_fn: KernelFn, where: str) -> KernelFn:
        def auto_choice(x1: PyTree, x2: Optional[PyTree] = None, params: Any = None, **kwargs: Any) -> AutoChoice:
            key = _shape_key(x1, x2, params, kwargs)
            return self.choice(self.prepare(x1, x2, params, kwargs, where, shape_key=key), key)

        auto_choice.__doc__ = _AUTO_CHOICE_DOC
        kernel_fn.auto_choice = auto_choice  # type: ignore[attr-defined]
        return kernel_fn


_AUTO_CHOICE_DOC = """The implementation used for these inputs, as an :class:`~torchntk.AutoChoice`.

Takes the arguments of the kernel function (without ``get``) and computes no kernel. With
``implementation=0`` (AUTO) the choice is made from the cost model once per input shapes and
cached; its ``estimates`` give the FLOPs and memory estimated for each candidate. With a fixed
implementation it reports that one.
"""


def _structured_options(values: dict, chosen: NtkImplementation, where: str) -> StructuredOptions:
    defaults = StructuredOptions()
    for name in ("structure_rules", "closed_form_rules", "verify"):
        _checks.bool_argument(values[name], name, where)
    if values["local_jacobian"] not in ("auto", "forward", "reverse"):
        raise ValueError(
            f"{where}: `local_jacobian` must be 'auto', 'forward' or 'reverse', got {_checks.show(values['local_jacobian'])}."
        )
    changed = [name for name, value in values.items() if value != getattr(defaults, name)]
    uses_them = (NtkImplementation.STRUCTURED_DERIVATIVES, NtkImplementation.AUTO)
    if changed and chosen not in uses_them:
        raise ValueError(
            f"{where}: {', '.join(f'`{name}`' for name in changed)} only apply to implementation=3 "
            f"(STRUCTURED_DERIVATIVES) or 0 (AUTO), but implementation={int(chosen)} ({chosen.name})."
        )
    return StructuredOptions(**values)


def _structure_key(f: Model) -> Any:
    """What of the model the derivative check depends on, besides the shapes."""
    return structure_fingerprint(f) if isinstance(f, torch.nn.Module) else id(f)


def _shape_key(x1: Any, x2: Any, params: Any, kwargs: dict) -> tuple:
    """What AUTO's choice may depend on: the structure, shapes and dtypes of every argument."""
    def describe_leaves(tree: Any) -> tuple:
        flat = Flat.of(tree)
        leaves = tuple(
            (tuple(leaf.shape), leaf.dtype, leaf.device.type) if isinstance(leaf, torch.Tensor) else repr(leaf)
            for leaf in flat.leaves
        )
        return (str(flat.spec), flat.none_positions, leaves)

    return (describe_leaves(x1), is_all_none(x2), describe_leaves(x2), describe_leaves(params), describe_leaves(kwargs))


def empirical_ntk_fn(
    f: Model,
    trace_axes: Axes = (-1,),
    diagonal_axes: Axes = (),
    vmap_axes: VMapAxes = None,
    implementation: Union[NtkImplementation, int] = DEFAULT_NTK_IMPLEMENTATION,
    *,
    chunk_size: Optional[int] = None,
    check_vmap_axes: bool = True,
    structure_rules: bool = True,
    closed_form_rules: bool = True,
    local_jacobian: str = "auto",
    verify: bool = False,
    output_fn: Optional[Callable[..., PyTree]] = None,
) -> KernelFn:
    """Returns a function computing the empirical neural tangent kernel of ``f``.

    ``NTK(x1, x2) = sum_p J_p(x1) J_p(x2)^T`` over the differentiated parameters ``p``, where
    ``J_p(x)`` is the Jacobian of ``f``'s output on ``x`` with respect to ``p``, laid out as
    described in NOTE: [Kernel layout] (``torchntk/_layout.py``).

    Args:
        f: an ``nn.Module`` (differentiated: its parameters with ``requires_grad=True``, each tied
            parameter once; frozen parameters and buffers are constants; the module is never
            mutated) or a function ``f(params, x, **kwargs)`` of a pytree of parameter tensors.
        trace_axes: output axes to trace over, i.e. contract and average. An int is one axis;
            negative axes count from the end of each output leaf. Default: ``(-1,)`` (logits).
        diagonal_axes: output axes of which only the diagonal (equal x1 and x2 indices) is kept.
            Default: ``()``.
        vmap_axes: certifies that ``f`` treats examples independently along these axes, which
            lets Jacobians be formed per example (``O(N)`` instead of ``O(N^2)`` work). ``None``
            (no such promise), an int (same axis for inputs and outputs, e.g. ``0``), a pytree of
            axes, or ``(in_axes, out_axes, kwargs_axes)``. See NOTE: [vmap_axes contract] in
            ``torchntk/_vmap_axes.py``. Default: ``None``.
        implementation: an :class:`NtkImplementation` or its int value: ``1`` (Jacobian
            contraction), ``2`` (NTK-vector products), ``3`` (structured derivatives) or ``0``
            (AUTO: the cheapest of the three for the input shapes, see ``ntk_fn.auto_choice``).
            Default: ``1``, exact for every model; ``docs/structured.md`` says when each wins.
        chunk_size: bounds peak memory. With ``vmap_axes``: at most this many examples of x1 and of
            x2 have their derivatives in memory at once (the kernel is assembled from blocks;
            with x2 None only blocks on and above the diagonal are computed). Without
            ``vmap_axes``: at most this many output entries are differentiated at once. ``None``:
            the implementation's default: everything at once for Jacobian contraction; for
            NTK-vector products, runs of x2 examples (at least 2) whose parameter-space vectors
            fit in about 32 MB (faster than all at once; see ``docs/design.md``). With
            NTK-vector products x1 is never cut (unless its batch axis is traced or diagonal).
            Default: ``None``.
        check_vmap_axes: when ``vmap_axes`` is given, compare one per-example forward pass with the
            whole-batch forward pass on every call, and (once per input shapes and module
            structure) random vector-Jacobian products of two examples per example and as a
            batch, and raise a ValueError naming the cause if they differ (NaN/Inf, unmapped
            keyword arguments, a PyTorch vmap bug, or coupling), so that neither a model that
            couples examples nor a vmap bug gives silently wrong kernels. Default: ``True``.
        structure_rules: implementation 3 (and AUTO) only. ``False`` sends every parameter to the
            Jacobian fallback, which makes implementation 3 compute Jacobian contraction (a test
            oracle). Default: ``True``.
        closed_form_rules: implementation 3 only. ``False`` computes each op's ``dy/dp`` densely
            with ``torch.func`` instead of the closed forms (a test oracle; slow). Default: ``True``.
        local_jacobian: with ``closed_form_rules=False``, how ``dy/dp`` is computed: ``"forward"``
            (``jacfwd``), ``"reverse"`` (``jacrev``) or ``"auto"`` (forward when ``y`` is larger
            than ``p``). Default: ``"auto"``.
        verify: implementation 3 only. On every call, compare the structured ``J^T v`` with autograd
            for a random ``v`` (one extra forward and backward pass) and raise ValueError if a
            parameter's use was missed or examples interact. Default: ``False``.
        output_fn: what to take the kernel of, from the model's output: ``output_fn(output)`` or
            ``output_fn(output, x, **kwargs)`` (called so when it takes two positional arguments;
            ``x`` and ``kwargs`` are what the model received). It runs inside the transforms, on
            one example (with its batch axis of size 1) under ``vmap_axes``. For Hugging Face
            models: ``lambda out: out.logits``, the logits at the last non-padding token, a logit
            difference, the log-probability of target tokens (``docs/real_models.md``). Tensor
            leaves of the result get a kernel; other leaves (a ``DynamicCache``) are dropped and
            hold None in the kernel pytree, with or without ``output_fn``. Default: ``None``.

    Returns:
        ``ntk_fn(x1, x2=None, params=None, **kwargs)``, with a method
        ``ntk_fn.auto_choice(x1, x2=None, params=None, **kwargs)`` returning the
        :class:`~torchntk.AutoChoice` (implementation, cost estimates, parameters sent to the
        Jacobian fallback) for those inputs. ``x1``/``x2`` are inputs (tensors or pytrees of
        tensors; numpy arrays raise a TypeError); ``x2=None`` means x1. ``params``: for a module, optional: a mapping
        ``name -> tensor`` choosing which parameters are differentiated (at these values; the
        others keep the module's values), or a selection of the module's own parameters at
        their current values, frozen ones included: a glob pattern or list of patterns over
        their names (``"*.lora_*"``, ``["head.*", "*.bias"]``) or a predicate
        ``(name, parameter) -> bool``; for a function, the required parameter pytree.
        ``kwargs`` go to ``f``; a 2-tuple value is split between x1 and x2. The result is a tensor
        (one per output leaf for pytree outputs) on the outputs' device, in the dtype promoted
        from the output and the parameters.

    Raises:
        TypeError: at build time, arguments of the wrong type; at call time, bad ``params``,
            numpy inputs, non-tensor outputs, complex parameters or outputs.
        ValueError: ``implementation`` outside 0..3; the implementation-3 options with
            implementation 1 or 2; an unknown ``local_jacobian``; at call time, axes out of range,
            duplicated, or both traced and diagonal; traced/diagonal sizes or output ndims that
            differ between x1 and x2; ``vmap_axes`` that do not fit the data or a model that
            couples examples; nothing to differentiate; with ``verify=True``, structured
            derivatives that disagree with autograd.
        RuntimeError: implementation 3 on a model whose operations change between evaluations.

    Example:
        >>> import torch, torchntk
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        >>> x1, x2 = torch.randn(6, 3), torch.randn(5, 3)
        >>> ntk_fn = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0)
        >>> ntk_fn(x1, x2).shape                                    # (N1, N2, O1, O2)
        torch.Size([6, 5, 4, 4])
        >>> last = {"2.weight": model[2].weight}                   # only the last layer
        >>> ntk_fn(x1, None, last).shape
        torch.Size([6, 6, 4, 4])
        >>> f = lambda params, x: torch.func.functional_call(model, params, (x,))
        >>> params = dict(model.named_parameters())
        >>> k = torchntk.empirical_ntk_fn(f, implementation=2)(x1, x2, params)   # (N1, N2)
        >>> torch.allclose(k, torchntk.empirical_ntk_fn(model)(x1, x2), atol=1e-5)
        True
        >>> structured = torchntk.empirical_ntk_fn(model, trace_axes=(), vmap_axes=0, implementation=3)
        >>> torch.allclose(structured(x1, x2), ntk_fn(x1, x2), atol=1e-5)
        True
        >>> auto = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=0)
        >>> auto.auto_choice(x1, x2).implementation in tuple(torchntk.NtkImplementation)[1:]
        True
    """
    structured = dict(
        structure_rules=structure_rules, closed_form_rules=closed_form_rules, local_jacobian=local_jacobian, verify=verify
    )
    settings = _NtkSettings.validate(
        f, trace_axes, diagonal_axes, vmap_axes, implementation, chunk_size, check_vmap_axes, structured, output_fn,
        "empirical_ntk_fn",
    )

    def ntk_fn(x1: PyTree, x2: Optional[PyTree] = None, params: Any = None, **kwargs: Any) -> PyTree:
        key = _shape_key(x1, x2, params, kwargs)
        return settings.ntk(settings.prepare(x1, x2, params, kwargs, "ntk_fn", shape_key=key), key)

    def open_blocks(request: BlockRequest, /, x1: Any, x2: Any = None, params: Any = None, **kwargs: Any) -> Optional[BlockSource]:
        return settings.open_blocks(request, x1, x2, params, kwargs, ("ntk",), True, "ntk_fn")

    return settings.publish(ntk_fn, "ntk", empirical_ntk_fn, open_blocks, "ntk_fn")


def empirical_nngp_fn(
    f: Model, trace_axes: Axes = (-1,), diagonal_axes: Axes = (), *, output_fn: Optional[Callable[..., PyTree]] = None
) -> KernelFn:
    """Returns a function computing the empirical NNGP kernel ``f(x1) f(x2)^T`` of ``f``.

    The outputs themselves are contracted with the layout of NOTE: [Kernel layout]; no
    derivative is taken.

    Args:
        f: an ``nn.Module`` or a function ``f(params, x, **kwargs)``, as in :func:`empirical_ntk_fn`.
        trace_axes: output axes to trace over (averaged). Default: ``(-1,)``.
        diagonal_axes: output axes of which only the diagonal is kept. Default: ``()``.
        output_fn: what to take the kernel of, as in :func:`empirical_ntk_fn`. Default: ``None``.

    Returns:
        ``nngp_fn(x1, x2=None, params=None, **kwargs)``, arguments as for
        :func:`empirical_ntk_fn`'s ``ntk_fn``. The result has the output's dtype.

    Raises:
        TypeError: arguments of the wrong type.
        ValueError: bad axes, or traced/diagonal sizes or output ndims that differ between x1 and x2.

    Example:
        >>> import torch, torchntk
        >>> model = torch.nn.Linear(3, 2)
        >>> x1, x2 = torch.randn(4, 3), torch.randn(5, 3)
        >>> k = torchntk.empirical_nngp_fn(model)(x1, x2)           # (N1, N2), mean over logits
        >>> torch.allclose(k, model(x1) @ model(x2).T / 2)
        True
    """
    where = "empirical_nngp_fn"
    _checks.callable_model_argument(f, where)
    traced = _checks.axes_argument(trace_axes, "trace_axes", where)
    diagonal = _checks.axes_argument(diagonal_axes, "diagonal_axes", where)
    selected = output_fn_argument(output_fn, where)

    def nngp_fn(x1: PyTree, x2: Optional[PyTree] = None, params: Any = None, **kwargs: Any) -> PyTree:
        call = prepare_call(
            f, x1, x2, params, kwargs, where="nngp_fn", trace_axes=traced, diagonal_axes=diagonal, output_fn=selected
        )
        return call.normalise(nngp(call), dtypes=call.output_dtypes)

    def rebuild(model: Model) -> KernelFn:
        return empirical_nngp_fn(model, trace_axes, diagonal_axes, output_fn=output_fn)

    return attach(nngp_fn, KernelFnSpec("nngp", f, traced, diagonal, rebuild))


def empirical_kernel_fn(
    f: Model,
    trace_axes: Axes = (-1,),
    diagonal_axes: Axes = (),
    vmap_axes: VMapAxes = None,
    implementation: Union[NtkImplementation, int] = DEFAULT_NTK_IMPLEMENTATION,
    *,
    chunk_size: Optional[int] = None,
    check_vmap_axes: bool = True,
    structure_rules: bool = True,
    closed_form_rules: bool = True,
    local_jacobian: str = "auto",
    verify: bool = False,
    output_fn: Optional[Callable[..., PyTree]] = None,
) -> KernelFn:
    """Returns a function computing the empirical NNGP and/or NTK of ``f`` in one call.

    Arguments are those of :func:`empirical_ntk_fn`; ``vmap_axes``, ``implementation``,
    ``chunk_size`` and ``check_vmap_axes`` only affect the NTK. The model's forward pass is
    shared between the two kernels.

    Returns:
        ``kernel_fn(x1, x2=None, get=None, params=None, **kwargs)``. ``get`` chooses the kernels:
        ``"ntk"`` or ``"nngp"`` returns that kernel bare; a tuple such as ``("ntk", "nngp")``
        returns a namedtuple ``EmpiricalKernel`` with those fields in that order; ``None`` means
        ``("nngp", "ntk")``. Names are case-insensitive. For a tuple/list/dict output the result
        is a container of the same structure holding one result per output leaf.

    Raises:
        TypeError, ValueError, RuntimeError: as :func:`empirical_ntk_fn`; also a ``get``
            that is empty, repeats a name or names an unknown kernel (ValueError).

    Example:
        >>> import torch, torchntk
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> kernel_fn = torchntk.empirical_kernel_fn(model, vmap_axes=0)
        >>> x1, x2 = torch.randn(4, 3), torch.randn(3, 3)
        >>> both = kernel_fn(x1, x2, ("ntk", "nngp"))
        >>> both.ntk.shape, both.nngp.shape
        (torch.Size([4, 3]), torch.Size([4, 3]))
        >>> kernel_fn(x1, None, "ntk").shape
        torch.Size([4, 4])
    """
    structured = dict(
        structure_rules=structure_rules, closed_form_rules=closed_form_rules, local_jacobian=local_jacobian, verify=verify
    )
    settings = _NtkSettings.validate(
        f, trace_axes, diagonal_axes, vmap_axes, implementation, chunk_size, check_vmap_axes, structured, output_fn,
        "empirical_kernel_fn",
    )

    def kernel_fn(
        x1: PyTree, x2: Optional[PyTree] = None, get: Union[None, str, Sequence[str]] = None,
        params: Any = None, **kwargs: Any,
    ) -> Any:
        names, bare = canonical_get(get, "kernel_fn")
        key = _shape_key(x1, x2, params, kwargs)
        call = settings.prepare(x1, x2, params, kwargs, "kernel_fn", for_ntk="ntk" in names, shape_key=key)
        kernels = {}
        if "nngp" in names:
            kernels["nngp"] = call.normalise(nngp(call), dtypes=call.output_dtypes)
        if "ntk" in names:
            kernels["ntk"] = settings.ntk(call, key)
        return combine(kernels, names, bare)

    def open_blocks(
        request: BlockRequest, /, x1: Any, x2: Any = None, get: Any = None, params: Any = None, **kwargs: Any
    ) -> Optional[BlockSource]:
        names, bare = canonical_get(get, "kernel_fn")
        return settings.open_blocks(request, x1, x2, params, kwargs, names, bare, "kernel_fn")

    return settings.publish(kernel_fn, "kernel", empirical_kernel_fn, open_blocks, "kernel_fn")


def empirical_ntk_vp_fn(
    f: Model, x1: PyTree, x2: Optional[PyTree] = None, params: Any = None, *,
    output_fn: Optional[Callable[..., PyTree]] = None, **kwargs: Any,
) -> Callable[[PyTree], PyTree]:
    """Returns ``v -> NTK(x1, x2) v`` without forming the kernel.

    The product runs over the fully flattened outputs (cross terms between output leaves
    included; no trace, diagonal or averaging): ``result = J(x1) (J(x2)^T v)``. The reverse pass
    over x2 is linearised once when this function is built; each product then costs one
    backward pass over x2 and one forward-mode pass over x1, with the memory of one backward pass.

    Args:
        f: an ``nn.Module`` or a function ``f(params, x, **kwargs)``.
        x1: first inputs.
        x2: second inputs; ``None`` means x1. Default: ``None``.
        params: as in the ``ntk_fn`` of :func:`empirical_ntk_fn`. Default: ``None``.
        output_fn: as in :func:`empirical_ntk_fn`. Default: ``None``.
        **kwargs: passed to ``f``; 2-tuples are split between x1 and x2.

    Returns:
        ``ntk_vp_fn(cotangents)``: ``cotangents`` has the structure and shapes of ``f(x2)``; the
        result has those of ``f(x1)``, in the output dtype.

    Raises:
        ValueError: cotangents whose structure or shapes differ from ``f(x2)``'s; bad ``params``.

    Example:
        >>> import torch, torchntk
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        >>> x1, x2 = torch.randn(4, 3), torch.randn(5, 3)
        >>> v = torch.randn(5, 2)                                   # like model(x2)
        >>> product = torchntk.empirical_ntk_vp_fn(model, x1, x2)(v)   # like model(x1)
        >>> full = torchntk.empirical_ntk_fn(model, trace_axes=())(x1, x2)   # (4, 5, 2, 2)
        >>> torch.allclose(product, torch.einsum("nmab,mb->na", full, v), atol=1e-5)
        True
    """
    where = "empirical_ntk_vp_fn"
    _checks.callable_model_argument(f, where)
    _checks.input_argument(x1, "x1", where)
    _checks.input_argument(x2, "x2", where)
    model = functional_model(f, params, where, output_fn_argument(output_fn, where))
    warn_training_mode(model, where)
    reuse = is_all_none(x2)
    kwargs1, kwargs2 = split_kwargs(kwargs, reuse, where)
    structure: dict[str, Flat] = {}

    def on(x: Any, side_kwargs: dict, key: str):
        def forward(param_leaves: tuple) -> tuple:
            flat = Flat.of(model.apply(param_leaves, x, side_kwargs))
            structure[key] = flat
            return flat.leaves
        return forward

    forward1 = on(x1, kwargs1, "x1")
    forward2 = forward1 if reuse else on(x2, kwargs2, "x2")
    outputs2, pullback = vjp(forward2, model.params)
    output2_tree = structure["x1" if reuse else "x2"]

    def ntk_vp_fn(cotangents: PyTree) -> PyTree:
        flat = Flat.of(cotangents)
        shapes_match = flat.same_structure(output2_tree) and all(
            isinstance(c, torch.Tensor) and c.shape == o.shape for c, o in zip(flat.leaves, outputs2)
        )
        if not shapes_match:
            raise ValueError(
                f"ntk_vp_fn: `cotangents` must have the structure and shapes of f(x2) "
                f"{describe(output2_tree.rebuild(outputs2))}, got {describe(cotangents)}."
            )
        leaves = tuple(c.to(o.dtype) for c, o in zip(flat.leaves, outputs2))
        (tangents,) = pullback(leaves)
        with FORWARD_MODE_LOCK, forward_mode_kernels(bool(model.fused)):  # NOTE: [Threads], [Unfused kernels]
            _, product = jvp(forward1, (model.params,), (tangents,))
        return structure["x1"].rebuild(product)

    return ntk_vp_fn
