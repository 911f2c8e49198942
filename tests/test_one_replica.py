"""One replica in all (``MirroredStrategy(["CPU:0"])``, ``OneDeviceStrategy``, the
default strategy) skips what is identity on one replica: ``run`` calls the step on the
caller's thread, ``reduce`` reduces the one component, the dataset hands batches over
as they are, the optimizer makes no all-reduce. The README loop must still give the
plain loop's numbers bit for bit, and every porting trap must raise as it does on N
replicas (a user going from 1 to 2 replicas meets no new error)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from mirrored._src import context
from mirrored._src.strategies import solo

pytestmark = pytest.mark.timeout(120)

ONE_REPLICA: dict[str, Callable[[], mirrored.Strategy]] = {
    "mirrored": lambda: mirrored.MirroredStrategy(["CPU:0"]),
    "one device": lambda: mirrored.OneDeviceStrategy("CPU:0"),
}


def make_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 4))


def make_batches(sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(b, 8, generator=g), torch.randint(0, 4, (b,), generator=g))
            for b in sizes]


OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1),
}


def plain_loop(batches: list[tuple[torch.Tensor, torch.Tensor]],
               make_optimizer: Callable[[Any], torch.optim.Optimizer]
               ) -> tuple[nn.Module, list[torch.Tensor]]:
    model = make_net()
    optimizer = make_optimizer(list(model.parameters()))
    losses = []
    for x, y in batches:
        per_example_loss = F.cross_entropy(model(x), y, reduction="none")
        loss = per_example_loss.sum() / len(y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(per_example_loss.detach().mean())
    return model, losses


def readme_loop(strategy: mirrored.Strategy, batches: list[tuple[torch.Tensor, torch.Tensor]],
                make_optimizer: Callable[[Any], torch.optim.Optimizer]
                ) -> tuple[nn.Module, list[torch.Tensor]]:
    model = strategy.mirror(make_net())
    optimizer = strategy.mirror_optimizer(model, make_optimizer)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example_loss = F.cross_entropy(model(x), y, reduction="none")
        loss = mirrored.compute_average_loss(per_example_loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return per_example_loss.detach()

    losses = []
    for x, y in strategy.experimental_distribute_dataset(batches):
        per_example_loss = strategy.run(train_step, args=(x, y))
        losses.append(strategy.reduce("MEAN", per_example_loss, axis=0))
    return model, losses


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", list(ONE_REPLICA))
def test_readme_loop_is_the_plain_loop_bit_for_bit(kind: str, optimizer: str) -> None:
    batches = make_batches([16, 16, 16, 5, 16, 1])  # a partial batch and a single example
    expected_model, expected_losses = plain_loop(batches, OPTIMIZERS[optimizer])
    strategy = ONE_REPLICA[kind]()
    model, losses = readme_loop(strategy, batches, OPTIMIZERS[optimizer])
    for got, expected in zip(losses, expected_losses, strict=True):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    for (name, got), expected in zip(model.state_dict().items(),
                                     expected_model.state_dict().values(), strict=True):
        assert torch.equal(got, expected), name
    strategy.close()


def test_default_strategy_loop_is_the_plain_loop_bit_for_bit() -> None:
    batches = make_batches([16, 7, 16])
    expected_model, expected_losses = plain_loop(batches, OPTIMIZERS["sgd momentum"])
    model, losses = readme_loop(mirrored.get_strategy(), batches, OPTIMIZERS["sgd momentum"])
    assert all(torch.equal(a, b) for a, b in zip(losses, expected_losses, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 expected_model.state_dict().values(),
                                                 strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reduce_mean_is_torch_mean_bit_for_bit(dtype: torch.dtype) -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0"])
    g = torch.Generator().manual_seed(3)
    for size in (1, 7, 64, 256, 1000):
        value = torch.randn(size, generator=g, dtype=dtype) * 1e3
        got = strategy.reduce("MEAN", value, axis=0)
        assert got.dtype == dtype and torch.equal(got, value.mean())
    strategy.close()


def test_reduce_alone_plan_cache_keeps_errors() -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0"])
    strategy.reduce("SUM", torch.ones(3), axis=0)  # caches the rank-1 plan
    with pytest.raises(ValueError, match=r"reduce\(SUM, axis=0\): rank-0 values at value"):
        strategy.reduce("SUM", torch.tensor(1.0), axis=0)
    with pytest.raises(ValueError, match=r"reduce\(MAX, axis=0\) has no elements"):
        strategy.reduce("MAX", torch.ones(0), axis=0)
    strategy.reduce("MAX", torch.ones(2), axis=0)  # now cached: the check still runs
    with pytest.raises(ValueError, match=r"reduce\(MAX, axis=0\) has no elements"):
        strategy.reduce("MAX", torch.ones(0), axis=0)
    strategy.close()


@pytest.mark.parametrize("kind", list(ONE_REPLICA))
def test_reduce_fast_path_after_the_general_path_planned(kind: str) -> None:
    strategy = ONE_REPLICA[kind]()
    solo_reduce = strategy._solo.reduce  # type: ignore[union-attr]
    value = torch.randn(5, 3, generator=torch.Generator().manual_seed(4), requires_grad=True)
    for op in ("MEAN", mirrored.ReduceOp.MEAN, "mean"):
        for axis in (0, 1, -1):
            expected = value.detach().mean(axis % 2)
            first = strategy.reduce(op, value, axis=axis)  # plans (and caches) the op
            taken = solo_reduce(op, value, axis)  # then the fast path answers
            assert taken is not solo.NOT_TAKEN and not taken.requires_grad
            assert torch.equal(first, expected) and torch.equal(taken, expected)
    # what it does not take goes the general way, with the general path's errors
    assert solo_reduce("SUM", value, 0) is solo.NOT_TAKEN
    assert solo_reduce("MEAN", value.detach().int(), 0) is solo.NOT_TAKEN
    assert solo_reduce("MEAN", value, (0,)) is solo.NOT_TAKEN
    assert solo_reduce("MEAN", value, 2) is solo.NOT_TAKEN
    assert solo_reduce("MEDIAN", value, 0) is solo.NOT_TAKEN
    with pytest.raises(ValueError, match="MEDIAN"):
        strategy.reduce("MEDIAN", value, axis=0)
    assert solo_reduce(["MEAN"], value, 0) is solo.NOT_TAKEN  # unhashable: not looked up
    with pytest.raises(TypeError, match=r"reduce_op must be .*got list"):
        strategy.reduce(["MEAN"], value, axis=0)
    with pytest.raises(ValueError, match="axis"):
        strategy.reduce("MEAN", value, axis=2)
    with pytest.raises(RuntimeError, match="requires cross-replica context"):
        strategy.run(lambda: strategy.reduce("MEAN", value, axis=0))
    strategy.close()


# ------------------------------------------------------------------ run's fast path
@pytest.mark.parametrize("kind", list(ONE_REPLICA))
def test_run_fast_path_is_a_replica_call(kind: str) -> None:
    strategy = ONE_REPLICA[kind]()
    x = torch.ones(2)
    seen: dict[str, Any] = {}

    def step(a: torch.Tensor, b: int, c: None) -> torch.Tensor:
        ctx = mirrored.get_replica_context()
        seen["ctx"] = ctx
        seen["in flight"] = context.run_in_flight(strategy)
        seen["cross"] = mirrored.in_cross_replica_context()
        seen["args"] = (a, b, c)
        return a

    assert strategy._solo is not None  # this strategy has the fast path
    assert strategy.run(step, args=(x, 3, None)) is x  # one replica: the plain result
    assert seen["ctx"] is strategy._contexts[0] and seen["ctx"].replica_id_in_sync_group == 0
    assert seen["in flight"] and not seen["cross"] and seen["args"][0] is x
    assert not context.run_in_flight(strategy) and not context.in_run()
    with strategy.scope():  # in its own scope too
        assert strategy.run(step, args=[x, 1, None]) is x
        assert seen["ctx"] is strategy._contexts[0]
    assert strategy.run(step, args=(x,), kwargs={"b": 2, "c": None}) is x  # general path
    assert seen["args"] == (x, 2, None)
    per_replica = strategy.experimental_distribute_values_from_function(lambda ctx: x)
    assert strategy.run(step, args=(per_replica, 0, None)) is x  # general path
    strategy.close()


def test_run_fast_path_errors_are_the_general_paths() -> None:
    one = mirrored.MirroredStrategy(["CPU:0"])
    other = mirrored.MirroredStrategy(["CPU:0"])

    def fail() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError) as info:
        one.run(fail)
    assert info.value.__notes__ == ["raised in replica 0 (CPU:0) of MirroredStrategy.run"]
    assert not context.in_run() and not context.run_in_flight(one)
    with pytest.raises(RuntimeError, match="cannot be called inside a replica"):
        one.run(lambda: one.run(lambda: None))
    with other.scope(), pytest.raises(RuntimeError, match="Mixing different mirrored"):
        one.run(lambda: None)
    with pytest.raises(ValueError, match="takes a tuple or list"):
        one.run(lambda x: x, args=torch.ones(1))
    with pytest.raises(TypeError, match="takes a dict"):
        one.run(lambda: None, kwargs=[1])
    with torch.device("meta"):  # a device mode: the general path, on the replica's device
        assert one.run(lambda: torch.ones(1)).device.type == "cpu"
    with torch.profiler.profile() as prof:  # a profiler: the general path, with its ranges
        one.run(lambda: torch.ones(1) + 1)
    assert any(e.name.startswith("mirrored.run") for e in prof.events())
    one.close()
    other.close()


def test_fast_path_only_with_one_replica_in_one_process() -> None:
    assert mirrored.MirroredStrategy(["CPU:0", "CPU:1"])._solo is None
    assert mirrored.get_strategy()._solo is not None
    assert solo.solo_run is not None


def test_dataset_hands_batches_over_as_they_are() -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0"])
    x, y = torch.ones(4, 2), torch.zeros(4)
    batches = [(x, y), x, [x, y], {"x": x}, (1.5, y)]
    got = list(strategy.experimental_distribute_dataset(batches))
    assert got[0] is batches[0] and got[1] is x  # tuples of tensors and tensors: as they are
    assert type(got[2]) is list and got[2][0] is x and got[2][1] is y
    assert got[3] == {"x": x}
    assert torch.equal(got[4][0], torch.tensor(1.5)) and got[4][1] is y  # converted
    with pytest.raises(ValueError, match="batch 0 of the dataset has no tensors"):
        list(strategy.experimental_distribute_dataset([()]))
    strategy.close()


# ------------------------------------------------------------- traps on one replica
def _model_and_optimizer(strategy: mirrored.Strategy, **options: Any
                         ) -> tuple[Any, mirrored.MirroredOptimizer]:
    model = strategy.mirror(make_net())
    return model, strategy.mirror_optimizer(
        model, lambda p: torch.optim.SGD(p, lr=0.1), **options)


@pytest.mark.parametrize("replicas", [1, 2])
def test_clip_before_step_raises_on_one_replica_as_on_two(replicas: int) -> None:
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    model, optimizer = _model_and_optimizer(strategy)
    (x, y), = make_batches([8])

    def clipped(x: torch.Tensor, y: torch.Tensor) -> None:
        mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        optimizer.step()

    before = [p.clone() for p in model.parameters()]
    with pytest.raises(mirrored.ReplicaDivergenceError,
                       match=r"changed in place on replica 0 between backward\(\) and "
                             r"optimizer.step\(\).*step\(clip_grad_norm=c\)"):
        strategy.run(clipped, args=next(iter(strategy.experimental_distribute_dataset(
            [(x, y)]))))
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    strategy.close()


@pytest.mark.parametrize("replicas", [1, 2])
def test_manual_update_discarded_by_zero_grad_raises_on_one_replica(replicas: int) -> None:
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    model, optimizer = _model_and_optimizer(strategy)
    batch = next(iter(strategy.experimental_distribute_dataset(make_batches([8]))))

    def manual(x: torch.Tensor, y: torch.Tensor) -> None:
        mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.1)
        optimizer.zero_grad()

    with pytest.raises(mirrored.ReplicaDivergenceError,
                       match="zero_grad discards gradients of local replica 0 that were never "
                             "all-reduced"):
        strategy.run(manual, args=batch)
    strategy.close()


def test_one_replica_message_says_why_it_is_refused() -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0"])
    model, optimizer = _model_and_optimizer(strategy)

    def step() -> None:
        model(torch.ones(2, 8)).sum().backward()
        for p in model.parameters():
            p.grad.mul_(0.5)
        optimizer.step()

    with pytest.raises(mirrored.ReplicaDivergenceError,
                       match="With one replica the gradients are already the global ones"):
        strategy.run(step)
    strategy.close()


@pytest.mark.parametrize("check", ["cheap", "full"])
def test_one_replica_watches_the_first_step_and_every_eighth_with_cheap(check: str) -> None:
    # One replica in all: the gradients are the global ones, so a change before step()
    # is only wrong on N replicas. "cheap" watches the steps the divergence check reads
    # (its hooks removed in between: their cost on every step); "full" every step.
    strategy = mirrored.MirroredStrategy(["CPU:0"])
    model, optimizer = _model_and_optimizer(strategy, check=check)
    reference = make_net()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(4, 8)

    def step(clip: bool) -> None:
        optimizer.zero_grad()
        model(x).square().sum().backward()
        if clip:
            for p in model.parameters():
                p.grad.mul_(0.5)
        optimizer.step()

    for k in range(8):  # the first step unchanged; then every step halves its gradients
        assert bool(optimizer._watch.handles) == (k == 0 or check == "full"), k
        if check == "full" and k == 1:
            with pytest.raises(mirrored.ReplicaDivergenceError, match="changed in place"):
                strategy.run(step, args=(True,))
            strategy.close()
            return
        strategy.run(step, args=(k > 0,))
        plain.zero_grad()
        reference(x).square().sum().backward()
        for p in reference.parameters():
            p.grad.mul_(0.5 if k > 0 else 1.0)
        plain.step()
    # cheap: steps 1-7 unwatched trained as plain torch does on one replica; step 8 is
    # watched again, and refused
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(),
                                                 strict=True))
    assert optimizer._watch.handles
    with pytest.raises(mirrored.ReplicaDivergenceError, match="changed in place"):
        strategy.run(step, args=(True,))
    strategy.run(step, args=(False,))  # refused once: not again (nor by zero_grad)
    strategy.close()


def test_one_replica_allowed_patterns_and_check_off() -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0"])
    model, optimizer = _model_and_optimizer(strategy)
    reference = make_net()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    x = torch.randn(4, 8)

    def step(clip: float | None) -> None:
        optimizer.zero_grad()
        model(x).square().sum().backward()
        optimizer.step(clip_grad_norm=clip)  # clipping the (global) gradients in step
        optimizer.step()  # a second step without backward: no refusal, as on N

    for clip in (None, 0.5):
        strategy.run(step, args=(clip,))
        plain.zero_grad()
        reference(x).square().sum().backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(reference.parameters(), clip)
        plain.step()
        plain.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters(),
                                                 strict=True))
    # check="off" turns the watch off, on one replica as on N
    model, optimizer = _model_and_optimizer(strategy, check="off")

    def clipped() -> None:
        model(x).sum().backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        optimizer.step()

    strategy.run(clipped)
    strategy.close()


@pytest.mark.parametrize("replicas", [1, 2])
def test_grad_scaler_clip_after_unscale_on_one_replica_as_on_two(replicas: int) -> None:
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    # (check="full": one replica watches every step, not only the first and every 8th)
    model, optimizer = _model_and_optimizer(strategy, check="full")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    batches = make_batches([8, 8])
    reference = make_net()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    plain_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)  # torch's recipe: allowed
        scaler.step(optimizer)
        scaler.update()

    for batch, (x, y) in zip(strategy.experimental_distribute_dataset(batches), batches,
                             strict=True):
        strategy.run(step, args=batch)
        plain.zero_grad()
        plain_scaler.scale(F.cross_entropy(reference(x), y)).backward()
        plain_scaler.unscale_(plain)
        nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        plain_scaler.step(plain)
        plain_scaler.update()
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
        if replicas == 1:
            assert torch.equal(got, expected)

    def clip_before_unscale(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        scaler.scale(loss).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        scaler.step(optimizer)

    with pytest.raises(mirrored.ReplicaDivergenceError, match="changed in place"):
        strategy.run(clip_before_unscale,
                     args=next(iter(strategy.experimental_distribute_dataset(batches))))
    strategy.close()


def test_grad_scaler_skipped_step_leaves_nothing_settled_on_one_replica() -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0"])
    model, optimizer = _model_and_optimizer(strategy, check="full")  # (every step watched)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)

    def overflowing() -> None:
        scaler.scale(model(torch.full((2, 8), float("inf"))).sum()).backward()
        scaler.step(optimizer)  # inf: torch's scaler skips the step
        scaler.update()

    def clipped() -> None:
        model(torch.ones(2, 8)).sum().backward()  # accumulates, no zero_grad
        nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        optimizer.step()

    strategy.run(overflowing)
    with pytest.raises(mirrored.ReplicaDivergenceError, match="changed in place"):
        strategy.run(clipped)
    strategy.close()


def test_zero_grad_after_unscale_forgets_the_reduced_gradients() -> None:
    # unscale_ all-reduces; zero_grad then drops those gradients, so the next step must
    # all-reduce the new ones (it used to take the new local gradients as reduced).
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model, optimizer = _model_and_optimizer(strategy)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    reference = make_net()
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    (x, y), = make_batches([8])

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        scaler.scale(loss).backward(retain_graph=True)
        scaler.unscale_(optimizer)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    strategy.run(step, args=next(iter(strategy.experimental_distribute_dataset([(x, y)]))))
    F.cross_entropy(reference(x), y).backward()
    plain.step()
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)
    strategy.close()
