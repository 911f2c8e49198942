"""The watchdog of baton runs: it ends the baton of a run that stopped handing it over.

In a baton run (`Rendezvous.start`) one replica runs at a time and the others
start or resume only when it waits at a collective or returns. A replica that
blocks on anything else (a ``threading.Barrier`` shared by the replicas, a queue
another replica fills, a long computation) would keep the others from running.
The watchdog thread looks at the run every `TICK` seconds; when the baton has not
changed hands since its previous look (and no thread is compiling with Dynamo,
`_compiling`), it makes the run concurrent (every
replica runs on its thread, as in a run without baton), so such a run completes,
just later. A replica function is therefore never able to hang because of the
baton, whatever it waits on.

The thread sleeps without a timeout while no baton run is in flight (after
`IDLE_TICKS` looks at nothing): it costs nothing between bursts of work and
about one wake-up per `TICK` while baton runs follow each other.
"""

from __future__ import annotations

import _thread
import sys
import threading
from collections.abc import Callable

__all__ = ["IDLE_TICKS", "TICK", "Watchdog"]

TICK = 0.01  # seconds between two looks at a baton run
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
            while not self._stop.acquire(timeout=TICK):
                in_flight, progress = self._state()
                if in_flight:
                    idle = 0
                    if progress == last and not _compiling():
                        self._stalled()
                        last = None
                    else:
                        last = progress
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
    """Whether some thread holds Dynamo's compile lock (never imports Dynamo).

    A replica compiling a function (``torch.compile``'s first call) does not end the
    baton: the others would enter the same function while the cache is still empty
    and each compile it again (Dynamo takes the cache entry before its lock), each
    counting towards its recompile limit (8 replicas made 8 compiles: the limit).
    Run after it, they find the compiled code."""
    convert_frame = sys.modules.get("torch._dynamo.convert_frame")
    lock = getattr(convert_frame, "compile_lock", None)
    if lock is None:
        return False
    if not lock.acquire(blocking=False):
        return True
    lock.release()
    return False

