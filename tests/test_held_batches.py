"""A source that writes into a batch the dataset still holds is refused.

A distributed dataset's steps keep views of the source's tensors, and it reads ahead of
the loop in three places (the workers' vote on a source without ``len()``, a prefetch
thread, ``distribute_datasets_from_function``'s one element per local replica). A
source that refills one tensor and yields it again (``buf.fill_(i); yield buf``) then
overwrote batches still waiting, so every step trained on a later batch's values, with
no error (found by a review: every step of two workers got the last batch). Now the read
that writes into a held batch raises; sources that are right as they are (fresh
tensors, the same tensor unchanged, a step that changes its batch in place, a ring
buffer with more slots than the read-ahead) train as one device's loop does."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import mirrored
from mirrored.testing import run_multi_process

pytestmark = pytest.mark.timeout(120)

PREFETCH = mirrored.InputOptions(experimental_prefetch_depth=2)
REFILLED = "wrote into the (batch|element) of step"


def _refilled(n: int, rows: int = 4) -> Iterator[torch.Tensor]:
    buf = torch.zeros(rows)
    for i in range(n):
        buf.fill_(i)
        yield buf


def _ring(n: int, slots: int, rows: int = 4) -> Iterator[torch.Tensor]:
    """A ring buffer of ``slots`` views of one tensor, refilled in turn."""
    ring = torch.zeros(slots, rows)
    for i in range(n):
        ring[i % slots].fill_(i)
        yield ring[i % slots]


def _seen(strategy: mirrored.Strategy, dataset: Any) -> list[list[float]]:
    """Each step's batch, as every replica saw it when its step ran."""
    out = []
    for step in dataset:
        values = strategy.experimental_local_results(step)
        out.append([float(v) for t in values for v in t.tolist()])
    return out


def test_prefetch_refuses_a_source_that_refills_its_batch() -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    dataset = strategy.experimental_distribute_dataset(_refilled(4), PREFETCH)
    with pytest.raises(ValueError, match=REFILLED + r".*float32\[4\] on cpu.*yield buf.clone\(\)"):
        _seen(strategy, dataset)


def test_datasets_from_function_refuse_a_source_that_refills_its_element() -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    dataset = strategy.distribute_datasets_from_function(lambda ctx: _refilled(4))
    with pytest.raises(ValueError, match="while reading another element of step 0"):
        _seen(strategy, dataset)


def test_sources_that_are_right_train_as_one_device_reads() -> None:
    """Fresh tensors, one tensor yielded unchanged, a step that changes its batch in
    place, and a ring buffer with more slots than the read-ahead: no error, and each
    step sees what a plain loop over the source sees."""
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    fresh = (torch.full((4,), float(i)) for i in range(5))
    assert _seen(strategy, strategy.experimental_distribute_dataset(fresh, PREFETCH)) == [
        [float(i)] * 4 for i in range(5)]
    ring = _ring(12, slots=8)
    assert _seen(strategy, strategy.experimental_distribute_dataset(ring, PREFETCH)) == [
        [float(i)] * 4 for i in range(12)]
    same = torch.ones(4)
    plain = []
    for batch in [same.clone()] * 4:  # one device: the step doubles its batch in place
        plain.append(batch.tolist())
        batch.mul_(2)
    seen = []
    for step in strategy.experimental_distribute_dataset(iter([same] * 4), PREFETCH):
        seen.append([v for t in strategy.experimental_local_results(step) for v in t.tolist()])
        strategy.run(lambda x: x.mul_(2), args=(step,))
    assert seen == plain
    from_function = strategy.distribute_datasets_from_function(
        lambda ctx: (torch.full((2,), float(i)) for i in range(4)))
    assert _seen(strategy, from_function) == [[0.0, 0.0, 1.0, 1.0], [2.0, 2.0, 3.0, 3.0]]


def test_no_read_ahead_lets_a_source_refill_after_each_step() -> None:
    """Without reading ahead (the default in one process on CPU replicas) each batch is
    trained on before the next is read: refilling is right there, as in a plain loop."""
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    assert _seen(strategy, strategy.experimental_distribute_dataset(_refilled(3))) == [
        [float(i)] * 4 for i in range(3)]


def _two_workers(refill: bool) -> list[list[float]]:
    strategy = mirrored.MultiWorkerMirroredStrategy()
    try:
        source = _refilled(5) if refill else (torch.full((4,), float(i)) for i in range(5))
        return _seen(strategy, strategy.experimental_distribute_dataset(source))
    except ValueError as error:
        return [[-1.0], [float("refills" in str(error) or "wrote into" in str(error))]]
    finally:
        strategy.close()


def test_workers_voting_ahead_refuse_a_source_that_refills_its_batch() -> None:
    """Across workers a source without len() is read up to 8 steps ahead for the vote
    (the default): every step got the last batch before."""
    for rank in run_multi_process(_two_workers, 2, args=(True,), timeout=90):
        assert rank == [[-1.0], [1.0]]
    for rank, seen in enumerate(run_multi_process(_two_workers, 2, args=(False,), timeout=90)):
        assert seen == [[float(i)] * 2 for i in range(5)], rank
