"""`compute_average_loss` across workers takes the step's example count from the
batches of ``experimental_distribute_dataset`` (every worker splits the same global
batch, so each knows its rows): no collective where every replica's per-example loss
has its batch's rows, the count collective where none has, an error (never a wrong
divisor, never a hang) where some have and some have not. Every training case is
compared with one device training on the same global batches, in float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mirrored
from mirrored._src.collectives import all_reduce
from mirrored._src.data.split import chunk_bounds
from mirrored._src.data.steps import sample_digest
from mirrored.experimental import CommunicationOptions

pytestmark = pytest.mark.multiprocess

SIZES = (8, 8, 5)  # the global batches' rows: the last is partial (3 + 2 on 2 replicas)


def model_fn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def global_batch(step: int, size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + step)
    rows = SIZES[step] if size is None else size
    return (torch.randn(rows, 4, generator=g, dtype=torch.float64),
            torch.randint(0, 3, (rows,), generator=g))


def reference(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One device: the mean loss of each global batch, SGD with momentum."""
    model = model_fn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _train(local: int, source: str, loss_kind: str = "rows", checked: bool = True) -> dict:
    """The README's loop on this worker; returns its parameters, how many count
    collectives ``compute_average_loss`` made, and the error it raised (if any)."""
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=20),
        devices=[f"CPU:{i}" for i in range(local)], check_collectives=checked)
    worker = strategy.cluster_resolver.worker_index
    counted = [0]
    original = all_reduce.sum_examples

    def counting(*args, **kwargs):
        counted[0] += 1
        return original(*args, **kwargs)

    all_reduce.sum_examples = counting
    model = strategy.mirror(model_fn())
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = nn.functional.cross_entropy(model(x), y, reduction="none")
        if loss_kind == "tokens":  # two rows per example (every replica: the count is taken)
            loss = torch.cat([loss, loss])
        else:  # "mixed": one worker's loss drops a row; "mixed locally": each worker's
            # last replica's does
            replica = mirrored.get_replica_context().replica_id_in_sync_group
            if (loss_kind, worker) == ("mixed", 1) or (
                    loss_kind == "mixed locally" and replica % local == local - 1):
                loss = loss[1:]
        mirrored.compute_average_loss(loss).backward()
        opt.step()
        opt.zero_grad()

    batches = [global_batch(step) for step in range(len(SIZES))]
    if source == "short":  # worker 1's source ends a batch early: it steps on empty batches
        batches = batches[:-1] if worker == 1 else batches
    elif source == "other sizes":  # worker 1's last batch has other rows than worker 0's
        batches = [*batches[:-1], global_batch(2, 7)] if worker == 1 else batches
    elif source == "shuffled" and worker == 1:  # the same sizes, rows in another order
        batches = [(x.flip(0), y.flip(0)) for x, y in batches]
    elif source == "augmented" and worker == 1:  # the same examples, other input values
        batches = [(x + 0.01, y) for x, y in batches]
    elif source.startswith("masked") and worker == 1:  # integer tensors randomized per worker
        batches = [(x, (y + 1) % 3) for x, y in batches]
    options = mirrored.InputOptions(experimental_compare_batches=source != "masked, allowed")
    data = batches if source in ("list", "other sizes") else (b for b in batches)
    error = ""
    try:
        for x, y in strategy.experimental_distribute_dataset(data, options):
            strategy.run(step_fn, args=(x, y))
    except Exception as caught:  # (reported to the test)
        error = f"{type(caught).__name__}: {caught}"
    finally:
        all_reduce.sum_examples = original
        state = {k: v.tolist() for k, v in model.replicas[0].state_dict().items()}
        strategy.close()
    return {"state": state, "counted": counted[0], "error": error}


def _assert_close(actual: dict[str, list], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(torch.tensor(actual[key], dtype=value.dtype), value,
                                   rtol=0, atol=1e-12, msg=key)


def _assert_trained(results: list[dict], counted: int) -> None:
    """Every worker trained as one device on the global batches, without an error,
    with ``counted`` count collectives."""
    expected = reference([global_batch(step) for step in range(len(SIZES))])
    for result in results:
        assert (result["error"], result["counted"]) == ("", counted)
        _assert_close(result["state"], expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local", [1, 2])
@pytest.mark.parametrize("source", ["list", "generator"])
def test_the_readme_loop_takes_the_count_from_the_batches(local, source):
    # A list has a len() (the workers agree on their steps once), a generator has none
    # (they vote at each step, and the vote tells whether every worker has a batch).
    # A step where some replica gets no rows counts (an empty loss matches any kind of
    # loss): the last batch of 5 rows on 4 replicas (2 + 2 + 1 + 0); on 2 (3 + 2) not.
    results = mirrored.testing.run_multi_process(_train, 2, args=(local, source), timeout=110)
    _assert_trained(results, 0 if local == 1 else local)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local", [1, 2])
def test_losses_with_other_rows_than_their_batch_are_counted_exactly(local):
    # Every replica's loss has two rows per example: each counts, as without a dataset,
    # and the mean over the rows is the mean over the examples. (With 2 local replicas
    # the last batch leaves one replica without rows, whose empty loss would match its
    # batch: that step carries no count.)
    results = mirrored.testing.run_multi_process(_train, 2, args=(local, "list", "tokens"),
                                                 timeout=110)
    _assert_trained(results, len(SIZES) * local)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local", [1, 2])
def test_some_replicas_counting_raise_instead_of_dividing_wrong(local):
    # Worker 1's losses drop a row: its replicas count with a collective that worker
    # 0's never make (theirs took the count from the batches). Both raise at once, and
    # no step is applied.
    results = mirrored.testing.run_multi_process(_train, 2, args=(local, "list", "mixed"),
                                                 timeout=110)
    before = {k: v.tolist() for k, v in model_fn().state_dict().items()}
    for result in results:
        assert result["error"].startswith("CollectiveMismatchError"), result["error"]
        assert "pass global_batch_size" in result["error"]
        assert "batches taken" not in result["error"]  # (the same on every worker)
        assert result["state"] == before
    # One explanation each: the hint for the workers that did not count, the rows for
    # the one that did.
    assert "where the others took the count from their batches" in results[0]["error"]
    assert "where the others took the count" not in results[1]["error"]
    rows = 4 // local  # (worker 1's replicas: rows 4-7 of the first batch)
    assert (f"this replica's per-example loss has {rows - 1} rows, its batch from "
            f"experimental_distribute_dataset {rows}") in results[1]["error"]
    assert results[1]["counted"] == local


@pytest.mark.timeout(120)
def test_a_worker_on_empty_batches_makes_every_worker_count():
    # Worker 1's source is a batch short: at the last step it has an empty batch, whose
    # count is unknown to worker 0, so both count (the vote says not every worker has
    # data). One device trains on what the replicas got: worker 0's rows of that batch.
    results = mirrored.testing.run_multi_process(_train, 2, args=(1, "short"), timeout=110)
    last_x, last_y = global_batch(2)
    start, stop = chunk_bounds(len(last_x), 2, 0)
    expected = reference([global_batch(0), global_batch(1),
                          (last_x[start:stop], last_y[start:stop])])
    for result in results:
        assert result["error"] == ""
        assert result["counted"] == 1
        _assert_close(result["state"], expected)


@pytest.mark.timeout(120)
def test_workers_whose_batches_differ_raise_before_the_step():
    # Each worker takes the count from its own source's batch: 5 rows on worker 0, 7 on
    # worker 1 at the last step. The counts taken ride in every call's identity, so the
    # step's gradient all-reduce refuses, no data of it used.
    results = mirrored.testing.run_multi_process(_train, 2, args=(1, "other sizes"),
                                                 timeout=110)
    expected = reference([global_batch(0), global_batch(1)])
    for result in results:
        assert result["error"].startswith("CollectiveMismatchError"), result["error"]
        assert ("MirroredOptimizer.step(the optimizer of mirrored model #1: SUM of"
                in result["error"])
        assert "batches of experimental_distribute_dataset of different sizes" in result["error"]
        assert result["counted"] == 0
        _assert_close(result["state"], expected)  # the last step was not applied


@pytest.mark.timeout(120)
def test_replicas_of_one_worker_counting_alone_raise_naming_the_rows():
    # Replica 1 of each worker drops a row, replica 0 does not: the worker's replicas
    # make different calls, caught at their rendezvous, and the message says why.
    results = mirrored.testing.run_multi_process(_train, 2, args=(2, "list", "mixed locally"),
                                                 timeout=110)
    before = {k: v.tolist() for k, v in model_fn().state_dict().items()}
    for result in results:
        assert result["error"], result
        assert result["state"] == before
    assert any("per-example loss has 1 rows, its batch from experimental_distribute_dataset 2"
               in result["error"] for result in results), [r["error"] for r in results]


@pytest.mark.timeout(120)
def test_unchecked_collectives_always_count():
    # check_collectives=False could not catch a replica counting alone: no batch carries
    # its count, and training is exact.
    results = mirrored.testing.run_multi_process(_train, 2, args=(1, "list", "rows", False),
                                                 timeout=110)
    _assert_trained(results, len(SIZES))


def _evaluate(kind: str) -> dict:
    """Evaluation (no optimizer): each step's average loss, summed over the replicas."""
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=20), devices=["CPU:0"])
    worker = strategy.cluster_resolver.worker_index

    def loss_of(x: torch.Tensor) -> torch.Tensor:
        if worker == 0 and len(x) == 2:  # an extra loss on one worker only: no collective
            mirrored.compute_average_loss(x.sum(dim=1))
        return mirrored.compute_average_loss(x.sum(dim=1))

    # The last batch has 1 row: worker 1's replica gets none, so that step carries no
    # count and both replicas count (worker 1's empty loss adds 0 to the sum).
    batches = [torch.ones(4, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)]
    if kind == "other sizes" and worker == 1:  # worker 1's first batch has 6 rows
        batches[0] = torch.ones(6, 2, dtype=torch.float64)
    sums, error = [], ""
    try:
        for x in strategy.experimental_distribute_dataset(batches):
            sums.append(strategy.reduce("SUM", strategy.run(loss_of, args=(x,))).item())
        # A run whose tensors do not come from the dataset counts its examples: the extra
        # call on worker 0 in an earlier run does not shift the calls' numbers.
        sums.append(strategy.reduce("SUM", strategy.run(
            lambda: mirrored.compute_average_loss(torch.ones(2 + worker)))).item())
    except Exception as caught:  # (reported to the test)
        error = f"{type(caught).__name__}: {caught}"
    finally:
        strategy.close()
    return {"sums": sums, "error": error}


@pytest.mark.timeout(120)
def test_evaluation_takes_the_counts_and_an_extra_loss_does_not_shift_later_counts():
    for result in mirrored.testing.run_multi_process(_evaluate, 2, args=("same",), timeout=110):
        assert result == {"sums": [2.0, 2.0, 1.0], "error": ""}


@pytest.mark.timeout(120)
def test_evaluation_on_batches_of_different_sizes_raises_at_the_next_collective():
    # Worker 0 divides its first step's losses by 4, worker 1 by 6 (their own batches'
    # rows): no optimizer compares them, but the reduce that combines them refuses.
    results = mirrored.testing.run_multi_process(_evaluate, 2, args=("other sizes",),
                                                 timeout=110)
    for result in results:
        assert result["sums"] == [], result
        assert result["error"].startswith("CollectiveMismatchError"), result["error"]
        assert "batches of experimental_distribute_dataset of different sizes" in result["error"]


def test_one_process_counts_after_a_replica_skipped_its_loss():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])

    def first(x: torch.Tensor) -> torch.Tensor:
        if len(x) == 0:
            return torch.zeros(())
        return mirrored.compute_average_loss(x, global_batch_size=3)

    strategy.run(first, args=(mirrored.PerReplica([torch.ones(3), torch.ones(0)]),))
    result = strategy.run(lambda: mirrored.compute_average_loss(torch.ones(1)))
    assert [t.item() for t in strategy.experimental_local_results(result)] == [0.5, 0.5]


def _passes(passes: int, reduces: bool) -> dict:
    """The README's loop over ``passes`` passes of the global batches (a new distributed
    dataset each, as the examples reshuffle them); with ``reduces``, each step's loss
    reduced after its run and a metric at each pass's end (the digits example's loop).
    Per pass: the data collectives launched, those the calls made carry, the header
    rounds."""
    from mirrored._src.comm import cross_call

    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=20), devices=["CPU:0"])
    counts = {"data": 0, "calls' data": 0, "header": 0}
    calls = cross_call.CrossWorkerCalls
    originals = calls._launch, calls._gather_rows, calls.call, calls.launch

    def launching(self, wire, data, fill=None, sources=()):
        counts["data"] += len(data)
        return originals[0](self, wire, data, fill, sources)

    def gathering(self, *args):
        counts["header"] += 1
        return originals[1](self, *args)

    def calling(self, what, wire, data, **kwargs):
        counts["calls' data"] += len(data)
        return originals[2](self, what, wire, data, **kwargs)

    def launching_later(self, what, wire, data):
        counts["calls' data"] += len(data)
        return originals[3](self, what, wire, data)

    calls._launch, calls._gather_rows, calls.call, calls.launch = (
        launching, gathering, calling, launching_later)
    try:
        model = strategy.mirror(model_fn())
        opt = strategy.mirror_optimizer(model,
                                        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))

        def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = nn.functional.cross_entropy(model(x), y, reduction="none")
            mirrored.compute_average_loss(loss).backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()

        per_pass, losses = [], []
        for _ in range(passes):
            before = dict(counts)
            source = [global_batch(step) for step in range(len(SIZES))]
            for x, y in strategy.experimental_distribute_dataset(source):
                loss = strategy.run(step_fn, args=(x, y))
                if reduces:
                    losses.append(strategy.reduce("MEAN", loss, axis=0).item())
            if reduces:
                losses.append(strategy.reduce("SUM", torch.tensor(float(len(losses)))).item())
            per_pass.append({k: counts[k] - before[k] for k in counts})
        state = {k: v.tolist() for k, v in model.replicas[0].state_dict().items()}
    finally:
        calls._launch, calls._gather_rows, calls.call, calls.launch = originals
        strategy.close()
    return {"state": state, "per_pass": per_pass, "losses": losses}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reduces", [False, True])
def test_passes_after_the_first_send_no_zeros_and_one_header_round_at_each_start(reduces):
    # From a pass's last step until the next pass starts, the workers' calls predict no
    # successor (what follows a pass is not the loop's next call): the next pass's
    # agreement on its steps is one header round, never a transfer of zeros the size of
    # the predicted call (the gradients) first; and the loop keeps its predictions
    # across the pass's end, so its steps are one round each.
    results = mirrored.testing.run_multi_process(_passes, 2, args=(3, reduces), timeout=110)
    expected = reference([global_batch(step) for step in range(len(SIZES))] * 3)
    for result in results:
        _assert_close(result["state"], expected)
        for counts in result["per_pass"]:
            assert counts["data"] == counts["calls' data"], result  # no zeros sent
        # header rounds: the agreement's; with reduces also, in two steps each, the
        # last step's loss and the metric (made after the pass's last run: nothing
        # predicted them; a MEAN's element counts ride in its sum's call)
        header = 1 + (2 if reduces else 0)
        assert [c["header"] for c in result["per_pass"][1:]] == [header] * 2, result
    assert results[0]["losses"] == results[1]["losses"]


@pytest.mark.timeout(120)
def test_workers_whose_batches_differ_in_content_raise_before_the_step():
    # Worker 1's source yields the same global batches in another row order (a shuffle
    # seeded differently): each worker would keep its rows of a different batch. A
    # sample of each global batch's elements rides in every later call's identity.
    results = mirrored.testing.run_multi_process(_train, 2, args=(1, "shuffled"), timeout=110)
    torch.manual_seed(0)
    expected = model_fn().state_dict()  # no step applied
    for result in results:
        assert result["error"].startswith("CollectiveMismatchError"), result["error"]
        assert "or contents (a sample of their integer tensors differs)" in result["error"]
        assert "shuffled with another seed on each worker" in result["error"]
        _assert_close(result["state"], expected)


@pytest.mark.timeout(120)
def test_inputs_augmented_differently_on_each_worker_are_no_mismatch():
    # Floating inputs (a random augmentation per worker) are not sampled: the labels are.
    for result in mirrored.testing.run_multi_process(_train, 2, args=(1, "augmented"),
                                                     timeout=110):
        assert result["error"] == "", result["error"]


@pytest.mark.timeout(120)
def test_integer_tensors_randomized_per_worker_raise_unless_allowed():
    # Worker 1's labels differ (as a per-worker random masking of token ids would):
    # refused by default, trained with InputOptions(experimental_compare_batches=False).
    refused = mirrored.testing.run_multi_process(_train, 2, args=(1, "masked"), timeout=110)
    assert all("experimental_compare_batches=False" in r["error"] for r in refused), refused
    allowed = mirrored.testing.run_multi_process(_train, 2, args=(1, "masked, allowed"),
                                                 timeout=110)
    assert [r["error"] for r in allowed] == ["", ""]


def test_the_digest_samples_off_the_row_grid_and_skips_uint8_and_bool():
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 1000, (16, 512), generator=g)  # every 512th: each row's first
    assert sample_digest([tokens]) != sample_digest([tokens[torch.randperm(16, generator=g)]])
    a, b = (torch.randint(0, 1000, (32, 512), generator=g) for _ in range(2))
    assert sample_digest([a]) != sample_digest([b])
    t = torch.randint(0, 9, (8, 8), generator=g).t()  # (a strided view: not copied)
    assert sample_digest([t]) == sample_digest([t.contiguous()])
    assert sample_digest([t]) != sample_digest([t.flip(0)])
    assert sample_digest([torch.tensor(3)]) != sample_digest([torch.tensor(4)])
    for dtype in (torch.uint8, torch.bool, torch.float32):  # images, masks, inputs
        assert sample_digest([torch.zeros(4, dtype=dtype)]) == sample_digest(
            [torch.ones(4, dtype=dtype)])
    assert sample_digest([torch.zeros(4)]) != sample_digest([torch.zeros(5)])  # shapes count
    with pytest.raises(TypeError, match="experimental_compare_batches must be a bool"):
        mirrored.InputOptions(experimental_compare_batches="no")
