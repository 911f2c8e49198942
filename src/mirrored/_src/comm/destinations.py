"""Destinations of ``reduce_to``, ``batch_reduce_to`` and ``broadcast_to``: which devices
a result goes to, and the shape of the answer (a tensor for one device, a `Mirrored`
for several)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..devices import Device, parse_device
from ..values import DistributedValues, Mirrored

__all__ = ["device_of_tensor", "resolve_destinations", "wrap"]


def device_of_tensor(tensor: torch.Tensor) -> Device:
    """The replica-device spelling of a tensor's device (logical CPU 0 for the host)."""
    if tensor.device.type == "cuda":
        return Device("GPU", tensor.device.index or 0)
    return Device("CPU", 0)


def resolve_destinations(destinations: Any) -> tuple[Device, ...]:
    """The devices named by ``destinations``: a device string or ``torch.device``, a
    tensor (its device) or a distributed value (its components' devices).

    Raises:
        ValueError: an empty string, a list or tuple, or a malformed device name.
        TypeError: any other type.

    Example:
        >>> [d.short_name for d in resolve_destinations("cpu:1")]
        ['CPU:1']
    """
    if isinstance(destinations, DistributedValues):
        return tuple(parse_device(name) for name in destinations.devices)
    if isinstance(destinations, torch.Tensor):
        return (device_of_tensor(destinations),)
    if isinstance(destinations, str) and not destinations.strip():
        raise ValueError(
            "destinations must not be empty; pass a device string such as 'CPU:0' or "
            "'cuda:1', a tensor, or a distributed value")
    if isinstance(destinations, str | torch.device):
        device = parse_device(destinations)
        if device.kind == "GPU" and device.index >= _gpus():
            raise ValueError(
                f"destinations names {device.short_name} ({destinations!r}), but this "
                f"process has {_gpus()} CUDA device(s); name a device that exists, e.g. "
                "'CPU:0'")
        return (device,)
    if isinstance(destinations, list | tuple):
        raise ValueError(
            "destinations must be one device string, a tensor or a distributed value; got a "
            f"{type(destinations).__name__}. For several destinations pass a distributed value "
            "(its component devices are the destinations)")
    raise TypeError(
        "destinations must be a device string, a torch.device, a tensor or a distributed "
        f"value; got {type(destinations).__name__}")


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def wrap(outputs: Sequence[torch.Tensor], devices: Sequence[Device]) -> Any:
    """One destination: the tensor; several: a `Mirrored` over them."""
    if len(devices) == 1:
        return outputs[0]
    return Mirrored(list(outputs), [d.name for d in devices])
