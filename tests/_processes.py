"""Every process the tests start, started here.

* :func:`run_python` runs ``python ARGUMENTS`` with this interpreter (a module with ``-m``, a
  script, Sphinx, ``torch.distributed.run``) and returns its exit status and captured text output.
* :func:`spawn` runs a worker in several processes with ``torch.multiprocessing`` (``mp.spawn``),
  waits for all of them with a grace period and a deadline, and kills what is left.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any, Callable, Mapping, Optional

import pytest
import torch.multiprocessing as mp

SpawnFailed = (mp.ProcessRaisedException, mp.ProcessExitedException)
"""What :func:`spawn` raises when a child raised (the child's traceback is in the message) or
exited with a non-zero status."""


def run_python(*arguments: Any, timeout: float = 300, env: Optional[Mapping[str, str]] = None) -> subprocess.CompletedProcess:
    """``python ARGUMENTS`` with this interpreter; standard output and error captured as text.

    ``env`` adds to (or overrides) this process's environment. The child's exit status is
    returned, not checked; running past ``timeout`` seconds raises ``subprocess.TimeoutExpired``.
    """
    environment = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, *map(str, arguments)], capture_output=True, text=True,
                          timeout=timeout, env=environment)


def spawn(worker: Callable[..., None], nprocs: int, args: tuple = (), *, grace: float = 10.0,
          deadline: float = 60.0) -> float:
    """Runs ``worker(rank, *args)`` in ``nprocs`` processes; returns the wall time in seconds.

    When a child fails, the others get ``grace`` seconds to finish (and record how they failed)
    before they are terminated, and the child's failure is raised as one of :data:`SpawnFailed`.
    Children still alive after ``deadline`` seconds fail the test (``pytest.fail``, which
    ``pytest.raises`` does not catch). No child outlives the call.
    """
    start = time.monotonic()
    context = mp.spawn(worker, args=tuple(args), nprocs=nprocs, join=False)
    try:
        while not context.join(timeout=1.0, grace_period=grace):
            if time.monotonic() - start > deadline:
                pytest.fail(f"the {nprocs} processes did not finish in {deadline} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
    return time.monotonic() - start
