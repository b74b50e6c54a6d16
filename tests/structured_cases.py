"""Model cases for the structured-derivatives tests (``implementation=3``): small float64 modules.

Like ``tests/cases.py`` (whose :class:`ModelCase`, :func:`make_x1_x2` and seeded ``_build`` these
reuse), nothing is built at import time: ``STRUCTURED_CASES`` maps an id to a factory, and calling
the factory builds a :class:`ModelCase` with a seeded float64 module in eval mode (except
``"batchnorm_train"``, which is in training mode on purpose). Each case exercises a layer or a
parameter use that a structured NTK must handle: strided/dilated/grouped convolutions, padding
modes, BatchNorm with running statistics, attention (self and cross), tied and reused weights,
parameters used by ops without a closed-form rule, pytree outputs, and batch-coupled layers.

Example::

    case = STRUCTURED_CASES["resnet_bn_eval"]()
    x1, x2 = make_x1_x2(case)
    reference_ntk(case.module, x1, x2, trace_axes=case.trace_axes)
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.cases import (
    DEFAULT_SEED,
    N1,
    N2,
    InputMaker,
    ModelCase,
    _build,
    _normal,
    make_x1_x2,
    tuple_output,
)

__all__ = ["N1", "N2", "STRUCTURED_CASES", "ModelCase", "make_x1_x2"]


def _perturb_(*tensors: Tensor, scale: float = 0.3) -> None:
    """Move parameters (e.g. norm affine weights at 1 and 0) off their initialisation."""
    with torch.no_grad():
        for tensor in tensors:
            tensor.add_(scale * torch.randn(tensor.shape, dtype=tensor.dtype))


def _tokens(vocabulary: int, length: int, padding_idx: int | None = None) -> InputMaker:
    """Input maker for int64 token ids ``(n, length)``; with ``padding_idx``, every example ends
    with one padding token and (when ``n > 1``) example 0 has a second one in the middle."""

    def make(n: int, generator: torch.Generator) -> Tensor:
        tokens = torch.randint(0, vocabulary, (n, length), generator=generator)
        if padding_idx is not None:
            tokens[:, -1] = padding_idx
            tokens[0, length // 2] = padding_idx
        return tokens

    return make


# --------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------


def _mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 3)
    )


def _cnn_stride_dilation_groups() -> nn.Module:
    """(N, 2, 9, 8) -> stride 2 -> (N, 4, 4, 3) -> dilation 2, groups 2, padding 2 -> (N, 4, 4, 3)
    -> groups 2, no bias -> (N, 2, 3, 2) -> flatten 12 -> Linear -> (N, 3)."""
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2),
        nn.Tanh(),
        nn.Conv2d(4, 4, 3, dilation=2, groups=2, padding=2),
        nn.Tanh(),
        nn.Conv2d(4, 2, 2, groups=2, bias=False),
        nn.Flatten(),
        nn.Linear(12, 3),
    )


def _conv_padding_modes() -> nn.Module:
    """(N, 2, 7, 6): 'same' with kernels 3, 4 (asymmetric padding) and 2 dilated by 3, 'same' +
    circular, reflect, replicate (asymmetric amounts), 'valid'; then flatten + Linear -> (N, 3)."""
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding="same"),
        nn.Tanh(),
        nn.Conv2d(3, 3, 4, padding="same"),  # total padding 3 per axis: 1 before, 2 after
        nn.Tanh(),
        nn.Conv2d(3, 3, 2, padding="same", dilation=3),  # total 3 again, via dilation
        nn.Tanh(),
        nn.Conv2d(3, 3, (3, 2), padding="same", padding_mode="circular"),
        nn.Tanh(),
        nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect"),
        nn.Tanh(),
        nn.Conv2d(3, 3, 3, padding=(1, 2), padding_mode="replicate"),  # -> (N, 3, 7, 8)
        nn.Tanh(),
        nn.Conv2d(3, 2, (3, 4), padding="valid"),  # -> (N, 2, 5, 5)
        nn.Flatten(),
        nn.Linear(50, 3),
    )


def _conv1d() -> nn.Module:
    """(N, 2, 11) -> stride 2 -> (N, 4, 5) -> groups 2, padding 1 -> (N, 4, 5) -> 1x1 -> (N, 3, 5)."""
    return nn.Sequential(
        nn.Conv1d(2, 4, 3, stride=2),
        nn.Tanh(),
        nn.Conv1d(4, 4, 3, groups=2, padding=1),
        nn.Tanh(),
        nn.Conv1d(4, 3, 1),
    )


def _conv3d() -> nn.Module:
    """(N, 1, 4, 5, 4) -> (N, 3, 3, 4, 3) -> stride (1, 2, 1), groups 3 -> (N, 3, 2, 2, 4) -> (N, 2, 2, 2, 4)."""
    return nn.Sequential(
        nn.Conv3d(1, 3, 2),
        nn.Tanh(),
        nn.Conv3d(3, 3, 2, stride=(1, 2, 1), groups=3, padding=(0, 0, 1)),
        nn.Tanh(),
        nn.Conv3d(3, 2, 1),
    )


def _random_bn(channels: int) -> nn.BatchNorm2d:
    """BatchNorm2d with random running statistics (positive variances) and affine parameters."""
    batchnorm = nn.BatchNorm2d(channels)
    with torch.no_grad():
        batchnorm.running_mean.copy_(0.5 * torch.randn(channels))
        batchnorm.running_var.copy_(0.5 + 1.5 * torch.rand(channels))
        batchnorm.weight.copy_(1.0 + 0.4 * torch.randn(channels))
        batchnorm.bias.copy_(0.3 * torch.randn(channels))
    return batchnorm


class _BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN + shortcut, ReLU; strided 1x1 conv + BN projection if needed."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _random_bn(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = _random_bn(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), _random_bn(c_out)
            )

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + self.shortcut(x))


class _ResNet(nn.Module):
    """(N, 2, 6, 5) -> stem -> identity block -> strided projection block -> mean pool -> (N, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False), _random_bn(4), nn.ReLU())
        self.block1 = _BasicBlock(4, 4)
        self.block2 = _BasicBlock(4, 6, stride=2)
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.block2(self.block1(self.stem(x)))
        return self.head(h.mean(dim=(2, 3)))


class _TransformerBlock(nn.Module):
    """Tokens (N, T) -> Embedding(V, E) -> pre-LN block (self-attention, GELU MLP) -> (N, T, V)."""

    def __init__(self, vocabulary: int = 7, embed: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, embed)
        self.ln1 = nn.LayerNorm(embed)
        self.attention = nn.MultiheadAttention(embed, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(embed)
        self.mlp = nn.Sequential(nn.Linear(embed, 12), nn.GELU(), nn.Linear(12, embed))
        self.head = nn.Linear(embed, vocabulary)
        _perturb_(self.ln1.weight, self.ln1.bias, self.ln2.weight, self.ln2.bias)
        _perturb_(self.attention.in_proj_bias, self.attention.out_proj.bias)  # initialised to 0

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embedding(tokens)
        a = self.ln1(h)
        h = h + self.attention(a, a, a, need_weights=False)[0]  # q is k is v: self-attention
        h = h + self.mlp(self.ln2(h))
        return self.head(h)


class _CrossAttention(nn.Module):
    """{'q': (N, 3, 6), 'kv': (N, 4, 5)} -> MHA(query, key=value) -> Linear -> (N, 3, 3).

    ``kdim == vdim == embed_dim`` (so one packed ``in_proj_weight``) with a query distinct from
    key/value: PyTorch splits the packed weight into the query rows and the key/value rows.
    """

    def __init__(self) -> None:
        super().__init__()
        self.kv_proj = nn.Linear(5, 6)
        self.attention = nn.MultiheadAttention(6, 2, batch_first=True)
        self.head = nn.Linear(6, 3)
        _perturb_(self.attention.in_proj_bias, self.attention.out_proj.bias)

    def forward(self, x: dict[str, Tensor]) -> Tensor:
        kv = torch.tanh(self.kv_proj(x["kv"]))
        out, _ = self.attention(x["q"], kv, kv, need_weights=False)
        return self.head(out)


class _TiedEmbeddingLM(nn.Module):
    """Tokens (N, T) -> Embedding(V, E, padding_idx=0) -> tanh(Linear) -> F.linear(h, emb.weight).

    The padding row is set non-zero: PyTorch's convention is that the lookup contributes no
    gradient to that row, but the tied output projection still does.
    """

    def __init__(self, vocabulary: int = 9, embed: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocabulary, embed, padding_idx=0)
        self.linear = nn.Linear(embed, embed)
        with torch.no_grad():
            self.emb.weight[0].copy_(0.5 * torch.randn(embed))

    def forward(self, tokens: Tensor) -> Tensor:
        h = torch.tanh(self.linear(self.emb(tokens)))
        return F.linear(h, self.emb.weight)


class _LinearTwice(nn.Module):
    """One Linear(5, 5) applied twice (tanh between), then a head Linear(5, 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 5)
        self.head = nn.Linear(5, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.linear(torch.tanh(self.linear(x)))))


class _RecurrentCell(nn.Module):
    """An Elman cell unrolled over the sequence axis: ``w_ih`` and ``w_hh`` (with their biases) are
    consumed once per step, then a head Linear(6, 4) reads the last state."""

    def __init__(self) -> None:
        super().__init__()
        self.input = nn.Linear(3, 6)
        self.hidden = nn.Linear(6, 6)
        self.head = nn.Linear(6, 4)

    def forward(self, x: Tensor) -> Tensor:  # (N, T, 3) -> (N, 4)
        h = torch.zeros(*x.shape[:-2], 6, dtype=x.dtype, device=x.device)
        for step in range(x.shape[-2]):
            h = torch.tanh(self.input(x[..., step, :]) + self.hidden(h))
        return self.head(h)


class _MixedRuledUnruled(nn.Module):
    """Normal layers mixed with parameters used by ops without a closed-form rule.

    (N, 4) -> Linear -> exp(log_scale) * h -> h * gamma + beta (broadcast) -> GroupNorm(2, 6) ->
    softplus(h) + 0.5 -> pow(power) -> h @ W.T -> + cumsum(offsets) -> tanh -> Linear -> (N, 3).
    """

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 6)
        self.log_scale = nn.Parameter(0.3 * torch.randn(6))
        self.gamma = nn.Parameter(1.0 + 0.3 * torch.randn(1, 6))
        self.beta = nn.Parameter(0.3 * torch.randn(6))
        self.norm = nn.GroupNorm(2, 6)
        self.power = nn.Parameter(1.0 + 0.2 * torch.randn(6))
        self.W = nn.Parameter(torch.randn(5, 6) / 6**0.5)
        self.offsets = nn.Parameter(0.3 * torch.randn(5))
        self.head = nn.Linear(5, 3)
        _perturb_(self.norm.weight, self.norm.bias)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear(x)
        h = torch.exp(self.log_scale) * h
        h = h * self.gamma + self.beta
        h = self.norm(h)
        h = (F.softplus(h) + 0.5).pow(self.power)
        h = h @ self.W.T + torch.cumsum(self.offsets, dim=0)
        return self.head(torch.tanh(h))


def _layernorm_groupnorm() -> nn.Module:
    """(N, 2, 5, 4) -> conv -> GroupNorm(2, 4) -> tanh -> 1x1 conv -> LayerNorm((5, 4)): (N, 3, 5, 4)."""
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.Tanh(),
        nn.Conv2d(4, 3, 1),
        nn.LayerNorm((5, 4)),
    )
    _perturb_(model[1].weight, model[1].bias, model[4].weight, model[4].bias)
    return model


def _batchnorm_train() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))
    _perturb_(model[1].weight, model[1].bias)
    return model


# --------------------------------------------------------------------------------------------
# Factories
# --------------------------------------------------------------------------------------------


def mlp(seed: int = DEFAULT_SEED) -> ModelCase:
    """5 -> 8 -> 7 -> 3 with ReLU and biases; output (N, 3)."""
    return ModelCase("mlp", _build(_mlp, seed), _normal(5), (-1,), True, ((-1, 3),))


def cnn_stride_dilation_groups(seed: int = DEFAULT_SEED) -> ModelCase:
    """Conv2d with stride 2, dilation 2 + groups 2, groups 2 without bias; flatten + Linear: (N, 3)."""
    module = _build(_cnn_stride_dilation_groups, seed)
    return ModelCase("cnn_stride_dilation_groups", module, _normal(2, 9, 8), (-1,), True, ((-1, 3),))


def conv_padding_modes(seed: int = DEFAULT_SEED) -> ModelCase:
    """'same' (odd, even, dilated), 'valid', reflect, replicate, circular; output (N, 3)."""
    module = _build(_conv_padding_modes, seed)
    return ModelCase("conv_padding_modes", module, _normal(2, 7, 6), (-1,), True, ((-1, 3),))


def conv1d(seed: int = DEFAULT_SEED) -> ModelCase:
    """Conv1d with stride and groups on (N, 2, 11); output (N, 3, 5), channel axis 1 traced."""
    return ModelCase("conv1d", _build(_conv1d, seed), _normal(2, 11), (1,), True, ((-1, 3, 5),))


def conv3d(seed: int = DEFAULT_SEED) -> ModelCase:
    """Conv3d on (N, 1, 4, 5, 4); output (N, 2, 2, 2, 4), channel axis 1 traced."""
    module = _build(_conv3d, seed)
    return ModelCase("conv3d", module, _normal(1, 4, 5, 4), (1,), True, ((-1, 2, 2, 2, 4),))


def resnet_bn_eval(seed: int = DEFAULT_SEED) -> ModelCase:
    """Two basic blocks (identity, strided 1x1 projection), eval BatchNorm2d; output (N, 3)."""
    module = _build(_ResNet, seed)
    return ModelCase("resnet_bn_eval", module, _normal(2, 6, 5), (-1,), True, ((-1, 3),))


def transformer_block(seed: int = DEFAULT_SEED) -> ModelCase:
    """Tokens (N, 4) in [0, 7) -> pre-LN transformer block -> (N, 4, 7); vocabulary axis traced."""
    module = _build(_TransformerBlock, seed)
    return ModelCase("transformer_block", module, _tokens(7, 4), (-1,), True, ((-1, 4, 7),))


def cross_attention(seed: int = DEFAULT_SEED) -> ModelCase:
    """{'q': (N, 3, 6), 'kv': (N, 4, 5)} -> cross-attention -> (N, 3, 3)."""

    def make(n: int, generator: torch.Generator) -> dict[str, Tensor]:
        return {"q": _normal(3, 6)(n, generator), "kv": _normal(4, 5)(n, generator)}

    module = _build(_CrossAttention, seed)
    return ModelCase("cross_attention", module, make, (-1,), True, ((-1, 3, 3),))


def tied_embedding_lm(seed: int = DEFAULT_SEED) -> ModelCase:
    """Tokens (N, 5) in [0, 9) with padding index 0 -> tied-embedding LM -> (N, 5, 9)."""
    module = _build(_TiedEmbeddingLM, seed)
    return ModelCase("tied_embedding_lm", module, _tokens(9, 5, padding_idx=0), (-1,), True, ((-1, 5, 9),))


def linear_twice(seed: int = DEFAULT_SEED) -> ModelCase:
    """The same Linear(5, 5) applied twice, then Linear(5, 4); output (N, 4)."""
    return ModelCase("linear_twice", _build(_LinearTwice, seed), _normal(5), (-1,), True, ((-1, 4),))


def recurrent_cell(seed: int = DEFAULT_SEED) -> ModelCase:
    """An Elman cell over 6 steps of (N, 6, 3): each weight used 6 times; output (N, 4)."""
    return ModelCase("recurrent_cell", _build(_RecurrentCell, seed), _normal(6, 3), (-1,), True, ((-1, 4),))


def mixed_ruled_unruled(seed: int = DEFAULT_SEED) -> ModelCase:
    """exp/pow/cumsum of parameters, broadcast scale/shift, raw matmul, GroupNorm; output (N, 3)."""
    module = _build(_MixedRuledUnruled, seed)
    return ModelCase("mixed_ruled_unruled", module, _normal(4), (-1,), True, ((-1, 3),))


def layernorm_groupnorm(seed: int = DEFAULT_SEED) -> ModelCase:
    """GroupNorm on a conv map, LayerNorm over the last two axes; output (N, 3, 5, 4), axis 1 traced."""
    module = _build(_layernorm_groupnorm, seed)
    return ModelCase("layernorm_groupnorm", module, _normal(2, 5, 4), (1,), True, ((-1, 3, 5, 4),))


def batchnorm_train(seed: int = DEFAULT_SEED) -> ModelCase:
    """Linear -> BatchNorm1d in TRAINING mode -> tanh -> Linear: (N, 3); couples examples."""
    module = _build(_batchnorm_train, seed).train()
    return ModelCase("batchnorm_train", module, _normal(4), (-1,), False, ((-1, 3),))


STRUCTURED_CASES: dict[str, Callable[..., ModelCase]] = {
    "mlp": mlp,
    "cnn_stride_dilation_groups": cnn_stride_dilation_groups,
    "conv_padding_modes": conv_padding_modes,
    "conv1d": conv1d,
    "conv3d": conv3d,
    "resnet_bn_eval": resnet_bn_eval,
    "transformer_block": transformer_block,
    "cross_attention": cross_attention,
    "tied_embedding_lm": tied_embedding_lm,
    "linear_twice": linear_twice,
    "recurrent_cell": recurrent_cell,
    "mixed_ruled_unruled": mixed_ruled_unruled,
    "tuple_output": tuple_output,
    "layernorm_groupnorm": layernorm_groupnorm,
    "batchnorm_train": batchnorm_train,
}
