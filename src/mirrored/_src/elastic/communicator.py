"""`ElasticCommunicator`: the `Communicator` of an elastic strategy. Local replicas
are combined in-process (a `CrossDeviceOps`), then one torchft fault-tolerant
all-reduce per pack crosses the workers of the step (`ElasticSession.allreduce`).

Only the workers of the step take part: a missing worker's replicas add nothing (0 to
a SUM and to the element counts that MEAN divides by, nothing to MIN/MAX, no rows to a
gather). A gather is two all-reduces (SUM) of zero-padded buffers: the sizes, one
slot per global replica, then the rows, each worker writing its own at its offset.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..comm import packing
from ..comm.cross_device_ops import CrossDeviceOps
from ..comm.host import concat
from ..devices import Device
from ..reduce_op import ReduceOp
from ..topology import Topology
from .session import ElasticSession

__all__ = ["ElasticCommunicator"]

_HOST = Device("CPU", 0)


class ElasticCommunicator:
    """Local replicas first (``local``), then the workers of the step (``session``).

    Example:
        >>> ElasticCommunicator.__name__  # built by ElasticMirroredStrategy
        'ElasticCommunicator'
    """

    def __init__(self, local: CrossDeviceOps, topology: Topology,
                 session: ElasticSession) -> None:
        self._local = local
        self._topology = topology
        self._session = session

    def reduce_packed(self, reduce_op: ReduceOp, per_replica: Sequence[Sequence[torch.Tensor]],
                      destinations: Sequence[tuple[Device, ...]], bytes_per_pack: int,
                      label: str = "") -> list[list[torch.Tensor]]:
        """Combines many values over every replica of the step's workers (SUM, MIN or
        MAX): see `Communicator.reduce_packed`."""
        first = per_replica[0]
        keys = [(t.dtype, id(destinations[k])) for k, t in enumerate(first)]
        packs = packing.plan([t.numel() * t.element_size() for t in first], keys,
                             bytes_per_pack)
        out: list[list[torch.Tensor]] = [[] for _ in first]
        for members in packs:
            flats = [packing.pack([leaves[m].to(_HOST.torch_device) for m in members])
                     for leaves in per_replica]
            flat = self._local.reduce_to_devices(reduce_op, flats, (_HOST,))[0]
            wire = flat.to(torch.uint8) if flat.dtype == torch.bool else flat
            self._session.allreduce(wire, reduce_op)
            flat = wire.to(flat.dtype) if wire is not flat else flat
            like = [first[m] for m in members]
            for copy in self._local.broadcast_to_devices(flat, destinations[members[0]]):
                for m, part in zip(members, packing.unpack(copy, like), strict=True):
                    out[m].append(part)
        return out

    def gather(self, per_replica: Sequence[torch.Tensor], dim: int,
               destinations: tuple[Device, ...]) -> tuple[list[torch.Tensor], list[int]]:
        """Concatenates every replica's component along ``dim``, in global replica order
        (a missing worker's replicas contribute no rows): see `Communicator.gather`."""
        topology = self._topology
        dim = dim % per_replica[0].dim()
        local = concat(per_replica, dim, _HOST.torch_device)
        sizes = torch.zeros(topology.num_replicas_in_sync, dtype=torch.int64)
        first = topology.first_replica_id
        sizes[first:first + len(per_replica)] = torch.tensor([c.shape[dim] for c in per_replica])
        self._session.allreduce(sizes, ReduceOp.SUM)
        counts = [int(s) for s in sizes.tolist()]
        shape = list(local.shape)
        shape[dim] = sum(counts)
        wire_dtype = torch.uint8 if local.dtype == torch.bool else local.dtype
        whole = torch.zeros(shape, dtype=wire_dtype)
        whole.narrow(dim, sum(counts[:first]), local.shape[dim]).copy_(local)
        self._session.allreduce(whole, ReduceOp.SUM)
        return (self._local.broadcast_to_devices(whole.to(local.dtype), destinations), counts)

    def broadcast(self, tensor: torch.Tensor, destinations: tuple[Device, ...]
                  ) -> list[torch.Tensor]:
        """One new copy of ``tensor`` per destination (local only)."""
        return self._local.broadcast_to_devices(tensor, destinations)

    def sum_counts(self, per_replica: Sequence[Sequence[int]], what: str = "") -> list[int]:
        """Element counts summed over the replicas of the step (one int64 all-reduce)."""
        totals = torch.tensor([sum(c) for c in zip(*per_replica, strict=True)],
                              dtype=torch.int64)
        self._session.allreduce(totals, ReduceOp.SUM)
        return [int(t) for t in totals.tolist()]

    def any(self, flag: bool) -> bool:
        """Whether any worker of the step passed ``True`` (a distributed dataset's vote).

        Raises:
            TypeError: ``flag`` is not a bool.
        """
        if not isinstance(flag, bool):
            raise TypeError(f"flag must be a bool; got {type(flag).__name__} {flag!r}")
        votes = torch.tensor([int(flag)], dtype=torch.int64)
        self._session.allreduce(votes, ReduceOp.SUM)
        return bool(votes.item())
