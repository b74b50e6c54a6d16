"""Model cases shared by the kernel tests: small float64 modules with readable ids.

Nothing is built at import time. ``CASES`` maps an id to a factory; calling the factory builds a
:class:`ModelCase` with a seeded, float64 module in eval mode. Draw inputs with
:func:`make_x1_x2`, which gives ``N1 = 3`` and ``N2 = 2`` examples.

On the device of the test run (``pytest --device cuda``, see ``tests/conftest.py``): the modules
are moved there when built and the inputs when drawn, from the same CPU generator, so every device
sees the same numbers.

Example::

    case = CASES["cnn"]()
    x1, x2 = make_x1_x2(case)
    reference_ntk(case.module, x1, x2, trace_axes=case.trace_axes)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

N1 = 3
N2 = 2
DEFAULT_SEED = 0
DEVICE = torch.device("cpu")
"""Where the cases' modules and inputs live; ``tests/conftest.py`` sets it from ``--device``."""

PyTree = Any
InputMaker = Callable[[int, torch.Generator], PyTree]


@dataclass(frozen=True)
class ModelCase:
    """One test model and how to feed it.

    Attributes:
        id: readable name, used as the pytest id.
        module: float64 module in eval mode, parameters drawn from a fixed seed.
        make_inputs: ``make_inputs(n, generator)`` returns an input pytree with batch size ``n``
            (float64 tensors, or int64 token ids).
        trace_axes: trace axes suited to the output (the feature/channel axis).
        batch_independent: True when ``f(x)`` is the concatenation of ``f`` on single examples
            along axis 0 of every input and output leaf, so ``vmap_axes=0`` is valid.
        output_shapes: shapes of the output leaves for a batch of ``n`` (``n`` written as -1),
            listed in pytree leaf order; handy for shape assertions.
    """

    id: str
    module: nn.Module
    make_inputs: InputMaker
    trace_axes: tuple[int, ...]
    batch_independent: bool
    output_shapes: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        draw = self.make_inputs

        def on_device(n: int, generator: torch.Generator) -> PyTree:
            return to_device(draw(n, generator))

        object.__setattr__(self, "make_inputs", on_device)


def make_x1_x2(case: ModelCase, seed: int = DEFAULT_SEED) -> tuple[PyTree, PyTree]:
    """Inputs with ``N1`` and ``N2`` examples from one seeded generator (x1 drawn first)."""
    generator = torch.Generator().manual_seed(seed)
    return case.make_inputs(N1, generator), case.make_inputs(N2, generator)


def _build(module_fn: Callable[[], nn.Module], seed: int) -> nn.Module:
    """Build under a forked global RNG so parameter init is seeded without side effects: modules are
    made on the CPU, and only the CPU generator (which the fork restores) is seeded, not CUDA's."""
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(seed)
        module = module_fn()
    return module.to(torch.float64).to(DEVICE).eval()


class BoundWrapper(nn.Module):
    """A wrapper in OptimizedModule's manner: the module registered as ``_orig_mod``, and a forward
    bound to that module object."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self._orig_mod = module
        self.forward = module.__call__


def to_device(tree: PyTree) -> PyTree:
    """The tensors of ``tree`` moved to :data:`DEVICE` (the test run's device)."""
    return pytree.tree_map(lambda leaf: leaf.to(DEVICE) if isinstance(leaf, Tensor) else leaf, tree)


def _normal(*shape: int) -> InputMaker:
    """Input maker for one float64 tensor of shape ``(n, *shape)``."""

    def make(n: int, generator: torch.Generator) -> Tensor:
        return torch.randn(n, *shape, generator=generator, dtype=torch.float64)

    return make


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


class _SharedLayer(nn.Module):
    """The same Linear applied twice (one parameter, two uses), then a head."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        hidden = torch.tanh(self.shared(x))
        hidden = torch.tanh(self.shared(hidden))
        return self.head(hidden)


class _TiedWeights(nn.Module):
    """Two Linear modules sharing one weight Parameter (named_parameters lists it once)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(5, 5)
        self.second = nn.Linear(5, 5)
        self.second.weight = self.first.weight
        self.head = nn.Linear(5, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.second(torch.tanh(self.first(x)))))


class _EmbeddingModel(nn.Module):
    """Token ids (N, L) -> embeddings (N, L, 5) -> tanh -> Linear -> (N, L, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(11, 5)
        self.linear = nn.Linear(5, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.linear(torch.tanh(self.embedding(tokens)))


class _TupleOutput(nn.Module):
    """(N, 4) -> (tanh (N, 5), (N, 2, 3)) from a shared trunk."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 6)
        self.head_a = nn.Linear(6, 5)
        self.head_b = nn.Linear(6, 6)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        hidden = torch.tanh(self.trunk(x))
        return torch.tanh(self.head_a(hidden)), self.head_b(hidden).reshape(-1, 2, 3)


class _DictInput(nn.Module):
    """{'u': (N, 4), 'v': (N, 2)} -> (N, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.u_proj = nn.Linear(4, 5)
        self.v_proj = nn.Linear(2, 5, bias=False)
        self.head = nn.Linear(5, 3)

    def forward(self, x: dict[str, Tensor]) -> Tensor:
        return self.head(torch.tanh(self.u_proj(x["u"]) + self.v_proj(x["v"])))


class _DictOutput(nn.Module):
    """(N, 4) -> {'mean': (N, 3), 'scale': (N, 2)}."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 6)
        self.mean = nn.Linear(6, 3)
        self.scale = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        hidden = torch.tanh(self.trunk(x))
        return {"mean": self.mean(hidden), "scale": nn.functional.softplus(self.scale(hidden))}


def _batchnorm_cnn() -> nn.Module:
    model = nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1),
        nn.BatchNorm2d(3),
        nn.Tanh(),
        nn.Conv2d(3, 2, 1),
    )
    batchnorm = model[1]
    # Non-trivial running stats and affine parameters, so eval-mode normalisation matters.
    with torch.no_grad():
        batchnorm.running_mean.copy_(torch.tensor([0.3, -0.2, 0.1]))
        batchnorm.running_var.copy_(torch.tensor([0.5, 2.0, 1.3]))
        batchnorm.weight.copy_(torch.tensor([1.2, 0.7, -0.9]))
        batchnorm.bias.copy_(torch.tensor([0.1, -0.3, 0.2]))
    return model


def _layernorm_mlp() -> nn.Module:
    model = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))
    with torch.no_grad():  # move the affine parameters off their (1, 0) initialisation
        model[1].weight.add_(0.3 * torch.randn(8))
        model[1].bias.add_(0.3 * torch.randn(8))
    return model


def _frozen_mlp() -> nn.Module:
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    model[0].requires_grad_(False)
    return model


# --------------------------------------------------------------------------------------------
# Factories
# --------------------------------------------------------------------------------------------


def mlp(seed: int = DEFAULT_SEED) -> ModelCase:
    """8 -> 16 -> 4 with tanh; output (N, 4)."""
    module = _build(lambda: nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)), seed)
    return ModelCase("mlp", module, _normal(8), (-1,), True, ((-1, 4),))


def cnn(seed: int = DEFAULT_SEED) -> ModelCase:
    """Two SAME convolutions, no flatten: (N, 2, 6, 5) -> (N, 3, 6, 5); channel axis 1 traced."""
    module = _build(
        lambda: nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.Tanh(), nn.Conv2d(4, 3, 3, padding=1)
        ),
        seed,
    )
    return ModelCase("cnn", module, _normal(2, 6, 5), (1,), True, ((-1, 3, 6, 5),))


def shared_layer(seed: int = DEFAULT_SEED) -> ModelCase:
    """One Linear(6, 6) called twice, then Linear(6, 3); output (N, 3)."""
    module = _build(_SharedLayer, seed)
    return ModelCase("shared_layer", module, _normal(6), (-1,), True, ((-1, 3),))


def tied_weights(seed: int = DEFAULT_SEED) -> ModelCase:
    """Two Linear(5, 5) sharing one weight Parameter, then Linear(5, 2); output (N, 2)."""
    module = _build(_TiedWeights, seed)
    return ModelCase("tied_weights", module, _normal(5), (-1,), True, ((-1, 2),))


def frozen_layer(seed: int = DEFAULT_SEED) -> ModelCase:
    """Linear(5, 7) frozen (requires_grad False) -> tanh -> Linear(7, 3); output (N, 3)."""
    module = _build(_frozen_mlp, seed)
    return ModelCase("frozen_layer", module, _normal(5), (-1,), True, ((-1, 3),))


def batchnorm_eval(seed: int = DEFAULT_SEED) -> ModelCase:
    """Conv -> BatchNorm2d (eval, set running stats) -> tanh -> 1x1 conv: (N,2,4,3) -> (N,2,4,3)."""
    module = _build(_batchnorm_cnn, seed)
    return ModelCase("batchnorm_eval", module, _normal(2, 4, 3), (1,), True, ((-1, 2, 4, 3),))


def layernorm(seed: int = DEFAULT_SEED) -> ModelCase:
    """Linear(6, 8) -> LayerNorm(8) -> tanh -> Linear(8, 3); output (N, 3)."""
    module = _build(_layernorm_mlp, seed)
    return ModelCase("layernorm", module, _normal(6), (-1,), True, ((-1, 3),))


def embedding(seed: int = DEFAULT_SEED) -> ModelCase:
    """Integer tokens (N, 4) in [0, 11) -> Embedding(11, 5) -> tanh -> Linear(5, 3): (N, 4, 3)."""

    def make_tokens(n: int, generator: torch.Generator) -> Tensor:
        return torch.randint(0, 11, (n, 4), generator=generator)

    module = _build(_EmbeddingModel, seed)
    return ModelCase("embedding", module, make_tokens, (-1,), True, ((-1, 4, 3),))


def tuple_output(seed: int = DEFAULT_SEED) -> ModelCase:
    """(N, 4) -> (tanh (N, 5), (N, 2, 3)); one kernel per output leaf."""
    module = _build(_TupleOutput, seed)
    return ModelCase("tuple_output", module, _normal(4), (-1,), True, ((-1, 5), (-1, 2, 3)))


def dict_input(seed: int = DEFAULT_SEED) -> ModelCase:
    """{'u': (N, 4), 'v': (N, 2)} -> (N, 3)."""

    def make_dict(n: int, generator: torch.Generator) -> dict[str, Tensor]:
        return {"u": _normal(4)(n, generator), "v": _normal(2)(n, generator)}

    module = _build(_DictInput, seed)
    return ModelCase("dict_input", module, make_dict, (-1,), True, ((-1, 3),))


def dict_output(seed: int = DEFAULT_SEED) -> ModelCase:
    """(N, 4) -> {'mean': (N, 3), 'scale': (N, 2)}; one kernel per key."""
    module = _build(_DictOutput, seed)
    return ModelCase("dict_output", module, _normal(4), (-1,), True, ((-1, 3), (-1, 2)))


CASES: dict[str, Callable[..., ModelCase]] = {
    "mlp": mlp,
    "cnn": cnn,
    "shared_layer": shared_layer,
    "tied_weights": tied_weights,
    "frozen_layer": frozen_layer,
    "batchnorm_eval": batchnorm_eval,
    "layernorm": layernorm,
    "embedding": embedding,
    "tuple_output": tuple_output,
    "dict_input": dict_input,
    "dict_output": dict_output,
}
