"""A parameter edited in place outside ``strategy.run`` through the mirrored model
(``model.parameters()``, a submodule) reaches every copy at the next run, as the one
device's model took it (TF: an assignment to a mirrored variable outside a replica
updates every copy). It reached replica 0's copy alone before (a review found a WGAN
critic's clipping training another model silently until the divergence check's next
checked step)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored

pytestmark = pytest.mark.timeout(60)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _data(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (8,), generator=g)) for _ in range(steps)]


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def _edit(model: nn.Module, how: str) -> None:
    with torch.no_grad():
        if how == "parameters":  # a WGAN critic's clipping
            for p in model.parameters():
                p.clamp_(-0.1, 0.1)
        elif how == "submodule":
            model[0].weight.mul_(0.5)  # type: ignore[index]
        else:  # a submodule's state loaded in place
            model[2].load_state_dict({"weight": torch.ones(3, 8, dtype=torch.float64),  # type: ignore[index]
                                      "bias": torch.zeros(3, dtype=torch.float64)})


@pytest.mark.parametrize("how", ["parameters", "submodule", "submodule state"])
def test_an_edit_outside_run_reaches_every_copy(how: str) -> None:
    data, edit_after = _data(5), 2
    net = _net()
    opt = _sgd(net.parameters())
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        if i == edit_after:
            _edit(net, how)
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_net())
    optimizer = strategy.mirror_optimizer(model, _sgd)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(data)):
        strategy.run(step, args=(x, y))
        if i == edit_after:
            _edit(model, how)
    for copy in model.replicas:  # (steps 4 and 5: before the check's next checked step)
        for p, q in zip(copy.parameters(), net.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


def test_an_edit_of_one_copy_stays_its_own() -> None:
    """``model.replicas[1]`` edited alone is not replica 0's change: it is not copied
    (the divergence check names it at its next checked step), and an edit made on
    every copy stays as made."""
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_net())
    strategy.run(lambda: None)
    with torch.no_grad():
        model.replicas[1][0].bias.add_(1.0)
    strategy.run(lambda: None)
    assert not torch.equal(model.replicas[0][0].bias, model.replicas[1][0].bias)
    with torch.no_grad():
        for copy in model.replicas:
            copy[0].bias.zero_()
        model.replicas[1][0].bias.add_(2.0)  # (after replica 0's edit: its own)
    strategy.run(lambda: None)
    assert model.replicas[0][0].bias.abs().sum() == 0
    assert torch.equal(model.replicas[1][0].bias, torch.full((8,), 2.0, dtype=torch.float64))
