"""`LocalCommunicator`: the `Communicator` of a single-process strategy, over one
`CrossDeviceOps` (every replica is local, so local results are global)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, final

import torch

from ..devices import Device
from ..reduce_op import ReduceOp

__all__ = ["DeviceOps", "LocalCommunicator"]


class DeviceOps(Protocol):
    """What `LocalCommunicator` needs from a `CrossDeviceOps`."""

    def reduce_packed(self, reduce_op: ReduceOp, per_replica: Sequence[Sequence[torch.Tensor]],
                      destinations: Sequence[tuple[Device, ...]], bytes_per_pack: int
                      ) -> list[list[torch.Tensor]]: ...

    def gather_to_devices(self, components: Sequence[torch.Tensor], dim: int,
                          devices: Sequence[Device]) -> list[torch.Tensor]: ...

    def broadcast_to_devices(self, tensor: torch.Tensor, devices: Sequence[Device]
                             ) -> list[torch.Tensor]: ...


@final
class LocalCommunicator:
    """Moves data between the replicas of one process through ``ops``.

    Example:
        >>> import torch, mirrored
        >>> from mirrored._src.devices import parse_device
        >>> comm = LocalCommunicator(mirrored.ReductionToOneDevice())
        >>> cpu = (parse_device("CPU:0"),)
        >>> comm.reduce_packed(ReduceOp.SUM, [[torch.tensor(1.)], [torch.tensor(2.)]],
        ...                    [cpu], 0)
        [[tensor(3.)]]
    """

    __slots__ = ("ops",)

    def __init__(self, ops: DeviceOps) -> None:
        self.ops = ops

    def reduce_packed(self, reduce_op: ReduceOp, per_replica: Sequence[Sequence[torch.Tensor]],
                      destinations: Sequence[tuple[Device, ...]], bytes_per_pack: int,
                      label: str = "") -> list[list[torch.Tensor]]:
        return self.ops.reduce_packed(reduce_op, per_replica, destinations, bytes_per_pack)

    def gather(self, per_replica: Sequence[torch.Tensor], dim: int,
               destinations: tuple[Device, ...]) -> tuple[list[torch.Tensor], list[int]]:
        sizes = [t.shape[dim] for t in per_replica]
        return self.ops.gather_to_devices(per_replica, dim, destinations), sizes

    def broadcast(self, tensor: torch.Tensor, destinations: tuple[Device, ...]
                  ) -> list[torch.Tensor]:
        return self.ops.broadcast_to_devices(tensor, destinations)

    def sum_counts(self, per_replica: Sequence[Sequence[int]], what: str = "") -> list[int]:
        return [sum(counts) for counts in zip(*per_replica, strict=True)]

    def __repr__(self) -> str:
        return f"LocalCommunicator({self.ops!r})"
