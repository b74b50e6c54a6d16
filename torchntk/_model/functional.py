"""One functional form for every model: ``call(param_leaves, args, kwargs) -> output pytree``.

NOTE: [Modules are never mutated]
A kernel call works on private copies, so that whatever the model does in its forward pass (an
``nn.Embedding(max_norm=...)`` renormalising its weight in place, a BatchNorm in training mode
updating its running statistics, a hook writing an attribute), the user's module, its parameters,
its buffers and the tensors passed in ``params`` are left exactly as they were, also when several
threads compute kernels of one module at once (NOTE: [Threads] in ``_utils/threads.py``):

* every parameter tensor (differentiated or constant) is cloned once per kernel call, and every
  buffer once per evaluation (so each evaluation starts from the module's running statistics);
* ``torch.func.functional_call`` swaps these clones into a private shell of the module
  (``_model/shell.py``), one per thread, never into the module itself.

A kernel call (``prepare_call``, ``lazy=True``) makes these clones copy-on-write
(``torch._lazy_clone``): the clone shares the module's memory until either side is written, and
a write to the clone (a forward pass renormalising a weight) copies it first, so the module still
never sees it. Reading is all a kernel does, so no copy is made at all: an eager copy cost 3-14 ms
per call on the wide benchmark MLP (36 MB of weights), 10-25 % of the call. The clones die
with the call, after which the module's next write takes its memory back without a copy; a
write from another thread during the call copies the module's tensor to new memory (its
``data_ptr`` changes). Longer-lived models (``empirical_ntk_vp_fn``, spectra operators) keep eager
clones, so that a module's memory never moves because a lazy clone outlived the call. Tensors
that cannot be shared copy-on-write (tensor subclasses, memory from ``torch.from_numpy``, devices
other than CPU and CUDA) are cloned eagerly.
"""

from __future__ import annotations

import contextlib
import fnmatch
import threading
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .._utils.checks import show, user_stacklevel
from .._utils.tree import Flat
from .._utils.types import promoted
from .aliases import storage_key, watched
from .inner_derivatives import with_inner_derivatives
from .names import parameter_names
from .requires_grad import ignored_by_global_hooks
from .shell import private_shell
from .survey import KeptSurvey, ModuleSurvey, survey_of
from .unfused import recurrent_layers_without_cudnn
from .wrappers import compiled_function, compiled_wrapper, plain_checkpoints

Call = Callable[[tuple, tuple, Mapping[str, Any]], Any]


@dataclass(frozen=True)
class FunctionalModel:
    """A model reduced to a function of a flat tuple of parameter tensors.

    Attributes:
        call: ``call(param_leaves, args, kwargs)`` evaluates the model on positional ``args``.
        params: the tensors to differentiate, detached.
        names: a readable name per parameter tensor, for messages.
        batch_coupled: module paths whose output depends on other examples (BatchNorm using
            batch statistics); empty for functional models.
        random: module paths drawing random numbers in the forward pass (active dropout).
        fused: module paths calling fused kernels that forward mode and vmap need replaced
            (``_model/unfused.fused_layers``: recurrent layers, weight norm); empty for functional models.
        survey: a module's :class:`~torchntk._model.survey.ModuleSurvey` (NOTE: [Module surveys]);
            None for functional models.
    """

    call: Call
    params: tuple[torch.Tensor, ...]
    names: tuple[str, ...]
    batch_coupled: tuple[str, ...] = ()
    random: tuple[str, ...] = ()
    params_tree: Optional[Flat] = None
    output_fn: Optional["OutputFn"] = None
    fused: tuple[str, ...] = ()
    survey: Optional[ModuleSurvey] = None

    def leaves_like_params(self, values: Any, name: str, where: str) -> tuple[torch.Tensor, ...]:
        """The tensors of ``values``, which must be structured like the differentiated parameters."""
        if self.params_tree is None:
            if not isinstance(values, Mapping) or set(values) != set(self.names):
                raise ValueError(
                    f"{where}: `{name}` must be a mapping with exactly the differentiated parameter "
                    f"names {sorted(self.names)}, got {show(values)}."
                )
            leaves = tuple(values[key] for key in self.names)
        else:
            flat = Flat.of(values)
            if not flat.same_structure(self.params_tree):
                raise ValueError(f"{where}: `{name}` must have the structure of `params`, got {show(values)}.")
            leaves = flat.leaves
        for leaf, reference, label in zip(leaves, self.params, self.names):
            if not isinstance(leaf, torch.Tensor) or leaf.shape != reference.shape:
                raise ValueError(
                    f"{where}: `{name}` entry {label!r} must be a tensor of shape "
                    f"{tuple(reference.shape)}, got {show(leaf)}."
                )
        return leaves

    def apply(self, param_leaves: tuple, x: Any, kwargs: Mapping[str, Any]) -> Any:
        """The model on one input pytree ``x``: ``f(params, x, **kwargs)`` or ``module(x, **kwargs)``,
        through ``output_fn`` if there is one, with its non-tensor leaves made None (NOTE:
        [Selected outputs])."""
        output = self.call(param_leaves, (x,), kwargs)
        if self.output_fn is not None:
            output = self.output_fn(output, x, kwargs)
        return tensor_leaves_only(output)

    def restricted(self, indices: Sequence[int]) -> "FunctionalModel":
        """The model differentiating only the parameters at ``indices`` (in that order); the others
        become constants at their current values. ``self`` when ``indices`` are all, in order."""
        if tuple(indices) == tuple(range(len(self.params))):
            return self
        everything, inner = self.params, self.call

        def call(param_leaves: tuple, args: tuple, kwargs: Mapping[str, Any]) -> Any:
            leaves = list(everything)
            for index, value in zip(indices, param_leaves):
                leaves[index] = value
            return inner(tuple(leaves), args, kwargs)

        return replace(
            self, call=call, params=tuple(everything[index] for index in indices),
            names=tuple(self.names[index] for index in indices), params_tree=None,
        )

    @property
    def param_dtype(self) -> torch.dtype:
        return promoted(param.dtype for param in self.params)


def functional_model(
    f: Any, params: Any, where: str, output_fn: Optional["OutputFn"] = None, lazy: bool = False,
    survey: Optional[KeptSurvey] = None,
) -> FunctionalModel:
    """Builds the :class:`FunctionalModel` of an ``nn.Module`` or of ``f(params, x, **kwargs)``;
    ``output_fn`` comes from :func:`~torchntk._call.outputs.output_fn_argument`. ``lazy``: a module's
    private copies are copy-on-write (NOTE: [Modules are never mutated]); only for a model that
    dies with the kernel call. ``survey``: a survey of the module kept under the call's plan key
    (NOTE: [Module surveys]), which saves walking its tree again.

    Raises:
        TypeError: ``params`` of the wrong type, or parameters that are not floating tensors.
        ValueError: unknown parameter names, wrong shapes, or nothing to differentiate.
    """
    if isinstance(f, nn.Module):
        model = _module_model(f, params, where, lazy, survey)
    else:
        model = _callable_model(f, params, where)
    model = replace(model, call=with_inner_derivatives(model.call, f, where))  # NOTE: [Derivatives inside the forward pass]
    return model if output_fn is None else replace(model, output_fn=output_fn)


OutputFn = Callable[[Any, Any, Mapping[str, Any]], Any]
"""``(output, x, kwargs) -> selected output``: the normalised form of a user's ``output_fn``."""


def tensor_leaves_only(output: Any) -> Any:
    """``output`` with every leaf that is not a floating-point or complex tensor replaced by None.

    NOTE: [Selected outputs]
    Kernels are computed for the tensor leaves of what the model returns. Other leaves (a Hugging
    Face ``DynamicCache``, a Python number, a string) carry no derivative with respect to the
    parameters and are dropped: their place in the kernel pytree holds None (NOTE: [None is an
    empty subtree]). ``output_fn`` selects what to take the kernel of (the logits, the logits at
    some positions, a log-probability) from the model's output and inputs; it runs inside the
    transforms, per example under ``vmap_axes``.

    NOTE: [Integer outputs]
    An integer or boolean output leaf (``y.argmax(-1)``, a mask) is piecewise constant in the
    parameters: its derivative is zero where it exists, and autograd refuses to differentiate it.
    Such a leaf is treated like a non-tensor leaf: it gets no kernel, and its place in the kernel
    pytree holds None, for the NTK and the NNGP alike, whatever the implementation or entry point,
    so that ``return logits, logits.argmax(-1)`` needs no ``output_fn``.
    """
    return pytree.tree_map(lambda leaf: leaf if _has_kernel(leaf) else None, output)


def _has_kernel(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) and (leaf.is_floating_point() or leaf.is_complex())


def _module_model(
    module: nn.Module, params: Optional[Mapping[str, torch.Tensor]], where: str, lazy: bool = False,
    kept: Optional[KeptSurvey] = None,
) -> FunctionalModel:
    wrapped = compiled_wrapper(module)  # NOTE: [Compiled modules]
    prefix = ""
    if wrapped is not None:
        if wrapped[1]:
            prefix = wrapped[1]
        else:  # the wrapper lists no parameters: it is the wrapped module, under the wrapped module's names
            module = wrapped[0]
    survey = survey_of(module, kept)  # NOTE: [Module surveys]
    scripted = survey.scripted
    if scripted:
        raise TypeError(
            f"{where}: the module holds TorchScript modules ({', '.join(map(repr, scripted[:3]))}), which "
            f"cannot be evaluated with other parameter tensors (torch.func.functional_call refuses them). "
            f"Pass the eager nn.Module, or a function f(params, x) that calls it."
        )
    all_params = survey.parameters(remove_duplicate=False)
    if params is None:
        chosen = {name: p for name, p in survey.parameters().items() if p.requires_grad}
        if not chosen:
            raise ValueError(
                f"{where}: the module has no parameter with requires_grad=True to differentiate "
                f"({len(all_params)} parameters in all). Unfreeze some, or pass `params`."
            )
    elif _is_selection(params):
        chosen = _selected(module, params, where)
    else:
        if not isinstance(params, Mapping):
            raise TypeError(
                f"{where}: for an nn.Module, `params` must be None, a mapping from parameter name to "
                f"tensor (e.g. dict(model.named_parameters())), a name pattern or list of patterns "
                f"(e.g. '*.lora_*'), or a predicate (name, parameter) -> bool; got {show(params)}."
            )
        if not params:
            raise ValueError(f"{where}: `params` is an empty mapping; there is no parameter to differentiate.")
        unknown = sorted(set(params) - set(all_params))
        if unknown:
            raise ValueError(
                f"{where}: `params` has names {unknown} that are not parameters of the module; "
                f"expected names from {sorted(all_params)}."
            )
        chosen = dict(params)
        for name, value in chosen.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{where}: `params[{name!r}]` must be a tensor, got {show(value)}.")
            if value.shape != all_params[name].shape:
                raise ValueError(
                    f"{where}: `params[{name!r}]` has shape {tuple(value.shape)}, but the module's "
                    f"parameter has shape {tuple(all_params[name].shape)}."
                )
    names = tuple(chosen)
    leaves = tuple(
        _private_copy(float_parameter(value, f"parameter {name!r}", where), lazy) for name, value in chosen.items()
    )
    chosen_ids = {id(all_params[name]) for name in chosen}
    # A tied parameter has several names for one tensor; every alias of a chosen one is chosen.
    constants = _private_copies({name: p for name, p in all_params.items() if id(p) not in chosen_ids}, lazy)
    buffers = survey.buffers()
    watch = watched(
        module, {name: all_params[name] for name in names},
        {name for name in names if not _same_values(chosen[name], all_params[name])}, where,
    )
    # The wrapper's names, as the user's object lists them, address the wrapped module's tables.
    inner = _without_prefix(prefix)
    evaluate = _private_evaluation(wrapped[0] if prefix else module, survey.recurrent)
    constants, buffers = inner(constants), inner(buffers)
    slots = tuple(tuple(inner(dict.fromkeys(aliases))) for aliases in _tied_names(all_params, names, where))

    def call(param_leaves: tuple, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        tensors = _private_copies(buffers, lazy)
        tensors.update(constants)
        for aliases, leaf in zip(slots, param_leaves):
            for alias in aliases:
                tensors[alias] = leaf
        if watch is None or not watch.armed:
            return evaluate(tensors, args, dict(kwargs))
        return watch.evaluate(param_leaves, lambda: evaluate(tensors, args, dict(kwargs)))

    return FunctionalModel(
        call, leaves, names, survey.coupled, survey.random, fused=survey.fused, survey=survey
    )


def _tied_names(all_params: dict[str, torch.Tensor], names: tuple[str, ...], where: str) -> list[tuple[str, ...]]:
    """Every name of each differentiated parameter (several where it is tied), so that every name
    gets its leaf and ``functional_call`` need not walk the module to tie them.

    Raises:
        ValueError: two names of ``names`` are one tied parameter.
    """
    names_of: dict[int, list[str]] = {}
    for name, tensor in all_params.items():
        names_of.setdefault(id(tensor), []).append(name)
    owner: dict[int, str] = {}
    for name in names:
        first = owner.setdefault(id(all_params[name]), name)
        if first != name:
            raise ValueError(
                f"{where}: `params` names {first!r} and {name!r}, which are one tied parameter; pass one "
                f"of its names (every name of a tied parameter gets its value)."
            )
    return [tuple(names_of[id(all_params[name])]) for name in names]


def _without_prefix(prefix: str) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """Renames a mapping's keys from the compile wrapper's parameter names to the wrapped module's."""
    return lambda mapping: {name[len(prefix):]: value for name, value in mapping.items()}


def _same_values(given: torch.Tensor, own: torch.Tensor) -> bool:
    """Whether ``given`` is ``own`` or a view of the same memory with its layout (so the module's
    own tensor has the value torchntk substitutes; NOTE: [Aliased parameters])."""
    if given is own:
        return True
    key = storage_key(given)
    return (
        key is not None and key == storage_key(own) and given.dtype == own.dtype
        and given.storage_offset() == own.storage_offset() and given.stride() == own.stride()
    )


def _is_selection(params: Any) -> bool:
    """Whether ``params`` selects module parameters by name (patterns) or by a predicate."""
    if isinstance(params, str) or (callable(params) and not isinstance(params, (Mapping, torch.Tensor, nn.Module))):
        return True
    return isinstance(params, (list, tuple)) and bool(params) and all(isinstance(item, str) for item in params)


def _selected(module: nn.Module, selection: Any, where: str) -> dict[str, torch.Tensor]:
    """The module's parameters (each tied tensor once, under its first name, frozen ones included)
    that ``selection`` picks: those with a name (any of a tied parameter's names) matching a glob
    pattern (``fnmatch``: ``*`` also crosses dots), or for which a predicate ``(name, parameter) ->
    bool`` is true. Their current values are differentiated.

    Raises:
        ValueError: nothing is selected.
        TypeError: a predicate that returns something other than a bool.
    """
    named = list(module.named_parameters())
    aliases = parameter_names(module)  # a tied parameter is selected by any of its names
    if callable(selection) and not isinstance(selection, str):
        what = "the `params` predicate"
        chosen = {
            name: param
            for name, param in named
            if any(predicate_verdict(selection, alias, param, what, where) for alias in aliases[name])
        }
    else:
        patterns = [selection] if isinstance(selection, str) else list(selection)
        chosen = {
            name: param
            for name, param in named
            if any(fnmatch.fnmatchcase(alias, p) for alias in aliases[name] for p in patterns)
        }
        what = f"`params` pattern{'s' if len(patterns) > 1 else ''} {patterns if len(patterns) > 1 else patterns[0]!r}"
    if not chosen:
        names = [name for name, _ in named]
        listing = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        raise ValueError(f"{where}: {what} selects no parameter of the module; its parameters are {listing}.")
    return chosen


def predicate_verdict(predicate: Callable, name: str, parameter: torch.Tensor, what: str, where: str) -> bool:
    """``predicate(name, parameter)``, which must be a bool (``what`` names the predicate in the TypeError)."""
    verdict = predicate(name, parameter)
    if not isinstance(verdict, bool):
        raise TypeError(
            f"{where}: {what} must return a bool for (name, parameter), got {show(verdict)} for {name!r}."
        )
    return verdict


def _private_copies(tensors: Mapping[str, torch.Tensor], lazy: bool = False) -> dict[str, torch.Tensor]:
    """Detached clones; names tied to one tensor get one clone, so they stay tied."""
    clones: dict[int, torch.Tensor] = {}
    for tensor in tensors.values():
        if id(tensor) not in clones:
            clones[id(tensor)] = _private_copy(tensor, lazy)
    return {name: clones[id(tensor)] for name, tensor in tensors.items()}


_LAZY_CLONE = getattr(torch, "_lazy_clone", None)
_COPY_ON_WRITE_DEVICES = ("cpu", "cuda")


def _private_copy(tensor: torch.Tensor, lazy: bool) -> torch.Tensor:
    """A detached clone of ``tensor``, copy-on-write where ``lazy`` and possible (NOTE: [Modules
    are never mutated])."""
    detached = tensor.detach()
    if (
        lazy and _LAZY_CLONE is not None and type(detached) is torch.Tensor and detached.layout == torch.strided
        and detached.device.type in _COPY_ON_WRITE_DEVICES and not detached.is_quantized
    ):
        try:
            return _LAZY_CLONE(detached)
        except RuntimeError:  # memory with a foreign owner (torch.from_numpy) cannot be shared so
            pass
    return detached.clone()


def _private_evaluation(module: nn.Module, recurrent: bool) -> Callable[[dict, tuple, dict], Any]:
    """``evaluate(tensors, args, kwargs)``: ``module(*args, **kwargs)`` with ``tensors`` in place of its
    own, on this thread's shell of the module (NOTE: [Modules are never mutated]); ``recurrent``:
    whether it holds an ``nn.RNNBase``."""
    local = threading.local()  # NOTE: [Thread-local state] in _utils/threads.py
    local.shell = private_shell(module)

    def evaluate(tensors: dict, args: tuple, kwargs: dict) -> Any:
        shell = getattr(local, "shell", None)
        if shell is None:  # another thread than the one that built the model
            shell = local.shell = private_shell(module)
        on_cuda = recurrent and any(tensor.is_cuda for tensor in tensors.values())
        with plain_checkpoints(), (recurrent_layers_without_cudnn() if on_cuda else contextlib.nullcontext()):
            # NOTE: [Checkpoints run plain], NOTE: [Hooks that ask for gradients]; cuDNN: see
            # recurrent_layers_without_cudnn
            with ignored_by_global_hooks():
                # every name of a tied tensor is in ``tensors`` (_tied_names): no walk of the module to tie them
                return torch.func.functional_call(shell, tensors, args, kwargs, tie_weights=False, strict=False)

    return evaluate


def _callable_model(f: Callable, params: Any, where: str) -> FunctionalModel:
    if params is None:
        raise TypeError(
            f"{where}: `f` is a function f(params, x, **kwargs), so `params` is required (the "
            f"pytree of tensors to differentiate); only nn.Modules supply their own parameters."
        )
    flat = Flat.of(params)
    if not flat.leaves:
        raise ValueError(f"{where}: `params` has no tensors, so there is no parameter to differentiate.")
    names = tuple(f"params leaf {index}" for index in range(len(flat.leaves)))
    f = compiled_function(f)  # NOTE: [Compiled modules]
    leaves = tuple(
        float_parameter(leaf, f"parameter {name!r}", where).detach() for leaf, name in zip(flat.leaves, names)
    )

    def call(param_leaves: tuple, args: tuple, kwargs: Mapping[str, Any]) -> Any:
        with plain_checkpoints():  # NOTE: [Checkpoints run plain]
            return f(flat.rebuild(param_leaves), *args, **kwargs)

    return FunctionalModel(call, leaves, names, params_tree=flat)


def float_parameter(value: Any, what: str, where: str) -> torch.Tensor:
    """``value`` if it is a floating-point (or complex) tensor; ``what`` names it in the errors.

    Raises:
        TypeError: not a tensor, or an integer or boolean tensor.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {what} must be a tensor, got {show(value)}.")
    if not (value.is_floating_point() or value.is_complex()):
        raise TypeError(
            f"{where}: {what} has dtype {value.dtype}; only floating-point "
            f"parameters can be differentiated."
        )
    return value


def warn_training_mode(model: FunctionalModel, where: str) -> None:
    """Warns when a module in training mode has batch statistics or random layers."""
    layers = [f"{layer} (batch statistics)" for layer in model.batch_coupled]
    layers += [f"{layer} (random in training mode)" for layer in model.random]
    if layers:
        # One short line: a ResNet has 20 BatchNorms, and the notice is what most users need to read
        shown = ", ".join(layers[:2]) + (f" and {len(layers) - 2} more" if len(layers) > 2 else "")
        warnings.warn(
            f"{where}: training mode, {shown}: the kernel is that of the model as called, examples coupled "
            f"(buffers unchanged); model.eval() gives the usual per-example kernel.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )


def reject_vmap_with_coupling(model: FunctionalModel, where: str) -> None:
    """``vmap_axes`` promises per-example independence, which these layers break."""
    if model.batch_coupled:
        raise ValueError(
            f"{where}: `vmap_axes` says examples are independent, but {', '.join(model.batch_coupled)} "
            f"normalises with batch statistics, which couples them. Call model.eval() (running "
            f"statistics) or pass vmap_axes=None."
        )
    if model.random:
        raise ValueError(
            f"{where}: `vmap_axes` is set, but {', '.join(model.random)} draws random numbers in "
            f"training mode, which a per-example evaluation cannot reproduce. Call model.eval() or "
            f"pass vmap_axes=None."
        )
