"""`CallWatch`: how a communicator waits for a cross-worker collective, and what it
raises: every wait is bounded by the call's timeout and watched through the job
(`JobLink`) for dead peers and peers that left; a call whose workers disagree is a
`CollectiveMismatchError` listing each worker's call. After any of these the
strategy's calls are refused (its `CallLedger` is marked broken)."""

from __future__ import annotations

import datetime
import time
from typing import Any, NoReturn

import torch

from ..errors import CollectiveMismatchError, CollectiveTimeoutError, WorkerFailureError
from .call_identity import CallLedger, JobLink

__all__ = ["COUNT", "COUNT_HINT", "DESPITE", "EXAMPLES_HINT", "PLACES_HINT", "SHARE_SECONDS",
           "CallWatch", "short"]

# How long a worker that found a mismatch waits for its peers' calls (they find it in
# the same collective, so they answer at once unless descheduled): error path only.
SHARE_SECONDS = 5.0


# compute_average_loss's count (`collectives.all_reduce.sum_examples`), and the mark of
# one made although the batch carried its count (the loss had other rows than the batch).
COUNT = "the step's example count"
DESPITE = "the loss's rows differ from its batch's"
COUNT_HINT = ("a worker counted the step's examples for compute_average_loss with a "
              "collective where the others took the count from their batches of "
              "experimental_distribute_dataset: its per-example loss had other rows than "
              "its batch; pass global_batch_size where that can happen on some replicas only")
EXAMPLES = " [batches taken: "
EXAMPLES_HINT = ("the workers' runs were given batches of experimental_distribute_dataset "
                 "of different sizes (compute_average_loss would divide by different "
                 "counts) or contents (a sample of their integer tensors differs): their "
                 "sources differ, e.g. shuffled with another seed on each worker, while every "
                 "worker must iterate the same global batches (each keeps its replicas' rows; "
                 "seed a shuffle alike on every worker). A source that randomizes integer "
                 "tensors on each worker by design (masked token ids) while yielding the "
                 "same examples: InputOptions(experimental_compare_batches=False)")

PLACES_HINT = ("the workers are at different calls: a call made or skipped on some workers "
               "only (a strategy.reduce or a metric on the chief only, an optimizer.step() "
               "skipped on one worker) or a run (a step) skipped or added on one; every "
               "worker must make the same calls in the same order")
BUCKET, ASYNC = "gradient bucket ", " (asynchronous)"  # (`DistributedCommunicator.launch_sum`)
BUCKET_HINT = ("a mirrored optimizer's gradient bucket, launched while backward() ran, met "
               "another call: either a collective was skipped or added on some workers "
               "(every worker must make the same calls in the same order), or a worker "
               "skipped backward() (a non-finite loss, an empty batch) or ran it at another "
               "point of the step while the others ran it, and made a collective before "
               "optimizer.step(); then run backward() at the same point on every worker "
               "or pass mirror_optimizer(..., overlap=False), which sends the gradients at "
               "step()")


def _odd_ones(calls: dict[int, str]) -> tuple[tuple[int, ...], str]:
    """The workers whose call differs from that of a strict majority (3 or more
    workers), and a sentence naming them; ``((), "")`` when no majority agrees."""
    groups: dict[str, list[int]] = {}
    for r, c in sorted(calls.items()):
        groups.setdefault(c, []).append(r)
    agree = max(groups.values(), key=len)
    if len(calls) < 3 or 2 * len(agree) <= len(calls):
        return (), ""
    odd = tuple(r for r in sorted(calls) if r not in agree)
    return odd, (f". Worker{'s' * (len(odd) > 1)} {', '.join(map(str, odd))} "
                 f"differ{'s' * (len(odd) == 1)} from workers "
                 f"{', '.join(map(str, agree))}, which agree")


def _place(call: str) -> tuple[str, str]:
    """Where a call's text (``entry(what) at site (collective k in run r) [batches taken:
    ...]``) was made: its entry, site and phase, with neither its shapes nor its batches
    (workers at one place whose calls differ in shape or batches had other data)."""
    head, _, where = call.partition(EXAMPLES)[0].rpartition(" at ")
    return head.partition("(")[0], where


# Whether a profiler records on this thread (`runtime.replica_call.profiling` also reads
# the flag of one started with profile_all_threads; comm is below runtime).
_thread_profiled = torch._C._autograd._profiler_enabled


def short(text: str, limit: int = 160) -> str:
    """``text``, cut to ``limit`` characters for a message."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


class CallWatch:
    """Waits and failures of one communicator (``timeout``: its collective timeout).

    Example:
        >>> watch = CallWatch(None, CallLedger(), 0, None)
        >>> watch.wait([], 1, "nothing")
    """

    def __init__(self, job: JobLink | None, ledger: CallLedger, me: int,
                 timeout: float | None) -> None:
        self._job = job
        self._ledger = ledger
        self._me = me
        self._timeout = timeout

    def started(self, seq: int, text: object) -> None:
        """Notes the name of collective ``seq`` on the ledger (for a divergence found
        while waiting for an earlier one: `JobLink.diverged`)."""
        texts = self._ledger.texts
        texts[seq] = text
        texts.pop(seq - 8, None)  # (numbers rise by one a call)

    def wait(self, works: list[Any], seq: int, text: object) -> None:
        """Waits for ``works``, bounded by the timeout and watched through the job;
        while a profiler records, as a ``mirrored.cross-worker wait`` range naming the
        call (a worker's trace shows where it waited for its peers)."""
        if works and (_thread_profiled() or getattr(torch.autograd.profiler,
                                                     "_is_profiler_enabled", False)):
            with torch.autograd.profiler.record_function(
                    f"mirrored.cross-worker wait [worker {self._me}]: {text} "
                    f"(collective #{seq})"):
                self._wait(works, seq, text)
        else:
            self._wait(works, seq, text)

    def _wait(self, works: list[Any], seq: int, text: object) -> None:
        start = time.monotonic()
        deadline = None if self._timeout is None else start + self._timeout
        poll = self._job.poll_interval if self._job is not None else 1.0
        for work in works:
            while True:
                now = time.monotonic()
                left = poll if deadline is None else min(poll, deadline - now)
                try:  # the wait itself sleeps in C++, without the GIL: no wake-up latency
                    # (at least 1 ms: torch reads a 0 ms timeout as "no timeout")
                    if work.wait(datetime.timedelta(seconds=max(0.001, left))) is not False:
                        break  # (Gloo's wait returns False at the end of the poll)
                except RuntimeError:  # Gloo: "timed out" at the end of each poll
                    if work.is_completed():  # failed, or done right after the poll ended
                        failure = self._failure(work)
                        if failure is not None:
                            self._broken_link(failure, seq, text, time.monotonic() - start,
                                              deadline)
                        break
                if self._job is not None:
                    self.fail_if_gone(seq, text)
                    diverged = self._job.diverged()
                    if diverged is not None:  # (peers sit in other calls: no data will come)
                        at = diverged[0]
                        self.mismatch(at, self._ledger.texts.get(
                            at, text if at == seq else f"collective #{at}"))
                if deadline is not None and time.monotonic() >= deadline:
                    self.fail(CollectiveTimeoutError(
                        f"worker {self._me} waited {self._timeout:g} s in "
                        f"{text} (collective #{seq}) for peers that never joined"
                        f"{self._progress_text()}"))

    @staticmethod
    def _failure(work: Any) -> RuntimeError | None:
        """The failure of a completed ``work`` whose wait raised (``None``: it
        succeeded). A poll's wait raises "timed out" when the work is not done at the
        poll's end, and the work may complete right after, before ``is_completed`` is
        asked (seen under load, at a job's first calls): a wait on a completed work
        returns at once, or raises its failure."""
        try:
            work.wait(datetime.timedelta(seconds=0.001))
        except RuntimeError as failure:
            return failure
        return None

    def _broken_link(self, error: RuntimeError, seq: int, text: object, waited: float,
                     deadline: float | None = None) -> NoReturn:
        """A collective failed in the process group. At the group's own timeout (longer
        than the job's, so only a longer per-call timeout or none meets it) that is a
        timeout; before it, a peer's connection broke, and the job's monitor says who,
        within its bound, but never past the call's ``deadline`` (the collective
        timeout bounds every wait in a call: a failure timeout longer than it leaves
        the error nameless rather than late)."""
        limit = self._job.collective_timeout if self._job is not None else None
        if limit is not None and waited >= limit - 0.5:
            self.fail(CollectiveTimeoutError(
                f"worker {self._me} waited {waited:.0f} s in {text} "
                f"(collective #{seq}): the process group's timeout{self._progress_text()}"),
                error)
        if self._job is not None:
            # The monitor names the dead peer within its bound; a loaded machine may
            # delay its thread, so the nameless error waits 2 s more than the bound.
            give_up = (time.monotonic() + self._job.failure_timeout
                       + 3 * self._job.poll_interval + 2.0)
            if deadline is not None:
                give_up = min(give_up, deadline)
            self.fail_if_gone(seq, text, cause=error)  # (named already: even past the deadline)
            while time.monotonic() < give_up:
                self.fail_if_gone(seq, text, cause=error)
                time.sleep(self._job.poll_interval / 2)
        self.fail(WorkerFailureError(
            f"{text} (collective #{seq}) failed on worker {self._me}: the "
            f"process group failed ({type(error).__name__}: {short(str(error), 300)})"), error)

    def fail_if_gone(self, seq: int, text: object, cause: BaseException | None = None) -> None:
        assert self._job is not None  # callers check; not user input
        dead, left = self._job.gone()
        if not dead and not left:  # (every call asks: the common answer first)
            return
        me = self._me
        if dead:
            names = ", ".join(str(r) for r in dead)
            self.fail(WorkerFailureError(
                f"worker {names} failed (no heartbeat for {self._job.failure_timeout:g} s) "
                f"while worker {me} was in {text} (collective #{seq})", tuple(dead)), cause)
        # Gone: left on an exception (Ctrl-C), or inside a collective it never finished.
        during = {r: reason for r, (started, done, reason) in left.items()
                  if done < seq and (reason or seq <= started)}
        if during:
            names = ", ".join(str(r) for r in sorted(during))
            why = "; ".join(f"worker {r} on {reason}" if reason else
                            f"worker {r} inside collective #{left[r][1] + 1}"
                            for r, reason in sorted(during.items()))
            self.fail(WorkerFailureError(
                f"worker {names} left the job ({why}) while worker {me} was in {text} "
                f"(collective #{seq})", tuple(sorted(during))), cause)
        skipped = {r: done for r, (started, done, _) in left.items() if started < seq}
        if skipped:
            listing = "; ".join(f"worker {r} left after {n} collectives"
                                for r, n in sorted(skipped.items()))
            self.fail(CollectiveMismatchError(
                f"{listing}, but worker {me} called {text} as collective #{seq}: a worker "
                "skipped a collective the others made, or ended its loop early (an error "
                "it caught, a break) and closed its strategy"), cause)

    def mismatch(self, seq: int, text: object) -> NoReturn:
        mine = str(text)
        if self._ledger.examples:
            mine += f"{EXAMPLES}{self._ledger.examples:x}]"
        calls = {self._me: mine}
        if self._job is not None:  # ask every worker what it called (only on mismatch)
            calls = self._job.share(f"call-{seq}", mine, SHARE_SECONDS)
            calls = {r: calls.get(r, f"(did not answer within {SHARE_SECONDS:g} s)")
                     for r in range(self._job.world_size)}
        answered = [c for c in calls.values() if not c.startswith("(did not answer")]
        taken = {c.partition(EXAMPLES)[2] for c in answered}
        # Batches taken differ also when workers are at different calls (a run or a call
        # made on some workers only): the sources are suspect only at the same place.
        places = {_place(c) for c in answered}
        sources = len(taken) > 1 and len(places) == 1
        listing = "; ".join(f"worker {r}: {c if sources else c.partition(EXAMPLES)[0]}"
                            for r, c in sorted(calls.items()))
        # (the counting worker's own error says why it counted: `ReplicaContext._sum_examples`)
        counted = DESPITE not in mine and any(DESPITE in c for c in calls.values())
        bucket = (any(ASYNC in c for c in answered)
                  and any(BUCKET not in c for c in answered))
        hint = (f" ({COUNT_HINT})" if counted else f" ({EXAMPLES_HINT})" if sources else
                f" ({BUCKET_HINT})" if bucket else f" ({PLACES_HINT})" if len(places) > 1
                else "")
        odd, blame = _odd_ones({r: c if sources else c.partition(EXAMPLES)[0]
                                for r, c in calls.items()})
        self.fail(CollectiveMismatchError(
            f"workers made different calls as collective #{seq} (a different call, site, "
            f"op, shape or dtype, or a worker skipped or added a call); no data of it was "
            f"used: {listing}{blame}{hint}", odd))

    def _progress_text(self) -> str:
        progress = self._job.progress() if self._job is not None else {}
        if not progress:
            return ""
        return "; peers' collectives started so far: " + ", ".join(
            f"worker {r}: {n}" for r, n in sorted(progress.items()))

    def fail(self, error: Exception, cause: BaseException | None = None) -> NoReturn:
        """Marks the strategy's calls broken and raises ``error``."""
        self._ledger.broken = f"{type(error).__name__}: {short(str(error), 300)}"
        if self._job is not None:
            self._job.note_failure()
        raise error from cause

