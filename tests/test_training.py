"""Mirrored modules and optimizers: which copy code sees, BatchNorm statistics,
None gradients, state dicts interchangeable with plain torch, misuse errors."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import mirrored
from mirrored import MirroredModule


@pytest.fixture
def two() -> Iterator[mirrored.MirroredStrategy]:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    yield strategy
    strategy.close()


def linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(2, 1).double()


def sgd(params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.1)


@pytest.mark.timeout(30)
def test_copies_equal_at_creation_and_each_replica_calls_its_own(
        two: mirrored.MirroredStrategy) -> None:
    original = linear()
    model = two.mirror(original)
    assert model.replicas[0] is original
    assert model.replicas[1] is not original
    for a, b in zip(model.replicas[0].parameters(), model.replicas[1].parameters(),
                    strict=True):
        assert torch.equal(a, b) and a is not b
    with torch.no_grad():
        model.replicas[1].bias.fill_(10.0)
    x = torch.zeros(1, 2, dtype=torch.float64)
    out = two.run(lambda: model(x))
    assert out.values[1].item() == 10.0
    assert out.values[0].item() == original.bias.item()
    # Cross-replica: replica 0's copy, in or outside a scope.
    assert model(x).item() == original.bias.item()
    with two.scope():
        assert model(x).item() == original.bias.item()
        assert next(model.parameters()) is original.weight
    ids = two.run(lambda: id(next(model.parameters())))
    assert ids.values == (id(original.weight), id(model.replicas[1].weight))


@pytest.mark.timeout(30)
def test_train_and_eval_apply_to_every_copy(two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    assert model.eval() is model
    assert not model.training
    assert [c.training for c in model.replicas] == [False, False]
    model.train()
    assert [m.training for c in model.replicas for m in c.modules()] == [True] * 6


@pytest.mark.timeout(30)
def test_default_batch_norm_averages_running_stats(two: mirrored.MirroredStrategy) -> None:
    torch.manual_seed(0)
    bn = nn.BatchNorm1d(2).double()
    chunks = [torch.randn(3, 2, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)]
    expected = {}
    for k, chunk in enumerate(chunks):  # each replica normalizes by its own batch
        local = nn.BatchNorm1d(2).double()
        local(chunk)
        expected[k] = local.state_dict()
    model = two.mirror(bn)
    optimizer = two.mirror_optimizer(model, sgd)
    outputs = []

    def step(x: torch.Tensor) -> None:
        y = model(x)
        outputs.append(y.detach())
        mirrored.compute_average_loss((y ** 2).sum(1)).backward()
        optimizer.step()

    two.run(step, args=(mirrored.PerReplica(chunks),))
    for name in ("running_mean", "running_var"):
        mean = (expected[0][name] + expected[1][name]) / 2
        for replica in model.replicas:
            torch.testing.assert_close(replica.state_dict()[name], mean, rtol=0, atol=1e-15)
    assert torch.equal(model.replicas[0].running_var, model.replicas[1].running_var)
    assert int(model.state_dict()["num_batches_tracked"]) == 1
    # Each replica normalized by its own batch: its outputs have mean 0 per channel.
    for y in outputs:
        torch.testing.assert_close(y.mean(0), torch.zeros(2, dtype=torch.float64), atol=1e-12,
                                   rtol=0)


@pytest.mark.timeout(30)
def test_sync_batch_norm_gradients_equal_single_device(two: mirrored.MirroredStrategy) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 3, 2, dtype=torch.float64)
    w = torch.randn(5, 3, 2, dtype=torch.float64)
    reference = nn.BatchNorm1d(3).double()
    with torch.no_grad():
        reference.weight.uniform_()
        reference.bias.uniform_()
    model = two.mirror(nn.BatchNorm1d(3).double(), sync_batch_norm=True)
    model.load_state_dict(reference.state_dict())
    xr = x.clone().requires_grad_()
    (reference(xr) * w).sum().backward()

    def step(xi: torch.Tensor, wi: torch.Tensor) -> tuple[torch.Tensor, ...]:
        xi = xi.clone().requires_grad_()
        (model(xi) * wi).sum().backward()
        bn = model.module
        return xi.grad, bn.weight.grad, bn.bias.grad

    chunks = (mirrored.PerReplica([x[:4], x[4:]]), mirrored.PerReplica([w[:4], w[4:]]))
    dx, dweight, dbias = two.run(step, args=chunks)
    torch.testing.assert_close(torch.cat(dx.values), xr.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(dweight.values[0] + dweight.values[1], reference.weight.grad,
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(dbias.values[0] + dbias.values[1], reference.bias.grad,
                               rtol=0, atol=1e-12)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=1e-12)


@pytest.mark.timeout(30)
def test_none_gradients_count_as_zeros(two: mirrored.MirroredStrategy) -> None:
    torch.manual_seed(0)
    net = nn.ModuleDict({"a": nn.Linear(2, 1), "b": nn.Linear(2, 1), "unused": nn.Linear(2, 1)})
    net = net.double()
    reference = nn.ModuleDict({k: nn.Linear(2, 1) for k in net}).double()
    reference.load_state_dict(net.state_dict())
    chunks = [torch.randn(2, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)]
    # Replica 0 uses a and b, replica 1 only a: b's gradient is None on replica 1.
    total = (reference["a"](chunks[0]) + reference["b"](chunks[0])).sum() + reference["a"](
        chunks[1]).sum()
    (total / 5).backward()
    ref_optimizer = sgd(reference.parameters())
    ref_optimizer.step()

    model = two.mirror(net)
    optimizer = two.mirror_optimizer(model, sgd)

    def step(x: torch.Tensor) -> None:
        m = model.module
        out = m["a"](x)
        if mirrored.get_replica_context().replica_id_in_sync_group == 0:
            out = out + m["b"](x)
        mirrored.compute_average_loss(out.sum(1)).backward()
        optimizer.step()

    two.run(step, args=(mirrored.PerReplica(chunks),))
    for replica in model.replicas:
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(replica.state_dict()[name], value, rtol=0, atol=1e-15)
        assert replica["unused"].weight.grad is None  # skipped, as on one device
        assert replica["b"].weight.grad is not None


@pytest.mark.timeout(30)
def test_state_dicts_interchange_with_plain_torch(two: mirrored.MirroredStrategy) -> None:
    plain = linear()
    plain_optimizer = torch.optim.Adam(plain.parameters(), lr=0.1)
    x = torch.randn(4, 2, dtype=torch.float64)
    plain(x).sum().backward()
    plain_optimizer.step()

    model = two.mirror(nn.Linear(2, 1).double())
    optimizer = two.mirror_optimizer(model, lambda p: torch.optim.Adam(p, lr=0.1))
    model.load_state_dict(plain.state_dict())
    optimizer.load_state_dict(plain_optimizer.state_dict())
    for replica, inner in zip(model.replicas, optimizer.optimizers, strict=True):
        for name, value in plain.state_dict().items():
            assert torch.equal(replica.state_dict()[name], value)
        state = inner.state_dict()["state"]
        assert torch.equal(state[0]["exp_avg"], plain_optimizer.state_dict()["state"][0]
                           ["exp_avg"])
    # Each replica owns its optimizer state (no aliasing between replicas or with plain).
    states = [inner.state[p]["exp_avg"] for inner, p in
              zip(optimizer.optimizers, (c.weight for c in model.replicas), strict=True)]
    assert states[0].data_ptr() != states[1].data_ptr()

    def step(xi: torch.Tensor) -> None:
        mirrored.compute_average_loss(model(xi).sum(1)).backward()
        optimizer.step()

    two.run(step, args=(mirrored.PerReplica([x[:2], x[2:]]),))
    plain_optimizer.zero_grad()
    plain(x).mean(0).sum().backward()
    plain_optimizer.step()

    fresh = nn.Linear(2, 1).double()
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    fresh.load_state_dict(model.state_dict())
    fresh_optimizer.load_state_dict(optimizer.state_dict())
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[name], value, rtol=0, atol=1e-15)
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 2


@pytest.mark.timeout(30)
def test_module_refuses_threads_that_are_not_its_replicas(
        two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(linear())
    x = torch.zeros(1, 2, dtype=torch.float64)
    errors: list[BaseException] = []

    def call_from_thread() -> None:
        try:
            model(x)
        except RuntimeError as error:
            errors.append(error)

    def fn() -> None:
        thread = threading.Thread(target=call_from_thread)
        thread.start()
        thread.join()

    two.run(fn)  # each replica starts a thread that calls the model
    assert len(errors) == 2
    assert all("not a replica" in str(error) for error in errors)
    other = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        with pytest.raises(RuntimeError, match="inside the run of another strategy"):
            other.run(lambda: model(x))
        with pytest.raises(ValueError, match="mirrored by"):
            other.mirror_optimizer(model, sgd)
    finally:
        other.close()


@pytest.mark.timeout(30)
def test_misuse_errors(two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(linear())
    optimizer = two.mirror_optimizer(model, sgd)
    with pytest.raises(RuntimeError, match=r"MirroredOptimizer.step must be called inside "
                                           r"strategy.run"):
        optimizer.step()
    with two.scope(), pytest.raises(RuntimeError, match="in cross-replica context"):
        optimizer.step()
    with pytest.raises(TypeError, match=r"takes a torch\.nn\.Module; got str"):
        two.mirror("not a module")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes a MirroredModule"):
        two.mirror_optimizer(linear(), sgd)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"must return a torch\.optim\.Optimizer; got list"):
        two.mirror_optimizer(model, list)  # type: ignore[arg-type]
    stranger = linear()
    with pytest.raises(ValueError, match="parameters of another module"):
        two.mirror_optimizer(model, lambda p: sgd(stranger.parameters()))
    with pytest.raises(RuntimeError, match=r"call it outside strategy\.run"):
        two.run(lambda: model.load_state_dict(model.state_dict()))
    with pytest.raises(RuntimeError, match=r"outside strategy\.run"):
        two.run(lambda: two.mirror(linear()))
    with pytest.raises(NotImplementedError, match="create them all in make_optimizer"):
        optimizer.add_param_group({"params": []})

    def bad_clip() -> None:
        optimizer.step(clip_grad_norm=-1.0)

    with pytest.raises(ValueError, match="clip_grad_norm must be a positive"):
        two.run(bad_clip)
    assert isinstance(model, MirroredModule)
    assert "2 copies of Linear" in repr(model)


@pytest.mark.filterwarnings("ignore::mirrored.LossScalingWarning")  # (no per-example loss here)
def test_step_hooks_run_and_sparse_gradients_are_refused(two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(linear())
    optimizer = two.mirror_optimizer(model, sgd)
    calls: list[int] = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(1))

    def step() -> None:
        model(torch.ones(3, 2, dtype=torch.float64)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    two.run(step)
    assert calls == [1, 1]  # once per replica, as step itself
    embedding = two.mirror(nn.Embedding(5, 2, sparse=True))
    sparse = two.mirror_optimizer(embedding, sgd)

    def sparse_step() -> None:
        embedding(torch.tensor([1, 2])).sum().backward()
        sparse.step()

    with pytest.raises(TypeError, match=r"a parameter has a sparse gradient"):
        two.run(sparse_step)


def test_a_checkpoint_of_an_earlier_step_replaces_later_ones(tmp_path) -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0"])
    model = strategy.mirror(linear())
    manager = mirrored.CheckpointManager(strategy, tmp_path)
    for step in (100, 200):
        manager.save(step, {"model": model})
    path = manager.save(1, {"model": model})  # a new run in a reused directory
    assert path.exists() and manager.steps() == [1]
    assert manager.restore({"model": model}) == 1
