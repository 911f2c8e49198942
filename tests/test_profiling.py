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
    site = "test_profiling.py:22"
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
