"""Which devices a batched computation runs on.

``device_count`` follows neural-tangents (``-1``: every accelerator, ``0``: no device
parallelism, ``k``: the first ``k``); ``devices`` names them explicitly, and may repeat ``"cpu"``
so that the multi-device logic runs (and is tested) on machines without GPUs.
"""

from __future__ import annotations

import numbers
from typing import Any, Optional, Sequence

import torch

from .._utils.checks import show
from .._utils.tree import Flat


def device_count_argument(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{where}: `device_count` must be an int (-1, 0 or a positive count), got {show(value)}.")
    if value < -1:
        raise ValueError(f"{where}: `device_count` must be -1 (all), 0 (none) or a positive count, got {value}.")
    return int(value)


def devices_argument(value: Any, where: str) -> Optional[tuple[torch.device, ...]]:
    """``None`` or a non-empty sequence of existing devices."""
    if value is None:
        return None
    if isinstance(value, (str, torch.device)) or not isinstance(value, Sequence) or not value:
        raise TypeError(
            f"{where}: `devices` must be None or a non-empty list of devices (e.g. ['cuda:0', 'cuda:1'] or "
            f"['cpu'] * 3), got {show(value)}."
        )
    devices = []
    for entry in value:
        try:
            device = torch.device(entry)
        except (RuntimeError, TypeError) as error:
            raise ValueError(f"{where}: `devices` has {show(entry)}, which is not a device: {error}") from None
        _check_exists(device, where)
        if device.type == "cuda" and device.index is None:
            # 'cuda' is the current device, as for Tensor.to('cuda'); with its index it compares
            # equal to the model's device, so workers there share the model instead of a replica
            device = torch.device("cuda", torch.cuda.current_device())
        devices.append(device)
    return tuple(devices)


def _check_exists(device: torch.device, where: str) -> None:
    if device.type == "cpu":
        return
    if device.type == "cuda":
        count = torch.cuda.device_count()
        index = 0 if device.index is None else device.index
        if index >= count:
            raise ValueError(
                f"{where}: `devices` has {device}, but this machine has {count} CUDA device(s)."
            )
        return
    raise ValueError(f"{where}: `devices` has {device}; only 'cpu' and 'cuda' devices are supported.")


def resolve(device_count: int, devices: Optional[tuple[torch.device, ...]], inputs_device: torch.device, where: str) -> tuple[torch.device, ...]:
    """The devices to run on; ``(inputs_device,)`` when nothing asks for more."""
    if devices is not None:
        return devices
    available = torch.cuda.device_count()
    if device_count == 0 or (device_count == -1 and available == 0):
        return (inputs_device,)
    if device_count == -1:
        return tuple(torch.device("cuda", index) for index in range(available))
    if device_count > available:
        if available == 0 and device_count == 1:
            return (inputs_device,)
        hint = " Pass devices=['cpu'] * k for several CPU workers." if available == 0 else ""
        raise ValueError(
            f"{where}: `device_count`={device_count}, but this machine has {available} CUDA device(s).{hint}"
        )
    return tuple(torch.device("cuda", index) for index in range(device_count))



def asynchronous_copy(source: torch.device, target: torch.device, source_kept: bool = False) -> bool:
    """Whether a copy from ``source`` to ``target`` may return before its data has arrived
    (``non_blocking=True``): the one rule for every copy ``batch`` and Monte Carlo make.

    Never towards the CPU: CPU code reads the copy as soon as it returns. Towards an accelerator,
    a copy from another accelerator is ordered by the streams before any use there; a copy from
    the CPU only when the caller keeps the source unchanged until the device has been synchronised
    (``source_kept``: the pinned copies of :func:`pinned`), since a pinned source is read after the
    copy returns.

    Example:
        >>> cpu, cuda = torch.device("cpu"), torch.device("cuda")
        >>> asynchronous_copy(cuda, cpu), asynchronous_copy(cpu, cuda), asynchronous_copy(cpu, cuda, source_kept=True)
        (False, False, True)
    """
    return target.type != "cpu" and (source.type != "cpu" or source_kept)


def move(tree: Any, device: torch.device, source_kept: bool = False) -> Any:
    """``tree`` with every tensor leaf moved to ``device``; other leaves (``None`` too) as they are.

    The one tree-to-device move of the package, so that batching and Monte Carlo hand tensors to a
    device the same way; whether a copy waits is :func:`asynchronous_copy`'s decision.
    """
    flat = Flat.of(tree)
    leaves = [
        leaf.to(device, non_blocking=asynchronous_copy(leaf.device, device, source_kept))
        if isinstance(leaf, torch.Tensor)
        else leaf
        for leaf in flat.leaves
    ]
    return flat.rebuild(leaves)


def pinned(tree: Any) -> Any:
    """``tree`` with its CPU tensors in pinned (page-locked) memory, from which copies to a CUDA
    device run without the host waiting: a copy of each such tensor (one per tensor, however many
    leaves hold it)."""
    copies: dict[int, torch.Tensor] = {}

    def pin(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.device.type != "cpu" or leaf.is_pinned():
            return leaf
        if id(leaf) not in copies:
            copies[id(leaf)] = leaf.pin_memory()
        return copies[id(leaf)]

    flat = Flat.of(tree)
    return flat.rebuild([pin(leaf) for leaf in flat.leaves])
