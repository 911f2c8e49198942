"""Bounds a user relies on in one process: a stuck ``merge_fn`` under a collective
timeout, and checkpoints that leave no partial files behind."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import mirrored
from mirrored.experimental import CommunicationOptions


@pytest.mark.timeout(30)
@pytest.mark.parametrize("replicas", [1, 2])
def test_a_stuck_merge_fn_is_bounded_by_the_timeout(replicas):
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)],
                                         communication_options=CommunicationOptions(
                                             timeout_seconds=1))
    release = threading.Event()

    def fn():
        return mirrored.get_replica_context().merge_call(lambda s: release.wait(30))

    start = time.monotonic()
    with pytest.raises(mirrored.CollectiveTimeoutError,
                       match=r"merge_fn of merge_call at test_bounds.py:\d+ did not return "
                             r"within 1 s"):
        strategy.run(fn)
    assert time.monotonic() - start < 1.0 + 2.0
    release.set()
    # The strategy stays usable, and merge_fn still sees the replicas' values.
    def add(x):
        return mirrored.get_replica_context().merge_call(
            lambda s, v: s.reduce("SUM", v), args=(x,))

    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group + 1)))
    out = strategy.experimental_local_results(strategy.run(add, args=(x,)))
    assert [t.item() for t in out] == [sum(range(1, replicas + 1))] * replicas
    strategy.close()


def test_save_removes_partial_files_a_killed_chief_left(tmp_path):
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(torch.nn.Linear(2, 1))
    (tmp_path / ".tmp-ckpt-abc123").write_bytes(b"half a checkpoint")
    manager = mirrored.CheckpointManager(strategy, tmp_path)
    assert manager.restore({"model": model}) is None
    assert not list(tmp_path.glob(".tmp-ckpt-*"))  # the chief cleans up on restore
    (tmp_path / ".tmp-ckpt-def456").write_bytes(b"half a checkpoint")
    manager.save(3, {"model": model})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000003.pt"]
    assert manager.restore({"model": model}) == 3
    strategy.close()
