"""The replica threads: runs one call per replica, concurrently or with a baton.

An `Executor` owns persistent daemon threads, started on first use. Each ``run``
is a `Task` with one *claim* per replica (`task`)::

    caller thread                       replica thread i
    -------------                       ----------------
    publish task, wake threads   ---->  wake (lock released)
    claim 0, run replica 0              claim i? -- yes --> run replica i
    claim the rest not yet claimed,                 no ---> sleep again
      run them here ("steal")           the last replica to finish signals `done`
    wait on `done` (woken early if the rendezvous breaks: then wait `grace` more)
    return results in replica order, or abandon the replicas still running

Replica 0 runs on the calling thread (unless ``caller_runs=False``: then every
replica has a thread and the caller only waits, so ``run`` can return even when
a replica is stuck in user code), and a replica whose thread has not woken up by
the time the caller is free runs on the caller too. Stealing is safe for
collectives: the caller steals only after replica 0 returned, and a collective
needs every replica at once.

A *baton* run (``baton=True``) wakes no thread at the start: the task is only
attached to the threads, and the rendezvous wakes the thread of the next
unclaimed replica (`start_next`) when the replica running waits at a collective
or returns on a replica thread; a replica returning on the caller's thread lets
the caller claim the next one itself. A trivial step therefore never wakes a
thread, and a step with collectives wakes one thread per hand-over.

A replica still running when ``run`` gives up (after a broken rendezvous plus
``grace``, or after an interrupt) is a *straggler*: its later outcome is dropped,
and the next ``run`` waits for its thread at most ``straggler_wait`` seconds, then
raises `RuntimeError` naming it. ``close()`` publishes ``STOP`` and joins.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .task import STOP, ReplicaFailure, Task, Worker

__all__ = ["Executor", "ReplicaAbandoned", "ReplicaFailure"]


class Executor:
    """Runs ``call(i)`` for every replica ``i`` concurrently; see the module docstring.

    Args:
        labels: how messages name each replica; their number is the replica count.
        name: prefix of the thread names.
        caller_runs: replica 0 (and stolen replicas) run on the caller's thread.
    """

    def __init__(self, labels: Sequence[str], name: str = "mirrored", *,
                 caller_runs: bool = True) -> None:
        self._labels = tuple(labels)
        self._n = len(self._labels)
        self._name = name
        self._caller_runs = caller_runs
        self._workers: list[Worker] = []
        self._closed: str | None = None
        self._current: Task | None = None
        self._straggler_wait = 0.0
        self._timeout_hint: float | None = None

    def timed_out(self, seconds: float) -> None:
        """A collective of the run in progress timed out after ``seconds``: its caller
        stops waiting for every replica (a straggler gets ``seconds`` at the next run)."""
        task = self._current
        if task is not None:
            self._timeout_hint = seconds
            task.signal()

    def reset_after_fork(self) -> None:
        """In a forked child: the threads did not survive the fork."""
        self._workers = []
        self._current = None

    def start_next(self, *, wake: bool) -> bool:
        """Baton runs: whether a replica of the run in progress is still unclaimed; with
        ``wake``, the lowest one's thread is woken to run it (`Starter`)."""
        task = self._current
        if task is None:
            return False
        for worker in self._workers:
            if task.owners[worker.index] is None:  # (a read: claim decides under the lock)
                if wake:
                    worker.publish(task)
                return True
        return False

    def start_all(self) -> None:
        """Wakes the thread of every replica of the run in progress not yet claimed."""
        task = self._current
        if task is not None:
            for worker in self._workers:
                if task.unclaimed(worker.index):
                    worker.publish(task)

    def run(self, call: Callable[[int], Any], on_exit: Callable[[int, BaseException | None],
            None], on_abort: Callable[[str], None], *, grace: float,
            straggler_wait: float, baton: Callable[[], bool] | None = None
            ) -> tuple[list[Any], list[ReplicaFailure]]:
        """Runs ``call(i)`` for every replica and waits for them.

        ``baton``: whether the run is (still) a baton run: then no thread is woken now;
        the rendezvous starts replicas as the ones running wait or return
        (`start_next`, `start_all`), and the caller runs those still unclaimed when it
        is free (see the module docstring).
        ``on_exit(i, error)`` runs on replica ``i``'s thread right after its call.
        Failures are returned, not raised, except an interrupt of the caller: then
        ``on_abort(message)`` releases the replicas from their collectives, the
        caller waits ``grace`` seconds for them, and re-raises.

        Raises:
            RuntimeError: the executor is closed, or a straggler of an abandoned run
                is still busy after ``straggler_wait`` seconds.
        """
        if self._closed:
            raise RuntimeError(f"this strategy's replica threads were {self._closed}; "
                               "create a new strategy")
        if self._straggler_wait:  # (a run was abandoned once)
            self._wait_for_stragglers()
        n = self._n
        task = Task(call, n, on_exit)
        first = 1 if self._caller_runs else 0
        if n > first and not self._workers:
            self._workers = [Worker(i, self._name) for i in range(first, n)]
        self._current = task
        self._timeout_hint = None
        try:
            for worker in self._workers:
                worker.task = task  # read when the thread wakes
            # (the watchdog may have ended the baton before `_current` was set)
            if baton is None or not baton():
                for worker in self._workers:
                    worker.publish(task)
            if self._caller_runs:
                for i in range(n):
                    if task.failures and task.has_interrupt():
                        break
                    if task.claim(i, "caller"):
                        task.execute(i)
                if task.failures and task.has_interrupt():
                    raise _Interrupted
            if not task.wait():  # the rendezvous broke: give the others `grace`
                self._bounded_wait(task, grace)
                if task.unfinished():
                    self._abandon(task, self._timeout_hint or straggler_wait)
        except BaseException as error:
            interrupt = next((f.error for f in task.failures
                              if not isinstance(f.error, Exception)), None)
            on_abort("released because strategy.run was interrupted")
            task.settle_caller()
            self._bounded_wait(task, grace)
            if task.unfinished():
                self._abandon(task, max(straggler_wait, grace))
            if isinstance(error, _Interrupted) and interrupt is not None:
                return task.results, task.failures  # raised by the caller, with its note
            raise
        finally:
            self._current = None
            for worker in self._workers:
                worker.task = None
        return task.results, task.failures

    def _bounded_wait(self, task: Task, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not task.rearm():
            left = deadline - time.monotonic()
            if left <= 0 or task.wait(left):
                return

    def _abandon(self, task: Task, straggler_wait: float) -> None:
        task.call = None  # replicas not started yet never will be
        running = [i for i in task.unfinished() if task.claimed_by_worker(i)]
        task.settle_caller()
        self._straggler_wait = straggler_wait
        for i in running:  # run must not look successful while they are still running
            task.fail(i, ReplicaAbandoned(
                f"{self._labels[i]} of {self._name} was still running its function when run "
                "gave up on it (a collective timed out, or run was interrupted); its outcome "
                "will be dropped"))

    def _wait_for_stragglers(self) -> None:
        if not self._straggler_wait:
            return  # no run was ever abandoned
        busy = [w for w in self._workers if w.busy]
        if not busy:
            return
        deadline = time.monotonic() + self._straggler_wait
        for worker in busy:
            worker.wait_idle(max(deadline - time.monotonic(), 0.0))
        still = [w for w in busy if w.busy]
        if still:
            names = ", ".join(self._labels[w.index] for w in still)
            raise RuntimeError(
                f"{names} of {self._name} is still running its function from an earlier run "
                "that was abandoned (a collective timed out or run was interrupted while it "
                f"was busy); waited {self._straggler_wait:g} s for it. The strategy works "
                "again once that function returns")

    def close(self, timeout: float = 10.0) -> None:
        """Stops the replica threads and waits for them to exit; `run` fails afterwards.

        Waiting matters at interpreter exit: a thread that has run torch ops and is
        still exiting when Python finalizes can abort the process from a C++
        thread-local destructor.
        """
        self._closed = "closed"
        workers, self._workers = self._workers, []
        for worker in workers:
            worker.publish(STOP)
        current = threading.current_thread()
        for worker in workers:
            if worker.thread is not current and not worker.busy:
                worker.thread.join(timeout)


class ReplicaAbandoned(RuntimeError):
    """A replica that run gave up on (a straggler)."""


class _Interrupted(Exception):
    """A replica run on the caller's thread was interrupted (KeyboardInterrupt)."""
