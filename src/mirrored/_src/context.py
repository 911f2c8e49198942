"""The only ambient state of the library: which strategy is current, and whether
code runs in replica or cross-replica context.

Each thread has a stack of frames ``(strategy, replica_context)``.
``strategy.scope()`` pushes ``(strategy, None)`` (cross-replica context); a
replica running inside ``strategy.run`` pushes ``(strategy, its ReplicaContext)``.
An empty stack means the default strategy, in its default replica context (as in
TF, where code outside any strategy is "in replica context" of the default).

This module knows strategies only through the small `StrategyLike` protocol; the
default strategy is registered here by the strategies package
(`register_default_strategy`), not imported.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, Protocol

__all__ = [
    "Scope",
    "StrategyLike",
    "enter_scope",
    "experimental_set_strategy",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "idle",
    "in_cross_replica_context",
    "replica_calls",
    "refuse_other_strategy",
    "register_default_strategy",
]


class StrategyLike(Protocol):
    """What this module needs of a strategy."""

    @property
    def default_replica_context(self) -> Any:
        """The replica context that code outside ``run`` of this strategy is in, if any
        (the default strategy's); ``None`` for every other strategy."""
        ...


# Typed as Any for users: get_strategy() is a mirrored.Strategy, but this module
# cannot import that class (it sits below the strategies in the layers).
Strategy = Any
ReplicaContext = Any
ReplicaArgs = Callable[[int], tuple[Any, dict[str, Any]]]  # run's arguments of replica i


class _Frame(NamedTuple):
    strategy: Strategy
    replica_context: ReplicaContext | None
    merging: bool = False
    in_run: bool = False


_new_frame = tuple.__new__  # a _Frame without NamedTuple's Python-level __new__ (hot path)


class _State(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Frame] = []
        self.set_scope: Scope | None = None  # experimental_set_strategy's open scope


_state = _State()


def _top() -> _Frame | None:
    return stack[-1] if (stack := _state.stack) else None


_default_factory: Callable[[], Strategy] | None = None


def register_default_strategy(factory: Callable[[], Strategy]) -> None:
    """Registers how to get the process-wide default strategy (called once, by the
    strategies package on import)."""
    global _default_factory
    _default_factory = factory


def _default() -> Strategy:
    if _default_factory is None:
        raise RuntimeError("the default strategy is not registered; import mirrored")
    return _default_factory()


class Scope:
    """What ``strategy.scope()`` returns: a context manager that makes its strategy
    current for this thread while entered.

    It may be entered again while already active (``with scope: ... with scope:``),
    as in TF; each exit pops the frame its enter pushed. Entering a different
    non-default strategy inside another one's scope raises `RuntimeError`.
    """

    __slots__ = ("_strategy",)

    def __init__(self, strategy: StrategyLike) -> None:
        self._strategy = strategy

    def __enter__(self) -> Strategy:
        strategy = self._strategy
        top = _top()
        if top is not None and top.strategy is not strategy and top.strategy is not _default():
            raise RuntimeError(
                f"Mixing different mirrored Strategy objects: cannot enter the scope of "
                f"{strategy!r} inside the scope of {top.strategy!r}; leave the outer scope "
                "first (one strategy at a time per thread)")
        replica_context = None
        if top is not None and top.strategy is strategy:
            replica_context = top.replica_context
        if replica_context is None:
            replica_context = strategy.default_replica_context  # the default's, as outside
        _state.stack.append(_Frame(strategy, replica_context,
                                   in_run=top is not None and top.in_run))
        return strategy

    def __exit__(self, *exc: object) -> None:
        _state.stack.pop()


def enter_scope(strategy: StrategyLike) -> Scope:
    """Makes ``strategy`` current for this thread (what ``strategy.scope()`` returns).
    Entering it inside the default strategy's scope is allowed (as in TF), inside another
    strategy's scope not."""
    return Scope(strategy)


def refuse_other_strategy(strategy: StrategyLike, method: str) -> None:
    """Refuses ``method`` of ``strategy`` while a different non-default strategy is
    current (its scope, or a replica of its ``run``), as TF does.

    Raises:
        RuntimeError: ``Mixing different mirrored Strategy objects``, naming both.
    """
    top = _top()
    if top is None or top.strategy is strategy or top.strategy is _default():
        return
    raise RuntimeError(
        f"Mixing different mirrored Strategy objects: {method} of {strategy!r} was called "
        f"while {top.strategy!r} is current (inside its scope or run); call it outside "
        "that scope, or use the current strategy (mirrored.get_strategy())")


def experimental_set_strategy(strategy: StrategyLike | None) -> None:
    """Makes ``strategy`` current for this thread until the next call, as if its
    ``scope()`` were entered and left open (TF's
    ``tf.distribute.experimental_set_strategy``); ``None`` goes back to the default.

    Raises:
        RuntimeError: called inside a strategy's ``scope()`` or ``run``.

    Example:
        >>> import mirrored
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> mirrored.experimental_set_strategy(strategy)
        >>> mirrored.get_strategy() is strategy, mirrored.in_cross_replica_context()
        (True, True)
        >>> mirrored.experimental_set_strategy(None)
        >>> mirrored.has_strategy()
        False
    """
    state = _state
    held = 1 if state.set_scope is not None else 0
    top = _top()
    if top is not None and len(state.stack) > held:
        raise RuntimeError(
            "experimental_set_strategy must not be called inside a strategy's scope() or "
            f"run (the current strategy is {top.strategy!r}); call it outside every scope")
    if state.set_scope is not None:
        state.set_scope.__exit__(None, None, None)
        state.set_scope = None
    if strategy is not None:
        scope = Scope(strategy)
        scope.__enter__()
        state.set_scope = scope


def replica_calls(strategy: Strategy, contexts: Sequence[ReplicaContext], fn: Callable[..., Any],
                  replica_args: ReplicaArgs | None) -> Callable[[int], Any]:
    """``call(i)``: ``fn(*replica_args(i))`` (no arguments for ``None``) with this thread
    in ``contexts[i]`` of ``strategy``, for ``run`` (a push/pop: cheaper than a ``with``)."""
    def call(i: int) -> Any:
        stack = _state.stack
        stack.append(_new_frame(_Frame, (strategy, contexts[i], False, True)))  # in_run
        try:
            if replica_args is None:
                return fn()
            args, kwargs = replica_args(i)
            return fn(*args, **kwargs)
        finally:
            stack.pop()
    return call


def idle() -> bool:
    """Whether this thread is outside every scope, ``run`` and ``merge_fn``."""
    return not _state.stack


def may_run_directly(strategy: Strategy) -> bool:
    """Whether ``strategy.run`` may start here with nothing to refuse or nest: outside
    every scope and ``run``, or in ``strategy``'s own scope (the one-replica fast path)."""
    stack = _state.stack
    if not stack:
        return True
    top = stack[-1]
    return top.strategy is strategy and not top.in_run


def call_in_run(strategy: Strategy, replica_context: ReplicaContext,
                fn: Callable[..., Any], args: Any, refused: Any) -> Any:
    """``fn(*args)`` as the one replica of a ``run`` of ``strategy`` on this thread, in one
    frame (the one-replica ``run``): ``refused`` unless `may_run_directly`; else the run
    marked in flight (`run_started`) and this thread in ``replica_context``."""
    stack = _state.stack
    if stack and ((top := stack[-1]).strategy is not strategy or top.in_run):
        return refused
    key = id(strategy)
    with _in_flight_lock:
        _in_flight[key] = _in_flight.get(key, 0) + 1
    stack.append(_new_frame(_Frame, (strategy, replica_context, False, True)))  # in_run
    try:
        return fn(*args)
    finally:
        stack.pop()
        with _in_flight_lock:  # (`run_finished`, inlined)
            if left := _in_flight[key] - 1:
                _in_flight[key] = left
            else:
                del _in_flight[key]


@contextmanager
def in_merge_fn(strategy: Strategy) -> Iterator[None]:
    """Puts this thread in the cross-replica context of a ``merge_fn`` of ``strategy``."""
    stack = _state.stack
    stack.append(_Frame(strategy, None, merging=True, in_run=True))
    try:
        yield
    finally:
        stack.pop()


def get_strategy() -> Strategy:
    """Returns the current strategy: the one whose ``scope()`` or ``run`` this code is in,
    else the default strategy (one replica on the current device).

    Example:
        >>> import mirrored
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with strategy.scope():
        ...     mirrored.get_strategy() is strategy
        True
        >>> mirrored.get_strategy().num_replicas_in_sync
        1
    """
    top = _top()
    return top.strategy if top is not None else _default()


def has_strategy() -> bool:
    """Whether a non-default strategy is current.

    Example:
        >>> import mirrored
        >>> mirrored.has_strategy()
        False
    """
    return (top := _top()) is not None and top.strategy is not _default()


def get_replica_context() -> ReplicaContext | None:
    """Returns the current replica's `ReplicaContext` inside ``strategy.run``; ``None`` in
    the cross-replica context of a strategy's scope; the default replica context
    outside any strategy.

    Example:
        >>> import mirrored
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> ids = strategy.run(lambda: mirrored.get_replica_context().replica_id_in_sync_group)
        >>> strategy.experimental_local_results(ids)
        (0, 1)
    """
    stack = _state.stack  # (_top inlined: this runs in every step)
    if not stack:
        return _default().default_replica_context
    return stack[-1].replica_context


def get_cross_replica_context() -> Strategy | None:
    """Returns the current strategy in cross-replica context, else ``None``.

    Exactly one of `get_replica_context` and `get_cross_replica_context` is ``None``.

    Example:
        >>> import mirrored
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with strategy.scope():
        ...     mirrored.get_cross_replica_context() is strategy
        True
    """
    top = _top()
    return None if top is None or top.replica_context is not None else top.strategy


def in_cross_replica_context() -> bool:
    """Whether this code is in cross-replica context (a strategy's scope, outside ``run``).

    Example:
        >>> import mirrored
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> with strategy.scope():
        ...     mirrored.in_cross_replica_context()
        True
        >>> strategy.run(mirrored.in_cross_replica_context)
        False
    """
    return (top := _top()) is not None and top.replica_context is None


def merging_strategy() -> Strategy | None:
    """The strategy whose ``merge_fn`` this thread runs (the innermost), else ``None``."""
    for frame in reversed(_state.stack):
        if frame.merging:
            return frame.strategy
    return None


def in_merge_fn_of_run() -> bool:
    """Whether this thread runs a ``merge_fn`` (inside some replica's ``run``)."""
    for frame in _state.stack:  # noqa: SIM110 (a loop: no generator per collective)
        if frame.merging:
            return True
    return False


def current_replica_context() -> ReplicaContext | None:
    """The `ReplicaContext` of the ``run`` this thread is inside, else ``None``
    (unlike `get_replica_context`, never the default replica context)."""
    stack = _state.stack  # (_top inlined: this runs in every step)
    top = stack[-1] if stack else None
    return top.replica_context if top is not None and top.in_run else None


_in_flight: dict[int, int] = {}
_in_flight_lock = threading.Lock()


def run_started(strategy: StrategyLike) -> int:
    """Marks a ``run`` of ``strategy`` in flight (process-wide); returns `run_finished`'s key."""
    key = id(strategy)
    with _in_flight_lock:
        _in_flight[key] = _in_flight.get(key, 0) + 1
    return key


def run_finished(key: int) -> None:
    """The run marked by `run_started` ended."""
    with _in_flight_lock:
        if left := _in_flight[key] - 1:
            _in_flight[key] = left
        else:
            del _in_flight[key]


def run_in_flight(strategy: StrategyLike | None = None) -> bool:
    """Whether some thread is inside ``strategy.run`` (any strategy's for ``None``)."""
    return bool(_in_flight) if strategy is None else id(strategy) in _in_flight


def refuse_default_context_in_foreign_thread(what: str) -> None:
    """Refuses ``what`` on the default replica context from a thread that is not a
    replica while some ``strategy.run`` is in flight: such a thread was most likely
    started inside a step function, where the default context would silently give
    one-replica answers (an unreduced all-reduce, a local average).

    Raises:
        RuntimeError: naming ``what`` and what to do instead.
    """
    if _in_flight and not in_run():
        raise RuntimeError(
            f"{what} of the default strategy was called from a thread that is not a replica "
            "while a strategy.run is in flight (e.g. a thread started inside the step "
            "function), where it would return the value unreduced; call it from the "
            "replica function's own thread")


def in_run() -> bool:
    """Whether this thread runs a replica or a ``merge_fn`` of some ``strategy.run``."""
    stack = _state.stack
    return bool(stack) and stack[-1].in_run
