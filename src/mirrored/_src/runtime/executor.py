"""The only module with threads: runs one call per replica, concurrently.

An `Executor` owns ``N - 1`` persistent daemon threads, started on first use.
Each ``run`` is a `_Task` with one *claim* per replica::

    caller thread                      replica thread i (i >= 1)
    -------------                      -------------------------
    publish task, wake threads  ---->  wake (lock released)
    claim 0, run replica 0             claim i? -- yes --> run replica i
    claim 1..N-1 not yet claimed,                  no ---> sleep again
      run them here ("steal")          last replica to finish releases `done`
    wait on `done` (if not last)
    return results in replica order

Replica 0 runs on the calling thread, and a replica whose thread has not woken
up by the time the caller is free runs on the caller too. Waking a blocked
thread costs tens of microseconds on a small machine, so a trivial step never
waits for a wake-up; a long step runs on all threads at once. Stealing is safe
for collectives: the caller steals only after replica 0 has returned, and a
collective needs every replica at once, so a replica that reaches one while
replica 0 is finished fails with a mismatch either way.

States of a worker: blocked on ``_wake`` -> running (claimed replica or nothing)
-> blocked. ``close()`` publishes ``_STOP``, wakes it and joins it: it exits.
"""

from __future__ import annotations

import _thread
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Executor", "ReplicaFailure"]

_STOP = object()


class ReplicaFailure:
    """An exception raised by one replica, with the replica's id."""

    __slots__ = ("error", "replica_id")

    def __init__(self, replica_id: int, error: BaseException) -> None:
        self.replica_id = replica_id
        self.error = error


class _Task:
    __slots__ = ("_claimed", "_done", "_lock", "_remaining", "call", "failures", "on_exit",
                 "results")

    def __init__(self, call: Callable[[int], Any], n: int,
                 on_exit: Callable[[int, BaseException | None], None] | None) -> None:
        self.call = call
        self.on_exit = on_exit
        self.results: list[Any] = [None] * n
        self.failures: list[ReplicaFailure] = []
        self._claimed = [False] * n
        self._remaining = n
        self._lock = _thread.allocate_lock()
        self._done = _thread.allocate_lock()
        self._done.acquire()

    def claim(self, index: int) -> bool:
        with self._lock:
            if self._claimed[index]:
                return False
            self._claimed[index] = True
            return True

    def execute(self, index: int) -> None:
        error: BaseException | None = None
        try:
            self.results[index] = self.call(index)
        except BaseException as e:  # re-raised by the caller of Executor.run
            error = e
            with self._lock:
                self.failures.append(ReplicaFailure(index, e))
        finally:
            if self.on_exit is not None:
                self.on_exit(index, error)
            with self._lock:
                self._remaining -= 1
                last = self._remaining == 0
            if last:
                self._done.release()

    def wait(self, timeout: float = -1) -> bool:
        return self._done.acquire(timeout=timeout)


class _Worker:
    __slots__ = ("index", "task", "thread", "wake")

    def __init__(self, index: int, name: str) -> None:
        self.index = index
        self.task: object = None
        self.wake = _thread.allocate_lock()
        self.wake.acquire()
        self.thread = threading.Thread(target=self._loop, name=f"{name}-replica-{index}",
                                       daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        wake = self.wake
        while True:
            wake.acquire()
            task = self.task
            if task is _STOP:
                return
            if isinstance(task, _Task) and task.claim(self.index):
                task.execute(self.index)

    def publish(self, task: object) -> None:
        self.task = task
        # Only this executor's caller releases `wake`, so `locked()` cannot change to
        # False underneath us: either the worker still has a pending wake (it will read
        # the task published above), or we give it one.
        if self.wake.locked():
            self.wake.release()


class Executor:
    """Runs ``call(i)`` for every replica ``i`` concurrently; see the module docstring.

    Args:
        num_replicas: how many replicas each `run` has.
        name: prefix of the thread names.
    """

    def __init__(self, num_replicas: int, name: str = "mirrored") -> None:
        self._n = num_replicas
        self._name = name
        self._workers: list[_Worker] = []
        self._run_lock = threading.Lock()
        self._closed: str | None = None

    def run(self, call: Callable[[int], Any],
            on_exit: Callable[[int, BaseException | None], None] | None = None,
            on_interrupt: Callable[[], None] | None = None,
            ) -> tuple[list[Any], list[ReplicaFailure]]:
        """Runs ``call(i)`` for ``i`` in ``range(N)`` and waits for all of them.

        ``on_exit(i, error)`` is called on replica ``i``'s thread right after its call
        returns or raises. Returns the results in replica order and the failures in
        the order they happened; exceptions are not raised here, except one that
        interrupts the wait (KeyboardInterrupt): then ``on_interrupt()`` releases the
        replicas from their collectives, and the executor waits for them to return
        (or, after 10 s, refuses further runs) before re-raising, so no replica of an
        interrupted run can leak into the next one.
        """
        with self._run_lock:
            if self._closed:
                raise RuntimeError(f"this strategy's replica threads were {self._closed}; "
                                   "create a new strategy")
            n = self._n
            task = _Task(call, n, on_exit)
            if n > 1:
                if not self._workers:
                    self._workers = [_Worker(i, self._name) for i in range(1, n)]
                for worker in self._workers:
                    worker.publish(task)
            task.claim(0)
            task.execute(0)
            for i in range(1, n):
                if task.claim(i):
                    task.execute(i)
            try:
                task.wait()
            except BaseException:
                if on_interrupt is not None:
                    on_interrupt()
                if not task.wait(timeout=10.0):
                    self._closed = "left running by an interrupted run"
                raise
            for worker in self._workers:
                worker.task = None
            return task.results, task.failures

    def close(self, timeout: float = 10.0) -> None:
        """Stops the replica threads and waits for them to exit; `run` fails afterwards.

        Waiting matters at interpreter exit: a thread that has run torch ops and is
        still exiting when Python finalizes can abort the process from a C++
        thread-local destructor.
        """
        with self._run_lock:
            self._closed = "closed"
            workers, self._workers = self._workers, []
            for worker in workers:
                worker.publish(_STOP)
        current = threading.current_thread()
        for worker in workers:
            if worker.thread is not current:
                worker.thread.join(timeout)
