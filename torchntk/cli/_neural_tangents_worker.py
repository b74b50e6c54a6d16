"""neural-tangents' side of ``torchntk bench``, in a process of its own.

XLA's worker threads keep spinning after a computation; in the same process they slowed the
next torch call several-fold on a 2-core machine (0.66 s instead of 0.13 s), so the two libraries
never share a process. Run as ``python -m torchntk.cli._neural_tangents_worker SPEC.json``: the
spec names a model of ``BENCH_MODELS``, the sizes, implementations, trace axes and repeats; the
worker rebuilds the same seeded model and inputs, times neural-tangents (jitted) on its JAX twin,
and writes the times and kernels to the spec's ``output`` (``.npz``) and a status line to
``status`` (JSON).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import types

import numpy as np
import torch

from ._models import BENCH_MODELS, inputs, jax_twin


def import_neural_tangents() -> tuple[object, str]:
    """``(module or None, status)``."""
    try:
        import jax
    except ImportError:
        return None, "not installed (pip install jax neural-tangents to compare)"
    # neural_tangents' __init__ imports its TensorFlow bridge; nothing here uses it, and a
    # placeholder spares installing TensorFlow.
    sys.modules.setdefault("neural_tangents.experimental", types.ModuleType("neural_tangents.experimental"))
    try:
        import neural_tangents as nt
    except Exception as error:  # an incompatible jax raises all kinds of errors at import
        return None, f"not importable ({type(error).__name__}: {error})"
    return nt, f"neural-tangents {getattr(nt, '__version__', '?')}, jax {jax.__version__} (jitted)"


def main(spec_path: str) -> int:
    with open(spec_path) as file:
        spec = json.load(file)
    nt, status = import_neural_tangents()
    results: dict = {}
    if nt is not None:
        import jax
        import jax.numpy as jnp

        choice = BENCH_MODELS[spec["model"]]
        apply, params = jax_twin(choice.build(), spec.get("layout", "in-out"))
        for n in spec["sizes"]:
            x = inputs(tuple(choice.input_shape), 2 * n, torch.float32, torch.device("cpu")).numpy()
            x1, x2 = jnp.asarray(x[:n]), jnp.asarray(x[n:])
            for implementation in spec["implementations"]:
                function = nt.empirical_ntk_fn(
                    apply, trace_axes=tuple(spec["trace_axes"]), vmap_axes=0, implementation=implementation
                )
                jitted = jax.jit(function)
                kernel = jitted(x1, x2, params).block_until_ready()  # warm-up: compilation
                times = []
                for _ in range(spec["repeats"]):
                    start = time.perf_counter()
                    kernel = jitted(x1, x2, params).block_until_ready()
                    times.append(time.perf_counter() - start)
                results[f"{n}-{implementation}"] = np.asarray(kernel)
                results[f"{n}-{implementation}-seconds"] = np.asarray(statistics.median(times))
    np.savez(spec["output"], **results)
    with open(spec["status"], "w") as file:
        json.dump({"status": status, "ok": nt is not None}, file)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
