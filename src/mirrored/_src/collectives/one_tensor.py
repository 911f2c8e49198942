"""`OneTensor`: ``ReplicaContext.all_reduce`` of one plain tensor with no ``axis`` and
the strategy's options, on a single-process strategy of several replicas: the most
common collective, without the pytree, planning and packing machinery.

It brings exactly what the general path (`all_reduce`) would: the same call key (so
the contract check compares it with any replica's call, on either path), the same
payload, and a combine that gives the same results (small host tensors through
`combine_each`, the same kernels in the same order; anything else through the
general combine). What it skips is per-call work whose outcome is known: flattening
a leaf, planning a dtype already planned, packing one tensor. Gradients, first calls
of a dtype and rank, tensor subclasses and unusual layouts take the general path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import context, pytree
from ..comm.cross_device_ops import sums_directly
from ..comm.host import DIRECT_BYTES, combine_each
from ..reduce_op import ReduceOp
from ..reduction import cached_plan, finish, op_title
from ..runtime.contract import Arrival, CallSpec
from .all_reduce import AllReduce, Payload, Result
from .call import refuse_in_merge_fn
from .parts import Parts

__all__ = ["OneTensor"]

_LEAF = pytree.flatten(torch.zeros(()))[1]  # the structure of a single leaf
_STRIDED = torch.strided
_MEAN = ReduceOp.MEAN
_in_merge_fn = context.in_merge_fn_of_run
_Entry = tuple[ReduceOp, str, Callable[[Sequence[Payload]], list[Result]]]


class OneTensor:
    """The fast path of local replica ``index`` (built by `make`, once per replica
    context)."""

    __slots__ = ("_entries", "_index", "_n", "_parts", "_timeout")

    def __init__(self, parts: Parts, index: int) -> None:
        self._parts = parts
        self._index = index
        self._n = parts.topology.num_replicas_in_sync
        self._timeout = parts.options.timeout_seconds
        devices = parts.topology.torch_devices
        direct = (all(d.type == "cpu" for d in devices)
                  and sums_directly(parts.communicators.for_options(parts.options)))
        entries: dict[str, _Entry] = {}
        for op in ReduceOp:
            title = op_title("all_reduce", op, None)
            job = AllReduce(parts, index, op, None, parts.options, title, "", None)
            entry = (op, title, _combine(job, op, direct))
            entries[op.value] = entries[op.value.lower()] = entry
        self._entries = entries

    @staticmethod
    def make(parts: Parts, index: int) -> OneTensor | None:
        """The fast path for local replica ``index``, if ``parts`` allow one."""
        topology = parts.topology
        if (topology.num_replicas_in_sync < 2 or topology.num_workers != 1
                or topology.elastic or topology.follows_caller):
            return None
        return OneTensor(parts, index)

    def all_reduce(self, reduce_op: Any, value: torch.Tensor, site: str) -> torch.Tensor | None:
        """The result, or ``None``: the general path takes the call."""
        kind = type(reduce_op)
        entry = self._entries.get(
            reduce_op if kind is str else reduce_op._value_ if kind is ReduceOp else "")
        if (entry is None or value.layout is not _STRIDED or not value.is_contiguous()
                or (value.requires_grad and torch.is_grad_enabled())):
            return None
        op, title, combine = entry
        plan = cached_plan(op, value, None)
        if plan is None:
            return None  # the first call of this dtype and rank: checked by the general path
        if _in_merge_fn():
            refuse_in_merge_fn(self._parts, title, site)
        dtype = value.dtype
        shape = tuple(value.shape)
        partial = value if dtype == plan.accumulate else value.to(plan.accumulate)
        call = CallSpec(title, site, (title, _LEAF, (shape,), (dtype,)), _LEAF,
                        ((dtype, shape),), value)
        result: Result = self._parts.runtime.exchange(
            self._index, Arrival(call, Payload([partial], [1]), combine), self._timeout)
        total = result.totals[0]
        return total if op is not _MEAN else finish(plan, total, self._n, in_place=True)


def _combine(job: AllReduce, op: ReduceOp, direct: bool
             ) -> Callable[[Sequence[Payload]], list[Result]]:
    """The combine of a fast call: `combine_each` when every replica brought one small
    contiguous host tensor (and the strategy's communicator combines that way), else
    the general path's."""
    base_op = ReduceOp.SUM if op is _MEAN else op

    def combine(payloads: Sequence[Payload]) -> list[Result]:
        if direct:
            parts = []
            for payload in payloads:
                partials = payload.partials
                if len(partials) != 1:
                    break
                t = partials[0]
                if not t.is_cpu or not t.is_contiguous() or t.nbytes >= DIRECT_BYTES:
                    break
                parts.append(t)
            else:
                return [Result([total], None) for total in combine_each(base_op, parts)]
        return job._combine(payloads)

    return combine
