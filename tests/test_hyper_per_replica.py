"""A hyper-parameter set inside the step from a per-replica value (each replica's own
share of the loss) is refused: the step used replica 0's value on every replica,
silently. Values alike on every replica (a schedule, a reduced loss), set outside
``run`` or by a scheduler train as one device does."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mirrored

pytestmark = pytest.mark.timeout(60)


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(6, 3, generator=g, dtype=torch.float64),
            torch.randn(6, generator=g, dtype=torch.float64))


def split(t: torch.Tensor) -> mirrored.PerReplica[torch.Tensor]:
    return mirrored.PerReplica([t[:4], t[4:]])  # uneven: 4 + 2


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.5)  # type: ignore[arg-type]


def one_device(rate: object, steps: int = 3) -> nn.Module:
    """``rate(i, loss)``: the rate set before step ``i``'s ``step()`` (None: unchanged)."""
    plain, (x, y) = net(), data()
    opt = sgd(plain.parameters())
    for i in range(steps):
        opt.zero_grad()
        loss = ((plain(x).squeeze(1) - y) ** 2).mean()
        loss.backward()
        lr = rate(i, loss.item())  # type: ignore[operator]
        if lr is not None:
            for group in opt.param_groups:
                group["lr"] = lr
        opt.step()
    return plain


def assert_like(model: mirrored.MirroredModule, plain: nn.Module) -> None:
    for copy in model.replicas:
        for a, b in zip(copy.state_dict().values(), plain.state_dict().values(), strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("key", ["lr", "weight_decay"])
def test_a_rate_set_from_each_replicas_own_loss_is_refused(
        two: mirrored.MirroredStrategy, key: str) -> None:
    # The repro: g["lr"] = 0.2 * loss.item() with loss the replica's own share; the step
    # used replica 0's rate on every replica (4.5e-2 off one device, copies equal).
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, sgd)
    x, y = data()

    def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        opt.zero_grad()
        loss = mirrored.compute_average_loss((model(xs).squeeze(1) - ys) ** 2,
                                             global_batch_size=6)
        loss.backward()
        for group in opt.param_groups:
            group[key] = 0.2 * loss.item()
        opt.step()

    refusal = rf"replica 1 set {key!r}.*replica 0's is.*Every replica must set the same"
    with pytest.raises((RuntimeError, ValueError), match=refusal):
        two.run(step, args=(split(x), split(y)))


def test_a_rate_set_per_replica_before_unscale_is_refused(
        two: mirrored.MirroredStrategy) -> None:
    # With a GradScaler, replica 0 publishes its values at unscale_ (the all-reduce).
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, sgd)
    scaler = torch.amp.GradScaler("cpu")
    x, y = data()

    def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        opt.zero_grad()
        loss = mirrored.compute_average_loss((model(xs).squeeze(1) - ys) ** 2,
                                             global_batch_size=6)
        scaler.scale(loss).backward()
        for group in opt.param_groups:
            group["lr"] = 0.2 * loss.item()
        scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()

    with pytest.raises(RuntimeError, match=r"replica 1 set 'lr'.*Every replica must set"):
        two.run(step, args=(split(x), split(y)))


def test_a_rate_set_after_step_from_each_replicas_own_loss_is_refused_at_the_next_step(
        two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, sgd)
    x, y = data()

    def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        opt.zero_grad()
        loss = mirrored.compute_average_loss((model(xs).squeeze(1) - ys) ** 2,
                                             global_batch_size=6)
        loss.backward()
        opt.step()
        for group in opt.param_groups:  # (for the next step, as on one device)
            group["lr"] = 0.2 * loss.item()

    two.run(step, args=(split(x), split(y)))
    with pytest.raises(RuntimeError, match=r"'lr'.*strategy\.reduce|'lr'.*all_reduce"):
        two.run(step, args=(split(x), split(y)))


def test_a_rate_from_the_reduced_loss_trains_as_one_device(
        two: mirrored.MirroredStrategy) -> None:
    # The fix the refusal names: every replica sets the same value, here from the loss
    # all-reduced across the replicas (the global loss one device sees).
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, sgd)
    x, y = data()

    def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        opt.zero_grad()
        loss = mirrored.compute_average_loss((model(xs).squeeze(1) - ys) ** 2,
                                             global_batch_size=6)
        loss.backward()
        total = mirrored.get_replica_context().all_reduce(
            mirrored.ReduceOp.SUM, loss.detach())
        for group in opt.param_groups:
            group["lr"] = 0.2 * total.item()
        opt.step()

    for _ in range(3):
        two.run(step, args=(split(x), split(y)))
    assert_like(model, one_device(lambda i, loss: 0.2 * loss))


def test_a_schedule_set_inside_the_step_and_one_set_outside_run_train_as_one_device(
        two: mirrored.MirroredStrategy) -> None:
    # Alike on every replica: a rate computed from the step number inside the step, and
    # rates set outside run (on replica 0's optimizer, as a scheduler does) and by a
    # torch scheduler stepped after run.
    rates = [0.1, 0.05, 0.2]
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, sgd)
    x, y = data()

    def step(i: int, xs: torch.Tensor, ys: torch.Tensor) -> None:
        opt.zero_grad()
        loss = mirrored.compute_average_loss((model(xs).squeeze(1) - ys) ** 2,
                                             global_batch_size=6)
        loss.backward()
        if i == 1:
            for group in opt.param_groups:
                group["lr"] = rates[i]
        opt.step()

    for i in range(3):
        if i == 2:
            for group in opt.param_groups:  # outside run: replica 0's
                group["lr"] = rates[i]
        two.run(step, args=(i, split(x), split(y)))
    assert_like(model, one_device(lambda i, loss: rates[i]))

    model = two.mirror(net())
    opt = two.mirror_optimizer(model, sgd)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        two.run(step, args=(0, split(x), split(y)))
        scheduler.step()
    assert_like(model, one_device(lambda i, loss: 0.1 * 0.5 ** i))


def test_a_rate_loaded_then_changed_by_a_scheduler_outside_run_trains_as_one_device(
        two: mirrored.MirroredStrategy) -> None:
    # load_state_dict gives every replica's optimizer the loaded rate; a scheduler built
    # after it changes replica 0's alone (the others take it at the step): not refused.
    x, y = data()
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, sgd)

    def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        opt.zero_grad()
        mirrored.compute_average_loss((model(xs).squeeze(1) - ys) ** 2,
                                      global_batch_size=6).backward()
        opt.step()

    two.run(step, args=(split(x), split(y)))
    saved = opt.state_dict()
    saved["param_groups"][0]["lr"] = 0.05
    opt.load_state_dict(saved)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 2.0)  # lr: 0.1 on replica 0
    for _ in range(2):
        two.run(step, args=(split(x), split(y)))
    assert [o.param_groups[0]["lr"] for o in opt.optimizers] == [0.1, 0.1]
    assert_like(model, one_device(lambda i, loss: None if i == 0 else 0.1))
