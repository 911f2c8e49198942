"""`StrategyExtended`: the lower-level members of a strategy (``strategy.extended``),
a thin view on the same parts: destinations-based reductions and device lists."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from .. import pytree
from ..collectives.cross_replica import check_components
from ..collectives.parts import Parts
from ..comm import batch
from ..options import CommunicationOptions
from ..reduce_op import ReduceOp
from ..values import DistributedValues, Mirrored, PerReplica
from . import distribute

__all__ = ["StrategyExtended"]


class StrategyExtended:
    """Lower-level members of a strategy, reached as ``strategy.extended``.

    Example:
        >>> import mirrored
        >>> mirrored.MirroredStrategy(["CPU:0", "CPU:1"]).extended.worker_devices[1]
        '/job:localhost/replica:0/task:0/device:CPU:1'
    """

    __slots__ = ("_parts",)

    def __init__(self, parts: Parts) -> None:
        self._parts = parts

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The canonical names of this worker's replica devices, in replica order."""
        return self._parts.topology.device_names

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Where mirrored parameters live: every replica device."""
        return self._parts.topology.device_names

    @property
    def should_checkpoint(self) -> bool:
        """Whether this worker writes checkpoints: the chief (worker 0) only."""
        return self._parts.topology.worker_index == 0

    @property
    def should_save_summary(self) -> bool:
        """Whether this worker writes summaries: the chief (worker 0) only."""
        return self._parts.topology.worker_index == 0

    def _require_cross_replica(self, method: str) -> None:
        distribute.require_cross_replica(self._parts, method)

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any,
                  options: CommunicationOptions | None = None) -> Any:
        """Reduces ``value`` across replicas to ``destinations`` (cross-replica context).

        ``destinations`` is a device string (``"CPU:1"``, ``"cuda:0"``), a tensor (its
        device) or a distributed value (its components' devices);
        ``reduce_to(op, v, destinations=v)`` is the all-reduce of ``v``. A nest of
        per-replica values is reduced leaf by leaf.

        Returns:
            A tensor on the destination for one device; a `Mirrored` with one
            component per destination device for several (a nest of them for a nest).

        Raises:
            ValueError: SUM of a value that is not per-replica (a `Mirrored` included),
                an empty or list ``destinations``, a wrong number of components.
            TypeError: ``destinations`` of another type.
            RuntimeError: called in replica context.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> v = mirrored.PerReplica([torch.tensor(1.0), torch.tensor(2.0)],
            ...                         devices=["CPU:0", "CPU:1"])
            >>> strategy.extended.reduce_to("SUM", v, destinations="CPU:1")
            tensor(3.)
            >>> strategy.extended.reduce_to("SUM", {"a": v}, destinations=v)
            {'a': Mirrored:{0: tensor(3.), 1: tensor(3.)}}
        """
        return self.batch_reduce_to(reduce_op, [(value, destinations)], options)[0]

    def batch_reduce_to(self, reduce_op: ReduceOp | str,
                        value_destination_pairs: Sequence[tuple[Any, Any]],
                        options: CommunicationOptions | None = None) -> list[Any]:
        """`reduce_to` of several ``(value, destinations)`` pairs, packing values of one
        dtype and destinations into buffers of at most ``bytes_per_pack`` bytes.

        Returns:
            A list with one result per pair.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> a = mirrored.PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
            >>> b = mirrored.PerReplica([torch.tensor([3]), torch.tensor([5])])
            >>> strategy.extended.batch_reduce_to("MEAN", [(a, "CPU:0"), (b, "CPU:0")])
            [tensor(1.5000), tensor([4.], dtype=torch.float64)]
        """
        self._require_cross_replica("extended.batch_reduce_to")
        parts = self._parts
        topology = parts.topology
        if not isinstance(value_destination_pairs, tuple | list):
            raise TypeError("value_destination_pairs must be a list of (value, destinations) "
                            f"pairs; got {type(value_destination_pairs).__name__}")
        pairs = list(value_destination_pairs)
        for index, pair in enumerate(pairs):
            if not (isinstance(pair, tuple | list) and len(pair) == 2):
                continue  # batch_reduce reports it
            value = pair[0]
            if isinstance(value, DistributedValues):
                check_components(parts, value, f"value_destination_pairs[{index}]")
            one = topology.num_replicas_in_sync == 1 or (
                topology.worker_values and topology.num_local_replicas == 1)
            if one:  # with one (local) replica every value is that replica's value
                pairs[index] = (pytree.tree_map(partial(_own, topology.device_names), value),
                                pair[1])
        merged = parts.options.merge(options)
        return batch.batch_reduce(parts.communicators.for_options(merged), reduce_op, pairs,
                                  bytes_per_pack=merged.bytes_per_pack,
                                  num_replicas_in_sync=topology.num_replicas_in_sync,
                                  labels=topology.labels)

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """Copies ``tensor`` (or a `Mirrored` value) to each destination device
        (cross-replica context), through the strategy's communicator.

        Returns:
            A tensor for one destination device, a `Mirrored` for several.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> like = mirrored.PerReplica([torch.tensor(0), torch.tensor(0)],
            ...                            devices=["CPU:0", "CPU:1"])
            >>> strategy.extended.broadcast_to(torch.tensor(7), like)
            Mirrored:{0: tensor(7), 1: tensor(7)}
        """
        self._require_cross_replica("extended.broadcast_to")
        return batch.broadcast(self._parts.communicators.default, tensor, destinations)


def _own(names: Sequence[str], leaf: Any) -> Any:
    """A leaf of a value reduced by the only (local) replica, as that replica's value
    (a nest's leaves one by one: a nest of per-replica values has them inside)."""
    if isinstance(leaf, PerReplica):
        return leaf
    return PerReplica([leaf.values[0] if isinstance(leaf, Mirrored) else leaf], names)
