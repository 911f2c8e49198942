"""Preparing input steps ahead of the training loop, on one background thread.

A `Prefetcher` runs a generator of prepared steps (read, split, moved) on a
daemon thread and hands them over through a bounded channel, at most ``depth``
steps ahead. States of the producer thread::

    running ──put──▶ (channel full) waiting ──consumer takes one──▶ running
       │ source ends / raises                  │ consumer closes or drops the Prefetcher
       ▼                                       ▼
    puts END or the exception, exits        wakes, closes the generator, exits

The thread never holds a reference to the `Prefetcher`, so dropping it runs its
finalizer, which closes the channel and lets the thread end. A producer busy
inside the source (a slow read) ends once that read returns. `InlineSteps` is
the same interface with no thread (prefetch depth 0).

At interpreter exit no producer may still be alive: torch aborts the process
(``terminate called without an active exception``) when a thread that ran torch
ops is torn down during finalization. An `atexit` hook closes every producer's
channel and joins its thread (for at most `EXIT_JOIN_SECONDS`), whatever became
of its `Prefetcher`: still referenced, dropped or closed.

The first step of a pass is made on the caller's thread, with torch's generator, as
one device's loop makes it: a ``DataLoader`` seeded by ``torch.manual_seed`` draws its
shuffle there, so the order is one device's. The thread, started then, draws from a
stream of its own seeded without a draw from torch's generator (from its initial seed
and a pass count), so the caller's later draws are one device's too; what the source
itself draws for later batches (random augmentations) comes from that stream.

`default_depth` decides when prefetching pays: only when the steps are copied to
a CUDA device (the copy overlaps the step). On CPU replicas there is nothing to
overlap, and a producer thread only competes with the training loop for the GIL
(measured in docs/design.md), so the default there is no thread.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import threading
import weakref
from collections.abc import Generator, Sequence
from typing import Any

import torch

from ..runtime.random import RandomStreams
from .ahead import ReadAhead

__all__ = ["DEFAULT_CUDA_DEPTH", "InlineSteps", "Prefetcher", "default_depth", "stop_all"]

THREAD_NAME = "mirrored-input-prefetch"
DEFAULT_CUDA_DEPTH = 2
EXIT_JOIN_SECONDS = 10.0

_END = object()


def _stream_seed() -> int:
    """The prefetch thread's stream, from the state of torch's CPU generator on the
    caller's thread (read, not drawn from: the caller's next draws stay one device's):
    a pass after other draws (the next epoch's shuffle) gets another stream, and the
    same program seeded alike gets the same streams, whatever ran before in the
    process (a count of passes per process made a second identically seeded run in a
    notebook differ from the first)."""
    state = torch.default_generator.get_state().numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(state, digest_size=8).digest(), "little")


class _Failure:
    """The exception that ended the producer, carried to the consumer."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Channel:
    """A bounded single-producer, single-consumer hand-off that can be closed."""

    def __init__(self, depth: int, keep: collections.deque[Any] | None = None) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._items: collections.deque[Any] = collections.deque()
        self._depth = depth
        self._closed = False
        self.producer_waiting = False
        self.keep = keep  # where closing leaves the steps read and not handed out

    def put(self, item: Any) -> bool:
        """Appends ``item`` once there is room; False if the channel closed (``item``
        then goes to ``keep``, if any, else is dropped)."""
        with self._cond:
            while len(self._items) >= self._depth and not self._closed:
                self.producer_waiting = True
                self._cond.wait()
                self.producer_waiting = False
            if self._closed:
                if self.keep is not None and not isinstance(item, _Failure) and item is not _END:
                    self.keep.append(item)
                return False
            self._items.append(item)
            self._cond.notify()
            return True

    def get(self) -> Any:
        """Takes the oldest item, waiting for one."""
        with self._cond:
            while not self._items:
                self._cond.wait()
            item = self._items.popleft()
            self._cond.notify()
            return item

    def close(self) -> bool:
        """Drops what is queued (or leaves it in ``keep``) and wakes the producer; True
        if it was waiting for room."""
        with self._cond:
            self._closed = True
            if self.keep is not None:
                self.keep.extend(i for i in self._items
                                 if not isinstance(i, _Failure) and i is not _END)
            self._items.clear()
            self._cond.notify_all()
            return self.producer_waiting


def default_depth(devices: Sequence[torch.device], fetch_to_device: bool) -> int:
    """The prefetch depth when the options leave it unset: `DEFAULT_CUDA_DEPTH` when
    steps are copied to a CUDA device, else 0 (no thread).

    Example:
        >>> default_depth([torch.device("cpu"), torch.device("cpu")], True)
        0
    """
    if fetch_to_device and any(d.type == "cuda" for d in devices):
        return DEFAULT_CUDA_DEPTH
    return 0


# Every producer thread still alive, with its channel: what the exit hook stops.
_producers: dict[threading.Thread, _Channel] = {}
_producers_lock = threading.Lock()


def stop_all(timeout: float = EXIT_JOIN_SECONDS) -> list[threading.Thread]:
    """Closes every producer's channel and joins its thread; returns those still alive
    after ``timeout`` seconds (a source stuck in a read). Runs at interpreter exit."""
    with _producers_lock:
        producers = list(_producers.items())
    for _, channel in producers:
        channel.close()
    alive = []
    for thread, _ in producers:
        if thread is not threading.current_thread():
            thread.join(timeout)
        if thread.is_alive():
            alive.append(thread)
    return alive


atexit.register(stop_all)


def _produce(steps: Generator[Any, None, None], channel: _Channel,
             streams: RandomStreams) -> None:
    try:
        _produce_all(steps, channel, streams)
    finally:
        with _producers_lock:
            _producers.pop(threading.current_thread(), None)


def _produce_all(steps: Generator[Any, None, None], channel: _Channel,
                 streams: RandomStreams) -> None:
    try:
        # The source's random draws (augmentations, shuffles) come from a stream of
        # its own, seeded on the consumer's thread: drawing from torch's shared CPU
        # generator here would race with the replicas' seeds and make seeded runs
        # differ with thread timing.
        with streams.mode(0):
            try:
                for step in steps:
                    if not channel.put(step):
                        return
            finally:
                steps.close()
    except BaseException as error:  # every failure must reach the consumer
        channel.put(_Failure(error))
        return
    channel.put(_END)


class Prefetcher:
    """Runs ``steps`` on a background thread, at most ``depth`` steps ahead of `next_step`.

    Args:
        steps: a generator of prepared steps; closed when the prefetcher stops.
        depth: how many prepared steps may wait in the channel (>= 1).
        ahead: where a prefetcher closed or dropped before the end leaves the steps
            it read and did not hand out, in order (a one-shot source's next pass takes
            them first: `ReadAhead`; a re-iterable source's, ``keeps=False``, drops
            them); a read in progress when it closes ends there too, and the next pass
            waits for it (`ReadAhead.settle`).

    Example:
        >>> p = Prefetcher((i * i for i in range(3)), depth=2)
        >>> [p.next_step() for _ in range(3)]
        [0, 1, 4]
        >>> p.next_step()
        Traceback (most recent call last):
        ...
        StopIteration
    """

    def __init__(self, steps: Generator[Any, None, None], depth: int,
                 ahead: ReadAhead | None = None) -> None:
        self._steps = steps
        self._ahead = ahead
        self._channel = _Channel(depth, None if ahead is None or not ahead.keeps
                                 else ahead.steps)
        self._done = False
        self._thread: threading.Thread | None = None  # (started after the first step)
        self._finalizer: Any = weakref.finalize(self, steps.close)

    def next_step(self) -> Any:
        """The next prepared step.

        Raises:
            StopIteration: the steps ran out (or the prefetcher was closed).
            BaseException: whatever ended the steps, re-raised here, once.
        """
        if self._done:
            raise StopIteration
        if self._thread is None:
            return self._first()
        item = self._channel.get()
        if item is _END:
            self._finish()
            raise StopIteration
        if isinstance(item, _Failure):
            self._finish()
            raise item.error
        return item

    def _first(self) -> Any:
        """The first step, made on the caller's thread with the caller's random
        generator, as one device's loop makes it (a ``DataLoader`` draws its shuffle
        from torch's generator there); then the thread starts on the rest, with a
        stream seeded without a draw from that generator, so the caller's next draws
        (dropout, ...) are one device's too."""
        try:
            step = next(self._steps)
        except BaseException:
            self._done = True
            self._finalizer()
            raise
        streams = RandomStreams([0])
        streams.seed(_stream_seed())
        thread = threading.Thread(target=_produce, args=(self._steps, self._channel, streams),
                                  name=THREAD_NAME, daemon=True)
        with _producers_lock:
            _producers[thread] = self._channel
        self._finalizer.detach()
        self._thread = thread
        thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._channel, thread, self._ahead)
        return step

    def _finish(self) -> None:
        self._done = True
        self._finalizer()
        if self._thread is not None:
            self._thread.join()  # it has put its last item and is returning

    def close(self) -> None:
        """Stops the thread: at once if it waits for room, else after its current step."""
        if self._done:
            return
        self._done = True
        self._finalizer()


def _stop(channel: _Channel, thread: threading.Thread, ahead: ReadAhead | None = None) -> None:
    """Closes ``channel``; waits for its producer if it waits for room. One still
    inside a read of a one-shot source leaves what it reads in ``ahead``, which the
    next pass waits for."""
    if channel.close():
        if thread is not threading.current_thread():
            thread.join()
    elif ahead is not None and thread.is_alive():
        ahead.producer = thread


class InlineSteps:
    """`Prefetcher`'s interface without a thread: each step is prepared when asked for.

    Example:
        >>> InlineSteps(i for i in [1, 2]).next_step()
        1
    """

    def __init__(self, steps: Generator[Any, None, None]) -> None:
        self._steps = steps

    def next_step(self) -> Any:
        """The next step; `StopIteration` at the end; the steps' own errors as they come."""
        return next(self._steps)

    def close(self) -> None:
        """Closes the steps' generator."""
        self._steps.close()
