"""How `run_multi_process` starts its ranks (see `testing`): the multiprocessing
context, and a rank's two ways of ending with the caller."""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["START_METHODS", "exit_with_caller", "process_context"]

# What the fork server imports once, before it forks any rank (torch._dynamo: torch
# imports it at an optimizer's first step, for seconds).
_PRELOAD = ["torch", "torch._dynamo", "mirrored"]
START_METHODS = ("forkserver", "spawn")


def process_context(start_method: str = "forkserver") -> Any:
    """The multiprocessing context `run_multi_process` starts ranks with: "forkserver"
    (on Linux; "spawn" elsewhere) or "spawn". The fork server is the process's one
    (multiprocessing keeps a single server): started here, it preloads torch,
    ``torch._dynamo`` and this library besides what the program asked it to; started
    earlier by the program, it keeps what it loaded then. Its children start with the
    server's environment (`run_multi_process` hands each rank the caller's).

    Example:
        >>> process_context("spawn").get_start_method()
        'spawn'
    """
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be one of {START_METHODS}; got {start_method!r}")
    if start_method == "forkserver":  # (not on macOS: forking there is unsafe)
        if not sys.platform.startswith("linux"):
            return multiprocessing.get_context("spawn")
        ctx = multiprocessing.get_context("forkserver")
        server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
        asked = list(getattr(server, "_preload_modules", []))  # the program's own
        # (once the server runs this has no effect: it keeps what it imported)
        ctx.set_forkserver_preload(list(dict.fromkeys([*asked, *_PRELOAD])))
        return ctx
    return multiprocessing.get_context(start_method)


def exit_with_caller(alive: Connection) -> None:
    """Runs first in a rank: it ends when the caller does, by two means.

    A thread waits on ``alive``, the read end of a pipe whose only write end the
    caller holds, and at its EOF kills the rank's process group (what the rank
    started too). And a forked rank is killed by the kernel when its parent, the fork
    server, ends (``PR_SET_PDEATHSIG``), even while a thread of it holds the GIL for
    good (seen: a Gloo thread's teardown waiting for the GIL the main thread held,
    so the watcher never ran); the server ends with the caller once no rank holds its
    inherited end of the server's own liveness pipe: the rank closes it (other
    children of the server, started through `process_context` directly, or children
    the caller forked, still hold it while they live). The server ends a moment after
    the caller, so the watcher usually kills the group first; when the signal wins,
    or the GIL is held, what the rank started survives it. (A spawned rank's parent
    is the caller: the signal would always win; it has the watcher only.)

    Example:
        `run_multi_process` calls it first in every rank; called in any other process
        it would tie that process's life to its parent's, so nothing else calls it.
    """
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if (sys.platform.startswith("linux") and fd is not None
            and getattr(server, "_forkserver_pid", 0) is None):  # a forked rank
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]
        parent = os.getppid()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent ended before that
            os._exit(70)
    threading.Thread(target=_watch, args=(alive,), daemon=True,
                     name="mirrored-exit-with-parent").start()


def _watch(alive: Connection) -> None:
    """Runs in a child: when the caller is gone, end this rank and what it started.
    ``alive``: the read end of a pipe whose only write end the caller holds, so it
    reads EOF once the caller exits or is killed."""
    with contextlib.suppress(EOFError, OSError):
        while True:
            alive.recv_bytes()
    if hasattr(os, "killpg") and os.getpgid(0) == os.getpid():
        os.killpg(0, signal.SIGKILL)  # this rank's own group, itself included
    os._exit(70)
