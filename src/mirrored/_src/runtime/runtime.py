"""The runtime of a strategy: run one callable per local replica, let replicas meet
at collectives, abort. One object per strategy owns the executor (threads), the
rendezvous (meetings), the propagation of the caller's thread state and the
replicas' random streams.

`ThreadRuntime` runs replicas concurrently on persistent threads (replica 0 on
the caller's thread, unless the strategy has a collective timeout: then every
replica has a thread, so ``run`` returns even if replica 0 is stuck);
`InlineRuntime` (the default strategy's) calls its one replica directly on the
caller's thread, under the caller's device.

Per ``run`` the common case (a CPU caller with torch's default thread state, no
torch mode active, no profiler) reads a handful of thread-local flags, takes the
run lock and hands one small `RunCall` to the executor: no thread-state snapshot is
taken, nothing is entered on the caller's thread, and a replica thread only sets
its intra-op thread count. With a profiler active, ``run`` and each replica's
function are `torch.profiler.record_function` ranges.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar, final

import torch

from ..comm.buffers import default_pool
from ..devices import current_device, default_device_set
from ..errors import ReplicaAbortedError
from ..topology import Topology
from . import compiled_kernels
from .contract import Arrival, CollectiveFailure
from .executor import Executor, ReplicaAbandoned, ReplicaFailure
from .random import RandomStreams, drop_stale_modes
from .rendezvous import Rendezvous
from .replica_call import RunCall, add_note, fn_name, on_device, profiling, record
from .thread_state import capture, plain_thread, refused_modes
from .watchdog import Watchdog

__all__ = ["InlineRuntime", "Runtime", "ThreadRuntime"]

P = TypeVar("P")
R = TypeVar("R")

GRACE_SECONDS = 0.5  # how long run waits for the others once a run is given up
MISUSE_SECONDS = 2.0  # how long run waits for another run of the same strategy
BATON_SECONDS = 1e-3  # a run after one of the last two was shorter is a baton run

_HOST = torch.device("cpu")
_function_modes = torch._C._len_torch_function_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack


class Runtime(Protocol):
    """What strategies and collectives need from a runtime."""

    @property
    def caller_device(self) -> torch.device:
        """The current device of the caller of the ``run`` in progress."""
        ...

    @property
    def caller_default(self) -> bool:
        """Whether the caller of the ``run`` in progress set a default device (the
        replicas' devices then replace it: `replica_call.on_device`)."""
        ...

    def run(self, call: Callable[[int], Any], fn: Callable[..., Any] | None = None) -> list[Any]:
        """Runs ``call(i)`` for every local replica ``i`` and returns the results in
        order, or raises the first replica's exception (with a note naming it).
        ``fn``: the user's function, named in profiler ranges."""
        ...

    def generation(self) -> int:
        """The run this thread serves as a replica (0: none). A collective's backward
        pass, which torch runs on its autograd thread of a CUDA device, not on the
        replica's, gives its forward's to `exchange`."""
        ...

    def exchange(self, index: int, arrival: Arrival[P, R], timeout: float | None,
                 generation: int | None = None) -> R:
        """Local replica ``index`` meets the others at a collective (of run
        ``generation`` where this thread serves none: a backward pass on torch's
        autograd thread of a CUDA device)."""
        ...

    def close(self) -> None:
        """Stops the replica threads."""
        ...


def _complete_alone(arrival: Arrival[P, R]) -> R:
    """A collective of one replica: combine its own payload."""
    try:
        return arrival.combine([arrival.payload])[0]
    except CollectiveFailure as failure:
        raise failure.failure.error() from None


_runtimes: weakref.WeakSet[ThreadRuntime] = weakref.WeakSet()
_ONE_ROW = "Expected more than 1 value per channel when training"  # (torch's BatchNorm)


@final
class ThreadRuntime:
    """Replicas on persistent threads; see the module docstring.

    Args:
        topology: the strategy's replicas (local devices, labels).
        name: the strategy's class name, for thread names and error notes.
        timeout_seconds: the strategy's collective timeout, if any.
        per_replica_random: give the replicas random streams of their own for CPU draws.
    """

    def __init__(self, topology: Topology, name: str, *, timeout_seconds: float | None = None,
                 per_replica_random: bool = True) -> None:
        self._topology = topology
        self._name = name
        self._n = topology.num_local_replicas
        self._timeout = timeout_seconds
        self._straggler_wait = timeout_seconds or GRACE_SECONDS
        self._local = threading.local()  # .generation: the run a replica thread serves
        self._split_threads = self._n > 1 and all(d.kind == "CPU" for d in topology.devices)
        if self._split_threads:  # (compiled steps' CPU kernels: see compiled_kernels.py)
            compiled_kernels.release_gil()
        self._host_only = all(d == _HOST for d in topology.torch_devices)
        self._baton = self._split_threads and timeout_seconds is None
        # (CPU draws only: a GPU replica's draws on its device use the device's generator,
        # and a factory without a device draws on the CPU: see `on_device`). Streams
        # whenever the job has several replicas, also one per worker: replica g draws
        # what it draws wherever it runs (2 workers of 1 replica as 1 worker of 2), not
        # the masks of a worker seeded alike.
        self._streams = RandomStreams(topology.replica_ids) if (
            per_replica_random and topology.num_replicas_in_sync > 1) else None
        self._pool = default_pool()
        self._pool.retain()
        self._closed = False
        self._reset()
        _runtimes.add(self)

    def _reset(self) -> None:
        executor = Executor(self._topology.labels, self._name,
                            caller_runs=self._timeout is None)
        self._executor = executor
        rendezvous = Rendezvous(self._topology.labels, on_timeout=executor.timed_out,
                                starter=executor)
        self._rendezvous = rendezvous
        self._watchdog = Watchdog(rendezvous.baton_state, rendezvous.concurrent, self._name)
        self._last_seconds = (0.0, 0.0)  # the wall times of the previous two runs
        # An RLock knows its owner: an interrupt between acquiring it and entering the
        # try that releases it leaves it owned by the caller's thread, which takes it
        # back on its next run; no other thread ever releases it.
        self._run_lock = threading.RLock()
        self._caller_device = torch.device("cpu")
        self._caller_default = False
        self._several = self._topology.num_replicas_in_sync > 1
        self._one_running = False  # `_run_one` of one local replica of several in all
        self._running = False
        self._full_threads = torch.get_num_threads()

    @property
    def caller_device(self) -> torch.device:
        return self._caller_device

    @property
    def caller_default(self) -> bool:
        return self._caller_default

    def run(self, call: Callable[[int], Any], fn: Callable[..., Any] | None = None) -> list[Any]:
        if self._n == 1:
            if profiling():
                with record(f"mirrored.run: {fn_name(fn)}"):
                    return [self._run_one(call)]
            return [self._run_one(call)]
        function_modes = _function_modes()
        if function_modes or _dispatch_modes():
            drop_stale_modes()
            modes = refused_modes()
            if modes:
                raise RuntimeError(
                    f"{self._name}.run cannot carry {', '.join(modes)} into its replica "
                    "threads (one mode object cannot be active on several threads); enter "
                    "it inside the step function instead")
        full = torch.get_num_threads()
        # N logical CPU replicas share the caller's intra-op budget: each runs with
        # get_num_threads() // N threads (at least 1), whichever thread runs it.
        threads = max(1, full // self._n) if self._split_threads else full
        state = None if plain_thread() else capture()
        profiled = profiling()
        # (a `torch.device` context is a function mode: none, and the caller is on the host)
        caller_device = current_device() if function_modes else _HOST
        run = RunCall(call, fn, self._local, self._topology.torch_devices, self._streams,
                      threads, state, caller_device, bool(function_modes),
                      profiled, not profiled and self._host_only and caller_device == _HOST)
        if profiled:
            with record(f"mirrored.run: {fn_name(fn)}"):
                return self._run(run, full)
        return self._run(run, full)

    def _run(self, run: RunCall, full: int) -> list[Any]:
        lock = self._run_lock
        if lock._is_owned() or not lock.acquire(False):  # type: ignore[attr-defined]
            self._acquire_run_lock()  # (the slow path: taken back, waited for, or refused)
        try:
            self._running = True
            self._full_threads = full
            self._caller_device = run.caller_device
            self._caller_default = run.caller_default
            rendezvous = self._rendezvous
            # Everyone else waits while one replica combines: it may use the caller's
            # whole intra-op thread budget for that.
            # A baton run (one replica at a time, threads woken only when one waits at a
            # collective) when the previous run was short: see docs/design.md.
            last = self._last_seconds
            baton = self._baton and (last[0] < BATON_SECONDS or last[1] < BATON_SECONDS)
            if baton:
                self._watchdog.arm()
            start = time.perf_counter()
            generation = run.generation = rendezvous.start(
                full if self._split_threads else None, run.profiling, baton)
            if run.threads != full:
                torch.set_num_threads(run.threads)  # for the replicas run on this thread
            try:
                if self._streams is not None:
                    self._streams.start_run()
                results, failures = self._executor.run(
                    run.replica, functools.partial(rendezvous.replica_exited, generation),
                    rendezvous.abort, grace=GRACE_SECONDS, straggler_wait=self._straggler_wait,
                    baton=rendezvous.in_baton if baton else None)
            finally:
                if self._streams is not None:
                    self._streams.finish_run()
                rendezvous.finish()
                self._last_seconds = (self._last_seconds[1], time.perf_counter() - start)
        finally:
            self._running = False
            self._run_lock.release()
            # Undo what an interrupt may have left half-entered on this thread.
            if _function_modes():
                drop_stale_modes()
            if torch.get_num_threads() != full:
                torch.set_num_threads(full)
        if failures:
            raise self._failure_error(failures)
        return results

    def _run_one(self, call: Callable[[int], Any]) -> Any:
        # One local replica runs right here, on the caller's thread and state.
        caller_device = current_device()
        self._caller_device = caller_device
        self._caller_default = default = default_device_set()
        device = self._topology.torch_devices[0]
        streams = self._streams  # (one replica of a job of several: its stream, as in-process)
        if streams is not None:
            streams.start_run()
        try:
            self._one_running = self._several  # (one replica of a job of several workers)
            if device == caller_device and device.type == "cpu":
                return call(0) if streams is None else streams.call(0, call)
            with on_device(device, default):
                return call(0) if streams is None else streams.call(0, call)
        except Exception as error:
            add_note(error, self._note(0, error))
            raise
        finally:
            self._one_running = False
            if streams is not None:
                streams.finish_run()

    def _acquire_run_lock(self) -> None:
        lock = self._run_lock
        if lock._is_owned():  # type: ignore[attr-defined]  # (what threading.Condition uses)
            if not self._running:
                # This thread holds it but runs nothing (nested runs are refused before
                # this): an interrupt landed right after an earlier run acquired it.
                return
        elif lock.acquire(timeout=MISUSE_SECONDS):
            return
        raise RuntimeError(
            f"{self._name}.run waited {MISUSE_SECONDS:g} s for another run of the same strategy "
            "to finish. If this thread was started inside a step function, that run waits "
            "for this thread and this thread for that run: a deadlock. Call collectives and "
            "run only from the replica functions themselves (or use one strategy per thread)")

    def generation(self) -> int:
        return getattr(self._local, "generation", 0)

    def exchange(self, index: int, arrival: Arrival[P, R], timeout: float | None,
                 generation: int | None = None) -> R:
        if self._n == 1:
            return _complete_alone(arrival)
        # The thread's own run wins (a backward pass in a later run, of a graph built in
        # an earlier one); the forward's only on a thread that serves none (torch's
        # autograd thread of a CUDA device).
        own = getattr(self._local, "generation", 0)
        if not own and generation and self._running and (
                generation != self._rendezvous._generation):  # (the current run's)
            raise RuntimeError(
                f"{arrival.title} at {arrival.site} was reached by a backward pass for "
                f"{self._topology.labels[index]} on a thread that runs no replica (torch's "
                "autograd thread of a CUDA device), through a collective of an earlier "
                f"{self._name}.run (run {generation}; run {self._rendezvous._generation} "
                "is in progress), whose replicas are gone. Call backward() in the run "
                "that made the forward pass")
        return self._rendezvous.exchange(own or generation or 0, index, arrival, timeout)

    def close(self) -> None:
        if self._running and not getattr(self._local, "generation", 0):
            raise RuntimeError(
                f"{self._name}.close was called from a thread that is not a replica while a "
                "run is in progress (e.g. a thread started inside the step function); close "
                "the strategy after run returns")
        self._executor.close()
        self._watchdog.stop()
        if not self._closed:
            self._closed = True
            self._pool.release()  # emptied once no open strategy uses it

    def _note(self, index: int, error: BaseException | None = None) -> str:
        note = f"raised in {self._topology.labels[index]} of {self._name}.run"
        if (isinstance(error, ValueError) and self._topology.num_replicas_in_sync > 1
                and str(error).startswith(_ONE_ROW)):
            note += (f". Each replica gets its rows of the global batch; {_ONE_ROW} "
                     "is BatchNorm's refusal of a shard of one row, which it normalizes alone "
                     "(a global batch smaller than 2 rows per replica, or a partial last "
                     "batch), where one device normalizes the whole batch: mirror the model "
                     "with sync_batch_norm=True (global-batch statistics), or drop the "
                     "partial batch (drop_last=True)")
        return note

    def _failure_error(self, failures: Sequence[ReplicaFailure]) -> BaseException:
        # An interrupt first; then the root cause, not a replica released because of
        # it; ties by replica id.
        interrupts = [f for f in failures if not isinstance(f.error, Exception)]
        causes = interrupts or [f for f in failures if not isinstance(
            f.error, ReplicaAbortedError | ReplicaAbandoned)] or [
            f for f in failures if not isinstance(f.error, ReplicaAbortedError)]
        failure = min(causes or failures, key=lambda f: f.replica_id)
        add_note(failure.error, self._note(failure.replica_id, failure.error))
        return failure.error


def runs_in_flight(with_streams: bool = False) -> bool:
    """Whether a run of some strategy with several replicas in all is in progress in
    this process (``with_streams``: of one whose replicas have random streams). Read
    only on rare paths (a backward pass on a thread that runs no replica); flags, not
    a count, so an interrupt cannot leave it stuck."""
    for runtime in list(_runtimes):
        if with_streams and runtime._streams is None:
            continue
        if (runtime._running and runtime._n > 1) or runtime._one_running:
            return True
    return False


def _after_fork_in_child() -> None:
    # Threads do not survive a fork: give every runtime fresh threads, locks and state.
    for runtime in list(_runtimes):
        runtime._executor.reset_after_fork()
        runtime._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@final
class InlineRuntime:
    """The default strategy's runtime: its one replica is the caller itself."""

    @property
    def caller_device(self) -> torch.device:
        return current_device()

    @property
    def caller_default(self) -> bool:
        return default_device_set()

    def run(self, call: Callable[[int], Any], fn: Callable[..., Any] | None = None) -> list[Any]:
        return [call(0)]

    def generation(self) -> int:
        return 0

    def exchange(self, index: int, arrival: Arrival[P, R], timeout: float | None,
                 generation: int | None = None) -> R:
        return _complete_alone(arrival)

    def close(self) -> None:
        """Nothing to stop."""
