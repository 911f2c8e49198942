"""`HostSum`: two host replicas of one process add each other's gradients on their own
threads. Bitwise the same training as the packed all-reduce it replaces (gradients,
BatchNorm statistics, buffers, missing gradients, the check), safe when a replica
changes its buffers while the other still reads them, and used only where it applies."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import pytest
import torch
from torch import nn

import mirrored
from mirrored._src.runtime.contract import CollectiveFailure
from mirrored._src.training import host_sum
from mirrored._src.training.host_sum import HOST_SUM_BYTES, HOST_SUM_REPLICAS, HostSum
from mirrored.experimental import CommunicationOptions

pytestmark = pytest.mark.timeout(120)


class Net(nn.Module):
    """BatchNorm statistics, a float buffer averaged across replicas, and a head used
    only at some steps (its gradients are missing at the others)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(),
                                  nn.Linear(16, 3))
        self.head = nn.Linear(3, 3)
        self.register_buffer("seen", torch.zeros(3))

    def forward(self, x: torch.Tensor, use_head: bool) -> torch.Tensor:
        out = self.body(x)
        self.seen += out.detach().abs().mean(0)
        return self.head(out) if use_head else out


def train(strategy: mirrored.MirroredStrategy, steps: int = 6, *, per_run: int = 1,
          check: str = "cheap", global_batch_size: int | None = None,
          after_step: Callable[[nn.Module], None] | None = None
          ) -> tuple[list[dict[str, torch.Tensor]], mirrored.MirroredOptimizer]:
    """``steps`` optimizer steps, ``per_run`` of them in each ``strategy.run`` (with a
    given ``global_batch_size``, no other collective between them)."""
    n = strategy.num_replicas_in_sync
    model = strategy.mirror(Net())
    opt = strategy.mirror_optimizer(
        model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), check=check)
    g = torch.Generator().manual_seed(1)
    data = [[torch.randn(4 + r, 6, generator=g) for r in range(n)] for _ in range(steps)]

    def step(first: int, *xs: torch.Tensor) -> None:
        for index, x in enumerate(xs, first):
            loss = model(x, use_head=index % 3 != 1).pow(2).sum(1)
            mirrored.compute_average_loss(loss, global_batch_size=global_batch_size).backward()
            opt.step()
            if after_step is not None:
                after_step(model.replicas[
                    mirrored.get_replica_context().replica_id_in_sync_group])
            opt.zero_grad()

    for first in range(0, steps, per_run):
        strategy.run(step, args=(first, *(mirrored.PerReplica(xs)
                                          for xs in data[first:first + per_run])))
    states = [{k: v.clone() for k, v in m.state_dict().items()} for m in model.replicas]
    return states, opt


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def packed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mirrored optimizers built from now on take the packed path."""
    monkeypatch.setattr(HostSum, "applies", staticmethod(lambda parts, params: False))


def strategy_of(replicas: int, concurrent: bool) -> mirrored.MirroredStrategy:
    # With a collective timeout every replica has a thread and none runs in a baton:
    # the replicas add at the same time.
    options = CommunicationOptions(timeout_seconds=60) if concurrent else None
    return mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)],
                                     communication_options=options)


@pytest.mark.parametrize("concurrent", [False, True])
@pytest.mark.parametrize(("replicas", "per_run", "check", "global_batch_size"), [
    (2, 1, "cheap", None), (2, 6, "full", 24), (3, 1, "cheap", None), (3, 6, "full", 36)])
def test_the_host_sum_trains_bitwise_as_the_packed_all_reduce(
        monkeypatch: pytest.MonkeyPatch, replicas: int, per_run: int, check: str,
        global_batch_size: int | None, concurrent: bool) -> None:
    # Several steps in one run, with nothing but the step's own meeting between them:
    # the replica that adds first goes on into the next step (in a baton run, until
    # its next collective) while the others still read what it handed over.
    strategy = strategy_of(replicas, concurrent)
    try:
        here, opt = train(strategy, per_run=per_run, check=check,
                          global_batch_size=global_batch_size)
        assert opt._reducer._host_sum is not None  # (the default takes the new path)
        packed(monkeypatch)
        reference, opt = train(strategy, per_run=per_run, check=check,
                               global_batch_size=global_batch_size)
        assert opt._reducer._host_sum is None
    finally:
        strategy.close()
    for replica in range(replicas):
        assert_bitwise(here[replica], reference[replica])
        assert_bitwise(here[0], here[replica])
    assert not torch.equal(here[0]["body.1.running_mean"], torch.zeros(16))


@pytest.mark.parametrize("concurrent", [False, True])
def test_a_replica_changing_its_buffers_right_after_its_sum_leaves_the_others_sums_alone(
        monkeypatch: pytest.MonkeyPatch, concurrent: bool) -> None:
    # Replica 1 adds late (held up right before its additions) while replica 0 has
    # already copied its averaged statistics into its BatchNorm buffers and changed
    # its other buffer in place: replica 1 must still add what replica 0 handed over.
    add = torch._foreach_add

    def late_add(*args: object, **kwargs: object) -> object:
        if mirrored.get_replica_context().replica_id_in_sync_group == 1:
            time.sleep(0.2)
        return add(*args, **kwargs)

    def after_step(module: nn.Module) -> None:
        module.seen.mul_(3.0)  # (the buffer sent at the next step; changed in place)

    strategy = strategy_of(2, concurrent)
    try:
        monkeypatch.setattr(host_sum.torch, "_foreach_add", late_add)
        start = time.monotonic()
        late, opt = train(strategy, after_step=after_step)
        assert time.monotonic() - start >= 6 * 0.2  # (held up at every step)
        assert opt._reducer._host_sum is not None
        monkeypatch.undo()
        packed(monkeypatch)
        reference, _ = train(strategy, after_step=after_step)
    finally:
        strategy.close()
    for replica in range(2):
        assert_bitwise(late[replica], reference[replica])


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_gradients_with_a_graph_take_the_differentiable_packed_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    call = HostSum.__call__
    monkeypatch.setattr(HostSum, "__call__", lambda self, *a: calls.append(1) or call(self, *a))
    strategy = strategy_of(2, False)
    try:
        model = strategy.mirror(nn.Linear(3, 1))
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

        def step(x: torch.Tensor, graph: bool) -> torch.Tensor:
            loss = mirrored.compute_average_loss(model(x).pow(2).sum(1), global_batch_size=4)
            loss.backward(create_graph=graph)
            opt.step()
            grad = model.weight.grad
            assert grad is not None
            kind = type(grad.grad_fn).__name__ if grad.grad_fn is not None else "none"
            opt.zero_grad()
            return torch.tensor(float(kind.startswith("_AllReduce")))

        x = mirrored.PerReplica([torch.ones(2, 3), torch.ones(2, 3)])
        plain = strategy.run(step, args=(x, False))
        assert calls and not any(v.item() for v in plain.values)
        calls.clear()
        graphs = strategy.run(step, args=(x, True))
        assert not calls and all(v.item() for v in graphs.values)
    finally:
        strategy.close()


def test_two_optimizers_met_by_different_replicas_are_a_mismatch() -> None:
    strategy = strategy_of(2, False)
    try:
        models = [strategy.mirror(nn.Linear(3, 3)) for _ in range(2)]
        opts = [strategy.mirror_optimizer(m, lambda p: torch.optim.SGD(p, lr=0.1))
                for m in models]

        def step() -> None:
            r = mirrored.get_replica_context().replica_id_in_sync_group
            loss = models[r](torch.ones(1, 3)).sum(1)  # (replica r: model r only)
            mirrored.compute_average_loss(loss, global_batch_size=2).backward()
            opts[r].step()

        assert all(o._reducer._host_sum is not None for o in opts)
        with pytest.raises(mirrored.CollectiveMismatchError) as raised:
            strategy.run(step)
        for number in (1, 2):
            label = f"MirroredOptimizer.step (the optimizer of mirrored model #{number})"
            assert label in str(raised.value)
    finally:
        strategy.close()


def test_replicas_handing_over_different_tensors_fail_on_every_replica() -> None:
    a = [torch.zeros(3), torch.zeros(2)]
    site = "the gradients of w, ... (mirrored optimizer #7)"
    with pytest.raises(CollectiveFailure) as raised:
        host_sum._hand_over(site, (), [a, [torch.zeros(3), torch.zeros(4)]])
    assert str(raised.value) == (
        "MirroredOptimizer.step at the gradients of w, ... (mirrored optimizer #7): replica 1 "
        "hands over float32[4] as gradient or buffer 1, where replica 0 has float32[2]; "
        "expected the same on every replica (the copies of the model must stay alike: was "
        "one copy changed alone, model.replicas[i]?)")
    with pytest.raises(CollectiveFailure, match=r"replica 1 hands over float64\[2\] as "
                                                r"gradient or buffer 1, where replica 0 has "
                                                r"float32\[2\]"):
        host_sum._hand_over(site, (), [a, [torch.zeros(3), torch.zeros(2, dtype=torch.float64)]])
    with pytest.raises(CollectiveFailure, match="replica 2 hands over 1 gradients and buffers, "
                                                "replica 0 2"):
        host_sum._hand_over(site, (), [a, a, a[:1]])
    with pytest.raises(CollectiveFailure, match=r"does not support dtype uint16 \(at the "
                                                r"gradients of w, .*, gradient or buffer 0\)"):
        host_sum._hand_over(site, (), [[torch.zeros(2, dtype=torch.uint16)]] * 2)
    names = ("the gradient of 'w'", "buffer 'h'")  # (a stateful RNN's hidden state)
    with pytest.raises(CollectiveFailure, match=r"replica 1 hands over float32\[4\] as buffer "
                                                r"'h', where replica 0 has float32\[2\]; .*"
                                                r"per-example state .* plain attribute"):
        host_sum._hand_over(site, names, [a, [torch.zeros(3), torch.zeros(4)]])
    with pytest.raises(CollectiveFailure, match=r"float32\[1\] as the gradient of 'w', .*"
                                                r"was one copy changed alone"):
        host_sum._hand_over(site, names, [a, [torch.zeros(1), torch.zeros(2)]])
    shared = host_sum._hand_over(site, (), [a, list(a)])
    assert len(shared) == 2 and shared[0] is shared[1] and shared[0][0] is a


@pytest.mark.parametrize("error", [ValueError, KeyboardInterrupt])
def test_a_replica_failing_before_its_step_releases_the_one_waiting_in_the_sum(
        error: type[BaseException]) -> None:
    # Replica 1 raises (or is interrupted) after backward, before opt.step; replica 0
    # waits in the sum's meeting: it is released, run raises replica 1's error, and the
    # strategy trains on afterwards.
    strategy = strategy_of(2, False)
    try:
        model = strategy.mirror(nn.Linear(3, 1))
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
        assert opt._reducer._host_sum is not None

        def step(fail: bool) -> None:
            r = mirrored.get_replica_context().replica_id_in_sync_group
            loss = mirrored.compute_average_loss(model(torch.ones(2, 3)).sum(1),
                                                 global_batch_size=4)
            loss.backward()
            if fail and r == 1:
                time.sleep(0.1)  # (replica 0 is in the meeting by then)
                raise error("replica 1 fails before its step")
            opt.step()
            opt.zero_grad()

        start = time.monotonic()
        with pytest.raises(error, match="replica 1 fails before its step"):
            strategy.run(step, args=(True,))
        assert time.monotonic() - start < 5.0
        strategy.run(step, args=(False,))  # (on the failed step's gradients, accumulated)
        assert torch.equal(model.replicas[0].weight, model.replicas[1].weight)
    finally:
        strategy.close()


@pytest.mark.parametrize(("dtype", "no_grad"), [(torch.bfloat16, False), (torch.float16, False),
                                                (torch.float32, True)])
def test_half_precision_and_a_step_under_no_grad_sum_bitwise_as_the_packed_path(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, no_grad: bool) -> None:
    def run_steps() -> tuple[list[torch.Tensor], mirrored.MirroredOptimizer]:
        strategy = strategy_of(2, False)
        try:
            torch.manual_seed(0)
            model = strategy.mirror(nn.Sequential(nn.Linear(6, 8), nn.Tanh(),
                                                  nn.Linear(8, 2)).to(dtype))
            opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
            g = torch.Generator().manual_seed(1)
            for _ in range(4):
                xs = mirrored.PerReplica([torch.randn(3, 6, generator=g).to(dtype)
                                          for _ in range(2)])

                def step(x: torch.Tensor) -> None:
                    mirrored.compute_average_loss(model(x).float().pow(2).sum(1)).backward()
                    with torch.no_grad() if no_grad else contextlib.nullcontext():
                        opt.step()
                    opt.zero_grad()

                strategy.run(step, args=(xs,))
            return [p.detach().clone() for r in model.replicas for p in r.parameters()], opt
        finally:
            strategy.close()

    here, opt = run_steps()
    assert opt._reducer._host_sum is not None
    assert here[0].dtype == dtype
    packed(monkeypatch)
    reference, opt = run_steps()
    assert opt._reducer._host_sum is None
    for a, b in zip(here, reference, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("replicas", "width", "options", "expected"), [
    (2, 2, {}, True),
    (2, 1024, {}, True),  # 4 MiB of parameters: 2 replicas always
    (1, 2, {}, False),
    (3, 2, {}, True),
    (8, 2, {}, True),
    (9, 2, {}, False),
    (3, 512, {}, False),  # 1 MiB + 2 KiB
    (2, 2, {"cross_device_ops": mirrored.ReductionToOneDevice(
        accumulation_fn=lambda parts: torch.stack(parts).sum(0))}, False),
    (2, 2, {"cross_device_ops": mirrored.ReductionToOneDevice(
        reduce_to_device="CPU:1")}, False),
])
def test_the_host_sum_applies_to_few_host_replicas_summing_as_the_default(
        replicas: int, width: int, options: dict[str, object], expected: bool) -> None:
    assert (HOST_SUM_REPLICAS, HOST_SUM_BYTES) == (8, 1 << 20)  # (the cases' limits)
    strategy = mirrored.MirroredStrategy(
        [f"CPU:{i}" for i in range(replicas)], **options)  # type: ignore[arg-type]
    try:
        model = strategy.mirror(nn.Linear(width, width))
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
        assert (opt._reducer._host_sum is not None) is expected
    finally:
        strategy.close()
