"""Tasks shared out to one worker per device from a queue, each worker in its own thread.

The calling thread serves the first worker: a second thread running torch work next to it
doubles the OpenMP thread pools, which made small blocks ~40% slower on a 2-core machine.
The first exception of any worker stops the others (after their current task) and is re-raised
in the caller.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Sequence, TypeVar

from tqdm.auto import tqdm

Worker = TypeVar("Worker")
Task = TypeVar("Task")


def serve(
    workers: Sequence[Worker], tasks: Sequence[Task], handle: Callable[[Worker, Task], int], *,
    progress: bool, total: int, description: str,
) -> None:
    """Runs ``handle(worker, task)`` for every task; it returns the number of steps done (progress)."""
    pending: queue.SimpleQueue = queue.SimpleQueue()
    for task in tasks:
        pending.put(task)
    failures: list[BaseException] = []
    stop = threading.Event()
    bar = tqdm(total=total, disable=not progress, desc=description)

    def work(worker: Worker) -> None:
        try:
            while not stop.is_set():
                try:
                    task = pending.get_nowait()
                except queue.Empty:
                    return
                bar.update(handle(worker, task))
        except BaseException as error:  # re-raised in the caller
            failures.append(error)
            stop.set()

    threads = [threading.Thread(target=work, args=(worker,), daemon=True) for worker in workers[1:]]
    for thread in threads:
        thread.start()
    try:
        work(workers[0])
    finally:
        for thread in threads:
            thread.join()
        bar.close()
    if failures:
        raise failures[0]
