"""`HostSum`: two host replicas of one process add each other's gradients on their own
threads. Bitwise the same training as the packed all-reduce it replaces (gradients,
BatchNorm statistics, buffers, missing gradients, the check), safe when a replica
changes its buffers while the other still reads them, and used only where it applies."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from torch import nn

import mirrored
from mirrored._src.runtime.contract import CollectiveFailure
from mirrored._src.training import host_sum
from mirrored._src.training.host_sum import HOST_SUM_BYTES, HOST_SUM_REPLICAS, HostSum

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


def train(strategy: mirrored.MirroredStrategy, steps: int = 6,
          after_step: Callable[[nn.Module], None] | None = None
          ) -> tuple[list[dict[str, torch.Tensor]], mirrored.MirroredOptimizer]:
    model = strategy.mirror(Net())
    opt = strategy.mirror_optimizer(
        model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    data = [[torch.randn(4 + r, 6, generator=g) for r in range(2)] for _ in range(steps)]

    def step(index: int, x: torch.Tensor) -> None:
        loss = model(x, use_head=index % 3 != 1).pow(2).sum(1)
        mirrored.compute_average_loss(loss).backward()
        opt.step()
        if after_step is not None:
            after_step(model.replicas[mirrored.get_replica_context().replica_id_in_sync_group])
        opt.zero_grad()

    for index, xs in enumerate(data):
        strategy.run(step, args=(index, mirrored.PerReplica(xs)))
    states = [{k: v.clone() for k, v in m.state_dict().items()} for m in model.replicas]
    return states, opt


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_the_host_sum_trains_bitwise_as_the_packed_all_reduce(
        monkeypatch: pytest.MonkeyPatch) -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        here, opt = train(strategy)
        assert opt._reducer._host_sum is not None  # (the default takes the new path)
        monkeypatch.setattr(HostSum, "applies", staticmethod(lambda parts, nbytes: False))
        packed, opt = train(strategy)
        assert opt._reducer._host_sum is None
    finally:
        strategy.close()
    for replica in range(2):
        assert_bitwise(here[replica], packed[replica])
    assert_bitwise(here[0], here[1])
    assert not torch.equal(here[0]["body.1.running_mean"], torch.zeros(16))


def test_a_replica_changing_its_buffers_right_after_its_sum_leaves_the_others_sums_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Replica 1 reads the others' tensors late (held up right before its additions),
    # while replica 0 has already copied its averaged statistics into its BatchNorm
    # buffers and changed its other buffer in place: replica 1 must still add what
    # replica 0 handed over.
    add = torch._foreach_add
    held = threading.Event()

    def late_add(*args: object) -> object:
        if mirrored.get_replica_context().replica_id_in_sync_group == 1:
            held.wait(0.2)  # (replica 0 is done with its step by then)
        return add(*args)

    def after_step(module: nn.Module) -> None:
        module.seen.mul_(3.0)  # (the buffer sent at the next step; changed in place)

    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        expected, _ = train(strategy, after_step=after_step)
        monkeypatch.setattr(host_sum.torch, "_foreach_add", late_add)
        start = time.monotonic()
        late, opt = train(strategy, after_step=after_step)
        assert time.monotonic() - start >= 6 * 0.2  # (held up at every step)
        assert opt._reducer._host_sum is not None
    finally:
        strategy.close()
    assert_bitwise(late[0], late[1])
    for replica in range(2):
        assert_bitwise(late[replica], expected[replica])


def test_replicas_handing_over_different_tensors_fail_on_every_replica() -> None:
    a = [torch.zeros(3), torch.zeros(2)]
    with pytest.raises(CollectiveFailure, match="replica 1's gradients and buffers differ"):
        host_sum._hand_over([a, [torch.zeros(3), torch.zeros(4)]])
    with pytest.raises(CollectiveFailure, match="replica 1's gradients and buffers differ"):
        host_sum._hand_over([a, [torch.zeros(3), torch.zeros(2, dtype=torch.float64)]])
    with pytest.raises(CollectiveFailure, match="in number, shape or dtype"):
        host_sum._hand_over([a, a[:1]])
    shared = host_sum._hand_over([a, list(a)])
    assert len(shared) == 2 and shared[0] is shared[1] and shared[0][0] is a


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
