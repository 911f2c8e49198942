"""CUDA replicas, on a machine with one GPU or more (skipped without CUDA): one GPU
replica trains as plain torch on that GPU (dropout included: CUDA replicas draw from
the device's own generator), a GPU and a CPU replica train as one device (sync
BatchNorm, averaged buffers, a partial batch), collectives return each replica's
result on its own device, and two workers on the same GPU train through Gloo as one
process. Each against a reference computed in the same test."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(120)]


class Counted(nn.Module):
    """A module with a large buffer (over the 64 KiB the CPU path defers) that changes
    every training step and a small one that never does."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3)
        self.norm = nn.BatchNorm1d(4)
        self.head = nn.Linear(4 * 6, 3)
        self.register_buffer("seen", torch.zeros(20_000, dtype=torch.float64))
        self.register_buffer("fixed", torch.arange(5.0, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen.add_(x.detach().abs().mean())
        return self.head(self.norm(self.conv(x)).relu().flatten(1))


def _reference_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
                    y: torch.Tensor) -> None:
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def test_one_gpu_replica_trains_as_plain_torch_with_dropout() -> None:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.3), nn.ReLU(), nn.Linear(32, 4))

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(b, 16, generator=g), torch.randint(0, 4, (b,), generator=g))
               for b in (8, 8, 8, 5)]  # a partial last batch
    reference = make().cuda()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    torch.cuda.manual_seed(7)
    for x, y in batches:
        _reference_step(reference, ref_opt, x.cuda(), y.cuda())

    strategy = mirrored.MirroredStrategy(["GPU:0"])
    try:
        model = strategy.mirror(make())
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            per_example = F.cross_entropy(model(x), y, reduction="none")
            opt.zero_grad()
            mirrored.compute_average_loss(per_example).backward()
            opt.step()
            return per_example.detach()

        torch.cuda.manual_seed(7)
        losses = [strategy.reduce("MEAN", strategy.run(step, args=(x, y)), axis=0)
                  for x, y in strategy.experimental_distribute_dataset(batches)]
    finally:
        strategy.close()
    assert all(loss.device.type == "cpu" for loss in losses)  # reduce: the caller's device
    for name, want in reference.state_dict().items():
        got = model.module.state_dict()[name]
        assert got.device.type == "cuda", name
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize(("devices", "check"), [(["GPU:0", "CPU:0"], "cheap"),
                                                (["CPU:0", "GPU:0"], "full")])
def test_gpu_and_cpu_replicas_train_as_one_device(devices: list[str], check: str) -> None:
    # The check compares bit sums there: norms of equal copies differed in the last bit.
    g = torch.Generator().manual_seed(1)
    rows = [8] * 11 + [5]  # a partial last batch: chunks of 3 and 2 rows
    batches = [(torch.randn(b, 2, 8, generator=g, dtype=torch.float64),
                torch.randint(0, 3, (b,), generator=g)) for b in rows]
    torch.manual_seed(0)
    reference = Counted().double()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        _reference_step(reference, ref_opt, x, y)

    strategy = mirrored.MirroredStrategy(devices)
    try:
        torch.manual_seed(0)
        model = strategy.mirror(Counted().double(), sync_batch_norm=True)
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                        check=check)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
            opt.step()

        for x, y in strategy.experimental_distribute_dataset(batches):
            strategy.run(step, args=(x, y))
    finally:
        strategy.close()
    want = reference.state_dict()
    for (name, a), b in zip(model.replicas[0].named_parameters(),
                            model.replicas[1].parameters(), strict=True):
        assert torch.equal(a.cpu(), b.cpu()), name  # the copies are one model, bit for bit
    for copy_, device in zip(model.replicas, devices, strict=True):
        got = copy_.state_dict()
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert got[name].device.type == ("cuda" if device.startswith("GPU") else "cpu")
            # "seen" averages |x|.mean() of the replicas' chunks, not of the batch:
            # the buffer rule is a mean of the replicas' values (weighted by rows)
            if name != "seen":
                torch.testing.assert_close(got[name].cpu(), value, rtol=1e-10, atol=1e-10,
                                           msg=name)
    # each step adds the mean over the replicas of their chunk's |x|.mean()
    # (chunks of ceil(b / 2) rows: 4 and 4, then 3 and 2)
    want_seen = sum(torch.stack([c.abs().mean() for c in x.split((len(x) + 1) // 2)]).mean()
                    for x, _ in batches)
    for copy_ in model.replicas:
        torch.testing.assert_close(copy_.seen.cpu(), torch.full((20_000,), float(want_seen),
                                   dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_collectives_on_a_gpu_and_a_cpu_replica() -> None:
    strategy = mirrored.MirroredStrategy(["GPU:0", "CPU:0"])
    try:
        def fn() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            ctx = mirrored.get_replica_context()
            r = ctx.replica_id_in_sync_group
            device = torch.device("cuda", 0) if r == 0 else torch.device("cpu")
            t = torch.arange(4.0, device=device) + 10 * r
            rows = torch.full((r + 1, 2), float(r), device=device)  # 1 and 2 rows
            return (ctx.all_reduce("SUM", t), ctx.all_reduce("MEAN", t),
                    ctx.all_gather(rows, axis=0))

        summed, mean, gathered = strategy.run(fn)
        rows = strategy.experimental_distribute_values_from_function(
            lambda c: torch.arange(3.0 * (2 - c.replica_id_in_sync_group)))  # 6 and 3 rows
        partial_mean = strategy.reduce("MEAN", rows, axis=0)
    finally:
        strategy.close()
    want_sum = torch.arange(4.0) * 2 + 10
    for values, device in ((summed, "cuda"), (mean, "cuda"), (gathered, "cuda")):
        assert strategy.experimental_local_results(values)[0].device.type == device
        assert strategy.experimental_local_results(values)[1].device.type == "cpu"
    for local in strategy.experimental_local_results(summed):
        assert torch.equal(local.cpu(), want_sum)
    for local in strategy.experimental_local_results(mean):
        assert torch.equal(local.cpu(), want_sum / 2)
    want_rows = torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
    for local in strategy.experimental_local_results(gathered):
        assert torch.equal(local.cpu(), want_rows)
    want_mean = torch.cat([torch.arange(6.0), torch.arange(3.0)]).mean()
    torch.testing.assert_close(partial_mean.cpu(), want_mean)


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3),
                         nn.ReLU(), nn.Flatten(), nn.Linear(3 * 8 * 8, 10)).double()


def _global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    size = 5 if step == 3 else 8
    return (torch.randn(size, 1, 8, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 10, (size,), generator=g))


def _gpu_worker() -> dict[str, list]:
    from mirrored.experimental import CommunicationImplementation, CommunicationOptions
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(
            implementation=CommunicationImplementation.RING, timeout_seconds=60),
        devices=["GPU:0"])
    try:
        model = strategy.mirror(_cnn(), sync_batch_norm=True)
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            loss = F.cross_entropy(model(x), y, reduction="none")
            mirrored.compute_average_loss(loss).backward()
            opt.step()
            opt.zero_grad()

        for x, y in strategy.experimental_distribute_dataset(_global_batch(s) for s in range(4)):
            strategy.run(step, args=(x, y))
        return {k: v.cpu().tolist() for k, v in model.state_dict().items()}
    finally:
        strategy.close()


@pytest.mark.multiprocess
def test_two_workers_on_one_gpu_train_through_gloo_as_one_process() -> None:
    results = mirrored.testing.run_multi_process(_gpu_worker, 2, timeout=110)
    reference = _cnn()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for s in range(4):
        x, y = _global_batch(s)
        F.cross_entropy(reference(x), y).backward()
        opt.step()
        opt.zero_grad()
    for state in results:
        assert state.keys() == reference.state_dict().keys()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(torch.tensor(state[name], dtype=value.dtype), value,
                                       rtol=0, atol=1e-9, msg=name)
    assert results[0] == results[1]


def test_a_gpu_replica_is_the_current_cuda_device_and_factories_follow_torch() -> None:
    seen: dict[int, tuple[str, str, str]] = {}

    def fn() -> None:
        seen[mirrored.get_replica_context().replica_id_in_sync_group] = (
            torch.zeros(1).device.type, torch.zeros(1, device="cuda").device.type,
            torch.get_default_device().type)

    strategy = mirrored.MirroredStrategy(["GPU:0", "CPU:0"])
    one = mirrored.MirroredStrategy(["GPU:0"])
    try:
        strategy.run(fn)
        assert seen == {0: ("cpu", "cuda", "cpu"), 1: ("cpu", "cuda", "cpu")}
        with torch.device("cuda"):  # the caller set a default device: the replica's replaces it
            strategy.run(fn)
        assert seen == {0: ("cuda", "cuda", "cuda"), 1: ("cpu", "cuda", "cpu")}
        seen.clear()
        one.run(fn)
        assert seen == {0: ("cpu", "cuda", "cpu")}
        with torch.device("cuda"):
            one.run(fn)
        assert seen == {0: ("cuda", "cuda", "cuda")}
    finally:
        strategy.close()
        one.close()


def test_cpu_draws_of_a_gpu_and_a_cpu_replica_are_reproducible_and_differ() -> None:
    strategy = mirrored.MirroredStrategy(["GPU:0", "CPU:0"])
    try:
        def fn() -> tuple[torch.Tensor, torch.Tensor]:
            device = "cuda" if mirrored.get_replica_context().replica_id_in_sync_group == 0 \
                else "cpu"
            return torch.rand(4), torch.rand(4, device=device).cpu()

        torch.manual_seed(5)
        torch.cuda.manual_seed(5)
        first = strategy.experimental_local_results(strategy.run(fn))
        torch.manual_seed(5)
        torch.cuda.manual_seed(5)
        again = strategy.experimental_local_results(strategy.run(fn))
    finally:
        strategy.close()
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(first[0][0], first[1][0])  # each replica its own CPU stream
