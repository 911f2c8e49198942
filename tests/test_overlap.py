"""Gradients all-reduced while backward runs (`GradientBuckets`): bitwise the same
parameters as without overlap, in one process and across workers, with unused
parameters, gradient accumulation, an eval forward, BatchNorm statistics, buffers,
GradScaler and the clip trap; and the same as one device in float64."""

from __future__ import annotations

import gc
import pathlib
import time
import weakref
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import mirrored
from mirrored import ReplicaDivergenceError
from mirrored._src.training import overlap as overlap_module
from mirrored._src.training.overlap import bucket_plan, hidden_time
from mirrored.experimental import CommunicationOptions

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def small_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(overlap_module, "DEFAULT_BUCKET_BYTES", 256)  # several buckets


@pytest.fixture
def two() -> Iterator[mirrored.MirroredStrategy]:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    yield strategy
    strategy.close()


class Net(nn.Module):
    """A small model with BatchNorm, a counter buffer and a head used only on demand."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(),
                                  nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)
        self.extra = nn.Linear(3, 3).to(dtype)
        self.register_buffer("calls", torch.zeros((), dtype=dtype))

    def forward(self, x: torch.Tensor, use_extra: bool = True) -> torch.Tensor:
        self.calls += 1
        out = self.body(x)
        return self.extra(out) if use_extra else out


def batches(steps: int, parts: int, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(4, 6, generator=g).to(dtype) for _ in range(parts)]
            for _ in range(steps)]


def train(strategy: mirrored.Strategy, overlap: bool, *, dtype: torch.dtype = torch.float32,
          steps: int = 5, accumulate: tuple[int, ...] = (1,) * 5, unused_at: int = -1,
          scaler: bool = False, frozen: bool = False
          ) -> tuple[list[torch.Tensor], mirrored.MirroredOptimizer]:
    """Trains on ``steps`` global batches; each replica gets 4 rows per backward,
    ``accumulate[step]`` backward passes per step; ``frozen``: the first Linear frozen
    (through the mirrored model, as torch freezes a part) and kept in the optimizer."""
    n = strategy.num_replicas_in_sync
    model = strategy.mirror(Net(dtype))
    if frozen:
        for p in model.body[0].parameters():  # (in the last bucket, sent at the step)
            p.requires_grad = False
    opt = strategy.mirror_optimizer(
        model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), overlap=overlap)
    amp = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if scaler else None

    def step(index: int, *xs: torch.Tensor) -> None:
        with torch.no_grad():
            model(xs[0])  # an eval-like forward: no hooks fire
        for x in xs:
            loss = mirrored.compute_average_loss(model(x, index != unused_at).pow(2).sum(1),
                                                 global_batch_size=4 * n * len(xs))
            (amp.scale(loss) if amp is not None else loss).backward()
        if amp is not None:
            amp.step(opt)
            amp.update()
        else:
            opt.step()
        opt.zero_grad()

    data = batches(steps, n * 2, dtype)
    local = strategy.extended._parts.topology  # which rows are ours
    first = local.worker_index * local.num_local_replicas
    for index, rows in enumerate(data):
        args = [mirrored.PerReplica([rows[(first + r) * 2 + a]
                                     for r in range(local.num_local_replicas)])
                if local.num_local_replicas > 1 else rows[first * 2 + a]
                for a in range(accumulate[index])]
        strategy.run(step, args=(index, *args))
    if frozen:  # frozen on every copy (of every worker): untouched
        initial = Net(dtype).body[0].weight
        assert all(torch.equal(c.body[0].weight, initial) for c in model.replicas)
    return [t.detach().clone() for t in model.replicas[0].state_dict().values()], opt


def one_device(steps: int = 5, replicas: int = 2) -> list[torch.Tensor]:
    model = Net(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for rows in batches(steps, replicas * 2, torch.float64):
        for x in rows[::2]:  # BatchNorm sees each replica's rows, as each replica does
            model(x, True).pow(2).sum(1).sum().div(4 * replicas).backward()
        opt.step()
        opt.zero_grad()
    return list(model.state_dict().values())


def assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


# Accumulation: steps 3 and 4 take two backward passes: step 3's launched buckets go
# stale (redone at the step), step 4 launches at step(), step 5 launches in backward.
ACCUMULATE = {"accumulate": (1, 1, 2, 2, 1)}
CASES = [{}, ACCUMULATE, {"accumulate": (2,) * 5}, {"unused_at": 2}, {"scaler": True},
         {"frozen": True}]


@pytest.mark.parametrize("case", CASES)
def test_overlap_is_bitwise_the_same_in_process(two: mirrored.MirroredStrategy,
                                                case: dict[str, object]) -> None:
    off, _ = train(two, False, **case)
    on, opt = train(two, True, **case)
    assert_bitwise(off, on)
    buckets = opt._reducer.buckets
    assert buckets is not None and len(buckets.plan) > 2
    assert buckets.stats["steps"] == 5
    # Accumulation at the last step: the next launches at step() (decided alike).
    assert buckets.armed is (case != {"accumulate": (2,) * 5})
    assert buckets.stats["redone"] == (1 if case == ACCUMULATE else 0)


def test_overlap_equals_one_device_in_float64(two: mirrored.MirroredStrategy) -> None:
    on, _ = train(two, True, dtype=torch.float64)
    reference = one_device()
    # BatchNorm's running statistics are averaged over replicas (one device's see
    # every row in one batch-of-4 at a time, twice): compare parameters only.
    names = list(Net(torch.float64).state_dict())
    for name, x, y in zip(names, on, reference, strict=True):
        if "running" not in name and "calls" not in name and "num_batches" not in name:
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12, msg=name)


def test_clipping_before_step_still_raises_with_overlap(two: mirrored.MirroredStrategy
                                                        ) -> None:
    model = two.mirror(Net(torch.float32))
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1), overlap=True)

    def step(x: torch.Tensor) -> None:
        mirrored.compute_average_loss(model(x).pow(2).sum(1)).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        opt.step()

    x = torch.randn(8, 6)
    with pytest.raises(ReplicaDivergenceError, match="changed in place"):
        two.run(step, args=(mirrored.PerReplica([x[:4], x[4:]]),))


def test_a_dropped_optimizer_launches_nothing(two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(Net(torch.float32))
    first = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1), overlap=True)
    ref = weakref.ref(first._reducer.buckets)
    del first
    gc.collect()
    assert ref() is None  # its hooks are gone with it
    second = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1), overlap=False)

    def step(x: torch.Tensor) -> None:
        mirrored.compute_average_loss(model(x).pow(2).sum(1)).backward()
        second.step()

    x = torch.randn(8, 6)
    two.run(step, args=(mirrored.PerReplica([x[:4], x[4:]]),))
    for a, b in zip(model.replicas[0].parameters(), model.replicas[1].parameters(),
                    strict=True):
        assert torch.equal(a, b)


def test_overlap_is_checked() -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="overlap must be True, False or None"):
        strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1),
                                  overlap="yes")  # type: ignore[arg-type]
    auto = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    assert auto._reducer.buckets is None  # in-process: off by default
    strategy.close()


def test_bucket_plan_and_hidden_time() -> None:
    ps = [nn.Parameter(torch.zeros(n)) for n in (4, 4, 8, 2)] + [
        nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    assert bucket_plan(ps, 40) == [[4], [3, 2], [1, 0]]
    assert bucket_plan(ps, 0) == [[4], [3], [2], [1], [0]]
    assert hidden_time([(0.0, 1.0), (0.5, 2.0)], backward_end=1.5) == (2.0, 1.5)
    assert hidden_time([], backward_end=1.0) == (0.0, 0.0)


def _worker_train(local: int) -> list[list[torch.Tensor]]:
    overlap_module.DEFAULT_BUCKET_BYTES = 256
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=60),
        devices=[f"CPU:{i}" for i in range(local)])
    try:
        out = []
        for case in ({}, ACCUMULATE, {"unused_at": 2}, {"frozen": True}):
            for overlap in (False, True):
                params, opt = train(strategy, overlap, **case)  # type: ignore[arg-type]
                buckets = opt._reducer.buckets
                assert (buckets is not None) is overlap
                if buckets is not None:
                    assert buckets.armed and len(buckets.plan) > 2
                    assert type(buckets._sum).__name__ == "DistributedCommunicator"
                    # Steps 2-5 launch all buckets but the last in backward; with
                    # ACCUMULATE, steps 2 and 3 (then stale), not 4 and 5 (launched at
                    # the step after a step with two backward passes).
                    early = (len(buckets.plan) - 1) * (2 if case is ACCUMULATE else 4)
                    assert buckets.stats["early"] == early, buckets.stats
                out.append(params)
        return out
    finally:
        strategy.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("local", [1, 2])
def test_overlap_is_bitwise_the_same_across_workers(local: int) -> None:
    results = mirrored.testing.run_multi_process(_worker_train, 2, args=(local,), timeout=200)
    for worker in results:
        for k in (0, 2, 4):
            assert_bitwise(worker[k], worker[k + 1])
    assert_bitwise(results[0][1], results[1][1])


def _mismatched_steps(strategy: mirrored.MultiWorkerMirroredStrategy) -> str:
    worker = strategy.cluster_resolver.worker_index
    model = strategy.mirror(Net(torch.float32))
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1), overlap=True)
    assert opt._reducer.buckets is not None
    assert type(opt._reducer.buckets._sum).__name__ == "DistributedCommunicator"

    def step(extra: bool) -> None:
        if extra:  # worker 1 only: a collective worker 0 does not make
            mirrored.get_replica_context().all_reduce("SUM", torch.ones(3))
        loss = model(torch.ones(4, 6)).sum(1)  # (no count all-reduce: the batch is given)
        mirrored.compute_average_loss(loss, global_batch_size=8).backward()
        opt.step()
        opt.zero_grad()

    try:
        for index in range(4):
            strategy.run(step, args=(worker == 1 and index == 3,))
        return "no error"
    except Exception as error:
        return f"{type(error).__name__}: {error}"


def _worker_mismatch() -> tuple[str, float]:
    overlap_module.DEFAULT_BUCKET_BYTES = 256
    strategy = mirrored.MultiWorkerMirroredStrategy(
        # (worker 0 leaves after its 5 s wait for worker 1's call; the process group's
        # timeout is this + the failure timeout + 5 s: 21 s)
        communication_options=CommunicationOptions(timeout_seconds=12), devices=["CPU:0"],
        failure_timeout_seconds=4.0)  # worker 1 names worker 0 gone in 4 s, not 10
    outcome = _mismatched_steps(strategy)
    start = time.monotonic()  # (worker 0 keeps its store up for worker 1 up to 5.2 s)
    strategy.close()
    del strategy  # the last reference to the process group
    gc.collect()
    return outcome, time.monotonic() - start


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_call_that_meets_a_launched_bucket_is_a_mismatch_and_its_data_unused() -> None:
    results, freed = zip(*mirrored.testing.run_multi_process(_worker_mismatch, 2, timeout=150),
                         strict=True)
    assert results[0].startswith("CollectiveMismatchError"), results[0]
    assert "gradient bucket 1 of" in results[0] and "(asynchronous)" in results[0]
    # Worker 1 sits in collective #13 as another call: the heartbeats' identities show
    # it to both (a mismatch listing both calls), or, had worker 0 left first, worker
    # 1 names it as gone inside #13 (its first unfinished one): never at the timeout.
    # (mirror and mirror_optimizer each agree once first: `training.agreement`.)
    assert results[1].startswith((
        "CollectiveMismatchError: workers made different calls as collective #13",
        "WorkerFailureError: worker 0 left the job (worker 0 inside collective #13) while "
        "worker 1 was in ")), results[1]
    # The failed job's process group is kept: freeing the strategy does not wait out the
    # bucket worker 1 never joined (the group's timeout, 21 s; freed, it waited 23 s).
    assert max(freed) < 10.0, freed


def _small_buckets_strategy() -> mirrored.MultiWorkerMirroredStrategy:
    """Two workers' strategy for these tests: buckets of 256 bytes, a 12 s call
    timeout, a peer gone named within 4 s."""
    overlap_module.DEFAULT_BUCKET_BYTES = 256
    return mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=12), devices=["CPU:0"],
        failure_timeout_seconds=4.0)


def _worker_skip(skipper: int, dtype: torch.dtype, at: int = 3
                 ) -> tuple[str, list[torch.Tensor]]:
    strategy = _small_buckets_strategy()
    worker = strategy.cluster_resolver.worker_index
    model = strategy.mirror(Net(torch.float32))
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1), overlap=True)

    def step(skip: bool) -> None:
        if not skip:  # every step, but worker `skipper` skips it once
            mirrored.get_replica_context().all_reduce("SUM", torch.ones(3, dtype=dtype))
        loss = model(torch.ones(4, 6)).sum(1)
        mirrored.compute_average_loss(loss, global_batch_size=8).backward()
        opt.step()
        opt.zero_grad()

    outcome = "no error"
    try:
        for index in range(6):
            strategy.run(step, args=(worker == skipper and index == at,))
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    params = [p.detach().clone() for p in model.parameters()]
    strategy.close()
    return outcome, params


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("skipper", "dtype", "at"), [
    (0, torch.float32, 3), (1, torch.float32, 3), (1, torch.bfloat16, 3), (1, torch.float32, 1)])
def test_a_worker_that_skips_the_predicted_call_for_a_bucket_is_a_mismatch(
        skipper: int, dtype: torch.dtype, at: int) -> None:
    # Every worker predicted the all-reduce; worker `skipper` launched its first bucket
    # there instead. Sent as it was, the bucket met the peer's all-reduce in one
    # collective of other sizes: Gloo ended the peer's process ("Received data size
    # doesn't match expected size"). It now meets it with the predicted sizes and a
    # miss (bfloat16: in the header), and both settle in a header round. At step 1 no
    # prediction is agreed yet: the bucket goes out at once while the peer's call
    # starts with its header, two collectives that never meet, which the workers'
    # heartbeats (the identities of their latest calls) show within a beat or two,
    # not at the 12 s timeout.
    results = mirrored.testing.run_multi_process(_worker_skip, 2, args=(skipper, dtype, at),
                                                 timeout=100)
    for outcome, _ in results:
        assert outcome.startswith("CollectiveMismatchError: workers made different calls"), \
            outcome
        assert f"worker {skipper}: MirroredOptimizer.step: SUM of gradient bucket 1 of" \
            in outcome, outcome
        assert f"worker {1 - skipper}: ReplicaContext.all_reduce(SUM of " \
            f"{str(dtype).removeprefix('torch.')}[3])" in outcome, outcome
    assert_bitwise(results[0][1], results[1][1])  # no step of it applied on either


def _worker_interrupted_with_a_bucket_in_flight(flag: str) -> tuple[str, float, int, int]:
    # Step 1: worker 1's step raises in forward; worker 0's raises after backward, which
    # launched gradient buckets worker 1 never joins. No collective failed (nothing is
    # noted): the close itself finds the bucket in flight. Worker 1 stays connected
    # (its group alive) until worker 0 has closed and freed its strategy.
    strategy = _small_buckets_strategy()
    worker = strategy.cluster_resolver.worker_index
    model = strategy.mirror(Net(torch.float32))
    held = {"model": model, "opt": strategy.mirror_optimizer(
        model, lambda p: torch.optim.SGD(p, lr=0.1), overlap=True)}
    del model

    def step(index: int) -> None:
        loss = held["model"](torch.ones(4, 6)).sum(1)
        if index == 1 and worker == 1:
            raise ValueError("worker 1's step fails in forward")
        mirrored.compute_average_loss(loss, global_batch_size=8).backward()
        if index == 1:
            raise ValueError("worker 0's step fails after backward")
        held["opt"].step()
        held["opt"].zero_grad()

    outcome = "no error"
    try:
        for index in range(2):
            strategy.run(step, args=(index,))
    except ValueError as error:
        outcome = str(error)
    ledger = strategy._parts.communicators.default._ledger  # type: ignore[attr-defined]
    started, completed = ledger.seq, ledger.completed
    done = pathlib.Path(flag)
    if worker == 1:
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    start = time.monotonic()
    strategy.close()
    del strategy
    held.clear()  # (the model and optimizer hold the process group too)
    gc.collect()
    seconds = time.monotonic() - start
    if worker == 0:
        done.write_text("closed")
    return outcome, seconds, started, completed


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_strategy_closed_with_a_bucket_its_peers_never_join_is_freed_at_once(
        tmp_path: pathlib.Path) -> None:
    # (a Ctrl-C in backward, caught, then close(): freeing the group waited for the
    # bucket up to the group's timeout, 21 s here, 135 s with the defaults)
    results = mirrored.testing.run_multi_process(
        _worker_interrupted_with_a_bucket_in_flight, 2, args=(str(tmp_path / "closed"),),
        timeout=100)
    (zero, zero_s, started, completed), (one, one_s, _, _) = results
    assert zero == "worker 0's step fails after backward", zero
    assert one == "worker 1's step fails in forward", one
    assert started > completed, results  # worker 0 closed with a bucket in flight
    assert zero_s < 10.0 and one_s < 10.0, results


def test_a_parameter_frozen_at_build_then_thawed_trains_as_one_device_with_accumulation(
        two: mirrored.MirroredStrategy) -> None:
    # Frozen when the optimizer is built, the head (a bucket of its own) has no gradient
    # hook: it waits for the step, so a gradient accumulated after a thaw is not sent
    # with the first backward's alone.
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 24)).double()

    model = two.mirror(make())
    model[2].requires_grad_(False)
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                               overlap=True)
    buckets = opt._reducer.buckets
    assert buckets is not None and buckets.plan[0] == [3, 2]  # the head alone
    model[2].requires_grad_(True)
    reference = make()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for index, rows in enumerate(batches(4, 4, torch.float64)):
        passes = 2 if index >= 2 else 1

        def step(*xs: torch.Tensor) -> None:
            for x in xs:
                mirrored.compute_average_loss(model(x).pow(2).sum(1),
                                              global_batch_size=8 * len(xs)).backward()
            opt.step()
            opt.zero_grad()

        two.run(step, args=tuple(mirrored.PerReplica([rows[a], rows[2 + a]])
                                 for a in range(passes)))
        for a in range(passes):
            reference(torch.cat([rows[a], rows[2 + a]])).pow(2).sum(1).sum().div(
                8 * passes).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for (name, x), y in zip(model.replicas[0].named_parameters(), reference.parameters(),
                            strict=True):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12, msg=name)
