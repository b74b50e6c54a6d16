"""Real architectures as users bring them, built from configs with random weights.

torchvision, timm, transformers, peft and e3nn are optional: the library needs none of them. Where one
does not import, the tests that need it are skipped, each with the reason, and the run's summary
counts them (``tests/conftest.py``). Users install them as ``docs/real_models.md`` says (torchvision
from the index their torch came from), which leaves every import working.

CI (``.ci/run``) must run every zoo test, on a CPU-only machine that cannot reach PyTorch's own
index: its pip finds the CPU torch on disk but only PyPI's torchvision, which is built against
PyPI's CUDA torch. Beside the CPU torch that wheel's compiled ops library does not load, and its
import then fails while registering fake kernels for those ops (``operator torchvision::nms does
not exist``); timm and transformers import torchvision and fail with it. The model definitions are
pure Python and use none of those ops, so CI sets two variables:

* ``TORCHNTK_TEST_STUB_TORCHVISION_OPS=1``: :func:`skip_torchvision_op_registrations` puts an
  empty ``torchvision._meta_registrations`` module in place (for a CPU torch only), and
  torchvision then imports; ``tests/conftest.py`` calls it for the test run, docs examples
  included, and :func:`import_torchvision` for scripts such as ``benchmarks/bench_zoo.py``.
* ``TORCHNTK_TEST_REQUIRE_ZOO=1``: a library that still does not import fails its tests instead of
  skipping them.

Neither belongs in a user's set-up: on a machine whose torchvision matches its torch, nothing needs
stubbing.

Every builder returns ``(module, x1, x2, kwargs, vmap_axes, output_fn)``; ``kwargs`` values are
``(for x1, for x2)`` pairs as kernel functions take them. ``reference_module`` turns the same
model into a module of one input pytree for ``torchntk.testing.reference_ntk``, whose keyword
arguments cannot differ between x1 and x2.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch import nn

from torchntk._call.outputs import output_fn_argument

STUB_VARIABLE = "TORCHNTK_TEST_STUB_TORCHVISION_OPS"
REQUIRE_VARIABLE = "TORCHNTK_TEST_REQUIRE_ZOO"
SKIP_PREFIX = "optional library"
"""How the skip reasons of :func:`optional` start, for the run's summary (``tests/conftest.py``)."""

OPTIONAL = ("torchvision", "timm", "transformers", "peft", "e3nn", "torch_geometric", "torchani", "schnetpack", "mace")
NOT_INSTALLED_BY_CI = ("torchani", "schnetpack", "mace")
"""Optional libraries of the recipes in docs/scientific.md that ``.ci/run`` does not install (their
dependencies reach beyond ``--no-deps``): skipped where they do not import, even under
``TORCHNTK_TEST_REQUIRE_ZOO=1``."""
_BEFORE_IMPORT = {"schnetpack": "docs/scientific.md"}
"""Libraries whose import needs the set-up their recipe shows first: schnetpack 2.1 imports
``T_co`` from ``torch.utils.data.dataloader``, which later torch releases dropped."""
_LOADED_LAZILY = {
    "transformers": "transformers.modeling_utils", "peft": "transformers.modeling_utils", "e3nn": "e3nn.o3",
}
"""What else to import to know that a library imports: transformers loads its models, whose code is
what imports torchvision, only when they are used; e3nn's ``o3`` is a subpackage it does not import."""


def skip_torchvision_op_registrations() -> None:
    """Lets PyPI's CUDA-built torchvision import beside a CPU torch, where CI asks for it (see the
    module docstring); does nothing otherwise."""
    if os.environ.get(STUB_VARIABLE) == "1" and torch.version.cuda is None and "torchvision" not in sys.modules:
        sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))


def optional(name: str) -> types.ModuleType:
    """The optional library ``name``; where it does not import, the test is skipped saying why (it
    fails instead under ``TORCHNTK_TEST_REQUIRE_ZOO=1``), and outside a test ImportError says why.
    """
    skip_torchvision_op_registrations()
    try:
        if name in _BEFORE_IMPORT:
            define_dataloader_t_co()
        if name in _LOADED_LAZILY:
            importlib.import_module(_LOADED_LAZILY[name])
        return importlib.import_module(name)
    except Exception as error:  # a broken install raises more than ImportError (RuntimeError from torch)
        reason = (f"{SKIP_PREFIX} {name} does not import ({type(error).__name__}: {' '.join(str(error).split())}); "
                  "docs/real_models.md says how to install it")
    if "_pytest" not in sys.modules:  # a script (a benchmark, also one a test started)
        raise ImportError(reason)
    import pytest

    if os.environ.get(REQUIRE_VARIABLE) == "1" and name not in NOT_INSTALLED_BY_CI:
        pytest.fail(f"{reason}; {REQUIRE_VARIABLE}=1 requires it", pytrace=False)
    pytest.skip(reason)


def define_dataloader_t_co() -> None:
    """What schnetpack 2.1 imports from ``torch.utils.data.dataloader`` and torch 2.13 dropped, as
    its recipe in docs/scientific.md defines it."""
    import typing

    import torch.utils.data.dataloader as loader

    if not hasattr(loader, "T_co"):
        loader.T_co = typing.TypeVar("T_co", covariant=True)


def import_torchvision():
    return optional("torchvision")


def import_transformers():
    transformers = optional("transformers")
    transformers.utils.logging.set_verbosity_error()
    return transformers


def import_peft():
    import_transformers()
    return optional("peft")


def import_timm():
    return optional("timm")


class Case(NamedTuple):
    module: nn.Module
    x1: Any
    x2: Any
    kwargs: dict
    vmap_axes: Any
    output_fn: Optional[Callable] = None


class FirstOutput(nn.Module):
    """An RNN or attention layer as the first element of what it returns."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.layer, nn.MultiheadAttention):
            return self.layer(x, x, x, need_weights=False)[0]
        output = self.layer(x)
        return output[0] if isinstance(output, tuple) else output


class TiedAutoencoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 8) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight.T) @ self.weight


class AniWithForces(nn.Module):
    """docs/scientific.md's torchani recipe: energies ``(N, 1)`` and forces ``(N, 5, 3)`` of
    methane, the forces taken by ``torch.autograd.grad`` inside ``forward`` (skipped, saying why,
    where torchani does not import)."""

    def __init__(self) -> None:
        super().__init__()
        os.environ.setdefault("TORCHANI_NO_WARN_EXTENSIONS", "1")  # its CUDA extensions are not needed
        self.ani = optional("torchani").arch.simple_ani(
            ("H", "C"), "wb97x-631gd", repulsion=False, self_energies="zero", radial_shifts=8, angular_shifts=4,
            sections=2,
        )
        self.register_buffer("species", torch.tensor([6, 1, 1, 1, 1]))

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = positions.clone().requires_grad_()
        energies = self.ani((self.species.expand(len(positions), -1), positions)).energies
        forces = -torch.autograd.grad(energies.sum(), positions, create_graph=self.training)[0]
        return energies[:, None], forces


def hooked_mlp() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    model[0].register_forward_hook(lambda module, args, output: output * 2)
    model[2].register_forward_pre_hook(lambda module, args: (args[0] + 0.5,))
    return model


def _images(size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, 3, size, size), torch.randn(2, 3, size, size)


def _sequences(features: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(3, 5, features), torch.randn(2, 5, features)


def _plain(module: nn.Module, x1: Any, x2: Any) -> Case:
    return Case(module.eval(), x1, x2, {}, 0)


def lstm() -> Case:
    return _plain(FirstOutput(nn.LSTM(4, 6, batch_first=True)), *_sequences(4))


def gru() -> Case:
    return _plain(FirstOutput(nn.GRU(4, 6, num_layers=2, batch_first=True)), *_sequences(4))


def multihead_attention() -> Case:
    return _plain(FirstOutput(nn.MultiheadAttention(8, 2, batch_first=True)), *_sequences(8))


def transformer_encoder() -> Case:
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    return _plain(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), *_sequences(8))


def weight_norm() -> Case:
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(8, 6)), nn.Tanh(), nn.Linear(6, 3))
    return _plain(model, torch.randn(3, 8), torch.randn(2, 8))


def tied_autoencoder() -> Case:
    return _plain(TiedAutoencoder(), torch.randn(3, 8), torch.randn(2, 8))


def hooks() -> Case:
    return _plain(hooked_mlp(), torch.randn(3, 8), torch.randn(2, 8))


def torchvision_vit() -> Case:
    models = import_torchvision().models
    model = models.VisionTransformer(
        image_size=16, patch_size=8, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16, num_classes=3
    )
    return _plain(model, *_images(16))


def resnet18() -> Case:
    return _plain(import_torchvision().models.resnet18(num_classes=3), *_images())


def mobilenet_v3_small() -> Case:
    return _plain(import_torchvision().models.mobilenet_v3_small(num_classes=3), *_images())


def efficientnet_b0() -> Case:
    return _plain(import_torchvision().models.efficientnet_b0(num_classes=3), *_images())


def timm_vit() -> Case:
    model = import_timm().create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, num_classes=3, depth=1,
        embed_dim=16, num_heads=2,
    )
    return _plain(model, *_images())


def _tokens(vocabulary: int) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    ids1, ids2 = torch.randint(0, vocabulary, (3, 6)), torch.randint(0, vocabulary, (2, 6))
    mask1, mask2 = torch.ones(3, 6, dtype=torch.long), torch.ones(2, 6, dtype=torch.long)
    mask1[1, 4:] = 0  # padding
    mask2[0, 3:] = 0
    return ids1, ids2, (mask1, mask2)


def last_token_logits(output: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The logits at the last non-padding token of each sequence (right padding)."""
    last = attention_mask.sum(-1) - 1
    return output.logits[torch.arange(input_ids.shape[0]), last]


def bert() -> Case:
    transformers = import_transformers()
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=16, num_labels=3,
    )
    ids1, ids2, masks = _tokens(50)
    model = transformers.BertForSequenceClassification(config).eval()
    return Case(model, ids1, ids2, {"attention_mask": masks}, (0, 0, {"attention_mask": 0}), lambda out: out.logits)


def gpt2() -> Case:
    transformers = import_transformers()
    config = transformers.GPT2Config(
        vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    ids1, ids2, masks = _tokens(50)
    model = transformers.GPT2LMHeadModel(config).eval()
    return Case(model, ids1, ids2, {"attention_mask": masks}, (0, 0, {"attention_mask": 0}), last_token_logits)


def bert_lora() -> Case:
    """``bert`` with peft's LoRA (r = 2) on the attention's query and value: peft freezes the base
    model, so the kernel is over the adapters only, the workload users run most."""
    peft = import_peft()
    case = bert()
    config = peft.LoraConfig(r=2, lora_alpha=4, lora_dropout=0.0, target_modules=["query", "value"],
                             init_lora_weights=False)  # random B too: the kernel over A is not zero
    model = peft.get_peft_model(case.module, config).eval()
    return case._replace(module=model)


FAST = {
    "lstm": lstm, "gru": gru, "multihead_attention": multihead_attention, "transformer_encoder": transformer_encoder,
    "weight_norm": weight_norm, "tied_autoencoder": tied_autoencoder, "hooks": hooks,
    "torchvision_vit": torchvision_vit, "timm_vit": timm_vit, "bert": bert, "bert_lora": bert_lora, "gpt2": gpt2,
}
SLOW = {"resnet18": resnet18, "mobilenet_v3_small": mobilenet_v3_small, "efficientnet_b0": efficientnet_b0}


class ReferenceModule(nn.Module):
    """``case.module`` as a module of one input pytree ``(x, kwargs)``, with ``output_fn`` applied,
    for the brute-force reference (the same parameter names, under ``model.``)."""

    def __init__(self, case: Case):
        super().__init__()
        self.model = case.module
        self.output_fn = case.output_fn

    def forward(self, inputs: tuple) -> Any:
        x, kwargs = inputs
        output = self.model(x, **kwargs)
        if self.output_fn is None:
            return output
        return output_fn_argument(self.output_fn, "reference")(output, x, kwargs)


def reference_inputs(case: Case) -> tuple[Any, Any]:
    kwargs1 = {key: value[0] for key, value in case.kwargs.items()}
    kwargs2 = {key: value[1] for key, value in case.kwargs.items()}
    return (case.x1, kwargs1), (case.x2, kwargs2)
