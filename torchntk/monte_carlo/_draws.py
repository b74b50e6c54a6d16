"""Drawing the parameters of Monte Carlo sample ``s``, for :mod:`torchntk.monte_carlo`.

Everything here follows NOTE: [Monte Carlo sample seeds] in ``torchntk/monte_carlo/__init__.py``: sample
``s`` depends only on ``(seed, s)``, is drawn on CPU in the parameters' dtype, and the caller's
global random state is left as it was.
"""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Mapping, Optional

import numpy as np
import torch
from torch import nn

from .._model.functional import float_parameter
from .._model.survey import training_mode_layers
from .._model.wrappers import compiled_wrapper
from .._utils.checks import show
from .._utils.tree import Flat
from .._utils.types import Model
from ..batching._devices import move

_GLOBAL_RNG_LOCK = threading.Lock()
"""Held while the global CPU generator is reseeded to draw a sample (one lock per process)."""


def sample_seed(seed: int, s: int) -> int:
    """The seed of Monte Carlo sample ``s`` (see NOTE: [Monte Carlo sample seeds]).

    Args:
        seed: the non-negative seed given to ``monte_carlo_kernel_fn``.
        s: the global index of the sample, ``0, 1, ...``.

    Returns:
        The first 64-bit word of ``numpy.random.SeedSequence([seed, s]).generate_state(2, numpy.uint64)``.

    Example:
        >>> import numpy as np
        >>> sample_seed(0, 3) == int(np.random.SeedSequence([0, 3]).generate_state(2, np.uint64)[0])
        True
    """
    return int(sample_state(seed, s)[0])


def sample_state(seed: int, s: int) -> tuple[int, int]:
    """``(seed of sample s, seed of the global CPU generator while an init_fn draws sample s)``.

    Two words of one ``SeedSequence``, so an ``init_fn`` that ignores its generator and draws
    from the global one does not replay the generator's stream.
    """
    words = np.random.SeedSequence([seed, s]).generate_state(2, np.uint64)
    return int(words[0]), int(words[1])


class Sampler:
    """Draws the parameters of sample ``s`` for one call (see NOTE: [Monte Carlo sample seeds]).

    Attributes:
        draw: ``draw(s)``, the parameters of sample ``s``, ready to pass as the kernel function's
            ``params``.
    """

    def __init__(self, draw: Callable[[int], Any]):
        self.draw = draw

    @classmethod
    def for_model(cls, f: Model, init_fn: Optional[Callable[..., Any]], seed: int, x1: Any, where: str) -> "Sampler":
        """The sampler of ``f``; the module is checked and copied to CPU once, here.

        Parameters are drawn on CPU so that sample ``s`` is the same on every device, then handed
        over on the device of the module's parameter (functions: of x1's first tensor).

        Raises:
            ValueError: a module with nothing to differentiate, or with BatchNorm using batch
                statistics or active dropout.
            TypeError: a module that cannot be deep-copied.
        """
        if not isinstance(f, nn.Module):
            inputs = [leaf for leaf in Flat.of(x1).leaves if isinstance(leaf, torch.Tensor)]
            device = inputs[0].device if inputs else torch.device("cpu")
            return cls(lambda s: move(draw_functional(init_fn, seed, s, where), device))
        names = [name for name, p in f.named_parameters() if p.requires_grad]
        if not names:
            raise ValueError(
                f"{where}: the module has no parameter with requires_grad=True, so there is nothing to "
                f"redraw or differentiate."
            )
        reject_random_or_coupled(f, where)
        skeleton = cpu_copy(f, where)
        devices = {name: p.device for name, p in f.named_parameters()}

        def draw(s: int) -> dict[str, torch.Tensor]:
            if init_fn is None:
                drawn = draw_by_reset(skeleton, names, seed, s, where)
            else:
                drawn = draw_module_init_fn(init_fn, skeleton, names, seed, s, where)
            return {name: value.to(devices[name]) for name, value in drawn.items()}

        return cls(draw)


def reject_random_or_coupled(module: nn.Module, where: str) -> None:
    """Raises ValueError when a layer makes the forward pass random or batch-coupled.

    Such a pass gives another kernel for every block and every sample, so nothing could be
    reproduced.
    """
    coupled, random = training_mode_layers(module)
    layers = [f"{layer} (uses batch statistics)" for layer in coupled]
    layers += [f"{layer} (random in training mode)" for layer in random]
    if layers:
        raise ValueError(
            f"{where}: {', '.join(layers)}: a forward pass that is random or depends on the rest of the "
            f"batch cannot be reproduced per sample or per block. Call model.eval() (BatchNorm "
            f"then needs track_running_stats=True)."
        )


def cpu_copy(module: nn.Module, where: str) -> nn.Module:
    """A deep copy of ``module`` whose parameters and buffers are on CPU, never copied to its device.

    The ``memo`` of :func:`copy.deepcopy` maps every parameter and buffer to its CPU copy up
    front, so tied parameters stay tied and no device memory is allocated.

    Raises:
        TypeError: the module cannot be deep-copied.
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


def reset_methods(module: nn.Module) -> list[Callable[[], Any]]:
    """``reset_parameters`` (else ``_reset_parameters``) of every submodule, children before parents.

    Post-order is the order in which constructors run, so the draws match a fresh model's.
    """
    seen: set[int] = set()
    methods: list[Callable[[], Any]] = []

    def visit(sub: nn.Module) -> None:
        if id(sub) in seen:
            return
        seen.add(id(sub))
        for child in sub.children():
            visit(child)
        if compiled_wrapper(sub) is not None:
            return  # its attributes are the wrapped module's: a second reset would draw other values
        method = getattr(sub, "reset_parameters", None)
        if not callable(method):
            method = getattr(sub, "_reset_parameters", None)
        if callable(method):
            methods.append(method)

    visit(module)
    return methods


def draw_by_reset(skeleton: nn.Module, names: list[str], seed: int, s: int, where: str) -> dict[str, torch.Tensor]:
    """Sample ``s``'s values of the parameters ``names``, redrawn by the submodules' resets.

    Raises:
        ValueError: a parameter still holds the NaN it was filled with, so no reset covered it.
    """
    seed_s, _ = sample_state(seed, s)
    params = dict(skeleton.named_parameters())
    with _GLOBAL_RNG_LOCK, torch.random.fork_rng(devices=[]):
        with torch.no_grad():
            for name in names:
                params[name].fill_(float("nan"))
        torch.random.default_generator.manual_seed(seed_s)
        for reset in reset_methods(skeleton):
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


def draw_module_init_fn(
    init_fn: Callable[..., Any], skeleton: nn.Module, names: list[str], seed: int, s: int, where: str
) -> dict[str, torch.Tensor]:
    """Sample ``s``'s values of the parameters ``names``, from ``init_fn(module, generator)``.

    Raises:
        TypeError: ``init_fn`` returned something other than a mapping, or a value that is not a
            floating-point tensor.
        ValueError: missing or unknown names, or a value of the wrong shape.
    """
    values = call_init_fn(init_fn, (skeleton,), seed, s)
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


def draw_functional(init_fn: Callable[..., Any], seed: int, s: int, where: str) -> Any:
    """Sample ``s``'s parameter pytree of a function model, from ``init_fn(generator)``.

    Raises:
        ValueError: the pytree has no tensors.
        TypeError: a leaf is not a floating-point or complex tensor.
    """
    params = call_init_fn(init_fn, (), seed, s)
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


def call_init_fn(init_fn: Callable[..., Any], args: tuple, seed: int, s: int) -> Any:
    """``init_fn(*args, generator)`` for sample ``s``, with the global CPU generator seeded too.

    The lock and ``fork_rng`` keep another thread's draws, and the caller's random state, out.
    """
    seed_s, global_seed = sample_state(seed, s)
    generator = torch.Generator("cpu").manual_seed(seed_s)
    with _GLOBAL_RNG_LOCK, torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(global_seed)
        return init_fn(*args, generator)
