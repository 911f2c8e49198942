"""The meeting point of a collective: every replica deposits an `Arrival`, the last
one checks the collective contract, combines, and releases the others.

States, per collective slot::

    open --(replica i arrives, not last)--> waiting on its wake-up lock
    open --(last replica arrives)--> completing --(results in mailboxes)--> open
    any  --(mismatch | timeout | a replica exits early or raises)--> broken

*Broken* lasts until the next ``run``: every waiting replica is released and
raises, and every later collective call in this run raises at once, so no
scenario hangs. Mismatch and timeout errors are raised in every replica; a
replica released because another one raised gets `ReplicaAbortedError`, and
``run`` reports the original exception instead.
"""

from __future__ import annotations

import _thread
import dataclasses
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, TypeVar

import torch

from .. import pytree
from ..errors import CollectiveMismatchError, CollectiveTimeoutError, ReplicaAbortedError
from ..reduction import describe_spec

__all__ = ["Arrival", "CallSpec", "CollectiveFailure", "Failure", "Rendezvous"]

P = TypeVar("P")
R = TypeVar("R")


@dataclasses.dataclass(frozen=True, slots=True)
class _Raise:
    """A result slot that re-raises an exception raised while combining."""

    error: BaseException


@dataclasses.dataclass(frozen=True, slots=True)
class Failure:
    """A result slot that raises ``error_type(message)`` in its replica."""

    error_type: type[BaseException]
    message: str

    def error(self) -> BaseException:
        return self.error_type(self.message)


class CollectiveFailure(Exception):
    """Raised by a ``combine`` to fail the collective in *every* replica with
    ``error_type(message)`` (e.g. MIN over no elements); any other exception is
    delivered to replica 0 and the others are released."""

    def __init__(self, error_type: type[BaseException], message: str) -> None:
        super().__init__(message)
        self.failure = Failure(error_type, message)


@dataclasses.dataclass(frozen=True, slots=True)
class CallSpec:
    """What one replica's collective call looks like, for the contract check.

    ``key`` must be equal on every replica (title, structure, shapes with the
    reduced/gathered dims masked, dtypes); ``leaves`` (dtype and shape per leaf)
    and ``value`` describe the inputs in error messages.
    """

    title: str
    site: str
    key: Hashable
    structure: pytree.PyTreeSpec | None = None
    leaves: tuple[tuple[torch.dtype, tuple[int, ...]], ...] = ()
    value: Any = None


@dataclasses.dataclass(frozen=True, slots=True)
class Arrival(Generic[P, R]):
    """What one replica brings to a collective: its call, its payload, and how to
    combine every replica's payload (run once, by the last replica to arrive, on the
    payloads in replica order; returns one result per replica)."""

    call: CallSpec
    payload: P
    combine: Callable[[Sequence[P]], Sequence[R]]

    @property
    def title(self) -> str:
        return self.call.title

    @property
    def site(self) -> str:
        return self.call.site


def _describe(call: CallSpec, index: int | None) -> str:
    leaves = call.leaves
    if index is not None:
        inputs = describe_spec(*leaves[index])
    elif len(leaves) <= 4:
        inputs = ", ".join(describe_spec(*leaf) for leaf in leaves)
    else:
        inputs = f"{len(leaves)} leaves"
    return f"{call.title} of {inputs or 'nothing'} at {call.site}"


def mismatch_message(calls: Sequence[CallSpec], labels: Sequence[str]) -> str | None:
    """``None`` if every call has replica 0's key, else the error message."""
    first = calls[0]
    if all(c.key == first.key for c in calls):
        return None
    other = next(c for c in calls if c.key != first.key)
    arrivals = calls
    if other.title != first.title:
        headline = "replicas called different collectives"
        lines = [f"  {label}: {_describe(a, None)}" for label, a in zip(labels, arrivals,
                                                                        strict=True)]
    elif other.structure != first.structure:
        found = pytree.first_difference(first.value, other.value)
        where = found[0] if found else "value"
        headline = f"replicas passed different structures (first difference at {where})"
        lines = []
        for label, a in zip(labels, arrivals, strict=True):
            mine = pytree.first_difference(first.value, a.value) if a is not first else None
            if mine is not None and mine[0] == where:
                shape = mine[2]
            else:  # same structure as replica 0 there
                shape = found[1] if found else "the same structure"
            lines.append(f"  {label}: {a.title} at {a.site} has {shape} at {where}")
    else:
        index = next(k for k, (x, y) in enumerate(zip(first.leaves, other.leaves, strict=True))
                     if x != y) if first.leaves != other.leaves else None
        paths = pytree.flatten_with_path(first.value)[0]
        where = pytree.format_path(paths[index]) if index is not None else "value"
        headline = f"replicas passed mismatched inputs (first difference at {where})"
        lines = [f"  {label}: {_describe(a, index)}"
                 for label, a in zip(labels, arrivals, strict=True)]
    return f"{first.title} got mismatched calls: {headline}:\n" + "\n".join(lines)


class Rendezvous:
    """Synchronizes the collectives of one strategy's replicas; see the module docstring.

    Args:
        labels: how messages name each replica (``"replica 0 (CPU:0)"``).
    """

    def __init__(self, labels: Sequence[str]) -> None:
        self._labels = tuple(labels)
        n = len(labels)
        self._n = n
        self._lock = threading.Lock()
        self._wakeups = [_thread.allocate_lock() for _ in range(n)]
        for wake in self._wakeups:
            wake.acquire()
        self._arrivals: list[Arrival[Any, Any] | None] = [None] * n
        self._count = 0
        self._completing = False
        self._mailbox: list[Any] = [None] * n
        self._delivered = [False] * n
        self._exited = [False] * n
        self._broken: Failure | None = None
        self._active = False
        self._completer = 0

    def start(self) -> None:
        """Resets the state for a new ``run`` (no replica of an earlier one is running)."""
        with self._lock:
            for wake in self._wakeups:
                wake.acquire(False)  # a wake-up nobody consumed must not leak into this run
            self._arrivals = [None] * self._n
            self._count = 0
            self._completing = False
            self._mailbox = [None] * self._n
            self._delivered = [False] * self._n
            self._exited = [False] * self._n
            self._broken = None
            self._active = True

    def finish(self) -> None:
        """Marks the end of a ``run``."""
        with self._lock:
            self._active = False

    # ----------------------------------------------------------- exchange
    def exchange(self, replica_id: int, arrival: Arrival[P, R], timeout: float | None) -> R:
        """Deposits ``arrival`` and returns this replica's result once all arrived.

        Raises:
            CollectiveMismatchError: the replicas' calls differ, or a replica returned
                from its function while others wait.
            CollectiveTimeoutError: not every replica arrived within ``timeout``.
            ReplicaAbortedError: another replica raised.
            RuntimeError: called outside ``run``.
        """
        with self._lock:
            if not self._active:
                raise RuntimeError(
                    f"{arrival.title} at {arrival.site} was called outside strategy.run: "
                    "collectives (and backward passes through them) must run inside the step "
                    "function, in every replica"
                )
            if self._broken is not None:
                raise self._broken.error_type(self._broken.message)
            exited = [j for j in range(self._n) if self._exited[j]]
            if exited:
                message = self._early_exit_message(
                    exited, {**{j: a for j, a in enumerate(self._arrivals) if a is not None},
                             replica_id: arrival})
                self._break(CollectiveMismatchError, message)
                raise CollectiveMismatchError(message)
            if self._completing and self._completer == threading.get_ident():
                raise RuntimeError(
                    f"{arrival.title} at {arrival.site} was called while combining another "
                    "collective (from a merge_fn?); collectives, and backward passes through "
                    "them, cannot run inside a merge_fn"
                )
            self._arrivals[replica_id] = arrival
            self._count += 1
            last = self._count == self._n
            if last:
                arrivals = [a for a in self._arrivals if a is not None]
                self._completing = True
                self._completer = threading.get_ident()
        result: R = (self._wait(replica_id, arrival, timeout) if not last
                     else self._complete(replica_id, arrivals))
        return result

    def _complete(self, replica_id: int, arrivals: list[Arrival[Any, Any]]) -> Any:
        message: str | None = None
        try:
            message = mismatch_message([a.call for a in arrivals], self._labels)
            if message is not None:
                results: Sequence[Any] = [Failure(CollectiveMismatchError, message)] * self._n
            else:
                results = arrivals[0].combine([a.payload for a in arrivals])
        except CollectiveFailure as failure:  # raised in every replica
            results = [failure.failure] * self._n
        except BaseException as error:  # delivered to replica 0, whose call it was
            aborted = Failure(ReplicaAbortedError, (
                f"{arrivals[0].title} at {arrivals[0].site} failed in replica 0 with "
                f"{type(error).__name__}: {error}"))
            results = [_Raise(error), *([aborted] * (self._n - 1))]
        with self._lock:
            for j in range(self._n):
                self._mailbox[j] = results[j]
                self._delivered[j] = True
                self._arrivals[j] = None
            self._count = 0
            self._completing = False
            for j in range(self._n):
                if j != replica_id:
                    self._wakeups[j].release()
            if message is not None:
                self._broken = Failure(CollectiveMismatchError, message)
        return self._take(replica_id)

    def _wait(self, replica_id: int, arrival: Arrival[Any, Any], timeout: float | None
              ) -> Any:
        wake = self._wakeups[replica_id]
        try:
            woken = wake.acquire() if timeout is None else wake.acquire(timeout=timeout)
        except BaseException:  # KeyboardInterrupt: leave the slot as if never arrived
            self._abandon(replica_id)
            raise
        if woken:
            return self._take(replica_id)
        with self._lock:
            if not (self._completing or self._delivered[replica_id]
                    or self._broken is not None):
                arrived = [j for j, a in enumerate(self._arrivals) if a is not None]
                missing = [j for j in range(self._n) if j not in arrived]
                self._break(CollectiveTimeoutError, (
                    f"{arrival.title} at {arrival.site} timed out after {timeout:g} s: "
                    f"{len(missing)} of {self._n} replicas did not arrive\n"
                    + "\n".join(f"  {self._labels[j]}: arrived" for j in arrived) + "\n"
                    + "\n".join(f"  {self._labels[j]}: missing" for j in missing)))
        try:
            wake.acquire()  # released at once by _break, or soon by the completing replica
        except BaseException:
            self._abandon(replica_id)
            raise
        return self._take(replica_id)

    def _abandon(self, replica_id: int) -> None:
        """Withdraws a waiting replica that stops waiting because of an exception, or
        consumes the wake-up it was already given, so no lock is left released."""
        with self._lock:
            if self._arrivals[replica_id] is not None and not self._completing:
                self._arrivals[replica_id] = None
                self._count -= 1
                return
        self._wakeups[replica_id].acquire()
        with self._lock:
            self._mailbox[replica_id] = None
            self._delivered[replica_id] = False

    def abort(self, message: str) -> None:
        """Breaks the current run's rendezvous (``run`` was interrupted)."""
        with self._lock:
            self._break(ReplicaAbortedError, message)

    def _take(self, replica_id: int) -> Any:
        with self._lock:
            if self._delivered[replica_id]:
                result = self._mailbox[replica_id]
                self._mailbox[replica_id] = None
                self._delivered[replica_id] = False
            else:
                result = self._broken
        if isinstance(result, Failure):
            raise result.error_type(result.message)
        if isinstance(result, _Raise):
            raise result.error
        return result

    def _break(self, error_type: type[BaseException], message: str) -> None:
        # Caller holds the lock. Releases every waiting replica; later calls raise too.
        if self._broken is not None:
            return
        self._broken = Failure(error_type, message)
        if self._completing:
            return  # the completing replica delivers results to everyone
        for j, waiting in enumerate(self._arrivals):
            if waiting is not None:
                self._arrivals[j] = None
                self._wakeups[j].release()
        self._count = 0

    # ------------------------------------------------------- replica exits
    def replica_exited(self, replica_id: int, error: BaseException | None) -> None:
        """Called when replica ``replica_id``'s function returned or raised."""
        with self._lock:
            self._exited[replica_id] = True
            if self._broken is not None:
                return
            waiting = {j: a for j, a in enumerate(self._arrivals) if a is not None}
            if error is not None:
                self._break(ReplicaAbortedError, (
                    f"released from a collective because {self._labels[replica_id]} raised "
                    f"{type(error).__name__}: {error}"))
            elif waiting:
                self._break(CollectiveMismatchError,
                            self._early_exit_message([replica_id], waiting))

    def _early_exit_message(self, exited: Sequence[int],
                            waiting: dict[int, Arrival[Any, Any]]) -> str:
        first = waiting[min(waiting)]
        names = ", ".join(self._labels[j] for j in exited)
        lines = []
        for j in range(self._n):
            if j in waiting:
                lines.append(f"  {self._labels[j]}: waiting in "
                             f"{_describe(waiting[j].call, None)}")
            elif j in exited:
                lines.append(f"  {self._labels[j]}: returned from its function")
            else:
                lines.append(f"  {self._labels[j]}: still running")
        return (f"{first.title} at {first.site} can never complete: {names} returned from its "
                "function without calling it, while other replicas wait in it. Every replica "
                "must make the same collective calls in the same order\n" + "\n".join(lines))
