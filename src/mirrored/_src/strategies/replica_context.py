"""`ReplicaContext`: what code running inside ``strategy.run`` knows about its replica."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import context
from ..collectives import all_gather, all_reduce, merge_call
from ..collectives.call import call_site
from ..collectives.one_tensor import OneTensor
from ..collectives.parts import Parts
from ..errors import CollectiveMismatchError
from ..lazy_torch import skip_in_dynamo
from ..options import CommunicationOptions
from ..reduce_op import ReduceOp

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

    __slots__ = ("_device", "_index", "_one_tensor", "_parts", "_replica_id")

    def __init__(self, parts: Parts, index: int) -> None:
        self._parts = parts
        self._index = index
        self._replica_id = parts.topology.replica_ids[index]
        self._device = parts.topology.device_names[index]
        self._one_tensor = OneTensor.make(parts, index)

    @property
    def replica_id_in_sync_group(self) -> int:
        """This replica's id, ``0 .. num_replicas_in_sync - 1`` (a Python ``int``)."""
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run each step."""
        return self._parts.topology.num_replicas_in_sync

    @property
    def strategy(self) -> Any:
        """The strategy this replica belongs to."""
        return self._parts.strategy

    @property
    def devices(self) -> tuple[str, ...]:
        """The canonical name of the device this replica runs on, as a 1-tuple."""
        return (self._device,)

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")

    def _check_current(self, method: str) -> None:
        if self._parts.topology.follows_caller:
            context.refuse_default_context_in_foreign_thread(f"ReplicaContext.{method}")
            return
        current = context.current_replica_context()
        if self._parts.topology.num_replicas_in_sync > 1 and current is not self:
            if current is not None:
                where = "another replica"
            elif context.in_merge_fn_of_run():
                where = "cross-replica context (a merge_fn)"
            else:
                where = ("outside strategy.run (a replica context kept after its run "
                         "returned, or used from a thread that is not a replica)")
            raise RuntimeError(
                f"ReplicaContext.{method} of replica {self._replica_id} must be called by that "
                f"replica, inside strategy.run; it was called from {where}")

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any,
                   options: CommunicationOptions | None = None, axis: Any = None) -> Any:
        """Combines ``value`` (a nest of tensors) across replicas; every replica gets its
        own copy of the result.

        ``axis=None`` combines element-wise (MEAN divides by the number of replicas).
        With ``axis``, each replica first reduces over it and MEAN is the global sum
        over the global number of elements, exact for uneven per-replica batches.
        Many leaves are packed per dtype into few transfers. Differentiable: the
        gradient is the all-reduce of the upstream gradients (for MIN/MAX, routed to
        the elements that attain the extreme).

        Args:
            reduce_op: a `ReduceOp` or its name, any case.
            value: a tensor, number, or nest of them.
            options: `CommunicationOptions` overriding the strategy's for this call.
            axis: ``None``, an int or a tuple of ints.

        Raises:
            CollectiveMismatchError: replicas made different calls, or one returned
                from its function while others wait.
            CollectiveTimeoutError: a replica did not arrive within the timeout.
            ValueError, TypeError: bad op, axis, or values.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> def step():
            ...     ctx = mirrored.get_replica_context()
            ...     batches = [torch.tensor([0.0, 1, 2, 3]), torch.tensor([4.0, 5])]
            ...     return ctx.all_reduce("MEAN", batches[ctx.replica_id_in_sync_group], axis=0)
            >>> strategy.experimental_local_results(strategy.run(step))
            (tensor(2.5000), tensor(2.5000))
        """
        one = self._one_tensor  # (not None: several replicas, so current must be self)
        site = call_site(1)
        if (one is not None and axis is None and options is None and type(value) is torch.Tensor
                and context.current_replica_context() is self):
            out = one.all_reduce(reduce_op, value, site)
            if out is not None:
                return out
        self._check_current("all_reduce")
        return all_reduce.all_reduce(self._parts, self._index, reduce_op, value,
                                     options, axis, site)

    def _sum_examples(self, count: int, note: str = "") -> int:
        """The step's example count over every replica (for ``compute_average_loss``;
        ``note``: why a replica whose batch carried its count counts anyway)."""
        self._check_current("compute_average_loss")
        try:
            return all_reduce.sum_examples(self._parts, self._index, count, call_site(1),
                                           note)
        except CollectiveMismatchError as error:
            if not note:
                raise
            raise CollectiveMismatchError(
                f"{error}. compute_average_loss counted the step's examples with a collective "
                f"on this replica because {note}; replicas whose per-example loss has their "
                "batch's rows take the count from the batches, without one. When the rows "
                "can differ from the batch's on some replicas only (a mask, say), pass "
                "global_batch_size, e.g. the all-reduced rows: ctx.all_reduce('SUM', "
                "torch.tensor(len(per_example_loss)))") from error

    def all_gather(self, value: Any, axis: int,
                   options: CommunicationOptions | None = None) -> Any:
        """Concatenates every replica's ``value`` along ``axis`` in replica order; every
        replica gets its own copy. Replicas may differ in size along ``axis`` only.
        Differentiable: each replica's gradient is its own rows of the summed
        upstream gradients.

        Raises:
            CollectiveMismatchError: replicas made different calls (other dims, dtypes).
            CollectiveTimeoutError: a replica did not arrive within the timeout.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> def step():
            ...     ctx = mirrored.get_replica_context()
            ...     return ctx.all_gather(torch.ones(ctx.replica_id_in_sync_group + 1), axis=0)
            >>> strategy.experimental_local_results(strategy.run(step))[0]
            tensor([1., 1., 1.])
        """
        self._check_current("all_gather")
        return all_gather.all_gather(self._parts, self._index, value, axis,
                                     options, call_site(1))

    def merge_call(self, merge_fn: Callable[..., Any], args: Sequence[Any] = (),
                   kwargs: dict[str, Any] | None = None) -> Any:
        """Pauses every replica and runs ``merge_fn(strategy, *args, **kwargs)`` once, in
        cross-replica context, with each argument regrouped across replicas into
        `PerReplica` values (identical objects stay as they are). Replica ``i``
        receives component ``i`` of each distributed value in the result.

        The ``merge_fn`` of replica 0 runs, on the thread of the last replica to
        arrive. An exception in it is raised from ``run``.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> def step():
            ...     ctx = mirrored.get_replica_context()
            ...     x = torch.tensor(float(ctx.replica_id_in_sync_group + 1))
            ...     return ctx.merge_call(lambda s, v: s.reduce("SUM", v), args=(x,))
            >>> strategy.run(step)
            tensor(3.)
        """
        self._check_current("merge_call")
        return merge_call.merge_call(self._parts, self._index, merge_fn, args, kwargs,
                                     call_site(1))


# Eager under torch.compile, each a graph break where it is called: a collective meets
# the other replicas (Dynamo cannot trace the wait, and read the call site with
# sys._getframe, warning about it, before it broke the graph inside).
for _method in (ReplicaContext.all_reduce, ReplicaContext.all_gather,
                ReplicaContext.merge_call):
    skip_in_dynamo(_method, inside=True, reason=(
        f"mirrored's ReplicaContext.{_method.__name__} meets the other replicas eagerly: a "
        "graph break there under torch.compile; drop fullgraph=True"))
