"""A global batch that leaves a replica one row: plain BatchNorm refuses that shard
(torch's own error, which one device would not raise), and the error says why and
what to do; with sync_batch_norm=True the same step trains as one device."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored

pytestmark = pytest.mark.timeout(60)


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 3, generator=g, dtype=torch.float64), torch.randint(0, 2, (3,),
                                                                             generator=g)


def train(strategy: mirrored.Strategy, sync: bool) -> nn.Module:
    model = strategy.mirror(make_net(), sync_batch_norm=sync)
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        opt.step()
        opt.zero_grad()

    for x, y in strategy.experimental_distribute_dataset([batch()]):
        strategy.run(step, args=(x, y))
    return model


def test_plain_batch_norm_on_a_one_row_shard_says_why():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])  # rows 2, 1
    try:
        with pytest.raises(ValueError, match="Expected more than 1 value per channel") as info:
            train(strategy, sync=False)
        notes = "\n".join(getattr(info.value, "__notes__", []))
        assert "shard of one row" in notes and "sync_batch_norm=True" in notes, notes
    finally:
        strategy.close()


def test_sync_batch_norm_trains_the_one_row_shard_as_one_device():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        model = train(strategy, sync=True)
    finally:
        strategy.close()
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = batch()
    F.cross_entropy(net(x), y).backward()
    opt.step()
    for (name, got), want in zip(model.state_dict().items(), net.state_dict().values(),
                                 strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=name)
