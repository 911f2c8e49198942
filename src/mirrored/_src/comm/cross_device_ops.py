"""`CrossDeviceOps`: the pluggable layer that combines components living on several
devices and copies results to destination devices.

A `CrossDeviceOps` implements two primitives: `reduce_to_devices` (combine
equally shaped components with SUM, MIN or MAX and give each destination its
own copy) and `broadcast_to_devices`; `gather_to_devices` (concatenate) has a
default. Fusion (`reduce_packed`) is built on them here, once. A strategy uses
its `CrossDeviceOps` through a `LocalCommunicator`; the TF-style `reduce`,
`batch_reduce` and `broadcast` go through the same code path (``comm.batch``).

- `ReductionToOneDevice`: the reference: copy to one device, combine, copy out.
- `NcclAllReduce`: single-process NCCL over several CUDA devices, through
  ``torch.cuda.nccl``; chosen automatically when every replica has its own GPU.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, final

import torch

from ..devices import Device, parse_device
from ..options import CommunicationOptions
from ..reduce_op import ReduceOp
from . import batch, packing
from .host import combine, concat, copy_to
from .local import LocalCommunicator

__all__ = ["CrossDeviceOps", "NcclAllReduce", "ReductionToOneDevice", "sums_directly"]


class CrossDeviceOps(abc.ABC):
    """Combines and copies tensors across devices; subclass it to plug in a transport.

    Subclasses implement `reduce_to_devices` and `broadcast_to_devices`;
    everything else (MEAN, destinations, packing) is shared.
    """

    @abc.abstractmethod
    def reduce_to_devices(self, reduce_op: ReduceOp, components: Sequence[torch.Tensor],
                          devices: Sequence[Device]) -> list[torch.Tensor]:
        """Combines equally shaped ``components`` (replica order) with SUM, MIN or MAX.

        Returns:
            One new tensor per destination in ``devices``, none aliasing another or
            a component.
        """

    @abc.abstractmethod
    def broadcast_to_devices(self, tensor: torch.Tensor, devices: Sequence[Device]
                             ) -> list[torch.Tensor]:
        """One new copy of ``tensor`` per destination in ``devices``."""

    def gather_to_devices(self, components: Sequence[torch.Tensor], dim: int,
                          devices: Sequence[Device]) -> list[torch.Tensor]:
        """Concatenates ``components`` (replica order; sizes may differ along ``dim``)
        onto the first destination, then copies it to the others."""
        first = concat(components, dim, devices[0].torch_device)
        return [first, *(copy_to(first, d.torch_device) for d in devices[1:])]

    # ---------------------------------------------------------- TF-style API
    def reduce(self, reduce_op: ReduceOp | str, per_replica_value: Any, destinations: Any,
               options: CommunicationOptions | None = None) -> Any:
        """Reduces ``per_replica_value`` across replicas to ``destinations``.

        Returns:
            A tensor for one destination device, a `Mirrored` for several.

        Raises:
            ValueError: SUM of a value that is not per-replica; mismatched components.

        Example:
            >>> import torch, mirrored
            >>> ops = mirrored.ReductionToOneDevice()
            >>> v = mirrored.PerReplica([torch.tensor(1.0), torch.tensor(2.0)],
            ...                         devices=["CPU:0", "CPU:1"])
            >>> ops.reduce("SUM", v, destinations=v)
            Mirrored:{0: tensor(3.), 1: tensor(3.)}
        """
        return self.batch_reduce(reduce_op, [(per_replica_value, destinations)], options)[0]

    def batch_reduce(self, reduce_op: ReduceOp | str,
                     value_destination_pairs: Sequence[tuple[Any, Any]],
                     options: CommunicationOptions | None = None) -> list[Any]:
        """Reduces several values, packing those of one dtype and destinations into
        buffers of at most ``options.bytes_per_pack`` bytes, each reduced once.

        Returns:
            A list with one result per pair, in order.

        Example:
            >>> import torch, mirrored
            >>> v = mirrored.PerReplica([torch.tensor(1.0), torch.tensor(4.0)])
            >>> mirrored.ReductionToOneDevice().batch_reduce("MEAN", [(v, "CPU:0")])
            [tensor(2.5000)]
        """
        merged = CommunicationOptions().merge(options)
        return batch.batch_reduce(LocalCommunicator(self), reduce_op, value_destination_pairs,
                                  bytes_per_pack=merged.bytes_per_pack)

    def broadcast(self, tensor: Any, destinations: Any) -> Any:
        """Copies ``tensor`` to every destination device.

        Example:
            >>> import torch, mirrored
            >>> mirrored.ReductionToOneDevice().broadcast(torch.tensor(1.0), "CPU:1")
            tensor(1.)
        """
        return batch.broadcast(LocalCommunicator(self), tensor, destinations)

    def reduce_packed(self, reduce_op: ReduceOp, per_replica: Sequence[Sequence[torch.Tensor]],
                      destinations: Sequence[tuple[Device, ...]], bytes_per_pack: int
                      ) -> list[list[torch.Tensor]]:
        """Combines many values at once with SUM, MIN or MAX, fused into packs.

        Values of one dtype, device and destinations (the same tuple object) share
        packs of at most ``bytes_per_pack`` bytes (0: no limit); each pack goes
        through `reduce_to_devices` once.

        Args:
            reduce_op: SUM, MIN or MAX.
            per_replica: ``per_replica[r][k]`` is replica ``r``'s component of value
                ``k``; components of one value are alike.
            destinations: ``destinations[k]`` are value ``k``'s destination devices.
            bytes_per_pack: the pack size limit.

        Returns:
            ``out[k][d]``: value ``k``'s result on its ``d``-th destination (views of
            the reduced packs, none shared between destinations).
        """
        first = per_replica[0]
        keys = [(t.dtype, t.device, id(destinations[k])) for k, t in enumerate(first)]
        nbytes = [t.numel() * t.element_size() for t in first]
        out: list[list[torch.Tensor]] = [[] for _ in first]
        for members in packing.plan(nbytes, keys, bytes_per_pack):
            flats = [packing.pack([leaves[m] for m in members]) for leaves in per_replica]
            reduced = self.reduce_to_devices(reduce_op, flats, destinations[members[0]])
            like = [first[m] for m in members]
            for flat in reduced:
                for m, part in zip(members, packing.unpack(flat, like), strict=True):
                    out[m].append(part)
        return out


@final
class ReductionToOneDevice(CrossDeviceOps):
    """The reference: copies components to one device, combines them there in replica
    order, then copies the result to each destination.

    Args:
        reduce_to_device: where to combine; default: the first destination.
        accumulation_fn: how SUM (and MEAN, before its division) combines the
            components once they are on ``reduce_to_device``: called with the list of
            components in replica order, it returns one tensor of their shape and dtype
            (TF's ``accumulation_fn``, default ``tf.math.add_n``; here ``None`` sums in
            place, in replica order). MIN and MAX ignore it.

    Raises:
        TypeError: ``accumulation_fn`` is not callable, or returns something other
            than a tensor.
        ValueError: it returns a tensor of another shape or dtype.

    Example:
        >>> import torch, mirrored
        >>> strategy = mirrored.MirroredStrategy(
        ...     ["CPU:0", "CPU:1"], cross_device_ops=mirrored.ReductionToOneDevice())
        >>> v = mirrored.PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
        >>> strategy.extended.reduce_to("MEAN", v, destinations="CPU:0")
        tensor(1.5000)
    """

    def __init__(self, reduce_to_device: str | torch.device | None = None,
                 accumulation_fn: Callable[[list[torch.Tensor]], torch.Tensor] | None = None
                 ) -> None:
        self._device = None if reduce_to_device is None else parse_device(reduce_to_device)
        if accumulation_fn is not None and not callable(accumulation_fn):
            raise TypeError("accumulation_fn must be a callable (list of tensors -> tensor) "
                            f"or None; got {type(accumulation_fn).__name__}")
        self._accumulate = accumulation_fn

    def _accumulated(self, accumulate: Callable[[list[torch.Tensor]], torch.Tensor],
                     components: Sequence[torch.Tensor], target: torch.device
                     ) -> torch.Tensor:
        first = components[0]
        total = accumulate([c if c.device == target else c.to(target) for c in components])
        if not isinstance(total, torch.Tensor):
            raise TypeError(f"ReductionToOneDevice's accumulation_fn must return a tensor; "
                            f"got {type(total).__name__}")
        if total.shape != first.shape or total.dtype != first.dtype:
            raise ValueError(
                "ReductionToOneDevice's accumulation_fn must return a tensor shaped like "
                f"its inputs: expected {first.dtype} {list(first.shape)}, got {total.dtype} "
                f"{list(total.shape)}")
        return total.to(target)

    @staticmethod
    def _fresh(total: torch.Tensor, components: Sequence[torch.Tensor],
               devices: Sequence[Device]) -> list[torch.Tensor]:
        """One copy per destination, never aliasing a component (an accumulation_fn may
        return one of its inputs, or a view of it)."""
        ptr = total.untyped_storage().data_ptr()
        aliased = any(c.untyped_storage().data_ptr() == ptr for c in components)
        return [total if i == 0 and not aliased and d.torch_device == total.device
                else copy_to(total, d.torch_device) for i, d in enumerate(devices)]

    def reduce_to_devices(self, reduce_op: ReduceOp, components: Sequence[torch.Tensor],
                          devices: Sequence[Device]) -> list[torch.Tensor]:
        target = (self._device or devices[0]).torch_device
        if self._accumulate is not None and reduce_op in (ReduceOp.SUM, ReduceOp.MEAN):
            total = self._accumulated(self._accumulate, components, target)
            return self._fresh(total, components, devices)
        total = combine(reduce_op, components, target)
        return [total if i == 0 and d.torch_device == target else copy_to(total, d.torch_device)
                for i, d in enumerate(devices)]

    def broadcast_to_devices(self, tensor: torch.Tensor, devices: Sequence[Device]
                             ) -> list[torch.Tensor]:
        return [copy_to(tensor, d.torch_device) for d in devices]

    def __repr__(self) -> str:
        device = "" if self._device is None else repr(self._device.short_name)
        return f"ReductionToOneDevice({device})"



_NCCL_OPS = {ReduceOp.SUM: 0, ReduceOp.MAX: 2, ReduceOp.MIN: 3}


@final
class NcclAllReduce(CrossDeviceOps):
    """Single-process NCCL all-reduce over several CUDA devices (``torch.cuda.nccl``).

    Used when every component is on its own CUDA device and the destinations are
    those devices, in order; anything else goes through `ReductionToOneDevice`.
    """

    def __init__(self) -> None:
        self._fallback = ReductionToOneDevice()

    def reduce_to_devices(self, reduce_op: ReduceOp, components: Sequence[torch.Tensor],
                          devices: Sequence[Device]) -> list[torch.Tensor]:
        targets = [d.torch_device for d in devices]
        if (len(components) > 1 and all(t.type == "cuda" for t in targets)
                and [c.device for c in components] == targets
                and len(set(targets)) == len(targets)):
            from torch.cuda import nccl

            outputs = [c.contiguous().clone() for c in components]
            if nccl.is_available(outputs):  # type: ignore[no-untyped-call]
                nccl.all_reduce(outputs, op=_NCCL_OPS[reduce_op])  # type: ignore[no-untyped-call]
                return outputs
        return self._fallback.reduce_to_devices(reduce_op, components, devices)

    def broadcast_to_devices(self, tensor: torch.Tensor, devices: Sequence[Device]
                             ) -> list[torch.Tensor]:
        return self._fallback.broadcast_to_devices(tensor, devices)

    def __repr__(self) -> str:
        return "NcclAllReduce()"


def sums_directly(communicator: object) -> bool:
    """Whether ``communicator`` combines host tensors of one device exactly as
    `host.combine_each` does: a `LocalCommunicator` over a default
    `ReductionToOneDevice` (no ``accumulation_fn``, no ``reduce_to_device``), so
    that small collectives may skip packing with bitwise-equal results."""
    if type(communicator) is not LocalCommunicator:
        return False
    ops = communicator.ops
    return type(ops) is ReductionToOneDevice and ops._accumulate is None and ops._device is None
