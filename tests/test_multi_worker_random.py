"""Random streams across workers: replica g draws what it draws wherever it runs, so two
workers of one replica each, seeded alike, draw what one worker of two replicas draws
(different masks per replica, as one device's independent masks over the global
batch), and a job repeats from ``torch.manual_seed``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mirrored
from mirrored.experimental import CommunicationOptions

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

RUNS = 3


def _draws() -> torch.Tensor:
    # a dropout mask (bernoulli_), a normal draw and a permutation: three kinds of operator
    mask = F.dropout(torch.ones(16), 0.5, training=True) > 0
    return torch.cat([mask.double(), torch.randn(4, dtype=torch.float64),
                      torch.randperm(6).double()])


def _worker() -> list[torch.Tensor]:
    torch.manual_seed(0)  # alike on every worker, as a DDP script seeds
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=30))
    try:
        out = []
        for _ in range(RUNS):
            value = strategy.run(_draws)
            out.append(strategy.experimental_local_results(value)[0].clone())
        after = torch.rand(3)  # the caller's own generator after the runs
        return [*out, after]
    finally:
        strategy.close()


def _in_process() -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        per_run = [[t.clone() for t in strategy.experimental_local_results(strategy.run(_draws))]
                   for _ in range(RUNS)]
        after = torch.rand(3)
        return [[run[g] for run in per_run] + [after] for g in range(2)]
    finally:
        strategy.close()


def test_two_workers_of_one_replica_draw_what_one_worker_of_two_draws():
    workers = mirrored.testing.run_multi_process(_worker, 2, timeout=110)
    expected = _in_process()
    for g in range(2):
        for got, want in zip(workers[g], expected[g], strict=True):
            assert torch.equal(got, want), (g, got, want)
    for run in range(RUNS):  # replicas draw masks of their own; runs differ
        assert not torch.equal(workers[0][run], workers[1][run])
        if run:
            assert not torch.equal(workers[0][run], workers[0][run - 1])
    # the caller's generator moves alike on both workers (one draw per run that drew)
    assert torch.equal(workers[0][-1], workers[1][-1])


def test_a_job_repeats_from_the_seed():
    first = mirrored.testing.run_multi_process(_worker, 2, timeout=110)
    again = mirrored.testing.run_multi_process(_worker, 2, timeout=110)
    for a, b in zip(first, again, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
