"""MultiWorkerMirroredStrategy across real processes (Gloo over 127.0.0.1).

One worker function per configuration makes many checks and returns plain values;
the parent compares them with references computed here from the same closed-form
inputs (replica ``g`` of ``N`` holds values built from ``g``), with NumPy. Spawning
is the slow part (torch's import), so configurations are few and checks many.
"""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
import torch

import mirrored
from mirrored._src.data.split import chunk_bounds
from mirrored.experimental import CommunicationOptions

pytestmark = pytest.mark.multiprocess

OPTIONS = CommunicationOptions(timeout_seconds=20)


def _strategy(local: int, **kwargs):
    return mirrored.MultiWorkerMirroredStrategy(
        communication_options=OPTIONS, devices=[f"CPU:{i}" for i in range(local)], **kwargs)


def _vals(value, strategy):
    return [t.tolist() for t in strategy.experimental_local_results(value)]


def _every_operation(local: int) -> dict:
    """Runs on each worker: every operation, results as lists."""
    strategy = _strategy(local)
    worker_index = strategy.cluster_resolver.worker_index
    out: dict = {"n": strategy.num_replicas_in_sync,
                 "devices": list(strategy.extended.worker_devices),
                 "chief": strategy.extended.should_checkpoint,
                 "resolver": type(strategy.cluster_resolver).__name__}
    ids = strategy.run(lambda: mirrored.get_replica_context().replica_id_in_sync_group)
    out["ids"] = list(strategy.experimental_local_results(ids))
    # Replica g holds [g+1, 2(g+1)] (no axis) and g+1 repeated 2(g+1) times (axis 0).
    pair = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([ctx.replica_id_in_sync_group + 1.0,
                                  2.0 * (ctx.replica_id_in_sync_group + 1)]))
    rows = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.full((2 * (ctx.replica_id_in_sync_group + 1),),
                               ctx.replica_id_in_sync_group + 1.0))
    for op in ("SUM", "MEAN", "MIN", "MAX"):
        out[f"reduce_{op}"] = strategy.reduce(op, pair).tolist()
        out[f"reduce_{op}_axis"] = strategy.reduce(op, rows, axis=0).item()
        # A host tensor is this worker's value: worker w holds w + 1.
        host = torch.tensor(worker_index + 1.0)
        out[f"host_{op}"] = strategy.reduce(op, host).item()
        out[f"host_{op}_axis"] = strategy.reduce(
            op, torch.arange(worker_index + 2.0), axis=0).item()
    out["host_sum_one"] = strategy.reduce("SUM", torch.tensor(1.0)).item()
    out["gather"] = strategy.gather(rows, axis=0).tolist()

    def step():
        ctx = mirrored.get_replica_context()
        g = ctx.replica_id_in_sync_group
        mine = torch.full((g + 1,), float(g))
        return (ctx.all_reduce("SUM", torch.tensor(float(g))),
                ctx.all_reduce("MEAN", torch.full((2 * (g + 1),), g + 1.0), axis=0),
                ctx.all_reduce("MAX", {"a": torch.tensor([g, -g])}),
                ctx.all_gather(mine, axis=0),
                ctx.merge_call(lambda s, v: s.reduce("SUM", v), args=(torch.tensor(2.0 * g),)),
                mirrored.compute_average_loss(torch.ones(g + 1)))

    step_out = strategy.run(step)
    out["step"] = [(s.item(), m.item(), x["a"].tolist(), ga.tolist(), mc.item(), loss.item())
                   for s, m, x, ga, mc, loss in strategy.experimental_local_results(step_out)]
    out["reduce_to"] = strategy.extended.reduce_to("MEAN", pair, "CPU:0").tolist()
    ones = strategy.experimental_distribute_values_from_function(lambda ctx: torch.tensor(1.0))
    batch = strategy.extended.batch_reduce_to("SUM", [(pair, "CPU:0"), (ones, "CPU:0")])
    out["batch_reduce_to"] = [t.tolist() for t in batch]
    out["broadcast_to"] = _vals(strategy.extended.broadcast_to(torch.tensor(7.0), pair),
                                strategy)
    # Dataset: range(14) in global batches of 8 (the last one partial).
    data = [torch.arange(0, 8), torch.arange(8, 14)]
    out["dataset"] = [_vals(b, strategy) for b in strategy.experimental_distribute_dataset(data)]

    def dataset_fn(ctx):  # worker w has w + 1 elements of its own per replica
        return [torch.full((2,), 10.0 * ctx.input_pipeline_id + j)
                for j in range((ctx.input_pipeline_id + 1) * local)]

    per_worker = strategy.distribute_datasets_from_function(dataset_fn)
    out["from_function"] = [_vals(b, strategy) for b in per_worker]
    out["input_context"] = (per_worker.input_context.num_input_pipelines,
                            per_worker.input_context.input_pipeline_id)
    out["repr"] = repr(strategy)
    strategy.close()
    return out


def _check_every_operation(results: list[dict], workers: int, local: int) -> None:
    n = workers * local
    pair = np.array([[g + 1.0, 2.0 * (g + 1)] for g in range(n)])
    rows = [np.full(2 * (g + 1), g + 1.0) for g in range(n)]
    flat = np.concatenate(rows)
    host = np.arange(1.0, workers + 1)
    host_rows = np.concatenate([np.arange(w + 2.0) for w in range(workers)])
    ops = {"SUM": np.sum, "MEAN": np.mean, "MIN": np.min, "MAX": np.max}
    for w, out in enumerate(results):
        assert out["n"] == n and out["chief"] == (w == 0)
        assert out["resolver"] == "TorchrunClusterResolver"
        assert out["devices"] == [f"/job:worker/replica:0/task:{w}/device:CPU:{i}"
                                  for i in range(local)]
        assert out["ids"] == [w * local + i for i in range(local)]
        for op, fn in ops.items():
            assert out[f"reduce_{op}"] == pytest.approx(fn(pair, axis=0).tolist())
            assert out[f"reduce_{op}_axis"] == pytest.approx(fn(flat))
            assert out[f"host_{op}"] == pytest.approx(fn(host))
            assert out[f"host_{op}_axis"] == pytest.approx(fn(host_rows))
        if n == 2:
            assert out["reduce_MEAN_axis"] == pytest.approx(10 / 6)
        assert out["host_sum_one"] == workers
        assert out["gather"] == flat.tolist()
        for i, (s, m, x, ga, mc, loss) in enumerate(out["step"]):
            g = w * local + i
            assert s == sum(range(n)) and m == pytest.approx(np.mean(flat))
            assert x == [n - 1, 0]
            assert ga == [float(r) for r in range(n) for _ in range(r + 1)]
            assert mc == pytest.approx(2.0 * sum(range(n)))
            assert loss == pytest.approx((g + 1) / sum(r + 1 for r in range(n)))
        assert out["reduce_to"] == pytest.approx(pair.mean(axis=0).tolist())
        assert out["batch_reduce_to"] == [pytest.approx(pair.sum(axis=0).tolist()), n]
        assert out["broadcast_to"] == [7.0] * local
        expect = []
        for lo, hi in ((0, 8), (8, 14)):
            expect.append([list(range(lo + a, lo + b)) for a, b in
                           (chunk_bounds(hi - lo, n, w * local + i) for i in range(local))])
        assert out["dataset"] == expect
        steps = workers  # the worker with the most data (the last) has `workers` steps
        expect_fn = [[[10.0 * w + s * local + i] * 2 if s < w + 1 else [] for i in range(local)]
                     for s in range(steps)]
        assert out["from_function"] == expect_fn
        assert out["input_context"] == (workers, w)
        assert out["repr"].startswith(f"MultiWorkerMirroredStrategy(worker {w} of {workers}")


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("workers", "local"), [(2, 1), (2, 2), (3, 2)])
def test_every_operation_across_workers(workers, local):
    results = mirrored.testing.run_multi_process(_every_operation, workers, args=(local,),
                                                 timeout=80)
    _check_every_operation(results, workers, local)


def _means_of_mixed_values(local: int) -> dict:
    """MEANs along axis 0 of a nest of float32, float64 and int64 rows (each replica
    and worker its own count, one replica none), and how many cross-worker calls
    each reduce made."""
    from mirrored._src.comm import cross_call

    strategy = _strategy(local)
    calls = [0]
    original = cross_call.CrossWorkerCalls.call

    def counting(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    def rows(ctx) -> dict:
        g = ctx.replica_id_in_sync_group
        n = 0 if g == 1 else g + 2
        return {"f32": torch.arange(n, dtype=torch.float32) * 0.1 + g,
                "f64": torch.arange(2 * n, dtype=torch.float64).view(n, 2) / 3 + g,
                "i64": torch.arange(n) * 7 - g,
                "f16": (torch.arange(n, dtype=torch.float16) + g) / 4}  # (no trailer)

    value = strategy.experimental_distribute_values_from_function(rows)
    cross_call.CrossWorkerCalls.call = counting
    try:
        with torch.inference_mode():  # (an evaluation's metrics)
            means = strategy.reduce("MEAN", value, axis=0)
        host = strategy.reduce("MEAN", torch.arange(strategy.cluster_resolver.worker_index + 3.0),
                               axis=0)
        calls_of_reduce = calls[0]
        inside = strategy.run(lambda v: mirrored.get_replica_context().all_reduce(
            "MEAN", v, axis=0), args=(value,))
        sums = strategy.run(lambda v: mirrored.get_replica_context().all_reduce(
            "SUM", v, axis=0), args=(value,))
    finally:
        cross_call.CrossWorkerCalls.call = original
        strategy.close()
    return {"means": {k: v.tolist() for k, v in means.items()}, "host": host.item(),
            "calls": calls_of_reduce, "calls inside run": calls[0] - calls_of_reduce,
            "inside": [{k: t.tolist() for k, t in r.items()}
                       for r in strategy.experimental_local_results(inside)],
            "sums": [{k: t.tolist() for k, t in r.items()}
                     for r in strategy.experimental_local_results(sums)]}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("local", [1, 2])
def test_means_along_an_axis_divide_by_every_workers_rows_in_one_call(local):
    # The element counts ride in the sum's call (their own pack), so each reduce is one
    # checked call; the means equal NumPy's over every replica's rows concatenated.
    results = mirrored.testing.run_multi_process(_means_of_mixed_values, 2, args=(local,),
                                                 timeout=80)
    replicas = 2 * local
    rows = {k: [] for k in ("f32", "f64", "i64", "f16")}
    for g in range(replicas):
        n = 0 if g == 1 else g + 2
        rows["f32"].append(np.arange(n, dtype=np.float32) * np.float32(0.1) + g)
        rows["f64"].append(np.arange(2 * n, dtype=np.float64).reshape(n, 2) / 3 + g)
        rows["i64"].append(np.arange(n) * 7 - g)
        rows["f16"].append((np.arange(n, dtype=np.float16) + g) / 4)
    for result in results:
        assert (result["calls"], result["calls inside run"]) == (2, 2), result
        for key, parts in rows.items():
            whole = np.concatenate(parts).astype(np.float64)
            expected = whole.mean(axis=0)
            rtol = 2e-3 if key == "f16" else 1e-6
            np.testing.assert_allclose(result["means"][key], expected, rtol=rtol)
            for inside, sums in zip(result["inside"], result["sums"], strict=True):
                np.testing.assert_allclose(inside[key], expected, rtol=rtol)
                np.testing.assert_allclose(sums[key], whole.sum(axis=0), rtol=rtol)
        assert result["host"] == pytest.approx(np.concatenate([np.arange(3.0),
                                                               np.arange(4.0)]).mean())


def test_two_workers_split_range_14_as_the_spec_says():
    # Worker 0 gets [0..3] then [8, 9, 10]; worker 1 [4..7] then [11, 12, 13].
    assert [list(range(*chunk_bounds(8, 2, w))) for w in (0, 1)] == [[0, 1, 2, 3],
                                                                      [4, 5, 6, 7]]
    assert [[8 + i for i in range(*chunk_bounds(6, 2, w))] for w in (0, 1)] == [
        [8, 9, 10], [11, 12, 13]]


def _uneven_local_counts() -> str:
    rank = int(os.environ["RANK"])
    try:
        _strategy(1 + rank)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.timeout(60)
def test_workers_with_different_local_replica_counts_are_refused():
    messages = mirrored.testing.run_multi_process(_uneven_local_counts, 2, timeout=50)
    for message in messages:
        assert "same number of local replicas; got worker 0: 1, worker 1: 2" in message


# ----------------------------------------------------------------- failures


def _killed_mid_training(directory: str) -> None:
    strategy = _strategy(1, failure_timeout_seconds=2.0)
    rank = strategy.cluster_resolver.worker_index
    model = strategy.mirror(torch.nn.Linear(4, 1))
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

    def step():
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for _ in range(3):
        strategy.run(step)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    report: dict = {"error": None}
    try:
        for _ in range(100000):
            strategy.run(step)
    except mirrored.WorkerFailureError as error:
        report = {"error": str(error), "seconds": time.monotonic() - start,
                  "workers": list(error.workers)}
    with open(os.path.join(directory, f"{rank}.json"), "w") as f:
        json.dump(report, f)


@pytest.mark.timeout(90)
def test_a_worker_killed_mid_training_makes_the_survivors_raise_worker_failure_error(
        tmp_path):
    with pytest.raises(mirrored.testing.MultiProcessError) as info:
        mirrored.testing.run_multi_process(_killed_mid_training, 3, args=(str(tmp_path),),
                                           timeout=80, grace=20)  # time to notice the death
    assert info.value.rank == 2 and set(info.value.failures) == {2}  # only the killed one
    for rank in (0, 1):
        report = json.loads((tmp_path / f"{rank}.json").read_text())
        assert report["workers"] == [2], report
        assert "worker 2 failed" in report["error"]
        assert report["seconds"] < 2.0 + 13.0  # failure_timeout_seconds plus slack (loaded CI)


def _skips_an_all_reduce() -> str:
    strategy = _strategy(2)
    rank = strategy.cluster_resolver.worker_index

    def step():
        ctx = mirrored.get_replica_context()
        first = ctx.all_reduce("SUM", torch.ones(3))
        if rank == 0:  # worker 1 skips this one and goes on to the next
            ctx.all_reduce("SUM", torch.ones(5))
        return ctx.all_reduce("MAX", first)

    try:
        strategy.run(step)
    except mirrored.CollectiveMismatchError as error:
        return str(error)
    finally:
        strategy.close()
    return "no error"


@pytest.mark.timeout(60)
def test_a_worker_that_skips_an_all_reduce_gets_a_mismatch_error():
    messages = mirrored.testing.run_multi_process(_skips_an_all_reduce, 2, timeout=50)
    for message in messages:
        assert "workers made different calls as collective" in message
    assert "worker 0: ReplicaContext.all_reduce(SUM of float32[5]) at test_multi_worker.py:" in (
        messages[0])


def _skips_a_whole_step() -> tuple[str, float]:
    strategy = _strategy(1)
    rank = strategy.cluster_resolver.worker_index
    error = "no error"
    try:
        for i in range(3):
            def step(i=i):
                if rank == 1 and i == 0:  # e.g. "if loss is nan: skip this step"
                    return torch.zeros(3)
                return mirrored.get_replica_context().all_reduce(
                    "SUM", torch.full((3,), 10.0 * rank + i))
            strategy.run(step)
    except mirrored.CollectiveMismatchError as caught:
        error = str(caught)
    strategy.close()  # leaves the job: a new strategy starts a new one on the same port
    again = _strategy(1)
    total = again.reduce("SUM", torch.tensor(1.0)).item()
    again.close()
    return error, total


@pytest.mark.timeout(60)
def test_a_worker_that_skips_a_step_of_identical_calls_gets_a_mismatch_error():
    for message, total in mirrored.testing.run_multi_process(_skips_a_whole_step, 2, timeout=50):
        assert "workers made different calls as collective" in message
        assert total == 2.0


def _mean_against_sum(call: str) -> list[str]:
    # The same call site, a MEAN on worker 1 where worker 0 sums: a MEAN travels as a
    # SUM of the same sizes, so only the call's name can tell them apart; each case
    # runs twice (the first call of a site, then predicted ones after settled calls).
    strategy = _strategy(1)
    rank = strategy.cluster_resolver.worker_index
    op = "MEAN" if rank == 1 else "SUM"
    outcomes = []
    for settle in (0, 3):
        for _ in range(settle):
            strategy.run(lambda: mirrored.get_replica_context().all_reduce(
                "SUM", torch.ones(3)))
        try:
            if call == "all_reduce":
                strategy.run(lambda: mirrored.get_replica_context().all_reduce(
                    op, torch.ones(3)))
            elif call == "all_reduce axis":
                strategy.run(lambda: mirrored.get_replica_context().all_reduce(
                    op, torch.ones(3), axis=0))
            else:  # (a plain tensor would make no collective: a value of every replica)
                value = strategy.experimental_distribute_values_from_function(
                    lambda ctx: torch.ones(3))
                strategy.extended.reduce_to(op, value, destinations="CPU:0")
            outcomes.append("no error")
        except mirrored.CollectiveMismatchError as error:
            outcomes.append(str(error))
            strategy.close()
            strategy = _strategy(1)
    strategy.close()
    return outcomes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("call", ["all_reduce", "all_reduce axis", "reduce_to"])
def test_a_mean_on_one_worker_and_a_sum_on_another_is_a_mismatch(call):
    for outcomes in mirrored.testing.run_multi_process(_mean_against_sum, 2, args=(call,),
                                                       timeout=100):
        for message in outcomes:
            assert "workers made different calls as collective" in message, message
            assert "MEAN" in message


def _never_joins() -> str:
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=1.5), devices=["CPU:0"])
    rank = strategy.cluster_resolver.worker_index
    if rank == 1:
        time.sleep(6)
        strategy.close()
        return "slept"
    start = time.monotonic()
    try:
        strategy.reduce("SUM", torch.tensor(1.0))
    except mirrored.CollectiveTimeoutError as error:
        return f"{time.monotonic() - start:.1f} {error}"
    return "no error"


@pytest.mark.timeout(60)
def test_a_collective_that_a_peer_never_joins_times_out():
    first, second = mirrored.testing.run_multi_process(_never_joins, 2, timeout=50)
    assert second == "slept"
    seconds, message = first.split(" ", 1)
    assert 1.4 <= float(seconds) < 8.0  # generous: the 2 shared cores are loaded in CI
    # Our deadline fires (Gloo's own timeout is longer): the user's call, named.
    assert "waited 1.5 s in Strategy.reduce(SUM of float32[]) at test_multi_worker.py:" in message


def _gather_worker(local: int) -> list[list[float]]:
    strategy = _strategy(local)
    try:
        out = []
        batches = [torch.arange(8.0), torch.arange(8.0, 13.0)]  # the last one partial
        for x in strategy.experimental_distribute_dataset(batches):
            predictions = strategy.run(lambda x: x * 10, args=(x,))
            assert (type(predictions) is torch.Tensor) is (local == 1)
            out.append(strategy.gather(predictions, axis=0).tolist())
            nest = strategy.gather({"p": predictions, "w": torch.tensor(
                [float(strategy.cluster_resolver.worker_index)]), "split": "eval"}, axis=-1)
            assert nest["split"] == "eval"  # (as is)
            out.append(nest["p"].tolist() + nest["w"].tolist())
            # A number or a scalar run returned is one per replica: refused as in one
            # process (on workers of one replica it returned each worker's own).
            for scalar in strategy.run(lambda x: (x.sum().item(), x.sum()), args=(x,)):
                with pytest.raises(ValueError, match="rank-0"):
                    strategy.gather(scalar, axis=0)
        return out
    finally:
        strategy.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local", [1, 2])
def test_gather_of_a_run_result_has_every_workers_rows(local: int) -> None:
    # On a worker of one replica run returns a plain tensor; gather returned it as is
    # (this worker's rows alone) where reduce combined it across workers.
    results = mirrored.testing.run_multi_process(_gather_worker, 2, args=(local,), timeout=100)
    full = [[10.0 * i for i in range(8)], [10.0 * i for i in range(8, 13)]]
    for out in results:
        assert out == [full[0], full[0] + [0.0, 1.0], full[1], full[1] + [0.0, 1.0]]


def _counts_worker() -> list[int]:
    strategy = _strategy(2)
    try:
        y = torch.arange(8)
        batches = [(torch.tensor([0, 9, 2, 9, 4, 9, 6, 9]), y),  # 1 right in each chunk
                   (torch.tensor([0, 1, 9, 9, 4, 5, 9, 9]), y)]  # 2, 0, 2, 0 right
        correct = seen = 0
        for p, t in strategy.experimental_distribute_dataset(batches):
            per_replica = strategy.run(lambda p, t: ((p == t).sum().item(), len(t)),
                                       args=(p, t))
            right, size = (int(strategy.reduce("SUM", v, axis=None)) for v in per_replica)
            correct, seen = correct + right, seen + size
        return [correct, seen]
    finally:
        strategy.close()


@pytest.mark.timeout(120)
def test_equal_counts_returned_by_run_count_once_per_replica_across_workers() -> None:
    # Equal Python ints from the replicas of a worker are one object, which came back
    # as a plain value and was summed once per worker: 6 and 8 where one device has 8, 16.
    for out in mirrored.testing.run_multi_process(_counts_worker, 2, timeout=100):
        assert out == [8, 16]
