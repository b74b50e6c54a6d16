"""What torchntk's default safety checks cost, against the kernel they protect.

For each model and implementation it times, in one process (float32, ``vmap_axes=0``):

- the kernel call as users make it, first call of a new kernel function (plans made, derivatives
  checked) and later calls (cached), all checks on;
- each check on its own, on the same inputs: the private copies of the module's tensors
  (``functional_model``), the per-example output check (per call), the derivative check of
  ``vmap_axes`` (first call per shapes), the structured plan check against autograd (first call
  per shapes, implementation 3 only), the check for parameters read around their registered
  names (NOTE: [Aliased parameters]: the derivative check's evaluations watched, first call per
  shapes).

Usage: ``python benchmarks/bench_checks.py [--repeats 7] [--threads 2] [--markdown]``. The
results are recorded in docs/guarantees.md and docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from torchntk import empirical_ntk_fn
from torchntk._call.kernel_call import FULL_CHECKS, NO_CHECKS, CallSpec, prepare_call
from torchntk._call.vmap_axes import parse_vmap_axes
from torchntk._implementations.structured import StructuredOptions, plan_for
from torchntk._implementations.structured._verify import disagreements
from torchntk._model.aliases import alias_checks
from torchntk._model.functional import functional_model
from torchntk.cli._models import cnn, mlp, seeded

MODELS = {
    "MLP 784-512-512-10, N=64": (seeded(mlp), (784,), 64),
    "CNN 3x32ch 16x16, N=16": (seeded(cnn), (3, 16, 16), 16),
}


def _median_ms(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _prepare(model, x, trace_axes, **options):
    return prepare_call(
        model, x, None, None, {}, CallSpec(trace_axes, (), vmap_axes=parse_vmap_axes(0, "bench")), where="bench",
        **options,
    )


def measure(model, x, implementation: int, trace_axes, repeats: int) -> dict:
    def fresh_call():
        empirical_ntk_fn(model, trace_axes, vmap_axes=0, implementation=implementation)(x)

    cached = empirical_ntk_fn(model, trace_axes, vmap_axes=0, implementation=implementation)
    cached(x)
    row = {
        "first call": _median_ms(fresh_call, repeats),
        "later calls": _median_ms(lambda: cached(x), repeats),
        "private copies": _median_ms(lambda: functional_model(model, None, "bench"), repeats),
    }
    without = _median_ms(lambda: _prepare(model, x, trace_axes, plan=NO_CHECKS), repeats)
    outputs = _median_ms(lambda: _prepare(model, x, trace_axes, plan=replace(FULL_CHECKS, check_derivatives=False)), repeats)
    everything = _median_ms(lambda: _prepare(model, x, trace_axes), repeats)

    def prepared(skip: bool):
        with alias_checks(skip=skip):
            _prepare(model, x, trace_axes)

    watched = _median_ms(lambda: prepared(False), repeats) - _median_ms(lambda: prepared(True), repeats)
    row["alias check"] = max(watched, 0.0)
    # implementation 3 compares the outputs of the per-example pass it makes anyway
    row["output check"] = max(outputs - without, 0.0) if implementation != 3 else None
    row["derivative check"] = max(everything - outputs, 0.0)
    row["plan check"] = None
    if implementation == 3:
        call = _prepare(model, x, trace_axes, plan=NO_CHECKS)
        plan = plan_for(call, StructuredOptions())
        probe = call.side1.narrow(0, 1)
        row["plan check"] = _median_ms(lambda: disagreements(probe, plan), repeats)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    columns = [
        "first call", "later calls", "private copies", "output check", "derivative check", "plan check", "alias check",
    ]
    print(f"torch {torch.__version__}, {args.threads} threads, float32, median of {args.repeats}, times in ms")
    print("| model | implementation | kernel | " + " | ".join(columns) + " |")
    print("|---|---|---|" + "---|" * len(columns))
    for name, (build, shape, n) in MODELS.items():
        model = build().eval()
        x = torch.randn((n,) + shape, generator=torch.Generator().manual_seed(1))
        for implementation in (1, 3):
            for label, trace_axes in (("traced", (-1,)), ("full", ())):
                row = measure(model, x, implementation, trace_axes, args.repeats)
                cells = " | ".join("—" if row[column] is None else f"{row[column]:.1f}" for column in columns)
                print(f"| {name} | {implementation} | {label} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
