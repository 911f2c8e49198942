"""Multi-worker training: 2 workers x 2 local replicas give the parameters of
single-process training on the same global batches (a small CNN with sync
BatchNorm, float64), and a job restarted after a crash resumes from the chief's
last checkpoint without losing a step.

`train_digits_like` is the reusable multi-worker loop (the shape the digits
example's ``--multi-worker`` mode takes).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import mirrored
from mirrored.experimental import CommunicationOptions

pytestmark = pytest.mark.multiprocess

GLOBAL_BATCH = 8
STEPS = 6


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3),
                         nn.ReLU(), nn.Flatten(), nn.Linear(3 * 8 * 8, 10)).double()


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Digits-like data: 8x8 images and 10 classes, a function of the step only
    (so a restarted job reads the same batches); the last step's batch is partial."""
    g = torch.Generator().manual_seed(100 + step)
    size = GLOBAL_BATCH - 3 if step == STEPS - 1 else GLOBAL_BATCH
    return (torch.randn(size, 1, 8, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 10, (size,), generator=g))


def train_reference(steps: int) -> dict[str, torch.Tensor]:
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = global_batch(step)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def noisy_cnn() -> nn.Module:
    model = cnn()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return model


def train_digits_like(strategy: mirrored.Strategy, steps: int, directory: str | None = None,
                      crash_at: int | None = None, model_fn=cnn,
                      set_to_none: bool = True) -> dict[str, torch.Tensor]:
    """The multi-worker training loop: mirror the model (the chief's initial values
    reach every worker), distribute each global batch, train with
    `compute_average_loss`, checkpoint through the chief every 2 steps and resume
    from the newest checkpoint at start."""
    model = strategy.mirror(model_fn(), sync_batch_norm=True)
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    manager = None if directory is None else mirrored.CheckpointManager(strategy, directory)
    start = 0
    if manager is not None:
        start = manager.restore({"model": model, "optimizer": opt}) or 0

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.cross_entropy(model(x), y, reduction="none")
        mirrored.compute_average_loss(loss).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        return loss.detach().sum()

    data = strategy.experimental_distribute_dataset(
        global_batch(step) for step in range(start, steps))
    for step, (x, y) in enumerate(data, start=start):
        if crash_at is not None and step == crash_at:
            raise SystemExit(f"crash at step {step}")  # a worker dies mid-training
        strategy.run(step_fn, args=(x, y))
        if manager is not None and (step + 1) % 2 == 0:
            manager.save(step + 1, {"model": model, "optimizer": opt})
    return {k: v.clone() for k, v in model.state_dict().items()}


def _worker(local: int, directory: str | None, crash_at: int | None,
            steps: int = STEPS, set_to_none: bool = True) -> dict[str, list]:
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=30),
        devices=[f"CPU:{i}" for i in range(local)])
    worker = strategy.cluster_resolver.worker_index
    try:  # worker 1 builds different initial values: mirror starts it from the chief's
        state = train_digits_like(strategy, steps, directory,
                                  crash_at if worker == 1 else None,
                                  model_fn=noisy_cnn if worker == 1 else cnn,
                                  set_to_none=set_to_none)
    finally:
        strategy.close()
    return {k: v.tolist() for k, v in state.items()}


def _assert_close(actual: dict[str, list], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(torch.tensor(actual[key], dtype=value.dtype), value,
                                   rtol=0, atol=1e-9, msg=key)


@pytest.mark.timeout(120)
def test_two_workers_of_two_replicas_train_like_one_process():
    results = mirrored.testing.run_multi_process(_worker, 2, args=(2, None, None), timeout=110)
    expected = train_reference(STEPS)
    for state in results:
        _assert_close(state, expected)
    assert results[0] == results[1]  # the workers' copies are bitwise equal


def _worker_windows(steps: int) -> tuple[int, dict[str, list]]:
    from mirrored._src.comm import cross_call
    misses = [0]
    miss = cross_call.CrossWorkerCalls._miss

    def counted(self, *args, **kwargs):
        misses[0] += 1
        return miss(self, *args, **kwargs)
    cross_call.CrossWorkerCalls._miss = counted
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=30), devices=["CPU:0"])
    try:
        state = train_digits_like(strategy, steps)
    finally:
        strategy.close()
    return misses[0], {k: v.tolist() for k, v in state.items()}


@pytest.mark.timeout(120)
def test_a_source_without_len_votes_per_window_and_trains_like_one_process():
    # 20 steps of a generator: three windows of votes. A window's vote follows the
    # loop's gradient call, which every worker predicted to come next: unquieted, each
    # vote first sent zeros of the gradients' sizes (a miss) and then a header round.
    results = mirrored.testing.run_multi_process(_worker_windows, 2, args=(20,), timeout=110)
    expected = train_reference(20)
    for misses, state in results:
        assert misses == 0
        _assert_close(state, expected)
    assert results[0][1] == results[1][1]


@pytest.mark.timeout(120)
def test_one_replica_workers_keeping_their_gradients_train_like_one_process():
    # One replica per worker: the gradients go straight to the communicator, whose
    # small result buffers are reused; zero_grad(set_to_none=False) keeps each step's
    # reduced gradients (views of one of them) through the next step's backward.
    results = mirrored.testing.run_multi_process(_worker, 2, args=(1, None, None, STEPS, False),
                                                 timeout=110)
    expected = train_reference(STEPS)
    for state in results:
        _assert_close(state, expected)
    assert results[0] == results[1]


@pytest.mark.timeout(150)
def test_a_restarted_job_resumes_from_the_last_checkpoint(tmp_path):
    directory = str(tmp_path / "ckpt")
    with pytest.raises(mirrored.testing.MultiProcessError, match="crash at step 5"):
        mirrored.testing.run_multi_process(_worker, 2, args=(1, directory, 5), timeout=60)
    saved = sorted(os.listdir(directory))
    assert saved == ["ckpt-000000002.pt", "ckpt-000000004.pt"]  # max_to_keep=2, complete
    state = torch.load(os.path.join(directory, saved[-1]), weights_only=True)
    _assert_close({k: v.tolist() for k, v in state["objects"]["model"].items()},
                  train_reference(4))  # the checkpoint holds exactly 4 steps
    # The restart resumes at step 4 and trains steps 4 and 5: the result equals an
    # uninterrupted run, so no step was lost or repeated.
    results = mirrored.testing.run_multi_process(_worker, 2, args=(1, directory, None),
                                                 timeout=80)
    expected = train_reference(STEPS)
    for state in results:
        _assert_close(state, expected)
    assert json.dumps(sorted(os.listdir(directory))) == json.dumps(
        ["ckpt-000000004.pt", "ckpt-000000006.pt"])


def _per_replica_global_size(local: int, times_replicas: bool = True) -> dict:
    """The loop above with ``global_batch_size=len(x) * num_replicas_in_sync`` (TF's
    per-replica formula), which is wrong on an uneven last batch (7 examples here:
    4 + 3 on one replica per worker, 2 + 2 + 2 + 1 on two); or (``times_replicas``
    false) ``len(x)``, wrong at every step."""
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=30),
        devices=[f"CPU:{i}" for i in range(local)])
    model = strategy.mirror(cnn(), sync_batch_norm=True)
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = nn.functional.cross_entropy(model(x), y, reduction="none")
        size = len(x) * (strategy.num_replicas_in_sync if times_replicas else 1)
        mirrored.compute_average_loss(loss, global_batch_size=size).backward()
        opt.step()
        opt.zero_grad()

    error, steps = "no error", 0
    try:
        last = [t[:7] for t in global_batch(0)]
        for x, y in strategy.experimental_distribute_dataset(
                [*(global_batch(step) for step in range(STEPS - 1)), last]):
            strategy.run(step_fn, args=(x, y))
            steps += 1
    except ValueError as caught:
        error = str(caught)
    finally:
        state = {k: v.tolist() for k, v in model.replicas[0].named_parameters()}
        strategy.close()
    return {"error": error, "steps": steps, "state": state}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local", [1, 2])
def test_workers_dividing_by_different_global_batch_sizes_raise_before_the_step(local):
    results = mirrored.testing.run_multi_process(_per_replica_global_size, 2, args=(local,),
                                                 timeout=110)
    expected = dict(train_reference(STEPS - 1))  # the full batches divide by 8 everywhere
    expected = {k: expected[k] for k in results[0]["state"]}  # (parameters only: BatchNorm's
    # statistics were updated by the last step's forward pass, as on one device)
    for result in results:
        assert result["steps"] == STEPS - 1, result["error"]
        assert "global_batch_size=...) was given different values" in result["error"]
        listing = result["error"].split("(", 2)[2]
        assert [f"replica {g}: " in listing for g in range(2 * local)] == [True] * (2 * local)
        _assert_close(result["state"], expected)  # the uneven step was not applied


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local", [1, 2])
def test_workers_dividing_by_their_own_rows_raise_at_the_first_step(local):
    # Every replica gives the same size, so they agree: the gradient was N times one
    # device's, silently.
    results = mirrored.testing.run_multi_process(_per_replica_global_size, 2,
                                                 args=(local, False), timeout=110)
    expected = dict(train_reference(0))
    expected = {k: expected[k] for k in results[0]["state"]}
    for result in results:
        assert result["steps"] == 0, result["error"]
        assert (f"global_batch_size={8 // (2 * local)}) the number of rows of its own"
                in result["error"]), result["error"]
        assert f"{2 * local} times the mean" in result["error"]
        _assert_close(result["state"], expected)  # not applied


def _plain_optimizer() -> dict:
    """DDP's habit ported as is: a plain optimizer over the mirrored model's
    parameters, on workers of one replica each (each worker's only copy)."""
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=30), devices=["CPU:0"])
    model = strategy.mirror(cnn())
    before = {k: v.tolist() for k, v in model.replicas[0].named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> None:
        mirrored.compute_average_loss(
            nn.functional.cross_entropy(model(x), y, reduction="none")).backward()
        opt.step()

    error = "no error"
    try:
        for x, y in strategy.experimental_distribute_dataset([global_batch(0)]):
            strategy.run(step_fn, args=(x, y))
    except RuntimeError as caught:
        error = str(caught)
    finally:
        after = {k: v.tolist() for k, v in model.replicas[0].named_parameters()}
        strategy.close()
    return {"error": error, "unchanged": after == before}


@pytest.mark.timeout(120)
def test_a_plain_optimizer_over_the_mirrored_model_is_refused_on_every_worker():
    for result in mirrored.testing.run_multi_process(_plain_optimizer, 2, timeout=110):
        assert result["error"].startswith(
            "torch.optim.SGD.step() would update the parameters of a model mirrored over 2 "
            "replicas (copy 0's "), result["error"]
        assert "strategy.mirror_optimizer(model, lambda params: torch.optim.SGD(" in (
            result["error"])
        assert result["unchanged"]


class _WithLargeBuffers(nn.Module):
    """The CNN beside a large buffer written through ``.data`` at every forward and a
    large constant one (both over `LATE_BYTES`: their values follow the flags)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("ema", torch.zeros(20000, dtype=torch.float64))
        self.register_buffer("mask", torch.ones(20000, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ema.data.mul_(0.5).add_(self.mask, alpha=0.25)
        return self.model(x)  # type: ignore[no-any-return]


def _worker_large_buffers(local: int) -> dict[str, list]:
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=30),
        devices=[f"CPU:{i}" for i in range(local)])
    try:
        state = train_digits_like(strategy, STEPS,
                                  model_fn=lambda: _WithLargeBuffers(cnn()))
    finally:
        strategy.close()
    return {k: v.tolist() for k, v in state.items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local", [1, 2])
def test_large_buffers_follow_the_flags_across_workers(local):
    results = mirrored.testing.run_multi_process(_worker_large_buffers, 2, args=(local,),
                                                 timeout=110)
    expected = {f"model.{k}": v for k, v in train_reference(STEPS).items()}
    ema = torch.zeros(20000, dtype=torch.float64)
    for _ in range(STEPS):
        ema.mul_(0.5).add_(torch.ones(20000, dtype=torch.float64), alpha=0.25)
    expected.update(ema=ema, mask=torch.ones(20000, dtype=torch.float64))
    for state in results:
        _assert_close(state, expected)
    assert results[0] == results[1]


class _QuietTable(nn.Module):
    """A large table left alone for 10 steps, then changed by worker 0's replicas."""

    def __init__(self, local: int) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1).double()
        self.register_buffer("table", torch.ones(20000, dtype=torch.float64))
        self.calls, self.local = 0, local

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        replica = mirrored.get_replica_context().replica_id_in_sync_group
        if self.calls == 11 and replica < self.local:
            self.table.data[:5] = 5.0
        return self.linear(x)  # type: ignore[no-any-return]


def _worker_quiet_table(local: int) -> list[list[float]]:
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=30),
        devices=[f"CPU:{i}" for i in range(local)])
    try:
        model = strategy.mirror(_QuietTable(local))
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

        def step(x: torch.Tensor) -> None:
            loss = mirrored.compute_average_loss(model(x).squeeze(1) ** 2)
            opt.zero_grad()
            loss.backward()
            opt.step()

        data = strategy.experimental_distribute_dataset(
            [torch.ones(8, 4, dtype=torch.float64)] * 12)
        for x in data:
            strategy.run(step, args=(x,))
        return [c.table[:6].tolist() for c in model.replicas]
    finally:
        strategy.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local", [1, 2])
def test_a_quiet_large_buffer_changed_on_one_worker_reaches_every_worker(local):
    # After 8 quiet steps the table rides as a flag only; its change at step 11 (on
    # worker 0's replicas) follows in a second all-reduce made on both workers.
    results = mirrored.testing.run_multi_process(_worker_quiet_table, 2, args=(local,),
                                                 timeout=110)
    want = [3.0] * 5 + [1.0]  # (5 + 1) / 2 per element changed on half the replicas
    assert results == [[want] * local] * 2
