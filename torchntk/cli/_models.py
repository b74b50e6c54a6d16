"""The command line's models: built-in MLPs and CNNs, user factories, and their JAX twins.

Built-in models are ``nn.Sequential`` stacks of ``Linear``, ``Conv2d`` (3x3, padding 1), ``ReLU``
and ``Flatten``, initialised from a fixed seed. :func:`jax_twin` turns such a stack into a
JAX ``apply(params, x)`` computing the same function with the same weights, which is how
``torchntk bench`` gives neural-tangents exactly the model torchntk sees.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ._inputs import InputSpec

MODEL_SEED = 0


class UsageError(Exception):
    """A bad command-line argument: reported as one line, exit status 2."""


@dataclass(frozen=True)
class ModelChoice:
    """A model for the command line and the shape of one input example; ``jax_twin``: whether
    :func:`jax_twin` can translate it (a ``Sequential`` of the built-in layer types)."""

    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    description: str
    jax_twin: bool = True


def mlp(input_dim: int = 784, width: int = 512, depth: int = 2, outputs: int = 10) -> nn.Sequential:
    """``depth`` hidden ReLU layers of ``width``, then ``outputs`` logits."""
    layers: list[nn.Module] = []
    features = input_dim
    for _ in range(depth):
        layers += [nn.Linear(features, width), nn.ReLU()]
        features = width
    layers.append(nn.Linear(features, outputs))
    return nn.Sequential(*layers)


def cnn(
    channels: int = 32, depth: int = 3, image: tuple[int, int, int] = (3, 16, 16), outputs: int = 10
) -> nn.Sequential:
    """``depth`` 3x3 convolutions of ``channels`` (padding 1, ReLU), flattened into a linear readout."""
    layers: list[nn.Module] = []
    features = image[0]
    for _ in range(depth):
        layers += [nn.Conv2d(features, channels, 3, padding=1), nn.ReLU()]
        features = channels
    layers += [nn.Flatten(), nn.Linear(channels * image[1] * image[2], outputs)]
    return nn.Sequential(*layers)


class _BasicBlock(nn.Module):
    """ResNet's two 3x3 convolutions with batch norm and a shortcut (a strided 1x1 convolution
    where the shape changes). Attribute names are torchvision's, so state dicts carry over."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        y = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(y + shortcut)


class ResNet18(nn.Module):
    """ResNet-18 as torchvision builds it (the same layers, names and parameter count: 11,689,512
    with 1000 classes), so that the benchmarks need not import torchvision, whose wheel must match
    the installed torch build."""

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths = [(64, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 2)]
        for index, (cin, cout, stride) in enumerate(widths, start=1):
            setattr(self, f"layer{index}", nn.Sequential(_BasicBlock(cin, cout, stride), _BasicBlock(cout, cout, 1)))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def seeded(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """``build`` run from ``MODEL_SEED`` without touching the caller's random state; modules
    are put in eval mode (the demo and the benchmarks compute kernels, they do not train)."""
    def make() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(MODEL_SEED)
            model = build()
        return model.eval() if isinstance(model, nn.Module) else model
    return make


DEMO_MODELS = {
    "mlp": ModelChoice("mlp", seeded(lambda: mlp(64, 256, 2, 10)), (64,), "MLP 64-256-256-10 (ReLU)"),
    "cnn": ModelChoice(
        "cnn", seeded(lambda: cnn(16, 2, (3, 16, 16), 10)), (3, 16, 16),
        "CNN 2x[Conv2d 3x3 16ch + ReLU] -> Linear(4096, 10)",
    ),
}
"""Small enough that every implementation runs in seconds on a laptop CPU."""

BENCH_MODELS = {
    "mlp": ModelChoice("mlp", seeded(lambda: mlp(784, 512, 2, 10)), (784,), "MLP 784-512-512-10 (ReLU)"),
    "wide": ModelChoice(
        "wide", seeded(lambda: mlp(256, 2048, 3, 10)), (256,), "wide MLP 256-2048-2048-2048-10 (ReLU)"
    ),
    "cnn": ModelChoice(
        "cnn", seeded(lambda: cnn(32, 3, (3, 16, 16), 10)), (3, 16, 16),
        "CNN 3x[Conv2d 3x3 32ch + ReLU] -> Linear(8192, 10)",
    ),
    "fcn": ModelChoice("fcn", seeded(lambda: mlp(3072, 2048, 3, 8)), (3072,), "FCN 3072-2048x3-8 (ReLU)"),
    "resnet18": ModelChoice(
        "resnet18", seeded(lambda: ResNet18(8)), (3, 224, 224), "ResNet-18, 224x224, 8 logits", jax_twin=False
    ),
    "resnet18-1000": ModelChoice(
        "resnet18-1000", seeded(lambda: ResNet18(1000)), (3, 224, 224), "ResNet-18, 224x224, 1000 logits",
        jax_twin=False,
    ),
}
"""The models of the benchmark tables in ``docs/benchmarks.md``. ``fcn`` and the ResNets are the
settings of neural-tangents' published GPU timings (the "Fast Finite Width NTK" paper); the
ResNets have no JAX twin here, so neural-tangents is not run on them."""

JAX_LAYOUTS = ("in-out", "out-in")
"""How :func:`jax_twin` stores dense weights: ``(in, out)`` used as ``h @ W`` (what neural-tangents'
structured derivatives analyse best), or torch's ``(out, in)`` used as ``h @ W.T``."""


class ModelFailure(Exception):
    """The user's model failed at ``step`` (importing its module, calling its factory): exit status 3.

    Attributes:
        step: what was being done, e.g. ``"building (the factory call)"``.
        error: the exception the user's code raised, or one saying what was wrong with its result.
    """

    def __init__(self, step: str, error: BaseException):
        super().__init__(f"{step}: {error}")
        self.step = step
        self.error = error


def user_model(path: str, input_shape: tuple[int, ...] | None) -> ModelChoice:
    """``module:callable`` -> the module the callable returns (called with no arguments).

    The module is imported here, like ``python -m``: from the current directory or ``sys.path``.
    A module that raises while it is imported becomes a model whose build raises
    :class:`ModelFailure`, so that the other models still run.

    Raises:
        UsageError: a malformed path (with a hint for a file name such as ``my_models.py``), a
            module that cannot be found, a missing or non-callable attribute, or no ``--input-shape``.
    """
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"--model {path!r}: expected 'mlp', 'cnn' or 'module:callable' (e.g. 'my_models:make_net')")
    hint = _file_hint(module_name, attribute)
    if hint:
        raise UsageError(f"--model {path!r}: {hint}")
    if input_shape is None:
        raise UsageError(f"--model {path!r}: give the shape of one input example with --input-shape (e.g. 3,32,32)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # what `python -m` does; the `torchntk` script does not
    try:
        factory: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not (module_name == error.name or module_name.startswith(error.name + ".")):
            return _failed(path, input_shape, f"importing {module_name!r}", error)  # what it imports is missing
        raise UsageError(f"--model {path!r}: cannot import {module_name!r} ({error}); the module must be in the "
                         "current directory or on PYTHONPATH") from None
    except (Exception, SystemExit) as error:
        return _failed(path, input_shape, f"importing {module_name!r}", error)
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise UsageError(f"--model {path!r}: {module_name!r} has no attribute {attribute!r}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise UsageError(f"--model {path!r}: {attribute!r} is not callable")
    step = "building (the factory call)"

    def build() -> nn.Module:
        try:
            model = seeded(factory)()
        except (Exception, SystemExit) as error:
            raise ModelFailure(step, error) from error
        if not isinstance(model, nn.Module):
            raise ModelFailure(step, TypeError(f"{attribute}() returned {type(model).__name__}, not an nn.Module"))
        return model

    return ModelChoice(path, build, input_shape, f"{path}()")


def _file_hint(module_name: str, attribute: str) -> str:
    """What to write instead of a file name or path in ``--model``, or ``""``."""
    if not (module_name.endswith(".py") or "/" in module_name or os.sep in module_name):
        return ""
    folder, file = os.path.split(module_name)
    stem = file[:-3] if file.endswith(".py") else file
    where = f", run from {folder!r} or add it to PYTHONPATH" if folder else ""
    return f"give the module's name, not its file: --model {stem}:{attribute}{where}"


def _failed(path: str, input_shape: tuple[int, ...], step: str, error: BaseException) -> ModelChoice:
    """A model whose build raises ``error`` at ``step`` (recorded as the model's failure)."""

    def build() -> nn.Module:
        raise ModelFailure(step, error)

    return ModelChoice(path, build, input_shape, f"{path}()")


def inputs(shape: tuple[int, ...], n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``n`` standard-normal examples of ``shape``, the same for every run."""
    return InputSpec(shape).make(n, dtype, device)


_SAME_3X3 = ((3, 3), (1, 1), (1, 1))
"""``(kernel_size, padding, stride)`` of the convolutions :func:`jax_twin` translates."""


def jax_twin(model: nn.Module, layout: str = "in-out") -> tuple[Callable[[Any, Any], Any], dict]:
    """``(apply, params)``: the JAX function of a ``Sequential`` of the built-in layer types.

    With ``layout="in-out"`` (the default) dense weights are stored ``(in, out)`` so that
    ``apply`` computes ``h @ W``: neural-tangents' structured derivatives analyse only a
    parameter's first consumer, and a transpose there makes them as slow as Jacobian contraction
    (see ``docs/benchmarks.md``). ``"out-in"`` keeps torch's ``(out, in)`` and computes ``h @ W.T``.

    Raises:
        TypeError: a layer other than Linear, Conv2d (3x3, stride 1, padding 1), ReLU, Flatten.
        ValueError: an unknown ``layout``.
    """
    import jax
    import jax.numpy as jnp

    if layout not in JAX_LAYOUTS:
        raise ValueError(f"jax_twin: layout must be one of {JAX_LAYOUTS}, got {layout!r}")

    params: dict = {}
    steps: list[Callable] = []
    for index, layer in enumerate(model):
        key = str(index)
        if isinstance(layer, nn.Linear):
            weight = layer.weight.detach().cpu().numpy()
            bias = jnp.asarray(layer.bias.detach().cpu().numpy())
            params[key] = (jnp.asarray(weight.T if layout == "in-out" else weight), bias)
            if layout == "in-out":
                steps.append(lambda p, h, key=key: h @ p[key][0] + p[key][1])
            else:
                steps.append(lambda p, h, key=key: h @ p[key][0].T + p[key][1])
        elif isinstance(layer, nn.Conv2d) and (layer.kernel_size, layer.padding, layer.stride) == _SAME_3X3:
            weight, bias = (jnp.asarray(t.detach().cpu().numpy()) for t in (layer.weight, layer.bias))
            params[key] = (weight, bias)

            def convolve(p, h, key=key):
                weight, bias = p[key]
                y = jax.lax.conv_general_dilated(
                    h, weight, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW")
                )
                return y + bias[None, :, None, None]

            steps.append(convolve)
        elif isinstance(layer, nn.ReLU):
            steps.append(lambda p, h: jax.nn.relu(h))
        elif isinstance(layer, nn.Flatten):
            steps.append(lambda p, h: h.reshape(h.shape[0], -1))
        else:
            raise TypeError(f"jax_twin: no JAX version of layer {index} ({type(layer).__name__})")

    def apply(p, x):
        for step in steps:
            x = step(p, x)
        return x

    return apply, params
