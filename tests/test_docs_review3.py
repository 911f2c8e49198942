"""Docs review 3: behaviours the user-facing docs state, as corrected in this review.

- docs/elastic.md's `PreemptionCheckpointHandler` loop: the global batches go through
  `experimental_distribute_dataset`, so each replica gets its rows (the loop before
  passed the whole global batch to every replica), and a preempted run resumed from
  `total_run_calls` ends with one device's parameters.
- docs/semantics.md, Iterators: a new pass over a one-shot source closes a live one;
  passes over a re-iterable source (a list) stay usable side by side.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mirrored

STEPS = 6


class Preempted(Exception):
    pass


def stop() -> None:
    raise Preempted


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * 5, 4, generator=g, dtype=torch.float64)
    y = torch.randn(STEPS * 5, 2, generator=g, dtype=torch.float64)
    return [(x[i:i + 5], y[i:i + 5]) for i in range(0, STEPS * 5, 5)]  # 3 + 2 rows


def make_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()


def train(checkpoint_dir: str, notify_at: int | None) -> tuple[dict[str, torch.Tensor],
                                                                  list[int]]:
    """docs/elastic.md's loop on 2 replicas; a notice at step ``notify_at`` saves and
    stops it (exit_fn raises instead of exiting)."""
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(make_model())
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    rows: list[int] = []

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        rows.append(len(x))
        loss = (model(x) - y).pow(2).sum(1)
        mirrored.compute_average_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        return loss.detach().sum()

    handler = mirrored.PreemptionCheckpointHandler(
        strategy, {"model": model, "optimizer": opt}, checkpoint_dir,
        mirrored.TerminationConfig(exit_fn=stop))
    try:
        start = handler.total_run_calls
        batches = global_batches()
        for x, y in strategy.experimental_distribute_dataset(batches[start:STEPS]):
            if handler.total_run_calls == notify_at:
                handler.notify()
            handler.run(strategy.run, step_fn, args=(x, y))
    finally:
        handler.close()
        strategy.close()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, rows


@pytest.mark.timeout(60)
def test_the_preemption_loop_splits_the_batch_and_resumes_as_one_device(tmp_path):
    with pytest.raises(Preempted):
        train(str(tmp_path), notify_at=2)
    assert mirrored.CheckpointManager(
        mirrored.MirroredStrategy(["CPU:0"]), tmp_path).steps() == [2]
    params, rows = train(str(tmp_path), notify_at=None)
    assert sorted(rows) == [2] * (STEPS - 2) + [3] * (STEPS - 2)  # each replica its rows

    reference = make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in global_batches():
        (reference(x) - y).pow(2).sum(1).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-12)


def test_a_new_pass_closes_a_live_pass_over_a_one_shot_source_only():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        batches = [torch.full((2,), float(i)) for i in range(4)]

        listed = strategy.experimental_distribute_dataset(copy.copy(batches))
        first, second = iter(listed), iter(listed)
        assert strategy.experimental_local_results(next(first))[0].item() == 0
        assert strategy.experimental_local_results(next(second))[0].item() == 0
        assert strategy.experimental_local_results(next(first))[0].item() == 1

        one_shot = strategy.experimental_distribute_dataset(iter(batches))
        old = iter(one_shot)
        assert strategy.experimental_local_results(next(old))[0].item() == 0
        new = iter(one_shot)
        assert strategy.experimental_local_results(next(new))[0].item() == 1
        with pytest.raises(RuntimeError, match="superseded by a new pass"):
            next(old)
    finally:
        strategy.close()


def test_an_unbatched_element_is_refused_with_the_documented_advice():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        with pytest.raises(ValueError, match="Batch the dataset"):
            list(strategy.experimental_distribute_dataset([torch.tensor(1.0)]))
    finally:
        strategy.close()
