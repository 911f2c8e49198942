"""compute_average_loss: exact single-device means over uneven and empty batches."""

import math
import warnings

import pytest
import torch

import mirrored
from mirrored._src.training import overlap as overlap_module


@pytest.mark.parametrize("sizes", [[4, 4], [3, 2], [2, 2, 2, 0], [0, 5], [1]])
def test_matches_single_device_mean(strategies, sizes):
    strategy = strategies[len(sizes)]
    gen = torch.Generator().manual_seed(sum(sizes))
    batch = torch.randn(sum(sizes), generator=gen)
    chunks = list(torch.split(batch, sizes))
    per_replica = mirrored.PerReplica(chunks) if len(sizes) > 1 else chunks[0]
    losses = strategy.run(mirrored.compute_average_loss, args=(per_replica,))
    total = strategy.reduce("SUM", losses) if len(sizes) > 1 else losses
    torch.testing.assert_close(total, batch.mean())


def test_given_global_batch_size(two):
    v = mirrored.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    out = two.run(lambda x: mirrored.compute_average_loss(x, global_batch_size=4), args=(v,))
    assert [t.item() for t in out.values] == [0.75, 0.75]


def test_gradients_match_single_device(two):
    w = torch.tensor(2.0)
    data = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])]

    def step(x):
        weight = w.clone().requires_grad_(True)
        loss = mirrored.compute_average_loss((weight * x) ** 2)
        loss.backward()
        return weight.grad

    grads = two.run(step, args=(mirrored.PerReplica(data),))
    weight = w.clone().requires_grad_(True)
    ((weight * torch.cat(data)) ** 2).mean().backward()
    torch.testing.assert_close(sum(grads.values), weight.grad)


def test_all_empty_is_nan(two):
    v = mirrored.PerReplica([torch.zeros(0), torch.zeros(0)])
    out = two.run(mirrored.compute_average_loss, args=(v,))
    assert all(math.isnan(t.item()) for t in out.values)


def test_errors(two):
    with pytest.raises(ValueError, match=r"expects per-example losses with a batch dimension; "
                                         r"got a rank-0 tensor"):
        two.run(mirrored.compute_average_loss, args=(torch.tensor(1.0),))
    with pytest.raises(ValueError, match=r"global_batch_size must be a positive integer"):
        two.run(lambda: mirrored.compute_average_loss(torch.ones(2), global_batch_size=0))
    with two.scope(), pytest.raises(RuntimeError, match=r"must be called in replica context"):
        mirrored.compute_average_loss(torch.ones(2))


def test_outside_any_strategy_is_the_local_mean():
    assert mirrored.compute_average_loss(torch.tensor([1.0, 3.0])).item() == 2.0


def test_global_batch_size_accepts_integer_types(two):
    import numpy as np

    v = mirrored.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    for size in [4, np.int64(4), torch.tensor(4)]:
        out = two.run(lambda x, s=size: mirrored.compute_average_loss(x, global_batch_size=s),
                      args=(v,))
        assert [t.item() for t in out.values] == [0.75, 0.75]
    with pytest.raises(ValueError, match=r"positive integer"):
        two.run(lambda: mirrored.compute_average_loss(torch.ones(1), global_batch_size=2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_replica_divides_by_the_exact_global_count(two, dtype):
    # The count travels as plain ints; each replica's share is bitwise its local sum
    # divided by the global count as a tensor of the loss's dtype.
    gen = torch.Generator().manual_seed(7)
    chunks = [torch.randn(5, generator=gen, dtype=dtype), torch.randn(2, generator=gen,
                                                                     dtype=dtype)]
    out = two.run(mirrored.compute_average_loss, args=(mirrored.PerReplica(chunks),))
    for got, chunk in zip(out.values, chunks, strict=True):
        assert got.dtype == dtype
        assert torch.equal(got, chunk.sum() / torch.tensor(7, dtype=dtype))



def test_half_precision_divides_by_the_exact_count(two):
    # 1001 examples: bfloat16 cannot hold the count (it rounds to 1000); the divisor
    # stays the exact int (the loss keeps its dtype; the quotient is rounded once).
    gen = torch.Generator().manual_seed(3)
    chunks = [torch.rand(501, generator=gen).to(torch.bfloat16),
              torch.rand(500, generator=gen).to(torch.bfloat16)]
    out = two.run(mirrored.compute_average_loss, args=(mirrored.PerReplica(chunks),))
    for got, chunk in zip(out.values, chunks, strict=True):
        assert got.dtype == torch.bfloat16
        # the quotient computed in float32 (bfloat16's op math) by 1001, then rounded
        assert torch.equal(got, (chunk.sum().float() / 1001).to(torch.bfloat16))


# ------------------------------------------- global_batch_size must agree across replicas


def _linear_training(strategy, sizes_per_step, global_size, *, overlap=False,
                     skip_empty=False, batches=None, models=None):
    """Trains a mirrored Linear(3, 2) with SGD on per-replica batches of the given sizes
    (one list per step); ``global_size(x, ctx)`` is what the user passes as
    ``global_batch_size``. Returns the mirrored model (also appended to ``models``);
    ``batches`` collects each step's global batch."""
    torch.manual_seed(0)
    model = strategy.mirror(torch.nn.Linear(3, 2))
    if models is not None:
        models.append(model)
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.5),
                                    overlap=overlap)
    assert (opt._reducer.buckets is not None) is overlap  # (weight and bias: two buckets)
    gen = torch.Generator().manual_seed(1)

    def step(x):
        ctx = mirrored.get_replica_context()
        if skip_empty and len(x) == 0:  # "no loss on an empty batch"
            loss = (model(x).sum() * 0)
        else:
            per_example = model(x).pow(2).sum(1)
            loss = mirrored.compute_average_loss(per_example,
                                                 global_batch_size=global_size(x, ctx))
        loss.backward()
        opt.step()
        opt.zero_grad()

    batches = [] if batches is None else batches
    for sizes in sizes_per_step:
        batch = torch.randn(sum(sizes), 3, generator=gen)
        batches.append(batch)
        strategy.run(step, args=(mirrored.PerReplica(list(torch.split(batch, sizes))),))
    return model


def _weights(model):
    return [t.detach().clone() for t in model.replicas[0].parameters()]


def _one_device(batches, divisors):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for batch, divisor in zip(batches, divisors, strict=True):
        (model(batch).pow(2).sum() / divisor).backward()
        opt.step()
        opt.zero_grad()
    return [t.detach().clone() for t in model.parameters()]


@pytest.mark.parametrize("overlap", [False, True])
def test_different_global_batch_sizes_on_replicas_raise_before_the_step(two, overlap,
                                                                        monkeypatch):
    monkeypatch.setattr(overlap_module, "DEFAULT_BUCKET_BYTES", 4)
    made = []
    # TF's per-replica formula on an uneven last batch: replica 0 says 6, replica 1 says 2.
    per_replica = lambda x, ctx: len(x) * ctx.num_replicas_in_sync  # noqa: E731
    batches = []
    with pytest.raises(ValueError, match=r"replica 0: 6, replica 1: 2") as error:
        _linear_training(two, [[2, 2], [3, 1]], per_replica, overlap=overlap,
                         batches=batches, models=made)
    assert "global_batch_size=None" in str(error.value)
    # The full step before it trained as one device; the bad step was not applied.
    expected = _one_device(batches[:1], [4])
    for copy in made[0].replicas:
        for got, want in zip(copy.parameters(), expected, strict=True):
            torch.testing.assert_close(got.detach(), want)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("n", [2, 3])
def test_a_per_replica_size_on_every_replica_raises_before_the_step(strategies, n, overlap,
                                                                    monkeypatch):
    # global_batch_size=len(x) on an even batch: every replica gives the same value, so
    # they agree, and the gradient was N times one device's, silently.
    monkeypatch.setattr(overlap_module, "DEFAULT_BUCKET_BYTES", 4)
    made, batches = [], []
    with pytest.raises(ValueError, match=rf"every replica gave compute_average_loss\("
                                         rf"per_example_loss, global_batch_size=2\) the number "
                                         rf"of rows of its own.*{n} times the mean.*no replica "
                                         r"applied the step"):
        _linear_training(strategies[n], [[2] * n, [2] * n], lambda x, ctx: len(x),
                         overlap=overlap, batches=batches, models=made)
    assert len(batches) == 1  # (the first step raised, and no copy moved)
    torch.manual_seed(0)
    initial = list(torch.nn.Linear(3, 2).parameters())
    for copy in made[0].replicas:
        for got, want in zip(copy.parameters(), initial, strict=True):
            torch.testing.assert_close(got.detach(), want.detach())


@pytest.mark.parametrize(("sizes", "skip_empty"), [
    ([[4, 0]], False),  # one replica holds the whole batch: its rows are the global count
    ([[4, 0]], True),  # ... and the other skips its loss
    ([[2, 2], [3, 1], [1, 3]], False),  # the global size, which no replica's rows equal
])
def test_a_size_equal_to_some_replicas_rows_is_not_refused(two, sizes, skip_empty):
    batches = []
    model = _linear_training(two, sizes, lambda x, ctx: 4, skip_empty=skip_empty,
                             batches=batches)
    for got, expected in zip(_weights(model), _one_device(batches, [4] * len(sizes)),
                             strict=True):
        torch.testing.assert_close(got, expected)


def test_the_same_global_batch_size_everywhere_trains_as_one_device(two):
    batches = []
    model = _linear_training(two, [[2, 2], [3, 1], [0, 2]], lambda x, ctx: 4,
                             batches=batches)
    for got, expected in zip(_weights(model), _one_device(batches, [4, 4, 4]), strict=True):
        torch.testing.assert_close(got, expected)


def test_a_replica_without_a_loss_on_its_empty_batch_is_not_a_mismatch(two):
    batches = []
    model = _linear_training(two, [[2, 2], [2, 0]], lambda x, ctx: 4, skip_empty=True,
                             batches=batches)
    for got, expected in zip(_weights(model), _one_device(batches, [4, 4]), strict=True):
        torch.testing.assert_close(got, expected)


def test_an_evaluation_run_with_different_sizes_does_not_blame_the_next_step(two):
    model = two.mirror(torch.nn.Linear(3, 2))
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.5))
    x = mirrored.PerReplica([torch.ones(3, 3), torch.ones(1, 3)])

    def evaluate(x):  # no optimizer step: nothing is all-reduced
        with torch.no_grad():
            return mirrored.compute_average_loss(model(x).sum(1), global_batch_size=len(x) * 2)

    def train(x):
        mirrored.compute_average_loss(model(x).sum(1), global_batch_size=4).backward()
        opt.step()
        opt.zero_grad()

    two.run(evaluate, args=(x,))
    two.run(train, args=(x,))  # no error: the evaluation's sizes were never used


def test_a_replica_that_skipped_its_loss_raises_with_the_others(strategies):
    # The uneven last batch leaves replica 2 empty; it skips its loss, the others pass
    # len(x) * 3 (9 and 6): every replica raises and no copy steps.
    three = strategies[3]
    made, batches = [], []
    with pytest.raises(ValueError, match=r"replica 0: 9, replica 1: 6, replica 2: none"):
        _linear_training(three, [[2, 2, 2], [3, 2, 0]],
                         lambda x, ctx: len(x) * ctx.num_replicas_in_sync, skip_empty=True,
                         batches=batches, models=made)
    expected = _one_device(batches[:1], [6])
    for copy in made[0].replicas:
        for got, want in zip(copy.parameters(), expected, strict=True):
            torch.testing.assert_close(got.detach(), want)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_replica_that_never_passed_a_size_raises_with_the_others(strategies, overlap,
                                                                   monkeypatch):
    # In the first step replica 2 is empty and skips its loss (it never passed a
    # size); replicas 0 and 1 pass 9 and 6. It must not step while they raise.
    monkeypatch.setattr(overlap_module, "DEFAULT_BUCKET_BYTES", 4)
    three = strategies[3]
    made = []
    with pytest.raises(ValueError, match=r"replica 0: 9, replica 1: 6, replica 2: none"):
        _linear_training(three, [[3, 2, 0]], lambda x, ctx: len(x) * ctx.num_replicas_in_sync,
                         skip_empty=True, models=made, overlap=overlap)
    torch.manual_seed(0)
    initial = list(torch.nn.Linear(3, 2).parameters())
    for copy in made[0].replicas:
        for got, want in zip(copy.parameters(), initial, strict=True):
            torch.testing.assert_close(got.detach(), want.detach())


def test_a_second_loss_on_some_replicas_only_with_the_same_size_is_not_a_mismatch(two):
    # An auxiliary loss that only some replicas compute (data-dependent), divided by
    # the same global size: the largest value each replica passed is compared.
    model = two.mirror(torch.nn.Linear(3, 2))
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.5))
    x = mirrored.PerReplica([torch.ones(2, 3), -torch.ones(2, 3)])

    def train(x):
        out = model(x)
        loss = mirrored.compute_average_loss(out.pow(2).sum(1), global_batch_size=4)
        if bool((x > 0).any()):
            loss = loss + mirrored.compute_average_loss(out.sum(1), global_batch_size=4)
        loss.backward()
        opt.step()
        opt.zero_grad()

    two.run(train, args=(x,))
    first, second = (list(c.parameters()) for c in model.replicas)
    for a, b in zip(first, second, strict=True):
        torch.testing.assert_close(a, b)


# ------------------------------------- no compute_average_loss before a step: a warning


def _step_with(strategy, loss_of, check="cheap"):
    model = strategy.mirror(torch.nn.Linear(3, 1))
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1), check=check)
    x = mirrored.PerReplica([torch.ones(2, 3), torch.zeros(0, 3)])

    def step(x):
        loss_of(model(x).squeeze(1)).backward()
        opt.step()
        opt.zero_grad()

    strategy.run(step, args=(x,))


def test_a_per_replica_mean_loss_warns_that_the_gradients_are_summed(two):
    with pytest.warns(mirrored.LossScalingWarning, match=r"on 2 replicas: no replica called "
                      r"compute_average_loss.*trains with 2 times the gradients"):
        _step_with(two, lambda out: out.pow(2).mean() if len(out) else out.sum())


@pytest.mark.parametrize("case", ["compute_average_loss", "only replica 0", "check off"])
def test_no_warning_when_a_replica_called_compute_average_loss_or_checks_are_off(two, case):
    def loss_of(out):
        if case == "check off":
            return out.sum()
        if case == "only replica 0":  # the empty replica skips its loss (a size given:
            if len(out) == 0:         # counting would be a collective it skips)
                return out.sum()
            return mirrored.compute_average_loss(out.pow(2), global_batch_size=2)
        return mirrored.compute_average_loss(out.pow(2))

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step_with(two, loss_of, check="off" if case == "check off" else "cheap")


@pytest.mark.parametrize("before", ["an evaluation", "another optimizer's training"])
def test_earlier_compute_average_loss_calls_do_not_hide_a_mean_loss(two, before):
    # The warning asks whether a replica called compute_average_loss for the gradients
    # stepped: an evaluation's loss (no gradient), or calls made before this optimizer
    # existed, are not that.
    x = mirrored.PerReplica([torch.ones(2, 3), torch.zeros(0, 3)])
    if before == "an evaluation":
        model = two.mirror(torch.nn.Linear(3, 1))

        def evaluate(x):
            with torch.no_grad():
                return mirrored.compute_average_loss(model(x).squeeze(1).pow(2))
        two.run(evaluate, args=(x,))
    else:
        _step_with(two, lambda out: mirrored.compute_average_loss(out.pow(2)))
    with pytest.warns(mirrored.LossScalingWarning, match="no replica called"):
        _step_with(two, lambda out: out.pow(2).mean() if len(out) else out.sum())


def test_two_optimizers_stepping_after_one_loss_do_not_warn(two):
    model = two.mirror(torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)))
    first = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p[:2], lr=0.1))
    second = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p[2:], lr=0.1))
    x = mirrored.PerReplica([torch.ones(2, 3), torch.ones(1, 3)])

    def step(x):
        mirrored.compute_average_loss(model(x).squeeze(1).pow(2)).backward()
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        two.run(step, args=(x,))


def test_the_warning_names_the_users_line_once_per_step():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _step_with(strategy, lambda out: out.pow(2).mean() if len(out) else out.sum())
    finally:
        strategy.close()
    ours = [w for w in caught if issubclass(w.category, mirrored.LossScalingWarning)]
    assert len(ours) == 1, ours  # one replica warns, not each
    assert ours[0].filename.endswith("test_loss.py"), ours[0].filename


@pytest.mark.parametrize("replicas", [2, 3])
def test_a_penalty_scaled_by_scale_regularization_loss_trains_as_one_device(replicas):
    # A term that is not per example (an L2 penalty) is added by every replica and the
    # gradients are summed: scaled by 1/N it counts once, as on one device.
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 1).double()
    x = torch.randn(10, 3, dtype=torch.float64)
    y = torch.randn(10, dtype=torch.float64)
    reference = torch.nn.Linear(3, 1).double()
    reference.load_state_dict(net.state_dict())
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    try:
        model = strategy.mirror(net)
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

        def step(x, y):
            loss = mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2)
            loss = loss + mirrored.scale_regularization_loss(
                [0.01 * model.weight.pow(2).sum(), 0.02 * model.bias.pow(2).sum()])
            loss.backward()
            opt.step()
            opt.zero_grad()

        for _ in range(3):
            strategy.run(step, args=next(iter(strategy.experimental_distribute_dataset(
                [(x, y)]))))
            ref_opt.zero_grad()
            (((reference(x).squeeze(1) - y) ** 2).mean() + 0.01 * reference.weight.pow(2).sum()
             + 0.02 * reference.bias.pow(2).sum()).backward()
            ref_opt.step()
        for p, q in zip(model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12)
    finally:
        strategy.close()
    cross = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        with cross.scope(), pytest.raises(RuntimeError, match="in replica context"):
            mirrored.scale_regularization_loss(torch.ones(()))
    finally:
        cross.close()


@pytest.mark.timeout(30)
def test_a_second_order_gradient_through_a_collective_is_refused_not_a_hang():
    # create_graph=True through all_reduce: its gradient, a collective too, would link
    # every replica's graph to the others' (the second backward hung or crashed).
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        def step():
            w = torch.tensor([2.0, 3.0], requires_grad=True)
            total = mirrored.get_replica_context().all_reduce("SUM", w)
            (g,) = torch.autograd.grad(total.pow(3).sum(), w, create_graph=True)
            g.sum().backward()  # (the penalty's backward: through the collective again)
            return w.grad

        with pytest.raises(RuntimeError, match="create_graph=True"):
            strategy.run(step)
    finally:
        strategy.close()
