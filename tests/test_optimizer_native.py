"""The mirrored optimizer as a torch user ports to it: GradScaler in the documented
pattern, the divergence check and the traps it names (manual updates, clipping
before step), the rule for buffers other than BatchNorm's, param groups built from
the parameter list; each against a one-device reference."""

from __future__ import annotations

import contextlib
import math
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import mirrored
from mirrored import ReplicaDivergenceError

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def two() -> Iterator[mirrored.MirroredStrategy]:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    yield strategy
    strategy.close()


def net(dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).to(dtype)


def data(dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(6, 3, generator=g).to(dtype), torch.randn(6, generator=g).to(dtype))


def split(t: torch.Tensor) -> mirrored.PerReplica[torch.Tensor]:
    return mirrored.PerReplica([t[:4], t[4:]])  # uneven: 4 + 2


def assert_copies_equal(model: mirrored.MirroredModule) -> None:
    for a, b in zip(model.replicas[0].state_dict().values(),
                    model.replicas[1].state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grad_scaler_steps_like_one_device_and_skips_an_inf_on_any_replica(
        two: mirrored.MirroredStrategy, dtype: torch.dtype) -> None:
    reference = net(dtype)
    model = two.mirror(net(dtype))
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    x0, y = data(dtype)
    scales = []
    for bad in (False, True, False, False, False):
        x = x0.clone()
        if bad:
            x[5, 0] = math.inf  # only in replica 1's batch
        before = [p.clone() for p in model.replicas[0].parameters()]
        two.run(step, args=(split(x), split(y)))
        loss = ((reference(x).squeeze(1) - y) ** 2).mean()
        ref_opt.zero_grad()
        ref_scaler.scale(loss).backward()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale()
        scales.append(scaler.get_scale())
        assert_copies_equal(model)
        if bad:  # skipped on every copy
            assert all(torch.equal(a, b) for a, b in zip(before, model.replicas[0].parameters(),
                                                         strict=True))
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        for a, b in zip(model.replicas[0].parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert scales == [1024.0, 512.0, 512.0, 1024.0, 1024.0]


def test_grad_scaler_unscale_then_clip_is_the_global_clip(two: mirrored.MirroredStrategy) -> None:
    reference = net()
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.5))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=256.0)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)  # all-reduces: the clip below sees the global gradients
        nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        scaler.step(opt)
        scaler.update()

    x, y = data()
    for _ in range(2):
        two.run(step, args=(split(x), split(y)))
        loss = ((reference(x).squeeze(1) - y) ** 2).mean()
        ref_opt.zero_grad()
        ref_scaler.scale(loss).backward()
        ref_scaler.unscale_(ref_opt)
        nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
    assert_copies_equal(model)
    for a, b in zip(model.replicas[0].parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

    def twice(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        scaler.unscale_(opt)

    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        two.run(twice, args=(split(x), split(y)))


def test_manual_update_raises_naming_the_trap(two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

    def manual(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2)
        loss.backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)  # each copy with its own gradient
        opt.zero_grad()

    x, y = data()
    with pytest.raises(ReplicaDivergenceError, match=r"never all-reduced.*manual update"):
        two.run(manual, args=(split(x), split(y)))


def test_copies_that_differ_raise_naming_the_parameter_and_replicas(
        two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if mirrored.get_replica_context().replica_id_in_sync_group == 1:
            with torch.no_grad():  # an update the optimizer does not make
                model.module[2].bias.add_(1e-3)

    x, y = data()
    for _ in range(8):  # checked at step 1 (equal), then every 8th step: found at step 9
        two.run(step, args=(split(x), split(y)))
    with pytest.raises(ReplicaDivergenceError,
                       match=r"step 9 \(equal at step 1; check='full' checks every step\): "
                             r"'2.bias' on replica\(s\) \[1\] differs from replica 0"
                             r".*manual update"):
        two.run(step, args=(split(x), split(y)))


def test_full_check_sees_one_bit_and_off_sees_nothing(two: mirrored.MirroredStrategy) -> None:
    x, y = data()
    for check in ("full", "off"):
        model = two.mirror(net())
        opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1), check=check)
        with torch.no_grad():
            w = model.replicas[1][0].weight
            w[1, 2] = torch.nextafter(w[1, 2], torch.tensor(math.inf, dtype=w.dtype))

        def step(x: torch.Tensor, y: torch.Tensor, model: mirrored.MirroredModule = model,
                 opt: mirrored.MirroredOptimizer = opt) -> None:
            loss = mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2)
            opt.zero_grad()
            loss.backward()
            opt.step()

        if check == "full":
            with pytest.raises(ReplicaDivergenceError, match=r"'0.weight' on replica\(s\) \[1\]"):
                two.run(step, args=(split(x), split(y)))
        else:
            two.run(step, args=(split(x), split(y)))
    with pytest.raises(ValueError, match="check must be one of 'cheap', 'full', 'off'; got 'all'"):
        two.mirror_optimizer(two.mirror(net()), torch.optim.SGD, check="all")  # type: ignore[arg-type]


def test_clipping_before_step_raises_naming_the_fix(two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2)
        opt.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # local gradients: the trap
        opt.step()

    x, y = data()
    with pytest.raises(ReplicaDivergenceError,
                       match=r"changed in place.*clip_grad_norm_.*step\(clip_grad_norm=c\)"):
        two.run(step, args=(split(x), split(y)))


class WithEma(nn.Module):
    """A linear layer with a buffer updated in forward (an EMA of the inputs' mean) and
    an integer counter."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 1).double()
        self.register_buffer("ema", torch.zeros(3, dtype=torch.float64))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.5).add_(x.mean(0), alpha=0.5)
                self.calls += 1
        return self.linear(x)


@pytest.mark.parametrize("rule", ["average", "broadcast", "off"])
def test_buffers_follow_the_rule(two: mirrored.MirroredStrategy, rule: str) -> None:
    torch.manual_seed(0)
    model = two.mirror(WithEma())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1),
                               buffers=rule)  # type: ignore[arg-type]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2)
        opt.zero_grad()
        loss.backward()
        opt.step()

    x, y = data()
    halves = mirrored.PerReplica([x[:3], x[3:]]), mirrored.PerReplica([y[:3], y[3:]])
    if rule == "off":  # nothing keeps the buffer equal: the check finds it at the step
        with pytest.raises(ReplicaDivergenceError,
                           match=r"'ema' on replica\(s\) \[1\].*buffers='average'"):
            two.run(step, args=halves)
        return
    two.run(step, args=halves)
    local = [0.5 * x[:3].mean(0), 0.5 * x[3:].mean(0)]
    ema = [c.ema for c in model.replicas]
    assert [int(c.calls) for c in model.replicas] == [1, 1]
    if rule == "average":  # the mean of the copies' EMAs: one device's, for equal halves
        for e in ema:
            torch.testing.assert_close(e, 0.5 * x.mean(0), rtol=1e-15, atol=1e-15)
        assert torch.equal(ema[0], ema[1])
    else:
        assert torch.equal(ema[0], local[0]) and torch.equal(ema[1], local[0])


class WithConstant(nn.Module):
    """A constant float buffer (a positional encoding) beside the parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(600, 1)
        self.register_buffer("pe", torch.randn(600))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x + self.pe)  # type: ignore[no-any-return]


@pytest.mark.parametrize("replicas", [3, 5])
def test_a_constant_buffer_stays_bitwise_constant(replicas: int) -> None:
    # Averaged at every step, it drifted: (x + x + x) / 3 is not x for about 15 % of
    # float32 values (93 of 600 elements moved in 5 steps on 3 replicas).
    torch.manual_seed(0)
    module = WithConstant()
    initial = module.pe.clone()
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    try:
        model = strategy.mirror(module)
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

        def step(x: torch.Tensor) -> None:
            opt.zero_grad()
            mirrored.compute_average_loss(model(x).pow(2).sum(1)).backward()
            opt.step()

        x = torch.randn(2 * replicas, 600)
        parts = strategy.experimental_distribute_values_from_function(
            lambda c: x.chunk(replicas)[c.replica_id_in_sync_group])
        for _ in range(5):
            strategy.run(step, args=(parts,))
        for copy_ in model.replicas:
            assert torch.equal(copy_.pe, initial)
    finally:
        strategy.close()


def _train_on_splits(two: mirrored.MirroredStrategy, model: nn.Module, opt: Any,
                     reference: nn.Module, splits: tuple[list[int], ...]) -> None:
    """Steps the mirrored model on the first ``sum(rows)`` examples split ``rows`` over
    the replicas, and ``reference`` (plain SGD, lr 0.1) on the same rows."""
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2)
        opt.zero_grad()
        loss.backward()
        opt.step()

    x, y = data()
    for rows in splits:
        xs, ys = x[:sum(rows)], y[:sum(rows)]
        two.run(step, args=(mirrored.PerReplica(list(xs.split(rows))),
                            mirrored.PerReplica(list(ys.split(rows)))))
        ref_opt.zero_grad()
        ((reference(xs).squeeze(1) - ys) ** 2).mean().backward()
        ref_opt.step()


def test_a_replica_with_an_empty_batch_is_left_out_of_the_buffers_average(
        two: mirrored.MirroredStrategy) -> None:
    # The empty replica's EMA took x.mean(0) of no rows, NaN; averaged in, every copy
    # became NaN, and the next step's parameters with it. ("broadcast" takes replica
    # 0's, as DDP does, empty or not.)
    torch.manual_seed(0)
    model = two.mirror(WithEma())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    torch.manual_seed(0)
    reference = WithEma()
    _train_on_splits(two, model, opt, reference, ([3, 3], [1, 0], [0, 2], [3, 3]))
    for copy_ in model.replicas:  # (even or one-sided batches: one device's EMA)
        torch.testing.assert_close(copy_.ema, reference.ema, rtol=1e-12, atol=1e-12)
        for a, b in zip(copy_.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_replica_with_an_empty_batch_is_left_out_of_the_batch_norm_average(
        two: mirrored.MirroredStrategy, overlap: bool) -> None:
    # torch leaves an empty batch's running statistics as they were; averaged in, the
    # statistics moved half as far as one device's (here, where one replica has every
    # row, its batch statistics and so its gradients are one device's exactly).
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).double()

    model = two.mirror(make())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1), overlap=overlap)
    reference = make()
    _train_on_splits(two, model, opt, reference, ([4, 0], [0, 3], [2, 0], [0, 5]))
    for copy_ in model.replicas:
        for a, b in zip(copy_.state_dict().values(), reference.state_dict().values(),
                        strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_make_optimizer_gets_a_list_for_decay_groups(two: mirrored.MirroredStrategy) -> None:
    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                  {"params": no_decay, "weight_decay": 0.0}], lr=0.05)

    reference = net()
    ref_opt = make(list(reference.parameters()))
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, make)
    assert [len(g["params"]) for g in opt.param_groups] == [2, 2]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2)
        opt.zero_grad()
        loss.backward()
        opt.step()

    x, y = data()
    for _ in range(3):
        two.run(step, args=(split(x), split(y)))
        ref_opt.zero_grad()
        ((reference(x).squeeze(1) - y) ** 2).mean().backward()
        ref_opt.step()
    assert_copies_equal(model)
    for a, b in zip(model.replicas[0].parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _scaled_worker(check_divergence: bool) -> dict[str, object]:
    """2 workers x 2 local replicas: GradScaler steps with an inf in global replica 3's
    batch only (worker 1), then (``check_divergence``) a change to global replica 3's
    copy, found by the check on every worker."""
    from mirrored.experimental import CommunicationOptions

    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=30),
        devices=["CPU:0", "CPU:1"])
    worker = strategy.cluster_resolver.worker_index
    try:
        model = strategy.mirror(net())
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1),
                                        check="full")
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            loss = mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2,
                                                 global_batch_size=8)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

        x0, y = torch.arange(24, dtype=torch.float64).reshape(8, 3) / 24, torch.ones(8).double()
        scales = []
        for bad in (False, True, False):
            x = x0.clone()
            if bad:
                x[7, 1] = math.inf  # global replica 3's rows are 6 and 7
            mine = slice(4 * worker, 4 * worker + 4)
            xs, ys = x[mine], y[mine]
            strategy.run(step, args=(mirrored.PerReplica([xs[:2], xs[2:]]),
                                     mirrored.PerReplica([ys[:2], ys[2:]])))
            scales.append(scaler.get_scale())
        error = ""
        if check_divergence:
            if worker == 1:
                with torch.no_grad():
                    model.replicas[1][0].bias.add_(1.0)
            try:
                strategy.run(step, args=(mirrored.PerReplica([xs[:2], xs[2:]]),
                                         mirrored.PerReplica([ys[:2], ys[2:]])))
            except ReplicaDivergenceError as e:
                error = str(e)
        state = {k: v.tolist() for k, v in model.replicas[0].state_dict().items()}
        return {"scales": scales, "state": state, "error": error}
    finally:
        strategy.close()


@pytest.mark.timeout(150)
def test_grad_scaler_and_check_across_two_workers() -> None:
    results = mirrored.testing.run_multi_process(_scaled_worker, 2, args=(True,), timeout=140)
    reference = net()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    x0, y = torch.arange(24, dtype=torch.float64).reshape(8, 3) / 24, torch.ones(8).double()
    for bad in (False, True, False):
        x = x0.clone()
        if bad:
            x[7, 1] = math.inf
        opt.zero_grad()
        scaler.scale(((reference(x).squeeze(1) - y) ** 2).mean()).backward()
        scaler.step(opt)
        scaler.update()
    for result in results:
        assert result["scales"] == [1024.0, 512.0, 512.0]
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(torch.tensor(result["state"][key], dtype=value.dtype),  # type: ignore[index]
                                       value,
                                       rtol=1e-12, atol=1e-12)
        assert re.search(r"'0.bias' on replica\(s\) \[3\] differs from replica 0",
                         str(result["error"])), result["error"]


@pytest.mark.filterwarnings("ignore::mirrored.LossScalingWarning")  # divided by hand
def test_accumulated_gradients_with_zero_grad_set_to_zero_pass_the_checks(
        two: mirrored.MirroredStrategy) -> None:
    reference = net()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                               check="full")

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=False)
        for half in (slice(0, 1), slice(1, None)):  # two micro-batches, one step
            loss = ((model(x[half]).squeeze(1) - y[half]) ** 2).sum() / 6
            loss.backward()
        opt.step()

    x, y = data()
    for _ in range(3):
        two.run(step, args=(split(x), split(y)))
        ref_opt.zero_grad()
        ((reference(x).squeeze(1) - y) ** 2).mean().backward()
        ref_opt.step()
    assert_copies_equal(model)
    for a, b in zip(model.replicas[0].parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_grad_scaler_update_outside_run_and_plain_use_stay_torch(
        two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)

    x, y = data()
    x[0, 0] = math.inf  # replica 0's batch
    two.run(step, args=(split(x), split(y)))
    scaler.update()  # once, outside run: one back-off for the step of both replicas
    assert scaler.get_scale() == 4.0
    # The same scaler with a plain optimizer outside run is torch's own.
    plain = net()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    scaler.scale(plain(torch.ones(1, 3, dtype=torch.float64)).sum()).backward()
    scaler.step(plain_opt)
    scaler.update()
    assert scaler.get_scale() == 4.0
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        scaler.update()


# ----------------------------------------------- a plain optimizer over the copies


def _plain_step(model: mirrored.MirroredModule, opt: object):
    def step(x: torch.Tensor, y: torch.Tensor, opt: torch.optim.Optimizer = opt) -> None:
        mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2).backward()
        opt.step()
    return step


@pytest.mark.parametrize("where", ["outside run", "per replica", "stepped outside run"])
def test_a_plain_optimizer_over_a_mirrored_model_is_refused_before_any_update(
        two: mirrored.MirroredStrategy, where: str) -> None:
    model = two.mirror(net())
    initial = [t.detach().clone() for t in model.replicas[0].parameters()]
    x, y = data()
    if where == "outside run":  # DDP's habit: the optimizer over model.parameters()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        call = lambda: two.run(_plain_step(model, opt), args=(split(x), split(y)))  # noqa: E731
        copy = 0
    elif where == "per replica":  # each replica's own copy, no all-reduce
        opts = two.run(lambda: torch.optim.Adam(model.parameters(), lr=0.1))
        call = lambda: two.run(  # noqa: E731
            lambda x, y, o: _plain_step(model, o)(x, y), args=(split(x), split(y), opts))
        copy = 0  # (run raises replica 0's error, over its own copy)
    else:  # backward in the run, the step after it
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        two.run(lambda x, y: mirrored.compute_average_loss(
            (model(x).squeeze(1) - y) ** 2).backward(), args=(split(x), split(y)))
        call, copy = opt.step, 0
    name = "Adam" if where == "per replica" else "SGD"
    with pytest.raises(RuntimeError, match=re.escape(
            f"torch.optim.{name}.step() would update the parameters of a model mirrored "
            f"over 2 replicas (copy {copy}'s '0.weight') with a plain optimizer")) as error:
        call()
    assert f"strategy.mirror_optimizer(model, lambda params: torch.optim.{name}(params" in (
        str(error.value))
    for replica in model.replicas:  # nothing was updated
        for got, want in zip(replica.parameters(), initial, strict=True):
            assert torch.equal(got, want)


def test_plain_optimizers_elsewhere_are_untouched(two: mirrored.MirroredStrategy) -> None:
    # A model mirrored over several replicas refuses plain optimizers over its copies
    # only: a reference copy, another model, one replica in all train as torch does.
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    one = mirrored.MirroredStrategy(["CPU:0"])
    solo = one.mirror(net())
    x, y = data()
    references = [net(), net()]
    plain_opts = [torch.optim.SGD(references[0].parameters(), lr=0.1),
                  torch.optim.SGD(solo.parameters(), lr=0.1)]

    def mirrored_step(x: torch.Tensor, y: torch.Tensor) -> None:
        mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2).backward()
        opt.step()
        opt.zero_grad()

    def solo_step() -> None:
        ((solo(x).squeeze(1) - y) ** 2).mean().backward()
        plain_opts[1].step()

    for _ in range(2):
        two.run(mirrored_step, args=(split(x), split(y)))
        ((references[0](x).squeeze(1) - y) ** 2).mean().backward()
        plain_opts[0].step()
        plain_opts[0].zero_grad()
        one.run(solo_step)
        plain_opts[1].zero_grad()
    reference_opt = torch.optim.SGD(references[1].parameters(), lr=0.1)
    for _ in range(2):
        ((references[1](x).squeeze(1) - y) ** 2).mean().backward()
        reference_opt.step()
        reference_opt.zero_grad()
    for trained in (model.replicas[0], model.replicas[1], references[0], solo):
        for got, want in zip(trained.parameters(), references[1].parameters(), strict=True):
            torch.testing.assert_close(got, want)
    one.close()


def test_the_guard_follows_the_mirrored_models_lifetime() -> None:
    # The user's module is copy 0: once its strategy is closed, or the module is
    # mirrored again over one replica, a plain optimizer over it trains as in torch;
    # an optimizer that stepped it before it was mirrored over two is refused after.
    x, y = data()
    module = net()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)

    def plain_step() -> None:
        ((module(x).squeeze(1) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()

    plain_step()  # cleared once, as a plain module
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    strategy.mirror(module)
    with pytest.raises(RuntimeError, match=r"torch.optim.SGD.step\(\) would update"):
        plain_step()
    strategy.close()
    plain_step()  # the strategy is closed: its copies are plain modules again
    again = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    again.mirror(module)
    one = mirrored.MirroredStrategy(["CPU:0"])
    one.mirror(module)  # mirrored over one replica: a plain optimizer is right
    plain_step()
    again.close()
    one.close()


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_dropped_mirrored_optimizer_takes_its_gradient_hooks_along(replicas: int) -> None:
    import gc

    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    model = strategy.mirror(net())
    first = model.replicas[0][0].weight

    def hooks() -> int:
        return len(getattr(first, "_post_accumulate_grad_hooks", None) or {})

    for _ in range(3):  # rebuilt three times: one optimizer's hooks at a time
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
        assert hooks() == 1
        del opt
        gc.collect()
        assert hooks() == 0
    strategy.close()


@pytest.mark.parametrize("scaled", [False, True])
def test_a_learning_rate_set_after_step_in_the_step_waits_for_the_next_step(
        two: mirrored.MirroredStrategy, scaled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each replica sets the next step's rate on its own optimizer after step(). Replica
    # 1 is slowed down right after the step's all-reduce, so replica 0 has already set
    # the next rate when replica 1 takes replica 0's hyper-parameters: it must still
    # take those replica 0's step() found (it took the next step's: a silent race).
    from mirrored._src.training.reducer import GradientReducer

    reduce = GradientReducer.reduce

    def slow_reduce(self: GradientReducer, ctx: mirrored.ReplicaContext, r: int) -> None:
        reduce(self, ctx, r)
        if r:
            time.sleep(0.05)

    monkeypatch.setattr(GradientReducer, "reduce", slow_reduce)
    x, y = data()
    rates = [0.1 * 0.5 ** i for i in range(4)]
    plain = net()
    opt = torch.optim.SGD(plain.parameters(), lr=rates[0], momentum=0.5)
    for i in range(3):
        opt.zero_grad()
        ((plain(x).squeeze(1) - y) ** 2).mean().backward()
        opt.step()
        for group in opt.param_groups:
            group["lr"] = rates[i + 1]
    model = two.mirror(net())
    mopt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=rates[0], momentum=0.5))
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0) if scaled else None

    def step(i: int, xs: torch.Tensor, ys: torch.Tensor) -> None:
        mopt.zero_grad()
        loss = mirrored.compute_average_loss((model(xs).squeeze(1) - ys) ** 2,
                                             global_batch_size=6)
        if scaler is None:
            loss.backward()
            mopt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(mopt)
        for group in mopt.param_groups:  # (the replica's own optimizer's, inside run)
            group["lr"] = rates[i + 1]

    for i in range(3):
        two.run(step, args=(i, split(x), split(y)))
        if scaler is not None:
            scaler.update()
    assert_copies_equal(model)
    for a, b in zip(model.replicas[0].parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_a_gan_step_drops_what_the_generator_loss_left_on_the_discriminator(
        two: mirrored.MirroredStrategy) -> None:
    # The generator's loss goes through the discriminator and fills its .grad; the next
    # iteration's optimizer_d.zero_grad() drops them, as on one device (refused, it
    # blamed a manual update). The manual update itself is still refused (above).
    def gen() -> nn.Module:
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6)).double()

    def disc() -> nn.Module:
        torch.manual_seed(2)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()

    bce = nn.BCEWithLogitsLoss(reduction="none")
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 4, generator=g).double(), torch.randn(8, 6, generator=g).double())
               for _ in range(3)]

    def iteration(G: nn.Module, D: nn.Module, oG: Any, oD: Any, z: torch.Tensor,
                  real: torch.Tensor, average: Any) -> None:
        fake = G(z)
        oD.zero_grad()
        (average(bce(D(real), torch.ones(len(real), 1, dtype=real.dtype)))
         + average(bce(D(fake.detach()), torch.zeros(len(z), 1, dtype=z.dtype)))).backward()
        oD.step()
        oG.zero_grad()
        average(bce(D(fake), torch.ones(len(z), 1, dtype=z.dtype))).backward()
        oG.step()

    G, D = gen(), disc()
    oG, oD = (torch.optim.Adam(m.parameters(), lr=0.01) for m in (G, D))
    for z, real in batches:
        iteration(G, D, oG, oD, z, real, lambda loss: loss.mean())
    mG, mD = two.mirror(gen()), two.mirror(disc())
    moG, moD = (two.mirror_optimizer(m, lambda p: torch.optim.Adam(p, lr=0.01)) for m in (mG, mD))
    for z, real in batches:
        two.run(iteration, args=(mG, mD, moG, moD, split(z), split(real),
                                 lambda loss: mirrored.compute_average_loss(loss,
                                                                            global_batch_size=8)))
    for mine, theirs in ((mG, G), (mD, D)):
        assert_copies_equal(mine)
        for a, b in zip(mine.replicas[0].parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(a, b)


def test_a_refused_zero_grad_is_said_once(two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    x, y = data()
    two.run(lambda xs, ys: mirrored.compute_average_loss(
        (model(xs).squeeze(1) - ys) ** 2).backward(), args=(split(x), split(y)))
    with pytest.raises(ReplicaDivergenceError, match=r"never all-reduced.*model\.zero_grad"):
        opt.zero_grad()
    opt.zero_grad()  # (it raised again and again: nothing cleared the records)
    assert all(p.grad is None for copy in model.replicas for p in copy.parameters())


@pytest.mark.parametrize("change", ["clear", "one_entry", "in_place", "read_only"])
def test_optimizer_state_changed_outside_run_reaches_every_replica(
        two: mirrored.MirroredStrategy, change: str) -> None:
    # Outside run, optimizer.state is replica 0's: a reset of Adam's moments there
    # reached replica 0 alone, and the copies drifted apart silently for up to 8 steps.
    x, y = data()

    def alter(opt: Any, params: list[torch.Tensor]) -> None:
        state = opt.state
        if change == "clear":
            state.clear()
        elif change == "one_entry":
            state[params[0]].clear()
        elif change == "in_place":
            state[params[2]]["exp_avg"].zero_()
        else:
            assert len(state) == len(params)

    plain = net()
    opt = torch.optim.Adam(plain.parameters(), lr=0.05)
    for i in range(5):
        if i == 3:
            alter(opt, list(plain.parameters()))
        opt.zero_grad()
        ((plain(x).squeeze(1) - y) ** 2).mean().backward()
        opt.step()
    model = two.mirror(net())
    mopt = two.mirror_optimizer(model, lambda p: torch.optim.Adam(p, lr=0.05))

    def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        mopt.zero_grad()
        assert len(mopt.state) in (0, 4)  # (inside run: the replica's own optimizer's)
        mirrored.compute_average_loss((model(xs).squeeze(1) - ys) ** 2,
                                      global_batch_size=6).backward()
        mopt.step()

    for i in range(5):
        if i == 3:
            alter(mopt, list(model.parameters()))
        two.run(step, args=(split(x), split(y)))
    assert_copies_equal(model)
    for a, b in zip(model.replicas[0].parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    states = [o.state_dict()["state"] for o in mopt.optimizers]
    for k in states[0]:
        for key, value in states[0][k].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(states[1][k][key]))


def test_a_manual_update_beside_another_optimizers_step_is_still_refused(
        two: mirrored.MirroredStrategy) -> None:
    # Two optimizers over two parts of one model; part b is updated by hand from its
    # own replica's gradient after part a's optimizer stepped. That step must not pass
    # for a GAN's (the parameters changed since backward): the copies drifted silently.
    model = two.mirror(net())
    oa = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p[:2], lr=0.1))
    ob = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p[2:], lr=0.1))
    x, y = data()

    def step(xs: torch.Tensor, ys: torch.Tensor) -> None:
        mirrored.compute_average_loss((model(xs).squeeze(1) - ys) ** 2).backward()
        oa.step()
        with torch.no_grad():
            for p in list(model.parameters())[2:]:
                p -= 0.1 * p.grad
        oa.zero_grad()
        ob.zero_grad()

    with pytest.raises(ReplicaDivergenceError, match=r"never all-reduced.*manual update"):
        two.run(step, args=(split(x), split(y)))


def test_a_learning_rate_set_between_unscale_and_step_raises(
        two: mirrored.MirroredStrategy) -> None:
    # With scaler.unscale_(opt) the step's all-reduce (and the hyper-parameters the other
    # replicas take) comes at unscale_: a rate set after it reached replica 0 alone, and
    # the copies diverged (silently with check="off").
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1), check="off")
    scaler = torch.amp.GradScaler("cpu")
    x, y = data()

    def step(xs: torch.Tensor, ys: torch.Tensor, late: bool) -> None:
        opt.zero_grad()
        if not late:
            for group in opt.param_groups:
                group["lr"] = 0.2
        loss = mirrored.compute_average_loss((model(xs).squeeze(1) - ys) ** 2)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        if late:
            for group in opt.param_groups:
                group["lr"] = 0.3
        scaler.step(opt)
        scaler.update()

    two.run(step, args=(split(x), split(y), False))  # set before unscale_: fine
    assert_copies_equal(model)
    assert [o.param_groups[0]["lr"] for o in opt.optimizers] == [0.2, 0.2]
    with pytest.raises(RuntimeError, match=r"'lr' .* between scaler\.unscale_.*Set it before"):
        two.run(step, args=(split(x), split(y), True))


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_gradients_clamped_through_data_before_step_are_refused(replicas: int) -> None:
    # The DQN tutorial's p.grad.data.clamp_(-1, 1): .data has a version counter of its
    # own, so the watch saw no change, and each replica clamped its local gradient
    # (0.29 off one device, silently). On one replica too: the same code on N.
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    model = strategy.mirror(net())
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            p.grad.data.clamp_(-1e-3, 1e-3)
        opt.step()

    x, y = data()
    parts = strategy.experimental_distribute_values_from_function(
        lambda c: (x.chunk(replicas)[c.replica_id_in_sync_group],
                   y.chunk(replicas)[c.replica_id_in_sync_group]))
    try:
        with pytest.raises(ReplicaDivergenceError, match=r"changed in place.*p\.grad\.data\."
                                                         r"clamp_.*step\(clip_grad_value=c\)"):
            strategy.run(lambda xy: step(*xy), args=(parts,))
    finally:
        strategy.close()


def _clipped_value_training(strategy: mirrored.Strategy | None, value: float,
                            norm: float | None = None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    module = net()
    x, y = data()
    if strategy is None:
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            ((module(x).squeeze(1) - y) ** 2).mean().backward()
            if norm is not None:
                nn.utils.clip_grad_norm_(module.parameters(), norm)
            nn.utils.clip_grad_value_(module.parameters(), value)
            opt.step()
        return [p.detach().clone() for p in module.parameters()]
    model = strategy.mirror(module)
    mopt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2)
        mopt.zero_grad()
        loss.backward()
        mopt.step(clip_grad_norm=norm, clip_grad_value=value)

    for _ in range(3):
        strategy.run(step, args=(split(x), split(y)))
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("norm", [None, 0.05])
def test_step_clips_the_reduced_gradients_by_value_as_one_device(
        two: mirrored.MirroredStrategy, norm: float | None) -> None:
    expected = _clipped_value_training(None, 1e-3, norm)
    got = _clipped_value_training(two, 1e-3, norm)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b)
    unclipped = _clipped_value_training(None, 1e6)
    assert not torch.allclose(unclipped[0], expected[0])  # (the clipping mattered)
    with pytest.raises(ValueError, match=r"clip_grad_value must be a positive finite number "
                                         r"or None; got 0"):
        _clipped_value_training(two, 0)


class Clamped(nn.Module):
    """Gradient hooks registered in the constructor, as some recipes clip."""

    def __init__(self, hook: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.linear = net()
        for p in self.linear.parameters():
            p.register_hook(hook)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)  # type: ignore[no-any-return]


def test_gradient_hooks_on_several_replicas_warn_at_mirror(two: mirrored.MirroredStrategy
                                                          ) -> None:
    # Each copy's hook runs on its replica's local gradient: a clamp there trained
    # another model than one device (0.29 off), with no word.
    with pytest.warns(mirrored.GradientHookWarning, match=r"parameter 'linear\.0\.weight' "
                                                          r"\(and 3 more\) has gradient hooks.*"
                                                          r"step\(clip_grad_value=c\)") as got:
        two.mirror(Clamped(lambda g: g.clamp(-1e-3, 1e-3)))
    assert got[0].filename == __file__  # (the user's line)
    one = mirrored.MirroredStrategy(["CPU:0"])
    try:
        one.mirror(Clamped(lambda g: g.clamp(-1e-3, 1e-3)))  # one replica: the whole batch's
    finally:
        one.close()


def test_ddp_no_sync_accumulation_runs_as_written(two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    reference = net()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = data()
    halves = [(x[:3], y[:3]), (x[3:], y[3:])]  # two micro-batches of one global batch

    def step(micro: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        opt.zero_grad()
        for i, (xb, yb) in enumerate(micro):
            with model.no_sync() if i == 0 else contextlib.nullcontext():
                loss = mirrored.compute_average_loss((model(xb).squeeze(1) - yb) ** 2,
                                                     global_batch_size=len(x))
                loss.backward()
        opt.step()

    per_replica = mirrored.PerReplica([[(xb[:2], yb[:2]) for xb, yb in halves],
                                       [(xb[2:], yb[2:]) for xb, yb in halves]])
    two.run(step, args=(per_replica,))
    ref_opt.zero_grad()
    ((reference(x).squeeze(1) - y) ** 2).mean().backward()
    ref_opt.step()
    for copy_ in model.replicas:
        for a, b in zip(copy_.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("check", ["cheap", "full"])
def test_replicas_on_two_kinds_of_device_compare_bit_sums(check: str) -> None:
    # A GPU's and the CPU's 2-norms of equal copies differ in the last bit (seen on an
    # H200: a false ReplicaDivergenceError at step 9), so where the job's replicas sit
    # on both kinds, the copies are compared by exact bit sums: equal copies pass, a
    # changed one is still named. (On the CPU, the topology is marked as mixed.)
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    object.__setattr__(strategy._parts.topology, "mixed_kinds", True)
    try:
        model = strategy.mirror(net())
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1),
                                        check=check)
        assert opt._reducer._exact
        drift = [False]

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            loss = mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if drift[0] and mirrored.get_replica_context().replica_id_in_sync_group == 1:
                with torch.no_grad():
                    model.module[2].bias.view(torch.int64)[0] ^= 1  # one bit, one copy

        x, y = data()
        for _ in range(9):
            strategy.run(step, args=(split(x), split(y)))
        drift[0] = True

        def until_checked() -> None:
            for _ in range(9):  # the drift of step 10 shows at the next checked step
                strategy.run(step, args=(split(x), split(y)))

        with pytest.raises(ReplicaDivergenceError,
                           match=r"'2.bias' on replica\(s\) \[1\] differs from replica 0 "
                                 r"\(bit-sum fingerprints"):
            until_checked()
    finally:
        strategy.close()
