"""Baton runs: after a short run, the replicas of the next run go one at a time (a
thread is woken only when a replica waits at a collective or returns). Results are
bitwise those of concurrent runs, and nothing a replica waits on can hang it."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

import mirrored
from conftest import cpu_strategy
from mirrored._src.runtime import watchdog

pytestmark = pytest.mark.timeout(60)


def _runtime(strategy: mirrored.MirroredStrategy) -> Any:
    return strategy._parts.runtime


def run_as(strategy: mirrored.MirroredStrategy, baton: bool, fn: Callable[..., Any],
           **kwargs: Any) -> Any:
    """``strategy.run(fn)`` as a baton run or a concurrent one; checks which it was."""
    runtime = _runtime(strategy)
    rendezvous = runtime._rendezvous
    seen: list[bool] = []
    start = rendezvous.start

    def spy(*args: Any) -> int:
        seen.append(args[2])
        return start(*args)

    runtime._last_seconds = (0.0, 0.0) if baton else (1.0, 1.0)
    rendezvous.start = spy
    try:
        return strategy.run(fn, **kwargs)
    finally:
        del rendezvous.start
        assert seen == [baton]


def replica_id() -> int:
    return mirrored.get_replica_context().replica_id_in_sync_group


def test_a_short_run_wakes_no_thread_and_a_long_one_is_concurrent(two):
    caller = threading.get_ident()
    idents = run_as(two, True, threading.get_ident)
    assert two.experimental_local_results(idents) == (caller, caller)
    runtime = _runtime(two)
    runtime._last_seconds = (0.0, 0.0)
    two.run(lambda: time.sleep(0.01))  # longer than BATON_SECONDS
    two.run(lambda: time.sleep(0.01))  # twice: both runs before the next one were long
    assert min(runtime._last_seconds) > 0.005
    barrier = threading.Barrier(2, timeout=0.5)  # concurrent: opens at once
    start = time.perf_counter()
    two.run(barrier.wait)
    assert time.perf_counter() - start < 0.5


def step(x: torch.Tensor) -> dict[str, Any]:
    """Collectives of every kind, random draws, and a backward pass that all-reduces
    its gradient mid-backward."""
    ctx = mirrored.get_replica_context()
    r = replica_id()
    w = (x * (r + 1)).requires_grad_()
    y = torch.nn.functional.dropout(w, 0.5)
    total = ctx.all_reduce("SUM", y)
    gathered = ctx.all_gather(y, axis=0)
    merged = ctx.merge_call(lambda strategy, v: strategy.reduce("MAX", v, axis=None),
                            args=(y,))
    (total * torch.rand(4)).sum().backward()
    return {"total": total.detach(), "gathered": gathered.detach(), "merged": merged,
            "grad": w.grad, "after": torch.rand(3), "mean": ctx.all_reduce("MEAN", r * 1.0)}


@pytest.mark.parametrize("n", [2, 3, 4])
def test_baton_runs_equal_concurrent_runs_bitwise(n):
    strategy = cpu_strategy(n)
    x = torch.arange(4.0) + 1
    results = {}
    for baton in (True, False, True):
        torch.manual_seed(7)
        out = run_as(strategy, baton, step, args=(x,))
        results.setdefault(baton, []).append(
            {k: strategy.experimental_local_results(v) if isinstance(
                v, mirrored.PerReplica) else (v,) for k, v in out.items()})
    strategy.close()
    first, concurrent, second = results[True][0], results[False][0], results[True][1]
    for key in first:
        for a, b, c in zip(first[key], concurrent[key], second[key], strict=True):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), key
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(c)), key
    # and the values are right: the all-reduce is the sum of each replica's draws
    ys = first["gathered"][0].view(n, 4)
    assert torch.equal(first["total"][0], sum(ys[i] for i in range(n)))
    assert torch.equal(first["merged"][0], ys.max(dim=0).values)
    assert first["mean"][0] == sum(range(n)) / n


@pytest.mark.parametrize("where", ["no collective", "before", "after", "queue"])
def test_replicas_waiting_on_each_other_outside_collectives_do_not_hang(two, where):
    # One replica blocks on something only the other can release: the baton would
    # never come to it, the watchdog makes the run concurrent.
    barrier = threading.Barrier(2, timeout=20)
    handoff: queue.Queue[int] = queue.Queue()

    def fn() -> float:
        ctx = mirrored.get_replica_context()
        if where == "queue":
            if replica_id() == 0:
                return float(handoff.get(timeout=20))
            handoff.put(41)
            return 1.0
        if where == "after":
            ctx.all_reduce("SUM", torch.ones(()))
        barrier.wait()
        if where == "before":
            return float(ctx.all_reduce("SUM", torch.ones(())))
        return 2.0

    start = time.perf_counter()
    out = run_as(two, True, fn)
    assert time.perf_counter() - start < 10 * watchdog.TICK + 5  # not a barrier timeout
    expected = {"no collective": (2.0, 2.0), "before": (2.0, 2.0), "after": (2.0, 2.0),
                "queue": (41.0, 1.0)}[where]
    assert two.experimental_local_results(out) == expected
    after = run_as(two, True, lambda: float(
        mirrored.get_replica_context().all_reduce("SUM", torch.ones(()))))
    assert two.experimental_local_results(after) == (2.0, 2.0)


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_an_exception_in_a_baton_run_releases_the_waiting_replicas(failing):
    class StepError(Exception):
        pass

    strategy = cpu_strategy(3)

    def fn() -> torch.Tensor:
        ctx = mirrored.get_replica_context()
        ctx.all_reduce("SUM", torch.ones(()))
        if replica_id() == failing:
            raise StepError("bad batch")
        return ctx.all_reduce("SUM", torch.ones(()))

    with pytest.raises(StepError, match="bad batch") as info:
        run_as(strategy, True, fn)
    assert f"replica {failing}" in "".join(info.value.__notes__)
    out = run_as(strategy, True, lambda: mirrored.get_replica_context().all_reduce(
        "SUM", torch.ones(())))
    assert [t.item() for t in strategy.experimental_local_results(out)] == [3.0] * 3
    strategy.close()


def test_a_replica_returning_early_is_a_mismatch_in_a_baton_run(two):
    def fn() -> None:
        if replica_id() == 0:
            mirrored.get_replica_context().all_reduce("SUM", torch.ones(()))

    with pytest.raises(mirrored.CollectiveMismatchError, match="returned from its function"):
        run_as(two, True, fn)


def test_thread_state_reaches_replicas_resumed_on_their_threads(two):
    def fn() -> tuple[bool, bool, torch.dtype, bool]:
        before = torch.is_grad_enabled()
        mirrored.get_replica_context().all_reduce("SUM", torch.ones(()))  # a hand-over
        return (before, torch.is_grad_enabled(), torch.get_autocast_dtype("cpu"),
                torch.is_autocast_enabled("cpu"))

    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = run_as(two, True, fn)
    assert two.experimental_local_results(out) == ((False, False, torch.bfloat16, True),) * 2


def test_nested_run_in_a_merge_fn_of_a_baton_run(two):
    def merge_fn(strategy: Any, v: Any) -> Any:
        return strategy.run(lambda a: a * 10, args=(v,))

    out = run_as(two, True, lambda: mirrored.get_replica_context().merge_call(
        merge_fn, args=(torch.tensor(float(replica_id())),)))
    assert [t.item() for t in two.experimental_local_results(out)] == [0.0, 10.0]


def test_the_watchdog_sleeps_between_bursts_and_stops_with_the_strategy(two):
    dog = _runtime(two)._watchdog
    run_as(two, True, lambda: None)
    assert dog._armed and dog._thread.is_alive()
    deadline = time.monotonic() + 5
    while dog._armed and time.monotonic() < deadline:
        time.sleep(watchdog.TICK)
    assert not dog._armed  # asleep without a timeout
    run_as(two, True, lambda: None)
    assert dog._armed
    thread = dog._thread
    two.close()
    assert not thread.is_alive()


def test_the_baton_ended_before_the_run_published_its_task_does_not_hang(two, monkeypatch):
    # The watchdog can end the baton while run still waits for a straggler of an
    # earlier run (before the task is published): then the run wakes every thread.
    executor = _runtime(two)._executor
    monkeypatch.setattr(executor, "_wait_for_stragglers",
                        lambda: time.sleep(5 * watchdog.TICK))
    out = run_as(two, True, lambda: mirrored.get_replica_context().all_reduce(
        "SUM", torch.ones(())))
    assert [t.item() for t in two.experimental_local_results(out)] == [2.0, 2.0]


def test_a_collective_with_a_timeout_makes_a_baton_run_concurrent(two):
    # The timeout measures how late the other replicas are, as in a concurrent run:
    # a replica that sleeps before its collective is already running meanwhile.
    options = mirrored.experimental.CommunicationOptions(timeout_seconds=5)

    def fn() -> float:
        if replica_id() == 1:
            time.sleep(0.2)
        return float(mirrored.get_replica_context().all_reduce(
            "SUM", torch.ones(()), options=options))

    out = run_as(two, True, fn)
    assert two.experimental_local_results(out) == (2.0, 2.0)
    assert not _runtime(two)._rendezvous.in_baton()
