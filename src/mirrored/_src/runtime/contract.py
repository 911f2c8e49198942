"""The collective contract: what a replica brings to a collective (`CallSpec`,
`Arrival`), how a failure is carried to replicas (`Failure`, `CollectiveFailure`),
and the mismatch message (one line per replica, with the pytree path of the first
difference and the call sites)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import torch

from .. import pytree
from ..reduction import describe_spec

__all__ = ["Arrival", "CallSpec", "CollectiveFailure", "Failure", "Raise", "Starter",
           "describe_call", "early_exit_message", "mismatch_message", "outside_message",
           "timeout_message"]

P = TypeVar("P")
R = TypeVar("R")


@dataclasses.dataclass(frozen=True, slots=True)
class Raise:
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


class CallSpec:
    """What one replica's collective call looks like, for the contract check.

    ``key`` must be equal on every replica (title, structure, shapes with the
    reduced/gathered dims masked, dtypes); ``leaves`` (dtype and shape per leaf)
    and ``value`` describe the inputs in error messages. Read-only by convention (a
    plain class: one is built per collective call).
    """

    __slots__ = ("key", "leaves", "site", "structure", "title", "value")

    def __init__(self, title: str, site: str, key: Hashable,
                 structure: pytree.PyTreeSpec | None = None,
                 leaves: tuple[tuple[torch.dtype, tuple[int, ...]], ...] = (),
                 value: Any = None) -> None:
        self.title = title
        self.site = site
        self.key = key
        self.structure = structure
        self.leaves = leaves
        self.value = value

    def __repr__(self) -> str:
        return f"CallSpec({self.title!r}, {self.site!r}, {self.key!r})"


class Arrival(Generic[P, R]):
    """What one replica brings to a collective: its call, its payload, and how to
    combine every replica's payload (run once, by the last replica to arrive, on the
    payloads in replica order; returns one result per replica)."""

    __slots__ = ("call", "combine", "payload")

    def __init__(self, call: CallSpec, payload: P,
                 combine: Callable[[Sequence[P]], Sequence[R]]) -> None:
        self.call = call
        self.payload = payload
        self.combine = combine

    @property
    def title(self) -> str:
        return self.call.title

    @property
    def site(self) -> str:
        return self.call.site


def describe_call(call: CallSpec, index: int | None) -> str:
    leaves = call.leaves
    if index is not None and index >= len(leaves):
        inputs = f"{len(leaves)} leaves (none at {index})"
    elif index is not None:
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
        lines = [f"  {label}: {describe_call(a, None)}" for label, a in zip(labels, arrivals,
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
        pairs = zip(first.leaves, other.leaves, strict=False)
        index = next((k for k, (x, y) in enumerate(pairs) if x != y),
                     min(len(first.leaves), len(other.leaves))
                     ) if first.leaves != other.leaves else None
        paths = pytree.flatten_with_path(first.value)[0] if first.value is not None else []
        where = (pytree.format_path(paths[index]) if index is not None and index < len(paths)
                 else "value" if index is None else f"leaf {index}")
        headline = f"replicas passed mismatched inputs (first difference at {where})"
        if len(other.leaves) != len(first.leaves):  # (e.g. a buffer None on some replicas)
            headline = "replicas passed different numbers of tensors (" + ", ".join(
                f"{label}: {len(a.leaves)}" for label, a in zip(labels, arrivals, strict=True)
            ) + "; a tensor present on some replicas only, as a buffer that is None on some)"
        lines = [f"  {label}: {describe_call(a, index)}"
                 for label, a in zip(labels, arrivals, strict=True)]
    return f"{first.title} got mismatched calls: {headline}:\n" + "\n".join(lines)


def outside_message(arrival: Arrival[Any, Any], *, abandoned: bool) -> str:
    """Why ``arrival`` cannot join the run in progress: it comes from a replica of an
    ``abandoned`` earlier run, or from outside every run."""
    if abandoned:
        return (f"{arrival.title} at {arrival.site} was called by a replica of an earlier "
                "strategy.run that was abandoned (it timed out or was interrupted while "
                "this replica was still busy); it cannot join the current run")
    return (f"{arrival.title} at {arrival.site} was called outside strategy.run: "
            "collectives (and backward passes through them) must run inside the step "
            "function, in every replica")


def timeout_message(arrival: Arrival[Any, Any], timeout: float, labels: Sequence[str],
                    arrived: Sequence[bool]) -> str:
    """Why ``arrival`` timed out: which replicas arrived and which are missing."""
    missing = len(arrived) - sum(arrived)
    return (f"{arrival.title} at {arrival.site} timed out after {timeout:g} s: "
            f"{missing} of {len(labels)} replicas did not arrive\n"
            + "\n".join(f"  {label}: arrived" for label, a in zip(labels, arrived, strict=True)
                        if a) + "\n"
            + "\n".join(f"  {label}: missing" for label, a in zip(labels, arrived, strict=True)
                        if not a))


def early_exit_message(labels: Sequence[str], exited: Sequence[int],
                       waiting: dict[int, Arrival[Any, Any]]) -> str:
    """Why a collective can never complete: replicas ``exited`` returned from their
    function while the replicas in ``waiting`` wait in it."""
    first = waiting[min(waiting)]
    names = ", ".join(labels[j] for j in exited)
    lines = []
    for j, label in enumerate(labels):
        if j in waiting:
            lines.append(f"  {label}: waiting in {describe_call(waiting[j].call, None)}")
        elif j in exited:
            lines.append(f"  {label}: returned from its function")
        else:
            lines.append(f"  {label}: still running")
    return (f"{first.title} at {first.site} can never complete: {names} returned from its "
            "function without calling it, while other replicas wait in it. Every replica "
            "must make the same collective calls in the same order\n" + "\n".join(lines))


class Starter(Protocol):
    """Starts replicas that have not started yet (the executor), for the rendezvous's
    baton runs."""

    def start_next(self, *, wake: bool) -> bool:
        """Whether a replica is still unstarted; with ``wake``, its thread is woken."""
        ...

    def start_all(self) -> None:
        """Wakes the thread of every unstarted replica."""
        ...
