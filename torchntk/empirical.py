"""Empirical NNGP and NTK kernels of ``nn.Module`` and functional models.

Every builder takes the model ``f``: an ``nn.Module`` (its parameters with
``requires_grad=True`` are differentiated; frozen parameters and buffers are constants) or a
function ``f(params, x, **kwargs)`` of a pytree of parameter tensors. The kernel functions they
return take ``(x1, x2=None, params=None, **kwargs)``; ``x2=None`` means ``x2 = x1`` and reuses the
x1 work. Keyword arguments given as a 2-tuple are split: the first element goes with x1, the
second with x2.

The module holds the four public builders and little else (the shared machinery is in
``_kernel/``); it is over 400 lines because of their docstrings.

Kernel shapes follow NOTE: [Kernel layout] in ``torchntk/_layout/kernel_layout.py`` and the "Kernel layout"
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

from dataclasses import replace
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
from torch.func import jvp, vjp

from ._call.kernel_call import NO_CHECKS, CallSpec, model_failures, prepare_call
from ._call.outputs import canonical_get, combine, output_fn_argument
from ._call.vmap_axes import parse_vmap_axes, split_kwargs
from ._implementations.nngp import nngp
from ._kernel.block_source import BlockRequest, BlockSource
from ._kernel.kernel_function import KernelFnSpec, KernelFunction
from ._kernel.block_source import FORWARD_RUN
from ._kernel.settings import NtkOptions, NtkSettings, input_shape_key
from ._layout.notices import OutputNotices
from ._memory import NEEDS_BLOCKS, CallerPlan
from ._model.functional import functional_model, warn_training_mode
from ._model.unfused import forward_mode_kernels
from ._utils import checks as _checks
from ._utils.threads import FORWARD_MODE_LOCK
from ._utils.tree import Flat, describe, is_all_none
from ._utils.types import Axes, Model, NtkImplementation, PyTree, VMapAxes

__all__ = ["empirical_ntk_fn", "empirical_nngp_fn", "empirical_kernel_fn", "empirical_ntk_vp_fn"]

DEFAULT_NTK_IMPLEMENTATION = NtkImplementation.AUTO
"""AUTO: the cheapest of 1, 2 and 3 that fits the memory budget, exact like each of them (neural-tangents'
default is 1; docs/migrating.md says why ours differs)."""

DEFAULT_VMAP_AXES = "auto"
"""Found per input structure where the checks prove the examples independent (NOTE: [Found
vmap_axes]); neural-tangents' default is None."""


_CALL_ARGS = """
Args:
    x1: inputs: a tensor or a pytree of tensors, ``N1`` examples (a nested list of numbers is a
        TypeError). Without ``vmap_axes`` a 1-D x1 into a model that takes unbatched inputs
        (``nn.Linear`` does) is one example, and the kernel has the output's axes only (0-d for
        traced logits); with ``vmap_axes=0`` its entries are the examples.
    x2: second inputs, ``N2`` examples; None means x1 (and reuses its work). Default: None.{get}
    params: the parameters to differentiate (see the builder): for a module None, a mapping
        ``name -> tensor``, a name pattern, a list of patterns or a predicate; for a function
        ``f(params, x, **kwargs)``, its parameter pytree. Default: None.
    **kwargs: passed to the model; a 2-tuple value is split between x1 and x2.

Returns:
    {returns}
"""

_NTK_FN_DOC = (
    "``ntk_fn(x1, x2=None, params=None, **kwargs)``: the empirical NTK of the model, laid out as\n"
    "NOTE: [Kernel layout] says (built by :func:`torchntk.empirical_ntk_fn`, which documents every\n"
    "option). ``ntk_fn.auto_choice(x1, x2=None, params=None, **kwargs)`` tells which implementation\n"
    "computes it.\n"
    + _CALL_ARGS.format(
        get="", returns="One kernel per output leaf, in the output's pytree structure; with ``groups``, each a dict\n"
        "    ``{group name: kernel}``.",
    )
)
_NNGP_FN_DOC = (
    "``nngp_fn(x1, x2=None, params=None, **kwargs)``: the empirical NNGP kernel of the model (built by\n"
    ":func:`torchntk.empirical_nngp_fn`).\n"
    + _CALL_ARGS.format(get="", returns="One kernel per output leaf, in the output's dtype.")
)
_KERNEL_FN_DOC = (
    "``kernel_fn(x1, x2=None, get=None, params=None, **kwargs)``: the empirical NNGP and/or NTK of the\n"
    "model in one call (built by :func:`torchntk.empirical_kernel_fn`).\n"
    + _CALL_ARGS.format(
        get="\n    get: ``\"ntk\"``, ``\"nngp\"`` (that kernel, bare), a tuple of them (an ``EmpiricalKernel``\n"
        "        namedtuple in that order) or None (both). Default: None.",
        returns="The kernels as ``get`` asks, per output leaf.",
    )
)


def empirical_ntk_fn(
    f: Model,
    trace_axes: Axes = (-1,),
    diagonal_axes: Axes = (),
    vmap_axes: VMapAxes = DEFAULT_VMAP_AXES,
    implementation: Union[NtkImplementation, int] = DEFAULT_NTK_IMPLEMENTATION,
    *,
    chunk_size: Optional[int] = None,
    check_vmap_axes: Union[bool, str] = "first",
    structure_rules: bool = True,
    closed_form_rules: bool = True,
    local_jacobian: str = "auto",
    verify: bool = False,
    output_fn: Optional[Callable[..., PyTree]] = None,
    groups: Optional[Mapping[str, Any]] = None,
    compile: Union[bool, str, Mapping[str, str]] = False,
    memory: Union[None, int, float, str] = None,
) -> KernelFunction:
    """Returns a function computing the empirical neural tangent kernel of ``f``.

    ``NTK(x1, x2) = sum_p J_p(x1) J_p(x2)^T`` over the differentiated parameters ``p``, where
    ``J_p(x)`` is the Jacobian of ``f``'s output on ``x`` with respect to ``p``, laid out as
    described in NOTE: [Kernel layout] (``torchntk/_layout/kernel_layout.py``).

    Args:
        f: an ``nn.Module`` (differentiated: its parameters with ``requires_grad=True``, each tied
            parameter once; frozen parameters and buffers are constants; the module is never
            mutated) or a function ``f(params, x, **kwargs)`` of a pytree of parameter tensors.
        trace_axes: output axes to trace over, i.e. contract and average. An int is one axis;
            negative axes count from the end of each output leaf. Default: ``(-1,)`` (logits).
            On an ``(N,)`` output (``.squeeze(-1)``) that axis holds the examples, and the kernel
            is one number: a :class:`~torchntk.OutputWarning` says so once (pass ``()`` for the
            ``(N1, N2)`` kernel; ``(0,)`` means the trace over the examples and is not warned
            about). Outputs of more than 1000 entries per example over several leaves, or more
            than 1000 kept after tracing, get one too, naming ``output_fn`` (docs/layout.md).
        diagonal_axes: output axes of which only the diagonal (equal x1 and x2 indices) is kept.
            Default: ``()``.
        vmap_axes: certifies that ``f`` treats examples independently along these axes, which
            lets Jacobians be formed per example (``O(N)`` instead of ``O(N^2)`` work). ``"auto"``
            (find them: the leading axis of the inputs, outputs and per-example keyword arguments,
            adopted only where the checks of ``check_vmap_axes`` pass on the first call per input
            structure, else the whole-batch computation; ``ntk_fn.auto_choice(x1, x2).vmap_axes``
            says what was found and ``vmap_axes_reason`` why not), ``None`` (no such promise), an
            int (same axis for inputs and outputs, e.g. ``0``), a pytree of axes, or ``(in_axes,
            out_axes, kwargs_axes)``. See NOTE: [vmap_axes contract] in
            ``torchntk/_call/vmap_axes.py`` and NOTE: [Found vmap_axes]. Default: ``"auto"``
            (neural-tangents: ``None``).
        implementation: an :class:`NtkImplementation` or its int value: ``1`` (Jacobian
            contraction), ``2`` (NTK-vector products), ``3`` (structured derivatives) or ``0``
            (AUTO: the cheapest of the three for the input shapes that fits the memory budget, see
            ``ntk_fn.auto_choice``). Every implementation is exact. Default: ``0`` (neural-tangents:
            ``1``); ``docs/structured.md`` says when each wins.
        chunk_size: bounds peak memory. With ``vmap_axes``: at most this many examples of x1 and of
            x2 have their derivatives in memory at once (the kernel is assembled from blocks;
            with x2 None only blocks on and above the diagonal are computed). Without
            ``vmap_axes``: at most this many output entries are differentiated at once, and
            implementation 1 holds the Jacobian of one run of coordinates of a traced output axis
            at a time (``docs/batching.md``, "Memory plans"). ``None``:
            the implementation's default: everything at once for Jacobian contraction; for
            NTK-vector products, runs of x2 examples (at least 2) whose parameter-space vectors
            fit in about 32 MB (faster than all at once; see ``docs/design.md``). With
            NTK-vector products x1 is never cut (unless its batch axis is traced or diagonal).
            Default: ``None``.
        check_vmap_axes: when ``vmap_axes`` is given or found, compare the per-example outputs with a
            whole-batch forward pass, and random vector-Jacobian products of two examples per
            example and as a batch, and raise a ValueError naming the cause if they differ
            (NaN/Inf, unmapped keyword arguments, a PyTorch vmap bug, or coupling), so that
            neither a model that couples examples nor a vmap bug gives silently wrong kernels.
            ``"first"``: both checks on the first call per input shapes, module structure and
            train/eval modes (the key of the call's plan); later calls with that key skip the
            checks and the whole-batch forward pass, also those of a kernel function built again
            for the same model with the same options, which shares this one's plans (a model
            whose coupling depends on the values, not on the shapes, such as a mixture of experts
            whose capacity overflows for some batches, is caught only if the first call shows it).
            ``True``: the output check, and its whole-batch forward pass, on every call as well.
            ``False``: no check (and with ``vmap_axes="auto"``, no axes found: nothing would prove
            them).
            Default: ``"first"`` (``docs/guarantees.md`` says why).
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
            hold None in the kernel pytree, with or without ``output_fn``; so do integer and boolean
            tensor leaves (``return logits, logits.argmax(-1)``), which have no derivative (NOTE:
            [Integer outputs] in ``_model/functional.py``). Default: ``None``.
        groups: split the NTK by parameter groups, every group in one call (``docs/groups.md``): a
            mapping ``{group name: selection}``. A selection is a glob pattern over parameter names
            (``"*.lora_*"``; a pattern naming a module, ``"encoder.layer.0"`` or ``"*.attn"``,
            selects every parameter under it too), a submodule of ``f``, a list of patterns and
            submodules, or a predicate ``(name, parameter) -> bool``. For a function ``f``, a
            parameter's name is its key path in ``params`` joined with dots (``"dense.w"``). Each
            differentiated parameter belongs to the first group selecting it (a last ``"*"`` takes
            the rest); parameters in no group are not differentiated. The kernels sum to the NTK of
            the grouped parameters (the whole NTK when every parameter is in a group). Implementations
            1 and 3 compute all groups in one pass; 2 repeats its forward-mode passes over x1 once
            per group. Default: ``None`` (one kernel).
        compile: capture each call's computation into one graph of aten operations and replay it
            (``docs/compile.md``): ``False`` (every call eager), ``True`` (``torch.compile``'s
            inductor backend), the name of a ``torch.compile`` backend (``"eager"`` replays the
            graph without generating code) or a mapping of ``torch.compile``'s ``"backend"`` and
            ``"mode"``. On CUDA, inductor replays the graph as a CUDA graph (its
            ``"reduce-overhead"`` mode) unless a mode is given (``{"mode":
            "max-autotune-no-cudagraphs"}`` keeps CUDA graphs out). The first call for given argument shapes, dtypes,
            non-tensor values and module structure, modes and ``requires_grad`` flags runs eagerly
            with every check, then is traced, compiled (inductor: seconds) and compared with the
            eager kernel; later such calls replay the graph, with the per-call output check of
            ``check_vmap_axes`` left to that first call. Models whose operations depend on tensor
            values (``.item()``, boolean masks) or draw random numbers are not captured (a
            RuntimeWarning says why; their calls stay eager). A model whose forward pass depends on
            Python state outside the module (a global variable) must not use it. ``batch`` computes
            its blocks eagerly. Default: ``False``.
        memory: the memory budget of a call: bytes (an int or float), a string such as ``"8GB"`` or
            ``"512MiB"``, ``math.inf`` (no planning) or None, which means half of the available RAM
            (``MemAvailable``) on the CPU, 80% of the free memory of a CUDA device, measured at each
            call (``docs/batching.md``, "Memory plans"). After validating a call, and before any
            derivative is taken, the result alone must fit (else ``KernelMemoryError``); if the
            implementation's estimated peak with ``chunk_size`` exceeds the budget, the largest
            ``chunk_size`` that fits is used instead (a ``MemoryPlanWarning`` says so, once); AUTO
            picks the fastest plan that fits. Default: ``None``.

    Returns:
        ``ntk_fn(x1, x2=None, params=None, **kwargs)``, with a method
        ``ntk_fn.auto_choice(x1, x2=None, params=None, **kwargs)`` returning the
        :class:`~torchntk.AutoChoice` (implementation, cost estimates, parameters sent to the
        Jacobian fallback) for those inputs. ``x1``/``x2`` are inputs (tensors or pytrees of
        tensors; numpy arrays raise a TypeError); ``x2=None`` means x1. ``params``: for a module, optional: a mapping
        ``name -> tensor`` choosing which parameters are differentiated (at these values; the
        others keep the module's values; a tied parameter under any one of its names, which
        all get that value: two of its names are a ValueError), or a selection of the module's own parameters at
        their current values, frozen ones included: a glob pattern or list of patterns over
        their names (``"*.lora_*"``, ``["head.*", "*.bias"]``) or a predicate
        ``(name, parameter) -> bool``; for a function, the required parameter pytree.
        ``kwargs`` go to ``f``; a 2-tuple value is split between x1 and x2. The result is a tensor
        (one per output leaf for pytree outputs) on the outputs' device, in the dtype promoted
        from the output and the parameters. With ``groups`` each of these tensors becomes a dict
        ``{group name: kernel}`` in the order of ``groups`` (for a single-tensor output, the
        result is that dict).

    Raises:
        TypeError: at build time, arguments of the wrong type (``groups`` that is not a mapping, keys
            that are not strings, selections of another type, ``compile`` neither a bool nor a string);
            at call time, bad ``params``, numpy inputs or inputs holding no tensor (nested lists),
            non-tensor outputs, complex parameters or outputs, a ``groups`` predicate returning
            something other than a bool; the model failing on an input whose floating dtype differs
            from its parameters' (both dtypes named; the check runs only when the model fails, so
            models that cast their inputs, and integer token ids, are accepted).
        ValueError: ``implementation`` outside 0..3; the implementation-3 options with implementation 1
            or 2; ``compile`` naming no ``torch.compile`` backend, or with ``verify=True``; an unknown
            ``local_jacobian``; an empty ``groups``, an empty list in it, a submodule not in ``f``; at
            call time, a group that selects no differentiated parameter (or only ones earlier groups
            hold), axes out of range, duplicated, or both traced and diagonal; traced/diagonal sizes or
            output ndims that differ between x1 and x2; ``vmap_axes`` that do not fit the data or a
            model that couples examples (a 1-D input under ``vmap_axes=0`` included); nothing to
            differentiate (a module without trainable parameters: its NNGP is still computed); with
            ``verify=True``, structured derivatives that disagree with autograd. When the model
            raises on x1 or x2 (a feature size it was not built for, examples on another axis), the
            ValueError names that input with its shapes and dtypes and ends with PyTorch's message;
            it is also a RuntimeError, as PyTorch's was.
        RuntimeError: implementation 3 on a model whose operations change between evaluations.
        KernelMemoryError: (a MemoryError) at call time, before any derivative is taken: the kernel
            alone, or the smallest plan, exceeds ``memory``; or an allocation failed during the
            computation anyway (the plan attempted is named; the CUDA cache is released). The
            message names the bytes, the budget and the ways out. ``memory`` that is not an amount
            of memory is a TypeError or ValueError at build time.

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
        >>> groups = {"first layer": model[0], "last weight": "2.weight", "rest": "*"}
        >>> split = torchntk.empirical_ntk_fn(model, vmap_axes=0, groups=groups)(x1, x2)
        >>> list(split), split["rest"].shape                        # {group: (N1, N2)}
        (['first layer', 'last weight', 'rest'], torch.Size([6, 5]))
        >>> torch.allclose(sum(split.values()), torchntk.empirical_ntk_fn(model)(x1, x2), atol=1e-5)
        True
        >>> replayed = torchntk.empirical_ntk_fn(model, vmap_axes=0, implementation=3, compile="eager")
        >>> first, again = replayed(x1, x2), replayed(x1, x2)  # captured on the first call, replayed after
        >>> torch.allclose(again, torchntk.empirical_ntk_fn(model)(x1, x2), atol=1e-5)
        True
    """
    given = NtkOptions(
        trace_axes=trace_axes, diagonal_axes=diagonal_axes, vmap_axes=vmap_axes, implementation=implementation,
        chunk_size=chunk_size, check_vmap_axes=check_vmap_axes, structure_rules=structure_rules,
        closed_form_rules=closed_form_rules, local_jacobian=local_jacobian, verify=verify, output_fn=output_fn,
        groups=groups, compile=compile, memory=memory,
    )
    settings = NtkSettings.validate(f, given, where="empirical_ntk_fn")

    def ntk(
        settings: NtkSettings, x1: PyTree, x2: Optional[PyTree], params: Any, kwargs: dict,
        caller: Optional[CallerPlan] = None,
    ) -> PyTree:
        key = input_shape_key(x1, x2, params, kwargs)
        call = settings.prepare(
            x1, x2, params, kwargs, "ntk_fn", shape_key=key, needs_outputs=False, admit=True, caller=caller
        )
        return settings.ntk(call, caller)

    def ntk_fn(x1: PyTree, x2: Optional[PyTree] = None, params: Any = None, **kwargs: Any) -> PyTree:
        return settings.called(ntk, x1, x2, params, kwargs)

    def within(caller: CallerPlan) -> Callable[..., Any]:  # NOTE: [Budgets of callers]
        def planned_ntk_fn(x1: PyTree, x2: Optional[PyTree] = None, params: Any = None, **kwargs: Any) -> Any:
            return settings.called(ntk, x1, x2, params, kwargs, caller=caller)

        return planned_ntk_fn

    def open_blocks(
        request: BlockRequest, /, x1: Any, x2: Any = None, params: Any = None, **kwargs: Any
    ) -> Optional[BlockSource]:
        return settings.open_blocks(request, x1, x2, params, kwargs, names=("ntk",), bare=True, where="ntk_fn")

    return settings.publish(ntk_fn, "ntk", empirical_ntk_fn, open_blocks, "ntk_fn", _NTK_FN_DOC, within)


def empirical_nngp_fn(
    f: Model, trace_axes: Axes = (-1,), diagonal_axes: Axes = (), *, output_fn: Optional[Callable[..., PyTree]] = None
) -> KernelFunction:
    """Returns a function computing the empirical NNGP kernel ``f(x1) f(x2)^T`` of ``f``.

    The outputs themselves are contracted with the layout of NOTE: [Kernel layout]; no
    derivative is taken, so a module without trainable parameters (``nn.Tanh()``, a frozen
    network) has an NNGP too, though its NTK is refused. Integer and boolean output leaves get
    None, like non-tensor leaves (NOTE: [Integer outputs]).

    Args:
        f: an ``nn.Module`` or a function ``f(params, x, **kwargs)``, as in :func:`empirical_ntk_fn`.
        trace_axes: output axes to trace over (averaged). Default: ``(-1,)``; warned about as in
            :func:`empirical_ntk_fn`.
        diagonal_axes: output axes of which only the diagonal is kept. Default: ``()``.
        output_fn: what to take the kernel of, as in :func:`empirical_ntk_fn`. Default: ``None``.

    Returns:
        ``nngp_fn(x1, x2=None, params=None, **kwargs)``, arguments as for
        :func:`empirical_ntk_fn`'s ``ntk_fn``. The result has the output's dtype.

    Raises:
        TypeError: arguments of the wrong type; inputs as for :func:`empirical_ntk_fn`.
        ValueError: bad axes, or traced/diagonal sizes or output ndims that differ between x1 and x2;
            the model failing on x1 or x2 (named, as for :func:`empirical_ntk_fn`).

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
    call_spec = CallSpec(traced, diagonal, output_fn=selected, notices=OutputNotices())  # notices once per kernel function

    def nngp_fn(x1: PyTree, x2: Optional[PyTree] = None, params: Any = None, **kwargs: Any) -> PyTree:
        call = prepare_call(f, x1, x2, params, kwargs, call_spec, where="nngp_fn")
        return call.normalise(nngp(call), dtypes=call.output_dtypes)

    def open_blocks(
        request: BlockRequest, /, x1: Any, x2: Any = None, params: Any = None, **kwargs: Any
    ) -> Optional[BlockSource]:
        """The call as prepared spans for ``batch`` (one forward pass per run of examples instead of
        one per pair of blocks): ``batch`` puts every input's examples on axis 0. Keyword arguments
        may or may not hold examples, which only ``vmap_axes`` says: with some, None (``batch``
        then calls ``nngp_fn`` per pair of blocks)."""
        if kwargs:
            return None
        call = prepare_call(
            f, x1, x2, params, {}, replace(call_spec, vmap_axes=_EXAMPLES_ON_AXIS_0, notices=None), where="nngp_fn",
            plan=NO_CHECKS, computes_ntk=False,
            forward_run_length=None if request.block_size is None else max(request.block_size, FORWARD_RUN),
        )
        return BlockSource(call, None, ("nngp",), bare=True, thread_safe=True)

    def rebuild(model: Model) -> KernelFunction:
        return empirical_nngp_fn(model, trace_axes, diagonal_axes, output_fn=output_fn)

    spec = KernelFnSpec("nngp", f, traced, diagonal, rebuild, open_blocks=open_blocks, options={"output_fn": output_fn})
    return KernelFunction(nngp_fn, spec, _NNGP_FN_DOC)


_EXAMPLES_ON_AXIS_0 = parse_vmap_axes(0, "empirical_nngp_fn")


def empirical_kernel_fn(
    f: Model,
    trace_axes: Axes = (-1,),
    diagonal_axes: Axes = (),
    vmap_axes: VMapAxes = DEFAULT_VMAP_AXES,
    implementation: Union[NtkImplementation, int] = DEFAULT_NTK_IMPLEMENTATION,
    *,
    chunk_size: Optional[int] = None,
    check_vmap_axes: Union[bool, str] = "first",
    structure_rules: bool = True,
    closed_form_rules: bool = True,
    local_jacobian: str = "auto",
    verify: bool = False,
    output_fn: Optional[Callable[..., PyTree]] = None,
    groups: Optional[Mapping[str, Any]] = None,
    compile: Union[bool, str, Mapping[str, str]] = False,
    memory: Union[None, int, float, str] = None,
) -> KernelFunction:
    """Returns a function computing the empirical NNGP and/or NTK of ``f`` in one call.

    Arguments are those of :func:`empirical_ntk_fn`; ``vmap_axes``, ``implementation``,
    ``chunk_size``, ``check_vmap_axes``, ``groups`` and ``memory`` only affect the NTK (the NNGP, the
    size of the outputs, is neither planned nor refused). The model's forward pass
    is shared between the two kernels. With ``compile``, each ``get`` has graphs of its own.

    Returns:
        ``kernel_fn(x1, x2=None, get=None, params=None, **kwargs)``. ``get`` chooses the kernels:
        ``"ntk"`` or ``"nngp"`` returns that kernel bare; a tuple such as ``("ntk", "nngp")``
        returns a namedtuple ``EmpiricalKernel`` with those fields in that order; ``None`` means
        ``("nngp", "ntk")``. Names are case-insensitive. For a tuple/list/dict output the result
        is a container of the same structure holding one result per output leaf. With ``groups``
        every NTK is a dict ``{group name: kernel}`` (``kernel_fn(x1, x2).ntk["head"]``); the NNGP
        is not split (it has no parameters).

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
        >>> split = torchntk.empirical_kernel_fn(model, vmap_axes=0, groups={"hidden": "0", "head": "2"})
        >>> sorted(split(x1, x2).ntk), split(x1, x2).nngp.shape
        (['head', 'hidden'], torch.Size([4, 3]))
    """
    given = NtkOptions(
        trace_axes=trace_axes, diagonal_axes=diagonal_axes, vmap_axes=vmap_axes, implementation=implementation,
        chunk_size=chunk_size, check_vmap_axes=check_vmap_axes, structure_rules=structure_rules,
        closed_form_rules=closed_form_rules, local_jacobian=local_jacobian, verify=verify, output_fn=output_fn,
        groups=groups, compile=compile, memory=memory,
    )
    settings = NtkSettings.validate(f, given, where="empirical_kernel_fn")

    def requested(
        settings: NtkSettings, x1: PyTree, x2: Optional[PyTree], get: Any, params: Any, kwargs: dict,
        caller: Optional[CallerPlan] = None,
    ) -> Any:
        names, bare = canonical_get(get, "kernel_fn")
        key = input_shape_key(x1, x2, params, kwargs)
        call = settings.prepare(
            x1, x2, params, kwargs, "kernel_fn", for_ntk="ntk" in names, shape_key=key, admit="ntk" in names,
            caller=caller,
        )
        kernels = {}
        if "ntk" in names:  # first: nothing is computed where it needs blocks (NOTE: [Budgets of callers])
            kernels["ntk"] = settings.ntk(call, caller)
            if kernels["ntk"] is NEEDS_BLOCKS:
                return NEEDS_BLOCKS
        if "nngp" in names:
            products = nngp(call)
            settings.explain_non_finite(call, products)
            kernels["nngp"] = call.normalise(products, dtypes=call.output_dtypes)
        return combine(kernels, names, bare)

    def kernel_fn(
        x1: PyTree, x2: Optional[PyTree] = None, get: Union[None, str, Sequence[str]] = None,
        params: Any = None, **kwargs: Any,
    ) -> Any:
        return settings.called(requested, x1, x2, get, params, kwargs)

    def within(caller: CallerPlan) -> Callable[..., Any]:  # NOTE: [Budgets of callers]
        def planned_kernel_fn(
            x1: PyTree, x2: Optional[PyTree] = None, get: Union[None, str, Sequence[str]] = None,
            params: Any = None, **kwargs: Any,
        ) -> Any:
            return settings.called(requested, x1, x2, get, params, kwargs, caller=caller)

        return planned_kernel_fn

    def open_blocks(
        request: BlockRequest, /, x1: Any, x2: Any = None, get: Any = None, params: Any = None, **kwargs: Any
    ) -> Optional[BlockSource]:
        names, bare = canonical_get(get, "kernel_fn")
        return settings.open_blocks(request, x1, x2, params, kwargs, names=names, bare=bare, where="kernel_fn")

    return settings.publish(
        kernel_fn, "kernel", empirical_kernel_fn, open_blocks, "kernel_fn", _KERNEL_FN_DOC, within
    )


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
        result has those of ``f(x1)``, in the output dtype. Integer and boolean output leaves are
        None in both, like non-tensor leaves (NOTE: [Integer outputs]).

    Raises:
        TypeError: inputs that hold no tensor (nested lists of numbers), numpy inputs.
        ValueError: x1 None; cotangents whose structure or shapes differ from ``f(x2)``'s; bad
            ``params``; the model failing on x2 (named, as for :func:`empirical_ntk_fn`).

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
    _checks.input_argument(x1, "x1", where, required=True)
    _checks.input_argument(x2, "x2", where)
    model = functional_model(f, params, where, output_fn_argument(output_fn, where))
    warn_training_mode(model, where)
    reuse = is_all_none(x2)
    kwargs1, kwargs2 = split_kwargs(kwargs, x2_is_none=reuse, where=where)
    structure: dict[str, Flat] = {}

    def on(x: Any, side_kwargs: dict, key: str):
        def forward(param_leaves: tuple) -> tuple:
            flat = Flat.of(model.apply(param_leaves, x, side_kwargs))
            structure[key] = flat
            return flat.leaves
        return forward

    forward1 = on(x1, kwargs1, "x1")
    forward2 = forward1 if reuse else on(x2, kwargs2, "x2")
    with model_failures(model, x1 if reuse else x2, "x1" if reuse else "x2", where):
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
