"""``strategy.reduce`` and ``strategy.gather``: cross-replica reductions of values that
hold one component per local replica, through the strategy's communicator.

Every per-replica leaf of a nest is planned and prepared (reduced over ``axis``
locally), all of them travel in one fused ``reduce_packed`` call to the current
device, and each total is finished (MEAN division, promotion). Results are
detached: a cross-replica result is a value to report, not part of a replica's
autograd graph.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from .. import pytree
from ..devices import Device, current_device
from ..reduce_op import ReduceOp, op_label
from ..reduction import (
    SUM_IS_MEAN,
    LeafPlan,
    cached_plan,
    check_dtype,
    finish,
    no_elements_message,
    normalize_axis,
    op_title,
    plan_components,
    plan_gather,
    plan_leaf,
    prepare,
)
from ..values import DistributedValues, Mirrored, PerReplica, to_tensor
from .call import check_layout, counts_ride, sum_with_counts
from .parts import Parts

__all__ = ["check_components", "gather", "reduce"]


def check_components(parts: Parts, value: DistributedValues[Any], where: str) -> None:
    """A distributed value must have one component per local replica.

    Raises:
        ValueError: naming the value, its component count and the replicas.
    """
    topology = parts.topology
    if len(value.values) != topology.num_local_replicas:
        local = "local " if topology.is_multi_worker else ""
        raise ValueError(
            f"{where} is a {type(value).__name__} with {len(value.values)} components "
            f"but this strategy has {topology.num_local_replicas} {local}replicas "
            f"({', '.join(d.short_name for d in topology.devices)}); build it with "
            "strategy.run or experimental_distribute_values_from_function")


def _destination(device: torch.device) -> tuple[Device, ...]:
    """The replica device results are combined on for ``device`` (the host for the
    CPU and for devices no replica can be on, like ``meta``)."""
    return (Device("GPU", device.index or 0) if device.type == "cuda" else Device("CPU", 0),)


def _to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    return tensor if tensor.device == device else tensor.to(device)


def _detached(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach() if tensor.requires_grad else tensor


def _reduce_alone(op: ReduceOp, tensor: torch.Tensor, axes: tuple[int, ...],
                  device: torch.device) -> torch.Tensor:
    """One replica in all, a tensor, an axis (the README loop's per-step reduce): the
    replica's own reduction is the result, with no communicator round trip and no
    message built unless something is wrong (a valid plan is cached by dtype, rank
    and axes). MEAN is ``sum(dim, dtype=accumulation).div_(count)``, which is what
    ``tensor.mean(dim)`` computes on the CPU for floating dtypes."""
    plan = cached_plan(op, tensor, axes)
    if plan is None:
        title = op_title("reduce", op, axes, show_none=True)
        plan = plan_leaf(title, op, tensor, axes, pytree.format_path(()))
    partial, count = prepare(plan, tensor)
    if plan.dims is not None and plan.op in (ReduceOp.MIN, ReduceOp.MAX) and not count:
        raise ValueError(no_elements_message(op_title("reduce", op, axes, show_none=True),
                                             pytree.format_path(())))
    if partial is tensor:  # never hand back (or divide) the caller's own tensor
        partial = partial.clone()
    return _to(finish(plan, partial, count if plan.counts else 1, in_place=True), device)


# (reduce_op, axis) -> (ReduceOp, axes) for an int axis: the one-replica path parses a
# call's arguments once (types are checked before anything is cached, and a bool or a
# float axis never reaches the cache, so False cannot pass for 0).
_PARSED: dict[tuple[Any, int], tuple[ReduceOp, tuple[int, ...]]] = {}
# Where the plan's MEAN (a sum in the input's dtype divided in place by the count) is
# exactly torch's CPU mean: at::mean_out on the CPU is sum_out(...).div_(count) for
# these dtypes (tested against the general path, bit for bit).
_function_modes = torch._C._len_torch_function_stack  # a device mode: results move


def reduce(parts: Parts, reduce_op: ReduceOp | str, value: Any, axis: Any) -> Any:
    """`Strategy.reduce`; see its docstring."""
    if (type(value) is torch.Tensor and type(axis) is int
            and parts.topology.num_replicas_in_sync == 1):
        parsed = _PARSED.get((reduce_op, axis)) if type(reduce_op) in (str, ReduceOp) else None
        if parsed is None:
            parsed = ReduceOp.from_value(reduce_op), (axis,)
            if len(_PARSED) < 256:
                _PARSED[(reduce_op, axis)] = parsed
        tensor = value.detach() if value.requires_grad else value
        plan = cached_plan(parsed[0], tensor, parsed[1])
        if (plan is not None and plan.op is ReduceOp.MEAN and tensor.dtype in SUM_IS_MEAN
                and tensor.is_cpu and not _function_modes()):
            # torch's CPU mean of float32/64 is this sum divided by the count: one op.
            return tensor.mean(plan.dims)
        return _reduce_alone(parsed[0], tensor, parsed[1], current_device())
    op = ReduceOp.from_value(reduce_op)
    axes = normalize_axis(axis)
    device = current_device()
    topology = parts.topology
    if (type(value) is torch.Tensor and axes is not None
            and topology.num_replicas_in_sync == 1):  # one replica in all: nothing to meet
        return _reduce_alone(op, _detached(value), axes, device)
    n_local = topology.num_local_replicas
    title = op_title("reduce", op, axes, show_none=True)
    paths, leaves, spec = pytree.flatten_with_path(value)
    out: list[Any] = [None] * len(leaves)
    jobs: list[tuple[int, LeafPlan, list[torch.Tensor], list[int]]] = []
    worker_values = False
    for k, (path, leaf) in enumerate(zip(paths, leaves, strict=True)):
        where = pytree.format_path(path)
        if isinstance(leaf, DistributedValues):
            check_components(parts, leaf, where)
        if isinstance(leaf, PerReplica):
            components = [_detached(to_tensor(v, where, "reduce")) for v in leaf.values]
            for c in components:
                check_layout(title, c, where)
                if c.is_meta and len(components) > 1:
                    raise TypeError(f"{title} got meta tensors (shapes only, no data) at "
                                    f"{where}: {len(components)} replicas' values cannot be "
                                    "combined")
        else:
            first = leaf.values[0] if isinstance(leaf, Mirrored) else leaf
            tensor = _detached(to_tensor(first, where, "reduce"))
            check_layout(title, tensor, where)
            if topology.worker_values:  # multi-worker: this worker's value, once
                plan = plan_components(title, op, [tensor], axes, topology.labels[:1], where)
                partial, count = prepare(plan, tensor)
                # The other local replicas add nothing: 0 to SUM/MEAN, the same value
                # to MIN/MAX; their count 0 makes MEAN's divisor the workers' elements.
                rest = partial if plan.base_op is not ReduceOp.SUM else torch.zeros_like(partial)
                jobs.append((k, plan, [partial] + [rest] * (n_local - 1),
                             [count] + [0] * (n_local - 1)))
                worker_values = True
                continue
            if axes is None and (topology.follows_caller or topology.num_replicas_in_sync > 1):
                # Without an axis a value that is not per-replica is already the result
                # (MEAN, MIN, MAX); with one replica of an explicit strategy it *is* the
                # replica's value (so MEAN promotes, as for a PerReplica).
                check_dtype(title, op, tensor.dtype, where)
                if op is ReduceOp.SUM and topology.num_replicas_in_sync > 1:
                    raise ValueError(
                        f"{title} got a value that is not per-replica at {where} "
                        f"({type(leaf).__name__}); a value that is not per-replica cannot be "
                        f"summed across {topology.num_replicas_in_sync} replicas; wrap it with "
                        "experimental_distribute_values_from_function or run")
                out[k] = _to(tensor, device)
                continue
            components = [tensor] * n_local  # with an axis: given to every replica
        plan = plan_components(title, op, components, axes, topology.labels, where)
        prepared = [prepare(plan, c) for c in components]
        jobs.append((k, plan, [p for p, _ in prepared], [c for _, c in prepared]))
    if jobs:
        communicator = parts.communicators.default
        counts: list[int] | None = None
        totals: list[list[torch.Tensor]] | None = None
        per_replica = list(zip(*(job[2] for job in jobs), strict=True))
        local_counts = [list(c) for c in zip(*(job[3] for job in jobs), strict=True)]
        destination = _destination(device)
        base_op = jobs[0][1].base_op
        if (op is ReduceOp.MEAN and (worker_values or topology.elastic)) or any(
                plan.counts for _, plan, _, _ in jobs):  # elastic: the replicas combined
            if counts_ride(parts, base_op):
                totals, counts = sum_with_counts(communicator, per_replica, local_counts,
                                                 [destination] * len(jobs),
                                                 parts.options.bytes_per_pack, op_label("", op))
            else:
                counts = communicator.sum_counts(local_counts)
        if totals is None:
            totals = communicator.reduce_packed(base_op, per_replica,
                                                [destination] * len(jobs),
                                                parts.options.bytes_per_pack, op_label("", op))
        for j, ((k, plan, _, _), total) in enumerate(zip(jobs, totals, strict=True)):
            divisor = topology.num_replicas_in_sync if counts is None else counts[j]
            if plan.dims is not None and plan.op in (ReduceOp.MIN, ReduceOp.MAX) and not divisor:
                raise ValueError(no_elements_message(title, pytree.format_path(paths[k])))
            out[k] = _to(finish(plan, total[0], divisor, in_place=True), device)
    return pytree.unflatten(spec, out)


def gather(parts: Parts, value: Any, axis: int) -> Any:
    """`Strategy.gather`; see its docstring."""
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"gather: axis must be an int; got {type(axis).__name__} {axis!r}")
    title = f"gather(axis={axis})"
    device = current_device()
    destination = _destination(device)
    paths, leaves, spec = pytree.flatten_with_path(value)
    out = []
    topology = parts.topology
    for path, leaf in zip(paths, leaves, strict=True):
        where = pytree.format_path(path)
        if isinstance(leaf, DistributedValues):
            check_components(parts, leaf, where)
            components = [_detached(to_tensor(v, where, "gather")) for v in leaf.values]
        elif topology.worker_values and (getattr(leaf, "ndim", 0) > 0 or (
                topology.num_local_replicas == 1 and not isinstance(leaf, bool)
                and isinstance(leaf, numbers.Number | torch.Tensor))):
            # Across workers, a plain tensor or array is this worker's, once (as `reduce`
            # takes it): what `run` returns on a worker of one replica is such a value,
            # and gathering it must reach the other workers' rows; there a number or a
            # rank-0 tensor is one too, refused as a replica's would be (it returned
            # each worker's own). Anything else (a string) is returned as is.
            tensor = _detached(to_tensor(leaf, where, "gather"))
            dim = plan_gather(title, [tensor], axis, topology.labels[:1], where)
            components = [tensor] + [tensor.narrow(dim, 0, 0)] * (topology.num_local_replicas
                                                                   - 1)
        else:
            out.append(leaf)
            continue
        dim = plan_gather(title, components, axis, parts.topology.labels, where)
        copies, _ = parts.communicators.default.gather(components, dim, destination)
        out.append(_to(copies[0], device))
    return pytree.unflatten(spec, out)
