#!/usr/bin/env python
"""Energy NTKs of force fields from their own packages: torchntk's default call against the
per-molecule ``jacrev`` loop users write by hand and the torch.func tutorial's ``vmap(jacrev)``.

Models, random weights, float32, one thread, N1 = N2 = ``--n`` molecules of 7 atoms (methane plus
water's oxygen and two hydrogens, random coordinates around a fixed geometry; fixed atom types):

* ``torchani``: ``torchani.arch.simple_ani`` (H, C, N, O; 8 radial and 4 angular shifts, 2
  sections, no repulsion), energies of ``(species, coordinates)``;
* ``schnetpack``: SchNet (16 features, 2 interactions, 10 Gaussians, cutoff 5) with an
  ``Atomwise`` energy head, every pair of a molecule's atoms its neighbours;
* ``mace``: MACE (``4x0e + 4x1o``, one interaction, correlation 2, cutoff 3), fully connected
  molecules, as in ``tests/test_fingerprint.py``.

Methods, each the median of ``--repeats`` warm calls after one warm-up call, the methods' calls
interleaved round by round (one call of each per round, each round starting with the next
method), so that a drift of the machine's speed, and the place in a round, reach every method
alike:

* ``default``: ``torchntk.empirical_ntk_fn(model)(x1, x2)``; what it chose (``vmap_axes`` or
  whole batches, and the implementation) is printed beside it;
* ``vmap_axes=0``: the axes given, so the examples are mapped by vmap, or by a loop where vmap
  cannot run the model (what the default did before it priced the loop against whole batches);
* ``hand``: a Python loop of ``torch.func.jacrev`` per molecule over the parameters (energy of
  one molecule, ``functional_call``), the Jacobians flattened and stacked, then ``J1 @ J2.T``;
* ``vmap``: the same with ``torch.func.vmap`` over the molecules instead of the loop, where it runs.

With ``--picks``, instead: AUTO's pick on the torchani recipe of docs/scientific.md (float64,
forces computed inside ``forward`` by ``torch.autograd.grad``, the energies or the forces picked by
``output_fn``, whole batches as the default maps them), against implementations 1, 2 and 3 timed
in interleaved rounds with the threads torch was given (``--threads``).

A package that does not import is skipped with its error. schnetpack 2.1 imports ``T_co`` from
``torch.utils.data.dataloader``, which later torch releases dropped: it is defined first.

    TORCHNTK_TEST_STUB_TORCHVISION_OPS=1 python benchmarks/bench_force_fields.py
    python benchmarks/bench_force_fields.py --n 8 --repeats 1 --models torchani   # seconds
    python benchmarks/bench_force_fields.py --repeats 15   # the docs' table, about a minute
    python benchmarks/bench_force_fields.py --picks --repeats 15 --threads 2   # AUTO's picks, seconds
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import typing
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchntk  # noqa: E402
from tests.zoo import AniWithForces, skip_torchvision_op_registrations  # noqa: E402

ATOMS = 7
GEOMETRY = torch.tensor(
    [[0.0, 0.0, 0.0], [0.63, 0.63, 0.63], [-0.63, -0.63, 0.63], [-0.63, 0.63, -0.63], [0.63, -0.63, -0.63],
     [2.5, 0.0, 0.0], [3.1, 0.75, 0.0]]
)
NUMBERS = torch.tensor([6, 1, 1, 1, 1, 8, 1])


class AniEnergy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        os.environ.setdefault("TORCHANI_NO_WARN_EXTENSIONS", "1")
        from torchani.arch import simple_ani

        self.ani = simple_ani(
            ("H", "C", "N", "O"), "wb97x-631gd", repulsion=False, self_energies="zero", radial_shifts=8,
            angular_shifts=4, sections=2,
        )

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        species = NUMBERS.expand(positions.shape[0], -1)
        return self.ani((species, positions)).energies[:, None]


def _pairs(molecules: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ordered pair of distinct atoms of each molecule, as flat atom indices."""
    send, receive = zip(*[(i, j) for i in range(ATOMS) for j in range(ATOMS) if i != j])
    offsets = (torch.arange(molecules) * ATOMS).repeat_interleave(len(send))
    return torch.tensor(send).repeat(molecules) + offsets, torch.tensor(receive).repeat(molecules) + offsets


class SchNetEnergy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import torch.utils.data.dataloader as loader

        if not hasattr(loader, "T_co"):
            loader.T_co = typing.TypeVar("T_co", covariant=True)
        import schnetpack as spk

        self.properties = spk.properties
        cutoff = 5.0
        schnet = spk.representation.SchNet(
            n_atom_basis=16, n_interactions=2, radial_basis=spk.nn.GaussianRBF(n_rbf=10, cutoff=cutoff),
            cutoff_fn=spk.nn.CosineCutoff(cutoff),
        )
        self.model = spk.model.NeuralNetworkPotential(
            representation=schnet, input_modules=[spk.atomistic.PairwiseDistances()],
            output_modules=[spk.atomistic.Atomwise(n_in=16, output_key="energy")],
        )

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        p = self.properties
        molecules = positions.shape[0]
        i, j = _pairs(molecules)
        inputs = {
            p.Z: NUMBERS.repeat(molecules), p.R: positions.reshape(-1, 3), p.idx_i: i, p.idx_j: j,
            p.offsets: positions.new_zeros(len(i), 3), p.n_atoms: torch.full((molecules,), ATOMS),
            p.idx_m: torch.arange(molecules).repeat_interleave(ATOMS),
        }
        return self.model(inputs)["energy"][:, None]


class MaceEnergy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import numpy as np
        from e3nn import o3
        from mace import modules, tools

        block = modules.interaction_classes["RealAgnosticResidualInteractionBlock"]
        self.mace = modules.MACE(
            r_max=3.0, num_bessel=4, num_polynomial_cutoff=5, max_ell=1, interaction_cls=block,
            interaction_cls_first=block, num_interactions=1, num_elements=3, hidden_irreps=o3.Irreps("4x0e + 4x1o"),
            MLP_irreps=o3.Irreps("4x0e"), gate=nn.functional.silu, atomic_energies=np.zeros(3),
            avg_num_neighbors=6.0, atomic_numbers=tools.AtomicNumberTable([1, 6, 8]).zs, correlation=2,
        )
        self.register_buffer("types", torch.tensor([1, 0, 0, 0, 0, 2, 0]), persistent=False)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        molecules = positions.shape[0]
        i, j = _pairs(molecules)
        zeros = positions.new_zeros(len(i), 3)
        data = {
            "positions": positions.reshape(-1, 3),
            "node_attrs": nn.functional.one_hot(self.types, 3).to(positions.dtype).repeat(molecules, 1),
            "edge_index": torch.stack([i, j]), "shifts": zeros, "unit_shifts": zeros,
            "cell": positions.new_zeros(3 * molecules, 3),
            "batch": torch.arange(molecules).repeat_interleave(ATOMS),
            "ptr": torch.arange(molecules + 1) * ATOMS,
            "weight": positions.new_ones(molecules), "head": torch.zeros(molecules, dtype=torch.long),
        }
        with _NoGradRequests():
            return self.mace(data, training=False, compute_force=False)["energy"][:, None]


class _NoGradRequests(torch.overrides.TorchFunctionMode):
    """``requires_grad_`` as a no-op: MACE asks for the positions' gradients (for forces) even
    with ``compute_force=False``, which ``torch.func.jacrev`` refuses; energies need none."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.requires_grad_:
            return args[0]
        return func(*args, **(kwargs or {}))


MODELS = {"torchani": AniEnergy, "schnetpack": SchNetEnergy, "mace": MaceEnergy}


def hand_loop(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor, vectorised: bool = False) -> torch.Tensor:
    """The kernel users write: per-molecule Jacobians over the parameters, then ``J1 @ J2.T``."""
    params = {name: p.detach() for name, p in model.named_parameters()}

    def energy(parameters: dict, molecule: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, parameters, (molecule[None],))[0, 0]

    jacobian = torch.func.jacrev(energy)

    def jacobians(x: torch.Tensor) -> torch.Tensor:
        if vectorised:
            rows = torch.func.vmap(jacobian, (None, 0))(params, x)
            return torch.cat([row.reshape(x.shape[0], -1) for row in rows.values()], 1)
        return torch.stack([torch.cat([g.reshape(-1) for g in jacobian(params, m).values()]) for m in x])

    return jacobians(x1) @ jacobians(x2).T


def timed(calls: dict, repeats: int) -> dict:
    """``{name: (median seconds, result)}`` of ``calls`` (``{name: call}``), each warmed up once, then
    called ``repeats`` times in interleaved rounds; a call that raises gives ``(None, the error)``."""
    results = {}
    for name, call in calls.items():
        try:
            results[name] = call()
        except Exception as error:  # noqa: BLE001 - vmap cannot run every model
            results[name] = error
    running = [(name, call) for name, call in calls.items() if not isinstance(results[name], Exception)]
    times: dict = {name: [] for name, _ in running}
    for round_ in range(repeats):
        # each round starts with another method: the first call of a round, after the slowest
        # one, ran 5% slower than the same call later in the round
        for name, call in running[round_ % len(running):] + running[: round_ % len(running)]:
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {
        name: (None, results[name]) if name not in times else (statistics.median(times[name]), results[name])
        for name in calls
    }


def _output(index: int):
    """``output_fn`` picking one output (a function of the output alone: a second parameter would
    receive the inputs)."""
    return lambda out: out[index]


def auto_picks(repeats: int) -> None:
    """AUTO's pick on :class:`AniWithForces` against the implementations' times (``--picks``)."""
    torch.manual_seed(0)
    model = AniWithForces().double().eval()
    generator = torch.Generator().manual_seed(0)
    methane = GEOMETRY[:5].double()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float64, median of {repeats} warm calls")
    print("| output | N1, N2 | AUTO's pick | 1 (s) | 2 (s) | 3 (s) | pick / fastest |")
    print("|---|---|---|---|---|---|---|")
    for output, index in (("energies", 0), ("forces", 1)):
        for n1, n2 in ((3, 2), (8, 8)):
            x1, x2 = (methane + 0.05 * torch.randn(n, 5, 3, dtype=torch.float64, generator=generator)
                      for n in (n1, n2))
            select = _output(index)
            pick = int(torchntk.empirical_ntk_fn(model, output_fn=select).auto_choice(x1, x2).implementation)
            fns = {i: torchntk.empirical_ntk_fn(model, output_fn=select, implementation=i) for i in (1, 2, 3)}
            measured = timed({i: (lambda f=f: f(x1, x2)) for i, f in fns.items()}, repeats)
            times = {i: seconds for i, (seconds, _) in measured.items()}
            print(f"| {output} | {n1}, {n2} | {pick} | {times[1]:.4f} | {times[2]:.4f} | {times[3]:.4f} | "
                  f"{times[pick] / min(times.values()):.2f} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--picks", action="store_true", help="AUTO's picks on the torchani recipe instead")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    skip_torchvision_op_registrations()
    warnings.filterwarnings("ignore", category=torchntk.ExampleLoopWarning)
    if args.picks:
        auto_picks(args.repeats)
        return 0
    print(f"torch {torch.__version__}, N1 = N2 = {args.n}, {ATOMS} atoms, float32, {args.threads} thread(s), "
          f"median of {args.repeats} warm calls")
    print("| model | parameters | default s | chosen | vmap_axes=0 s | hand loop s | vmap(jacrev) s | hand / default "
          "| vmap / default |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        try:
            torch.manual_seed(0)
            model = MODELS[name]().float().eval()
        except Exception as error:  # noqa: BLE001 - a package that does not import is skipped, saying why
            print(f"| {name} | skipped: {type(error).__name__}: {' '.join(str(error).split())[:120]} |")
            continue
        generator = torch.Generator().manual_seed(1)
        x1, x2 = (GEOMETRY + 0.1 * torch.randn(args.n, ATOMS, 3, generator=generator) for _ in range(2))
        ntk_fn = torchntk.empirical_ntk_fn(model)
        given_fn = torchntk.empirical_ntk_fn(model, vmap_axes=0)
        measured = timed({
            "default": lambda: ntk_fn(x1, x2), "given": lambda: given_fn(x1, x2),
            "hand": lambda: hand_loop(model, x1, x2), "vmap": lambda: hand_loop(model, x1, x2, vectorised=True),
        }, args.repeats)
        for method in ("default", "given", "hand"):  # only the tutorial's vmap may fail
            if measured[method][0] is None:
                raise measured[method][1]
        (default, kernel), (given, _), (hand, expected), (vmapped, failure) = (
            measured[method] for method in ("default", "given", "hand", "vmap")
        )
        choice = ntk_fn.auto_choice(x1, x2)
        reason = choice.vmap_axes_reason or ""
        mapping = "whole batches" if choice.vmap_axes is None else "loop" if "loop over" in reason else "vmap"
        chosen = f"{mapping}, implementation {int(choice.implementation)}"
        error = float((kernel - expected).abs().max() / expected.abs().max())
        if vmapped is None:
            vmap_cells = [f"fails ({type(failure).__name__})", "-"]
        else:
            vmap_cells = [f"{vmapped:.4f}", f"{vmapped / default:.2f}"]
        parameters = sum(p.numel() for p in model.parameters())
        print(f"| {name} | {parameters} | {default:.4f} | {chosen} | {given:.4f} | {hand:.4f} | {vmap_cells[0]} | "
              f"{hand / default:.2f} | {vmap_cells[1]} |  (max rel. diff. to hand {error:.1e})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
