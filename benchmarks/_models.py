"""Benchmark models shared by the torch and JAX sides of ``bench_core.py``.

Each model exists twice: as a ``torch.nn.Module`` (what torchntk sees) and as
a plain JAX ``apply(params, x)`` function (what neural-tangents sees).  The
JAX parameters are the torch weights converted to arrays, kept under the same
names and in the same layouts (Linear weights ``(out, in)``, Conv2d weights
``OIHW``), so both libraries differentiate exactly the same function.

Only ``torch`` is imported at module level; the JAX helpers import ``jax``
lazily so that the torch-only workers never load it.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import numpy as np
import torch
from torch import nn

MODEL_SEED = 0
INPUT_SEED = 1

# name -> (N1, N2, per-example input shape, human-readable description)
MODEL_SPECS: Dict[str, Tuple[int, int, Tuple[int, ...], str]] = {
    "mlp": (64, 64, (784,), "MLP 784-512-512-10 (ReLU), N1=N2=64"),
    "cnn": (16, 16, (3, 16, 16),
            "CNN 3x[Conv2d 3x3 32ch pad 1 + ReLU] -> Linear(8192,10), "
            "NCHW 16x3x16x16, N1=N2=16"),
}


def build_torch_model(name: str) -> nn.Module:
    """Deterministically initialised float32 model, in eval mode."""
    torch.manual_seed(MODEL_SEED)
    if name == "mlp":
        model = nn.Sequential(
            nn.Linear(784, 512), nn.ReLU(),
            nn.Linear(512, 512), nn.ReLU(),
            nn.Linear(512, 10),
        )
    elif name == "cnn":
        model = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
            nn.Flatten(),
            nn.Linear(32 * 16 * 16, 10),
        )
    else:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODEL_SPECS)}")
    return model.float().eval()


def make_inputs(name: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Two different standard-normal float32 batches ``x1`` and ``x2``."""
    n1, n2, shape, _ = MODEL_SPECS[name]
    gen = torch.Generator().manual_seed(INPUT_SEED)
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

def jax_params(state: Dict[str, np.ndarray]):
    """Torch ``state_dict`` arrays -> dict of ``jnp`` arrays (same names/layouts)."""
    import jax.numpy as jnp
    return {k: jnp.asarray(v, dtype=jnp.float32) for k, v in state.items()}


def _dense(p, prefix: str, h):
    import jax.numpy as jnp
    # torch Linear: y = h W^T + b, W of shape (out, in)
    return jnp.dot(h, p[prefix + ".weight"].T) + p[prefix + ".bias"]


def _conv_same(p, prefix: str, h):
    import jax
    y = jax.lax.conv_general_dilated(
        h, p[prefix + ".weight"],
        window_strides=(1, 1),
        padding=((1, 1), (1, 1)),
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
    )
    return y + p[prefix + ".bias"][None, :, None, None]


def _mlp_apply(params, x):
    import jax
    h = jax.nn.relu(_dense(params, "0", x))
    h = jax.nn.relu(_dense(params, "2", h))
    return _dense(params, "4", h)


def _cnn_apply(params, x):
    import jax
    h = jax.nn.relu(_conv_same(params, "0", x))
    h = jax.nn.relu(_conv_same(params, "2", h))
    h = jax.nn.relu(_conv_same(params, "4", h))
    h = h.reshape(h.shape[0], -1)  # same C-major order as nn.Flatten on NCHW
    return _dense(params, "7", h)


def jax_apply_fn(name: str) -> Callable:
    if name == "mlp":
        return _mlp_apply
    if name == "cnn":
        return _cnn_apply
    raise ValueError(f"unknown model {name!r}")
