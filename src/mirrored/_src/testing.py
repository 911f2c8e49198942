"""`run_multi_process`: run a function in several fresh worker processes wired like
torchrun, for tests of multi-worker code on one machine.

Each rank is a child process in its own process group with torchrun's variables set.
On Linux it is forked from one server process that imported torch and this library
once (multiprocessing's "forkserver", started at the first call and kept for the
caller's life): a rank starts in milliseconds instead of importing torch for seconds.
Elsewhere, or with ``start_method="spawn"``, each rank is a fresh interpreter. Either
way a rank gets the caller's environment as it is at the call. A forked rank differs
from a fresh one in what was fixed when the server started: what torch read from the
environment at its import (``TORCH_LOGS``, ``TORCHDYNAMO_*``: pass them with "spawn"),
the string-hash seed (the same on every rank), the server's stdout/stderr and limits;
NumPy's global random state is reseeded in each rank, as Python's is.
A rank sends back one pickled report (its return value, or its exception's traceback)
through its own pipe, runs what a normal exit runs (``atexit`` functions, weakref
finalizers), then leaves with ``os._exit`` (no interpreter teardown to hang in). The
parent waits on every pipe and process sentinel until all ranks reported, one failed
(the others then get a short grace period), or the deadline passed; on every path it
kills each rank's process group and the rank, so no rank outlives a call, nor the caller.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from .errors import MirroredError
from .processes import START_METHODS, exit_with_caller, process_context

__all__ = ["START_METHODS", "MultiProcessError", "find_free_port", "process_context",
           "run_multi_process"]

_FAILURE_GRACE_SECONDS = 3.0  # how long the other ranks may still report after a failure
_JOIN_SECONDS = 10.0  # a SIGKILLed child is gone well within this


class MultiProcessError(MirroredError, RuntimeError):
    """A rank of `run_multi_process` raised or died before reporting a result.

    Attributes:
        rank: the lowest failed rank, whose report heads the message.
        failures: each failed rank's one-line summary, by rank.
        remote_traceback: ``rank``'s formatted traceback ("" if it died without one).
    """

    def __init__(self, message: str, *, rank: int, failures: Mapping[int, str],
                 remote_traceback: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.failures = dict(failures)
        self.remote_traceback = remote_traceback


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it).

    Example:
        >>> 1 <= find_free_port() <= 65535
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def _summary(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = f"{type(error).__qualname__}: {text[0]}" if text else type(error).__qualname__
    return line if len(line) <= 300 else line[:297] + "..."


def _child_main(rank: int, env: dict[str, str], payload: bytes, conn: Connection,
                num_threads: int, alive: Connection) -> None:
    """Entry point of one rank (runs in the child). ``env``: its whole environment (a
    forked child has the fork server's)."""
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not POSIX
        os.setpgid(0, 0)  # own group: the parent can kill what this rank starts
    exit_with_caller(alive)
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    if (numpy_random := sys.modules.get("numpy.random")) is not None:  # (the server's)
        numpy_random.seed()  # each rank its own global state, as a fresh process has
    torch.set_num_threads(num_threads)
    report: tuple[str, Any, str]
    try:
        fn, args, kwargs = pickle.loads(payload)
        report = ("ok", fn(*args, **kwargs), "")
    except BaseException as e:  # report everything, SystemExit included
        report = ("error", f"raised {_summary(e)}", "".join(traceback.format_exception(e)))
    try:
        data = pickle.dumps(report)
    except Exception as e:
        data = pickle.dumps(("error", f"returned a value that cannot be pickled: {_summary(e)}",
                             "".join(traceback.format_exception(e))))
    code = 0 if report[0] == "ok" else 1
    try:
        conn.send_bytes(data)
        conn.close()
        # What a script's normal exit runs (weakref finalizers included: a job that was
        # never closed leaves the way it would at exit), without the teardown.
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError, AttributeError):
                stream.flush()
        os._exit(code)


def _check(fn: object, world_size: object, args: object, kwargs: object, timeout: object,
           env: object) -> tuple[tuple[Any, ...], dict[str, Any], dict[str, str], int]:
    if not callable(fn):
        raise TypeError(f"fn must be a callable; got {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int; got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1; got {world_size}")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"timeout must be a number of seconds; got {type(timeout).__name__}")
    if not (math.isfinite(timeout) and timeout > 0):
        raise ValueError(f"timeout must be a finite number of seconds > 0; got {timeout!r}")
    if not isinstance(args, Sequence) or isinstance(args, str | bytes):
        raise TypeError(f"args must be a tuple or list; got {type(args).__name__}")
    if kwargs is not None and not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs must be a mapping or None; got {type(kwargs).__name__}")
    if env is not None and not isinstance(env, Mapping):
        raise TypeError(f"env must be a mapping of str to str or None; got {type(env).__name__}")
    env = dict(env or {})
    for key, value in env.items():
        if not (isinstance(key, str) and isinstance(value, str)):
            raise TypeError(f"env must map str to str; got {key!r}: {type(value).__name__} "
                            f"{value!r}")
    threads = env.get("OMP_NUM_THREADS", "1")
    if not (threads.strip().isdigit() and int(threads) >= 1):
        raise ValueError(f"env['OMP_NUM_THREADS'] must be an integer >= 1; got {threads!r}")
    return tuple(args), dict(kwargs or {}), env, int(threads)


def run_multi_process(fn: Callable[..., Any], world_size: int, *, args: Sequence[Any] = (),
                      kwargs: Mapping[str, Any] | None = None, timeout: float = 60.0,
                      env: Mapping[str, str] | None = None,
                      grace: float = _FAILURE_GRACE_SECONDS,
                      start_method: str = "forkserver") -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` in ``world_size`` fresh processes, one per rank, as
    torchrun would, and returns their results in rank order.

    Each child gets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``MASTER_ADDR=127.0.0.1`` and ``MASTER_PORT`` (a free port), then ``env`` on top, so
    ``torch.distributed.init_process_group("gloo")`` works as is. Children run
    ``torch.set_num_threads(1)`` unless ``env`` sets ``OMP_NUM_THREADS``. The variables
    are set after the child imports :mod:`mirrored` (and torch), before ``fn`` is loaded.

    Args:
        fn: a picklable callable (a module-level function); the children import its module.
        world_size: how many processes.
        args: positional arguments for ``fn``, the same for every rank.
        kwargs: keyword arguments for ``fn``.
        timeout: seconds for the whole run, process start-up included.
        env: extra environment variables for every child (they override the above).
        grace: once a rank failed, how long the others may still report (seconds)
            before they are killed; a test of how survivors react to a death needs
            more than the default 3 s.
        start_method: "forkserver" (the default: on Linux ranks are forked from one
            server process that imported torch, ``torch._dynamo`` and this library
            once, started at the first call and kept for the caller's life; see
            `process_context`; "spawn" elsewhere) or "spawn" (each rank a fresh
            interpreter that imports everything itself, seconds per rank: for what
            torch reads from the environment at import). Either way a rank gets the
            caller's environment as it is at the call.

    Returns:
        Each rank's return value (pickled back), in rank order.

    Raises:
        MultiProcessError: a rank raised, or died before reporting (exit code or signal).
            The message starts with the lowest failed rank, carries its traceback and
            summarizes the other failed ranks; ranks still running after a short grace
            period are killed.
        TimeoutError: some ranks had not reported when ``timeout`` passed; it names them.
            Every child is killed with its process group.
        TypeError: ``fn``, ``args`` or ``kwargs`` do not pickle, or a wrong argument type.
        ValueError: ``world_size < 1``, a non-positive ``timeout``, a bad
            ``OMP_NUM_THREADS`` in ``env``, or an unknown ``start_method``.

    Example:
        >>> import os
        >>> run_multi_process(os.getenv, 2, args=("RANK",))
        ['0', '1']
    """
    args_t, kwargs_d, env_d, threads = _check(fn, world_size, args, kwargs, timeout, env)
    try:
        payload = pickle.dumps((fn, args_t, kwargs_d))
    except Exception as e:
        raise TypeError(f"run_multi_process sends fn, args and kwargs to fresh processes, so "
                        f"they must pickle (use a module-level function, not a lambda or a "
                        f"closure); pickling failed: {_summary(e)}") from e
    deadline = time.monotonic() + timeout
    base = {"WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port())}
    ctx = process_context(start_method)
    procs: list[multiprocessing.process.BaseProcess] = []
    readers: list[Connection] = []
    alive, alive_writer = ctx.Pipe(duplex=False)  # EOF in the ranks once this process ends
    try:
        for rank in range(world_size):
            child_env = {**os.environ, **base, "RANK": str(rank), "LOCAL_RANK": str(rank),
                         **env_d}
            reader, writer = ctx.Pipe(duplex=False)
            readers.append(reader)
            proc = ctx.Process(target=_child_main, name=f"mirrored-rank-{rank}",
                               args=(rank, child_env, payload, writer, threads, alive))
            try:
                proc.start()
            finally:
                writer.close()
            procs.append(proc)
        outcome = _collect(procs, readers, deadline, grace)
    finally:
        _stop(procs)
        for reader in readers:
            reader.close()
        alive.close()
        alive_writer.close()
    return _result(outcome, procs, timeout)


class _Outcome:
    """What the parent learnt from the children."""

    def __init__(self) -> None:
        self.results: dict[int, Any] = {}
        self.failures: dict[int, tuple[str, str]] = {}  # rank -> (summary, traceback)
        self.failure_order: list[int] = []
        self.silent: set[int] = set()  # exited without a report: summary needs the exit code
        self.running: set[int] = set()


def _collect(procs: Sequence[multiprocessing.process.BaseProcess], readers: Sequence[Connection],
             deadline: float, grace: float) -> _Outcome:
    out = _Outcome()
    out.running = set(range(len(procs)))
    limit = deadline
    while out.running:
        remaining = limit - time.monotonic()
        if remaining <= 0:
            break
        waitables: list[Any] = [readers[r] for r in out.running]
        waitables += [procs[r].sentinel for r in out.running]
        ready = set(wait(waitables, timeout=remaining))
        for rank in sorted(out.running):
            reader, sentinel = readers[rank], procs[rank].sentinel
            if reader not in ready and sentinel not in ready:
                continue
            out.running.discard(rank)
            report = _read(reader)
            if report is None:
                out.silent.add(rank)
                out.failures[rank] = ("", "")
            elif report[0] == "ok":
                out.results[rank] = report[1]
                continue
            else:
                out.failures[rank] = (report[1], report[2])
            if not out.failure_order:
                limit = min(deadline, time.monotonic() + grace)
            out.failure_order.append(rank)
    return out


def _read(reader: Connection) -> tuple[str, Any, str] | None:
    """One rank's report, or ``None`` when it closed its pipe without one."""
    try:
        if not reader.poll():
            return None
        data = reader.recv_bytes()
    except (EOFError, OSError):
        return None
    try:
        report: tuple[str, Any, str] = pickle.loads(data)
    except Exception as e:
        return ("error", f"sent a result that cannot be unpickled here: {_summary(e)}",
                "".join(traceback.format_exception(e)))
    return report


def _stop(procs: Sequence[multiprocessing.process.BaseProcess]) -> None:
    # Every process group first: its id is not reused while it has a member (a forked
    # rank is reaped by the fork server at once: only a running rank is killed).
    for proc in procs:
        if proc.pid is not None and hasattr(os, "killpg"):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
    for proc in procs:
        proc.join(_JOIN_SECONDS)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "an unknown signal"
        return f"was killed by signal {name} ({-code})"
    return f"exited with code {code}"


def _result(out: _Outcome, procs: Sequence[multiprocessing.process.BaseProcess],
            timeout: float) -> list[Any]:
    n = len(procs)
    for rank in out.silent:
        out.failures[rank] = (f"{_exit_text(procs[rank].exitcode)} before reporting a result",
                              "")
    if out.failures:
        rank = min(out.failures)
        summary, remote_tb = out.failures[rank]
        others = [f"rank {r} {out.failures[r][0]}" for r in sorted(out.failures) if r != rank]
        others += [f"rank {r} was still running and was killed" for r in sorted(out.running)]
        lines = [f"run_multi_process: rank {rank} of {n} {summary}"]
        if others:
            lines.append("other ranks: " + "; ".join(others))
        if out.failure_order[0] != rank:
            lines.append(f"rank {out.failure_order[0]} was the first to fail")
        lines.append(f"\n--- traceback of rank {rank} ---\n{remote_tb.rstrip()}" if remote_tb
                     else f"(rank {rank} left no traceback; see its output above)")
        raise MultiProcessError("\n".join(lines), rank=rank,
                                failures={r: s for r, (s, _) in out.failures.items()},
                                remote_traceback=remote_tb)
    if out.running:
        running = ", ".join(map(str, sorted(out.running)))
        done = ", ".join(map(str, sorted(out.results))) or "none"
        raise TimeoutError(f"run_multi_process timed out after {timeout:g} s: rank(s) "
                           f"{running} of {n} still running (killed, with their process "
                           f"groups); rank(s) {done} finished")
    return [out.results[r] for r in range(n)]
