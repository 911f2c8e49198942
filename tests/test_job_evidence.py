"""Who is blamed, and what counts as one call, across workers: a survivor names only
the dead (also when the store's host leaves after seeing the death), and a call's site
is the user's line, not a line inside a wrapper such as tqdm that differs by worker."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import mirrored
from mirrored._src.cluster.monitor import PeerMonitor


@pytest.mark.timeout(30)
def test_a_departed_peers_reported_death_is_believed_and_the_departed_is_not_dead():
    store = dist.HashStore()
    # Worker 0 left after seeing worker 2 die; worker 2's last beat is fresh.
    store.set("heartbeat/0", "exit 5 4 WorkerFailureError 2")
    store.set("heartbeat/2", "7 5 4")
    monitor = PeerMonitor(store, rank=1, world_size=3, failure_timeout=60.0)
    try:
        monitor.arm()
        deadline = time.monotonic() + 10
        while not monitor.dead_peers() and time.monotonic() < deadline:
            time.sleep(monitor.interval)
        assert monitor.dead_peers() == [2]  # worker 0's evidence, long before 60 s
        assert monitor.left_peers() == {0: (5, 4, "WorkerFailureError")}
    finally:
        monitor.stop()
    # Its own departure record lists what it saw, for the peers after it.
    assert store.get("heartbeat/1").decode().split(" ")[3:] == ["-", "2"]


@pytest.mark.timeout(30)
def test_a_peer_that_made_another_call_at_the_same_number_is_seen_diverged():
    # Each beat carries the identities of a worker's latest collectives: a peer whose
    # collective 6 is another call than this worker's is named, a peer that is behind
    # (no collective 6 yet) or made the same calls is not.
    store = dist.HashStore()
    store.set("heartbeat/0", "9 6 5 4:a1,5:b2,6:c3")  # collective 6 was another call
    store.set("heartbeat/2", "9 5 5 4:a1,5:b2")  # behind: not yet at 6
    monitor = PeerMonitor(store, rank=1, world_size=3, failure_timeout=60.0)
    try:
        for seq, identity in [(4, 0xA1), (5, 0xB2), (6, 0xD4)]:
            monitor.note(seq, seq - 1, identity)
        monitor.note(6, 6)  # (completed: the identity of 6 stays)
        deadline = time.monotonic() + 10
        while monitor.diverged() is None and time.monotonic() < deadline:
            time.sleep(monitor.interval)
        assert monitor.diverged() == (6, [0])
        store.set("heartbeat/0", "10 6 5 4:a1,5:b2,6:d4")  # the same calls after all
        deadline = time.monotonic() + 10
        while monitor.diverged() is not None and time.monotonic() < deadline:
            time.sleep(monitor.interval)
        assert monitor.diverged() is None
    finally:
        monitor.stop()


def _iterate_through_tqdm() -> list[float]:
    import tqdm

    strategy = mirrored.MultiWorkerMirroredStrategy()
    rank = strategy.cluster_resolver.worker_index
    try:
        data = strategy.experimental_distribute_dataset(
            [torch.arange(4.0) + 4 * i for i in range(3)])
        # A bar on the chief only: tqdm's iteration takes other lines where it is off.
        means = []
        for x in tqdm.tqdm(data, disable=rank != 0, file=open("/dev/null", "w")):  # noqa: SIM115
            means.append(float(strategy.reduce("MEAN", x, axis=0)))
        return means
    finally:
        strategy.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_wrapper_that_takes_other_lines_per_worker_is_one_call():
    pytest.importorskip("tqdm")
    results = mirrored.testing.run_multi_process(_iterate_through_tqdm, 2, timeout=60)
    assert results == [[1.5, 5.5, 9.5]] * 2
