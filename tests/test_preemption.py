"""`PreemptionCheckpointHandler`: a SIGTERM (or a watcher's notice) to any worker makes
every worker save one checkpoint at the same step and exit; the restarted job resumes
and ends with the parameters of an uninterrupted run (bitwise, float64).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import threading
from collections.abc import Callable

import pytest
import torch
from torch import nn

import mirrored
from mirrored.experimental import CommunicationOptions

STEPS = 8
OnStep = Callable[[mirrored.PreemptionCheckpointHandler, int], None]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step: a function of the step only, so a restarted job
    reads the batches an uninterrupted one would."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(6, 3, generator=g, dtype=torch.float64)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64)


class Stop(Exception):
    """What the tests' exit_fn raises (the default is sys.exit(42))."""


def stop() -> None:
    raise Stop


def train(strategy: mirrored.Strategy, directory: str, *, signal_at: int | None = None,
          config: mirrored.TerminationConfig | None = None,
          on_step: OnStep | None = None) -> tuple[mirrored.PreemptionCheckpointHandler, nn.Module]:
    """Trains to STEPS through the handler; at step ``signal_at`` this process sends
    itself SIGTERM (from inside the step, as a preemption would arrive)."""
    torch.manual_seed(0)
    model = strategy.mirror(nn.Linear(3, 1).double())
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    handler = mirrored.PreemptionCheckpointHandler(
        strategy, {"model": model, "optimizer": opt}, directory, config)

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(model(x), y, reduction="none").squeeze(1)
        mirrored.compute_average_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        return loss.detach().sum()

    def train_step() -> None:
        step = handler.total_run_calls
        (x, y), = strategy.experimental_distribute_dataset([batch(step)])
        strategy.run(step_fn, args=(x, y))
        if step == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
        if on_step is not None:
            on_step(handler, step)

    with handler.watch_preemption_scope():
        while handler.total_run_calls < STEPS:
            handler.run(train_step)
    return handler, model


def state_of(model: nn.Module) -> dict[str, list]:
    return {k: v.tolist() for k, v in model.state_dict().items()}


# -- one process ----------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_sigterm_saves_the_step_and_a_restart_resumes_bitwise(tmp_path):
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stop):
        train(strategy, str(tmp_path / "a"), signal_at=3,
              config=mirrored.TerminationConfig(exit_fn=stop))
    assert signal.getsignal(signal.SIGTERM) is before  # the handler was removed
    # The notice came during step 3; the next run() saw it before step 4: 4 steps saved.
    assert os.listdir(tmp_path / "a") == ["ckpt-000000004.pt"]
    handler, resumed = train(strategy, str(tmp_path / "a"))
    assert handler.total_run_calls == STEPS
    _, uninterrupted = train(strategy, str(tmp_path / "b"))
    assert state_of(resumed) == state_of(uninterrupted)  # bitwise
    # and one device trains the same (not bitwise: another summation order)
    torch.manual_seed(0)
    ref = nn.Linear(3, 1).double()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(STEPS):
        nn.functional.mse_loss(ref(batch(step)[0]), batch(step)[1]).backward()
        opt.step()
        opt.zero_grad()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[k], v, rtol=0, atol=1e-12)


@pytest.mark.timeout(60)
def test_the_default_exit_is_sys_exit_42(tmp_path):
    strategy = mirrored.MirroredStrategy(["CPU:0"])
    with pytest.raises(SystemExit) as exited:
        train(strategy, str(tmp_path), signal_at=0)
    assert exited.value.code == 42
    assert mirrored.CheckpointManager(strategy, tmp_path).steps() == [1]


@pytest.mark.timeout(60)
def test_a_termination_watcher_fn_is_a_notice(tmp_path):
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    noticed = threading.Event()
    seen: list[int] = []
    before = signal.getsignal(signal.SIGTERM)

    def at(handler: mirrored.PreemptionCheckpointHandler, step: int) -> None:
        seen.append(step)
        if step == 2:  # the notice arrives during step 2; the poller picks it up
            noticed.set()
            assert handler._notice.wait(10)

    config = mirrored.TerminationConfig(termination_watcher_fn=noticed.is_set, exit_fn=stop,
                                        poll_interval_seconds=0.01)
    with pytest.raises(Stop):
        train(strategy, str(tmp_path), config=config, on_step=at)
    assert signal.getsignal(signal.SIGTERM) is before  # a watcher does not touch SIGTERM
    assert seen == [0, 1, 2]
    assert mirrored.CheckpointManager(strategy, tmp_path).steps() == [3]


@pytest.mark.timeout(60)
def test_save_checkpoint_if_preempted_and_save_fn(tmp_path):
    strategy = mirrored.MirroredStrategy(["CPU:0"])
    saved: list[int] = []
    handler = mirrored.PreemptionCheckpointHandler(
        strategy, {"m": nn.Linear(1, 1)}, tmp_path,
        mirrored.TerminationConfig(exit_fn=stop, save_fn=saved.append))
    with handler.watch_preemption_scope():
        handler.save_checkpoint_if_preempted()
        handler.notify()
        with pytest.raises(Stop):
            handler.save_checkpoint_if_preempted()
    assert saved == [2]
    assert os.listdir(tmp_path) == []  # save_fn replaced the CheckpointManager


def test_bad_arguments():
    strategy = mirrored.MirroredStrategy(["CPU:0"])
    objects = {"m": nn.Linear(1, 1)}
    with pytest.raises(TypeError, match="takes the training's strategy"):
        mirrored.PreemptionCheckpointHandler(
            mirrored.cluster_resolver.SimpleClusterResolver(), objects, "d")
    with pytest.raises(ValueError, match="exactly one of checkpoint_dir"):
        mirrored.PreemptionCheckpointHandler(strategy, objects)
    with pytest.raises(TypeError, match=r"must be a mirrored\.TerminationConfig"):
        mirrored.PreemptionCheckpointHandler(strategy, objects, "d", termination_config=1)
    with pytest.raises(TypeError, match=r"must be a mirrored\.CheckpointManager"):
        mirrored.PreemptionCheckpointHandler(strategy, objects, checkpoint_manager="d")
    with pytest.raises(TypeError, match="exit_fn must be callable"):
        mirrored.TerminationConfig(exit_fn=42)
    with pytest.raises(ValueError, match="poll_interval_seconds must be > 0"):
        mirrored.TerminationConfig(poll_interval_seconds=0)
    with pytest.raises(TypeError, match=r"objects\['x'\] \(int\) has no state_dict"):
        mirrored.PreemptionCheckpointHandler(strategy, {"x": 1}, "unused-dir")
    errors: list[BaseException] = []

    def off_main() -> None:
        try:
            mirrored.PreemptionCheckpointHandler(strategy, objects, "unused-dir")
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=off_main)
    t.start()
    t.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


# -- several workers -------------------------------------------------------------------

def _worker(directory: str, signal_rank: int | None, signal_at: int | None,
            uninterrupted_first: str | None = None) -> dict:
    """Trains in ``directory`` (signalled as asked); with ``uninterrupted_first``, the
    same job first trains uninterrupted in that directory (one job for both runs)."""
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=30))
    rank = strategy.cluster_resolver.worker_index
    out = {}
    try:
        if uninterrupted_first is not None:
            handler, model = train(strategy, uninterrupted_first)
            out["uninterrupted"] = {"runs": handler.total_run_calls, "state": state_of(model)}
        try:
            handler, model = train(strategy, directory,
                                   signal_at=signal_at if rank == signal_rank else None)
        except SystemExit as e:  # the default exit_fn: every worker exits, code 42
            return {**out, "exit": e.code, "steps": mirrored.CheckpointManager(
                strategy, directory).steps()}
        return {**out, "exit": None, "runs": handler.total_run_calls, "state": state_of(model)}
    finally:
        strategy.close()


@pytest.mark.timeout(240)
def test_sigterm_to_one_of_three_workers_saves_one_step_everywhere(tmp_path):
    run = mirrored.testing.run_multi_process
    directory = str(tmp_path / "a")
    # One job trains uninterrupted (in b), then again in a, where worker 1 gets SIGTERM.
    stopped = run(_worker, 3, args=(directory, 1, 4, str(tmp_path / "b")), timeout=70)
    uninterrupted = [r.pop("uninterrupted") for r in stopped]
    assert [r["runs"] for r in uninterrupted] == [STEPS] * 3
    # Worker 1 got SIGTERM during step 4; every worker saved 5 steps and exited with 42.
    assert stopped == [{"exit": 42, "steps": [5]}] * 3
    resumed = run(_worker, 3, args=(directory, None, None), timeout=70)
    assert [r["runs"] for r in resumed] == [STEPS] * 3
    assert resumed[0]["state"] == uninterrupted[0]["state"]  # bitwise
    assert all(r["state"] == resumed[0]["state"] for r in resumed + uninterrupted)


def _skipping_worker(directory: str) -> str:
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=30))
    rank = strategy.cluster_resolver.worker_index
    try:
        handler = mirrored.PreemptionCheckpointHandler(strategy, {"m": nn.Linear(1, 1)},
                                                       directory)
        def step() -> None:
            if rank == 1:
                raise ValueError("a step that fails on worker 1 only")

        with contextlib.suppress(ValueError):  # worker 1 goes on after its step failed
            handler.run(step)
        with pytest.raises(RuntimeError, match=r"have run between 0 and 1 steps"):
            handler.run(lambda: None)
        return "raised"
    finally:
        strategy.close()


@pytest.mark.timeout(120)
def test_workers_with_different_step_counts_are_refused(tmp_path):
    assert mirrored.testing.run_multi_process(_skipping_worker, 2, args=(str(tmp_path),),
                                              timeout=60) == ["raised", "raised"]


# -- the digits example ------------------------------------------------------------------

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "train_digits.py"


@pytest.mark.timeout(400)
def test_the_digits_example_saves_on_sigterm_and_resumes_bitwise(tmp_path, digits_two_replicas):
    pytest.importorskip("sklearn")
    common = [sys.executable, "-u", str(EXAMPLE), "--replicas", "2", "--epochs", "2"]
    preempted = [*common, "--preemption", "--checkpoint-dir", str(tmp_path / "ckpt"),
                 "--save-final", str(tmp_path / "resumed.pt")]
    with subprocess.Popen(preempted, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          text=True) as job:
        assert job.stdout is not None
        lines = [job.stdout.readline(), job.stdout.readline()]  # header, then epoch 1
        assert lines[1].startswith("epoch 1/2"), lines
        job.send_signal(signal.SIGTERM)  # during epoch 2 (15 steps per epoch)
        out, _ = job.communicate(timeout=120)
    assert job.returncode == 42, out
    (saved,) = sorted(os.listdir(tmp_path / "ckpt"))
    step = int(saved[len("ckpt-"):-len(".pt")])
    assert 15 <= step < 30  # in epoch 2 (max_to_keep=1: one checkpoint)
    resumed = subprocess.run(preempted, capture_output=True, text=True, timeout=150)
    assert f"resumed from step {step} (epoch 2, batch {step - 15 + 1})" in resumed.stdout
    assert resumed.returncode == 0, resumed.stderr
    _, straight = digits_two_replicas()  # the same command without --preemption
    a = torch.load(tmp_path / "resumed.pt", weights_only=True)
    b = torch.load(straight, weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bitwise
