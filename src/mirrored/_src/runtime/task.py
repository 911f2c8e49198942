"""One ``run``'s claims and results (`Task`), and the persistent replica threads that
serve them (`Worker`); the `Executor` drives both (see its module docstring).

Each replica of a task is claimed exactly once, by the caller's thread or by its
own worker thread (`Task.claim`, under the task's lock); the last replica to finish
signals the caller. A worker thread sleeps on its ``wake`` lock between tasks and
holds a task only while running it.
"""

from __future__ import annotations

import _thread
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["SLICE", "STOP", "ReplicaFailure", "Task", "Worker"]

STOP = object()
SLICE = 0.1  # the longest untimed wait on the caller's thread between interrupt checks
IDLE_POLL = 0.002  # `Worker.wait_idle`: how often a straggler's thread is looked at


class ReplicaFailure:
    """An exception raised by one replica, with the replica's index."""

    __slots__ = ("error", "replica_id")

    def __init__(self, replica_id: int, error: BaseException) -> None:
        self.replica_id = replica_id
        self.error = error


class Task:
    """One run's calls: who claimed each replica, results, failures, the done signal."""

    __slots__ = ("_done", "_finished", "_lock", "_remaining", "_signaled", "call", "failures",
                 "on_exit", "owners", "results")

    def __init__(self, call: Callable[[int], Any], n: int,
                 on_exit: Callable[[int, BaseException | None], None]) -> None:
        self.call: Callable[[int], Any] | None = call
        self.on_exit = on_exit
        self.results: list[Any] = [None] * n
        self.failures: list[ReplicaFailure] = []
        # Who claimed each replica ("caller", "worker", "cancelled"); written only by
        # `claim` and `settle_caller` under the lock, read without it elsewhere.
        self.owners: list[str | None] = [None] * n
        self._finished = [False] * n
        self._remaining = n
        self._lock = _thread.allocate_lock()
        self._done = _thread.allocate_lock()
        self._done.acquire()
        self._signaled = False

    def claim(self, index: int, owner: str) -> bool:
        with self._lock:
            if self.owners[index] is not None:
                return False
            self.owners[index] = owner
            return True

    def execute(self, index: int) -> None:
        error: BaseException | None = None
        try:
            call = self.call
            if call is not None:
                self.results[index] = call(index)
        except BaseException as e:  # re-raised by the caller of Executor.run
            error = e
            with self._lock:
                self.failures.append(ReplicaFailure(index, e))
        finally:
            try:
                self.on_exit(index, error)
            finally:
                with self._lock:  # (`_finish_locked`, inlined: this runs for every replica)
                    if not self._finished[index]:
                        self._finished[index] = True
                        self._remaining -= 1
                        if self._remaining == 0:
                            self._signal_locked()

    def _finish_locked(self, index: int) -> None:
        if not self._finished[index]:
            self._finished[index] = True
            self._remaining -= 1
            if self._remaining == 0:
                self._signal_locked()

    def _signal_locked(self) -> None:
        if not self._signaled:
            self._signaled = True
            self._done.release()

    def signal(self) -> None:
        """Wakes the caller's wait (the rendezvous broke)."""
        with self._lock:
            self._signal_locked()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until every replica finished (``True``), a signal, or the timeout.

        An untimed wait sleeps in slices of `SLICE` seconds, so that an interrupt that
        only sets Python's signal flag (``_thread.interrupt_main()``) is seen promptly."""
        if timeout is None:
            while not self._done.acquire(timeout=SLICE):
                pass
            if self._remaining == 0:  # (it only decreases: a read without the lock)
                return True
        else:
            self._done.acquire(timeout=max(timeout, 0.0))
        return self.rearm()

    def rearm(self) -> bool:
        """``True`` if every replica finished; else makes the next signal count."""
        with self._lock:
            if self._remaining == 0:
                return True
            self._done.acquire(False)  # consume a pending signal, if any
            self._signaled = False
            return False

    def settle_caller(self) -> None:
        """After an interrupt of the caller: its own replicas are no longer running and
        replicas nobody claimed never will."""
        with self._lock:
            for i, owner in enumerate(self.owners):
                if owner is None:
                    self.owners[i] = "cancelled"
                    self._finish_locked(i)
                elif owner == "caller":
                    self._finish_locked(i)

    def unclaimed(self, index: int) -> bool:
        return self.owners[index] is None  # a read: claim decides under the lock

    def claimed_by_worker(self, index: int) -> bool:
        with self._lock:
            return self.owners[index] == "worker"

    def fail(self, index: int, error: BaseException) -> None:
        with self._lock:
            self.failures.append(ReplicaFailure(index, error))

    def unfinished(self) -> list[int]:
        with self._lock:
            return [i for i, done in enumerate(self._finished) if not done]

    def has_interrupt(self) -> bool:
        if not self.failures:  # the common case, read without the lock
            return False
        with self._lock:
            return any(not isinstance(f.error, Exception) for f in self.failures)


class Worker:
    """A persistent replica thread and what it is asked to run next."""

    __slots__ = ("busy", "index", "running", "task", "thread", "wake")

    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.task: object = None
        self.busy = False  # running a task (nothing to set per task but this flag)
        self.wake = _thread.allocate_lock()
        self.wake.acquire()
        self.thread = threading.Thread(target=loop, args=(self,),
                                       name=f"{name}-replica-{index}", daemon=True)
        self.thread.start()

    def wait_idle(self, timeout: float) -> None:
        """Waits at most ``timeout`` seconds until the thread is not running a task.

        Polls ``busy`` (only after an abandoned run): holding nothing, an interrupt here
        can leave no lock taken that the thread's next task would wait for."""
        deadline = time.monotonic() + timeout
        while self.busy and time.monotonic() < deadline:
            time.sleep(IDLE_POLL)

    def publish(self, task: object) -> None:
        self.task = task
        # Only one thread at a time releases `wake` (the executor's caller at the start
        # of a run or at close; in a baton run, whoever hands the baton over, under the
        # rendezvous lock), so `locked()` cannot turn False underneath us: either the
        # worker has a pending wake (it will read the task published above), or we give
        # it one.
        if self.wake.locked():
            self.wake.release()


def loop(worker: Worker) -> None:
    # A plain function over the worker (not a method of the executor), holding the
    # task only while running it: an idle thread pins no strategy, closure or result.
    wake = worker.wake
    while True:
        wake.acquire()
        task = worker.task
        if task is STOP:
            return
        if isinstance(task, Task) and task.claim(worker.index, "worker"):
            worker.busy = True
            try:
                task.execute(worker.index)
            finally:
                worker.busy = False
        task = None
