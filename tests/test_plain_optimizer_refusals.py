"""Plain torch optimizers inside ``strategy.run``: one shared by the replicas (over a
parameter outside the mirrored model, such as a learnable loss temperature) and
stepped or zeroed by several replicas of one run is refused, naming both replicas and
the fix; per-replica optimizers, stepping outside ``run`` (exact against one device)
and one-replica strategies are left alone. An optimizer whose ``step`` needs a closure
(LBFGS) is refused by ``mirror_optimizer``."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored

pytestmark = pytest.mark.timeout(60)

SHARED = (r"stepped by replica \d and replica \d in one strategy\.run.*"
          r"2 steps per global step.*outside strategy\.run.*mirror_optimizer")
ZEROED = (r"zeroed by replica \d and replica \d in one strategy\.run: one replica's "
          r"zero_grad\(\) wipes.*outside strategy\.run.*mirror_optimizer")


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def make_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(n, 4, dtype=torch.float64, generator=g),
             torch.randint(0, 3, (n,), generator=g)) for n in (8, 8, 6, 8)]


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def temperature() -> nn.Parameter:
    return nn.Parameter(torch.zeros(1, dtype=torch.float64))


def loss_of(out: torch.Tensor, y: torch.Tensor, t: torch.Tensor, reduction: str
            ) -> torch.Tensor:
    return F.cross_entropy(out * t.exp(), y, reduction=reduction)


def one_device() -> tuple[nn.Module, nn.Parameter]:
    net = make_net()
    opt = sgd(list(net.parameters()))
    t = temperature()
    opt_t = torch.optim.Adam([t], lr=0.05)
    for x, y in make_data():
        opt.zero_grad()
        opt_t.zero_grad()
        loss_of(net(x), y, t, "mean").backward()
        opt.step()
        opt_t.step()
    return net, t


def test_a_shared_plain_optimizer_stepped_in_run_is_refused(
        two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(make_net())
    optimizer = two.mirror_optimizer(model, sgd)
    t = temperature()
    opt_t = torch.optim.Adam([t], lr=0.05)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss = mirrored.compute_average_loss(loss_of(model(x), y, t, "none"))
        loss.backward()
        optimizer.step()
        opt_t.step()  # every replica would step it: N Adam steps per global step

    x, y = next(iter(two.experimental_distribute_dataset(make_data())))
    with pytest.raises(RuntimeError, match=SHARED) as caught:
        two.run(step, args=(x, y))
    assert "A plain torch.optim.Adam" in str(caught.value)
    assert opt_t.state[t]["step"].item() == 1  # (the first replica's step went through)


def test_a_shared_plain_optimizer_without_a_mirrored_model_is_refused(
        two: mirrored.MirroredStrategy) -> None:
    t = temperature()
    opt_t = torch.optim.SGD([t], lr=0.1)

    def step() -> None:
        (t * 2).sum().backward()
        opt_t.step()

    with pytest.raises(RuntimeError, match=SHARED):
        two.run(step)


def test_a_shared_plain_optimizer_zeroed_in_run_is_refused(
        two: mirrored.MirroredStrategy) -> None:
    # zero_grad() in every replica, step() after run: one replica's zero_grad wipes what
    # another's backward summed into the shared .grad. Refused from the optimizer's
    # first step on (torch has no global zero_grad hook: its zero_grad is watched once
    # the step hook has seen it).
    model = two.mirror(make_net())
    optimizer = two.mirror_optimizer(model, sgd)
    t = temperature()
    opt_t = torch.optim.Adam([t], lr=0.05)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        opt_t.zero_grad()
        loss = mirrored.compute_average_loss(loss_of(model(x), y, t, "none"))
        loss.backward()
        optimizer.step()

    batches = iter(two.experimental_distribute_dataset(make_data()))
    two.run(step, args=next(batches))  # (not seen yet: the step after run shows it)
    opt_t.step()
    with pytest.raises(RuntimeError, match=ZEROED):
        two.run(step, args=next(batches))
    assert opt_t.state[t]["step"].item() == 1


def test_stepped_and_zeroed_outside_run_is_exact(two: mirrored.MirroredStrategy) -> None:
    net, t_ref = one_device()
    model = two.mirror(make_net())
    optimizer = two.mirror_optimizer(model, sgd)
    t = temperature()
    opt_t = torch.optim.Adam([t], lr=0.05)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss = mirrored.compute_average_loss(loss_of(model(x), y, t, "none"))
        loss.backward()
        optimizer.step()

    for x, y in two.experimental_distribute_dataset(make_data()):
        opt_t.zero_grad()
        two.run(step, args=(x, y))
        opt_t.step()  # the replicas' backward passes summed the global gradient into .grad
    torch.testing.assert_close(t.detach(), t_ref.detach(), rtol=0, atol=1e-12)
    for name, value in net.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=1e-12)


def test_per_replica_plain_optimizers_in_run_are_left_alone(
        two: mirrored.MirroredStrategy) -> None:
    # One optimizer per replica, over that replica's own parameter, stepped (twice) and
    # zeroed in run: each optimizer sees one replica per run.
    params = [nn.Parameter(torch.ones(2, dtype=torch.float64)) for _ in range(2)]
    opts = [torch.optim.SGD([p], lr=0.5) for p in params]

    def step() -> None:
        r = mirrored.get_replica_context().replica_id_in_sync_group
        for _ in range(2):
            opts[r].zero_grad()
            (params[r] * (r + 1)).sum().backward()
            opts[r].step()

    for _ in range(3):
        two.run(step)
    assert torch.equal(params[0].detach(), torch.full((2,), -2.0, dtype=torch.float64))
    assert torch.equal(params[1].detach(), torch.full((2,), -5.0, dtype=torch.float64))


def test_one_replica_per_run_alternating_is_left_alone(two: mirrored.MirroredStrategy) -> None:
    t = temperature()
    opt_t = torch.optim.SGD([t], lr=0.5)
    for k in range(4):
        def step(k: int = k) -> None:
            if mirrored.get_replica_context().replica_id_in_sync_group == k % 2:
                t.grad = torch.ones_like(t)
                opt_t.step()
                opt_t.zero_grad()
        two.run(step)
    assert t.item() == -2.0


def test_one_replica_strategy_is_left_alone() -> None:
    one = mirrored.MirroredStrategy(["CPU:0"])
    try:
        t = temperature()
        opt_t = torch.optim.SGD([t], lr=0.5)

        def step() -> None:
            opt_t.zero_grad()
            (t * 2).sum().backward()
            opt_t.step()

        for _ in range(2):
            one.run(step)
        assert t.item() == -2.0
    finally:
        one.close()


def test_mirror_optimizer_refuses_a_closure_only_step(two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(make_net())
    with pytest.raises(TypeError, match=r"LBFGS.*closure.*not supported by mirror_optimizer"):
        two.mirror_optimizer(model, lambda p: torch.optim.LBFGS(p, lr=0.5, max_iter=3))


def test_a_watched_optimizer_copies_pickles_and_is_freed(
        two: mirrored.MirroredStrategy) -> None:
    t = temperature()
    opt_t = torch.optim.SGD([t], lr=0.5)
    t.grad = torch.ones_like(t)
    opt_t.step()  # (seen by the hook: its zero_grad is watched from here on)
    assert "zero_grad" in vars(opt_t)
    opt_t.zero_grad()
    assert t.grad is None
    clone = copy.deepcopy(opt_t)
    assert "zero_grad" not in vars(clone)  # (torch's __getstate__ keeps the state only)
    assert pickle.loads(pickle.dumps(opt_t)).param_groups[0]["lr"] == 0.5
    gone = weakref.ref(opt_t)
    gc.disable()
    try:
        del opt_t
        assert gone() is None  # (no reference cycle through the wrapper)
    finally:
        gc.enable()
