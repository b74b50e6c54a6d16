"""Each ``batch`` worker's own CUDA stream, and how its blocks reach the result.

NOTE: [Worker streams]
On CUDA, every worker queues its work on a stream of its own (a :class:`Lane`), so that several
workers on one GPU run at once and a block's copy to host memory overlaps the next block's
compute. Streams share memory but not order, so the rules are:

* A lane starts after everything the calling thread queued before the work (inputs moved,
  replicas refreshed, the probe block): it waits on the caller's current stream of its device,
  its *origin*, captured in the calling thread (a worker thread's own current stream is the
  default stream, not the caller's).
* Blocks go into a result on a device through the *result stream* only, the caller's current
  stream of that device: it waits on the lane, the write (or the copy from another GPU, queued on
  the lane and the result stream) runs on it, and the block is marked as used there
  (``record_stream``), so the allocator does not hand its memory to the lane's next block while
  the write is pending. Writes of all workers into one result are thus ordered on one stream,
  which is what makes a traced kernel's accumulation (``+=`` of every block) safe.
* Blocks for host memory are copied asynchronously into pinned staging memory on the lane, and an
  event marks their arrival; the host writes them into place (tensor, NumPy array, memmap, zarr)
  when the lane's next block has been queued, or when the worker stops. At most
  :data:`IN_FLIGHT` blocks per worker wait like this, so the staging memory is bounded.
* When the work ends, every origin stream waits on every lane, so the caller's later work sees
  the result, and memory the lanes used is not reused too early.
* Workers on one device share a kernel function, whose caches hold shapes and plans, never
  device tensors (its plans run on meta tensors), and the model's tensors, which they only read;
  anything else a worker makes on a device (inputs moved there, prepared spans) is its own.

Elsewhere (CPU workers) a lane does nothing: blocks are written at once.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Callable, Iterator, Optional

import torch

IN_FLIGHT = 1
"""Blocks per worker whose copy to host memory may still be on its way: one lets the host place a
block while the GPU computes the next, and costs one block of pinned memory per worker."""


class Lane:
    """A worker's stream on ``device`` (CUDA), or nothing (other devices); made in the calling thread.

    Args:
        device: the worker's device.
        result_device: where the result lives (the first device, or the CPU for host memory).
    """

    def __init__(self, device: torch.device, result_device: torch.device):
        self.device = device
        self.stream: Optional[torch.cuda.Stream] = None
        self.origin: Optional[torch.cuda.Stream] = None
        if device.type == "cuda":
            self.origin = torch.cuda.current_stream(device)
            self.stream = torch.cuda.Stream(device)
        self.result_stream = result_stream(result_device)
        self._pending: collections.deque = collections.deque()
        self._copying = False  # copies queued since the last write was scheduled

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The worker's loop: device work queued inside runs on the lane, after the origin's work.
        Writes still waiting are finished on the way out (also after an error, so that no staged
        copy is left pending; the first error is the one raised)."""
        if self.stream is None:
            try:
                yield
            finally:
                self.finish_writes()
            return
        self.stream.wait_stream(self.origin)
        with torch.cuda.stream(self.stream):
            try:
                yield
            finally:
                self.finish_writes()

    def to_host(self, block: torch.Tensor) -> torch.Tensor:
        """``block`` for host memory: on the lane, an asynchronous copy into pinned memory, valid
        only once :meth:`then`'s write runs; elsewhere ``block`` itself (copied when written)."""
        if self.stream is None or block.device.type != "cuda":
            return block
        staged = torch.empty(block.shape, dtype=block.dtype, pin_memory=True)
        staged.copy_(block, non_blocking=True)
        self._copying = True
        return staged

    def then(self, write: Callable[[], None]) -> None:
        """Runs ``write`` once the lane's copies queued so far have arrived: now when none was queued
        since the last call (no stream, or blocks that stay on the device), else later (the next
        call, or the end of :meth:`running`)."""
        arrival = self._arrival()
        if arrival is None:
            write()
            return
        self._pending.append((arrival, write))
        while len(self._pending) > IN_FLIGHT:
            self._finish_oldest()

    def _arrival(self) -> Optional[torch.cuda.Event]:
        """What :meth:`then` waits on: an event after the lane's work so far (None: nothing to wait for)."""
        if self.stream is None or not self._copying:
            return None
        self._copying = False
        arrived = torch.cuda.Event()
        arrived.record(self.stream)
        return arrived

    def finish_writes(self) -> None:
        while self._pending:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        arrival, write = self._pending.popleft()
        arrival.synchronize()
        write()

    @contextlib.contextmanager
    def handing_over(self, blocks: list) -> Iterator[None]:
        """Device work queued inside runs on the result stream, after the lane's work so far; the
        lane's ``blocks`` (tensors) are marked as used there."""
        stream = self.result_stream
        if stream is None:
            yield
            return
        if self.stream is not None:
            stream.wait_stream(self.stream)
        with torch.cuda.stream(stream):
            yield
        for block in blocks:
            if isinstance(block, torch.Tensor) and block.device == stream.device:
                block.record_stream(stream)


def result_stream(device: torch.device) -> Optional[torch.cuda.Stream]:
    """The stream a result on ``device`` is written on: the calling thread's current one (CUDA)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def lanes_joined(lanes: list[Lane]) -> None:
    """After the work: every origin (and result) stream waits on every lane (NOTE: [Worker streams])."""
    streams = [lane.stream for lane in lanes if lane.stream is not None]
    if not streams:
        return
    waiting = {lane.origin for lane in lanes if lane.origin is not None}
    waiting |= {lane.result_stream for lane in lanes if lane.result_stream is not None}
    for origin in waiting:
        for stream in streams:
            if stream != origin:
                origin.wait_stream(stream)
