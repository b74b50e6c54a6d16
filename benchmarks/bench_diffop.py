#!/usr/bin/env python
"""NTKs of models that differentiate inside their forward pass (a PINN residual, a force field),
torchntk's implementations against the vectorised Jacobian loop users write by hand, and the floor
of that loop: the product ``J J^T`` alone.

Rows:

* ``poisson``: the Poisson residual ``u_xx + u_yy`` of a 2-W-W-W-1 tanh MLP (``--widths``, default
  64 and 256; ``--depth``) at N collocation points in the unit square (``--n``, default 1024, 2048,
  4096), in float32 (``--dtypes``), the residual written with ``torch.autograd.grad(...,
  create_graph=True)`` inside ``forward`` (style ``autograd``) and with ``torch.func`` inside
  ``forward`` (``vmap(hessian(u))``, style ``func``; ``--styles``); the traced kernel (N, N);
* ``forces``: the forces ``-dE/dx`` of a molecular energy model (an MLP of the inverse pair distances
  of ``--atoms`` atoms, width ``--force-width`` (64), tanh) by ``torch.autograd.grad`` inside
  ``forward``, at ``--force-n`` random molecules; the full kernel (N, N, A, A, 3, 3).

Methods, timed in the same run on the same inputs:

* ``vmap``, the peer every ratio is against: what a competent user writes, the per-example
  Jacobians of the residual (a pure function of the parameters and one point, ``hessian`` of
  ``functional_call``) over the parameters by ``vmap(jacrev)`` in chunks of ``--chunk`` examples,
  then one matrix product ``J J^T``;
* ``hand`` (``--loop``): the same with a Python loop over the examples instead of ``vmap``;
* torchntk's implementations ``1``, ``2``, ``3`` and ``0`` (AUTO, its pick shown), the default
  settings (``vmap_axes="auto"``, default checks), ``x2=None``. Implementation 2 pushes every x2
  example's vector through a forward-mode pass over all of x1 (``N^2`` example passes); it runs
  last, and where the others' measured times scaled by AUTO's estimates project it above
  ``--max-seconds`` a call it is not run and the row says so (one timed call above 10 s).

Each implementation's time is the median of ``--repeats`` warm calls after one warm-up call, the
warm calls of 1, 3 and AUTO alternating round by round (the hand loop and ``vmap``: one call each
after a warm-up on 8 examples); every kernel is compared with the peer's
(``max|K - K_peer| / max|K_peer|``). ``memory``: for AUTO, the peak its plan estimated and
the budget it planned within; for every method, the growth of the process's resident set during
its warm-up call (Linux ``VmHWM``). The floor: ``2 N^2 P`` FLOPs of the contraction ``J J^T`` at
the rate of one ``(N, P) @ (P, N)`` product measured in the same run (``matmul s``), the
Jacobians' own arithmetic apart.

    python benchmarks/bench_diffop.py                        # the whole grid: about 25 min on 2 cores
    python benchmarks/bench_diffop.py --widths 256 --n 2048 --styles autograd --no-forces
    python benchmarks/bench_diffop.py --quick                # tiny sizes: seconds
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.func import functional_call, grad, hessian, jacrev, vmap  # noqa: E402

import torchntk  # noqa: E402
from benchmarks._common import current_rss_mb, hwm_rss_mb, reset_peak_rss  # noqa: E402

IMPLEMENTATIONS = ("1", "2", "3", "0")


def mlp(inputs: int, width: int, depth: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    size = inputs
    for _ in range(depth):
        layers += [nn.Linear(size, width), nn.Tanh()]
        size = width
    return nn.Sequential(*layers, nn.Linear(size, 1))


class PoissonAutograd(nn.Module):
    """The residual ``u_xx + u_yy`` by ``torch.autograd.grad`` inside ``forward``."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone().requires_grad_()
        u = self.net(x)
        du = torch.autograd.grad(u, x, torch.ones_like(u), create_graph=True)[0]
        laplacian = sum(torch.autograd.grad(du[:, i].sum(), x, create_graph=True)[0][:, i] for i in range(x.shape[1]))
        return laplacian.unsqueeze(-1)


class PoissonFunc(nn.Module):
    """The same residual by ``torch.func`` inside ``forward``."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hessians = vmap(hessian(lambda point: self.net(point).squeeze(-1)))(x)
        return hessians.diagonal(dim1=-2, dim2=-1).sum(-1, keepdim=True)


def inverse_distances(positions: torch.Tensor) -> torch.Tensor:
    atoms = positions.shape[-2]
    first, second = torch.triu_indices(atoms, atoms, 1)
    return 1.0 / (positions[..., first, :] - positions[..., second, :]).norm(dim=-1)


class ForceField(nn.Module):
    """Forces ``-dE/dx`` of an energy MLP of the inverse pair distances."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        positions = positions.clone().requires_grad_()
        energy = self.net(inverse_distances(positions)).sum()
        return -torch.autograd.grad(energy, positions, create_graph=True)[0]


def residual_function(net: nn.Module):
    """``(params, point) -> u_xx + u_yy`` as a pure function, for the hand loop."""

    def residual(params, point):
        u = lambda p: functional_call(net, params, (p,)).squeeze(-1)  # noqa: E731
        return torch.diagonal(hessian(u)(point)).sum()

    return residual


def forces_function(net: nn.Module):
    def forces(params, positions):
        return -grad(lambda p: functional_call(net, params, (inverse_distances(p),)).squeeze(-1))(positions)

    return forces


def hand_kernel(function, params: dict, x: torch.Tensor, loop: bool, chunk: int = 256) -> torch.Tensor:
    """``J J^T`` from per-example Jacobians of ``function`` over ``params``, by a loop or by vmap
    (``chunk`` examples at once)."""
    n = x.shape[0]
    if loop:
        per_example = [jacrev(function)(params, x[index]) for index in range(n)]
        jacobians = [torch.stack([one[name] for one in per_example]) for name in params]
    else:
        batched = vmap(jacrev(function), (None, 0), chunk_size=chunk)(params, x)
        jacobians = [batched[name] for name in params]
    outputs = jacobians[0].shape[1 : jacobians[0].ndim - params[next(iter(params))].ndim]
    flat = torch.cat([j.reshape(n, math.prod(outputs), -1) for j in jacobians], dim=-1)  # (N, O, P)
    if not outputs:
        return flat[:, 0] @ flat[:, 0].T
    kernel = torch.einsum("nap,mbp->nmab", flat, flat)  # (N, N, O, O), O = A * 3
    atoms = outputs[0]
    return kernel.reshape(n, n, atoms, 3, atoms, 3).permute(0, 1, 2, 4, 3, 5)


def timed(call, repeats: int):
    """``(result, median seconds of `repeats` calls after the first (NaN for none), resident-set
    growth during the first in MB)``."""
    before = current_rss_mb()
    reset_peak_rss()
    result = call()
    growth = hwm_rss_mb() - before
    times = []
    for _ in range(repeats):
        del result
        start = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times) if times else math.nan, growth


def relative_difference(kernel: torch.Tensor, reference: torch.Tensor) -> float:
    return float((kernel.double() - reference.double()).abs().max() / reference.double().abs().max())


def hand_rows(function, params: dict, x: torch.Tensor, label: str, args) -> tuple[list[tuple], torch.Tensor, float]:
    """The rows of the vectorised hand-written kernel (the peer) and, with ``--loop``, of its Python
    loop; the peer's kernel and time."""
    hand_kernel(function, params, x[:8], loop=False, chunk=args.chunk)  # warm-up
    start = time.perf_counter()
    reference = hand_kernel(function, params, x, loop=False, chunk=args.chunk)
    peer_seconds = time.perf_counter() - start
    rows = [(label, "vmap", peer_seconds, 1.0, 0.0, f"chunks of {args.chunk} examples")]
    if args.loop:
        hand_kernel(function, params, x[:8], loop=True)
        start = time.perf_counter()
        kernel = hand_kernel(function, params, x, loop=True)
        seconds = time.perf_counter() - start
        difference = relative_difference(kernel, reference)
        rows.append((label, "hand", seconds, peer_seconds / seconds, difference, "a Python loop"))
    return rows, reference, peer_seconds


def torchntk_rows(model: nn.Module, x: torch.Tensor, label: str, args, trace_axes, reference: torch.Tensor,
                  hand_seconds: float) -> list[tuple]:
    """One row per implementation of torchntk, and the floor's."""
    auto = torchntk.empirical_ntk_fn(model, trace_axes=trace_axes).auto_choice(x)
    cheapest = min(estimate.flops for estimate in auto.estimates.values())

    def estimate_of(code: int):
        return auto.estimates.get(torchntk.NtkImplementation(code))

    def ratio_note(code: int) -> str:
        estimate = estimate_of(code)
        return f"AUTO's estimate {estimate.flops / cheapest:.1f}x its cheapest; " if estimate is not None and code else ""

    # The warm calls of 1, 3 and AUTO alternate round by round, so that a change of the machine's
    # load falls on all of them; implementation 2 comes last, its time projected from theirs first.
    functions = {implementation: torchntk.empirical_ntk_fn(model, implementation=int(implementation), trace_axes=trace_axes)
                 for implementation in args.implementations if implementation != "2"}
    kernels, growth, times = {}, {}, {implementation: [] for implementation in functions}
    for implementation, ntk_fn in functions.items():
        kernels[implementation], _, growth[implementation] = timed(lambda: ntk_fn(x), 0)
    for _ in range(args.repeats):
        for implementation, ntk_fn in functions.items():
            start = time.perf_counter()
            ntk_fn(x)
            times[implementation].append(time.perf_counter() - start)
    results: dict[str, tuple] = {}
    for implementation, ntk_fn in functions.items():
        seconds = statistics.median(times[implementation])
        note = f"{ratio_note(int(implementation))}RSS +{growth[implementation]:.0f} MB"
        if implementation == "0":
            choice = ntk_fn.auto_choice(x)
            picked = choice.estimates[choice.implementation]
            note = (f"picks {int(choice.implementation)}; planned {picked.memory_bytes / 2**20:.0f} MB of "
                    f"{choice.memory_budget_bytes / 2**30:.1f} GB; " + note)
        results[implementation] = (label, implementation, seconds, hand_seconds / seconds,
                                   relative_difference(kernels[implementation], reference), note)
    kernels.clear()
    if "2" in args.implementations:
        estimate = estimate_of(2)
        projected = [
            results[other][2] * estimate.flops / estimate_of(int(other)).flops
            for other in functions if other != "0" and estimate is not None and estimate_of(int(other)) is not None
        ]
        if projected and min(projected) > args.max_seconds:
            results["2"] = (label, "2", math.nan, math.nan, math.nan,
                            f"not run: {ratio_note(2)}about {min(projected):.0f} s a call by it")
        else:
            ntk_fn = torchntk.empirical_ntk_fn(model, implementation=2, trace_axes=trace_axes)
            repeats = 1 if projected and min(projected) > 10 else args.repeats
            kernel, seconds, memory = timed(lambda: ntk_fn(x), repeats)
            results["2"] = (label, "2", seconds, hand_seconds / seconds, relative_difference(kernel, reference),
                            f"{ratio_note(2)}RSS +{memory:.0f} MB")
            del kernel
    rows = [results[implementation] for implementation in args.implementations]
    size = sum(param.numel() for param in model.parameters())
    rows_of_j = reference.shape[0] if trace_axes else reference.shape[0] * x[0].numel()
    jacobian = torch.randn(rows_of_j, size, dtype=x.dtype)
    _, matmul_seconds, _ = timed(lambda: jacobian @ jacobian.T, 3)
    flops = 2 * rows_of_j**2 * size
    rows.append((label, "floor", matmul_seconds, hand_seconds / matmul_seconds, math.nan,
                 f"J J^T alone: 2 x {rows_of_j}^2 x {size} = {flops:.2e} FLOPs, {flops / matmul_seconds / 1e9:.0f} GFLOP/s"))
    return rows


def base_label(label: str) -> str:
    """The hand loop's label of a row: the style of writing the residual left out."""
    return label.replace(" autograd", "").replace(" func", "")


def summary(rows: list[tuple]) -> list[str]:
    """Per row label: the fastest implementation's speed-up over the hand loop, and AUTO's time
    over the fastest's."""
    hands = {row[0]: row[2] for row in rows if row[1] == "vmap"}
    lines = []
    for label in dict.fromkeys(row[0] for row in rows if row[1] in IMPLEMENTATIONS):
        mine = {row[1]: row[2] for row in rows if row[0] == label and not math.isnan(row[2])}
        timed_implementations = {key: value for key, value in mine.items() if key in ("1", "2", "3")}
        if not timed_implementations:
            continue
        best = min(timed_implementations, key=timed_implementations.get)
        speedup = hands[base_label(label)] / timed_implementations[best]
        line = f"{label}: fastest {best}, {speedup:.1f}x the vectorised hand loop"
        if "0" in mine:
            line += f"; AUTO {mine['0'] / timed_implementations[best]:.2f}x the fastest"
        if "floor" in mine:
            line += f"; J J^T alone {mine['floor'] / timed_implementations[best]:.2f}x the fastest's time"
        lines.append(line)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="1024,2048,4096", help="collocation points (comma-separated)")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--styles", default="autograd,func", help="how the residual is written")
    parser.add_argument("--implementations", default=",".join(IMPLEMENTATIONS))
    parser.add_argument("--widths", default="64,256", help="widths of the Poisson MLP (comma-separated)")
    parser.add_argument("--depth", type=int, default=3, help="hidden layers")
    parser.add_argument("--force-n", default="64,256", help="molecules of the force-field rows")
    parser.add_argument("--atoms", type=int, default=8)
    parser.add_argument("--force-width", type=int, default=64, help="width of the force field's energy MLP")
    parser.add_argument("--no-forces", action="store_true")
    parser.add_argument("--loop", action="store_true", help="time the Python loop over examples too (minutes)")
    parser.add_argument("--chunk", type=int, default=256, help="examples per vmap chunk of the peer")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-seconds", type=float, default=60.0,
                        help="implementation 2 is not run where AUTO's estimates project it above this per call")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.n, args.force_n, args.widths, args.depth, args.repeats, args.atoms = "16", "8", "8", 2, 1, 4
        args.force_width = 8
    if args.threads:
        torch.set_num_threads(args.threads)
    args.implementations = [item for item in args.implementations.split(",") if item]
    warnings.simplefilter("ignore", torchntk.MemoryPlanWarning)
    print(f"`python {' '.join(sys.argv)}`, {datetime.date.today()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.2f}")
    print()
    print("| model | method | median s | vmap / method | rel. diff from vmap | notes |")
    print("|---|---|---|---|---|---|")

    def show(rows):
        for label, method, seconds, speedup, difference, note in rows:
            cells = [f"{value:.3f}" if index == 0 else f"{value:.1f}" if index == 1 else f"{value:.1e}"
                     for index, value in enumerate((seconds, speedup, difference))]
            cells = ["—" if math.isnan(value) else cell for value, cell in zip((seconds, speedup, difference), cells)]
            print(f"| {label} | {method} | {' | '.join(cells)} | {note} |", flush=True)
        everything.extend(rows)

    everything: list[tuple] = []
    torch.manual_seed(0)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for width in (int(item) for item in args.widths.split(",") if item):
            net = mlp(2, width, args.depth).to(dtype)
            params = {name: param.detach() for name, param in net.named_parameters()}
            for n in (int(item) for item in args.n.split(",") if item):
                x = torch.rand(n, 2, dtype=dtype)
                label = f"poisson W={width} {dtype_name} N={n}"
                rows, reference, hand_seconds = hand_rows(residual_function(net), params, x, label, args)
                show(rows)
                del rows
                for style in args.styles.split(","):
                    model = (PoissonAutograd if style == "autograd" else PoissonFunc)(net)
                    label = f"poisson {style} W={width} {dtype_name} N={n}"
                    show(torchntk_rows(model, x, label, args, (-1,), reference, hand_seconds))
                del reference
        if args.no_forces:
            continue
        pairs = args.atoms * (args.atoms - 1) // 2
        energy = mlp(pairs, args.force_width, 2).to(dtype)
        energy_params = {name: param.detach() for name, param in energy.named_parameters()}
        for n in (int(item) for item in args.force_n.split(",") if item):
            positions = torch.randn(n, args.atoms, 3, dtype=dtype) * 2
            label = f"forces {args.atoms} atoms {dtype_name} N={n}"
            rows, reference, hand_seconds = hand_rows(forces_function(energy), energy_params, positions, label, args)
            show(rows)
            show(torchntk_rows(ForceField(energy), positions, label, args, (), reference, hand_seconds))
    print()
    for line in summary(everything):
        print(f"- {line}")


if __name__ == "__main__":
    main()
