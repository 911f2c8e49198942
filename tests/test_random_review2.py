"""Randomness in the replicas, second review (porting programs as a new user would):

- a step whose first random draw is inside ``torch.random.fork_rng()`` (a probe that
  must not shift the caller's stream) drew the same dropout masks at every step: the
  base seed was drawn inside the block, and the block's exit undid that draw;
- a step that calls ``torch.manual_seed`` before its first draw was not reproducible
  from ``torch.manual_seed`` in the same process (a count of such runs, kept for the
  strategy's life, perturbed the base seed);
- a mirrored model compiled in place (``model.compile()``) whose dropout ran eagerly
  (an ``nn.Sequential``, which Dynamo skips) had Dynamo compile the library's routing
  kernel: graph breaks in torch's counters, and ``fullgraph=True`` failed naming it.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored

pytestmark = pytest.mark.timeout(120)


def _local(strategy: mirrored.MirroredStrategy, value: object) -> list[torch.Tensor]:
    return [t.detach().clone() for t in strategy.experimental_local_results(value)]


def _mask_key(masks: list[torch.Tensor]) -> tuple[tuple[float, ...], ...]:
    return tuple(tuple(m.tolist()) for m in masks)


def test_a_first_draw_inside_fork_rng_still_gets_new_masks_each_step() -> None:
    def step() -> torch.Tensor:
        with torch.random.fork_rng():
            probe = torch.randn(2)  # drawn without shifting the caller's generator
        return F.dropout(torch.ones(32), 0.5) + 0 * probe.sum()

    torch.manual_seed(0)
    one_device = {tuple(step().tolist()) for _ in range(4)}
    assert len(one_device) == 4  # one device: a new mask every step
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        torch.manual_seed(0)
        runs = [_local(strategy, strategy.run(step)) for _ in range(4)]
        assert len({_mask_key(r) for r in runs}) == 4  # a new mask every run
        assert all(not torch.equal(a, b) for a, b in runs)  # the replicas' differ
        torch.manual_seed(0)
        again = [_local(strategy, strategy.run(step)) for _ in range(4)]
        assert [_mask_key(r) for r in runs] == [_mask_key(r) for r in again]
    finally:
        strategy.close()


def _reseeding_step() -> torch.Tensor:
    torch.manual_seed(42)  # a step that reseeds torch before its first random call
    return F.dropout(torch.ones(32), 0.5)


def _fork_reseeding_step() -> torch.Tensor:
    with torch.random.fork_rng():
        torch.manual_seed(123)
        fixed = torch.randn(2)
    return F.dropout(torch.ones(32), 0.5) + 0 * fixed.sum()


@pytest.mark.parametrize("step", [_reseeding_step, _fork_reseeding_step])
def test_a_step_that_reseeds_is_reproducible_from_the_seed(step) -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])

    def sequence() -> list[tuple[tuple[float, ...], ...]]:
        torch.manual_seed(0)
        return [_mask_key(_local(strategy, strategy.run(step))) for _ in range(3)]

    try:
        first = sequence()
        assert sequence() == first  # the same seed, the same masks, in one process
        assert sequence() == first
    finally:
        strategy.close()


@pytest.mark.timeout(180)
def test_the_same_seed_gives_the_same_masks_in_another_process() -> None:
    code = textwrap.dedent("""
        import torch, torch.nn.functional as F
        import mirrored
        strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
        def step():
            with torch.random.fork_rng():
                probe = torch.randn(2)
            layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.3, batch_first=True)
            return layer(torch.ones(2, 3, 8)) + F.dropout(torch.ones(8), 0.5) + probe.sum()
        torch.manual_seed(7)
        out = [t for _ in range(2) for t in strategy.experimental_local_results(
            strategy.run(step))]
        print(repr([round(float(t.double().sum()), 9) for t in out]))
        strategy.close()
    """)

    def once() -> str:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=150, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()

    first = once()
    assert first == once()
    sums = ast.literal_eval(first)
    assert len(set(sums)) == 8  # four replicas and two runs, each its own draws


def test_four_replicas_draw_their_own_attention_and_encoder_dropout() -> None:
    torch.manual_seed(0)
    encoder = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.3, batch_first=True)
    attention = nn.MultiheadAttention(8, 2, dropout=0.3, batch_first=True)
    x = torch.ones(2, 3, 8)

    def step() -> torch.Tensor:
        return encoder(x) + attention(x, x, x)[0]

    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2", "CPU:3"])
    try:
        torch.manual_seed(5)
        first = _local(strategy, strategy.run(step))
        torch.manual_seed(5)
        assert _mask_key(_local(strategy, strategy.run(step))) == _mask_key(first)
        assert len({tuple(t.flatten().tolist()) for t in first}) == 4
    finally:
        strategy.close()


def test_one_replica_draws_what_plain_torch_draws() -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0"])
    try:
        torch.manual_seed(3)
        got = _local(strategy, strategy.run(lambda: F.dropout(torch.ones(64), 0.5)))[0]
        torch.manual_seed(3)
        assert torch.equal(got, F.dropout(torch.ones(64), 0.5))
    finally:
        strategy.close()


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_an_eager_draw_under_dynamos_frame_hook_is_not_compiled() -> None:
    import torch._dynamo
    from torch._dynamo.utils import counters

    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        torch.manual_seed(0)
        model = strategy.mirror(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5),
                                              nn.Linear(16, 2)))
        model.compile()  # Dynamo skips Sequential's iteration: dropout runs eagerly
        x = torch.ones(4, 8)

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            out = model(x)
            out.sum().backward()
            grad = model[0].weight.grad.clone()
            model.zero_grad()
            return out, grad

        torch._dynamo.reset()
        counters.clear()
        strategy.run(step)
        torch.manual_seed(1)
        first = [_local(strategy, v) for v in strategy.run(step)]
        torch.manual_seed(1)
        second = [_local(strategy, v) for v in strategy.run(step)]
        assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
        for a, b in zip(first, second, strict=True):
            assert all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
        assert not torch.equal(*first[0])  # the replicas' masks differ
    finally:
        torch._dynamo.reset()
        strategy.close()
