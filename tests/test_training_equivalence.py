"""N-replica training equals single-device training over the same global batches
(MLP, and a small CNN with sync BatchNorm; SGD with momentum and Adam; partial
and empty per-replica batches), and the copies stay bitwise equal; per-step objects
(LR schedulers, averaged models) stepped inside the step function are refused."""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import mirrored
from mirrored._src.training.module import MirroredModule, mirror
from mirrored._src.training.optimizer import MirroredOptimizer, mirror_optimizer

EPOCHS = 3
BATCH = 4
EXAMPLES = 11  # batches of 4, 4, 3: splits with empty chunks for N = 3, 4

OPTIMIZERS: dict[str, Callable[[Iterator[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
}


def split(batch: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The input split rule: contiguous chunks of ceil(b / n) rows, possibly empty."""
    c = math.ceil(batch.shape[0] / n)
    return [batch[i * c:min((i + 1) * c, batch.shape[0])] for i in range(n)]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()


def cnn(seed: int = 0) -> nn.Module:
    # No conv bias before BatchNorm: its true gradient is 0, and Adam would turn the
    # rounding noise of that 0 into lr-sized steps that differ between summation orders.
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, bias=False), nn.BatchNorm2d(2),
                         nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 2)).double()


MODELS = {"mlp": (mlp, (3,)), "cnn": (cnn, (1, 4, 4))}


def batches(shape: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(EXAMPLES, *shape, generator=g, dtype=torch.float64)
    y = torch.randn(EXAMPLES, 2, generator=g, dtype=torch.float64)
    return [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, EXAMPLES, BATCH)]


def per_example_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum(1)


def train_reference(model: nn.Module, optimizer: torch.optim.Optimizer,
                    data: list[tuple[torch.Tensor, torch.Tensor]], epochs: int,
                    clip: float | None = None,
                    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None) -> None:
    for _ in range(epochs):
        for x, y in data:
            per_example_loss(model(x), y).mean().backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()


def train_mirrored(strategy: mirrored.MirroredStrategy, model: MirroredModule,
                   optimizer: MirroredOptimizer, data: list[tuple[torch.Tensor, torch.Tensor]],
                   epochs: int, clip: float | None = None,
                   scheduler: torch.optim.lr_scheduler.LRScheduler | None = None) -> None:
    n = strategy.num_replicas_in_sync

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        mirrored.compute_average_loss(per_example_loss(model(x), y)).backward()
        optimizer.step(clip_grad_norm=clip)
        optimizer.zero_grad()

    for _ in range(epochs):
        for x, y in data:
            strategy.run(step, args=(mirrored.PerReplica(split(x, n)),
                                     mirrored.PerReplica(split(y, n))))
        if scheduler is not None:
            scheduler.step()


def assert_matches(reference: nn.Module, model: MirroredModule) -> None:
    expected = reference.state_dict()
    actual = model.state_dict()
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, rtol=0, atol=1e-9, msg=key)
    assert_copies_equal(model)


def assert_copies_equal(model: MirroredModule) -> None:
    first = model.replicas[0].state_dict()
    for r, replica in enumerate(model.replicas[1:], start=1):
        for key, value in replica.state_dict().items():
            assert torch.equal(value, first[key]), f"replica {r} differs at {key}"


@pytest.fixture(scope="module")
def strategies() -> Iterator[dict[int, mirrored.MirroredStrategy]]:
    made = {n: mirrored.MirroredStrategy([f"CPU:{i}" for i in range(n)]) for n in (1, 2, 3, 4)}
    yield made
    for strategy in made.values():
        strategy.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model_name", ["mlp", "cnn"])
@pytest.mark.parametrize("optimizer_name", ["sgd", "adam"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_training_equals_single_device(strategies: dict[int, mirrored.MirroredStrategy],
                                       n: int, optimizer_name: str, model_name: str) -> None:
    make_model, shape = MODELS[model_name]
    make_optimizer = OPTIMIZERS[optimizer_name]
    data = batches(shape)
    reference = make_model()
    train_reference(reference, make_optimizer(reference.parameters()), data, EPOCHS)

    strategy = strategies[n]
    model = mirror(strategy, make_model(), sync_batch_norm=model_name == "cnn")
    optimizer = mirror_optimizer(strategy, model, make_optimizer)
    train_mirrored(strategy, model, optimizer, data, EPOCHS)
    assert_matches(reference, model)
    if model_name == "cnn":  # the running statistics moved, and match too
        assert int(model.state_dict()["1.num_batches_tracked"]) == EPOCHS * len(data)


@pytest.mark.timeout(60)
def test_clip_grad_norm_equals_torch_clip(strategies: dict[int, mirrored.MirroredStrategy]
                                          ) -> None:
    data = batches((3,))
    reference = mlp()
    train_reference(reference, OPTIMIZERS["sgd"](reference.parameters()), data, 1, clip=0.05)
    unclipped = mlp()
    train_reference(unclipped, OPTIMIZERS["sgd"](unclipped.parameters()), data, 1)

    strategy = strategies[3]
    model = mirror(strategy, mlp())
    optimizer = mirror_optimizer(strategy, model, OPTIMIZERS["sgd"])
    train_mirrored(strategy, model, optimizer, data, 1, clip=0.05)
    assert_matches(reference, model)
    assert not torch.allclose(unclipped[0].weight, reference[0].weight)  # clipping mattered


@pytest.mark.timeout(60)
def test_step_lr_scheduler(strategies: dict[int, mirrored.MirroredStrategy]) -> None:
    data = batches((3,))
    reference = mlp()
    ref_optimizer = OPTIMIZERS["sgd"](reference.parameters())
    ref_scheduler = torch.optim.lr_scheduler.StepLR(ref_optimizer, step_size=1, gamma=0.5)
    train_reference(reference, ref_optimizer, data, EPOCHS, scheduler=ref_scheduler)

    strategy = strategies[2]
    model = mirror(strategy, mlp())
    optimizer = mirror_optimizer(strategy, model, OPTIMIZERS["sgd"])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    train_mirrored(strategy, model, optimizer, data, EPOCHS, scheduler=scheduler)
    assert_matches(reference, model)
    assert scheduler.get_last_lr() == [0.1 * 0.5 ** EPOCHS]
    # Replica 1's optimizer got replica 0's lr at its last step (0.1 * 0.5 ** 2).
    assert optimizer.optimizers[1].param_groups[0]["lr"] == 0.1 * 0.5 ** (EPOCHS - 1)


@pytest.mark.timeout(60)
def test_checkpoint_resume_equals_straight_training(
        strategies: dict[int, mirrored.MirroredStrategy]) -> None:
    data = batches((1, 4, 4))
    strategy = strategies[3]
    straight = mirror(strategy, cnn(), sync_batch_norm=True)
    straight_optimizer = mirror_optimizer(strategy, straight, OPTIMIZERS["adam"])
    train_mirrored(strategy, straight, straight_optimizer, data, EPOCHS)

    model = mirror(strategy, cnn(), sync_batch_norm=True)
    optimizer = mirror_optimizer(strategy, model, OPTIMIZERS["adam"])
    train_mirrored(strategy, model, optimizer, data, EPOCHS - 1)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)

    fresh = mirrored.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    try:
        # A different initialization, overwritten by the load.
        resumed = mirror(fresh, cnn(seed=123), sync_batch_norm=True)
        resumed_optimizer = mirror_optimizer(fresh, resumed, OPTIMIZERS["adam"])
        resumed.load_state_dict(saved["model"])
        resumed_optimizer.load_state_dict(saved["optimizer"])
        assert_copies_equal(resumed)
        train_mirrored(fresh, resumed, resumed_optimizer, data, 1)
    finally:
        fresh.close()
    expected = straight.state_dict()
    for key, value in resumed.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert_copies_equal(resumed)


SCHEDULERS = {
    "step": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 / (1 + e)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),
    "sequential": lambda opt: torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, 0.5, total_iters=2),
        torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)], milestones=[2]),
    "chained": lambda opt: torch.optim.lr_scheduler.ChainedScheduler([
        torch.optim.lr_scheduler.ConstantLR(opt, 0.5, total_iters=2),
        torch.optim.lr_scheduler.ExponentialLR(opt, 0.9)]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_a_scheduler_stepped_inside_run_is_refused(
        strategies: dict[int, mirrored.MirroredStrategy], name: str, replicas: int) -> None:
    """The plain loop's ``scheduler.step()`` after ``optimizer.step()``, ported into
    the step function: each replica would step it, a schedule N times too fast."""
    strategy = strategies[replicas]
    model = mirror(strategy, mlp())
    optimizer = mirror_optimizer(strategy, model, OPTIMIZERS["sgd"])
    scheduler = SCHEDULERS[name](optimizer)
    lr = optimizer.param_groups[0]["lr"]  # (replica 0's: every replica takes it at step)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        mirrored.compute_average_loss(per_example_loss(model(x), y)).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    x, y = batches((3,))[0]
    times = f"{replicas} times per training step" if replicas > 1 else "N times per training"
    owner = type(scheduler).__name__  # (SequentialLR: itself, not the child it steps)
    with pytest.raises(RuntimeError, match=rf"^{owner} was stepped \(or built\) inside "
                                           rf"strategy.run: .* advance {times}"):
        strategy.run(step, args=(mirrored.PerReplica(split(x, replicas)),
                                 mirrored.PerReplica(split(y, replicas))))
    # The learning rate did not move (the schedule's count did, once per replica).
    assert [o.param_groups[0]["lr"] for o in optimizer.optimizers] == [lr] * replicas


@pytest.mark.timeout(60)
def test_plateau_and_schedulers_built_inside_run_are_refused(
        strategies: dict[int, mirrored.MirroredStrategy]) -> None:
    strategy = strategies[2]
    model = mirror(strategy, mlp())
    optimizer = mirror_optimizer(strategy, model, OPTIMIZERS["sgd"])
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)

    with pytest.raises(RuntimeError, match=r"^ReduceLROnPlateau was stepped"):
        strategy.run(plateau.step, args=(1.0,))
    with pytest.raises(RuntimeError, match=r"^StepLR was stepped"):
        strategy.run(lambda: torch.optim.lr_scheduler.StepLR(optimizer, step_size=1))
    # Outside run, as in the test above: replica 0's groups, copied at the next step.
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)
    for loss in (1.0, 2.0):
        plateau.step(loss)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("replicas", [1, 2])
def test_an_averaged_model_updated_inside_run_is_refused_and_after_run_is_one_devices(
        strategies: dict[int, mirrored.MirroredStrategy], replicas: int) -> None:
    """torch's EMA (``AveragedModel``) updated in the step function: each replica
    would update it, N updates a step; after ``run`` it averages as on one device."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    data = batches((3,))
    reference = mlp()
    ref_optimizer = OPTIMIZERS["sgd"](reference.parameters())
    ref_ema = AveragedModel(reference, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    strategy = strategies[replicas]
    model = mirror(strategy, mlp())
    optimizer = mirror_optimizer(strategy, model, OPTIMIZERS["sgd"])
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))

    def step(x: torch.Tensor, y: torch.Tensor, update: bool) -> None:
        mirrored.compute_average_loss(per_example_loss(model(x), y)).backward()
        optimizer.step()
        optimizer.zero_grad()
        if update:
            ema.update_parameters(model)

    def args(x: torch.Tensor, y: torch.Tensor, update: bool) -> tuple[Any, ...]:
        return (mirrored.PerReplica(split(x, replicas)), mirrored.PerReplica(split(y, replicas)),
                update)

    with pytest.raises(RuntimeError, match=r"^AveragedModel.update_parameters\(model\) .* "
                                           r"inside strategy.run: every replica would update"):
        strategy.run(step, args=args(*data[0], True))
    assert int(ema.n_averaged) == 0
    train_reference(reference, ref_optimizer, data[:1], 1)  # (the refused run's step)
    for x, y in data[1:]:
        strategy.run(step, args=args(x, y, False))
        ema.update_parameters(model)  # after run: replica 0's copy, once a step
        per_example_loss(reference(x), y).mean().backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        ref_ema.update_parameters(reference)
    assert int(ema.n_averaged) == len(data) - 1
    for a, b in zip(ema.parameters(), ref_ema.parameters(), strict=True):
        torch.testing.assert_close(a, b)
