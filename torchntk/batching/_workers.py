"""Tasks shared out to one worker per device from a queue, each worker in its own thread.

The calling thread serves the first worker: a second thread running torch work next to it
doubles the OpenMP thread pools, which made small blocks ~40% slower on a 2-core machine.
Progress is counted in kernel entries (pairs of examples), so the bar's rate is entries per
second whatever the block sizes. The first exception of any worker stops the others (after
their current task) and is re-raised in the caller. Each worker runs inside its lane (its CUDA
stream, NOTE: [Worker streams] in ``batching/_streams.py``), which finishes the worker's pending writes
before the worker stops.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Sequence, TypeVar

from tqdm.auto import tqdm

from ._streams import Lane, lanes_joined

Worker = TypeVar("Worker")
Task = TypeVar("Task")


def serve(
    workers: Sequence[Worker], tasks: Sequence[Task],
    handle: Callable[[Worker, Lane, Task, Callable[[int], Any]], None], *,
    lanes: Sequence[Lane], progress: bool, total: int, description: str, initial: int = 0,
) -> None:
    """Runs ``handle(worker, lane, task, advance)`` for every task, each worker inside its lane
    (``lanes``, one per worker); ``advance(n)`` moves the progress bar by ``n`` kernel entries (of
    ``total``, ``initial`` of them done before)."""
    pending: queue.SimpleQueue = queue.SimpleQueue()
    for task in tasks:
        pending.put(task)
    failures: list[BaseException] = []
    stop = threading.Event()
    bar = tqdm(total=total, initial=initial, disable=not progress, desc=description, unit=" entries",
               unit_scale=True, smoothing=0.1)
    bar_lock = threading.Lock()

    def advance(entries: int) -> None:
        with bar_lock:  # tqdm's own lock does not cover update's arithmetic
            bar.update(entries)

    def work(worker: Worker, lane: Lane) -> None:
        try:
            with lane.running():
                while not stop.is_set():
                    try:
                        task = pending.get_nowait()
                    except queue.Empty:
                        return
                    handle(worker, lane, task, advance)
        except BaseException as error:  # re-raised in the caller
            failures.append(error)
            stop.set()

    threads = [threading.Thread(target=work, args=pair, daemon=True) for pair in zip(workers[1:], lanes[1:])]
    for thread in threads:
        thread.start()
    try:
        work(workers[0], lanes[0])
    finally:
        for thread in threads:
            thread.join()
        lanes_joined(list(lanes))
        bar.close()
    if failures:
        raise failures[0]
