"""``ReplicaContext.all_gather``: every replica receives the concatenation of all
replicas' values along ``axis``, in replica order (sizes may differ along it).
Differentiable: each replica's gradient is its own rows of the summed upstream
gradients.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .. import pytree
from ..options import CommunicationOptions
from ..reduction import check_dtype, gather_dim
from ..runtime.contract import Arrival
from .all_reduce import gradient_all_reduce, zeros_for_none
from .call import call_spec, refuse_in_merge_fn, tensors_of, with_paths
from .parts import Parts

__all__ = ["AllGather", "all_gather"]


@dataclasses.dataclass(frozen=True, slots=True)
class _Result:
    outputs: list[torch.Tensor]
    offsets: list[tuple[int, int]]  # (start, size) of this replica's rows, per leaf


class AllGather:
    """One replica's side of one all-gather."""

    def __init__(self, parts: Parts, index: int, axis: int, options: CommunicationOptions,
                 site: str, value: Any) -> None:
        self.parts = parts
        self.generation: int | None = None  # (for the backward pass: see AllReduce)
        self.index = index
        self.axis = axis
        self.options = options
        self.site = site
        self.value = value
        self.title = f"all_gather(axis={axis})"
        self.dims: list[int] = []
        self.offsets: list[tuple[int, int]] = []

    def forward(self, tensors: Sequence[torch.Tensor], spec: pytree.PyTreeSpec
                ) -> list[torch.Tensor]:
        title = self.title

        def plan(wheres: Sequence[str]) -> list[int]:
            dims = []
            for t, where in zip(tensors, wheres, strict=True):
                check_dtype(title, None, t.dtype, where)
                dims.append(gather_dim(title, t.shape, self.axis, where))
            return dims

        self.dims = with_paths(self.value, len(tensors), plan)
        call = call_spec(title, self.site, spec, tensors, [(d,) for d in self.dims],
                         self.value)
        result = self.parts.runtime.exchange(
            self.index, Arrival(call, list(tensors), self._combine), self.options.timeout_seconds,
            self.generation)
        self.offsets = result.offsets
        return result.outputs

    def _combine(self, payloads: Sequence[list[torch.Tensor]]) -> list[_Result]:
        topology = self.parts.topology
        n = len(payloads)
        if topology.num_replicas_in_sync == 1:  # a copy on the value's own device
            return [_Result([t.clone() for t in payloads[0]],
                            [(0, t.shape[d]) for t, d in zip(payloads[0], self.dims,
                                                             strict=True)])]
        communicator = self.parts.communicators.for_options(self.options)
        outputs: list[list[torch.Tensor]] = [[] for _ in range(n)]
        offsets: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        first_id = topology.first_replica_id
        for k, dim in enumerate(self.dims):
            copies, sizes = communicator.gather([p[k] for p in payloads], dim, topology.devices)
            starts = [sum(sizes[:i]) for i in range(len(sizes))]
            for r in range(n):
                offsets[r].append((starts[first_id + r], sizes[first_id + r]))
                outputs[r].append(copies[r])
        return [_Result(outputs[r], offsets[r]) for r in range(n)]


class _AllGatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, job: AllGather, spec: pytree.PyTreeSpec, *tensors: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        outputs = job.forward(tensors, spec)
        job.generation = job.parts.runtime.generation()
        ctx.job = job
        ctx.outputs = [(t.shape, t.dtype, t.device) for t in outputs]
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        job: AllGather = ctx.job
        # Only floating and complex outputs have gradients (an integer or bool one, a
        # mask gathered beside them, has none: the same on every replica, dtypes agree).
        keep = [k for k, (_, dtype, _) in enumerate(ctx.outputs)
                if dtype.is_floating_point or dtype.is_complex]
        total = gradient_all_reduce(job.parts, job.index, job.options, job.site,
                                    "gradient of all_gather", zeros_for_none(
                                        [grads[k] for k in keep], [ctx.outputs[k] for k in keep]),
                                    generation=job.generation)
        result: list[torch.Tensor | None] = [None] * len(grads)
        for k, g in zip(keep, total, strict=True):
            start, size = job.offsets[k]
            result[k] = g.narrow(job.dims[k], start, size)
        return (None, None, *result)


def all_gather(parts: Parts, index: int, value: Any, axis: int,
               options: CommunicationOptions | None, site: str) -> Any:
    """`ReplicaContext.all_gather` of local replica ``index``; see its docstring."""
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"all_gather: axis must be an int; got {type(axis).__name__} {axis!r}")
    merged = parts.options.merge(options)
    title = f"all_gather(axis={axis})"
    refuse_in_merge_fn(parts, title, site)
    tensors, spec = tensors_of(value, title)
    job = AllGather(parts, index, axis, merged, site, value)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        outputs = list(_AllGatherFunction.apply(job, spec, *tensors))  # type: ignore[no-untyped-call]
    else:
        outputs = job.forward(tensors, spec)
    return pytree.unflatten(spec, outputs)
