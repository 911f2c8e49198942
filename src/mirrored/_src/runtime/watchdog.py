"""The watchdog of baton runs: it ends the baton of a run that stopped handing it over.

In a baton run (`Rendezvous.start`) one replica runs at a time and the others
start or resume only when it waits at a collective or returns. A replica that
blocks on anything else (a ``threading.Barrier`` shared by the replicas, a queue
another replica fills, a long computation) would keep the others from running.
The watchdog thread looks at the run every `TICK` seconds; when the baton has not
changed hands since its previous look (and no thread is compiling with Dynamo,
`_compiling`, for at most `COMPILE_GRACE` seconds), it makes the run concurrent (every
replica runs on its thread, as in a run without baton), so such a run completes,
just later. A replica function is therefore never able to hang because of the
baton, whatever it waits on.

The thread sleeps without a timeout while no baton run is in flight (after
`IDLE_TICKS` looks at nothing): it costs nothing between bursts of work and
about one wake-up per `TICK` while baton runs follow each other.
"""

from __future__ import annotations

import _thread
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["COMPILE_GRACE", "IDLE_TICKS", "TICK", "Watchdog"]

TICK = 0.01  # seconds between two looks at a baton run
COMPILE_GRACE = 60.0  # seconds a compile may keep the baton without handing it over
IDLE_TICKS = 5  # looks at no baton run before the thread sleeps without a timeout


class Watchdog:
    """Makes a stalled baton run concurrent; see the module docstring.

    Args:
        state: ``(in_flight, progress)``: whether a baton run is in flight, and a
            counter that changes whenever the baton changes hands.
        stalled: ends the baton of the run in flight.
        name: the thread's name.
    """

    def __init__(self, state: Callable[[], tuple[bool, int]], stalled: Callable[[], None],
                 name: str) -> None:
        self._state = state
        self._stalled = stalled
        self._name = name
        self._armed = False
        self._stopped = False
        self._wake = _thread.allocate_lock()
        self._wake.acquire()
        self._stop = _thread.allocate_lock()
        self._stop.acquire()
        self._thread: threading.Thread | None = None

    def arm(self) -> None:
        """A baton run starts: make sure the thread looks (one flag read when it does)."""
        if self._armed or self._stopped:
            return
        self._armed = True
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"{self._name}-watchdog",
                                            daemon=True)
            self._thread.start()
        if self._wake.locked():  # only the caller of run (one at a time) releases it
            self._wake.release()

    def _loop(self) -> None:
        while True:
            self._wake.acquire()
            if self._stopped:
                return
            last: int | None = None
            idle = 0
            since = 0.0  # (when the baton last changed hands, or this look began)
            while not self._stop.acquire(timeout=TICK):
                in_flight, progress = self._state()
                if in_flight:
                    idle = 0
                    if progress != last:
                        last, since = progress, time.monotonic()
                    elif not _compiling() or time.monotonic() - since > COMPILE_GRACE:
                        self._stalled()
                        last = None
                    continue
                last = None
                idle += 1
                if idle >= IDLE_TICKS:
                    self._armed = False
                    if not self._state()[0]:  # a run that started meanwhile re-armed it
                        break
                    self._armed = True
            if self._stopped:
                return

    def stop(self, timeout: float = 10.0) -> None:
        """Ends the thread and waits for it."""
        self._stopped = True
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.release()
        if self._wake.locked():
            self._wake.release()
        if thread is not threading.current_thread():
            thread.join(timeout)


def _compiling() -> bool:
    """Whether some thread holds Dynamo's compile lock and runs torch's code (never
    imports Dynamo).

    A replica compiling a function (``torch.compile``'s first call) does not end the
    baton: the others would enter the same function while the cache is still empty
    and each compile it again (Dynamo takes the cache entry before its lock), each
    counting towards its recompile limit (8 replicas made 8 compiles: the limit).
    Run after it, they find the compiled code. But user code that Dynamo runs while
    it traces (``assume_constant_result``, a custom op's fake implementation) waiting
    in ``threading`` or ``queue`` gets the ordinary rule: kept, a wait there for
    another replica hung. Any other wait (a raw lock) ends the baton after
    `COMPILE_GRACE` seconds without a hand-over."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    lock = getattr(convert_frame, "compile_lock", None)
    if lock is None:
        return False
    if not lock.acquire(blocking=False):
        return not _user_code_compiling(convert_frame.__file__)  # type: ignore[union-attr]
    lock.release()
    return False


_STDLIB = os.path.dirname(threading.__file__) + os.sep


def _user_code_compiling(convert_frame: str | None) -> bool:
    """Whether the thread inside Dynamo's ``convert_frame`` waits in ``threading`` or
    ``queue`` called from code that is not torch's (its innermost frame outside the
    standard library is outside torch): user code that Dynamo runs at trace time and
    that waits for another replica. (A wait torch's code makes, as Inductor's for its
    compile workers, or user code computing, such as a custom backend, is compiling.)"""
    torch_dir = os.path.dirname(getattr(sys.modules.get("torch"), "__file__", "") or "")
    for top in sys._current_frames().values():
        frame: Any = top
        waits = os.path.basename(top.f_code.co_filename) in ("threading.py", "queue.py")
        innermost = None
        while frame is not None:
            name = frame.f_code.co_filename
            if innermost is None and not (name.startswith(_STDLIB) and "-packages" not in name):
                innermost = name
            if name == convert_frame:
                return waits and not innermost.startswith(  # type: ignore[union-attr]
                    torch_dir + os.sep)
            frame = frame.f_back
    return False
