"""GradScaler with mirrored optimizers, two review findings: a scaler kept while the
mirrored optimizer is rebuilt skipped update() when the new optimizer got a freed one's
id() (its steps were keyed by the address), and a GAN loop (two optimizers, one scaler)
raised at the next zero_grad() after a step the scaler skipped on an inf."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from mirrored._src.training.amp import _serial

pytestmark = pytest.mark.timeout(120)


def _net(i: int = 4, o: int = 3, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(i, 8), nn.Tanh(), nn.Linear(8, o)).double()


def test_an_optimizer_at_a_freed_ones_address_is_another_optimizer() -> None:
    class Optimizer:  # (the same size at each allocation: CPython reuses the address)
        pass

    first = Optimizer()
    address, serial = id(first), _serial(first)
    del first
    second = Optimizer()
    if id(second) != address:
        pytest.skip("this interpreter did not reuse the address")
    assert _serial(second) != serial


def test_a_scaler_kept_across_rebuilt_optimizers_updates_at_every_step() -> None:
    """One GradScaler, the mirrored model and optimizer rebuilt at every step (a stage
    each): the scale grows at every step as one device's (growth_interval=1). Before,
    a rebuilt optimizer at a freed one's address had its update() dropped (in most
    runs at least once in these 20 rebuilds)."""
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (8,), generator=g)) for _ in range(20)]
    kw = {"init_scale": 2.0 ** 8, "growth_interval": 1}
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    reference = torch.amp.GradScaler("cpu", **kw)
    for x, y in data:
        opt.zero_grad()
        reference.scale(F.cross_entropy(net(x), y)).backward()
        reference.step(opt)
        reference.update()
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    scaler = torch.amp.GradScaler("cpu", **kw)
    state = _net().state_dict()
    for batch in data:
        state = _stage(strategy, scaler, batch, state)
        gc.collect()  # (the stage's optimizer freed: its address free for the next)
    assert scaler.get_scale() == reference.get_scale()
    for k, v in net.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=1e-12)


def _stage(strategy: mirrored.MirroredStrategy, scaler: torch.amp.GradScaler,
           batch: tuple[torch.Tensor, torch.Tensor], state: dict[str, torch.Tensor]
           ) -> dict[str, torch.Tensor]:
    """One step of a new mirrored model and optimizer from ``state``; their new state."""
    model = strategy.mirror(_net())
    model.load_state_dict(state)
    optimizer = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    for x, y in strategy.experimental_distribute_dataset([batch]):
        strategy.run(step, args=(x, y))
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_gan_loop_runs_on_after_a_step_the_scaler_skipped() -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g))
            for _ in range(3)]
    data[1][0][7, 0] = float("inf")  # an overflow at step 1, in replica 1's rows

    def step_fn(G, D, oG, oD, scaler, x, y, average):  # type: ignore[no-untyped-def]
        h = G(x)
        oD.zero_grad()
        scaler.scale(average(F.cross_entropy(D(h.detach()), y, reduction="none"))).backward()
        scaler.step(oD)
        oG.zero_grad()
        scaler.scale(average(-F.cross_entropy(D(h), y, reduction="none"))).backward()
        scaler.step(oG)
        scaler.update()

    G, D = _net(4, 5, 0).float(), _net(5, 3, 1).float()
    oG, oD = torch.optim.Adam(G.parameters()), torch.optim.Adam(D.parameters())
    reference = torch.amp.GradScaler("cpu")
    for x, y in data:
        step_fn(G, D, oG, oD, reference, x, y, lambda loss: loss.mean())
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    mG, mD = strategy.mirror(_net(4, 5, 0).float()), strategy.mirror(_net(5, 3, 1).float())
    qG = strategy.mirror_optimizer(mG, torch.optim.Adam)
    qD = strategy.mirror_optimizer(mD, torch.optim.Adam)
    scaler = torch.amp.GradScaler("cpu")
    for x, y in strategy.experimental_distribute_dataset(data):
        strategy.run(lambda x, y: step_fn(mG, mD, qG, qD, scaler, x, y,
                                          mirrored.compute_average_loss), args=(x, y))
    assert scaler.get_scale() == reference.get_scale()
    for mine, theirs in ((mG, G), (mD, D)):
        for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
