"""`CrossDeviceOps`: the pluggable layer that combines components living on several
devices and copies results to destination devices.

A `CrossDeviceOps` implements two primitives: `reduce_to_devices` (combine
equally shaped components with SUM, MIN or MAX and give each destination its
own copy) and `broadcast_to_devices`. The TF-style `reduce`, `batch_reduce` and
`broadcast` are built on them here, once, with destinations resolved, MEAN
(division and dtype promotion) and fusion (packing) handled for every
implementation.

- `ReductionToOneDevice`: the reference: copy to one device, combine, copy out.
- `NcclAllReduce`: single-process NCCL over several CUDA devices, through
  ``torch.cuda.nccl``; chosen automatically when every replica has its own GPU.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, final

import torch

from . import packing
from .devices import Device, parse_device
from .options import CommunicationOptions
from .reduce_op import ReduceOp
from .reduction import combine, copy_to, describe, mean_dtype, sum_dtype
from .values import DistributedValues, Mirrored, PerReplica, to_tensor

__all__ = [
    "CrossDeviceOps",
    "NcclAllReduce",
    "ReductionToOneDevice",
    "resolve_destinations",
]


# (pair index, components in the accumulation dtype, destinations, input dtype)
_Item = tuple[int, list[torch.Tensor], tuple[Device, ...], torch.dtype]


def _device_of_tensor(tensor: torch.Tensor) -> Device:
    if tensor.device.type == "cuda":
        return Device("GPU", tensor.device.index or 0)
    return Device("CPU", 0)


def resolve_destinations(destinations: Any) -> tuple[Device, ...]:
    """The devices named by ``destinations``: a device string or ``torch.device``, a
    tensor (its device) or a distributed value (its components' devices).

    Raises:
        ValueError: an empty string, a list or tuple, or a malformed device name.
        TypeError: any other type.
    """
    if isinstance(destinations, DistributedValues):
        return tuple(parse_device(name) for name in destinations.devices)
    if isinstance(destinations, torch.Tensor):
        return (_device_of_tensor(destinations),)
    if isinstance(destinations, str) and not destinations.strip():
        raise ValueError(
            "destinations must not be empty; pass a device string such as 'CPU:0' or "
            "'cuda:1', a tensor, or a distributed value"
        )
    if isinstance(destinations, str | torch.device):
        return (parse_device(destinations),)
    if isinstance(destinations, list | tuple):
        raise ValueError(
            "destinations must be one device string, a tensor or a distributed value; got a "
            f"{type(destinations).__name__}. For several destinations pass a distributed value "
            "(its component devices are the destinations)"
        )
    raise TypeError(
        "destinations must be a device string, a torch.device, a tensor or a distributed "
        f"value; got {type(destinations).__name__}"
    )


_NEST_HINT = (". reduce_to and broadcast_to take one tensor per value: reduce a nest leaf "
              "by leaf with batch_reduce_to")


def _wrap(outputs: Sequence[torch.Tensor], devices: Sequence[Device]) -> Any:
    if len(devices) == 1:
        return outputs[0]
    return Mirrored(list(outputs), [d.name for d in devices])


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
        """
        op = ReduceOp.from_value(reduce_op)
        options = CommunicationOptions().merge(options)
        if not isinstance(value_destination_pairs, tuple | list):
            raise TypeError("value_destination_pairs must be a list of (value, destinations) "
                            f"pairs; got {type(value_destination_pairs).__name__}")
        results: list[Any] = [None] * len(value_destination_pairs)
        fused: list[_Item] = []
        interned: dict[tuple[Device, ...], tuple[Device, ...]] = {}
        for index, pair in enumerate(value_destination_pairs):
            if not (isinstance(pair, tuple | list) and len(pair) == 2):
                raise ValueError(
                    f"value_destination_pairs[{index}] must be a (value, destinations) pair; "
                    f"got {type(pair).__name__}"
                )
            value, destinations = pair
            devices = resolve_destinations(destinations)
            devices = interned.setdefault(devices, devices)  # equal destinations share packs
            where = f"value_destination_pairs[{index}]"
            if isinstance(value, PerReplica):
                components = [to_tensor(v, where, "reduce_to", _NEST_HINT) for v in value.values]
                _check_alike(components, where)
                dtype = components[0].dtype
                accumulate = sum_dtype(op, dtype)
                fused.append((index, [c.to(accumulate) for c in components], devices, dtype))
                continue
            if isinstance(value, Mirrored) or not isinstance(value, DistributedValues):
                if op is ReduceOp.SUM:
                    raise ValueError(
                        f"reduce_to(SUM) got a value that is not per-replica at {where} "
                        f"({type(value).__name__}); summing it across replicas would count it "
                        "once per replica. Pass a PerReplica value, or use MEAN, MIN or MAX"
                    )
                first = value.values[0] if isinstance(value, Mirrored) else value
                tensor = to_tensor(first, where, "reduce_to", _NEST_HINT)
                results[index] = _wrap(self.broadcast_to_devices(tensor, devices), devices)
        if fused:
            base_op = ReduceOp.SUM if op is ReduceOp.MEAN else op
            per_replica = list(zip(*(components for _, components, _, _ in fused), strict=True))
            reduced = self.reduce_packed(base_op, per_replica,
                                         [devices for _, _, devices, _ in fused],
                                         options.bytes_per_pack)
            for (index, components, devices, dtype), outputs in zip(fused, reduced, strict=True):
                if op is ReduceOp.MEAN:
                    outputs = [_mean(t, len(components), dtype) for t in outputs]
                results[index] = _wrap(outputs, devices)
        return results

    def broadcast(self, tensor: Any, destinations: Any) -> Any:
        """Copies ``tensor`` to every destination device.

        Example:
            >>> import torch, mirrored
            >>> mirrored.ReductionToOneDevice().broadcast(torch.tensor(1.0), "CPU:1")
            tensor(1.)
        """
        devices = resolve_destinations(destinations)
        value = to_tensor(tensor, "tensor", "broadcast_to")
        return _wrap(self.broadcast_to_devices(value, devices), devices)

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


def _mean(total: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    promote = mean_dtype(dtype)
    if promote == total.dtype:
        return total.div_(n)
    return total.to(promote).div_(n)


def _check_alike(components: Sequence[torch.Tensor], where: str) -> None:
    first = components[0]
    if first.dtype == torch.bool:
        raise TypeError(f"cannot reduce bool tensors (at {where}); cast them first")
    if any(c.shape != first.shape or c.dtype != first.dtype for c in components):
        listing = "; ".join(f"replica {i}: {describe(c)}" for i, c in enumerate(components))
        raise ValueError(f"reduce_to needs components of one shape and dtype at {where}; got "
                         f"{listing}")


@final
class ReductionToOneDevice(CrossDeviceOps):
    """The reference: copies components to one device, combines them there in replica
    order, then copies the result to each destination.

    Args:
        reduce_to_device: where to combine; default: the first destination.

    Example:
        >>> import torch, mirrored
        >>> strategy = mirrored.MirroredStrategy(
        ...     ["CPU:0", "CPU:1"], cross_device_ops=mirrored.ReductionToOneDevice())
        >>> v = mirrored.PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
        >>> strategy.extended.reduce_to("MEAN", v, destinations="CPU:0")
        tensor(1.5000)
    """

    def __init__(self, reduce_to_device: str | torch.device | None = None) -> None:
        self._device = None if reduce_to_device is None else parse_device(reduce_to_device)

    def reduce_to_devices(self, reduce_op: ReduceOp, components: Sequence[torch.Tensor],
                          devices: Sequence[Device]) -> list[torch.Tensor]:
        target = (self._device or devices[0]).torch_device
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
