"""What identifies one cross-worker collective, and what a communicator needs from
its job.

A call's identity is (its number in the strategy's sequence, which ``run`` of the
strategy or which stretch between runs, its index within that stretch, the user's
call and its site, the signature: op, dtypes, sizes); its hash rides in the header
that the workers all-gather with the data. `CallLedger` keeps the counts, shared by
a strategy's communicators, and predicts the next call's wire sizes from the calls
seen so far (a training loop repeats itself), so that the data of a call can travel
with its header in one round trip once the workers agreed on that prediction: see
`DistributedCommunicator` for the protocol.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import sys
import sysconfig
from types import CodeType, FrameType
from typing import Protocol

import torch

__all__ = ["CallLedger", "JobLink", "UserCall", "Wire", "call_identity", "identity_hash",
           "user_call"]

Wire = tuple[tuple[str, str, int], ...]  # (kind, dtype, numel) of each data collective
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))
# Frames skipped on the way to the user's line: this library, torch, the standard
# library and installed packages. A wrapper such as tqdm takes different lines on
# different workers (a progress bar shown on the chief only), so its lines are no site.
_SKIPPED = tuple(sorted({_PACKAGE, _TORCH} | {
    os.path.abspath(p) + os.sep for k, p in sysconfig.get_paths().items()
    if k in ("stdlib", "platstdlib", "purelib", "platlib")}))
_FRIENDLY = {"__next__": "next(distributed dataset)", "__iter__": "iter(distributed dataset)",
             "AllReduceFunction.backward": "the backward pass of ReplicaContext.all_reduce"}


class JobLink(Protocol):
    """What a communicator asks of its job (`Job` implements it)."""

    rank: int
    world_size: int
    failure_timeout: float
    collective_timeout: float  # the process group's own timeout
    poll_interval: float

    def note_progress(self, started: int, completed: int, identity: int = 0) -> None:
        """This worker's counts of started and completed collectives, and the identity
        of collective ``started`` (0: unknown)."""
        ...

    def diverged(self) -> tuple[int, list[int]] | None:
        """The first of this worker's recent collectives that some peer made as another
        call, and those peers (``None``: none seen)."""
        ...

    def gone(self) -> tuple[list[int], dict[int, tuple[int, int, str]]]:
        """Dead peers, and peers that left -> (started, completed, the exception it
        left on or "")."""
        ...

    def progress(self) -> dict[int, int]:
        """Each peer's count of started collectives."""
        ...

    def note_failure(self) -> None:
        """This worker's communication failed (its store stays up for the peers)."""
        ...

    def share(self, topic: str, text: str, wait_seconds: float) -> dict[int, str]:
        """Every worker's ``text`` for ``topic`` (for error messages)."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class UserCall:
    """The library entry point the user called (``Strategy.reduce``) and where."""

    entry: str
    site: str

    def __str__(self) -> str:
        return f"{self.entry} at {self.site}"


def _frame_kind(code: CodeType) -> str | bool:
    """``False`` for a frame of the user's code, ``True`` for one skipped (torch, the
    standard library, installed packages), this library's entry name for its own."""
    filename = code.co_filename
    if filename.startswith(_SKIPPED) or filename.startswith("<frozen "):
        return code.co_qualname.lstrip("_") if filename.startswith(_PACKAGE) else True
    return False


# What each code object on the way is (a loop repeats its calls: its frames are known),
# and the `UserCall` of each (user frame, line, entry): a dict lookup per frame instead
# of prefix tests, and no string built per call. Keyed by the code object's id, with
# the object kept and compared by identity: code objects compare equal by value
# (neither their file nor their name counts), so one function copied into two files
# must not share the other's site. Both are emptied when full.
_KINDS: dict[int, tuple[CodeType, str | bool]] = {}
_CALLS: dict[tuple[int, int, str], tuple[CodeType, UserCall]] = {}


def user_call() -> UserCall:
    """The outermost frame of this library below the user's code, and the user's
    ``file.py:line`` (the first frame outside this library, torch, the standard
    library and installed packages), from the calling thread's stack."""
    frame: FrameType | None = sys._getframe(1)
    entry = "?"
    kinds = _KINDS
    while frame is not None:
        code = frame.f_code
        known_kind = kinds.get(id(code))
        if known_kind is not None and known_kind[0] is code:
            kind = known_kind[1]
        else:
            if len(kinds) >= 4096:
                kinds.clear()
            kind = _frame_kind(code)
            kinds[id(code)] = (code, kind)
        if kind is False:
            key = (id(code), frame.f_lineno, entry)
            known = _CALLS.get(key)
            if known is not None and known[0] is code:
                return known[1]
            if len(_CALLS) >= 4096:
                _CALLS.clear()
            call = UserCall(_FRIENDLY.get(entry, entry),
                            f"{os.path.basename(code.co_filename)}:{frame.f_lineno}")
            _CALLS[key] = (code, call)
            return call
        if kind is not True:
            entry = kind  # (a str: this library's entry)
        frame = frame.f_back
    return UserCall(_FRIENDLY.get(entry, entry), "?")


def identity_hash(text: str) -> int:
    """A 62-bit hash of ``text``, stable across processes (unlike ``hash``), never 0."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 2) or 1


_FIELDS = struct.Struct("<5Q")


def call_identity(key_hash: int, seq: int, run: int, index: int, examples: int) -> int:
    """A call's 62-bit identity (never 0): ``identity_hash`` of its key (kept per key: a
    loop repeats its calls) hashed with its number, its run, its index in the run and
    the examples taken so far: five packed integers, not the key's text formatted
    anew for every call.

    Example:
        >>> key = identity_hash("reduce_packed at train.py:12")
        >>> call_identity(key, 7, 3, 1, 0) == call_identity(key, 7, 3, 1, 0)
        True
        >>> call_identity(key, 7, 3, 1, 0) == call_identity(key, 8, 3, 1, 0)
        False
    """
    digest = hashlib.blake2b(_FIELDS.pack(key_hash, seq, run, index, examples),
                             digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 2) or 1


class CallLedger:
    """A strategy's count of runs and collectives, shared by its communicators.

    Example:
        >>> ledger = CallLedger()
        >>> ledger.next_phase(); ledger.phase_text()
        'in run 1'
        >>> ledger.next_phase(); ledger.phase_text()
        'after run 1'
    """

    def __init__(self) -> None:
        self.run = 0
        self.in_run = False
        self.index = 0  # collectives so far in this phase
        self.seq = 0  # collectives so far
        self.completed = 0
        self.broken: str | None = None  # set once workers may be out of step
        # The latest calls' names by number, kept here (shared by every communicator of
        # the strategy, `with_timeout`'s too) for a divergence found while waiting for
        # an earlier call (`JobLink.diverged`).
        self.texts: dict[int, object] = {}
        self.agreed: Wire | None = None  # the wire sizes every worker predicted
        self.predicted: Wire | None = None  # this worker's guess for the next call
        # call key -> [the wire sizes of the call after it, other sizes seen once since]
        self._next: dict[str, list[Wire | None]] = {}
        self._last: str | None = None
        # The run given a distributed dataset's last step (`pass_ends`), and whether calls
        # predict nothing (from that run's start until a pass or another run starts).
        self._ending = -1
        self._quiet = False
        # The global example counts of the batches runs were given (which
        # compute_average_loss may take), and digests of their elements, folded into one
        # number that every later call's identity carries: workers whose batches had
        # other sizes or contents disagree at their next collective.
        self.examples = 0

    def took_examples(self, total: int, digest: int = 0) -> None:
        """A run was given a batch whose global count is ``total`` (``digest``: a hash
        of a sample of its elements, `data.steps.sample_digest`)."""
        self.examples = (self.examples * 1_000_003 + total + 1 + digest) % (1 << 61)

    def next_phase(self) -> None:
        """A ``run`` starts or ends."""
        if not self.in_run:
            self.run += 1
            self._quiet = self.run == self._ending
        self.in_run = not self.in_run
        self.index = 0

    def phase_text(self) -> str:
        return self.describe_phase(self.in_run, self.run)

    @staticmethod
    def describe_phase(in_run: bool, run: int) -> str:
        """``in run 3``, ``after run 3`` or ``before the first run``."""
        if in_run:
            return f"in run {run}"
        return f"after run {run}" if run else "before the first run"

    def pass_ends(self) -> None:
        """A distributed dataset hands out the last step of its pass: from the start of
        the run that takes it until the next pass starts (`pass_starts`) or another run
        does, calls predict no successor. What follows a pass is another pass's
        agreement on its steps (a call without data), an epoch's reductions or other
        code, not the loop's next call: predicted, a worker would send zeros the size of
        that call (the step's gradients) and then make the call in two steps."""
        self._ending = self.run + 1

    def pass_starts(self) -> None:
        """A distributed dataset's pass starts (its agreement on the steps comes next):
        calls predict their successors again (see `pass_ends`), also where the last
        pass's last step was never run."""
        self._quiet = False
        self._ending = -1

    def enter(self, key: str, wire: Wire) -> tuple[int, Wire | None]:
        """A call starts: its number, and the predicted wire sizes of the next one: what
        has followed this call, another successor taking over once it followed twice
        in a row (a step's last call, followed by the step's first call but once a
        pass, keeps that prediction)."""
        self.seq += 1
        self.index += 1
        if self._last is not None:
            seen = self._next.get(self._last)
            if seen is None:
                self._next[self._last] = [wire, None]
            elif seen[0] == wire:
                seen[1] = None
            elif seen[1] == wire:  # twice in a row: the successor now
                seen[0], seen[1] = wire, None
            else:
                seen[1] = wire
        self._last = key
        known = self._next.get(key)
        self.predicted = None if self._quiet or known is None else known[0]
        return self.seq, self.predicted
