"""``ReplicaContext.merge_call``: every replica pauses, replica 0's ``merge_fn`` runs
once in cross-replica context on the regrouped arguments (on the thread of the last
replica to arrive, under the caller's device), and replica ``i`` receives
component ``i`` of the result.

With a collective timeout (``CommunicationOptions.timeout_seconds``), ``merge_fn``
runs on a helper thread of its own, carrying the caller's thread state, and a
``merge_fn`` that has not returned within the timeout makes every replica raise
`CollectiveTimeoutError` (a thread cannot be stopped: it goes on in the background,
and its result is dropped)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .. import context, pytree
from ..errors import CollectiveTimeoutError
from ..runtime.contract import Arrival, CallSpec
from ..runtime.random import library_call
from ..runtime.replica_call import on_device
from ..runtime.thread_state import capture
from ..values import DistributedValues, regroup, select_replica
from .call import refuse_in_merge_fn
from .parts import Parts

__all__ = ["merge_call"]

_Payload = tuple[Callable[..., Any], Sequence[Any], dict[str, Any]]


def _bounded(call: Callable[[], Any], timeout: float | None, site: str) -> Any:
    """``call()``, here without a timeout, else on a helper thread waited for at most
    ``timeout`` seconds."""
    if timeout is None:
        return call()
    state = capture()
    box: dict[str, Any] = {}
    done = threading.Event()

    def target() -> None:
        try:
            with contextlib.ExitStack() as stack:
                state.apply(stack)
                box["value"] = call()
        except BaseException as error:  # handed to the caller
            box["error"] = error
        finally:
            done.set()

    threading.Thread(target=target, name="mirrored-merge-fn", daemon=True).start()
    if not done.wait(timeout):
        raise CollectiveTimeoutError(
            f"the merge_fn of merge_call at {site} did not return within {timeout:g} s "
            "(CommunicationOptions.timeout_seconds); it goes on in the background and its "
            "result is dropped. Make merge_fn faster or raise the timeout")
    if "error" in box:
        raise box["error"]
    return box["value"]


def merge_call(parts: Parts, index: int, merge_fn: Callable[..., Any], args: Sequence[Any],
               kwargs: dict[str, Any] | None, site: str) -> Any:
    """`ReplicaContext.merge_call` of local replica ``index``; see its docstring."""
    if not callable(merge_fn):
        raise TypeError(f"merge_call needs a callable merge_fn; got {type(merge_fn).__name__}")
    if not isinstance(args, tuple | list):
        raise ValueError(f"merge_call(merge_fn, args=...) takes a tuple or list; got "
                        f"{type(args).__name__}")
    kwargs = {} if kwargs is None else kwargs
    strategy = parts.strategy
    topology = parts.topology

    def combine(payloads: Sequence[_Payload]) -> list[Any]:
        n = len(payloads)
        merged_args, merged_kwargs = regroup([(p[1], p[2]) for p in payloads],
                                             topology.device_names,
                                             passed_to=f"merge_call at {site}")
        # merge_fn sees the caller's device, whichever replica's thread runs it.
        # merge_fn is cross-replica code: it draws random numbers from the caller's
        # generator (every replica waits meanwhile), not from a replica's stream.
        # (as the default device only where the caller set one: see `on_device`)
        device = parts.runtime.caller_device
        default = parts.runtime.caller_default

        def call_merge_fn() -> Any:
            with context.in_merge_fn(strategy), on_device(device, default):
                return library_call(payloads[0][0], strategy, *merged_args, **merged_kwargs)

        result = _bounded(call_merge_fn, timeout, site)
        leaves, spec = pytree.flatten(result)
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, DistributedValues) and len(leaf.values) != n:
                where = pytree.format_path(pytree.flatten_with_path(result)[0][k], "result")
                raise ValueError(f"merge_fn returned a {type(leaf).__name__} with "
                                 f"{len(leaf.values)} components at {where}, but there are "
                                 f"{n} local replicas")
        return [pytree.unflatten(spec, select_replica(r, leaves)) for r in range(n)]

    timeout = parts.options.timeout_seconds
    if topology.num_local_replicas == 1:
        def call_alone() -> Any:
            with context.in_merge_fn(strategy):
                return merge_fn(strategy, *args, **kwargs)

        return _bounded(call_alone, timeout, site)
    refuse_in_merge_fn(parts, "merge_call", site)
    call = CallSpec("merge_call", site, ("merge_call",))
    payload: _Payload = (merge_fn, tuple(args), kwargs)
    return parts.runtime.exchange(index, Arrival(call, payload, combine),
                                  parts.options.timeout_seconds)
