"""How a cross-worker call waits (`CallWatch.wait`), against fake works that end the
way Gloo's do: a poll that ends just before the work completes is not a failure; a
failed work names its failure; a work that never ends times out."""

from __future__ import annotations

import datetime
import time

import pytest

from mirrored import CollectiveTimeoutError, WorkerFailureError
from mirrored._src.comm.call_identity import CallLedger
from mirrored._src.comm.watch import CallWatch


class _CompletesAsThePollEnds:
    """Gloo's ``wait(timeout)`` raises "Operation timed out!" when the work is not
    done at the end of the poll; here it completes right after, before the waiter asks
    ``is_completed`` (a race seen under load)."""

    def __init__(self) -> None:
        self.completed = False
        self.waits = 0

    def wait(self, timeout: datetime.timedelta) -> bool:
        self.waits += 1
        if not self.completed:
            self.completed = True
            raise RuntimeError("Operation timed out!")
        return True

    def is_completed(self) -> bool:
        return self.completed


class _Failed:
    def wait(self, timeout: datetime.timedelta) -> bool:
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    def is_completed(self) -> bool:
        return True


class _FailsAsThePollEnds:
    """A poll ends ("timed out"), then the work completes with a failure before the
    waiter asks ``is_completed``: the failure, not the poll's end, is reported."""

    def __init__(self) -> None:
        self.completed = False

    def wait(self, timeout: datetime.timedelta) -> bool:
        if not self.completed:
            self.completed = True
            raise RuntimeError("Operation timed out!")
        raise RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    def is_completed(self) -> bool:
        return self.completed


class _Never:
    def wait(self, timeout: datetime.timedelta) -> bool:
        time.sleep(timeout.total_seconds())
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return False


def test_a_work_that_completes_as_its_poll_ends_is_done_not_failed():
    ledger = CallLedger()
    works = [_CompletesAsThePollEnds(), _CompletesAsThePollEnds()]
    CallWatch(None, ledger, 0, 5.0).wait(works, 1, "reduce_packed(SUM of float32[4])")
    assert ledger.broken is None and [w.waits for w in works] == [2, 2]


def test_a_failed_work_is_a_worker_failure_naming_the_process_groups_error():
    ledger = CallLedger()
    with pytest.raises(WorkerFailureError, match=r"reduce_packed\(SUM\) \(collective #3\) "
                       r"failed on worker 1: the process group failed \(RuntimeError: "
                       r".*Connection closed by peer\)"):
        CallWatch(None, ledger, 1, 5.0).wait([_Failed()], 3, "reduce_packed(SUM)")
    assert ledger.broken is not None and "Connection closed by peer" in ledger.broken


def test_a_work_that_fails_as_its_poll_ends_names_its_failure_not_the_poll():
    ledger = CallLedger()
    with pytest.raises(WorkerFailureError, match=r"the process group failed \(RuntimeError: "
                       r".*Connection closed by peer\)") as caught:
        CallWatch(None, ledger, 0, 5.0).wait([_FailsAsThePollEnds()], 4, "agree(steps)")
    assert "timed out" not in str(caught.value)


def test_a_work_that_never_completes_times_out_within_the_bound():
    ledger = CallLedger()
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match=r"worker 0 waited 0.2 s in agree\(steps\) "
                       r"\(collective #2\) for peers that never joined"):
        CallWatch(None, ledger, 0, 0.2).wait([_Never()], 2, "agree(steps)")
    assert time.monotonic() - start < 0.2 + 1.0 and ledger.broken is not None
