"""`Topology`: where the replicas of a strategy are, as frozen data.

Every replica id, replica count, MEAN divisor and input split reads it. A
topology holds this worker's local replica devices and the worker's place in
the job; global replica ids follow SPEC's rule
``replica_id_in_sync_group = worker_index * num_local_replicas + local_index``.
"""

from __future__ import annotations

import dataclasses

import torch

from .devices import Device

__all__ = ["Topology"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Topology:
    """The replicas of one strategy.

    Args:
        devices: this worker's replica devices, in local replica order.
        worker_index: this worker's index in the job (0 for a single process).
        num_workers: how many workers the job has, each with ``len(devices)`` replicas.
        follows_caller: the default strategy's topology: its one replica is wherever
            the caller is (the caller's thread and current device), and a value that
            is not per-replica is already "the" value.
        worker_values: a worker of a multi-worker job (of any size): a value that is
            not per-replica is this worker's value, combined once per worker.
        elastic: workers may be missing from a step (`mirrored.elastic`): a MEAN
            divides by the replicas actually combined (counted), not by
            ``num_replicas_in_sync``.
        mixed_kinds: the job's replicas sit on more than one kind of device (a GPU
            and the CPU; another worker's count, as the workers told each other at
            start-up); this worker's own devices are counted in any case (the
            divergence check compares exact bit sums there, not 2-norms).

    Raises:
        ValueError: no devices, or a worker index outside ``0 .. num_workers - 1``.

    Example:
        >>> from mirrored._src.devices import parse_devices
        >>> t = Topology(devices=parse_devices(["CPU:0", "CPU:1"]), worker_index=1,
        ...              num_workers=2)
        >>> t.num_replicas_in_sync, t.replica_ids, t.labels[0]
        (4, (2, 3), 'replica 2 (worker 1, CPU:0)')
    """

    devices: tuple[Device, ...]
    worker_index: int = 0
    num_workers: int = 1
    follows_caller: bool = False
    worker_values: bool = False
    elastic: bool = False
    mixed_kinds: bool = False
    # Derived, filled in __post_init__ (hot paths read them).
    num_local_replicas: int = dataclasses.field(init=False)
    num_replicas_in_sync: int = dataclasses.field(init=False)
    replica_ids: tuple[int, ...] = dataclasses.field(init=False)
    device_names: tuple[str, ...] = dataclasses.field(init=False)
    torch_devices: tuple[torch.device, ...] = dataclasses.field(init=False)
    labels: tuple[str, ...] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        devices = tuple(self.devices)
        if not devices:
            raise ValueError("a topology needs at least one local replica device; got none")
        if not (isinstance(self.num_workers, int) and self.num_workers >= 1):
            raise ValueError(f"num_workers must be an int >= 1; got {self.num_workers!r}")
        if not (isinstance(self.worker_index, int) and 0 <= self.worker_index < self.num_workers):
            raise ValueError(f"worker_index must be in 0..{self.num_workers - 1}; got "
                             f"{self.worker_index!r}")
        n_local = len(devices)
        first = self.worker_index * n_local
        ids = tuple(range(first, first + n_local))
        set_ = object.__setattr__
        set_(self, "devices", devices)
        set_(self, "num_local_replicas", n_local)
        set_(self, "num_replicas_in_sync", n_local * self.num_workers)
        set_(self, "replica_ids", ids)
        set_(self, "device_names", tuple(d.name for d in devices))
        set_(self, "torch_devices", tuple(d.torch_device for d in devices))
        if len({d.kind for d in devices}) > 1:
            set_(self, "mixed_kinds", True)
        if self.num_workers == 1:
            labels = tuple(f"replica {i} ({d.short_name})" for i, d in zip(ids, devices,
                                                                           strict=True))
        else:
            labels = tuple(f"replica {i} (worker {self.worker_index}, {d.short_name})"
                           for i, d in zip(ids, devices, strict=True))
        set_(self, "labels", labels)

    @property
    def first_replica_id(self) -> int:
        """The global id of this worker's local replica 0."""
        return self.replica_ids[0]

    @property
    def is_multi_worker(self) -> bool:
        """Whether replicas live in more than one process."""
        return self.num_workers > 1

    def local_index(self, replica_id: int) -> int:
        """The local index of global replica ``replica_id``.

        Raises:
            ValueError: the replica is not one of this worker's.
        """
        index = replica_id - self.replica_ids[0]
        if not 0 <= index < self.num_local_replicas:
            raise ValueError(f"replica {replica_id} is not local to worker {self.worker_index} "
                             f"(its replicas are {self.replica_ids[0]}..{self.replica_ids[-1]})")
        return index
