"""Replica-context collectives: all_reduce, all_gather and merge_call.

Each call is prepared on the replica's own thread (inputs converted, reduced
over ``axis`` locally, checked), meets the other replicas in the strategy's
`Rendezvous`, is combined once by the last replica to arrive (packed per dtype,
through the strategy's `CrossDeviceOps`, in replica order), and is finished on
the replica's thread again (MEAN division, unpacking). all_reduce and
all_gather are differentiable: their backward passes are collectives too.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from . import context, pytree
from .devices import Device
from .options import CommunicationOptions
from .reduce_op import ReduceOp
from .reduction import copy_to, describe, mean_dtype, normalize_axis, sum_dtype
from .rendezvous import Arrival, Failure
from .values import DistributedValues, regroup, select_replica, to_tensor

if TYPE_CHECKING:
    from .strategy import Strategy

__all__ = ["all_gather", "all_reduce", "call_site", "merge_call"]


def call_site(depth: int) -> str:
    """``file.py:line`` of the frame ``depth`` levels above the caller."""
    frame = sys._getframe(depth + 1)
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _tensors(value: Any, title: str) -> tuple[list[torch.Tensor], pytree.PyTreeSpec]:
    leaves, spec = pytree.flatten(value)
    tensors = []
    for k, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            where = pytree.format_path(pytree.flatten_with_path(value)[0][k])
            if isinstance(leaf, DistributedValues):
                raise TypeError(
                    f"{title} takes this replica's own tensors; got a {type(leaf).__name__} at "
                    f"{where}. Pass values from inside strategy.run"
                )
            leaf = to_tensor(leaf, where, title)
        tensors.append(leaf)
    return tensors, spec


def _identity(op: ReduceOp, dtype: torch.dtype) -> float | int | bool:
    if dtype.is_floating_point:
        return math.inf if op is ReduceOp.MIN else -math.inf
    info = torch.iinfo(dtype)
    return info.max if op is ReduceOp.MIN else info.min


def _masked_shape(shape: torch.Size, dims: Sequence[int]) -> tuple[int, ...]:
    return tuple(-1 if d in dims else s for d, s in enumerate(shape))


def _leaf_dims(title: str, tensor: torch.Tensor, axes: tuple[int, ...], where: str
               ) -> tuple[int, ...]:
    rank = tensor.dim()
    if rank == 0 and axes:
        raise ValueError(f"{title}: a rank-0 value at {where} has no axis {axes[0]}; use "
                         "axis=None to reduce scalars across replicas")
    dims = []
    for a in axes:
        if not -rank <= a < rank:
            raise ValueError(f"{title}: axis {a} is out of range for the rank-{rank} value at "
                             f"{where} ({describe(tensor)}); valid axes are {-rank}..{rank - 1}")
        dims.append(a % rank)
    if len(set(dims)) != len(dims):
        raise ValueError(f"{title}: axis {axes} names the same dimension twice for the rank-"
                         f"{rank} value at {where}")
    return tuple(dims)


def _refuse_in_merge_fn(strategy: Strategy, arrival: Arrival) -> None:
    if strategy.num_replicas_in_sync > 1 and context.in_merge_fn_of_run():
        raise RuntimeError(
            f"{arrival.title} at {arrival.site} was called inside a merge_fn; collectives, and "
            "backward passes through them, must run in the replicas, not in merge_fn"
        )


class _Collective:
    """One replica's side of one all_reduce or all_gather call."""

    def __init__(self, strategy: Strategy, replica_id: int, options: CommunicationOptions,
                 site: str) -> None:
        self.strategy = strategy
        self.replica_id = replica_id
        self.options = options
        self.site = site

    def exchange(self, arrival: Arrival) -> Any:
        _refuse_in_merge_fn(self.strategy, arrival)
        if self.strategy.num_replicas_in_sync == 1:
            result = arrival.combine([arrival])[0]
            if isinstance(result, Failure):
                raise result.error_type(result.message)
            return result
        return self.strategy._rendezvous.exchange(self.replica_id, arrival,
                                                  self.options.timeout_seconds)


class _AllReduce(_Collective):
    def __init__(self, strategy: Strategy, replica_id: int, options: CommunicationOptions,
                 site: str, op: ReduceOp, axes: tuple[int, ...] | None, value: Any,
                 title: str, spec: pytree.PyTreeSpec) -> None:
        super().__init__(strategy, replica_id, options, site)
        self.op = op
        self.axes = axes
        self.value = value
        self.title = title
        self.spec = spec
        self.dims: list[tuple[int, ...]] = []
        self.counts: list[int] = []
        self.global_counts: list[int] = []

    def forward(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        op, axes = self.op, self.axes
        for k, t in enumerate(tensors):
            if t.dtype == torch.bool or (t.dtype.is_complex and op in (ReduceOp.MIN,
                                                                        ReduceOp.MAX)):
                where = pytree.format_path(pytree.flatten_with_path(self.value)[0][k])
                if t.dtype == torch.bool:
                    raise TypeError(f"{self.title} cannot reduce bool tensors (at {where}); "
                                    "cast them first, e.g. x.to(torch.int32)")
                raise TypeError(f"{self.title} is not defined for complex dtype {t.dtype} "
                                f"(at {where})")
        if axes is None:
            partials = list(tensors)
            if op is ReduceOp.MEAN:  # integers sum exactly in int64
                partials = [t if t.is_floating_point() else t.to(sum_dtype(op, t.dtype))
                            for t in partials]
            signature_shapes = tuple(tuple(t.shape) for t in tensors)
        else:
            paths = None
            partials = []
            shapes = []
            for k, t in enumerate(tensors):
                if paths is None and (t.dim() == 0 or any(not -t.dim() <= a < t.dim()
                                                          for a in axes)
                                      or len({a % t.dim() for a in axes}) != len(axes)):
                    paths = pytree.flatten_with_path(self.value)[0]
                where = pytree.format_path(paths[k]) if paths is not None else "value"
                dims = _leaf_dims(self.title, t, axes, where)
                count = math.prod(t.shape[d] for d in dims)
                self.dims.append(dims)
                self.counts.append(count)
                shapes.append(_masked_shape(t.shape, dims))
                if op is ReduceOp.SUM or op is ReduceOp.MEAN:
                    accumulate = sum_dtype(op, t.dtype)
                    partials.append(t.sum(dim=dims, dtype=accumulate) if dims
                                    else t.to(accumulate))
                elif count == 0:
                    kept = [s for d, s in enumerate(t.shape) if d not in dims]
                    partials.append(torch.full(kept, _identity(op, t.dtype), dtype=t.dtype,
                                               device=t.device))
                else:
                    fn = torch.amin if op is ReduceOp.MIN else torch.amax
                    partials.append(fn(t, dim=dims) if dims else t)
            signature_shapes = tuple(shapes)
        dtypes = tuple(t.dtype for t in tensors)
        arrival = Arrival(
            title=self.title, site=self.site,
            signature=(self.title, self.spec, signature_shapes, dtypes),
            structure=self.spec,
            leaves=tuple(zip(dtypes, (tuple(t.shape) for t in tensors), strict=True)),
            value=self.value,
            payload=(partials, self.counts),
            combine=self.combine,
        )
        reduced, self.global_counts, failure = self.exchange(arrival)
        if failure is not None:
            raise ValueError(failure)
        return [self.finish(k, t, tensors[k].dtype) for k, t in enumerate(reduced)]

    def finish(self, k: int, total: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.op is not ReduceOp.MEAN:
            return total
        divisor = self.strategy.num_replicas_in_sync if self.axes is None else (
            self.global_counts[k])
        promote = mean_dtype(dtype)
        return (total if promote == total.dtype else total.to(promote)).div_(divisor)

    def combine(self, arrivals: Sequence[Arrival]) -> list[Any]:
        n = len(arrivals)
        partials = [a.payload[0] for a in arrivals]
        first = partials[0]
        if n == 1:  # one replica: a copy on the value's own device (the default strategy's
            # device is whatever the current one is, so no CrossDeviceOps is involved)
            local_counts: list[int] = list(arrivals[0].payload[1])
            return [([p.clone() for p in first], local_counts,
                     self._no_elements(local_counts))]
        devices: tuple[Device, ...] = self.strategy._devices
        ops = self.strategy._cross_device_ops_for(self.options)
        base_op = ReduceOp.SUM if self.op is ReduceOp.MEAN else self.op
        reduced = ops.reduce_packed(base_op, partials, [devices] * len(first),
                                    self.options.bytes_per_pack)
        outputs = [[per_value[r] for per_value in reduced] for r in range(n)]
        counts: list[int] = []
        if self.axes is not None:
            counts = [sum(a.payload[1][k] for a in arrivals) for k in range(len(first))]
        failure = self._no_elements(counts)
        return [(outputs[r], counts, failure) for r in range(n)]

    def _no_elements(self, counts: list[int]) -> str | None:
        """The message for MIN/MAX over an axis where no replica has an element."""
        if self.axes is None or self.op not in (ReduceOp.MIN, ReduceOp.MAX) or 0 not in counts:
            return None
        where = pytree.format_path(pytree.flatten_with_path(self.value)[0][counts.index(0)])
        return (f"{self.title} has no elements to reduce at {where}: every replica's value is "
                "empty along the axis")


class _AllReduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, job: _AllReduce, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = job.forward(tensors)
        ctx.job = job
        ctx.shapes = [t.shape for t in tensors]
        ctx.outputs = [(t.shape, t.dtype, t.device) for t in outputs]
        if job.op in (ReduceOp.MIN, ReduceOp.MAX):
            ctx.save_for_backward(*tensors, *outputs)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        job: _AllReduce = ctx.job
        n_in = len(ctx.shapes)
        upstream = _zeros_for_none(grads, ctx.outputs)
        dims = [job.dims[k] if job.axes is not None else () for k in range(n_in)]
        if job.op in (ReduceOp.MIN, ReduceOp.MAX):
            # The gradient goes to the elements that attain the extreme, split evenly
            # among ties across replicas (as torch.amin/amax do within one tensor).
            saved = ctx.saved_tensors
            masks = [(x == _expand(out, d, x.shape)).to(g.dtype)
                     for x, out, d, g in zip(saved[:n_in], saved[n_in:], dims, upstream,
                                             strict=True)]
            ties = [m.sum(dim=d, dtype=m.dtype) if d else m for m, d in zip(masks, dims,
                                                                            strict=True)]
            summed = _gradient_all_reduce(job, [*upstream, *ties])
            return (None, *(_expand(g / t.clamp(min=1), d, shape) * m for g, t, d, shape, m in
                            zip(summed[:n_in], summed[n_in:], dims, ctx.shapes, masks,
                                strict=True)))
        total = _gradient_all_reduce(job, upstream)
        result = []
        for k in range(n_in):
            g = total[k]
            if job.op is ReduceOp.MEAN:
                g = g / (job.strategy.num_replicas_in_sync if job.axes is None
                         else job.global_counts[k])
            result.append(_expand(g, dims[k], ctx.shapes[k]))
        return (None, *result)


def _zeros_for_none(grads: Sequence[torch.Tensor | None],
                    outputs: Sequence[tuple[torch.Size, torch.dtype, torch.device]]
                    ) -> list[torch.Tensor]:
    return [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype, device) in zip(grads, outputs, strict=True)]


def _expand(g: torch.Tensor, dims: Sequence[int], shape: torch.Size) -> torch.Tensor:
    for d in sorted(dims):
        g = g.unsqueeze(d)
    return g.expand(shape)


def _gradient_all_reduce(job: _Collective, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    title = f"gradient of {job.title if isinstance(job, _AllReduce) else 'all_gather'}"
    inner = _AllReduce(job.strategy, job.replica_id, job.options, job.site, ReduceOp.SUM, None,
                       grads, title, pytree.flatten(grads)[1])
    return inner.forward(grads)


def all_reduce(strategy: Strategy, replica_id: int, reduce_op: ReduceOp | str, value: Any,
               options: CommunicationOptions | None, axis: Any, site: str) -> Any:
    """`ReplicaContext.all_reduce`; see its docstring."""
    op = ReduceOp.from_value(reduce_op)
    axes = normalize_axis(axis)
    merged = strategy._communication_options.merge(options)
    # axis=0 and axis=(0,) are the same call, so they print (and compare) the same.
    axis_text = "" if axes is None else (
        f", axis={axes[0]}" if len(axes) == 1 else f", axis={axes}")
    title = f"all_reduce({op.name}{axis_text})"
    tensors, spec = _tensors(value, title)
    job = _AllReduce(strategy, replica_id, merged, site, op, axes, value, title, spec)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        outputs = list(_AllReduceFunction.apply(job, *tensors))  # type: ignore[no-untyped-call]
    else:
        outputs = job.forward(tensors)
    return pytree.unflatten(spec, outputs)


class _AllGather(_Collective):
    def __init__(self, strategy: Strategy, replica_id: int, options: CommunicationOptions,
                 site: str, axis: int, value: Any, spec: pytree.PyTreeSpec) -> None:
        super().__init__(strategy, replica_id, options, site)
        self.axis = axis
        self.value = value
        self.spec = spec
        self.title = f"all_gather(axis={axis})"
        self.dims: list[int] = []
        self.offsets: list[tuple[int, int]] = []

    def forward(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        shapes = []
        for k, t in enumerate(tensors):
            where = pytree.format_path(pytree.flatten_with_path(self.value)[0][k]) if (
                t.dim() == 0 or not -t.dim() <= self.axis < t.dim()) else "value"
            if t.dim() == 0:
                raise ValueError(f"{self.title} cannot concatenate the rank-0 value at {where}; "
                                 "give it a dimension first, e.g. x[None]")
            (dim,) = _leaf_dims(self.title, t, (self.axis,), where)
            self.dims.append(dim)
            shapes.append(_masked_shape(t.shape, (dim,)))
        dtypes = tuple(t.dtype for t in tensors)
        arrival = Arrival(
            title=self.title, site=self.site,
            signature=(self.title, self.spec, tuple(shapes), dtypes),
            structure=self.spec,
            leaves=tuple(zip(dtypes, (tuple(t.shape) for t in tensors), strict=True)),
            value=self.value, payload=list(tensors), combine=self.combine)
        outputs, self.offsets = self.exchange(arrival)
        return list(outputs)

    def combine(self, arrivals: Sequence[Arrival]) -> list[Any]:
        n = len(arrivals)
        if n == 1:  # a copy on the value's own device
            payload = arrivals[0].payload
            return [([t.clone() for t in payload], [(0, t.shape[d]) for t, d in
                                                    zip(payload, self.dims, strict=True)])]
        devices = self.strategy._devices
        outputs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        offsets: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for k, dim in enumerate(self.dims):
            parts = [a.payload[k] for a in arrivals]
            target = devices[0].torch_device
            gathered = torch.cat([p.to(target) for p in parts], dim=dim)
            start = 0
            for r in range(n):
                size = parts[r].shape[dim]
                offsets[r].append((start, size))
                start += size
                outputs[r].append(gathered if r == 0 else copy_to(gathered,
                                                                  devices[r].torch_device))
        return [(outputs[r], offsets[r]) for r in range(n)]


class _AllGatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, job: _AllGather, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outputs = job.forward(tensors)
        ctx.job = job
        ctx.outputs = [(t.shape, t.dtype, t.device) for t in outputs]
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        job: _AllGather = ctx.job
        total = _gradient_all_reduce(job, _zeros_for_none(grads, ctx.outputs))
        return (None, *(g.narrow(dim, start, size) for g, dim, (start, size)
                        in zip(total, job.dims, job.offsets, strict=True)))


def all_gather(strategy: Strategy, replica_id: int, value: Any, axis: int,
               options: CommunicationOptions | None, site: str) -> Any:
    """`ReplicaContext.all_gather`; see its docstring."""
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"all_gather: axis must be an int; got {type(axis).__name__} {axis!r}")
    merged = strategy._communication_options.merge(options)
    tensors, spec = _tensors(value, f"all_gather(axis={axis})")
    job = _AllGather(strategy, replica_id, merged, site, axis, value, spec)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        outputs = list(_AllGatherFunction.apply(job, *tensors))  # type: ignore[no-untyped-call]
    else:
        outputs = job.forward(tensors)
    return pytree.unflatten(spec, outputs)


def merge_call(strategy: Strategy, replica_id: int, merge_fn: Callable[..., Any],
               args: Sequence[Any], kwargs: dict[str, Any] | None, site: str) -> Any:
    """`ReplicaContext.merge_call`; see its docstring."""
    if not callable(merge_fn):
        raise TypeError(f"merge_call needs a callable merge_fn; got {type(merge_fn).__name__}")
    if not isinstance(args, tuple | list):
        raise ValueError(f"merge_call(merge_fn, args=...) takes a tuple or list; got "
                         f"{type(args).__name__}")
    kwargs = {} if kwargs is None else kwargs
    devices = strategy.extended.worker_devices

    def combine(arrivals: Sequence[Arrival]) -> list[Any]:
        n = len(arrivals)
        merged_args, merged_kwargs = regroup([a.payload[1:] for a in arrivals], devices)
        # merge_fn sees the caller's device, whichever replica's thread runs it.
        with context.in_merge_fn(strategy), torch.device(strategy._caller_device):
            result = arrivals[0].payload[0](strategy, *merged_args, **merged_kwargs)
        leaves, spec = pytree.flatten(result)
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, DistributedValues) and len(leaf.values) != n:
                where = pytree.format_path(pytree.flatten_with_path(result)[0][k], "result")
                raise ValueError(f"merge_fn returned a {type(leaf).__name__} with "
                                 f"{len(leaf.values)} components at {where}, but there are "
                                 f"{n} replicas")
        return [pytree.unflatten(spec, select_replica(r, leaves)) for r in range(n)]

    if strategy.num_replicas_in_sync == 1:
        with context.in_merge_fn(strategy):
            return merge_fn(strategy, *args, **kwargs)
    arrival = Arrival(title="merge_call", site=site, signature=("merge_call",), structure=None,
                      leaves=(), value=None, payload=(merge_fn, tuple(args), kwargs),
                      combine=combine)
    _refuse_in_merge_fn(strategy, arrival)
    return strategy._rendezvous.exchange(replica_id, arrival,
                                         strategy._communication_options.timeout_seconds)
