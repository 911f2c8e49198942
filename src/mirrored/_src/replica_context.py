"""`ReplicaContext`: what code running inside ``strategy.run`` knows about its replica."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .strategy import Strategy

__all__ = ["ReplicaContext"]


class ReplicaContext:
    """The context of one replica, returned by `get_replica_context` inside ``run``.

    Example:
        >>> import mirrored
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> def step():
        ...     ctx = mirrored.get_replica_context()
        ...     return (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync, ctx.devices)
        >>> strategy.experimental_local_results(strategy.run(step))[1]
        (1, 2, ('/job:localhost/replica:0/task:0/device:CPU:1',))
    """

    __slots__ = ("_device", "_replica_id", "_strategy")

    def __init__(self, strategy: Strategy, replica_id_in_sync_group: int, device: str) -> None:
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group
        self._device = device

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id, ``0 .. num_replicas_in_sync - 1`` (a Python ``int``)."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run each step."""
        return self._strategy.num_replicas_in_sync

    @property
    def strategy(self) -> Strategy:
        """The strategy this replica belongs to."""
        return self._strategy

    @property
    def devices(self) -> tuple[str, ...]:
        """The canonical name of the device this replica runs on, as a 1-tuple."""
        return (self._device,)

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")
