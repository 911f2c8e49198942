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
(what followed this call last time). When every worker predicted the same sizes and
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

import datetime
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..devices import Device
from ..errors import CollectiveMismatchError, CollectiveTimeoutError, WorkerFailureError
from ..reduce_op import ReduceOp
from ..reduction import describe
from ..topology import Topology
from . import packing, trailer
from .buffers import default_pool
from .call_identity import CallLedger, JobLink, Wire, identity_hash, user_call
from .cross_device_ops import CrossDeviceOps
from .host import concat

__all__ = ["DistributedCommunicator"]

_DIST_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
_HOST = Device("CPU", 0)
_HEAD = 5  # identity, prediction, miss, flag, value; then one size per local replica
_GATHER: Wire = (("gather", "", 0),)  # sizes known only from the header


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
        nccl = dist.get_backend(group) == "nccl"
        self._wire = topology.devices[0] if nccl else _HOST  # where cross-worker data travels
        self._world = topology.num_workers

    def with_timeout(self, timeout_seconds: float | None) -> DistributedCommunicator:
        """The same communicator (same job, same call counts) with another timeout, for
        calls whose `CommunicationOptions` carry one."""
        return DistributedCommunicator(self._local, self._topology, group=self._group,
                                       timeout_seconds=timeout_seconds,
                                       check_calls=self._check, job=self._job,
                                       ledger=self._ledger)

    # ------------------------------------------------------------------ calls
    def reduce_packed(self, reduce_op: ReduceOp, per_replica: Sequence[Sequence[torch.Tensor]],
                      destinations: Sequence[tuple[Device, ...]], bytes_per_pack: int
                      ) -> list[list[torch.Tensor]]:
        """Combines many values over every replica of every worker (SUM, MIN or MAX):
        see `Communicator.reduce_packed`."""
        first = per_replica[0]
        keys = [(t.dtype, t.device, id(destinations[k])) for k, t in enumerate(first)]
        nbytes = [t.numel() * t.element_size() for t in first]
        packs = packing.plan(nbytes, keys, bytes_per_pack)
        kind = reduce_op.name.lower()
        buffers, views = [], []
        extra = 0
        for index, members in enumerate(packs):
            flats = [packing.pack([leaves[m] for m in members]) for leaves in per_replica]
            if index == 0 and self._check:
                extra = trailer.length(kind, flats[0].dtype, self._topology.num_workers)
            if extra and index == 0:  # the call check rides at the end of the first pack
                n = flats[0].numel()
                buffer = default_pool().empty((n + extra,), flats[0].dtype,
                                              self._wire.torch_device)
                buffer[:n].copy_(flats[0] if len(flats) == 1 else self._local.reduce_to_devices(
                    reduce_op, flats, (self._wire,))[0])
                buffers.append(buffer)
                views.append(buffer[:n])
                continue
            buffers.append(self._local.reduce_to_devices(reduce_op, flats, (self._wire,))[0])
            views.append(buffers[-1])
        wire = tuple((kind, str(b.dtype), b.numel()) for b in buffers)
        self._call(f"{reduce_op.name} of " + ", ".join(describe(t) for t in first), wire,
                   buffers)
        out: list[list[torch.Tensor]] = [[] for _ in first]
        for members, buffer in zip(packs, views, strict=True):
            like = [first[m] for m in members]
            for flat in self._copies(buffer, destinations[members[0]]):
                for m, part in zip(members, packing.unpack(flat, like), strict=True):
                    out[m].append(part)
        return out

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
        table = self._call(f"gather of {dtype}{masked} along {dim}", _GATHER, [], sizes=sizes)
        totals = [sum(row[_HEAD:]) for row in table]
        shape = list(local.shape)
        shape[dim] = max(totals)
        padded = local.new_zeros(shape)
        padded.narrow(dim, 0, local.shape[dim]).copy_(local)
        parts = [torch.empty_like(padded) for _ in totals]
        self._wait([dist.all_gather(parts, padded, group=self._group, async_op=True)],
                   self._ledger.seq, "gather")
        whole = torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, totals, strict=True)],
                          dim=dim)
        return self._copies(whole, destinations), [s for row in table for s in row[_HEAD:]]

    def broadcast(self, tensor: torch.Tensor, destinations: tuple[Device, ...]
                  ) -> list[torch.Tensor]:
        """One new copy of ``tensor`` per destination (local only: no cross-worker traffic)."""
        return self._local.broadcast_to_devices(tensor, destinations)

    def sum_counts(self, per_replica: Sequence[Sequence[int]]) -> list[int]:
        """Global element counts (``per_replica[r][k]``: local replica ``r``'s count of
        value ``k``): one int64 all-reduce SUM, checked like every call."""
        local = [sum(counts) for counts in zip(*per_replica, strict=True)]
        extra = trailer.length("sum", torch.int64, self._topology.num_workers
                               ) if self._check else 0
        totals = torch.zeros(len(local) + extra, dtype=torch.int64,
                             device=self._wire.torch_device)
        totals[:len(local)] = torch.tensor(local, dtype=torch.int64)
        self._call(f"element counts of {len(local)} values",
                   (("sum", "torch.int64", totals.numel()),), [totals])
        return [int(t) for t in totals[:len(local)].tolist()]

    def agree(self, what: str, value: int) -> list[int]:
        """Every worker's ``value`` (one int each), in worker order.

        Example:
            ``comm.agree("steps", 5)`` on 2 workers gives ``[5, 5]``.
        """
        table = self._call(f"agree({what})", (), [], value=int(value))
        return [row[4] for row in table]

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
        self._call(f"broadcast of {len(tensors)} tensors", tuple(
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
        return any(row[3] for row in self._call("any worker has data", (), [], flag=int(flag)))

    # ------------------------------------------------------------ the protocol
    def _call(self, what: str, wire: Wire, data: list[torch.Tensor], *, flag: int = 0,
              value: int = 0, sizes: Sequence[int] = ()) -> list[list[int]]:
        """One checked cross-worker call (see the module's docstring): launches
        ``data``'s collectives (kinds and sizes in ``wire``) with the header and returns
        the header table (one row per worker) once every identity agrees."""
        ledger = self._ledger
        if ledger.broken is not None:
            raise RuntimeError(f"this strategy's cross-worker communication is unusable after "
                               f"an earlier failure ({ledger.broken}); restart the job")
        who = user_call()
        key = f"{ledger.in_run}|{who}|{what}|{wire}"
        index = ledger.index + 1
        seq, prediction = ledger.enter(key, wire)
        text = (f"{who.entry}({_short(what)}) at {who.site} (collective {index} "
                f"{ledger.phase_text()})")
        if self._job is not None:
            self._job.note_progress(seq, seq - 1)
            self._fail_if_gone(seq, text)
        check = self._check
        ident = identity_hash(f"{seq}|{ledger.run}|{index}|{key}") if check else 0
        predicted = identity_hash(repr(prediction)) if check and prediction else 0
        row = [ident, predicted, 0, flag, value, *sizes]
        row += [0] * (_HEAD + self._topology.num_local_replicas - len(row))
        agreed, ledger.agreed = ledger.agreed, None
        if not check and wire and wire != _GATHER:
            self._wait(self._launch(wire, data), seq, text)  # unchecked: the data only
            self._done(seq)
            return []
        if agreed is not None and agreed != _GATHER:
            inside = self._trailer_length(agreed)  # the check rides in the data
            if agreed == wire:  # header and data together
                if inside:
                    trailer.encode(data[0][-inside:], wire[0][0], self._world,
                                   (ident, predicted, 0))
                    self._wait(self._launch(wire, data), seq, text)
                    (same, guess, miss), _ = trailer.decode(data[0][-inside:], wire[0][0],
                                                            self._world)
                    if miss == 0:
                        if same is None:
                            self._mismatch(seq, text)
                        ledger.agreed = ledger.predicted if guess == predicted != 0 else None
                        self._done(seq)
                        return []
                else:
                    table = self._round(row, self._launch(wire, data), seq, text)
                    if not any(r[2] for r in table):
                        return self._verified(table, seq, text)
            else:  # zeros of the agreed sizes, so that every worker sends what it expects
                dummy = [torch.zeros(n, dtype=getattr(torch, d.removeprefix("torch.")),
                                     device=self._wire.torch_device) for _, d, n in agreed]
                if inside:
                    trailer.encode(dummy[0][-inside:], agreed[0][0], self._world,
                                   (ident, 0, 1))
                    self._wait(self._launch(agreed, dummy), seq, text)
                else:
                    self._round([*row[:2], 1, *row[3:]], self._launch(agreed, dummy), seq,
                                text)
        table = self._verified(self._round(row, [], seq, text), seq, text)
        if wire != _GATHER and data:
            self._wait(self._launch(wire, data), seq, text)
        return table

    def _trailer_length(self, wire: Wire) -> int:
        """The trailer a call of these wire sizes carries in its first pack (0: none)."""
        if not wire or wire[0][0] not in ("sum", "min", "max"):
            return 0
        dtype = getattr(torch, wire[0][1].removeprefix("torch."))
        return trailer.length(wire[0][0], dtype, self._world)

    def _done(self, seq: int) -> None:
        self._ledger.completed = seq
        if self._job is not None:
            self._job.note_progress(seq, seq)

    def _launch(self, wire: Wire, data: Sequence[torch.Tensor]) -> list[Any]:
        works = []
        for (kind, _, _), buffer in zip(wire, data, strict=True):
            if kind == "broadcast":
                works.append(dist.broadcast(buffer, src=0, group=self._group, async_op=True))
            else:
                works.append(dist.all_reduce(buffer, op=_DIST_OPS[kind], group=self._group,
                                             async_op=True))
        return works

    def _round(self, row: list[int], works: list[Any], seq: int, text: str
               ) -> list[list[int]]:
        """All-gathers ``row`` (before ``works``' results are awaited) -> the table."""
        header = torch.tensor(row, dtype=torch.int64, device=self._wire.torch_device)
        rows = [torch.empty_like(header) for _ in range(self._topology.num_workers)]
        gathered = dist.all_gather(rows, header, group=self._group, async_op=True)
        self._wait([gathered, *works], seq, text)
        table: list[list[int]] = torch.stack(rows).tolist()
        return table

    def _verified(self, table: list[list[int]], seq: int, text: str) -> list[list[int]]:
        ledger = self._ledger
        if any(r[0] != table[0][0] for r in table):
            self._mismatch(seq, text)
        if all(r[1] == table[0][1] for r in table) and table[0][1]:
            ledger.agreed = ledger.predicted
        self._done(seq)
        return table

    # ------------------------------------------------------------------ waits
    def _wait(self, works: list[Any], seq: int, text: str) -> None:
        """Waits for ``works``, bounded by the timeout and watched through the job."""
        start = time.monotonic()
        deadline = None if self._timeout is None else start + self._timeout
        poll = self._job.poll_interval if self._job is not None else 1.0
        for work in works:
            while True:
                now = time.monotonic()
                left = poll if deadline is None else min(poll, deadline - now)
                try:  # the wait itself sleeps in C++, without the GIL: no wake-up latency
                    # (at least 1 ms: torch reads a 0 ms timeout as "no timeout")
                    if work.wait(datetime.timedelta(seconds=max(0.001, left))) is not False:
                        break  # (Gloo's wait returns False at the end of the poll)
                except RuntimeError as error:  # Gloo: "timed out" at the end of each poll
                    if work.is_completed():  # a real failure, not the end of one poll
                        self._broken_link(error, seq, text, time.monotonic() - start)
                if self._job is not None:
                    self._fail_if_gone(seq, text)
                if deadline is not None and time.monotonic() >= deadline:
                    self._fail(CollectiveTimeoutError(
                        f"worker {self._topology.worker_index} waited {self._timeout:g} s in "
                        f"{text} (collective #{seq}) for peers that never joined"
                        f"{self._progress_text()}"))

    def _broken_link(self, error: RuntimeError, seq: int, text: str, waited: float
                     ) -> NoReturn:
        """A collective failed in the process group. At the group's own timeout (longer
        than the job's, so only a longer per-call timeout or none meets it) that is a
        timeout; before it, a peer's connection broke, and the job's monitor says who,
        within its bound."""
        limit = self._job.collective_timeout if self._job is not None else None
        if limit is not None and waited >= limit - 0.5:
            self._fail(CollectiveTimeoutError(
                f"worker {self._topology.worker_index} waited {waited:.0f} s in {text} "
                f"(collective #{seq}): the process group's timeout{self._progress_text()}"),
                error)
        if self._job is not None:
            give_up = time.monotonic() + self._job.failure_timeout + 3 * self._job.poll_interval
            while time.monotonic() < give_up:
                self._fail_if_gone(seq, text, cause=error)
                time.sleep(self._job.poll_interval / 2)
        self._fail(WorkerFailureError(
            f"{text} (collective #{seq}) failed on worker {self._topology.worker_index}: the "
            f"process group failed ({type(error).__name__}: {_short(str(error), 300)})"), error)

    def _fail_if_gone(self, seq: int, text: str, cause: BaseException | None = None) -> None:
        assert self._job is not None  # callers check; not user input
        dead, left = self._job.gone()
        me = self._topology.worker_index
        if dead:
            names = ", ".join(str(r) for r in dead)
            self._fail(WorkerFailureError(
                f"worker {names} failed (no heartbeat for {self._job.failure_timeout:g} s) "
                f"while worker {me} was in {text} (collective #{seq})", tuple(dead)), cause)
        # Gone: left on an exception (Ctrl-C), or inside a collective it never finished.
        during = {r: reason for r, (started, done, reason) in left.items()
                  if done < seq and (reason or seq <= started)}
        if during:
            names = ", ".join(str(r) for r in sorted(during))
            why = "; ".join(f"worker {r} on {reason}" if reason else
                            f"worker {r} inside collective #{left[r][0]}"
                            for r, reason in sorted(during.items()))
            self._fail(WorkerFailureError(
                f"worker {names} left the job ({why}) while worker {me} was in {text} "
                f"(collective #{seq})", tuple(sorted(during))), cause)
        skipped = {r: done for r, (started, done, _) in left.items() if started < seq}
        if skipped:
            listing = "; ".join(f"worker {r} left after {n} collectives"
                                for r, n in sorted(skipped.items()))
            self._fail(CollectiveMismatchError(
                f"{listing}, but worker {me} called {text} as collective #{seq}: a worker "
                "skipped a collective the others made"), cause)

    def _mismatch(self, seq: int, text: str) -> NoReturn:
        calls = {self._topology.worker_index: text}
        if self._job is not None:  # ask every worker what it called (only on mismatch)
            calls = self._job.share(f"call-{seq}", text, 2.0)
        listing = "; ".join(f"worker {r}: {c}" for r, c in sorted(calls.items()))
        self._fail(CollectiveMismatchError(
            f"workers made different calls as collective #{seq} (a different call, site, "
            f"op, shape or dtype, or a worker skipped or added a call); no data of it was "
            f"used: {listing}"))

    def _progress_text(self) -> str:
        progress = self._job.progress() if self._job is not None else {}
        if not progress:
            return ""
        return "; peers' collectives started so far: " + ", ".join(
            f"worker {r}: {n}" for r, n in sorted(progress.items()))

    def _fail(self, error: Exception, cause: BaseException | None = None) -> NoReturn:
        self._ledger.broken = f"{type(error).__name__}: {_short(str(error), 300)}"
        raise error from cause

    def _copies(self, tensor: torch.Tensor, devices: Sequence[Device]) -> list[torch.Tensor]:
        """``tensor`` itself for the first destination when it already lives there."""
        if devices and devices[0].torch_device == tensor.device:
            return [tensor, *self._local.broadcast_to_devices(tensor, devices[1:])]
        return self._local.broadcast_to_devices(tensor, devices)
