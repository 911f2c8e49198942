"""`Strategy`: the one strategy class, assembled from parts (topology, runtime,
communicators, options) by the public constructors (`MirroredStrategy`,
`OneDeviceStrategy`, the default strategy). Subclasses only assemble: they may
define ``__init__`` and ``__repr__``, never override behaviour.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from .. import context
from ..collectives import cross_replica
from ..collectives.parts import Cluster, Parts
from ..comm.selection import CommunicatorSelector
from ..data import DistributedDataset, DistributedDatasetsFromFunction, InputContext, InputOptions
from ..data.split import refuse_sharded_source
from ..options import CommunicationOptions
from ..reduce_op import ReduceOp
from ..runtime.runtime import Runtime
from ..topology import Topology
from ..training import plain_optimizer
from ..training.module import MirroredModule, mirror
from ..training.optimizer import MirroredOptimizer, mirror_optimizer
from ..values import ValueContext
from . import distribute
from .extended import StrategyExtended
from .replica_context import ReplicaContext
from .solo import NOT_TAKEN, solo_run

__all__ = ["Strategy"]

_ASSEMBLY_ONLY = frozenset({"__init__", "__repr__", "__doc__", "__module__", "__qualname__",
                            "__firstlineno__", "__static_attributes__", "__annotations__",
                            "__orig_bases__", "__parameters__", "__final__"})


class Strategy:
    """Synchronous data parallelism over a `Topology` of replicas. Construct
    `MirroredStrategy`, `OneDeviceStrategy`, `MultiWorkerMirroredStrategy` or use
    `get_strategy()`; they assemble the parts: ``topology`` (where the replicas are),
    ``runtime`` (runs and meets them), ``communicators`` (move data), ``options``
    (collective defaults), ``raw_single_values`` (TF's one-device rule for
    `experimental_distribute_values_from_function`), ``cluster`` (multi-worker).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        overridden = sorted(set(vars(cls)) - _ASSEMBLY_ONLY)
        if overridden:
            raise TypeError(f"{cls.__name__} may only assemble a Strategy (define __init__ "
                            f"and __repr__); it overrides {', '.join(overridden)}")

    def __init__(self, *, topology: Topology, runtime: Runtime,
                 communicators: CommunicatorSelector, options: CommunicationOptions,
                 raw_single_values: bool = False, cluster: Cluster | None = None) -> None:
        self._parts = Parts(strategy_ref=weakref.ref(self), name=type(self).__name__,
                            topology=topology, runtime=runtime, communicators=communicators,
                            options=options, cluster=cluster)
        self._contexts = tuple(ReplicaContext(self._parts, i)
                               for i in range(topology.num_local_replicas))
        self._extended = StrategyExtended(self._parts)
        self._raw_single_values = raw_single_values
        self._solo = solo_run(self, self._parts, self._contexts[0])  # one replica: fast run
        if topology.num_local_replicas > 1:  # (a plain optimizer shared by the replicas)
            plain_optimizer.install()
        weakref.finalize(self, runtime.close)

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run each step, across every worker."""
        return self._parts.topology.num_replicas_in_sync

    @property
    def extended(self) -> StrategyExtended:
        """Lower-level members (`StrategyExtended`)."""
        return self._extended

    @property
    def cluster_resolver(self) -> Any:
        """The multi-worker strategy's `ClusterResolver`; ``None`` for single-process ones."""
        cluster = self._parts.cluster
        return None if cluster is None else cluster.resolver

    @property
    def default_replica_context(self) -> ReplicaContext | None:
        """The replica context code outside ``run`` is in: the default strategy's only."""
        return self._contexts[0] if self._parts.topology.follows_caller else None

    def scope(self) -> contextlib.AbstractContextManager[Strategy]:
        """Makes this strategy current for the enclosed code (cross-replica context);
        `RuntimeError` inside the scope of a different non-default strategy."""
        return context.enter_scope(self)

    def close(self) -> None:
        """Stops the replica threads, empties the result pool, leaves the job (multi-worker);
        also on garbage collection. `RuntimeError` inside ``run``."""
        if context.in_run():
            raise RuntimeError(f"{self._parts.name}.close cannot be called inside run (a "
                               "replica or a merge_fn); call it after run returns")
        self._parts.runtime.close()
        plain_optimizer.forget(self)
        if self._parts.cluster is not None:
            self._parts.cluster.leave()

    def __repr__(self) -> str:
        names = ", ".join(repr(d.short_name) for d in self._parts.topology.devices)
        return f"{self._parts.name}(devices=[{names}])"

    def _require_cross_replica(self, method: str) -> None:
        distribute.require_cross_replica(self._parts, method)

    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (),
            kwargs: dict[str, Any] | None = None, options: Any = None) -> Any:
        """Runs ``fn(*args, **kwargs)`` once per replica, concurrently, in replica context.

        Each `PerReplica`/`Mirrored` leaf of ``args``/``kwargs`` is replaced by the
        replica's own component. Leaves that differ across replicas come back as
        `PerReplica`, and so do ints and floats, even one object on every replica
        (equal counts are; one replica: the plain result). ``options`` is unused (TF's).
        A replica's exception is raised with a note naming the replica; `ValueError`
        for bad ``args`` or mismatched results, `RuntimeError` inside another run or
        another strategy's scope. Inside a ``merge_fn`` the replicas run one after
        another on the merging thread (as TF allows; no collectives there).

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> x = strategy.experimental_distribute_values_from_function(
            ...     lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group)))
            >>> strategy.run(lambda v: v * 10, args=(x,))
            PerReplica:{0: tensor(0.), 1: tensor(10.)}
        """
        if self._solo is not None and (out := self._solo.run(fn, args, kwargs)) is not NOT_TAKEN:
            return out
        return distribute.run(self, self._parts, self._contexts, fn, args, kwargs)

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: Any = None) -> Any:
        """Reduces ``value`` across replicas (and over ``axis``) onto the current device.

        ``axis=None`` combines replicas element-wise. With an ``axis`` each component is
        first reduced over it; MEAN is the global sum over the global element count,
        exact for uneven batches. Nests leaf by leaf; results are detached. See
        docs/semantics.md for dtypes, plain values and errors.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> v = mirrored.PerReplica([torch.tensor([0., 1, 2, 3]), torch.tensor([4., 5])])
            >>> strategy.reduce("MEAN", v, axis=0)
            tensor(2.5000)
        """
        if self._solo is not None and (
                out := self._solo.reduce(reduce_op, value, axis)) is not NOT_TAKEN:
            return out
        self._require_cross_replica("reduce")
        return cross_replica.reduce(self._parts, reduce_op, value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates the components along ``axis`` in replica order onto the current
        device; sizes may differ along ``axis`` only. Nests leaf by leaf; a value that
        is not distributed is returned as is.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> v = mirrored.PerReplica([torch.tensor([1, 2]), torch.tensor([3])])
            >>> strategy.gather(v, axis=0)
            tensor([1, 2, 3])
        """
        self._require_cross_replica("gather")
        return cross_replica.gather(self._parts, value, axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """This worker's components of ``value``, one per local replica: for a nest, one
        nest per replica; a value with no distributed leaf, once per replica (as TF).

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> v = mirrored.PerReplica([torch.tensor(0), torch.tensor(1)])
            >>> strategy.experimental_local_results({"x": v, "y": 2})
            ({'x': tensor(0), 'y': 2}, {'x': tensor(1), 'y': 2})
        """
        return distribute.local_results(self._parts, value)

    def experimental_distribute_values_from_function(
            self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Calls ``value_fn(ValueContext)`` once per local replica in replica order and
        returns a `PerReplica` (a nest of them for a nest; also for ``None`` results and
        one replica). Tensors move to each replica's device.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> strategy.experimental_distribute_values_from_function(
            ...     lambda ctx: torch.tensor(ctx.replica_id_in_sync_group * 2))
            PerReplica:{0: tensor(0), 1: tensor(2)}
        """
        return distribute.distribute_values(self._parts, value_fn,
                                            raw_single_values=self._raw_single_values)

    # ------------------------------------------------------------ input
    def experimental_distribute_dataset(self, dataset: Iterable[Any],
                                        options: InputOptions | None = None
                                        ) -> DistributedDataset:
        """Splits each global batch of ``dataset`` (a DataLoader, generator, list, ...)
        by the split rule (contiguous chunks of ``ceil(b / N)`` rows, replica 0
        first) and yields `PerReplica` batches on the replica devices.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> [b for b in strategy.experimental_distribute_dataset([torch.arange(3)])]
            [PerReplica:{0: tensor([0, 1]), 1: tensor([2])}]
        """
        self._require_cross_replica("experimental_distribute_dataset")
        refuse_sharded_source(dataset)  # (DDP's DistributedSampler: a shard per process)
        dataset, options = distribute.steps_input(self._parts, dataset, options, "dataset")
        parts = self._parts  # (a fixed, checked multi-worker job: steps carry their counts)
        return DistributedDataset(dataset, parts.topology, options,
                                  any_worker=distribute.vote(parts), count_examples=(
                                      parts.cluster is not None and parts.cluster.count_examples))

    def distribute_datasets_from_function(
            self, dataset_fn: Callable[[InputContext], Iterable[Any]],
            options: InputOptions | None = None) -> DistributedDatasetsFromFunction:
        """Calls ``dataset_fn(InputContext)`` once per worker; its elements are per-replica
        batches, taken whole by replica 0, 1, ... at each step.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> ds = strategy.distribute_datasets_from_function(
            ...     lambda ctx: [torch.ones(2), torch.zeros(1)])
            >>> next(iter(ds))
            PerReplica:{0: tensor([1., 1.]), 1: tensor([0.])}
        """
        self._require_cross_replica("distribute_datasets_from_function")
        dataset_fn, options = distribute.steps_input(self._parts, dataset_fn, options, "function")
        return DistributedDatasetsFromFunction(dataset_fn, self._parts.topology, options,
                                               any_worker=distribute.vote(self._parts))

    # --------------------------------------------------------- training
    def mirror(self, module: torch.nn.Module, *,
               sync_batch_norm: bool = False) -> MirroredModule:
        """One copy of ``module`` per local replica device (`MirroredModule`); in
        replica context a call runs the replica's copy. ``sync_batch_norm=True``
        normalizes every BatchNorm layer with global-batch statistics (other
        buffers follow ``mirror_optimizer(buffers=)``).

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> model = strategy.mirror(torch.nn.Linear(2, 1))
            >>> len(model.replicas)
            2
        """
        distribute.sync_from_chief(self._parts, module)
        mirrored = mirror(self, module, sync_batch_norm=sync_batch_norm)
        return distribute.track(self._parts, mirrored)

    def mirror_optimizer(self, module: MirroredModule,
                         make_optimizer: Callable[[Any], torch.optim.Optimizer],
                         **options: Any) -> MirroredOptimizer:
        """One optimizer per replica copy of ``module``, built by ``make_optimizer(params)``;
        ``step()`` inside ``run`` all-reduces the gradients first (`MirroredOptimizer`);
        ``options`` (``check=``, ``buffers=``) as in `mirror_optimizer`.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> model = strategy.mirror(torch.nn.Linear(2, 1))
            >>> opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
            >>> len(opt.optimizers)
            2
        """
        optimizer = mirror_optimizer(self, module, make_optimizer, **options)
        return distribute.track(self._parts, optimizer)
