"""`DistributedCommunicator`: the two-level `Communicator` of a multi-worker job.

Local replicas are combined in-process by a local `CrossDeviceOps`, then ONE
``torch.distributed`` collective per pack crosses the workers. Each call also
checks, in a tiny collective issued alongside the data, that every worker made
the same call (a fingerprint of sequence number, op, shapes and dtypes), and
every wait is bounded: a timeout, a dead peer (the job's `PeerMonitor`) or a
peer that left early becomes a `CollectiveTimeoutError`, `WorkerFailureError` or
`CollectiveMismatchError` instead of a hang. After such an error the
communicator is unusable (workers are out of step); the job should restart.
"""

from __future__ import annotations

import datetime
import hashlib
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ..cluster.process_group import Job, current_job
from ..devices import Device
from ..errors import CollectiveMismatchError, CollectiveTimeoutError, WorkerFailureError
from ..reduce_op import ReduceOp
from ..reduction import describe
from ..topology import Topology
from . import packing
from .cross_device_ops import CrossDeviceOps
from .host import concat

__all__ = ["DistributedCommunicator"]

_DIST_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN,
             ReduceOp.MAX: dist.ReduceOp.MAX}
_HOST = Device("CPU", 0)


def _fingerprint(seq: int, call: str, phase: int = 0) -> int:
    """A 56-bit hash of ``seq``, the program ``phase`` (`Job.phase`) and ``call``
    (stable across processes, unlike ``hash``)."""
    digest = hashlib.blake2b(f"{seq}|{phase}|{call}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


class DistributedCommunicator:
    """Local replicas first (``local``), then one collective across workers per pack.

    Args:
        local: combines this worker's replicas in-process.
        topology: this worker's replicas and place in the job.
        group: the ``torch.distributed`` process group (default: the default group).
        timeout_seconds: the longest a collective waits for the peers (``None``: no
            limit of its own; the process group's timeout still applies).
        check_calls: check every call against the peers' (one tiny extra collective,
            overlapped with the data).
        job: the `Job` whose peer monitor detects dead peers (default: the running
            one, if any).

    Example:
        >>> import socket, torch, mirrored
        >>> from mirrored._src.cluster import process_group
        >>> from mirrored._src.devices import parse_devices
        >>> with socket.socket() as s:
        ...     s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        >>> job = process_group.init_process_group("gloo", 0, 1, "127.0.0.1", port, 10)
        >>> topology = Topology(devices=parse_devices(["CPU:0", "CPU:1"]))
        >>> comm = DistributedCommunicator(mirrored.ReductionToOneDevice(), topology)
        >>> out = comm.reduce_packed(ReduceOp.SUM, [[torch.tensor(1.0)], [torch.tensor(2.0)]],
        ...                          [topology.devices], bytes_per_pack=0)
        >>> out[0][1], comm.any(False)
        (tensor(3.), False)
        >>> process_group.destroy_process_group()
    """

    def __init__(self, local: CrossDeviceOps, topology: Topology, *,
                 group: Any = None, timeout_seconds: float | None = None,
                 check_calls: bool = True, job: Job | None = None) -> None:
        if not isinstance(local, CrossDeviceOps):
            raise TypeError(f"local must be a CrossDeviceOps; got {type(local).__name__}")
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a Topology; got {type(topology).__name__}")
        if timeout_seconds is not None and not timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be None or > 0; got {timeout_seconds!r}")
        if not dist.is_initialized():
            raise RuntimeError("DistributedCommunicator needs a running torch.distributed "
                               "process group; call init_process_group first")
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
        self._job = job if job is not None else current_job()
        nccl = dist.get_backend(group) == "nccl"
        self._wire = topology.devices[0] if nccl else _HOST  # where cross-worker data travels
        self._seq = 0
        self._broken: str | None = None

    # ------------------------------------------------------------------ calls
    def reduce_packed(self, reduce_op: ReduceOp, per_replica: Sequence[Sequence[torch.Tensor]],
                      destinations: Sequence[tuple[Device, ...]], bytes_per_pack: int
                      ) -> list[list[torch.Tensor]]:
        """Combines many values over every replica of every worker (SUM, MIN or MAX):
        see `Communicator.reduce_packed`."""
        first = per_replica[0]
        call = (f"reduce_packed({reduce_op.name}: " + ", ".join(describe(t) for t in first)
                + f"; {bytes_per_pack} bytes per pack)")
        seq = self._enter(call)
        keys = [(t.dtype, t.device, id(destinations[k])) for k, t in enumerate(first)]
        nbytes = [t.numel() * t.element_size() for t in first]
        packs = packing.plan(nbytes, keys, bytes_per_pack)
        buffers = []
        for members in packs:
            flats = [packing.pack([leaves[m] for m in members]) for leaves in per_replica]
            buffers.append(self._local.reduce_to_devices(reduce_op, flats, (self._wire,))[0])
        if self._check:
            self._header(seq, call, [0] * self._topology.num_local_replicas)
        self._wait([dist.all_reduce(b, op=_DIST_OPS[reduce_op], group=self._group,
                                    async_op=True) for b in buffers], seq, call)
        out: list[list[torch.Tensor]] = [[] for _ in first]
        for members, buffer in zip(packs, buffers, strict=True):
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
        rest = [s for d, s in enumerate(local.shape) if d != dim]
        dtype = str(local.dtype).removeprefix("torch.")
        call = f"gather(dim={dim}: {dtype}, other dims {rest})"
        seq = self._enter(call)
        sizes = [c.shape[dim] for c in per_replica]
        table = self._header(seq, call, sizes)
        totals = [sum(row[1:]) for row in table]
        shape = list(local.shape)
        shape[dim] = max(totals)
        padded = local.new_zeros(shape)
        padded.narrow(dim, 0, local.shape[dim]).copy_(local)
        parts = [torch.empty_like(padded) for _ in totals]
        self._wait([dist.all_gather(parts, padded, group=self._group, async_op=True)],
                   seq, call)
        whole = torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, totals, strict=True)],
                          dim=dim)
        return self._copies(whole, destinations), [s for row in table for s in row[1:]]

    def broadcast(self, tensor: torch.Tensor, destinations: tuple[Device, ...]
                  ) -> list[torch.Tensor]:
        """One new copy of ``tensor`` per destination (local only: no cross-worker traffic)."""
        return self._local.broadcast_to_devices(tensor, destinations)

    def sum_counts(self, per_replica: Sequence[Sequence[int]]) -> list[int]:
        """Global element counts (``per_replica[r][k]``: local replica ``r``'s count of
        value ``k``): one int64 all-reduce SUM, checked like every call."""
        local = [sum(counts) for counts in zip(*per_replica, strict=True)]
        call = f"sum_counts({len(local)} values)"
        seq = self._enter(call)
        if self._check:
            self._header(seq, call, [0] * self._topology.num_local_replicas)
        totals = torch.tensor(local, dtype=torch.int64, device=self._wire.torch_device)
        self._wait([dist.all_reduce(totals, group=self._group, async_op=True)], seq, call)
        return [int(t) for t in totals.tolist()]

    def agree(self, what: str, value: int) -> list[int]:
        """Every worker's ``value`` (one int each), in worker order, whatever the local
        replica counts (for start-up checks of what every worker must share).

        Example:
            ``comm.agree("local replicas", 2)`` on 2 workers gives ``[2, 2]``.
        """
        call = f"agree({what})"
        seq = self._enter(call)
        fp = _fingerprint(seq, call, self._phase())  # always checked: a two-int header
        header = torch.tensor([fp, int(value)], dtype=torch.int64,
                              device=self._wire.torch_device)
        rows = [torch.empty_like(header) for _ in range(self._topology.num_workers)]
        self._wait([dist.all_gather(rows, header, group=self._group, async_op=True)], seq, call)
        table: list[list[int]] = torch.stack(rows).tolist()
        if any(row[0] != fp for row in table):
            self._mismatch(seq, call)
        return [row[1] for row in table]

    def broadcast_from_chief(self, tensors: Sequence[torch.Tensor]) -> None:
        """Overwrites ``tensors`` in place with worker 0's values (one broadcast per
        dtype; every worker passes tensors of the same shapes and dtypes)."""
        call = "broadcast_from_chief(" + ", ".join(describe(t) for t in tensors) + ")"
        seq = self._enter(call)
        if self._check:
            self._header(seq, call, [0] * self._topology.num_local_replicas)
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault(t.dtype, []).append(t)
        flats, works = [], []
        for dtype, members in groups.items():
            wire = torch.uint8 if dtype == torch.bool else dtype
            flat = packing.pack([m.detach().to(self._wire.torch_device, wire) for m in members])
            flats.append((members, flat))
            works.append(dist.broadcast(flat, src=0, group=self._group, async_op=True))
        self._wait(works, seq, call)
        with torch.no_grad():
            for members, flat in flats:
                for m, part in zip(members, packing.unpack(flat, members), strict=True):
                    m.copy_(part)

    def any(self, flag: bool) -> bool:
        """Whether any worker passed ``True`` (one tiny all-gather of flags).

        Raises:
            TypeError: ``flag`` is not a bool.
        """
        if not isinstance(flag, bool):
            raise TypeError(f"flag must be a bool; got {type(flag).__name__} {flag!r}")
        call = "any()"
        seq = self._enter(call)
        flags = [int(flag)] + [0] * (self._topology.num_local_replicas - 1)
        return any(row[1] for row in self._header(seq, call, flags))

    # ---------------------------------------------------------------- helpers
    def _copies(self, tensor: torch.Tensor, devices: Sequence[Device]) -> list[torch.Tensor]:
        """``tensor`` itself for the first destination when it already lives there."""
        if devices and devices[0].torch_device == tensor.device:
            return [tensor, *self._local.broadcast_to_devices(tensor, devices[1:])]
        return self._local.broadcast_to_devices(tensor, devices)

    def _phase(self) -> int:
        return self._job.phase if self._job is not None else 0

    def _enter(self, call: str) -> int:
        if self._broken is not None:
            raise RuntimeError(f"this communicator is unusable after an earlier failure "
                               f"({self._broken}); cannot run {call}. Restart the job")
        if self._job is not None:
            self._fail_if_peers_gone(self._seq + 1, call)
            self._job.monitor.started = self._seq + 1
        self._seq += 1
        return self._seq

    def _header(self, seq: int, call: str, extra: list[int]) -> list[list[int]]:
        """All-gathers ``[fingerprint, *extra]`` (one int64 per local replica in
        ``extra``: the same size for every kind of call, so a mismatched call never
        meets a collective of another size, which Gloo answers by aborting the
        process) and raises `CollectiveMismatchError` if the fingerprints differ.

        Returns:
            One row per worker.
        """
        fp = _fingerprint(seq, call, self._phase()) if self._check else 0
        header = torch.tensor([fp, *extra], dtype=torch.int64, device=self._wire.torch_device)
        rows = [torch.empty_like(header) for _ in range(self._topology.num_workers)]
        self._wait([dist.all_gather(rows, header, group=self._group, async_op=True)], seq, call)
        table: list[list[int]] = torch.stack(rows).tolist()
        if any(row[0] != fp for row in table):
            self._mismatch(seq, call)
        return table

    def _wait(self, works: list[Any], seq: int, call: str) -> None:
        """Waits for ``works``, bounded by the timeout and watched by the peer monitor."""
        if self._timeout is None and self._job is None:
            self._raise_translated(works, seq, call)
            return
        deadline = None if self._timeout is None else time.monotonic() + self._timeout
        poll = self._job.monitor.interval if self._job is not None else 1.0
        for work in works:
            while True:
                left = poll if deadline is None else min(poll, deadline - time.monotonic())
                try:  # the wait itself sleeps in C++, without the GIL: no wake-up latency
                    # (at least 1 ms: torch reads a 0 ms timeout as "no timeout")
                    if work.wait(datetime.timedelta(seconds=max(0.001, left))) is not False:
                        break  # (Gloo's wait returns False at the end of the poll)
                except RuntimeError as error:
                    if work.is_completed():  # a real failure, not the end of one poll
                        self._translate(error, seq, call)
                if self._job is not None:
                    self._fail_if_peers_gone(seq, call)
                if deadline is not None and time.monotonic() >= deadline:
                    self._fail(CollectiveTimeoutError(
                        f"worker {self._topology.worker_index} waited {self._timeout:g} s in "
                        f"collective #{seq} ({call}) for peers that never joined"
                        f"{self._progress_text()}"))

    def _raise_translated(self, works: list[Any], seq: int, call: str) -> None:
        try:
            for work in works:
                work.wait()
        except RuntimeError as error:
            self._translate(error, seq, call)

    def _translate(self, error: RuntimeError, seq: int, call: str) -> NoReturn:
        """Raises the library's error for a failed collective (``error`` from torch)."""
        text = str(error)
        if "timed out" in text.lower() or "timeout" in text.lower():
            self._fail(CollectiveTimeoutError(
                f"collective #{seq} ({call}) timed out in the process group: {text}"
                f"{self._progress_text()}"), error)
        if self._job is not None:  # a broken connection: let the monitor say who
            give_up = time.monotonic() + self._job.monitor.failure_timeout + 2.0
            while time.monotonic() < give_up:
                self._fail_if_peers_gone(seq, call, cause=error)
                time.sleep(self._job.monitor.interval)
        self._fail(WorkerFailureError(
            f"collective #{seq} ({call}) failed on worker {self._topology.worker_index}: "
            f"a connection to a peer broke ({text})"), error)

    def _fail_if_peers_gone(self, seq: int, call: str,
                            cause: BaseException | None = None) -> None:
        assert self._job is not None  # callers check; not user input
        monitor = self._job.monitor
        dead = monitor.dead_peers()
        if dead:
            names = ", ".join(str(r) for r in dead)
            self._fail(WorkerFailureError(
                f"worker {names} failed (no heartbeat for {monitor.failure_timeout:g} s) "
                f"while worker {self._topology.worker_index} was in collective #{seq} "
                f"({call})", tuple(dead)), cause)
        left = {r: n for r, n in monitor.exited_peers().items() if n < seq}
        if left:
            listing = "; ".join(f"worker {r} left after {n} collectives" for r, n in left.items())
            self._fail(CollectiveMismatchError(
                f"{listing}, but worker {self._topology.worker_index} called collective #{seq} "
                f"({call}): a worker skipped a collective the others made"), cause)

    def _mismatch(self, seq: int, call: str) -> NoReturn:
        rank = self._topology.worker_index
        calls = {rank: call}
        if self._job is not None:  # ask every worker what it called (only on mismatch)
            store = self._job.store
            store.set(f"mirrored/call/{seq}/{rank}", call)
            for r in range(self._topology.num_workers):
                if r != rank:
                    try:
                        store.wait([f"mirrored/call/{seq}/{r}"], datetime.timedelta(seconds=2))
                        calls[r] = store.get(f"mirrored/call/{seq}/{r}").decode()
                    except Exception:  # a peer that doesn't answer
                        continue
        listing = "; ".join(f"worker {r}: {c}" for r, c in sorted(calls.items()))
        self._fail(CollectiveMismatchError(
            f"workers made different calls as collective #{seq} (a different op, shape, "
            f"dtype or number of values, or a worker skipped a call): {listing}"))

    def _progress_text(self) -> str:
        if self._job is None:
            return ""
        progress = self._job.monitor.progress()
        if not progress:
            return ""
        return "; peers' collectives started so far: " + ", ".join(
            f"worker {r}: {n}" for r, n in sorted(progress.items()))

    def _fail(self, error: Exception, cause: BaseException | None = None) -> NoReturn:
        self._broken = f"{type(error).__name__}: {error}"
        raise error from cause

