"""``reduce_to`` / ``batch_reduce_to`` / ``broadcast_to`` over any `Communicator`: the
TF-style cross-device API, built once on the reduction math and the communicator.

Nests are reduced leaf by leaf (as TF does), every per-replica leaf of every pair
in one fused ``reduce_packed`` call. A value that is not per-replica (a
`Mirrored` or a plain tensor) is broadcast for MEAN, MIN and MAX, and refused for
SUM (summing it would count it once per replica).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import pytree
from ..devices import Device
from ..reduce_op import ReduceOp, op_label
from ..reduction import LeafPlan, finish, op_title, plan_components, prepare
from ..values import DistributedValues, Mirrored, PerReplica, to_tensor
from .communicator import Communicator
from .destinations import resolve_destinations, wrap

__all__ = ["batch_reduce", "broadcast"]


def _check_count(value: DistributedValues[Any], expected: int, where: str) -> None:
    if len(value.values) != expected:
        raise ValueError(
            f"{where} is a {type(value).__name__} with {len(value.values)} components but "
            f"there are {expected} local replicas; build it with strategy.run or "
            "experimental_distribute_values_from_function")


def batch_reduce(communicator: Communicator, reduce_op: ReduceOp | str,
                 value_destination_pairs: Sequence[tuple[Any, Any]], *, bytes_per_pack: int,
                 num_replicas_in_sync: int | None = None,
                 labels: Sequence[str] | None = None) -> list[Any]:
    """Reduces each ``(value, destinations)`` pair; see ``StrategyExtended.batch_reduce_to``.

    Args:
        communicator: moves the data.
        reduce_op: the op (a `ReduceOp` or its name).
        value_destination_pairs: a list of ``(value, destinations)``.
        bytes_per_pack: the pack size limit for fusion.
        num_replicas_in_sync: the global replica count (MEAN's divisor); ``None``: the
            number of components of the per-replica values (one process).
        labels: how messages name each local replica.

    Returns:
        One result per pair: a tensor for one destination device, a `Mirrored` for
        several (nests keep their structure).
    """
    op = ReduceOp.from_value(reduce_op)
    if not isinstance(value_destination_pairs, tuple | list):
        raise TypeError("value_destination_pairs must be a list of (value, destinations) "
                        f"pairs; got {type(value_destination_pairs).__name__}")
    title = op_title("reduce_to", op, None)
    local = None if labels is None else len(labels)
    results: list[Any] = []
    jobs: list[tuple[list[Any], int, LeafPlan, list[torch.Tensor], tuple[Device, ...]]] = []
    interned: dict[tuple[Device, ...], tuple[Device, ...]] = {}
    for index, pair in enumerate(value_destination_pairs):
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise ValueError(f"value_destination_pairs[{index}] must be a (value, destinations) "
                             f"pair; got {type(pair).__name__}")
        value, destinations = pair
        devices = resolve_destinations(destinations)
        devices = interned.setdefault(devices, devices)  # equal destinations share packs
        paths, leaves, spec = pytree.flatten_with_path(value)
        out: list[Any] = list(leaves)
        for k, (path, leaf) in enumerate(zip(paths, leaves, strict=True)):
            where = pytree.format_path(path, f"value_destination_pairs[{index}]")
            if isinstance(leaf, DistributedValues):
                local = len(leaf.values) if local is None else local
                _check_count(leaf, local, where)
            if isinstance(leaf, PerReplica):
                components = [to_tensor(v, where, "reduce_to").detach() for v in leaf.values]
                names = labels or [f"replica {i}" for i in range(len(components))]
                plan = plan_components(title, op, components, None, names, where)
                partials = [prepare(plan, c)[0] for c in components]
                jobs.append((out, k, plan, partials, devices))
                continue
            if op is ReduceOp.SUM:
                raise ValueError(
                    f"{title} got a value that is not per-replica at {where} "
                    f"({type(leaf).__name__}); summing it across replicas would count it once "
                    "per replica. Pass a PerReplica value, or use MEAN, MIN or MAX")
            first = leaf.values[0] if isinstance(leaf, Mirrored) else leaf
            tensor = to_tensor(first, where, "reduce_to").detach()
            out[k] = wrap(communicator.broadcast(tensor, devices), devices)
        results.append((spec, out))
    if jobs:
        per_replica = list(zip(*(partials for _, _, _, partials, _ in jobs), strict=True))
        reduced = communicator.reduce_packed(jobs[0][2].base_op, per_replica,
                                             [devices for *_, devices in jobs], bytes_per_pack,
                                             op_label("", op))
        divisor = num_replicas_in_sync or len(per_replica)
        for (out, k, plan, _, devices), totals in zip(jobs, reduced, strict=True):
            out[k] = wrap([finish(plan, t, divisor, in_place=True) for t in totals], devices)
    return [pytree.unflatten(spec, out) for spec, out in results]


def broadcast(communicator: Communicator, tensor: Any, destinations: Any) -> Any:
    """Copies ``tensor`` (a `Mirrored`'s value for a `Mirrored`) to each destination device.

    Raises:
        ValueError: a `PerReplica` (its components differ: reduce it first).
    """
    devices = resolve_destinations(destinations)
    if isinstance(tensor, PerReplica):
        raise ValueError("broadcast_to got a PerReplica, whose components differ; reduce it "
                         "first (extended.reduce_to) or pass one tensor or a Mirrored value")
    value = tensor.values[0] if isinstance(tensor, Mirrored) else tensor
    return wrap(communicator.broadcast(to_tensor(value, "tensor", "broadcast_to"), devices),
                devices)
