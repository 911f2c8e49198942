"""The meeting point of a collective: every replica deposits an `Arrival`, the last
one checks the collective contract, combines, and releases the others.

Each arrival waits on a lock of its own (a fresh `_Slot`), so a wake-up can never
leak into a later wait, and every state change happens under one lock::

    open --(replica i arrives, not last)--> its slot waits
    open --(last replica arrives)--> completing --(every slot done, woken)--> open
    any  --(mismatch | timeout | a replica exits early or raises | abort)--> broken

*Broken* lasts until the run ends: every waiting slot is done with the failure and
woken, and every later call in the run raises at once. Each run has a generation;
a replica of an abandoned run (a straggler) that reaches a collective later is
refused, so it can never meet the replicas of the next run. Leaving a wait because
of an interrupt withdraws the slot (or marks it done) without waiting for anything.

In a *baton* run one replica runs at a time: an arrival that is not the last hands
the baton over before it waits (a completed replica resumes, else the executor
starts an unstarted one), the last one combines and goes on while the others'
wake-ups are deferred until it waits or returns. A break ends the baton.
While a profiler is active (checked once per run), each replica's wait and the
combine are `torch.profiler.record_function` ranges named
``mirrored.<collective> wait|combine [replica i] at <call site>``: in a trace, the
replicas that wait longest arrived first, and the combining one arrived last.
"""

from __future__ import annotations

import _thread
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import torch

from ..errors import CollectiveMismatchError, CollectiveTimeoutError, ReplicaAbortedError
from .contract import (
    Arrival,
    CollectiveFailure,
    Failure,
    Raise,
    Starter,
    early_exit_message,
    mismatch_message,
    outside_message,
    timeout_message,
)

__all__ = ["Rendezvous"]

_record = torch.autograd.profiler.record_function

SLICE = 0.1  # the longest untimed wait between checks for a pending interrupt

P = TypeVar("P")
R = TypeVar("R")


class _Slot:
    __slots__ = ("arrival", "done", "result", "wake")

    def __init__(self, arrival: Arrival[Any, Any]) -> None:
        self.arrival = arrival
        self.done = False
        self.result: Any = None
        self.wake = _thread.allocate_lock()
        self.wake.acquire()


class Rendezvous:
    """Synchronizes the collectives of one strategy's replicas; see the module docstring.

    Args:
        labels: how messages name each replica (``"replica 0 (CPU:0)"``).
        on_timeout: called (under the lock) with the timeout when a collective times
            out, so the caller of ``run`` stops waiting for a replica that may be stuck.
    """

    def __init__(self, labels: Sequence[str],
                 on_timeout: Callable[[float], None] | None = None,
                 starter: Starter | None = None) -> None:
        self._labels = tuple(labels)
        self._n = len(self._labels)
        self._on_timeout = on_timeout
        self._starter = starter
        self._lock = threading.Lock()
        # Baton runs: slots whose wake-up is deferred, the caller's thread, hand-overs.
        self._baton = False
        self._deferred: list[_Slot] = []
        self._caller = 0
        self.progress = 0
        self._generation = 0
        self._combine_threads: int | None = None
        self._profiling = False
        self._active = False
        self._round: list[_Slot | None] = [None] * self._n
        self._count = 0
        self._completing: tuple[_Slot, ...] = ()
        self._completer = 0
        self._exited = [False] * self._n
        self._broken: Failure | None = None

    def start(self, combine_threads: int | None = None, profiling: bool = False,
              baton: bool = False) -> int:
        """Starts a new run; returns its generation. ``combine_threads``: the intra-op
        thread count the combining replica uses (everyone else waits meanwhile);
        ``profiling``: record profiler ranges for this run's waits and combines;
        ``baton``: one replica runs at a time (see `_hand_over_locked`)."""
        with self._lock:
            self._combine_threads = combine_threads
            self._profiling = profiling
            self._baton = baton
            self._caller = threading.get_ident()
            self.progress += 1
            self._generation = generation = self._generation + 1
            self._active = True
            if self._count or self._deferred or self._completing:  # (finish leaves them
                self._round = [None] * self._n  # empty unless a run was interrupted)
                self._count = 0
                self._deferred = []
                self._completing = ()
            self._exited = [False] * self._n
            self._broken = None
            return generation

    def finish(self) -> None:
        """Ends the current run: later calls from its replicas are refused."""
        with self._lock:
            self._active = False
            self._baton = False
            if self._count:
                self._round = [None] * self._n
            if self._deferred:
                self._release_deferred_locked()

    # ------------------------------------------------------------- baton
    def _hand_over_locked(self) -> None:
        """The replica holding the baton waits at a collective or returned: the next one
        runs. A replica whose collective completed resumes first (its deferred wake-up),
        else an unstarted replica starts on its thread (when the caller of run returned
        from a replica it runs the unstarted ones itself: `replica_exited`)."""
        self.progress += 1
        starter = self._starter
        if self._deferred:
            self._deferred.pop(0).wake.release()
        elif starter is not None:
            starter.start_next(wake=True)

    def _release_deferred_locked(self) -> None:
        deferred, self._deferred = self._deferred, []
        for slot in deferred:
            slot.wake.release()

    def in_baton(self) -> bool:  # whether the run in flight is (still) a baton run
        return self._baton

    def baton_state(self) -> tuple[bool, int]:
        """Whether a baton run is in flight, and the count of hand-overs (`Watchdog`)."""
        return self._baton and self._active, self.progress

    def concurrent(self) -> None:
        """Ends the baton of the current run: every replica runs from now on (the
        watchdog saw no hand-over for a while; also on a break, or at a collective
        with a timeout, which measures how late the others are)."""
        with self._lock:
            if self._concurrent_locked() and self._starter is not None:
                self._starter.start_all()

    def _concurrent_locked(self) -> bool:
        if not self._baton:
            return False
        self._baton = False
        self._release_deferred_locked()
        return True

    # ----------------------------------------------------------- exchange
    def exchange(self, generation: int, index: int, arrival: Arrival[P, R],
                 timeout: float | None) -> R:
        """Deposits ``arrival`` for replica ``index`` and returns its result once every
        replica arrived.

        Raises:
            CollectiveMismatchError: the calls differ, or a replica returned from its
                function while others wait.
            CollectiveTimeoutError: not every replica arrived within ``timeout``.
            ReplicaAbortedError: another replica raised, or ``run`` was interrupted.
            RuntimeError: called outside ``run`` or from an abandoned run.
        """
        with self._lock:
            if not self._active or generation != self._generation:
                raise RuntimeError(outside_message(
                    arrival, abandoned=self._active and generation != 0))
            if self._broken is not None:
                raise self._broken.error()
            if True in self._exited:
                exited = [j for j in range(self._n) if self._exited[j]]
                waiting = {j: s.arrival for j, s in enumerate(self._round) if s is not None}
                message = early_exit_message(self._labels, exited, {**waiting, index: arrival})
                self._break_locked(CollectiveMismatchError, message)
                raise CollectiveMismatchError(message)
            if self._completing and self._completer == threading.get_ident():
                raise RuntimeError(
                    f"{arrival.title} at {arrival.site} was called while combining another "
                    "collective (from a merge_fn?); collectives, and backward passes through "
                    "them, cannot run inside a merge_fn")
            slot = _Slot(arrival)
            self._round[index] = slot
            self._count += 1
            last = self._count == self._n
            if last:
                slots = cast("tuple[_Slot, ...]", tuple(self._round))  # (count == n: all)
                self._round = [None] * self._n
                self._count = 0
                self._completing = slots
                self._completer = threading.get_ident()
            elif self._baton:
                if timeout is None:
                    self._hand_over_locked()
                elif self._concurrent_locked() and self._starter is not None:
                    self._starter.start_all()  # a timeout measures the others' lateness
        if not self._profiling:
            if last:
                self._complete(index, slots)
            else:
                self._wait(slot, timeout)
        else:
            phase = "combine" if last else "wait"
            with _record(f"mirrored.{arrival.title} {phase} [replica {index}] at {arrival.site}"):
                if last:
                    self._complete(index, slots)
                else:
                    self._wait(slot, timeout)
        result: R = _take(slot)
        return result

    def _complete(self, index: int, slots: tuple[_Slot, ...]) -> None:
        results: Sequence[Any]
        interrupt: BaseException | None = None
        try:
            key = slots[0].arrival.call.key
            message = None
            for s in slots:
                if s.arrival.call.key != key:
                    message = mismatch_message([s.arrival.call for s in slots], self._labels)
                    break
            if message is not None:
                results = [Failure(CollectiveMismatchError, message)] * self._n
            else:
                results = self._combine(slots)
        except CollectiveFailure as failure:  # raised in every replica
            message = None
            results = [failure.failure] * self._n
        except Exception as error:  # delivered to replica 0, whose call it was
            message = None
            aborted = Failure(ReplicaAbortedError, (
                f"{slots[0].arrival.title} at {slots[0].arrival.site} failed in replica 0 "
                f"with {type(error).__name__}: {error}"))
            results = [Raise(error), *([aborted] * (self._n - 1))]
        except BaseException as error:  # an interrupt on this (the caller's) thread
            message = None
            interrupt = error
            results = [Failure(ReplicaAbortedError, "released because strategy.run was "
                               "interrupted")] * self._n
        with self._lock:
            if message is not None:
                self._break_locked(CollectiveMismatchError, message)
            broken = self._broken if message is None else None
            for j, slot in enumerate(slots):
                if slot.done:
                    continue  # abandoned, or already failed by an abort
                slot.result = broken if broken is not None else results[j]
                slot.done = True
                if j != index:
                    if self._baton:  # it resumes when this replica hands the baton over
                        self._deferred.append(slot)
                    else:
                        slot.wake.release()
            self._completing = ()
        if interrupt is not None:
            raise interrupt

    def _combine(self, slots: tuple[_Slot, ...]) -> Sequence[Any]:
        combine = slots[0].arrival.combine
        payloads = [s.arrival.payload for s in slots]
        threads, previous = self._combine_threads, torch.get_num_threads()
        if threads is None or threads == previous:
            return combine(payloads)
        torch.set_num_threads(threads)
        try:
            return combine(payloads)
        finally:
            torch.set_num_threads(previous)

    def _wait(self, slot: _Slot, timeout: float | None) -> None:
        try:
            if timeout is None:  # in slices, so that _thread.interrupt_main() is seen
                while not slot.wake.acquire(timeout=SLICE):
                    pass
                return
            deadline = time.monotonic() + timeout
            while True:  # in slices too
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if slot.wake.acquire(timeout=min(SLICE, left)):
                    return
            with self._lock:
                if slot.done:
                    slot.wake.acquire(False)
                    return
                if slot not in self._completing:
                    arrived = [s is not None for s in self._round]
                    self._break_locked(CollectiveTimeoutError, timeout_message(
                        slot.arrival, timeout, self._labels, arrived))
                    if self._on_timeout is not None and timeout is not None:
                        self._on_timeout(timeout)
                    slot.wake.acquire(False)
                    return
            while not slot.wake.acquire(timeout=SLICE):  # every replica arrived: the
                pass  # completer delivers soon (slices: interrupt_main is seen promptly)
        except BaseException:  # an interrupt: leave without waiting for anything
            with self._lock:
                if not slot.done:
                    for j, waiting in enumerate(self._round):
                        if waiting is slot:
                            self._round[j] = None
                            self._count -= 1
                    slot.done = True
                    slot.result = None
            raise

    def abort(self, message: str) -> None:
        """Breaks the current run (``run`` was interrupted or gave up on a replica):
        every waiting replica, including those whose collective is being combined,
        is released with `ReplicaAbortedError`."""
        with self._lock:
            self._break_locked(ReplicaAbortedError, message)
            failure = self._broken
            for slot in self._completing:
                if not slot.done:
                    slot.result = failure
                    slot.done = True
                    slot.wake.release()

    def _break_locked(self, error_type: type[BaseException], message: str) -> None:
        if self._broken is not None:
            return
        self._broken = Failure(error_type, message)
        if self._concurrent_locked() and self._starter is not None:
            self._starter.start_all()  # every replica runs to its end now
        for j, slot in enumerate(self._round):
            if slot is not None:
                self._round[j] = None
                if not slot.done:
                    slot.result = self._broken
                    slot.done = True
                    slot.wake.release()
        self._count = 0

    # ------------------------------------------------------- replica exits
    def replica_exited(self, generation: int, index: int, error: BaseException | None) -> None:
        """Replica ``index`` of run ``generation`` returned (``error=None``) or raised."""
        with self._lock:
            if generation != self._generation or not self._active:
                return  # a straggler of an abandoned run
            self._exited[index] = True
            if self._baton and error is None:
                starter = self._starter
                if starter is not None and threading.get_ident() == self._caller:
                    # The caller claims the next unstarted replica itself (no wake-up);
                    # with none left, a deferred replica resumes.
                    self.progress += 1
                    if self._deferred and not starter.start_next(wake=False):
                        self._deferred.pop(0).wake.release()
                else:
                    self._hand_over_locked()
            if self._broken is not None or (error is None and not self._count):
                return
            waiting = {j: s.arrival for j, s in enumerate(self._round) if s is not None}
            if error is not None:
                self._break_locked(ReplicaAbortedError, (
                    f"released from a collective because {self._labels[index]} raised "
                    f"{type(error).__name__}: {error}"))
            elif waiting:
                self._break_locked(CollectiveMismatchError,
                                   early_exit_message(self._labels, [index], waiting))


def _take(slot: _Slot) -> Any:
    result = slot.result
    slot.result = None
    slot.arrival = None  # type: ignore[assignment]  # free the payload
    if isinstance(result, Failure):
        raise result.error()
    if isinstance(result, Raise):
        raise result.error
    return result
