"""The mirrored model called outside ``run`` in train mode (a quick metric on another
batch) runs replica 0's copy: the buffers it writes there (an EMA, BatchNorm's running
statistics and ``num_batches_tracked``) reach the other copies at the next ``run``, as
for any other method of the model called there; each against one device."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored

pytestmark = pytest.mark.timeout(60)


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


class Ema(nn.Module):  # docs/porting.md's example: a buffer written by forward
    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()
        self.register_buffer("ema", torch.zeros(4, dtype=torch.float64))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * x.mean(0))
        self.calls += 1
        out: torch.Tensor = self.net(x)
        return out


def bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


def batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, dtype=torch.float64, generator=g),
             torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def extra() -> torch.Tensor:
    g = torch.Generator().manual_seed(9)
    return torch.randn(8, 4, dtype=torch.float64, generator=g) + 2.0


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)  # type: ignore[arg-type]


CASES = [pytest.param(Ema, {}, id="ema-buffer-averaged"),
         pytest.param(bn_net, {"sync_batch_norm": True}, id="batch-norm-sync")]


@pytest.mark.parametrize(("make", "options"), CASES)
@pytest.mark.parametrize("calls", [1, 3])
def test_buffers_written_by_a_forward_outside_run_reach_every_copy(
        two: mirrored.MirroredStrategy, make: Callable[[], nn.Module],
        options: dict[str, bool], calls: int) -> None:
    data = batches()
    plain = make()
    opt = sgd(plain.parameters())
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        F.cross_entropy(plain(x), y).backward()
        opt.step()
        if i == 1:
            with torch.no_grad():
                for _ in range(calls):
                    plain(extra())
    model = two.mirror(make(), **options)
    optimizer = two.mirror_optimizer(model, sgd)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
        optimizer.step()

    for i, (x, y) in enumerate(two.experimental_distribute_dataset(data)):
        two.run(step, args=(x, y))
        if i == 1:
            with torch.no_grad():
                for _ in range(calls):
                    model(extra())  # outside run: replica 0's copy
    for copy in model.replicas:
        for (name, a), b in zip(copy.state_dict().items(), plain.state_dict().values(),
                                strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)
    if isinstance(plain, Ema):  # (a plain attribute forward sets: replica 0's, given too)
        assert [c.calls for c in model.replicas] == [4 + calls] * 2


def test_a_forward_outside_run_as_the_last_call_before_saving_reads_replica_zero(
        two: mirrored.MirroredStrategy) -> None:
    # Nothing ran since: the copies differ until the next run, and the mirrored model
    # (state_dict, parameters) reads as replica 0's copy, which has the update.
    model = two.mirror(bn_net(), sync_batch_norm=True)
    plain = bn_net()
    with torch.no_grad():
        model(extra())
        plain(extra())
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values(),
                            strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    two.run(lambda: None)
    for copy in model.replicas:
        for (name, a), b in zip(copy.state_dict().items(), plain.state_dict().values(),
                                strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_forward_outside_run_under_no_grad_or_inference_mode_reaches_every_copy(
        mode: Any, dtype: torch.dtype) -> None:
    """The evaluation idioms, in half precision too: BatchNorm's statistics a train-mode
    forward outside run updates reach every copy at the next run."""
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    torch.manual_seed(0)
    model = strategy.mirror(nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).to(dtype))
    with mode():
        model(torch.randn(8, 3).to(dtype))
    strategy.run(lambda: None)
    first, second = (copy[1] for copy in model.replicas)
    assert first.running_mean.abs().sum() > 0  # (the forward updated replica 0's)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name
