"""The collective contract: every broken promise raises a named error, never hangs,
and the strategy works again afterwards. Each test has a hard timeout."""

import time

import pytest
import torch

import mirrored
from mirrored.experimental import CommunicationOptions

pytestmark = pytest.mark.timeout(30)


def rid():
    return mirrored.get_replica_context().replica_id_in_sync_group


def assert_still_usable(strategy):
    def step():
        return mirrored.get_replica_context().all_reduce("SUM", torch.tensor(1.0))

    out = strategy.experimental_local_results(strategy.run(step))
    assert [t.item() for t in out] == [float(strategy.num_replicas_in_sync)] * len(out)


def test_replica_returning_early_is_a_mismatch_within_a_second(two):
    def step():
        if rid() == 1:
            return None
        time.sleep(0.05)  # let replica 1 return first, or wait in all_reduce, either way
        return mirrored.get_replica_context().all_reduce("SUM", torch.ones(2))

    start = time.perf_counter()
    with pytest.raises(mirrored.CollectiveMismatchError) as info:
        two.run(step)
    assert time.perf_counter() - start < 1.0
    message = str(info.value)
    assert "all_reduce(SUM) at test_contract.py:" in message
    assert "replica 1 (CPU:1) returned from its function" in message
    assert "replica 0 (CPU:0): waiting in all_reduce(SUM) of float32[2] at test_contract.py:" in (
        message)
    assert isinstance(info.value, ValueError)
    assert_still_usable(two)


def test_replica_returning_while_other_already_waits(two):
    def step():
        if rid() == 1:
            time.sleep(0.2)  # replica 0 is surely waiting by now
            return None
        return mirrored.get_replica_context().all_reduce("SUM", torch.ones(2))

    start = time.perf_counter()
    with pytest.raises(mirrored.CollectiveMismatchError,
                       match=r"(?s)can never complete: replica 1 \(CPU:1\) returned.*replica 0 "
                             r"\(CPU:0\): waiting in all_reduce\(SUM\)"):
        two.run(step)
    assert time.perf_counter() - start < 1.0
    assert_still_usable(two)


def test_different_collectives(two):
    def step():
        ctx = mirrored.get_replica_context()
        if rid() == 0:
            return ctx.all_reduce("SUM", torch.ones(2))
        return ctx.all_gather(torch.ones(2), axis=0)

    with pytest.raises(mirrored.CollectiveMismatchError) as info:
        two.run(step)
    lines = str(info.value).splitlines()
    assert "replicas called different collectives" in lines[0]
    assert lines[1].startswith("  replica 0 (CPU:0): all_reduce(SUM) of float32[2] at "
                               "test_contract.py:")
    assert lines[2].startswith("  replica 1 (CPU:1): all_gather(axis=0) of float32[2] at "
                               "test_contract.py:")
    assert_still_usable(two)


def test_different_shapes_name_the_path(two):
    def step():
        shape = [1] if rid() == 0 else [2]
        return mirrored.get_replica_context().all_reduce(
            "SUM", {"ok": torch.ones(3), "grad": [torch.ones(shape)]})

    with pytest.raises(mirrored.CollectiveMismatchError) as info:
        two.run(step)
    message = str(info.value)
    assert "mismatched inputs (first difference at value['grad'][0])" in message
    assert "replica 0 (CPU:0): all_reduce(SUM) of float32[1] at test_contract.py:" in message
    assert "replica 1 (CPU:1): all_reduce(SUM) of float32[2] at test_contract.py:" in message
    assert_still_usable(two)


def test_different_dtypes_and_structures(two):
    def dtypes():
        dtype = torch.float32 if rid() == 0 else torch.float64
        return mirrored.get_replica_context().all_reduce("SUM", torch.ones(2, dtype=dtype))

    with pytest.raises(mirrored.CollectiveMismatchError, match=r"float32\[2\](?s:.*)float64\[2\]"):
        two.run(dtypes)

    def structures():
        value = {"a": torch.ones(1)} if rid() == 0 else {"a": torch.ones(1), "b": torch.ones(1)}
        return mirrored.get_replica_context().all_reduce("SUM", value)

    with pytest.raises(mirrored.CollectiveMismatchError,
                       match=r"different structures \(first difference at value\['b'\]\)"):
        two.run(structures)
    assert_still_usable(two)


def test_different_reduce_ops(two):
    def step():
        op = "SUM" if rid() == 0 else "MEAN"
        return mirrored.get_replica_context().all_reduce(op, torch.ones(2))

    with pytest.raises(mirrored.CollectiveMismatchError,
                       match=r"(?s)different collectives.*all_reduce\(SUM\).*all_reduce\(MEAN\)"):
        two.run(step)
    assert_still_usable(two)


def test_timeout_lists_arrived_and_missing(strategies):
    strategy = strategies[3]
    options = CommunicationOptions(timeout_seconds=0.5)

    def step():
        if rid() == 2:
            # (late past the timeout, and by less than the 2 s a next run waits for the
            # straggler's thread, with room for a loaded machine: assert_still_usable)
            time.sleep(1.0)
        return mirrored.get_replica_context().all_reduce("SUM", torch.ones(1), options=options)

    start = time.perf_counter()
    with pytest.raises(mirrored.CollectiveTimeoutError) as info:
        strategy.run(step)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.5
    message = str(info.value)
    assert "all_reduce(SUM) at test_contract.py:" in message
    assert "timed out after 0.5 s: 1 of 3 replicas did not arrive" in message
    assert "replica 0 (CPU:0): arrived" in message
    assert "replica 1 (CPU:1): arrived" in message
    assert "replica 2 (CPU:2): missing" in message
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, mirrored.MirroredError)
    assert_still_usable(strategy)


def test_strategy_wide_timeout():
    strategy = mirrored.MirroredStrategy(
        ["CPU:0", "CPU:1"], communication_options=CommunicationOptions(timeout_seconds=0.3))

    def step():
        if rid() == 1:
            time.sleep(1.0)
        return mirrored.get_replica_context().merge_call(lambda s: 1)

    with pytest.raises(mirrored.CollectiveTimeoutError, match=r"merge_call at test_contract.py"):
        strategy.run(step)


def test_exception_in_one_replica_releases_the_waiting_one_promptly(two):
    def step():
        if rid() == 1:
            raise KeyError("bad input in replica 1")
        return mirrored.get_replica_context().all_reduce("SUM", torch.ones(1))

    start = time.perf_counter()
    with pytest.raises(KeyError, match="bad input in replica 1") as info:
        two.run(step)
    assert time.perf_counter() - start < 1.0
    assert info.value.__notes__ == ["raised in replica 1 (CPU:1) of MirroredStrategy.run"]
    assert_still_usable(two)


def test_exception_while_other_already_waits(two):
    def step():
        if rid() == 0:
            time.sleep(0.2)
            raise ArithmeticError("late failure")
        return mirrored.get_replica_context().all_gather(torch.ones(1), axis=0)

    with pytest.raises(ArithmeticError, match="late failure"):
        two.run(step)
    assert_still_usable(two)


def test_later_collectives_in_a_broken_run_raise_at_once(two):
    calls = []

    def step():
        ctx = mirrored.get_replica_context()
        try:
            ctx.all_reduce("SUM", torch.ones(rid() + 1))
        except mirrored.CollectiveMismatchError:
            calls.append(rid())
        return ctx.all_reduce("SUM", torch.ones(1))  # the run is broken: raises, no hang

    with pytest.raises(mirrored.CollectiveMismatchError):
        two.run(step)
    assert sorted(calls) == [0, 1]
    assert_still_usable(two)


def test_second_collective_skipped_by_one_replica(strategies):
    strategy = strategies[4]

    def step():
        ctx = mirrored.get_replica_context()
        ctx.all_reduce("SUM", torch.ones(1))
        if rid() != 3:
            ctx.all_reduce("MAX", torch.ones(1))

    with pytest.raises(mirrored.CollectiveMismatchError,
                       match=r"replica 3 \(CPU:3\) returned from its function"):
        strategy.run(step)
    assert_still_usable(strategy)


def test_random_breaches_never_hang_and_leave_the_strategy_usable():
    """Random sleeps, early returns, exceptions, short timeouts and mixed collectives:
    every run either succeeds with the right values or raises a named error, and the
    next run works."""
    import random

    n = 4
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(n)])
    rng = random.Random(0)
    tight = CommunicationOptions(timeout_seconds=0.03)
    outcomes = set()
    for _ in range(120):
        delays = [[rng.choice([0] * 8 + [0.002, 0.06]) for _ in range(3)] for _ in range(n)]
        early = rng.randrange(1, n) if rng.random() < 0.15 else None
        raising = rng.randrange(n) if rng.random() < 0.15 else None

        def step(delays=delays, early=early, raising=raising):
            ctx = mirrored.get_replica_context()
            r = ctx.replica_id_in_sync_group
            outs = []
            for k in range(3):
                time.sleep(delays[r][k])
                if raising == r and k == 1:
                    raise KeyError("boom")
                if early == r and k == 2:
                    return outs
                if k == 1:
                    outs.append(ctx.merge_call(lambda s, v: s.reduce("SUM", v),
                                               args=(torch.tensor(float(r)),)))
                else:
                    outs.append(ctx.all_reduce("SUM", torch.tensor(float(r + k)),
                                               options=tight))
            return outs

        try:
            out = strategy.experimental_local_results(strategy.run(step))
        except (mirrored.CollectiveTimeoutError, mirrored.CollectiveMismatchError, KeyError) as e:
            outcomes.add(type(e).__name__)
        else:
            outcomes.add("ok")
            for replica in out:
                assert [t.item() for t in replica] == [6.0, 6.0, 14.0]
        assert_still_usable(strategy)
    assert {"ok", "KeyError", "CollectiveMismatchError"} <= outcomes
