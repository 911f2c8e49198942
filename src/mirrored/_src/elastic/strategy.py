"""`ElasticMirroredStrategy`: `MultiWorkerMirroredStrategy`'s semantics over a job whose
workers may die and come back, assembled from a fixed nominal `Topology` (``elastic``:
MEANs count the replicas actually combined), the thread runtime, an
`ElasticCommunicator` over torchft, and a `Cluster` whose step control is the
worker's `ElasticSession` (per-step quorum, commit vote, live recovery).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import final

import torch

from ..collectives.parts import Cluster
from ..comm.communicator import Communicator
from ..comm.cross_device_ops import CrossDeviceOps
from ..comm.selection import CommunicatorSelector
from ..devices import parse_devices
from ..options import CommunicationOptions
from ..runtime.runtime import ThreadRuntime
from ..strategies.mirrored import _options
from ..strategies.strategy import Strategy
from ..topology import Topology
from .communicator import ElasticCommunicator
from .session import ElasticSession

__all__ = ["ElasticMirroredStrategy"]


def _index(name: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}; got {value}")
    return value


@final
class ElasticMirroredStrategy(Strategy):
    """Synchronous data parallelism over ``num_workers`` workers that may be lost and
    restarted without stopping the others (torchft: a quorum of the live workers per
    step, a fault-tolerant process group, live recovery from a healthy peer).

    The loop is the mirrored one: ``mirror``/``mirror_optimizer`` under ``scope()``,
    ``experimental_distribute_dataset``, ``run``, ``reduce``. A step begins when the
    dataset's next batch is taken (or ``run`` starts) and ends at the optimizer step,
    which applies the update on every worker of the step or on none (torchft's commit
    vote). While workers are missing (docs/elastic.md):

    - ``num_replicas_in_sync`` and replica ids keep the job's nominal values
      (``num_workers`` x local replicas); each batch is split over all of them and a
      missing worker's rows are not trained in that step (never twice);
    - MEAN (``reduce``, ``all_reduce``, ``compute_average_loss``) divides by what was
      actually combined: the live replicas, or the live examples;
    - a step in which a worker dies is not committed, and the distributed dataset
      serves its batch again to the survivors; a restarted worker (same
      ``worker_index``) rejoins at a step boundary with a healthy peer's state.

    Args:
        lighthouse: the address of the job's `Lighthouse` (``http://host:port``).
        worker_index: this worker's place in the job, ``0 .. num_workers - 1``; a
            restarted worker reuses the lost one's.
        num_workers: the job's nominal size (its dataset split).
        devices: this worker's replica devices (default: one CPU replica).
        min_workers: a step is committed only with at least this many workers (the
            lighthouse's ``min_workers`` decides when a quorum forms).
        communication_options: collective defaults (``timeout_seconds`` bounds the
            local replicas' waits).
        timeout_seconds: bound on each cross-worker all-reduce, vote and state transfer.
        quorum_timeout_seconds: bound on waiting for a quorum.

    Raises:
        ImportError: torchft is not installed.
        TypeError, ValueError: bad indices or counts; one replica in all.

    Example:
        >>> import torch, mirrored
        >>> from mirrored import elastic
        >>> lighthouse = elastic.Lighthouse(min_workers=1)
        >>> strategy = elastic.ElasticMirroredStrategy(lighthouse.address, worker_index=0,
        ...                                            num_workers=1, devices=["CPU:0", "CPU:1"])
        >>> v = mirrored.PerReplica([torch.tensor(1.0), torch.tensor(3.0)])
        >>> strategy.num_replicas_in_sync, strategy.reduce("MEAN", v)
        (2, tensor(2.))
        >>> strategy.close(); lighthouse.close()
    """

    def __init__(self, lighthouse: str, worker_index: int, num_workers: int,
                 devices: Sequence[str | torch.device] | None = None, *, min_workers: int = 1,
                 communication_options: CommunicationOptions | None = None,
                 timeout_seconds: float = 10.0, quorum_timeout_seconds: float = 60.0) -> None:
        num_workers = _index("num_workers", num_workers, 1)
        worker_index = _index("worker_index", worker_index, 0)
        min_workers = _index("min_workers", min_workers, 1)
        if worker_index >= num_workers:
            raise ValueError(f"worker_index must be in 0..{num_workers - 1}; got {worker_index}")
        if min_workers > num_workers:
            raise ValueError(f"min_workers ({min_workers}) cannot exceed num_workers "
                             f"({num_workers})")
        options = _options(communication_options)
        parsed = parse_devices(["CPU:0"] if devices is None else devices, job="worker",
                               task=worker_index)
        if len(parsed) * num_workers < 2:
            raise ValueError("an elastic job needs at least 2 replicas in all (num_workers x "
                             f"local devices); got {num_workers} x {len(parsed)}")
        topology = Topology(devices=tuple(parsed), worker_index=worker_index,
                            num_workers=num_workers, worker_values=True, elastic=True)
        session = ElasticSession(lighthouse_address=lighthouse, worker_index=worker_index,
                                 min_workers=min_workers, timeout_seconds=timeout_seconds,
                                 quorum_timeout_seconds=quorum_timeout_seconds)

        def wrap(ops: CrossDeviceOps) -> Communicator:
            return ElasticCommunicator(ops, topology, session)

        selector = CommunicatorSelector(topology.devices, None, options, wrap=wrap)
        comm = selector.default
        assert isinstance(comm, ElasticCommunicator)  # built by wrap above
        # torchft's first quorum gives every worker the first one's state (init_sync),
        # so mirror() needs no broadcast of its own.
        cluster = Cluster(resolver=None, vote=comm.any, sync=lambda tensors: None,
                          leave=session.close, steps=session)
        runtime = ThreadRuntime(topology, type(self).__name__,
                                timeout_seconds=options.timeout_seconds)
        super().__init__(topology=topology, runtime=runtime, communicators=selector,
                         options=options, cluster=cluster)
        self.elastic = session  # where the job stands: .step, .num_workers

    def __repr__(self) -> str:
        topology = self._parts.topology
        return (f"ElasticMirroredStrategy(worker {topology.worker_index} of "
                f"{topology.num_workers}, devices=["
                + ", ".join(repr(d.short_name) for d in topology.devices) + "])")
