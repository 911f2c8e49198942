"""`MultiWorkerMirroredStrategy`: `Strategy` over several processes, assembled from a
global `Topology` (this worker's devices, its index in the job), the thread runtime,
and a `CommunicatorSelector` whose communicators are two-level: local replicas are
combined in-process, then one ``torch.distributed`` collective per pack crosses the
workers (`DistributedCommunicator`). It starts (or joins) the job's process group
from a cluster resolver and refuses workers with different local replica counts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import final

import torch

from ..cluster.process_group import Job, JobSpec
from ..cluster.resolver import ClusterResolver, default_cluster_resolver
from ..collectives.parts import Cluster
from ..comm.call_identity import CallLedger
from ..comm.communicator import Communicator
from ..comm.cross_device_ops import CrossDeviceOps, NcclAllReduce
from ..comm.distributed import DistributedCommunicator
from ..comm.selection import CommunicatorSelector
from ..data.vote import WorkerVote
from ..devices import Device, parse_devices
from ..options import CommunicationImplementation, CommunicationOptions
from ..runtime.runtime import ThreadRuntime
from ..topology import Topology
from .mirrored import _options
from .strategy import Strategy

__all__ = ["MultiWorkerMirroredStrategy"]

_NCCL = CommunicationImplementation.NCCL
_AUTO = CommunicationImplementation.AUTO


def _default_devices(resolver: ClusterResolver) -> list[str]:
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return [f"GPU:{resolver.spec.local_rank % torch.cuda.device_count()}"]
    return ["CPU:0"]


def _backend(devices: Sequence[Device], options: CommunicationOptions) -> str:
    """RING is Gloo; NCCL needs every replica on a GPU; AUTO is NCCL when they are."""
    all_gpus = all(d.kind == "GPU" for d in devices)
    implementation = options.implementation
    if implementation is _NCCL and not all_gpus:
        raise ValueError(
            "implementation NCCL needs every replica on a CUDA device; this worker's "
            f"replicas are on {', '.join(d.short_name for d in devices)}. Use AUTO or RING")
    return "nccl" if implementation is _NCCL or (implementation is _AUTO and all_gpus) else "gloo"


@final
class MultiWorkerMirroredStrategy(Strategy):
    """Synchronous data parallelism across the workers of a job, each with one or more
    local replicas (TF: ``tf.distribute.MultiWorkerMirroredStrategy``).

    Global replica ids are ``worker_index * local_replicas + local_index``;
    ``num_replicas_in_sync`` counts every worker's replicas. Every operation of a
    single-process strategy works across workers with the same semantics; results
    of ``reduce`` are on every worker. A value that is not per-replica is *this
    worker's value*: ``reduce("SUM", torch.tensor(1.))`` is ``2.`` on 2 workers
    (MEAN, MIN and MAX combine one value per worker too).

    Failures never hang: a collective that a peer never joins raises
    `CollectiveTimeoutError` after ``communication_options.timeout_seconds``; a dead
    peer makes the survivors raise `WorkerFailureError` naming it within
    ``failure_timeout_seconds`` plus three heartbeat intervals (a tenth of it each, at
    most 1 s); a worker that skips a collective or calls another one makes every
    worker raise `CollectiveMismatchError`, naming each worker's call and its site,
    before any data of that call is used (docs/multi_worker.md).

    Args:
        cluster_resolver: where this process sits in the job (default:
            `default_cluster_resolver`: torchrun's variables, else ``TF_CONFIG``, else
            one local worker).
        communication_options: default `CommunicationOptions`; ``implementation``
            picks the backend (``RING``: Gloo, ``NCCL``, ``AUTO``: NCCL when every
            replica is a GPU) and ``timeout_seconds`` bounds each cross-worker wait.
        devices: this worker's replica devices (default: the GPU of ``LOCAL_RANK``,
            else one CPU replica). Every worker must have as many.
        failure_timeout_seconds: a peer silent for this long is dead (default 10 s).
        check_collectives: compare every worker's call (which run, which collective in
            it, the call and its site, the signature) in a header that travels with the
            data, and use no data unless they agree (see docs/multi_worker.md for its
            cost). ``False`` saves it, but then workers that make different calls are
            not told apart: Gloo aborts the process on a size mismatch, and equal-sized
            different calls mix data.

    Raises:
        ValueError: workers with different local replica counts or ``check_collectives``
            (every worker raises, naming each worker's), NCCL on CPU replicas, bad
            devices.
        StartupError: the job did not start within ``timeout_seconds`` (120 s by
            default) plus a second, on every worker: nothing (or something else)
            listens at the rendezvous, workers disagree on the job's size, duplicate
            ranks, a worker that never joins.
        RuntimeError: another strategy's job (or a process group started outside
            mirrored) is still running in this process: ``close()`` it first.

    Example:
        >>> import torch, mirrored
        >>> one_worker = mirrored.cluster_resolver.SimpleClusterResolver(
        ...     master_port=mirrored.testing.find_free_port())
        >>> strategy = mirrored.MultiWorkerMirroredStrategy(one_worker, devices=["CPU:0", "CPU:1"])
        >>> strategy.num_replicas_in_sync, strategy.extended.worker_devices[1]
        (2, '/job:worker/replica:0/task:0/device:CPU:1')
        >>> strategy.reduce("SUM", torch.tensor(1.0))
        tensor(1.)
        >>> strategy.close()  # also leaves the job: the process group ends
    """

    def __init__(self, cluster_resolver: ClusterResolver | None = None,
                 communication_options: CommunicationOptions | None = None,
                 devices: Sequence[str | torch.device] | None = None, *,
                 failure_timeout_seconds: float = 10.0, check_collectives: bool = True) -> None:
        resolver = default_cluster_resolver() if cluster_resolver is None else cluster_resolver
        if not isinstance(resolver, ClusterResolver):
            raise TypeError("cluster_resolver must be a mirrored.cluster_resolver."
                            f"ClusterResolver; got {type(resolver).__name__}")
        options = _options(communication_options)
        spec = resolver.spec
        parsed = parse_devices(_default_devices(resolver) if devices is None else devices,
                               job="worker", task=spec.worker_index)
        backend = _backend(parsed, options)
        job = Job.start(JobSpec(
            backend=backend, rank=spec.worker_index, world_size=spec.num_workers,
            master_addr=spec.master_addr, master_port=spec.master_port,
            timeout_seconds=options.timeout_seconds or 120.0,
            failure_timeout_seconds=failure_timeout_seconds, attempt=spec.attempt,
            agent_store=spec.agent_store), {
                "local replicas": len(parsed),
                "device kinds": (1 if any(d.kind == "CPU" for d in parsed) else 0)
                | (2 if any(d.kind == "GPU" for d in parsed) else 0),
                "check collectives": int(bool(check_collectives))})
        _same(job, "local replicas", "number of local replicas", int,
              "Pass devices= with as many devices on every worker")
        # (a checked call carries a trailer or a header that an unchecked peer's call
        # lacks: their first collective would meet in other sizes or other calls)
        _same(job, "check collectives", "check_collectives", bool,
              "Pass the same value on every worker")
        kinds = 0
        for mask in job.facts["device kinds"]:
            kinds |= mask
        topology = Topology(devices=tuple(parsed), worker_index=spec.worker_index,
                            num_workers=spec.num_workers, worker_values=True,
                            mixed_kinds=kinds == 3)
        explicit: CrossDeviceOps | None = None
        if backend == "nccl" and len(parsed) == 1:
            explicit = NcclAllReduce()  # the selector's NCCL rule wants several GPUs
        ledger = CallLedger()

        def wrap(ops: CrossDeviceOps) -> DistributedCommunicator:
            return DistributedCommunicator(ops, topology, timeout_seconds=options.timeout_seconds,
                                           job=job, check_calls=check_collectives,
                                           ledger=ledger)

        def retime(comm: Communicator, timeout: float | None) -> Communicator:
            assert isinstance(comm, DistributedCommunicator)  # built by wrap above
            return comm.with_timeout(timeout)

        selector = CommunicatorSelector(topology.devices, explicit, options, wrap=wrap,
                                        retime=retime)
        comm = selector.default
        assert isinstance(comm, DistributedCommunicator)  # built by wrap above
        # (datasets whose every worker's source has a len() agree on their steps once)
        vote = WorkerVote(comm.any, functools.partial(comm.agree, "the dataset's steps"),
                          functools.partial(comm.agree, "the dataset's steps read ahead"),
                          ledger.pass_ends, ledger.pass_starts)
        # (with unchecked calls a replica counting alone would meet another call unseen)
        cluster = Cluster(resolver=resolver, vote=vote, sync=comm.broadcast_from_chief,
                          leave=job.close, next_phase=ledger.next_phase,
                          count_examples=check_collectives, took_examples=ledger.took_examples,
                          agree=comm.agree)
        runtime = ThreadRuntime(topology, type(self).__name__,
                                timeout_seconds=options.timeout_seconds)
        super().__init__(topology=topology, runtime=runtime, communicators=selector,
                         options=options, cluster=cluster)

    def __repr__(self) -> str:
        return (f"MultiWorkerMirroredStrategy(worker {self._parts.topology.worker_index} of "
                f"{self._parts.topology.num_workers}, devices=["
                + ", ".join(repr(d.short_name) for d in self._parts.topology.devices) + "])")


def _same(job: Job, fact: str, what: str, shown: Callable[[int], object], fix: str) -> None:
    """Raises `ValueError` (after leaving the job) unless every worker reported the same
    start-up ``fact``; the message lists each worker's value as ``shown`` gives it."""
    values = job.facts[fact]
    if len(set(values)) > 1:
        job.close()
        listing = ", ".join(f"worker {i}: {shown(v)}" for i, v in enumerate(values))
        raise ValueError(f"every worker of a MultiWorkerMirroredStrategy needs the same "
                         f"{what}; got {listing}. {fix}")
