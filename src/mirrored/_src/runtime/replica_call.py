"""`RunCall`: one ``run``'s replica calls as the executor sees them, with the caller's
thread state carried to replica threads; and the small helpers of the runtime
(profiler ranges, device contexts, error notes).

The common case (every replica on the CPU where the caller is, torch's default
thread state, no profiler) is decided once per run (`RunCall.plain`): a replica on
the caller's thread then costs one flag read, the run's generation and its random
stream around the call; anything else enters what differs on an ``ExitStack``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .random import RandomStreams
from .random import state as _streams
from .thread_state import ThreadState

__all__ = ["RunCall", "add_note", "fn_name", "on_device", "profiling", "record"]

_thread_profiled = torch._C._autograd._profiler_enabled
record = torch.autograd.profiler.record_function
_get_ident = threading.get_ident


def profiling() -> bool:
    """Whether a profiler records this run: one started on this thread, or one started
    with ``profile_all_threads=True`` (which only the profiler module's flag shows)."""
    return _thread_profiled() or getattr(torch.autograd.profiler, "_is_profiler_enabled", False)


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)``, also on Python 3.10."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10
        error.__notes__ = [*getattr(error, "__notes__", []), note]


def fn_name(fn: Callable[..., Any] | None) -> str:
    """How profiler ranges name the user's function."""
    return getattr(fn, "__qualname__", None) or type(fn).__name__


@contextlib.contextmanager
def on_device(device: torch.device, as_default: bool) -> Iterator[None]:
    """A replica's function runs on ``device``: the current CUDA device, for one (so
    ``"cuda"`` and ``.cuda()`` mean it), and torch's default device where
    ``as_default``: the caller set one (``torch.device(...)``,
    ``torch.set_default_device``), which the replica's replaces. Without one, a factory
    without a device makes a CPU tensor, as in plain torch: a default device is a
    torch function mode, which every torch call goes through in Python (+40 % on a
    small MLP's step; +65 % on the README's loop on one GPU)."""
    with contextlib.ExitStack() as stack:
        if device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        if as_default:
            stack.enter_context(torch.device(device))
        yield


class RunCall:
    """One ``run``'s calls and what a replica thread needs of the caller's state. A
    fresh one per run: a straggler of an abandoned run keeps its own.

    Args:
        call: ``call(i)`` runs local replica ``i``'s function.
        fn: the user's function (named in profiler ranges).
        local: the runtime's thread-local (``.generation``: the run a thread serves).
        devices: the local replica devices.
        streams: the replicas' random streams, if any.
        threads: the intra-op thread count each replica runs with.
        state: the caller's thread state; ``None`` when it is torch's default.
        caller_device: the caller's current device.
        caller_default: the caller set a default device (a ``torch.device`` mode).
        profiling: record profiler ranges.
        plain: no profiling, and every replica is on the caller's device, the host CPU:
            the caller's thread runs a replica as is (it has the caller's state and,
            set by run, its thread count).
    """

    __slots__ = ("call", "caller_default", "caller_device", "caller_thread", "context",
                 "devices", "fn", "generation", "local", "plain", "profiling", "state", "streams",
                 "threads")

    def __init__(self, call: Callable[[int], Any], fn: Callable[..., Any] | None,
                 local: threading.local, devices: Sequence[torch.device],
                 streams: RandomStreams | None, threads: int, state: ThreadState | None,
                 caller_device: torch.device, caller_default: bool, profiling: bool,
                 plain: bool) -> None:
        self.call = call
        self.fn = fn
        self.local = local
        self.devices = devices
        self.streams = streams
        self.threads = threads
        self.state = state  # None: the caller's thread state is plain
        self.caller_device = caller_device
        self.caller_default = caller_default
        self.caller_thread = _get_ident()
        # torch keeps the user's compile settings in context variables: a replica on
        # another thread runs in a copy of the caller's (see `thread_state`).
        self.context = contextvars.copy_context()
        self.profiling = profiling
        self.generation = 0
        self.plain = plain

    def replica(self, i: int) -> Any:
        """Runs replica ``i`` on this thread (the caller's or a replica thread)."""
        if _get_ident() != self.caller_thread:
            return self.context.copy().run(self._replica, i, False)
        if not self.plain:
            return self._replica(i, True)
        local = self.local
        local.generation = self.generation
        try:
            streams = self.streams
            if streams is None:
                return self.call(i)
            saved = getattr(_streams, "stream", None)  # (`RandomStreams.call`, inlined)
            _streams.stream = streams.keys[i]
            try:
                return self.call(i)
            finally:
                _streams.stream = saved
        finally:
            local.generation = 0

    def _replica(self, i: int, on_caller: bool) -> Any:
        local = self.local
        local.generation = self.generation
        try:
            device = self.devices[i]
            if device.type == "cpu" and device == self.caller_device:
                # The common case. The caller's thread has the caller's state and its
                # thread count (set by run); a replica thread has torch's defaults,
                # which a plain caller state is.
                if on_caller:
                    return self._call(i)
                if self.state is None:
                    if torch.get_num_threads() != self.threads:
                        torch.set_num_threads(self.threads)
                    return self._call(i)
            with contextlib.ExitStack() as stack:
                if device.type != "cpu" or device != self.caller_device:
                    stack.enter_context(on_device(device, self.caller_default))
                if self.state is not None:
                    dataclasses.replace(self.state, num_threads=self.threads).apply(stack)
                elif torch.get_num_threads() != self.threads:
                    torch.set_num_threads(self.threads)
                return self._call(i)
        finally:
            local.generation = 0

    def _call(self, i: int) -> Any:
        streams = self.streams
        if not self.profiling:
            if streams is None:
                return self.call(i)
            return streams.call(i, self.call)
        with record(f"mirrored.replica {i}: {fn_name(self.fn)}"):
            if streams is None:
                return self.call(i)
            return streams.call(i, self.call)
