"""`Job`: one worker's membership in a multi-worker job, an explicit part that a
strategy owns and hands to its communicators (as torch's ``Joinable`` or torchft's
``Manager`` are explicit).

`Job.start` connects to the job's ``TCPStore`` (hosted by worker 0, or by torchrun's
agent when ``TORCHELASTIC_USE_AGENT_STORE`` says so), meets every worker in a
rendezvous of its own (each worker's rank, the job's size and the facts every worker
must share are compared, so a wrong ``WORLD_SIZE``, a duplicate rank or a second job
on the port is a `StartupError` on every worker, fast), starts the default process
group and a `PeerMonitor`. Every wait is bounded by the job's timeout, also where
torch's store client would hang. `Job.close` leaves the job. Nothing is process-wide:
the job keeps its store, monitor and keys; a later job of the same processes gets
keys of its own (a generation counter in the store).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import logging
import socket
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..errors import StartupError
from .monitor import PeerMonitor
from .teardown import end_default_group, keep_default_group

_TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]
_PrefixStore: Any = dist.PrefixStore  # type: ignore[attr-defined]
_STORE_ERRORS = (dist.DistError, RuntimeError, OSError)
_POLL = 0.05
_BACKENDS = ("gloo", "nccl", "auto")
_log = logging.getLogger("mirrored")
T = TypeVar("T")

__all__ = ["Job", "JobSpec"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    """Where a worker sits in a job and how long it waits for the others.

    Args:
        backend: ``"gloo"`` (CPU tensors), ``"nccl"`` (CUDA tensors) or ``"auto"``
            (NCCL when CUDA is available, else Gloo).
        rank: this worker's index, ``0 .. world_size - 1``; worker 0 hosts the store.
        world_size: the number of workers.
        master_addr: the store's host (worker 0's, or torchrun's agent's).
        master_port: the store's port.
        timeout_seconds: the start-up bound and the process group's timeout.
        failure_timeout_seconds: a peer whose heartbeat stops for this long is dead.
        attempt: torchrun's restart count; each attempt's keys are kept apart.
        agent_store: torchrun's agent hosts the store (every worker is a client).

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
    attempt: int = 0
    agent_store: bool = False

    def __post_init__(self) -> None:
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}; got {self.backend!r}")
        for name in ("rank", "world_size", "master_port", "attempt"):
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

    @property
    def where(self) -> str:
        """``host:port`` of the store."""
        return f"{self.master_addr}:{self.master_port}"

    @property
    def collective_timeout(self) -> float:
        """The process group's own timeout: past every deadline of the communicators."""
        return self.timeout_seconds + self.failure_timeout_seconds + 5.0


def _bounded(make: Callable[[], T], seconds: float, what: str) -> T:
    """``make()`` on a helper thread, given up after ``seconds`` (torch's store client
    can block past its own timeout when the peer accepts and never answers)."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            box["value"] = make()
        except BaseException as error:  # handed to the caller
            box["error"] = error
        finally:
            done.set()

    threading.Thread(target=target, name="mirrored-store-connect", daemon=True).start()
    if not done.wait(max(0.0, seconds)):
        raise StartupError(what)
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


class _Retry(Exception):
    """The store this worker reached belongs to a job that is ending: reconnect."""


class Job:
    """This worker's membership in a started job (see `Job.start`). Communicators use
    only its `JobLink` members; ``facts``: every worker's start-up facts, in order."""

    def __init__(self, spec: JobSpec, store: Any, monitor: PeerMonitor,
                 facts: dict[str, list[int]]) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.world_size = spec.world_size
        self.failure_timeout = spec.failure_timeout_seconds
        self.collective_timeout = spec.collective_timeout
        self.poll_interval = monitor.interval
        self.facts = facts
        self._store = store
        self._monitor = monitor
        self._closed = False
        # Dropped without close() (no strategy.close(), an exit), the job still departs.
        self._departure = weakref.finalize(self, monitor.depart, host=store.server is not None)

    @classmethod
    def start(cls, spec: JobSpec, facts: Mapping[str, int] | None = None) -> Job:
        """Joins the job: returns when every worker has joined, or raises.

        Args:
            spec: the job and this worker's place in it.
            facts: values each worker reports at start-up (``{"local replicas": 2}``);
                the job's ``facts`` lists every worker's, for the caller to compare.

        Raises:
            StartupError: within ``timeout_seconds`` (plus a second): the store is
                unreachable or does not answer, the port is taken, workers disagree
                on the job's size, two workers claim one rank, or some worker did not
                join (named in ``error.workers``).
            RuntimeError: ``torch.distributed`` is already initialized (one job per
                process at a time).

        Example:
            >>> import mirrored
            >>> spec = JobSpec(backend="gloo", rank=0, world_size=1,
            ...                master_port=mirrored.testing.find_free_port(), timeout_seconds=10)
            >>> job = Job.start(spec, {"local replicas": 2})
            >>> job.facts, job.gone()
            ({'local replicas': [2]}, ([], {}))
            >>> job.close()
        """
        if dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is already initialized in this process (another "
                "MultiWorkerMirroredStrategy that is not closed, or a process group "
                "started outside mirrored); close() that strategy or destroy that group "
                "first")
        facts = dict(facts or {})
        deadline = time.monotonic() + spec.timeout_seconds
        store, table = _join(spec, facts, deadline)
        client = _connect(spec, deadline, host=False)
        beat_store = _PrefixStore(f"mirrored/attempt-{spec.attempt}", client)
        beat_store = _PrefixStore(f"job-{store.generation}", beat_store)
        monitor = PeerMonitor(beat_store, rank=spec.rank, world_size=spec.world_size,
                              failure_timeout=spec.failure_timeout_seconds,
                              hosted_by_0=not spec.agent_store)
        # Gloo's own timeout outlasts the communicators' deadlines (the job's timeout)
        # and the failure bound, so that a failed collective before it is a broken
        # connection, and one at it a timeout: told apart by time, not by its text.
        timeout = datetime.timedelta(seconds=spec.collective_timeout)
        try:
            dist.init_process_group(spec.backend, store=store.store, rank=spec.rank,
                                    world_size=spec.world_size, timeout=timeout)
        except dist.DistError as error:
            monitor.stop(announce=False)
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            raise StartupError(f"worker {spec.rank} of {spec.world_size}: the process group "
                               f"did not start ({type(error).__name__}: {error})") from error
        monitor.arm()
        if spec.attempt:
            _log.warning("worker %d of %d: the job restarted (attempt %d of torchrun)",
                         spec.rank, spec.world_size, spec.attempt)
        _log.info("worker %d of %d joined the job at %s (attempt %d, generation %d)",
                  spec.rank, spec.world_size, spec.where, spec.attempt, store.generation)
        return cls(spec, store, monitor, {k: [row[k] for row in table] for k in facts})

    def note_progress(self, started: int, completed: int, identity: int = 0) -> None:
        """This worker's counts of collectives, for the peers (`PeerMonitor.note`)."""
        self._monitor.note(started, completed, identity)

    def diverged(self) -> tuple[int, list[int]] | None:
        """See `PeerMonitor.diverged`."""
        return self._monitor.diverged()

    def gone(self) -> tuple[list[int], dict[int, tuple[int, int, str]]]:
        """Dead peers; peers that left -> (started, completed, the exception or "")."""
        return self._monitor.dead_peers(), self._monitor.left_peers()

    def progress(self) -> dict[int, int]:  # (each peer's started collectives, as seen)
        return self._monitor.progress()

    def note_failure(self) -> None:
        """Keeps worker 0's store up at its close (`PeerMonitor.stop`) and the group."""
        self._monitor.failed = True
        keep_default_group()

    def share(self, topic: str, text: str, wait_seconds: float) -> dict[int, str]:
        """Every worker's ``text`` for ``topic`` (within ``wait_seconds``), for messages."""
        store, texts = self._store.store, {self.rank: text}
        with contextlib.suppress(Exception):
            store.set(f"share/{topic}/{self.rank}", text)
        give_up = time.monotonic() + wait_seconds
        for r in (r for r in range(self.world_size) if r != self.rank):
            with contextlib.suppress(Exception):  # a peer that does not answer
                left = datetime.timedelta(seconds=max(0.01, give_up - time.monotonic()))
                store.wait([f"share/{topic}/{r}"], left)
                texts[r] = store.get(f"share/{topic}/{r}").decode()
        return texts

    def close(self) -> None:
        """Leaves the job: tells the peers (called while an exception is handled, e.g.
        ``except KeyboardInterrupt: strategy.close()``, that it leaves on it: gone, to
        them), ends the process group (kept, if the job failed), drops the store."""
        if self._closed:
            return
        self._closed = True
        self._departure()  # (on the exception being handled, if any)
        end_default_group(keep=self._monitor.started > self._monitor.completed)
        self._store = None
        _log.info("worker %d of %d left the job at %s", self.rank, self.world_size,
                  self.spec.where)
        # (failed collectives' exceptions, in cycles, may hold the group and the store)
        gc.collect()

    def __repr__(self) -> str:
        s = self.spec
        return (f"Job(backend={s.backend!r}, rank={s.rank}, world_size={s.world_size}, "
                f"master={s.where})")


@dataclasses.dataclass(frozen=True, slots=True)
class _Keys:
    store: Any  # the job's namespace of the store
    generation: int
    server: Any  # worker 0's store server (None elsewhere), held by the job alone


def _connect(spec: JobSpec, deadline: float, *, host: bool) -> Any:
    """A store server (``host``) or client at the job's address, within ``deadline``."""
    timeout = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
    if host:
        try:
            return _TCPStore(spec.master_addr, spec.master_port, spec.world_size,
                             is_master=True, timeout=timeout, wait_for_workers=False)
        except dist.DistError as error:
            raise StartupError(
                f"worker 0 cannot host the job's store at {spec.where}: the port is taken "
                f"(another job or program uses it; {error}). Pick a free MASTER_PORT") from error
    # Wait for a listener ourselves: torch's client logs an error for every retry.
    while True:
        try:
            with socket.create_connection((spec.master_addr, spec.master_port),
                                          timeout=max(0.05, min(1.0, deadline - time.monotonic()))):
                break
        except OSError:
            if time.monotonic() >= deadline:
                raise StartupError(
                    f"worker {spec.rank} of {spec.world_size}: nothing listens at {spec.where} "
                    f"after {spec.timeout_seconds:g} s: worker 0 (the chief) has not started, "
                    "or MASTER_ADDR/MASTER_PORT (or TF_CONFIG) is wrong", (0,)) from None
            time.sleep(_POLL)
    left = deadline - time.monotonic()
    try:
        return _bounded(lambda: _TCPStore(
            spec.master_addr, spec.master_port, spec.world_size, is_master=False,
            timeout=timeout, wait_for_workers=False), left + 1.0,
            f"worker {spec.rank} of {spec.world_size}: a program listens at {spec.where} but "
            f"did not answer as the job's store within {spec.timeout_seconds:g} s; another "
            "program holds the port. Pick a free MASTER_PORT")
    except dist.DistError as error:
        raise StartupError(f"worker {spec.rank} of {spec.world_size}: cannot reach the job's "
                           f"store at {spec.where} ({error})") from error


def _join(spec: JobSpec, facts: dict[str, int], deadline: float
          ) -> tuple[_Keys, list[dict[str, int]]]:
    """Reaches the store and meets every worker in this job's namespace."""
    base = f"mirrored/attempt-{spec.attempt}"
    while True:
        # Worker 0 hosts the store (unless torchrun's agent does) and, like every
        # worker, talks to it as a client: only the job holds the server, so the
        # port is free again when the job closes, even if something (a DDP model)
        # keeps the process group, and with it the client, alive.
        server = _connect(spec, deadline, host=True) if (
            spec.rank == 0 and not spec.agent_store) else None
        try:
            root = _PrefixStore(base, _connect(spec, deadline, host=False))
            if spec.rank == 0:
                generation = int(root.add("generation", 1))
                root.set("current", str(generation))
            else:
                generation = _current_generation(root, spec, deadline)
            keys = _Keys(_PrefixStore(f"job-{generation}", root), generation, server)
            return keys, _meet(keys.store, spec, facts, deadline)
        except (_Retry, *_STORE_ERRORS) as error:
            if isinstance(error, StartupError):
                raise
            if time.monotonic() >= deadline:
                raise StartupError(
                    f"worker {spec.rank} of {spec.world_size}: the job's store at "
                    f"{spec.where} went away during start-up and did not come back within "
                    f"{spec.timeout_seconds:g} s") from error
            server = None  # (worker 0 rebinds on the next try)
            time.sleep(_POLL)  # an ending job's store, or worker 0 restarting its store


def _current_generation(root: Any, spec: JobSpec, deadline: float) -> int:
    """The job worker 0 started last, once it is not one this rank already left."""
    while True:
        if root.check(["current"]):
            generation = int(root.get("current"))
            job = _PrefixStore(f"job-{generation}", root)
            beat = f"heartbeat/{spec.rank}"
            if not (job.check([beat]) and job.get(beat).startswith(b"exit")):
                return generation
        if time.monotonic() >= deadline:
            raise _Retry
        time.sleep(_POLL)


def _meet(store: Any, spec: JobSpec, facts: dict[str, int], deadline: float
          ) -> list[dict[str, int]]:
    """The rendezvous: every worker's ``{"world_size": ..., **facts}``, in rank order."""
    rank, world = spec.rank, spec.world_size

    def abort(message: str, workers: tuple[int, ...] = ()) -> StartupError:
        with contextlib.suppress(Exception):
            store.set("abort", message)
        return StartupError(message, workers)

    if int(store.add(f"rank/{rank}", 1)) > 1:
        raise abort(f"two workers claim rank {rank} at {spec.where}: RANK (or the TF_CONFIG "
                    "task index) is duplicated, or a second job uses the same "
                    "MASTER_PORT", (rank,))
    store.set(f"join/{rank}", json.dumps({"world_size": world, **facts}))
    joined: dict[int, dict[str, int]] = {}
    while True:
        if store.check(["abort"]):
            raise StartupError(store.get("abort").decode())
        for r in range(world):
            if r not in joined and store.check([f"join/{r}"]):
                joined[r] = json.loads(store.get(f"join/{r}"))
                if joined[r]["world_size"] != world:
                    raise abort(
                        f"workers disagree on the job's size: worker {rank} has {world} "
                        f"workers, worker {r} has {joined[r]['world_size']} (WORLD_SIZE or "
                        "TF_CONFIG's cluster differ); give every worker the same", (rank, r))
        if len(joined) == world:
            return [joined[r] for r in range(world)]
        if time.monotonic() >= deadline:
            missing = tuple(r for r in range(world) if r not in joined)
            raise StartupError(
                f"worker {rank} of {world}: worker(s) {', '.join(map(str, missing))} did not "
                f"join the job at {spec.where} within {spec.timeout_seconds:g} s; start every "
                "worker, or check MASTER_ADDR/MASTER_PORT or TF_CONFIG", missing)
        time.sleep(_POLL)
