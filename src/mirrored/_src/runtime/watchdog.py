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

__all__ = ["COMPILE_GRACE", "IDLE_TICKS", "TICK", "USER_WINDOW", "Watchdog"]

TICK = 0.01  # seconds between two looks at a baton run
COMPILE_GRACE = 600.0  # seconds a compile may keep the baton without handing it over
USER_WINDOW = 1.0  # seconds over which user code run by a compile must use some CPU
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
            since = 0.0  # (when the baton last changed hands)
            mark: tuple[float, float] | None = None  # (CPU seconds, when): user code
            while not self._stop.acquire(timeout=TICK):
                in_flight, progress = self._state()
                if in_flight:
                    idle = 0
                    if progress != last:
                        last, since, mark = progress, time.monotonic(), None
                        continue
                    compiling, cpu = _compiling()
                    now = time.monotonic()
                    # (user code run by the compile: kept while it computes)
                    if compiling and cpu is not None and (
                            mark is None or now - mark[1] >= USER_WINDOW):
                        idle_user = mark is not None and cpu - mark[0] < USER_WINDOW / 20
                        compiling, mark = not idle_user, (cpu, now)
                    if not compiling or now - since > COMPILE_GRACE:
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


def _compiling() -> tuple[bool, float | None]:
    """Whether some thread compiles with Dynamo (holds its compile lock; never imports
    Dynamo), and the CPU seconds that thread has used if it runs user code there.

    A replica compiling a function (``torch.compile``'s first call) does not end the
    baton: the others would enter the same function while the cache is still empty
    and each compile it again (Dynamo takes the cache entry before its lock), each
    counting towards its recompile limit (8 replicas made 8 compiles: the limit).
    Run after it, they find the compiled code. While torch's code compiles (also
    waiting for Inductor's compile workers or the C++ compiler) the baton stays, up to
    `COMPILE_GRACE` seconds. User code that Dynamo runs there (a custom backend,
    ``assume_constant_result``, a fake implementation) keeps it while it computes:
    one waiting in ``threading`` or ``queue``, or using under 5 % of a CPU over
    `USER_WINDOW` seconds (a raw lock), may wait for another replica, which the baton
    would keep from running (it hung)."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    lock = getattr(convert_frame, "compile_lock", None)
    if lock is None:
        return False, None
    if lock.acquire(blocking=False):
        lock.release()
        return False, None
    found = _compiling_thread(convert_frame.__file__)  # type: ignore[union-attr]
    if found is None:
        return True, None
    ident, user, waits = found
    if not user:
        return True, None
    if waits:
        return False, None
    try:
        return True, time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (AttributeError, OSError):  # (no per-thread CPU clock: kept, up to the grace)
        return True, None


_STDLIB = os.path.dirname(threading.__file__) + os.sep


def _compiling_thread(convert_frame: str | None) -> tuple[int, bool, bool] | None:
    """``(ident, user, waits)`` of the thread inside Dynamo's ``convert_frame``: its
    innermost frame outside the standard library is not torch's (``user``), and its
    top frame is a wait in ``threading`` or ``queue`` (``waits``)."""
    torch_dir = os.path.dirname(getattr(sys.modules.get("torch"), "__file__", "") or "")
    for ident, top in sys._current_frames().items():
        frame: Any = top
        innermost = None
        while frame is not None:
            name = frame.f_code.co_filename
            if innermost is None and not (name.startswith(_STDLIB) and "-packages" not in name):
                innermost = name
            if name == convert_frame:
                waits = os.path.basename(top.f_code.co_filename) in ("threading.py", "queue.py")
                user = not innermost.startswith(torch_dir + os.sep)  # type: ignore[union-attr]
                return ident, user, waits
            frame = frame.f_back
    return None
