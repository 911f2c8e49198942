"""`PeerMonitor`: how a worker learns that a peer died or left.

Each worker beats a counter, with how many collectives it has started and completed,
into the job's store; a peer whose counter stops moving for ``failure_timeout``
seconds is dead. A worker that leaves (``Job.close``) writes ``exit`` with its counts,
so the others can tell a peer that left mid-collective (gone) from one that
finished its calls. Verdicts rest on evidence only: when the store itself (hosted by
worker 0) stops answering, worker 0 is dead once it stayed silent for the failure
timeout, and another peer only if its beat had already stopped for that long while
the store still answered, never merely because its beats can no longer be read.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections import deque
from typing import Any

__all__ = ["PeerMonitor"]

_log = logging.getLogger("mirrored")


RECENT = 4  # collectives whose identities a heartbeat carries (see `PeerMonitor.diverged`)


def _key(rank: int) -> str:
    return f"heartbeat/{rank}"


class PeerMonitor:
    """Beats this worker's heartbeat into ``store`` and watches the peers' beats.

    A heartbeat is ``"<count> <started> <completed> <calls>"`` (``calls``: the
    identities of its latest `RECENT` started collectives, ``seq:ident`` in hex,
    comma-separated, or ``-``: see `diverged`), or ``"exit <started>
    <completed> <reason> <dead>"`` once a worker left (``reason``: the exception it
    left on, e.g. ``KeyboardInterrupt``, ``-`` for a normal departure; ``dead``: the
    peers it saw die, comma-separated, or ``-``; the others believe it). ``interval`` (a
    tenth of the failure timeout, between 0.05 and 1 s) is how often it beats and looks.

    Example:
        >>> import torch.distributed as dist
        >>> monitor = PeerMonitor(dist.HashStore(), rank=0, world_size=1, failure_timeout=5.0)
        >>> monitor.dead_peers(), monitor.left_peers()
        ([], {})
        >>> monitor.stop()
    """

    def __init__(self, store: Any, *, rank: int, world_size: int,
                 failure_timeout: float, hosted_by_0: bool = True) -> None:
        self.rank = rank
        self.world_size = world_size
        self.failure_timeout = failure_timeout
        self.interval = min(1.0, max(0.05, failure_timeout / 10))
        self.started = 0  # collectives this worker has started / completed
        self.completed = 0
        self.failed = False  # this worker's communication failed (see `stop`)
        self._store = store
        self._hosted_by_0 = hosted_by_0  # (torchrun's agent may host it instead)
        self._peers = [r for r in range(world_size) if r != rank]
        now = time.monotonic()
        self._seen: dict[int, tuple[bytes, float]] = {r: (b"", now) for r in self._peers}
        self._progress: dict[int, int] = {}
        self._left: dict[int, tuple[int, int, str]] = {}
        self._dead: list[int] = []
        self._reported: set[int] = set()  # dead according to a peer that left
        self._last_read = now  # when the store last answered
        self._beats = 0
        self._armed = False  # no verdicts until every peer has joined (see arm)
        self._recent: deque[tuple[int, int]] = deque(maxlen=RECENT)  # (seq, identity)
        self._calls: dict[int, dict[int, int]] = {}  # each peer's, as last read
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="mirrored-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._beats += 1
        # (a copy first: the calling thread appends while this thread beats)
        calls = ",".join(f"{s}:{i:x}" for s, i in tuple(self._recent)) or "-"
        self._store.set(_key(self.rank),
                        f"{self._beats} {self.started} {self.completed} {calls}")

    def note(self, started: int, completed: int, identity: int = 0) -> None:
        """This worker's counts of started and completed collectives, and the identity
        of collective ``started`` (0: none known), published at the next beat."""
        self.started, self.completed = started, completed
        recent = self._recent
        if identity and (not recent or recent[-1][0] != started):
            recent.append((started, identity))

    def diverged(self) -> tuple[int, list[int]] | None:
        """The first of this worker's latest collectives that a peer, by its last beat,
        made as another call (another identity at the same number), and those peers;
        ``None``: none found. Workers that sit in different collectives wait for each
        other until a timeout (a header's all-gather never meets a launched gradient
        bucket's exchange); this names the disagreement within a beat or two."""
        for seq, identity in list(self._recent):
            peers = [r for r, calls in list(self._calls.items())
                     if calls.get(seq, identity) != identity]
            if peers:
                return seq, peers
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                present = [r for r in self._peers if self._store.check([_key(r)])]
                values = self._store.multi_get([_key(r) for r in present]) if present else []
            except Exception:  # the store's host (worker 0) may be gone
                if self._stop.is_set() or (self._hosted_by_0 and 0 in self._left):
                    return  # (it left, its store with it: nothing more to beat or read)
                self._judge(time.monotonic(), store_alive=False)
                continue
            now = self._last_read = time.monotonic()
            for r, value in zip(present, values, strict=True):
                head, started, completed, reason, reported = _parse(value)
                self._progress[r] = started
                if head != b"exit":
                    self._calls[r] = _calls(value)
                if head == b"exit" and r not in self._left:
                    self._left[r] = (started, completed, reason)
                    _log.info("worker %d: worker %d left the job after %s collectives%s",
                              self.rank, r, completed, f" ({reason})" if reason else "")
                    # Deaths it saw are evidence here too: the survivors name the dead
                    # worker, not the one that left after seeing it die.
                    self._reported.update(d for d in reported if d != self.rank)
                if value != self._seen[r][0]:
                    self._seen[r] = (value, now)
            self._judge(now, store_alive=True)

    def _judge(self, now: float, *, store_alive: bool) -> None:
        if not self._armed:
            return
        limit = self.failure_timeout
        # Without the store, time stops at its last answer for every peer but its host.
        dead = sorted(r for r in self._peers if r not in self._left and (
            r in self._reported
            or (now if store_alive or r == 0 else self._last_read) - self._seen[r][1] > limit))
        for r in set(dead) - set(self._dead):
            _log.warning("worker %d: worker %d failed (no heartbeat for %g s)",
                         self.rank, r, limit)
        self._dead = dead

    def arm(self) -> None:
        """Starts judging peers (call once every worker has joined the job)."""
        now = self._last_read = time.monotonic()
        self._seen = {r: (value, now) for r, (value, _) in self._seen.items()}
        self._armed = True

    def dead_peers(self) -> list[int]:
        """The workers whose heartbeat stopped (sorted)."""
        return list(self._dead)

    def left_peers(self) -> dict[int, tuple[int, int, str]]:
        """Workers that left -> how many collectives each had started and completed,
        and the exception it left on ("" for none)."""
        return dict(self._left)

    def progress(self) -> dict[int, int]:
        """Each peer's count of started collectives, as last seen."""
        return dict(self._progress)

    def stop(self, *, announce: bool = True, reason: str = "", host: bool = False) -> None:
        """Stops beating; with ``announce``, tells the peers this worker left (on the
        exception named by ``reason``, if any) and which peers it saw die.

        The ``host`` of the store (worker 0, outside torchrun) leaving after a death, on
        an exception, or after its communication ``failed`` (an error it caught, then
        closed) keeps the store up until every peer has left or is dead, at most
        ``failure_timeout`` plus three beats: its peers read its record and the calls
        their own errors list there, so they name the dead worker rather than the host
        whose store vanished. Leaving normally, it keeps the store up until every peer
        has left, at most two beats: a peer still running reads its record in that
        time (each reads every beat), so if that peer then makes a collective the host
        never joins, it is told at once that worker 0 left after its last collective,
        not, a failure timeout later, that worker 0 died."""
        self._stop.set()
        self._thread.join()
        if announce:
            dead = ",".join(str(r) for r in self._dead) or "-"
            with contextlib.suppress(Exception):  # the store is gone already
                self._store.set(_key(self.rank),
                                f"exit {self.started} {self.completed} {reason or '-'} {dead}")
            if host:
                trouble = self._dead or reason or self.failed
                self._linger(time.monotonic() + (self.failure_timeout + 3 * self.interval
                                                 if trouble else 2 * self.interval + 0.1))
        self._store = None  # its connection closes now

    def depart(self, *, host: bool) -> None:
        """`stop` on the job's departure (its ``close()``, or the job dropped or the
        interpreter exiting without it), on the exception being handled, if any."""
        handling = sys.exc_info()[0]
        if handling is None and not threading.main_thread().is_alive() and not (
                hasattr(sys, "ps1") or sys.flags.interactive):
            # A program exiting (the job's finalizer runs from atexit, after the main
            # thread ended): an exception that ended it was printed and kept as
            # sys.last_type; the peers then name this worker as failed on it, rather
            # than as one that skipped their collective. (Interactive sessions keep
            # every displayed error there: not used.)
            handling = getattr(sys, "last_type", None)
        self.stop(reason="" if handling is None else handling.__name__, host=host)

    def _linger(self, deadline: float) -> None:
        waiting = [r for r in self._peers if r not in self._left and r not in self._dead]
        while waiting and time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                waiting = [r for r in waiting if self._store.check([_key(r)]) and
                           not self._store.get(_key(r)).startswith(b"exit")]
            if waiting:  # (peers closing with this worker leave within milliseconds)
                time.sleep(min(self.interval / 2, 0.02))


def _calls(value: bytes) -> dict[int, int]:
    """A heartbeat's recent collectives: number -> identity (none from an older beat).

    Example:
        >>> _calls(b"7 12 11 11:a,12:ff"), _calls(b"7 0 0 -"), _calls(b"7 3 3")
        ({11: 10, 12: 255}, {}, {})
    """
    parts = value.split(b" ")
    if len(parts) < 4 or parts[3] == b"-":
        return {}
    return {int(s): int(i, 16) for s, _, i in (c.partition(b":") for c in parts[3].split(b","))}


def _parse(value: bytes) -> tuple[bytes, int, int, str, list[int]]:
    """A heartbeat ``"<count> <started> <completed>"`` or a departure ``"exit <started>
    <completed> <reason or -> <dead peers, comma-separated, or ->"``."""
    parts = value.split(b" ")
    head, started, completed = [*parts, b"0", b"0"][:3]
    reason = parts[3].decode() if len(parts) > 3 and parts[3] != b"-" else ""
    dead = ([int(r) for r in parts[4].split(b",")]
            if len(parts) > 4 and parts[4] != b"-" else [])
    return head, int(started), int(completed), reason, dead
