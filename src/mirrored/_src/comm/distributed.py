"""`DistributedCommunicator`: the two-level `Communicator` of a multi-worker job.

Local replicas are combined in-process by a local `CrossDeviceOps`, then ONE
``torch.distributed`` collective per pack crosses the workers. Every call is
checked: a fixed-size int64 header ``[identity, prediction, miss, flag, value,
sizes...]`` is all-gathered with the data, and no worker uses the data unless every
worker's identity (see `call_identity`) is the same; otherwise every worker raises
`CollectiveMismatchError` naming each worker's call and its site.

The header and the data travel together (one round trip) when their sizes are
known to match: Gloo aborts the process when workers send different sizes, so each
header also carries a hash of the wire sizes its worker *predicts* for its next call
(what has followed this call: `CallLedger.enter`). When every worker predicted the same sizes and
the call has them, header and data go at once; a worker whose call has other sizes
sends zeros of the predicted sizes with ``miss`` set, and every worker then redoes
the call in two steps (header first, data once the identities agree). Without an
agreed prediction (the first calls, uneven gathers) the two steps are the rule.

Every wait is bounded: a timeout, a dead peer, or a peer that left the job (seen
through the `JobLink`) becomes `CollectiveTimeoutError`, `WorkerFailureError` or
`CollectiveMismatchError` instead of a hang. After such an error the communicator is
unusable (workers are out of step); the job should restart.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..devices import Device
from ..reduce_op import ReduceOp
from ..reduction import describe
from ..topology import Topology
from . import packing, trailer
from .buffers import default_pool
from .call_identity import CallLedger, JobLink
from .cross_call import GATHER, HEAD, VALUE, CrossWorkerCalls, PendingCall
from .cross_device_ops import CrossDeviceOps
from .host import concat
from .slots import CHUNK_MIN_BYTES, CHUNKS, KEPT_BYTES, KEPT_PER_PLAN, ResultSlot, SlotMaker
from .watch import CallWatch

__all__ = ["CHUNKS", "CHUNK_MIN_BYTES", "DistributedCommunicator", "OverlappedSum"]

_HOST = Device("CPU", 0)
_META = operator.attrgetter("shape", "dtype", "device")  # what a call's plan depends on


class DistributedCommunicator:
    """Local replicas first (``local``), then one collective across workers per pack.

    Args:
        local: combines this worker's replicas in-process.
        topology: this worker's replicas and place in the job.
        group: the ``torch.distributed`` process group (default: the default group).
        timeout_seconds: the longest a collective waits for the peers (``None``: no
            limit of its own; the process group's timeout still applies).
        check_calls: check every call against the peers' (a header all-gathered
            with the data; see the module's docstring).
        job: the job whose peer monitor detects dead peers and peers that left.
        ledger: the strategy's call counts, shared by its communicators (default:
            a new one).

    Example:
        >>> import torch, mirrored
        >>> from mirrored._src.cluster.process_group import Job, JobSpec
        >>> from mirrored._src.devices import parse_devices
        >>> job = Job.start(JobSpec(backend="gloo", rank=0, world_size=1, timeout_seconds=10,
        ...                         master_port=mirrored.testing.find_free_port()))
        >>> topology = Topology(devices=parse_devices(["CPU:0", "CPU:1"]))
        >>> comm = DistributedCommunicator(mirrored.ReductionToOneDevice(), topology, job=job)
        >>> out = comm.reduce_packed(ReduceOp.SUM, [[torch.tensor(1.0)], [torch.tensor(2.0)]],
        ...                          [topology.devices], bytes_per_pack=0)
        >>> out[0][1], comm.any(False)
        (tensor(3.), False)
        >>> job.close()
    """

    def __init__(self, local: CrossDeviceOps, topology: Topology, *,
                 group: Any = None, timeout_seconds: float | None = None,
                 check_calls: bool = True, job: JobLink | None = None,
                 ledger: CallLedger | None = None) -> None:
        if not isinstance(local, CrossDeviceOps):
            raise TypeError(f"local must be a CrossDeviceOps; got {type(local).__name__}")
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a Topology; got {type(topology).__name__}")
        if timeout_seconds is not None and not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be None or > 0; got {timeout_seconds!r}")
        if not dist.is_initialized():
            raise RuntimeError("DistributedCommunicator needs a running torch.distributed "
                               "process group; start the job (Job.start) first")
        world = dist.get_world_size(group)
        if world != topology.num_workers or dist.get_rank(group) != topology.worker_index:
            raise ValueError(
                f"the topology (worker {topology.worker_index} of {topology.num_workers}) "
                f"does not match the process group (rank {dist.get_rank(group)} of {world})")
        self._local = local
        self._topology = topology
        self._group = group
        self._timeout = timeout_seconds
        self._check = check_calls
        self._job = job
        self._ledger = ledger if ledger is not None else CallLedger()
        self._calls = CrossWorkerCalls(group, self._ledger, CallWatch(
            job, self._ledger, topology.worker_index, timeout_seconds), job, check_calls,
            topology, self._wire_device(topology, group))
        self._wire = self._wire_device(topology, group)  # where cross-worker data travels
        self._wire_torch = self._wire.torch_device
        # The destinations that are the wire's device itself: results need no copy.
        self._home = topology.devices if (
            len(topology.devices) == 1
            and topology.devices[0].torch_device == self._wire_torch) else None
        self._plans: dict[tuple[Any, ...], _Plan] = {}
        self._kept_bytes = 0  # of the plans' kept slots

    @staticmethod
    def _wire_device(topology: Topology, group: Any) -> Device:
        return topology.devices[0] if dist.get_backend(group) == "nccl" else _HOST

    def with_timeout(self, timeout_seconds: float | None) -> DistributedCommunicator:
        """The same communicator (same job, same call counts) with another timeout, for
        calls whose `CommunicationOptions` carry one."""
        return DistributedCommunicator(self._local, self._topology, group=self._group,
                                       timeout_seconds=timeout_seconds,
                                       check_calls=self._check, job=self._job,
                                       ledger=self._ledger)

    # ------------------------------------------------------------------ calls
    def reduce_packed(self, reduce_op: ReduceOp, per_replica: Sequence[Sequence[torch.Tensor]],
                      destinations: Sequence[tuple[Device, ...]], bytes_per_pack: int,
                      label: str = "") -> list[list[torch.Tensor]]:
        """Combines many values over every replica of every worker (SUM, MIN or MAX):
        see `Communicator.reduce_packed`."""
        first = per_replica[0]
        # A training loop repeats its calls: their packs, description and buffers
        # (`ResultSlot`: results are new views of them) are kept.
        key = (reduce_op, label, bytes_per_pack, len(per_replica), *map(_META, first),
               *map(id, destinations))
        known = self._plans.get(key)
        if known is None:
            known = self._plan(key, reduce_op, per_replica, destinations, bytes_per_pack,
                               label)
        packs, what, wire, slots, make = known
        # (copies of inputs that require grad, in grad mode, give the buffer autograd
        # history: kept, it would chain every later call's graph to it)
        graph = torch.is_grad_enabled() and any(
            t.requires_grad for leaves in per_replica for t in leaves)
        slot = make(kept=False, pooled=False) if graph else self._slot(slots, make)
        data, fills, views = [], [], []
        sources: list[torch.Tensor | None] = []  # (only where an exchange could read them)
        as_is = self._calls.exchanges and not graph  # (history: the copy gives the result)
        for index, (members, parts) in enumerate(zip(packs, slot.parts, strict=True)):
            payload, shaped = slot.results(index, make.leaves[index])
            views.append((payload, shaped))
            leaves = [first[m] for m in members]
            source = leaves[0]
            if len(per_replica) > 1:  # the local sum in replica order, then one copy
                flats = [packing.pack([leaves_r[m] for m in members])
                         for leaves_r in per_replica]
                source = self._local.reduce_to_devices(reduce_op, flats, (self._wire,))[0]
            elif len(leaves) == 1:
                source = leaves[0].reshape(-1)
            for chunk, span, dst in parts:
                data.append(chunk)
                if span is None or dst is None:  # the leaves, into views shaped like them
                    fills.append(functools.partial(torch._foreach_copy_, shaped, leaves))
                    sources.append(None)
                else:
                    a, b = span
                    src = source if a == 0 and b == source.numel() else source[a:b]
                    fills.append(functools.partial(_copy, dst, src))
                    # (a chunk that is all data, no trailer: an exchange sends it as it is)
                    sources.append(src if as_is and dst.numel() == chunk.numel() and (
                        src.dtype, src.device) == (chunk.dtype, chunk.device)
                        and src.is_contiguous() else None)
        if not wire:  # (the same for every call of this plan: kept as a tuple)
            wire.append(tuple((make.kind, str(b.dtype), b.numel()) for b in data))
        self._calls.call(what, wire[0], data, fill=lambda i: fills[i](), sources=sources)
        out: list[list[torch.Tensor]] = [[] for _ in first]
        for members, (payload, shaped) in zip(packs, views, strict=True):
            for flat in self._copies(payload, destinations[members[0]]):
                results = shaped if flat is payload else packing.unpack(
                    flat, [first[m] for m in members])
                for m, part in zip(members, results, strict=True):
                    out[m].append(part)
        return out

    def _plan(self, key: tuple[Any, ...], reduce_op: ReduceOp,
              per_replica: Sequence[Sequence[torch.Tensor]],
              destinations: Sequence[tuple[Device, ...]], bytes_per_pack: int,
              label: str) -> _Plan:
        """A call's packs, description, wire sizes (a list its first call fills), kept
        slots and how to make one; kept under ``key``."""
        first = per_replica[0]
        workers = self._topology.num_workers
        packs = packing.plan([t.numel() * t.element_size() for t in first],
                             [(t.dtype, t.device, id(destinations[k]))
                              for k, t in enumerate(first)], bytes_per_pack)
        what = (f"{label}: " if label else "") + f"{reduce_op.name} of " + ", ".join(
            describe(t) for t in first)
        kind = reduce_op.name.lower()
        sizes = []
        for index, members in enumerate(packs):
            dtype = first[members[0]].dtype
            extra = trailer.length(kind, dtype, workers) if index == 0 and self._check else 0
            # Chunks change the order in which a ring of 3 or more workers adds an
            # element's floats (its position in the transfer): then one collective.
            exact = kind != "sum" or workers <= 2 or not dtype.is_floating_point
            sizes.append((sum(first[m].numel() for m in members), dtype, extra, exact))
        make = SlotMaker(sizes, [[first[m] for m in members] for members in packs],
                         [len(per_replica) > 1 or len(members) == 1 for members in packs],
                         self._wire_torch, kind)
        if len(self._plans) >= 256:
            self._plans.clear()
            self._kept_bytes = 0
        known = self._plans[key] = (packs, what, [], [], make)
        return known

    def _slot(self, slots: list[ResultSlot], make: SlotMaker) -> ResultSlot:
        """A kept slot of the plan that nothing else holds, else a new one: kept from
        the plan's second call on (a plan whose destinations are a new tuple at every
        call never repeats), while the plan keeps fewer than `KEPT_PER_PLAN` and the
        communicator's kept bytes stay under 16 `KEPT_BYTES`. A kept slot that can
        never be free again (autograd history, shared storage) is dropped."""
        inference = torch.is_inference_mode_enabled()
        for slot in slots:
            if slot.inference == inference and slot.free():
                return slot
        for slot in [s for s in slots if s.stuck()]:
            slots.remove(slot)
            self._kept_bytes -= make.nbytes
        make.calls += 1
        keep = (make.keep and make.calls > 1 and len(slots) < KEPT_PER_PLAN
                and self._kept_bytes + make.nbytes <= 16 * KEPT_BYTES)
        slot = make(kept=keep)
        if keep:
            slots.append(slot)
            self._kept_bytes += make.nbytes
        return slot

    def gather(self, per_replica: Sequence[torch.Tensor], dim: int,
               destinations: tuple[Device, ...]) -> tuple[list[torch.Tensor], list[int]]:
        """Concatenates every replica's component along ``dim``, in global replica order
        (sizes along ``dim`` may differ): see `Communicator.gather`."""
        dim = dim % per_replica[0].dim()
        local = concat(per_replica, dim, self._wire.torch_device)
        sizes = [c.shape[dim] for c in per_replica]
        masked = list(local.shape)
        masked[dim] = -1
        dtype = str(local.dtype).removeprefix("torch.")
        table = self._calls.call(f"gather of {dtype}{masked} along {dim}", GATHER, [],
                                 sizes=sizes)
        totals = [sum(row[HEAD:]) for row in table]
        shape = list(local.shape)
        shape[dim] = max(totals)
        padded = local.new_zeros(shape)
        padded.narrow(dim, 0, local.shape[dim]).copy_(local)
        parts = [torch.empty_like(padded) for _ in totals]
        self._calls.follow([dist.all_gather(parts, padded, group=self._group, async_op=True)])
        whole = torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, totals, strict=True)],
                          dim=dim)
        return self._copies(whole, destinations), [s for row in table for s in row[HEAD:]]

    def broadcast(self, tensor: torch.Tensor, destinations: tuple[Device, ...]
                  ) -> list[torch.Tensor]:
        """One new copy of ``tensor`` per destination (local only: no cross-worker traffic)."""
        return self._local.broadcast_to_devices(tensor, destinations)

    def sum_counts(self, per_replica: Sequence[Sequence[int]], what: str = "") -> list[int]:
        """Global element counts (``per_replica[r][k]``: local replica ``r``'s count of
        value ``k``), checked like every call, in one int64 SUM with its trailer: one
        exchange where two workers exchange sums (`CrossWorkerCalls.exchanges`). Else
        one count (``compute_average_loss``'s) rides in the header's ``value``: Gloo's
        ring takes two rounds for it (docs/multi_worker.md, "The step's example count")."""
        local = [sum(counts) for counts in zip(*per_replica, strict=True)]
        what = what or ("element count of 1 value" if len(local) == 1 else
                        f"element counts of {len(local)} values")
        if len(local) == 1 and not self._calls.exchanges:
            table = self._calls.call(what, (), [], value=local[0])
            return [sum(row[VALUE] for row in table)]
        extra = trailer.length("sum", torch.int64, self._topology.num_workers
                               ) if self._check else 0
        totals = torch.zeros(len(local) + extra, dtype=torch.int64,
                             device=self._wire.torch_device)
        totals[:len(local)] = torch.tensor(local, dtype=torch.int64)
        self._calls.call(what, (("sum", "torch.int64", totals.numel()),), [totals])
        return [int(t) for t in totals[:len(local)].tolist()]

    def agree(self, what: str, value: int) -> list[int]:
        """Every worker's ``value`` (one int each), in worker order.

        Example:
            ``comm.agree("steps", 5)`` on 2 workers gives ``[5, 5]``.
        """
        table = self._calls.call(f"agree({what})", (), [], value=int(value))
        return [row[VALUE] for row in table]

    def broadcast_from_chief(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrites ``tensors`` in place with worker 0's values (one broadcast per
        dtype; every worker passes tensors of the same shapes and dtypes)."""
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault(t.dtype, []).append(t)
        flats = []
        for dtype, members in groups.items():
            wire = torch.uint8 if dtype == torch.bool else dtype
            flats.append((members, packing.pack(
                [m.detach().to(self._wire.torch_device, wire) for m in members])))
        self._calls.call(f"broadcast of {len(tensors)} tensors", tuple(
            ("broadcast", str(f.dtype), f.numel()) for _, f in flats), [f for _, f in flats])
        with torch.no_grad():
            for members, flat in flats:
                for m, part in zip(members, packing.unpack(flat, members), strict=True):
                    m.copy_(part)

    def any(self, flag: bool) -> bool:
        """Whether any worker passed ``True`` (rides in the header: one round trip).

        Raises:
            TypeError: ``flag`` is not a bool.
        """
        if not isinstance(flag, bool):
            raise TypeError(f"flag must be a bool; got {type(flag).__name__} {flag!r}")
        table = self._calls.call("any worker has data", (), [], flag=int(flag))
        return any(row[3] for row in table)

    # ------------------------------------------------- overlapped gradients
    def overlaps(self, dtype: torch.dtype) -> bool:
        """Whether a SUM of ``dtype`` can be launched ahead (`launch_sum`): its call
        check rides in the data, or calls are not checked."""
        return not self._check or trailer.length("sum", dtype, self._topology.num_workers) > 0

    def launch_sum(self, what: str, flats: Sequence[torch.Tensor], *, sync: bool
                   ) -> OverlappedSum:
        """Starts the SUM over every replica of every worker of the local replicas'
        ``flats`` (one flat tensor each, one dtype; summed locally in replica order, as
        `reduce_packed` does), without waiting; `finish_sum` waits. Its identity rides
        in the data, so its sizes must be known to match the peers': ``sync=True``
        makes the fully checked call instead (header first; done on return), as the
        first step of a bucket plan does. The optimizer's gradient buckets use it."""
        n = flats[0].numel()
        dtype = flats[0].dtype
        extra = trailer.length("sum", dtype, self._topology.num_workers) if self._check else 0
        buffer = default_pool().empty((n + extra,), dtype, self._wire.torch_device)
        buffer[:n].copy_(flats[0] if len(flats) == 1 else self._local.reduce_to_devices(
            ReduceOp.SUM, flats, (self._wire,))[0])
        wire = (("sum", str(dtype), n + extra),)
        what = f"MirroredOptimizer.step: SUM of {what}"
        if sync:
            self._calls.call(what, wire, [buffer])
            return OverlappedSum(None, buffer[:n])
        return OverlappedSum(self._calls.launch(what + " (asynchronous)", wire,
                                                [buffer]), buffer[:n])

    def finish_sum(self, pending: OverlappedSum) -> list[torch.Tensor]:
        """Waits for a `launch_sum` and checks its identity (no data of a mismatched
        call is used); the sum, one copy per local replica."""
        if pending.call is not None:
            self._calls.finish(pending.call)
        return self._copies(pending.sum, self._topology.devices)

    def _copies(self, tensor: torch.Tensor, devices: Sequence[Device]) -> list[torch.Tensor]:
        """``tensor`` (on the wire's device, as every result here is) itself for the first
        destination when it already lives there."""
        if devices is self._home:  # this worker's one device, the wire's: nothing to copy
            return [tensor]
        if devices and devices[0].torch_device == tensor.device:
            return [tensor, *self._local.broadcast_to_devices(tensor, devices[1:])]
        return self._local.broadcast_to_devices(tensor, devices)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


# A call's packs, description, wire sizes (filled by its first call), kept slots, maker.
_Plan = tuple[list[list[int]], str, list[tuple[tuple[str, str, int], ...]], list[ResultSlot],
              SlotMaker]


class OverlappedSum:
    """A `DistributedCommunicator.launch_sum`: the call in flight (``None``: done) and
    the view of its buffer that holds the sum."""

    __slots__ = ("call", "sum")

    def __init__(self, call: PendingCall | None, total: torch.Tensor) -> None:
        self.call, self.sum = call, total

    @property
    def works(self) -> list[Any]:
        """The collectives in flight (none once done)."""
        return [] if self.call is None else self.call.works
