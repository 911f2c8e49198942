"""The runtime of a strategy: run one callable per local replica, let replicas meet
at collectives, abort. One object per strategy owns the executor (threads), the
rendezvous (meetings) and the propagation of the caller's thread state.

`ThreadRuntime` runs replicas concurrently on persistent threads (replica 0 on
the caller's thread); `InlineRuntime` (the default strategy's) calls its one
replica directly on the caller's thread, under the caller's device.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, final

import torch

from ..devices import current_device
from ..errors import ReplicaAbortedError
from ..topology import Topology
from .executor import Executor, ReplicaFailure
from .rendezvous import Arrival, CollectiveFailure
from .rendezvous import Rendezvous as Rendezvous
from .thread_state import capture

__all__ = ["InlineRuntime", "Runtime", "ThreadRuntime"]

P = TypeVar("P")
R = TypeVar("R")


class Runtime(Protocol):
    """What strategies and collectives need from a runtime."""

    @property
    def caller_device(self) -> torch.device:
        """The current device of the caller of the ``run`` in progress."""
        ...

    def run(self, call: Callable[[int], Any]) -> list[Any]:
        """Runs ``call(i)`` for every local replica ``i`` and returns the results in
        order, or raises the first replica's exception (with a note naming it)."""
        ...

    def exchange(self, index: int, arrival: Arrival[P, R], timeout: float | None) -> R:
        """Local replica ``index`` meets the others at a collective."""
        ...

    def close(self) -> None:
        """Stops the replica threads."""
        ...


def _add_note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10
        error.__notes__ = [*getattr(error, "__notes__", []), note]


def _complete_alone(arrival: Arrival[P, R]) -> R:
    """A collective of one replica: combine its own payload."""
    try:
        return arrival.combine([arrival.payload])[0]
    except CollectiveFailure as failure:
        raise failure.failure.error() from None


@contextlib.contextmanager
def _on_device(device: torch.device) -> Iterator[None]:
    with torch.device(device):
        if device.type == "cuda":
            with torch.cuda.device(device):
                yield
        else:
            yield


@final
class ThreadRuntime:
    """Replicas on persistent threads; see the module docstring.

    Args:
        topology: the strategy's replicas (local devices, labels).
        name: the strategy's class name, for thread names and error notes.
    """

    def __init__(self, topology: Topology, name: str) -> None:
        self._topology = topology
        self._name = name
        self._n = topology.num_local_replicas
        self._rendezvous = Rendezvous(topology.labels)
        self._executor = Executor(self._n, name=name)
        self._run_lock = threading.Lock()
        self._caller_device = torch.device("cpu")

    @property
    def caller_device(self) -> torch.device:
        return self._caller_device

    def run(self, call: Callable[[int], Any]) -> list[Any]:
        caller_state = capture()
        caller_thread = threading.get_ident()
        caller_device = current_device()
        devices = self._topology.torch_devices

        def on_replica(i: int) -> Any:
            device = devices[i]
            if device == caller_device and device.type == "cpu" and (
                    threading.get_ident() == caller_thread or capture() == caller_state):
                return call(i)  # the common case: nothing to set up
            with contextlib.ExitStack() as stack:
                if device != caller_device or device.type != "cpu":
                    stack.enter_context(_on_device(device))
                caller_state.apply(stack)
                return call(i)

        if self._n == 1:
            self._caller_device = caller_device
            try:
                return [on_replica(0)]
            except Exception as error:
                _add_note(error, self._note(0))
                raise
        rendezvous = self._rendezvous
        with self._run_lock:  # one run at a time; concurrent callers queue here
            self._caller_device = caller_device
            rendezvous.start()
            try:
                results, failures = self._executor.run(
                    on_replica, rendezvous.replica_exited,
                    lambda: rendezvous.abort("released because strategy.run was interrupted"))
            finally:
                rendezvous.finish()
        if failures:
            raise self._failure_error(failures)
        return results

    def exchange(self, index: int, arrival: Arrival[P, R], timeout: float | None) -> R:
        if self._n == 1:
            return _complete_alone(arrival)
        return self._rendezvous.exchange(index, arrival, timeout)

    def close(self) -> None:
        self._executor.close()

    def _note(self, index: int) -> str:
        label = self._topology.labels[index]
        return f"raised in {label} of {self._name}.run"

    def _failure_error(self, failures: Sequence[ReplicaFailure]) -> BaseException:
        # An interrupt first; then the root cause, not a replica released because of
        # it; ties by replica id.
        interrupts = [f for f in failures if not isinstance(f.error, Exception)]
        causes = interrupts or [f for f in failures
                                if not isinstance(f.error, ReplicaAbortedError)]
        failure = min(causes or failures, key=lambda f: f.replica_id)
        _add_note(failure.error, self._note(failure.replica_id))
        return failure.error


@final
class InlineRuntime:
    """The default strategy's runtime: its one replica is the caller itself."""

    @property
    def caller_device(self) -> torch.device:
        return current_device()

    def run(self, call: Callable[[int], Any]) -> list[Any]:
        return [call(0)]

    def exchange(self, index: int, arrival: Arrival[P, R], timeout: float | None) -> R:
        return _complete_alone(arrival)

    def close(self) -> None:
        """Nothing to stop."""
