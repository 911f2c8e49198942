"""Randomness in the replicas, review findings: a step that reseeds torch's generator
before its first draw (``manual_seed`` in a ``fork_rng`` block, for fixed noise) made
every step repeat its dropout masks; with prefetching, a second identically seeded run
in the same process got other augmentations (a count of passes per process seeded the
prefetch thread); a draw in a gradient hook was refused naming only checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import mirrored

pytestmark = pytest.mark.timeout(60)


def _masks(strategy: mirrored.MirroredStrategy, steps: int) -> list[list[torch.Tensor]]:
    def step() -> torch.Tensor:
        with torch.random.fork_rng():
            torch.manual_seed(123)
            fixed = torch.randn(2)  # a fixed probe, the same at every step
        return F.dropout(torch.ones(16), 0.5) + 0 * fixed.sum()

    return [[t.clone() for t in strategy.experimental_local_results(strategy.run(step))]
            for _ in range(steps)]


def test_a_step_that_reseeds_before_its_first_draw_still_gets_new_masks() -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    torch.manual_seed(0)
    first = _masks(strategy, 4)
    assert len({tuple(m[0].tolist()) for m in first}) == 4  # every step its own mask
    assert all(not torch.equal(a, b) for a, b in first)  # the two replicas' differ


def test_runs_stay_reproducible_from_the_seed() -> None:
    """A step that draws without reseeding: the same masks after the same seed."""
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])

    def masks() -> list[torch.Tensor]:
        torch.manual_seed(0)
        return [t.clone() for _ in range(3) for t in strategy.experimental_local_results(
            strategy.run(lambda: F.dropout(torch.ones(16), 0.5)))]

    assert all(torch.equal(a, b) for a, b in zip(masks(), masks(), strict=True))


class _Augmented(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2,), float(i)) + torch.randn(2)  # a random augmentation


def test_identically_seeded_runs_with_prefetching_are_equal() -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    options = mirrored.InputOptions(experimental_prefetch_depth=2)

    def run() -> torch.Tensor:
        torch.manual_seed(0)
        loader = DataLoader(_Augmented(), batch_size=4, shuffle=True)
        return torch.cat([torch.cat(strategy.experimental_local_results(b))
                          for b in strategy.experimental_distribute_dataset(loader, options)])

    assert torch.equal(run(), run())


def test_a_draw_in_a_gradient_hook_is_refused_naming_hooks() -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    w = torch.ones(3, requires_grad=True)

    def step() -> None:
        h = w * 2
        h.register_hook(lambda g: g + 0.01 * torch.randn_like(g))
        h.sum().backward()

    with pytest.raises(RuntimeError, match="a gradient hook that adds noise"):
        strategy.run(step)
