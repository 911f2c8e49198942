"""The job's ``torch.distributed`` process group, and how a worker learns a peer died.

`init_process_group` starts the default process group (Gloo for CPU, NCCL for
CUDA) over a ``TCPStore`` hosted by worker 0, with a short timeout instead of
torch's 30 minutes, and starts a `PeerMonitor`: each worker beats a counter (and
the number of collectives it has started) into the store, and a peer whose
counter stops moving for ``failure_timeout_seconds`` is dead. `Job` holds both;
`destroy_process_group` tears them down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CollectiveTimeoutError

_TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]
_PrefixStore: Any = dist.PrefixStore  # type: ignore[attr-defined]

__all__ = ["Job", "JobSpec", "PeerMonitor", "current_job", "destroy_process_group",
           "init_process_group"]

_BACKENDS = ("gloo", "nccl", "auto")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    """Where a worker sits in a job and how long it waits for the others.

    Args:
        backend: ``"gloo"`` (CPU tensors), ``"nccl"`` (CUDA tensors) or ``"auto"``
            (NCCL when CUDA is available, else Gloo).
        rank: this worker's index, ``0 .. world_size - 1``; worker 0 hosts the store.
        world_size: the number of workers.
        master_addr: worker 0's address.
        master_port: the store's port on worker 0.
        timeout_seconds: the process group's timeout (rendezvous and each collective).
        failure_timeout_seconds: a peer whose heartbeat stops for this long is dead.

    Raises:
        ValueError: an unknown backend, a rank outside the job, a bad port or timeout.

    Example:
        >>> JobSpec(backend="gloo", rank=1, world_size=2, master_port=29500).timeout_seconds
        120.0
    """

    backend: str
    rank: int
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int
    timeout_seconds: float = 120.0
    failure_timeout_seconds: float = 10.0

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}; got {self.backend!r}")
        for name in ("rank", "world_size", "master_port"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int; got {type(value).__name__} {value!r}")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in 0..world_size - 1 and world_size >= 1; got rank "
                             f"{self.rank}, world_size {self.world_size}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535; got {self.master_port}")
        for name in ("timeout_seconds", "failure_timeout_seconds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0; got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.backend == "auto":
            object.__setattr__(self, "backend", "nccl" if torch.cuda.is_available() else "gloo")


def _key(rank: int) -> str:
    return f"mirrored/heartbeat/{rank}"


class PeerMonitor:
    """Beats this worker's heartbeat into the store and watches the peers' beats.

    A heartbeat is ``"<count> <collectives started>"``, or ``"exit <collectives
    started>"`` once a worker shut down cleanly. A peer whose count has not moved
    for ``failure_timeout`` seconds is dead; if the store itself (hosted by worker
    0) stops answering, worker 0 is dead.

    Example:
        >>> import datetime, torch.distributed as dist
        >>> store = dist.HashStore()
        >>> monitor = PeerMonitor(store, rank=0, world_size=1, failure_timeout=5.0)
        >>> monitor.dead_peers(), monitor.exited_peers()
        ([], {})
        >>> monitor.stop()
    """

    def __init__(self, store: Any, *, rank: int, world_size: int,
                 failure_timeout: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.failure_timeout = failure_timeout
        self.interval = min(1.0, max(0.05, failure_timeout / 10))
        self.started = 0  # collectives this worker has started (set by the communicator)
        self._store = store
        self._peers = [r for r in range(world_size) if r != rank]
        now = time.monotonic()
        self._seen: dict[int, tuple[bytes, float]] = {r: (b"", now) for r in self._peers}
        self._progress: dict[int, int] = {}
        self._exited: dict[int, int] = {}
        self._dead: list[int] = []
        self._beats = 0
        self._armed = False  # no verdicts until every peer has joined (see arm)
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="mirrored-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._beats += 1
        self._store.set(_key(self.rank), f"{self._beats} {self.started}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                present = [r for r in self._peers if self._store.check([_key(r)])]
                values = self._store.multi_get([_key(r) for r in present]) if present else []
            except Exception:  # the store's host (worker 0) may be gone
                if self._stop.is_set():
                    return
                # Verdicts go on from the heartbeats seen so far: worker 0's stops with
                # its store (dead after the failure timeout, not at one failed call, which
                # can be a hiccup of a loaded machine), and worker 0 may have left after
                # noticing a death that this worker must still name.
                self._judge(time.monotonic())
                continue
            now = time.monotonic()
            for r, value in zip(present, values, strict=True):
                head, _, started = value.partition(b" ")
                self._progress[r] = int(started or 0)
                if head == b"exit":
                    self._exited[r] = int(started or 0)
                if value != self._seen[r][0]:
                    self._seen[r] = (value, now)
            self._judge(now)

    def _judge(self, now: float) -> None:
        if self._armed:
            self._dead = sorted(r for r in self._peers if r not in self._exited
                                and now - self._seen[r][1] > self.failure_timeout)

    def arm(self) -> None:
        """Starts judging peers (call once every worker has joined the job)."""
        now = time.monotonic()
        self._seen = {r: (value, now) for r, (value, _) in self._seen.items()}
        self._armed = True

    def dead_peers(self) -> list[int]:
        """The workers whose heartbeat stopped (sorted)."""
        return list(self._dead)

    def exited_peers(self) -> dict[int, int]:
        """Workers that shut down cleanly -> how many collectives each had started."""
        return dict(self._exited)

    def progress(self) -> dict[int, int]:
        """Each peer's count of started collectives, as last seen."""
        return dict(self._progress)

    def stop(self, *, announce: bool = True) -> None:
        """Stops beating; with ``announce``, tells the peers this worker left cleanly."""
        self._stop.set()
        self._thread.join()
        if announce:
            with contextlib.suppress(Exception):  # the store is gone already
                self._store.set(_key(self.rank), f"exit {self.started}")

    def release(self) -> None:
        """Drops the store client (after `stop`), so its connection closes now."""
        self._store = None


class Job:
    """A started process group and its peer monitor (see `init_process_group`)."""

    def __init__(self, spec: JobSpec, store: Any, monitor: PeerMonitor) -> None:
        self.spec = spec
        self.store = store
        self.monitor = monitor
        # Which phase of the program every worker is in: odd inside the n-th run of the
        # strategy, even between runs. Part of every call's fingerprint, so a worker
        # that skips a collective is caught at the next phase even when its calls look
        # alike (collective #k of one worker never meets #k of a later run).
        self.phase = 0

    def next_phase(self) -> None:
        """A ``run`` starts or ends."""
        self.phase += 1

    def __repr__(self) -> str:
        s = self.spec
        return (f"Job(backend={s.backend!r}, rank={s.rank}, world_size={s.world_size}, "
                f"master={s.master_addr}:{s.master_port})")


_current: Job | None = None
_lock = threading.Lock()
_servers: dict[tuple[str, int], Any] = {}  # worker 0's stores, kept for the next job
_generations: dict[tuple[str, int], int] = {}


def init_process_group(backend: str, rank: int, world_size: int, master_addr: str,
                       master_port: int, timeout_seconds: float = 120.0, *,
                       failure_timeout_seconds: float = 10.0, attempt: int = 0) -> Job:
    """Starts the default process group of a job and its peer monitor; idempotent.

    Every worker calls it with the same job; it returns when all have joined (or
    raises after ``timeout_seconds``). A second call with the same arguments
    returns the running `Job`. The store keys of each ``attempt`` (a restart of the
    job by torchrun) are prefixed apart: a restarted job shares torchrun's store with
    the dead attempt's keys, and must not read them.

    Raises:
        RuntimeError: a process group is already running with other arguments, or
            ``torch.distributed`` was initialized by someone else.

    Example:
        >>> import socket
        >>> with socket.socket() as s:
        ...     s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
        >>> job = init_process_group("gloo", 0, 1, "127.0.0.1", port, timeout_seconds=10)
        >>> job.spec.world_size, current_job() is job
        (1, True)
        >>> destroy_process_group()
        >>> current_job() is None
        True
    """
    global _current
    spec = JobSpec(backend=backend, rank=rank, world_size=world_size, master_addr=master_addr,
                   master_port=master_port, timeout_seconds=timeout_seconds,
                   failure_timeout_seconds=failure_timeout_seconds)
    with _lock:
        if _current is not None:
            if _current.spec == spec:
                return _current
            raise RuntimeError(f"a process group is already running ({_current}); got a "
                               f"request for {spec}. Call destroy_process_group() first")
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialized outside mirrored; "
                               "destroy that process group first")
        timeout = datetime.timedelta(seconds=spec.timeout_seconds)
        # Jobs started one after the other by the same processes (a strategy closed,
        # then a new one) share worker 0's store, which stays up: re-binding its port
        # would race with peers still connected to the old one. Each job of the
        # sequence has keys of its own, as each restart attempt has.
        where = (spec.master_addr, spec.master_port)
        generation = _generations.get(where, 0)
        _generations[where] = generation + 1
        prefix = f"mirrored/attempt-{attempt}/job-{generation}/"
        if spec.rank == 0:
            server = _servers.get(where)
            if server is None:
                server = _servers[where] = _TCPStore(
                    spec.master_addr, spec.master_port, spec.world_size, is_master=True,
                    timeout=timeout, wait_for_workers=False)
            root = server
        else:
            root = _TCPStore(spec.master_addr, spec.master_port, spec.world_size,
                             is_master=False, timeout=timeout, wait_for_workers=False)
        store = _PrefixStore(prefix, root)
        # A separate client for the heartbeat thread: a store call blocked there
        # never delays a collective's store traffic, nor the other way round.
        beat_store = _PrefixStore(prefix, _TCPStore(
            spec.master_addr, spec.master_port, spec.world_size, is_master=False,
            timeout=timeout, wait_for_workers=False))
        monitor = PeerMonitor(beat_store, rank=spec.rank, world_size=spec.world_size,
                              failure_timeout=spec.failure_timeout_seconds)
        try:
            dist.init_process_group(spec.backend, store=store, rank=spec.rank,
                                    world_size=spec.world_size, timeout=timeout)
        except BaseException as error:
            monitor.stop(announce=False)
            if isinstance(error, Exception) and "timeout" in str(error).lower():
                raise CollectiveTimeoutError(
                    f"worker {spec.rank} of {spec.world_size}: not every worker joined the job "
                    f"within {spec.timeout_seconds:g} s (rendezvous at {spec.master_addr}:"
                    f"{spec.master_port}); start every worker, or check MASTER_ADDR/"
                    f"MASTER_PORT or TF_CONFIG") from error
            raise
        monitor.arm()
        _current = Job(spec, store, monitor)
        return _current


def current_job() -> Job | None:
    """The running `Job`, or ``None``."""
    return _current


def destroy_process_group() -> None:
    """Stops the peer monitor (announcing a clean exit) and destroys the default
    process group; does nothing when none is running."""
    global _current
    with _lock:
        job, _current = _current, None
        if job is None:
            return
        job.monitor.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
        job.store = None  # the store (and, on worker 0, its listening socket) goes with it
        job.monitor.release()
    # Exceptions of failed collectives (kept in reference cycles through their
    # tracebacks) may still hold the process group: free it now.
    gc.collect()
