"""Monte Carlo NNGP and NTK estimates shared between processes with ``torch.distributed``.

Run on one machine with two processes (add ``--nnodes``/``--rdzv-endpoint`` for several)::

    torchrun --standalone --nproc_per_node=2 examples/distributed_monte_carlo.py

Each process ("rank") starts the process group with :func:`torchntk.distributed.setup`: gloo
on CPU, or NCCL with one GPU per rank (``cuda:LOCAL_RANK``) when CUDA is available. Then it
builds the same model and inputs and calls the same :func:`torchntk.monte_carlo_kernel_fn`.
That function sees the initialised process group and shares the samples: rank ``r`` draws
the samples ``s`` with ``s % world_size == r``, and the ranks' running sums are added with
one all-reduce, so every rank returns the same estimate (equal to one process's up to
float rounding). ``distributed="blocks"`` shares the kernel blocks of every sample instead.

:func:`torchntk.distributed.failure_guard` makes an exception on one rank stop the others at
once, with an error naming that rank, instead of after ``TIMEOUT`` seconds.
:func:`torchntk.distributed.finalize` is a last barrier before ``destroy_process_group``:
without it, a rank that tears gloo down while another still works can abort that one.
"""

from __future__ import annotations

import torch

import torchntk
from torchntk import distributed

TIMEOUT = 300.0  # seconds a rank waits for the others at a collective


def main() -> None:
    device = distributed.setup(timeout=TIMEOUT)
    rank, world_size = distributed.world()

    # The same data and architecture on every rank (the weights are redrawn for each sample).
    torch.manual_seed(0)
    x1 = torch.randn(6, 16, device=device)
    x2 = torch.randn(4, 16, device=device)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)).to(device).eval()

    owned = distributed.owned_samples(rank, world_size)
    print(f"rank {rank} of {world_size} on {device}: samples {[s for s in range(8) if owned(s)]}",
          flush=True)

    with distributed.failure_guard(timeout=TIMEOUT):
        # devices=[device]: each rank computes on its own device only.
        kernel_fn = torchntk.monte_carlo_kernel_fn(model, n_samples=8, seed=0, devices=[device],
                                                   timeout=TIMEOUT)
        kernel = kernel_fn(x1, x2, get=("nngp", "ntk"))
        if rank == 0:
            # For comparison only: the same 8 samples, all computed by this rank.
            alone = torchntk.monte_carlo_kernel_fn(model, n_samples=8, seed=0, devices=[device],
                                                   distributed="off")(x1, x2, get=("nngp", "ntk"))
            torch.set_printoptions(precision=4, sci_mode=False)
            print(f"NNGP estimate (8 samples shared by {world_size} ranks):\n{kernel.nngp.cpu()}")
            print(f"NTK estimate:\n{kernel.ntk.cpu()}")
            difference = max((kernel.nngp - alone.nngp).abs().max().item(),
                              (kernel.ntk - alone.ntk).abs().max().item())
            print(f"largest difference from one process computing every sample: {difference:.1e}")

    distributed.finalize(timeout=TIMEOUT)


if __name__ == "__main__":
    main()
