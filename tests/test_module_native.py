"""A mirrored model is a torch model: attributes and methods of the wrapped module,
``nn.Module`` members on every copy, pickle / ``torch.save`` / ``deepcopy``,
``AveragedModel`` and ``torch.compile`` before and after ``mirror``, each checked
against a one-device reference (float64)."""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from mirrored import MirroredModule

with warnings.catch_warnings():  # dynamo's first import warns about a torch.jit helper
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch._dynamo
    from torch._dynamo.utils import counters


class Net(nn.Module):
    """A small model with a method and attributes of its own, like an RNN's."""

    def __init__(self) -> None:
        super().__init__()
        self.nhid = 3
        self.fc1 = nn.Linear(4, 3)
        self.fc2 = nn.Linear(3, 2)

    def init_hidden(self, bsz: int) -> torch.Tensor:
        return self.fc1.weight.new_zeros(bsz, self.nhid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def net() -> Net:
    torch.manual_seed(0)
    return Net().double()


def replica() -> int:
    return int(mirrored.get_replica_context().replica_id_in_sync_group)


@pytest.fixture
def three() -> Iterator[mirrored.MirroredStrategy]:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    yield strategy
    strategy.close()


@pytest.mark.timeout(30)
def test_attributes_and_methods_of_the_wrapped_module(two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(net())
    assert isinstance(model, nn.Module) and isinstance(model, MirroredModule)
    # Outside run: replica 0's copy.
    assert model.nhid == 3 and model.fc1 is model.replicas[0].fc1
    assert torch.equal(model.init_hidden(4), torch.zeros(4, 3, dtype=torch.float64))
    assert model.init_hidden(4).dtype == torch.float64
    # Inside run: each replica its own copy.
    seen = two.run(lambda: (id(model.fc1.weight), model.init_hidden(replica() + 1).shape))
    assert seen[0].values == tuple(id(c.fc1.weight) for c in model.replicas)
    assert seen[1].values == ((1, 3), (2, 3))
    # Setting a plain value outside run: every copy; inside run: the replica's own.
    model.nhid = 5
    assert [c.nhid for c in model.replicas] == [5, 5]
    two.run(lambda: setattr(model, "scale", replica() + 1))
    assert [c.scale for c in model.replicas] == [1, 2]
    assert two.run(lambda: model.scale).values == (1, 2)
    del model.scale
    assert not any(hasattr(c, "scale") for c in model.replicas)
    # A tensor or a module set outside run: one copy per replica, equal, not shared.
    model.offset = torch.ones(2, dtype=torch.float64)
    assert torch.equal(model.replicas[1].offset, model.replicas[0].offset)
    assert model.replicas[1].offset is not model.replicas[0].offset
    model.fc3 = nn.Linear(2, 2)
    assert model.replicas[1].fc3.weight is not model.replicas[0].fc3.weight
    assert torch.equal(model.replicas[1].fc3.weight, model.replicas[0].fc3.weight)
    with pytest.raises(TypeError, match="tensor with a grad_fn"):
        model.offset = torch.ones(2, requires_grad=True) * 2
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        _ = model.missing
    assert "init_hidden" in dir(model)


@pytest.mark.timeout(30)
def test_parameters_are_one_models_and_members_reach_every_copy(
        three: mirrored.MirroredStrategy) -> None:
    reference = net()
    model = three.mirror(net())
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in reference.parameters()) == 23
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in
                                                        reference.named_parameters()]
    assert [n for n, _ in model.named_modules()] == ["", "fc1", "fc2"]
    assert [type(m) for m in model.modules()] == [Net, nn.Linear, nn.Linear]
    assert [n for n, _ in model.named_children()] == ["fc1", "fc2"]
    assert next(iter(model.children())) is model.replicas[0].fc1
    # Inside run, each replica iterates its own copy's parameters.
    ids = three.run(lambda: id(next(model.parameters())))
    assert ids.values == tuple(id(c.fc1.weight) for c in model.replicas)

    model.eval()
    assert not model.training and not any(m.training for c in model.replicas
                                           for m in c.modules())
    model.train()
    assert all(m.training for c in model.replicas for m in c.modules())
    model.apply(lambda m: nn.init.constant_(m.bias, 0.5) if isinstance(m, nn.Linear) else None)
    assert all(torch.equal(c.fc2.bias, torch.full((2,), 0.5, dtype=torch.float64))
               for c in model.replicas)
    model.requires_grad_(False)
    assert not any(p.requires_grad for c in model.replicas for p in c.parameters())
    model.requires_grad_(True)
    assert model.float() is model
    assert all(p.dtype == torch.float32 for c in model.replicas for p in c.parameters())
    model.to(torch.float64)
    assert all(p.dtype == torch.float64 for c in model.replicas for p in c.parameters())
    model.to("cpu").cpu()  # the copies' own device: allowed, nothing moves
    with pytest.raises(ValueError, match=r"each copy lives on its replica's device"):
        model.to("meta")
    # zero_grad: every copy outside run, the replica's own inside.
    x = torch.ones(2, 4, dtype=torch.float64)
    three.run(lambda: model(x).sum().backward())
    three.run(lambda: model.zero_grad() if replica() == 1 else None)
    assert [c.fc1.weight.grad is None for c in model.replicas] == [False, True, False]
    model.zero_grad()
    assert all(p.grad is None for c in model.replicas for p in c.parameters())
    # register_buffer: one copy per replica.
    model.register_buffer("steps", torch.zeros((), dtype=torch.int64))
    assert "steps" in model.state_dict()
    assert model.replicas[2].steps is not model.replicas[0].steps
    # state_dict / load_state_dict round trip with a plain module.
    reference.register_buffer("steps", torch.tensor(7))
    model.load_state_dict(reference.state_dict())
    for c in model.replicas:
        for name, value in reference.state_dict().items():
            assert torch.equal(c.state_dict()[name], value)


@pytest.mark.timeout(30)
def test_hooks_run_on_every_copy_and_one_handle_removes_them(
        two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(net())
    seen: list[tuple[str, int]] = []
    pre = model.register_forward_pre_hook(lambda m, args: seen.append(("pre", id(m))))
    back = model.register_full_backward_hook(
        lambda m, gin, gout: seen.append(("back", id(m))))
    x = mirrored.PerReplica([torch.ones(1, 4, dtype=torch.float64),
                             torch.ones(2, 4, dtype=torch.float64)])
    post = model.fc2.register_forward_hook(lambda m, args, out: seen.append(("fc2", id(m))))
    with pytest.raises(RuntimeError, match="submodule 'fc2' has 1 forward hook"):
        two.run(lambda xi: model(xi), args=(x,))  # model.fc2 is replica 0's: refused
    assert seen == []
    post.remove()
    posts = [c.fc2.register_forward_hook(lambda m, args, out: seen.append(("fc2", id(m))))
             for c in model.replicas]  # (on every copy: the fix the error names)
    two.run(lambda xi: model(xi.clone().requires_grad_()).sum().backward(), args=(x,))
    copies = {id(c) for c in model.replicas}
    assert sorted(k for k, _ in seen) == ["back", "back", "fc2", "fc2", "pre", "pre"]
    assert {i for k, i in seen if k in ("pre", "back")} == copies  # each copy's own
    with pre:  # a handle is a context manager, as torch's
        pass
    back.remove()
    for handle in posts:
        handle.remove()
    seen.clear()
    two.run(lambda xi: model(xi.clone().requires_grad_()).sum().backward(), args=(x,))
    assert seen == []


@pytest.mark.timeout(30)
def test_pickle_save_and_deepcopy_give_replica_zeros_plain_module(
        two: mirrored.MirroredStrategy) -> None:
    model = two.mirror(net())
    with torch.no_grad():
        for c in model.replicas:
            c.fc1.bias.add_(1.0)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = [torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(model)),
              pickle.loads(pickle.dumps(model, protocol=0)), copy.deepcopy(model)]
    x = torch.randn(3, 4, dtype=torch.float64)
    for plain in loaded:
        assert type(plain) is Net
        assert plain.fc1.weight is not model.replicas[0].fc1.weight
        for name, value in model.replicas[0].state_dict().items():
            assert torch.equal(plain.state_dict()[name], value)
        assert torch.equal(plain(x), model(x))


@pytest.mark.timeout(60)
def test_averaged_model_matches_one_device(two: mirrored.MirroredStrategy) -> None:
    torch.manual_seed(1)
    batches = [(torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64))
               for _ in range(4)]
    reference = net()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    ref_swa = torch.optim.swa_utils.AveragedModel(reference)
    for x, y in batches:
        ref_opt.zero_grad()
        F.mse_loss(reference(x), y, reduction="none").sum(1).mean().backward()
        ref_opt.step()
        ref_swa.update_parameters(reference)

    model = two.mirror(net())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    swa = torch.optim.swa_utils.AveragedModel(model)  # deep-copies replica 0's module
    assert type(swa.module) is Net

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = F.mse_loss(model(x), y, reduction="none").sum(1)
        mirrored.compute_average_loss(loss).backward()
        opt.step()
        opt.zero_grad()

    for x, y in batches:
        two.run(step, args=(mirrored.PerReplica([x[:3], x[3:]]),
                            mirrored.PerReplica([y[:3], y[3:]])))
        swa.update_parameters(model)
    assert int(swa.n_averaged) == 4
    for (name, a), b in zip(swa.module.state_dict().items(), ref_swa.module.state_dict().values(),
                            strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14, msg=name)


def gpt_like() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0,
                                       batch_first=True)
    return nn.Sequential(nn.Embedding(11, 8), layer, nn.Linear(8, 11)).double()


def train_steps(strategy: mirrored.MirroredStrategy, model: nn.Module,
                batches: list[torch.Tensor]) -> list[float]:
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))

    def step(x: torch.Tensor) -> torch.Tensor:
        logits = model(x[:, :-1])
        loss = F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none").mean(1)
        average = mirrored.compute_average_loss(loss)
        average.backward()
        opt.step()
        opt.zero_grad()
        return average.detach()

    losses = []
    for x in batches:
        out = strategy.run(step, args=(mirrored.PerReplica([x[:3], x[3:]]),))
        losses.append(float(strategy.reduce("SUM", out)))
    return losses


def one_device(batches: list[torch.Tensor]) -> tuple[nn.Module, list[float]]:
    reference = gpt_like()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x in batches:
        logits = reference(x[:, :-1])
        loss = F.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none").mean(1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return reference, losses


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["before_mirror", "after_mirror"])
def test_compile_before_or_after_mirror_trains_like_one_device(where: str) -> None:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(2)
    batches = [torch.randint(0, 11, (5, 7)) for _ in range(3)]
    reference, expected = one_device(batches)
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"], per_replica_random=False)
    try:
        if where == "before_mirror":
            model: nn.Module = strategy.mirror(torch.compile(gpt_like(), backend="eager"))
            plain = model
        else:
            plain = strategy.mirror(gpt_like())
            model = torch.compile(plain, backend="eager")
        losses = train_steps(strategy, model, batches)  # mirror_optimizer takes either
    finally:
        strategy.close()
    assert isinstance(plain, MirroredModule)
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-13)
    for name, value in reference.state_dict().items():
        for c in plain.replicas:
            torch.testing.assert_close(c.state_dict()[name], value, rtol=0, atol=1e-13)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 2, dict(counters["stats"])  # one per copy
    assert sorted(plain.state_dict()) == sorted(reference.state_dict())  # no _orig_mod.


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["before_mirror", "after_mirror", "in_place"])
def test_compiled_replicas_each_run_their_own_copy(where: str) -> None:
    torch._dynamo.reset()
    counters.clear()
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"], per_replica_random=False)
    try:
        if where == "before_mirror":
            model = strategy.mirror(torch.compile(net(), backend="eager"))
            compiled: nn.Module = model
        elif where == "in_place":
            model = compiled = strategy.mirror(net())
            model.compile(backend="eager")  # nn.Module.compile on every copy
        else:
            model = strategy.mirror(net())
            compiled = torch.compile(model, backend="eager")
        with torch.no_grad():
            model.replicas[1].fc2.bias.add_(1.0)  # the copies differ: each must use its own
        x = torch.randn(3, 4, dtype=torch.float64)
        for _ in range(2):  # compiled, then cached
            out = strategy.run(compiled, args=(x,))
            for r, c in enumerate(model.replicas):
                torch.testing.assert_close(out.values[r], c(x), rtol=0, atol=0)
        assert not torch.equal(out.values[0], out.values[1])
        assert torch.equal(compiled(x), model.replicas[0](x))  # outside run: replica 0's
        assert counters["stats"]["unique_graphs"] >= 1, dict(counters["stats"])
    finally:
        strategy.close()


@pytest.mark.timeout(30)
def test_misuse_is_refused(two: mirrored.MirroredStrategy) -> None:
    inner = net()
    inner.fc1.compile(backend="eager")
    with pytest.raises(TypeError, match=r"fc1 was compiled in place"):
        two.mirror(inner)
    model = two.mirror(net())
    with pytest.raises(TypeError, match="got a MirroredModule"):
        two.mirror(model)
    with pytest.raises(RuntimeError, match=r"call it outside strategy\.run"):
        two.run(lambda: model.load_state_dict(model.state_dict()))
    with pytest.raises(TypeError, match="takes a MirroredModule"):
        two.mirror_optimizer(torch.compile(net(), backend="eager"), torch.optim.SGD)


@pytest.mark.parametrize("kind", [nn.Embedding, nn.EmbeddingBag])
def test_an_embedding_with_max_norm_is_refused_on_several_replicas(
        two: mirrored.MirroredStrategy, kind: type[nn.Module]) -> None:
    # It renormalizes, in place in forward, the rows each replica's own batch looks up:
    # the copies drifted apart (refused at the first step naming a manual update, or
    # silently with check="off").
    model = nn.Sequential(nn.Linear(2, 2), kind(10, 4, max_norm=1.0))
    with pytest.raises(ValueError, match=r": 1 is an embedding with max_norm.*each replica"):
        two.mirror(model)
    one = mirrored.MirroredStrategy(["CPU:0"])  # one replica: one device's forward
    assert one.mirror(kind(10, 4, max_norm=1.0)).max_norm == 1.0
    assert two.mirror(kind(10, 4)).max_norm is None


@pytest.mark.timeout(30)
def test_batch_norm_buffers_are_listed_for_the_optimizer(
        two: mirrored.MirroredStrategy) -> None:
    body = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    body.register_buffer("ema", torch.zeros(2))
    model = two.mirror(body)
    for r, c in enumerate(model.replicas):
        assert [id(t) for t in model.averaged_buffers(r)] == [id(c[1].running_mean),
                                                              id(c[1].running_var)]


class _Symmetric(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + w.T


@pytest.mark.parametrize("kind", ["custom", "spectral_norm"])
def test_parametrized_copies_under_cached_train_as_one_device(
        two: mirrored.MirroredStrategy, kind: str) -> None:
    # deepcopy kept the original's parametrized class, whose cache key is the original
    # module: under parametrize.cached() every copy read the first replica's weight,
    # and its backward went into that replica's gradients (wrong, or a misleading error).
    from torch.nn.utils import parametrizations
    from torch.nn.utils import parametrize as P

    def make() -> nn.Module:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                            nn.Linear(8, 3)).double()
        if kind == "custom":
            P.register_parametrization(net[2], "weight", _Symmetric())
        else:
            parametrizations.spectral_norm(net[2])
        return net

    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 4, generator=g).double(), torch.randint(0, 3, (8,), generator=g))
               for _ in range(3)]
    plain = make()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for x, y in batches:
        with P.cached():
            loss = nn.functional.cross_entropy(plain(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model = two.mirror(make())
    mopt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    if kind == "custom":  # (spectral_norm's weight, read in training mode, iterates)
        with P.cached():
            assert model.replicas[1][2].weight is not model.replicas[0][2].weight

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with P.cached():
            loss = mirrored.compute_average_loss(
                nn.functional.cross_entropy(model(x), y, reduction="none"), global_batch_size=8)
        mopt.zero_grad()
        loss.backward()
        mopt.step()

    for x, y in batches:
        two.run(step, args=(mirrored.PerReplica(list(x.chunk(2))),
                            mirrored.PerReplica(list(y.chunk(2)))))
    for (name, a), b in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=lambda m, name=name: f"{name}: {m}")
