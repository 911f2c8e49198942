"""`ElasticMirroredStrategy` (torchft): the mirrored loop over workers that die and
come back.

3 workers of 2 local CPU replicas each train with the plain mirrored loop; worker 2 is
SIGKILLed in the middle of step KILL_AT (after backward, before the optimizer step);
workers 0 and 1 go on without restarting (the interrupted step is not committed and
they redo it on the same batch); worker 2, started again from other initial values,
rejoins at a step boundary with a healthy peer's state. All three end with equal
parameters, equal to one device trained on the rows each committed step actually
combined (worker 2's rows are missing from the degraded steps, each mean over the rows
present), and every replica of every step trained rows of that step only.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import time
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("torchft")

import mirrored
from mirrored import elastic

STEPS = 10
GLOBAL_BATCH = 12  # 6 replicas x 2 rows; worker w holds rows 4w .. 4w+3
KILL_AT = 4
DEVICES = ["CPU:0", "CPU:1"]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randn(GLOBAL_BATCH, 3, generator=g, dtype=torch.float64)
    noise = 0.3 * torch.randn(GLOBAL_BATCH, 1, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5]], dtype=torch.float64) + noise
    return x, y, torch.full((GLOBAL_BATCH,), step)  # the tag: which step a row is of


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(3, 1).double()


def eval_loss(net: nn.Module) -> float:
    x, y, _ = batch(10_000)
    with torch.no_grad():
        return float(((net(x) - y) ** 2).mean())


def _worker(index: int, address: str, seed: int, kill_at: int | None, start: Any,
            degraded: Any, conn: Any) -> None:
    torch.set_num_threads(1)
    strategy = elastic.ElasticMirroredStrategy(address, worker_index=index, num_workers=3,
                                               devices=DEVICES, min_workers=2,
                                               timeout_seconds=5)
    if start is not None:
        start.wait(60)  # the first three begin together (the first quorum has all three)
    with strategy.scope():
        net = strategy.mirror(model(seed))
        opt = strategy.mirror_optimizer(net, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5))
    dataset = strategy.experimental_distribute_dataset(batch(s) for s in itertools.count())

    def step_fn(x: torch.Tensor, y: torch.Tensor, tag: torch.Tensor) -> Any:
        ctx = mirrored.get_replica_context()
        loss = mirrored.compute_average_loss(((net(x) - y) ** 2).squeeze(1))
        loss.backward()
        if kill_at is not None and strategy.elastic.step >= kill_at \
                and strategy.elastic.num_workers == 3:
            os.kill(os.getpid(), signal.SIGKILL)  # in the step, before its all-reduce
        opt.step()
        opt.zero_grad()
        replicas = ctx.all_reduce("SUM", torch.tensor(1.0))
        mean_id = ctx.all_reduce("MEAN", torch.tensor(float(ctx.replica_id_in_sync_group)))
        ids = ctx.all_gather(torch.tensor([ctx.replica_id_in_sync_group]), axis=0)
        return loss, replicas, mean_id, ids, tag

    log = []
    for x, y, tag in dataset:
        step, workers = strategy.elastic.step, strategy.elastic.num_workers
        loss, replicas, mean_id, ids, tags = strategy.run(step_fn, args=(x, y, tag))
        committed = strategy.elastic.step == step + 1
        rows = strategy.gather(tags, axis=0)
        log.append({"step": step, "workers": workers, "committed": committed,
                    "time": time.monotonic(), "eval": eval_loss(net.replicas[0]),
                    "in_sync": strategy.num_replicas_in_sync,
                    "replicas": [float(v) for v in strategy.experimental_local_results(replicas)],
                    "mean_id": [float(v) for v in strategy.experimental_local_results(mean_id)],
                    "loss": float(strategy.reduce("SUM", loss)), "tags": rows.tolist(),
                    "ids": [v.tolist() for v in strategy.experimental_local_results(ids)]})
        if committed and workers == 2:
            degraded.value += 1  # (the test restarts worker 2 after a few such steps)
        if committed and strategy.elastic.step >= STEPS and workers == 3:
            break  # stop together: after STEPS, at the first step all three took part in
        if strategy.elastic.step >= STEPS:
            time.sleep(0.05)  # past STEPS, waiting for the restarted worker: fewer steps
    equal = all(torch.equal(a, b) for a, b in zip(net.replicas[0].parameters(),
                                                   net.replicas[1].parameters(), strict=True))
    conn.send({"state": {k: v.tolist() for k, v in net.state_dict().items()},
               "step": strategy.elastic.step, "log": log, "local_equal": equal})
    conn.close()
    strategy.close()


def reference(log: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """One device trained on the rows each committed step combined (replica g holds
    rows 2g and 2g+1), the loss a mean over those rows."""
    net = model(0)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
    for entry in log:
        if not entry["committed"]:
            continue
        x, y, _ = batch(entry["step"])
        rows = [r for g in entry["ids"][0] for r in (2 * g, 2 * g + 1)]
        (((net(x[rows]) - y[rows]) ** 2).mean()).backward()
        opt.step()
        opt.zero_grad()
    return net.state_dict()


@pytest.mark.timeout(120)
def test_strategy_survives_a_killed_worker_which_rejoins_with_a_peers_state():
    ctx = multiprocessing.get_context("forkserver")  # one clean process forks workers
    # torch imports torch._dynamo at the first optimizer (seconds): once, in the server.
    ctx.set_forkserver_preload(["torch", "torch._dynamo", "torchft.manager", "mirrored.elastic"])
    barrier = ctx.Barrier(3)
    degraded = ctx.Value("i", 0)
    lighthouse = elastic.Lighthouse(min_workers=2, join_timeout_seconds=1.0,
                                    heartbeat_timeout_seconds=1.0)
    procs: list[Any] = []
    readers: dict[int, Any] = {}

    def start(index: int, seed: int, kill_at: int | None, first: bool = True) -> None:
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(index, lighthouse.address, seed, kill_at,
                                                 barrier if first else None, degraded,
                                                 writer),
                           daemon=True)
        proc.start()
        writer.close()
        procs.append(proc)
        readers[index] = reader

    try:
        for index in range(3):
            start(index, 0, KILL_AT if index == 2 else None)
        procs[2].join(60)
        assert procs[2].exitcode == -signal.SIGKILL
        killed_at = time.monotonic()
        deadline = killed_at + 30
        while degraded.value < 6 and time.monotonic() < deadline:  # survivors' steps alone
            time.sleep(0.05)
        start(2, 99, None, first=False)  # only a peer's state can make it equal
        results = {}
        for index, reader in readers.items():
            assert reader.poll(90), f"worker {index} did not finish"
            results[index] = reader.recv()
    finally:
        for proc in procs:
            proc.kill()
            proc.join(10)
        lighthouse.close()

    check(results, killed_at)


def check(results: dict[int, Any], killed_at: float) -> None:
    final = results[0]["step"]
    assert final >= STEPS and all(r["step"] == final for r in results.values())
    # Equal parameters everywhere (local copies too), those of the one-device reference
    # over the steps as committed (the workers that were first started at step 0).
    assert results[0]["state"] == results[1]["state"] == results[2]["state"]
    assert all(r["local_equal"] for r in results.values())
    committed = {e["step"]: e for r in (results[1], results[0]) for e in r["log"]
                 if e["committed"]}
    assert sorted(committed) == list(range(final))
    for key, value in reference([committed[s] for s in range(final)]).items():
        got = torch.tensor(results[0]["state"][key], dtype=torch.float64)
        torch.testing.assert_close(got, value, rtol=0, atol=1e-10, msg=key)
    # The survivors never restarted: each committed every step once, in order, from the
    # one it joined at (a late starter joins with a peer's state too); the step the kill
    # interrupted failed on both and was redone by the two of them.
    failed_steps = set()
    for index in (0, 1):
        log = results[index]["log"]
        done = [e["step"] for e in log if e["committed"]]
        assert done == list(range(done[0], final)), done
        failed = [e["step"] for e in log if not e["committed"]]
        assert len(failed) == 1 and failed[0] >= KILL_AT, failed
        failed_steps.add(failed[0])
    (killed_step,) = failed_steps
    # Degraded semantics, as docs/elastic.md states them.
    for entry in (e for r in results.values() for e in r["log"]):
        assert entry["in_sync"] == 6  # the nominal job, whoever is alive
        if not entry["committed"]:
            continue
        ids = entry["ids"][0]  # the live replicas (all_gather: every worker's, in order)
        assert entry["ids"] == [ids, ids] and len(ids) == 2 * entry["workers"]
        assert ids == sorted(ids) and (entry["workers"] == 3) == (ids == list(range(6)))
        assert entry["replicas"] == [len(ids)] * 2  # SUM over the live replicas
        assert entry["mean_id"] == [sum(ids) / len(ids)] * 2  # MEAN divides by the live ones
        # Every row the step trained is of that step: 4 rows per live worker, no more.
        assert entry["tags"] == [entry["step"]] * (4 * entry["workers"])
    assert {committed[s]["workers"] for s in range(killed_step, final)} == {2, 3}
    # The restarted worker joined at a step boundary after the kill, not from step 0,
    # and its first step's rows were of the job's step.
    rejoined = results[2]["log"][0]
    assert killed_step < rejoined["step"] < final and rejoined["workers"] == 3
    assert rejoined["tags"] == [rejoined["step"]] * GLOBAL_BATCH
    # The loss (on a fixed evaluation batch) goes down through the failure: means over
    # windows of 3 steps, before the kill, after it, after the rejoin, at the end.
    loss_at = [committed[s]["eval"] for s in range(final)]

    def window(lo: int) -> float:
        return sum(loss_at[lo:lo + 3]) / len(loss_at[lo:lo + 3])

    assert window(0) < eval_loss(model(0))
    assert window(max(killed_step - 3, 0)) < window(0)
    assert window(killed_step) < window(0) and window(rejoined["step"]) < window(0)
    assert window(final - 3) < window(0)
    times = [e["time"] for e in results[0]["log"] if e["committed"]]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    print(f"\nelastic strategy: survivors' longest pause {max(gaps):.2f} s (median step "
          f"{sorted(gaps)[len(gaps) // 2]:.3f} s); restarted worker back at step "
          f"{rejoined['step']}, {rejoined['time'] - killed_at:.1f} s after the kill")


@pytest.fixture
def one_worker():
    """A job of one worker with 2 local replicas (its own lighthouse)."""
    lighthouse = elastic.Lighthouse(min_workers=1, join_timeout_seconds=0.2)
    strategy = elastic.ElasticMirroredStrategy(lighthouse.address, worker_index=0,
                                               num_workers=1, devices=DEVICES)
    yield strategy
    strategy.close()
    lighthouse.close()


@pytest.mark.timeout(60)
def test_a_checkpoint_is_written_by_the_lowest_live_worker_when_worker_0_is_gone(tmp_path):
    # A job of 2 whose worker 0 is lost: worker 1, the lowest live one, writes (no worker
    # did, and save returned the path of a file that never existed).
    lighthouse = elastic.Lighthouse(min_workers=1, join_timeout_seconds=0.2)
    strategy = elastic.ElasticMirroredStrategy(lighthouse.address, worker_index=1,
                                               num_workers=2, devices=DEVICES, min_workers=1)
    try:
        with strategy.scope():
            net = strategy.mirror(model(0))
        manager = mirrored.CheckpointManager(strategy, tmp_path)
        path = manager.save(3, {"model": net})
        assert path.exists() and manager.steps() == [3]
        assert manager.restore({"model": net}) == 3
    finally:
        strategy.close()
        lighthouse.close()


@pytest.mark.timeout(60)
def test_one_worker_trains_as_one_device_and_indexes_its_dataset_by_step(one_worker):
    strategy = one_worker
    with strategy.scope():
        net = strategy.mirror(model(0))
        opt = strategy.mirror_optimizer(net, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.5))
    dataset = strategy.experimental_distribute_dataset([batch(s) for s in range(6)])

    def step_fn(x: torch.Tensor, y: torch.Tensor, tag: torch.Tensor, train: bool) -> Any:
        loss = mirrored.compute_average_loss(((net(x) - y) ** 2).squeeze(1))
        if train:
            loss.backward()
            opt.step()
            opt.zero_grad()
        return tag

    seen = []
    for k, (x, y, tag) in enumerate(dataset):
        # Every other batch is an evaluation run (no optimizer step): the step does not
        # end, so the next batch taken is the same element.
        tags = strategy.run(step_fn, args=(x, y, tag, k % 2 == 1))
        seen.append((strategy.elastic.step, strategy.gather(tags, axis=0).tolist()))
    assert [step for step, _ in seen] == [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
    assert [rows for _, rows in seen] == [[s] * GLOBAL_BATCH for s in range(6) for _ in "ab"]
    reference_net = model(0)
    reference_opt = torch.optim.SGD(reference_net.parameters(), lr=0.1, momentum=0.5)
    for s in range(6):
        x, y, _ = batch(s)
        ((reference_net(x) - y) ** 2).mean().backward()
        reference_opt.step()
        reference_opt.zero_grad()
    for key, value in reference_net.state_dict().items():
        torch.testing.assert_close(net.state_dict()[key], value, rtol=0, atol=1e-12)
    # Reductions keep their single-process meaning with every worker present.
    v = mirrored.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([6.0])])
    assert strategy.reduce("MEAN", v, axis=0).item() == 3.0
    assert strategy.reduce("SUM", mirrored.PerReplica([torch.tensor(1), torch.tensor(2)])) == 3
    assert strategy.gather(v, axis=0).tolist() == [1.0, 2.0, 6.0]
    with pytest.raises(RuntimeError, match="an elastic distributed dataset is iterated once"):
        next(iter(dataset))
    with pytest.raises(NotImplementedError, match="distribute_datasets_from_function"):
        strategy.distribute_datasets_from_function(lambda ctx: [torch.ones(2)])


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::mirrored.LossScalingWarning")  # (no per-example loss here)
def test_one_optimizer_step_per_step_and_no_overlap(one_worker):
    strategy = one_worker
    with strategy.scope():
        net = strategy.mirror(model(0))
        opt = strategy.mirror_optimizer(net, lambda p: torch.optim.SGD(p, lr=0.1))
        with pytest.raises(ValueError, match=r"overlap=True\) is not available"):
            strategy.mirror_optimizer(net, lambda p: torch.optim.SGD(p, lr=0.1), overlap=True)
        counted = model(0)
        counted.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        counted_copies = strategy.mirror(counted)
        with pytest.raises(ValueError, match=r"no buffer can be taken from replica 0.*'calls'"):
            strategy.mirror_optimizer(counted_copies, lambda p: torch.optim.SGD(p, lr=0.1))
    x = mirrored.PerReplica([torch.ones(1, 3, dtype=torch.float64)] * 2)

    def twice(x: torch.Tensor) -> None:
        for _ in range(2):
            net(x).sum().backward()
            opt.step()
            opt.zero_grad()

    with pytest.raises(RuntimeError, match="an elastic step has one optimizer step"):
        strategy.run(twice, args=(x,))


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore::mirrored.LossScalingWarning")  # (no per-example loss here)
def test_elastic_copies_are_compared_by_exact_bit_sums(one_worker):
    """Elastic workers join with no start-up exchange of their devices, so none can know
    whether another's replicas sit on another kind of device (where 2-norms of equal
    copies may differ in the last bit): every worker compares exact bit sums."""
    strategy = one_worker
    with strategy.scope():
        net = strategy.mirror(model(0))
        opt = strategy.mirror_optimizer(net, lambda p: torch.optim.SGD(p, lr=0.1))
    x = mirrored.PerReplica([torch.ones(1, 3, dtype=torch.float64)] * 2)

    def step(x: torch.Tensor) -> None:
        net(x).sum().backward()
        opt.step()
        opt.zero_grad()

    strategy.run(step, args=(x,))  # equal copies: compared, no error
    with torch.no_grad():
        next(net.replicas[1].parameters()).view(-1)[0] += 2.0 ** -40  # one copy, one bit
    for _ in range(7):  # (check="cheap": the first step and every 8th)
        strategy.run(step, args=(x,))
    with pytest.raises(mirrored.ReplicaDivergenceError, match="bit-sum fingerprints"):
        strategy.run(step, args=(x,))


def test_bad_arguments():
    make = elastic.ElasticMirroredStrategy
    with pytest.raises(ValueError, match=r"worker_index must be in 0\.\.1; got 2"):
        make("http://127.0.0.1:1", worker_index=2, num_workers=2)
    with pytest.raises(TypeError, match="num_workers must be an int"):
        make("http://127.0.0.1:1", worker_index=0, num_workers=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"min_workers \(3\) cannot exceed num_workers \(2\)"):
        make("http://127.0.0.1:1", worker_index=0, num_workers=2, min_workers=3)
    with pytest.raises(ValueError, match="at least 2 replicas in all"):
        make("http://127.0.0.1:1", worker_index=0, num_workers=1)


class _Work:
    def wait(self) -> None:
        pass


class _OneStepApart:
    """A torchft Manager stand-in whose all-reduce SUM adds a second worker that is one
    step (and one dataset element) ahead in the same quorum."""

    def __init__(self) -> None:
        self.reported: list[Exception] = []
        self._quorum_id = 3

    def current_step(self) -> int:
        return 5

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any) -> _Work:
        one, step, step2, element, element2, quorum, quorum2 = tensor.tolist()
        tensor.copy_(torch.tensor([one + 1, step + 6, step2 + 36, element + 6, element2 + 36,
                                   quorum + 3, quorum2 + 9]))
        return _Work()

    def errored(self) -> None:
        return None

    def report_error(self, error: Exception) -> None:
        self.reported.append(error)

    def should_commit(self) -> bool:
        return not self.reported


def test_a_step_whose_workers_are_at_different_steps_is_not_committed(caplog):
    from mirrored._src.elastic.session import ElasticSession
    session = ElasticSession.__new__(ElasticSession)  # the vote only, on a stand-in
    manager = _OneStepApart()
    session._manager = manager
    session._open, session.element = True, 5
    with caplog.at_level("ERROR", logger="mirrored"):
        assert session.commit() is False
    assert [str(e) for e in manager.reported] == [
        "the workers of the step differ in step, dataset element"]
    assert "differ in step, dataset element; not committed" in caplog.text
