"""Profiler ranges: a Chrome trace of a step names run, each replica's function and
each collective's wait and combine (replica and call site); none without a profiler."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import mirrored
from mirrored.experimental import CommunicationOptions

pytestmark = pytest.mark.timeout(60)


def train_step(x: torch.Tensor) -> torch.Tensor:
    ctx = mirrored.get_replica_context()
    assert ctx is not None
    return ctx.all_reduce("SUM", x * 2)  # the call site named in the trace


def test_a_trace_shows_run_replicas_and_collective_waits(tmp_path: Path) -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group + 1)))
    try:  # replica threads record too (torch >= 2.7)
        config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # pragma: no cover - older torch
        pytest.skip("this torch's profiler records the profiling thread only")
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        out = strategy.run(train_step, args=(x,))
    assert [v.item() for v in out.values] == [6.0, 6.0]  # 2 * (1 + 2)
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    names = [e["name"] for e in json.loads(trace.read_text())["traceEvents"]
             if e.get("ph") == "X"]
    assert "mirrored.run: train_step" in names
    assert {"mirrored.replica 0: train_step", "mirrored.replica 1: train_step"} <= set(names)
    collective = [n for n in names if n.startswith("mirrored.all_reduce(SUM)")]
    site = "test_profiling.py:23"
    # One replica waited for the other, which arrived last and combined.
    prefix = "mirrored.all_reduce(SUM)"
    assert sorted(n.split(" at ")[0] for n in collective) in (
        [f"{prefix} combine [replica 0]", f"{prefix} wait [replica 1]"],
        [f"{prefix} combine [replica 1]", f"{prefix} wait [replica 0]"])
    assert all(n.endswith(site) for n in collective), collective
    strategy.close()


def test_no_ranges_are_recorded_without_a_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    entered = []
    original = torch.autograd.profiler.record_function.__enter__

    def spy(self: torch.autograd.profiler.record_function) -> object:
        entered.append((self.name, threading.get_ident()))
        return original(self)

    monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__", spy)
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    strategy.run(train_step, args=(torch.tensor(1.0),))
    assert [n for n, _ in entered if n.startswith("mirrored.")] == []
    strategy.close()


def _profiled_worker() -> tuple[float, list[str], list[str]]:
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=30), devices=["CPU:0"])
    entered: list[str] = []
    original = torch.autograd.profiler.record_function.__enter__

    def spy(self: torch.autograd.profiler.record_function) -> object:
        entered.append(self.name)
        return original(self)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = strategy.run(train_step, args=(torch.tensor(1.0),))
        names = [e.name for e in prof.events()]
        torch.autograd.profiler.record_function.__enter__ = spy  # type: ignore[method-assign]
        strategy.run(train_step, args=(torch.tensor(1.0),))  # no profiler: no range
    finally:
        torch.autograd.profiler.record_function.__enter__ = original  # type: ignore[method-assign]
        strategy.close()
    return (float(out), [n for n in names if n.startswith("mirrored.")],
            [n for n in entered if n.startswith("mirrored.")])


@pytest.mark.multiprocess
def test_a_workers_trace_shows_where_it_waited_for_its_peers() -> None:
    results = mirrored.testing.run_multi_process(_profiled_worker, 2, timeout=50)
    for worker, (total, names, unprofiled) in enumerate(results):
        assert total == 4.0 and unprofiled == []  # 2 * 1 on each of the 2 workers
        mine = f"mirrored.cross-worker wait [worker {worker}]: "
        waits = [n for n in names if n.startswith(mine)]
        # (the call's first time: its header round, then its data)
        assert waits and all("all_reduce(SUM of float32[]) at test_profiling.py:23 "
                             "(collective 1 in run 1) (collective #1)" in w for w in waits), names
