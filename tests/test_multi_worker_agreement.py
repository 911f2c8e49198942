"""Workers that built different models or optimizers are refused on every worker when
the module is mirrored / the optimizer built (one agreement each, no per-step cost);
identical workers still train exactly what one device trains; a divergence found on
another worker's replica says a setting may differ between workers; and workers at
different calls are not told that their data sources differ."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mirrored
from mirrored._src.comm.call_identity import CallLedger
from mirrored._src.comm.watch import CallWatch
from mirrored.experimental import CommunicationOptions

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]

STEPS = 4


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(8, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (8,), generator=g))


def make_model(variant: str = "", rank: int = 0) -> nn.Module:
    torch.manual_seed(0)
    other = rank == 1
    act = nn.ReLU if variant == "activation" and other else nn.Tanh
    p = 0.2 if variant == "dropout" and other else 0.0
    model = nn.Sequential(nn.Linear(4, 6), act(), nn.Dropout(p),
                          nn.BatchNorm1d(6, momentum=0.2 if variant == "bn" and other else 0.1),
                          nn.Linear(6, 3)).double()
    if variant == "frozen" and other:
        model[0].bias.requires_grad_(False)
    return model


def make_optimizer(params, variant: str = "", rank: int = 0) -> torch.optim.Optimizer:
    params = list(params)
    other = rank == 1
    lr = 0.2 if variant == "lr" and other else 0.1
    nesterov = variant == "nesterov" and other
    groups = [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.01},
              {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}]
    if variant == "groups" and other:  # the same settings, other group sizes
        groups = [{"params": params[:1], "weight_decay": 0.01},
                  {"params": params[1:], "weight_decay": 0.0}]
    # (foreach is an implementation flag: differing is no error)
    return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=nesterov, foreach=other)


def reference(steps: int = STEPS, sched_every_step: bool = False) -> list[torch.Tensor]:
    model = make_model()
    opt = make_optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for i in range(steps):
        x, y = data(i)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if sched_every_step:
            sched.step()
    return [t.detach() for t in model.state_dict().values()]


def _train(model_variant: str, opt_variant: str, chief_sched: bool = False,
           steps: int = STEPS) -> dict:
    """A worker: mirror, build the optimizer, train ``steps`` steps; ``chief_sched``:
    a scheduler stepped on the chief only (after step 1), else on every worker."""
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=20))
    rank = strategy.cluster_resolver.worker_index
    try:
        model = strategy.mirror(make_model(model_variant, rank), sync_batch_norm=True)
        opt = strategy.mirror_optimizer(
            model, lambda p: make_optimizer(p, opt_variant, rank),
            check="full" if chief_sched else "cheap")
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

        def step_fn(x, y):
            loss = nn.functional.cross_entropy(model(x), y, reduction="none")
            mirrored.compute_average_loss(loss).backward()
            opt.step()
            opt.zero_grad()

        ds = strategy.experimental_distribute_dataset([data(i) for i in range(steps)])
        for step, (x, y) in enumerate(ds, 1):
            strategy.run(step_fn, args=(x, y))
            if not chief_sched or (rank == 0 and step == 1):
                sched.step()
        return {"error": None, "state": [t.detach().clone() for t in
                                         model.replicas[0].state_dict().values()]}
    except Exception as error:
        return {"error": error}
    finally:
        strategy.close()


def _raised(error: BaseException | None, kind: type[BaseException], *patterns: str) -> str:
    """Asserts that a worker raised ``kind`` whose message matches every pattern."""
    assert error is not None, "no error"
    for pattern in patterns:
        with pytest.raises(kind, match=pattern):
            raise error
    return str(error)


def test_identical_workers_train_like_one_device():
    # (two param groups, a scheduler stepped on every worker, foreach on one worker only)
    results = mirrored.testing.run_multi_process(_train, 2, args=("", ""), timeout=110)
    expected = reference(sched_every_step=True)
    for result in results:
        assert result["error"] is None, result["error"]
        for got, want in zip(result["state"], expected, strict=True):
            assert torch.allclose(got.double(), want.double(), rtol=0, atol=1e-12)


@pytest.mark.parametrize(("variant", "mine"), [
    ("activation", (r"Tanh\(\)", r"ReLU\(\)")),
    ("dropout", (r"Dropout\(p=0\.0", r"Dropout\(p=0\.2")),
    ("bn", (r"momentum=0\.1", r"momentum=0\.2")),
    ("frozen", (r"0\.bias: torch\.float64 \[6\];", r"0\.bias: torch\.float64 \[6\] \(frozen\)")),
])
def test_workers_whose_modules_differ_are_refused_on_every_worker(variant, mine):
    results = mirrored.testing.run_multi_process(_train, 2, args=(variant, ""), timeout=110)
    for rank, result in enumerate(results):
        _raised(result["error"], ValueError,
                r"^strategy\.mirror: the workers' modules differ: worker 1 differs from worker 0",
                f"(?s)this is worker {rank}; its module: .*{mine[rank]}",
                r"forward\(\) written by hand that differs between workers cannot be seen")


@pytest.mark.parametrize(("variant", "mine"), [
    ("lr", (r"lr=0\.1,", r"lr=0\.2,")),
    ("nesterov", ("nesterov=False", "nesterov=True")),
    ("groups", (r"group 0 \(2 parameters\)", r"group 0 \(1 parameters\)")),
])
def test_workers_whose_optimizers_differ_are_refused_on_every_worker(variant, mine):
    results = mirrored.testing.run_multi_process(_train, 2, args=("", variant), timeout=110)
    for rank, result in enumerate(results):
        message = _raised(result["error"], ValueError,
                          r"^mirror_optimizer: the workers' optimizers differ: worker 1 differs "
                          "from worker 0",
                          f"(?s)this is worker {rank}; its optimizer: .*{mine[rank]}")
        assert "foreach" not in message.partition("its optimizer:")[2], message


def test_a_scheduler_stepped_on_the_chief_only_names_a_setting_that_differs():
    results = mirrored.testing.run_multi_process(_train, 2, args=("", "", True), timeout=110)
    for result in results:
        _raised(result["error"], mirrored.ReplicaDivergenceError,
                r"'0\.weight' on replica\(s\) \[1\] differs from replica 0",
                r"Replica\(s\) \[1\] run on another worker than replica 0: a setting that "
                "differs between workers also makes the copies differ",
                "a scheduler stepped on some workers only")


def _different_calls(variant: str) -> BaseException | None:
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=20))
    rank = strategy.cluster_resolver.worker_index
    try:
        torch.manual_seed(0)
        model = strategy.mirror(nn.Linear(4, 3).double())
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

        def step_fn(x, y, do_step):
            loss = nn.functional.cross_entropy(model(x), y, reduction="none")
            mirrored.compute_average_loss(loss).backward()
            if do_step:
                opt.step()
                opt.zero_grad()
            return loss.detach().sum()

        same_source = [data(i) for i in range(4)]  # identical on both workers
        for step, (x, y) in enumerate(strategy.experimental_distribute_dataset(same_source), 1):
            skip = variant == "skip_step" and rank == 1 and step == 2
            out = strategy.run(step_fn, args=(x, y, not skip))
            if variant == "reduce_alone" and rank == 0 and step == 2:
                strategy.reduce("SUM", out, axis=None)  # a metric on the chief only
        return None
    except Exception as error:
        return error
    finally:
        strategy.close()


@pytest.mark.parametrize("variant", ["reduce_alone", "skip_step"])
def test_workers_at_different_calls_are_not_told_their_sources_differ(variant):
    for error in mirrored.testing.run_multi_process(_different_calls, 2, args=(variant,),
                                                    timeout=110):
        message = _raised(error, mirrored.CollectiveMismatchError,
                          "^workers made different calls", "the workers are at different calls")
        assert "shuffled with another seed" not in message, message


class _Job:
    """What `CallWatch.mismatch` asks of a job: every worker's call text."""

    world_size = 2

    def __init__(self, calls: dict[int, str]) -> None:
        self._calls = calls

    def share(self, key: str, mine: str, seconds: float) -> dict[int, str]:
        return self._calls

    def note_failure(self) -> None:
        pass


def _mismatch(calls: dict[int, str]) -> str:
    ledger = CallLedger()
    ledger.examples = 0x1234
    with pytest.raises(mirrored.CollectiveMismatchError) as info:
        CallWatch(_Job(calls), ledger, 0, None).mismatch(5, "unused")  # type: ignore[arg-type]
    return str(info.value)


CALL = "MirroredOptimizer.step(SUM of float64[3, 4]) at train.py:31 (collective 1 in run {})"


def test_the_sources_hint_only_when_the_calls_are_the_same_but_the_batches():
    same = _mismatch({0: CALL.format(2) + " [batches taken: 1234]",
                      1: CALL.format(2) + " [batches taken: 5678]"})
    assert "shuffled with another seed" in same and "batches taken: 5678" in same, same
    runs = _mismatch({0: CALL.format(2) + " [batches taken: 1234]",
                      1: CALL.format(3) + " [batches taken: 5678]"})
    assert "shuffled with another seed" not in runs, runs
    assert "the workers are at different calls" in runs, runs
    other = _mismatch({0: "Strategy.reduce(SUM of float64[]) at train.py:40 (collective 1 "
                          "after run 2) [batches taken: 1234]",
                       1: CALL.format(3) + " [batches taken: 5678]"})
    assert "shuffled with another seed" not in other, other
    assert "the workers are at different calls" in other, other
