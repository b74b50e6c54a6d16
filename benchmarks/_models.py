"""Benchmark models shared by ``bench_core.py`` and ``bench_structured.py``.

``mlp``, ``wide`` and ``cnn`` exist twice: as a ``torch.nn.Module`` (what
torchntk sees) and as a plain JAX ``apply(params, x)`` function (what
neural-tangents sees). The JAX parameters are the torch weights converted to
arrays, kept under the same names; dense weights are stored ``(in, out)``
(``h @ W``, the layout neural-tangents' structured derivatives analyse best)
or, with ``layout="out-in"``, in torch's ``(out, in)`` (``h @ W.T``); Conv2d
weights stay ``OIHW``. Both libraries differentiate exactly the same function.
``resnet`` and ``transformer`` are torch-only (``JAX_MODELS`` lists the
others).

Only ``torch`` is imported at module level; the JAX helpers import ``jax``
lazily so that the torch-only workers never load it.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

import numpy as np
import torch
from torch import nn

from torchntk.cli._models import BENCH_MODELS, mlp, seeded

MODEL_SEED = 0
INPUT_SEED = 1

# name -> (N1, N2, per-example input shape, human-readable description)
MODEL_SPECS: Dict[str, Tuple[int, int, Tuple[int, ...], str]] = {
    "mlp": (64, 64, (784,), "MLP 784-512-512-10 (ReLU), N1=N2=64"),
    "wide": (32, 32, (256,), "wide MLP 256-2048-2048-2048-10 (ReLU), N1=N2=32"),
    "cnn": (16, 16, (3, 16, 16),
            "CNN 3x[Conv2d 3x3 32ch pad 1 + ReLU] -> Linear(8192,10), "
            "NCHW 16x3x16x16, N1=N2=16"),
    "resnet": (16, 16, (3, 16, 16),
               "ResNet: Conv 3x3 16ch + BN + ReLU, BasicBlock 16->16, BasicBlock 16->32 "
               "(stride 2, 1x1 conv + BN shortcut), global average pool, Linear(32,10); "
               "BatchNorm in eval mode with non-trivial running statistics; "
               "NCHW 16x3x16x16, N1=N2=16"),
    "transformer": (16, 16, (16,),
                    "Transformer block: token + position Embedding (vocab 50, d_model 64), "
                    "pre-LN MultiheadAttention(4 heads, batch_first) + residual, "
                    "pre-LN MLP 64-128-64 (GELU) + residual, final LayerNorm, mean over "
                    "the 16 tokens, Linear(64,50) head (logits over the vocabulary); "
                    "int64 tokens of length 16, N1=N2=16"),
}

# Models whose inputs are integer token ids: name -> vocabulary size.
TOKEN_VOCAB: Dict[str, int] = {"transformer": 50}

# Models that also have a JAX version (``jax_apply_fn``), for neural-tangents.
JAX_MODELS = ("mlp", "wide", "cnn")

# Dense weight layouts of the JAX twins: "in-out" stores W as (in, out) and computes h @ W;
# "out-in" keeps torch's (out, in) and computes h @ W.T.
JAX_LAYOUTS = ("in-out", "out-in")


class BasicBlock(nn.Module):
    """torchvision-style ResNet basic block: two 3x3 convs (no bias) with
    BatchNorm, identity or 1x1-conv + BatchNorm shortcut, ReLU after the sum."""

    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return torch.relu(h + self.shortcut(x))


class SmallResNet(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(16), nn.ReLU())
        self.layer1 = BasicBlock(16, 16)
        self.layer2 = BasicBlock(16, 32, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        h = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(h), 1))


class TinyTransformer(nn.Module):
    """One pre-LN transformer block, mean-pooled over the tokens, with a
    vocabulary-sized head.

    ``tokens`` of shape ``(N, L)`` (int64) -> logits ``(N, vocab)``.  (Pooled
    rather than a per-token head: ``L * vocab`` outputs per example would make
    the Jacobian-based implementations 16x as costly, too slow for a routine
    benchmark on a 2-core CPU; every layer still acts on all ``L`` tokens.)
    """

    def __init__(self, vocab: int = 50, seq_len: int = 16, d_model: int = 64,
                 heads: int = 4, hidden: int = 128):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = nn.MultiheadAttention(d_model, heads, dropout=0.0, batch_first=True)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, hidden), nn.GELU(),
                                 nn.Linear(hidden, d_model))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[-1], device=tokens.device)
        h = self.tok(tokens) + self.pos(positions)
        a = self.ln1(h)
        h = h + self.attn(a, a, a, need_weights=False)[0]
        h = h + self.mlp(self.ln2(h))
        return self.head(self.ln_f(h).mean(dim=-2))


def _randomise_norms(model: nn.Module) -> None:
    """Non-trivial affine parameters and running statistics for every
    BatchNorm / LayerNorm, so that eval-mode normalisation is not close to the
    identity (fresh BatchNorm has mean 0, variance 1, weight 1, bias 0)."""
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, (nn.BatchNorm2d, nn.LayerNorm)):
                mod.weight.copy_(1.0 + 0.2 * torch.randn_like(mod.weight))
                mod.bias.copy_(0.1 * torch.randn_like(mod.bias))
            if isinstance(mod, nn.BatchNorm2d):
                mod.running_mean.copy_(0.1 * torch.randn_like(mod.running_mean))
                mod.running_var.copy_(0.5 + torch.rand_like(mod.running_var))


def build_torch_model(name: str) -> nn.Module:
    """Deterministically initialised float32 model, in eval mode."""
    if name in BENCH_MODELS:  # the same seeded models as `python -m torchntk bench`
        return BENCH_MODELS[name].build().float().eval()
    if name == "wide":  # a torchntk checkout older than the "wide" bench model (--torchntk-root)
        return seeded(lambda: mlp(256, 2048, 3, 10))().float().eval()
    torch.manual_seed(MODEL_SEED)
    if name == "resnet":
        model = SmallResNet()
        _randomise_norms(model)
    elif name == "transformer":
        vocab = TOKEN_VOCAB[name]
        model = TinyTransformer(vocab=vocab, seq_len=MODEL_SPECS[name][2][0])
        _randomise_norms(model)
    else:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODEL_SPECS)}")
    return model.float().eval()


def make_inputs(name: str, n: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two different standard-normal float32 batches ``x1`` and ``x2`` (uniform
    int64 token ids for the models in ``TOKEN_VOCAB``), of the model's N1, N2 or
    of ``n`` examples each."""
    n1, n2, shape, _ = MODEL_SPECS[name]
    if n is not None:
        n1 = n2 = n
    gen = torch.Generator().manual_seed(INPUT_SEED)
    if name in TOKEN_VOCAB:
        vocab = TOKEN_VOCAB[name]
        x1 = torch.randint(vocab, (n1,) + shape, generator=gen, dtype=torch.int64)
        x2 = torch.randint(vocab, (n2,) + shape, generator=gen, dtype=torch.int64)
        return x1, x2
    x1 = torch.randn((n1,) + shape, generator=gen, dtype=torch.float32)
    x2 = torch.randn((n2,) + shape, generator=gen, dtype=torch.float32)
    return x1, x2


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def state_to_numpy(model: nn.Module) -> Dict[str, np.ndarray]:
    return {k: v.detach().cpu().numpy().copy() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------
# JAX side
# --------------------------------------------------------------------------

def jax_params(state: Dict[str, np.ndarray], layout: str = "in-out"):
    """Torch ``state_dict`` arrays -> dict of ``jnp`` arrays (same names and values).

    With ``layout="in-out"`` dense weights are stored transposed, ``(in, out)``, the
    layout JAX models use, so that the JAX model computes ``h @ W`` with no transpose
    in front of the product: neural-tangents' structured derivatives only analyse a
    parameter's first consumer, and a transpose there makes them as slow as Jacobian
    contraction (4.6 s instead of 18 ms on the benchmark MLP). ``"out-in"`` keeps
    torch's ``(out, in)`` (the model then computes ``h @ W.T``). Conv filters keep
    PyTorch's OIHW layout.
    """
    import jax.numpy as jnp
    if layout not in JAX_LAYOUTS:
        raise ValueError(f"layout must be one of {JAX_LAYOUTS}, got {layout!r}")
    params = {}
    for name, value in state.items():
        if name.endswith(".weight") and value.ndim == 2 and layout == "in-out":
            value = value.T.copy()
        params[name] = jnp.asarray(value, dtype=jnp.float32)
    return params


def _dense(p, prefix: str, h, layout: str = "in-out"):
    import jax.numpy as jnp
    # torch Linear: y = h W^T + b; the "in-out" JAX copy of W is already (in, out)
    weight = p[prefix + ".weight"]
    return jnp.dot(h, weight if layout == "in-out" else weight.T) + p[prefix + ".bias"]


def _conv_same(p, prefix: str, h):
    import jax
    y = jax.lax.conv_general_dilated(
        h, p[prefix + ".weight"],
        window_strides=(1, 1),
        padding=((1, 1), (1, 1)),
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
    )
    return y + p[prefix + ".bias"][None, :, None, None]


def _mlp_apply(params, x, layers: int = 3, layout: str = "in-out"):
    import jax
    h = x
    for k in range(layers - 1):  # Linear, ReLU pairs: modules 0, 2, 4, ...
        h = jax.nn.relu(_dense(params, str(2 * k), h, layout))
    return _dense(params, str(2 * (layers - 1)), h, layout)


def _cnn_apply(params, x, layout: str = "in-out"):
    import jax
    h = jax.nn.relu(_conv_same(params, "0", x))
    h = jax.nn.relu(_conv_same(params, "2", h))
    h = jax.nn.relu(_conv_same(params, "4", h))
    h = h.reshape(h.shape[0], -1)  # same C-major order as nn.Flatten on NCHW
    return _dense(params, "7", h, layout)


def jax_apply_fn(name: str, layout: str = "in-out") -> Callable:
    """``apply(params, x)`` of ``name`` for parameters from ``jax_params(state, layout)``."""
    import functools
    if layout not in JAX_LAYOUTS:
        raise ValueError(f"layout must be one of {JAX_LAYOUTS}, got {layout!r}")
    if name == "mlp":
        return functools.partial(_mlp_apply, layers=3, layout=layout)
    if name == "wide":
        return functools.partial(_mlp_apply, layers=4, layout=layout)
    if name == "cnn":
        return functools.partial(_cnn_apply, layout=layout)
    raise ValueError(f"model {name!r} has no JAX version (those that do: {JAX_MODELS})")


# --------------------------------------------------------------------------
# NTK-parameterised MLP (Monte Carlo benchmark, ``bench_batching.py``)
# --------------------------------------------------------------------------

# One hidden ReLU layer, as neural-tangents' ``stax.serial(Dense(512, W_std, b_std), Relu(),
# Dense(10, W_std, b_std))`` in its default NTK parameterisation.
NTK_MLP = dict(d=64, width=512, k=10, W_std=1.5, b_std=0.05)


class NtkDense(nn.Module):
    """``W_std * x @ W.T / sqrt(in_features) + b_std * b`` with ``W``, ``b`` ~ N(0, 1), drawn by
    ``reset_parameters`` (neural-tangents' ``stax.Dense`` with ``parameterization='ntk'``)."""

    def __init__(self, in_features: int, out_features: int, W_std: float = 1.0, b_std: float = 0.0):
        super().__init__()
        self.W_std, self.b_std = float(W_std), float(b_std)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        nn.init.normal_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.W_std / float(np.sqrt(self.weight.shape[1]))
        return x @ self.weight.T * scale + self.b_std * self.bias


def build_ntk_mlp(d: int = NTK_MLP["d"], width: int = NTK_MLP["width"], k: int = NTK_MLP["k"],
                  W_std: float = NTK_MLP["W_std"], b_std: float = NTK_MLP["b_std"]) -> nn.Module:
    """``NtkDense(d, width) -> ReLU -> NtkDense(width, k)``, float32, eval mode, seeded."""
    torch.manual_seed(MODEL_SEED)
    model = nn.Sequential(NtkDense(d, width, W_std, b_std), nn.ReLU(),
                          NtkDense(width, k, W_std, b_std))
    return model.float().eval()


def ntk_mlp_stax(width: int = NTK_MLP["width"], k: int = NTK_MLP["k"],
                 W_std: float = NTK_MLP["W_std"], b_std: float = NTK_MLP["b_std"]):
    """neural-tangents' ``(init_fn, apply_fn, kernel_fn)`` of the same network (NT must be
    importable: see ``_common.import_neural_tangents``)."""
    from neural_tangents import stax
    return stax.serial(stax.Dense(width, W_std=W_std, b_std=b_std), stax.Relu(),
                       stax.Dense(k, W_std=W_std, b_std=b_std))
