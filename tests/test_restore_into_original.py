"""A checkpoint restored through the module given to ``strategy.mirror`` (replica 0's
copy: ``model = strategy.mirror(net); ...; net.load_state_dict(torch.load(f))``, a
plain script's restore or rollback) reaches every copy at the next run, as the one
device's model took it. It reached replica 0's copy alone before (a review found
evaluation mixing restored and old weights silently, and training raising only at
the divergence check's next checked step). ``load_state_dict(assign=True)`` there,
which would replace replica 0's tensors alone, is refused before anything changes."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored

pytestmark = pytest.mark.timeout(60)


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


def _data(steps: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (8,), generator=g)) for _ in range(steps)]


def _trained(seed: int) -> dict[str, torch.Tensor]:
    """A state dict unlike a fresh net's (BatchNorm statistics included)."""
    net = _net(seed)
    with torch.no_grad():
        for x, _ in _data(3, seed=seed):
            net(x)
    buffer = io.BytesIO()
    torch.save(net.state_dict(), buffer)
    buffer.seek(0)
    state: dict[str, torch.Tensor] = torch.load(buffer)
    return state


def _sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)  # type: ignore[arg-type]


def _strategy() -> mirrored.MirroredStrategy:
    return mirrored.MirroredStrategy(["CPU:0", "CPU:1"])


def _eval_loss(strategy: mirrored.MirroredStrategy, model: nn.Module,
               data: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    model.eval()

    def ev(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return F.cross_entropy(model(x), y, reduction="sum")

    return sum(float(strategy.reduce("SUM", strategy.run(ev, args=(x, y)), axis=None))
               for x, y in strategy.experimental_distribute_dataset(data))


def _reference_loss(reference: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]
                    ) -> float:
    reference.eval()
    with torch.no_grad():
        return sum(float(F.cross_entropy(reference(x), y, reduction="sum")) for x, y in data)


def _assert_copies_are(model: nn.Module, reference: nn.Module) -> None:
    want = reference.state_dict()
    for c in model.replicas:  # type: ignore[attr-defined]
        got = c.state_dict()
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-12, msg=k)


@pytest.mark.parametrize("into", ["the module", "a submodule", "an old submodule reference"])
def test_a_restore_into_the_original_module_reaches_every_copy(into: str) -> None:
    data, state = _data(3), _trained(123)
    reference = _net()
    strategy = _strategy()
    net = _net()
    model = strategy.mirror(net)
    head = model[3]  # type: ignore[index]
    _eval_loss(strategy, model, data)  # (a run since: the kept reference is an old one)
    model.train()
    if into == "the module":
        net.load_state_dict(state)
        reference.load_state_dict(state)
    else:
        part = {k.removeprefix("3."): v for k, v in state.items() if k.startswith("3.")}
        (net[3] if into == "a submodule" else head).load_state_dict(part)
        reference[3].load_state_dict(part)
    want = _reference_loss(reference, data)
    got = _eval_loss(strategy, model, data)
    assert abs(got - want) < 1e-12 * max(1.0, abs(want))
    _assert_copies_are(model, reference)
    strategy.close()


def test_a_rollback_into_the_original_module_trains_as_one_device() -> None:
    data, state, rollback_before = _data(6), _trained(7), 3
    reference = _net()
    opt = _sgd(reference.parameters())
    for i, (x, y) in enumerate(data):
        if i == rollback_before:
            reference.load_state_dict(state)
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opt.step()
    strategy = _strategy()
    net = _net()
    model = strategy.mirror(net, sync_batch_norm=True)  # (BatchNorm over the global batch)
    optimizer = strategy.mirror_optimizer(model, _sgd)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(data)):
        if i == rollback_before:
            net.load_state_dict(state)  # e.g. back to a saved checkpoint
        strategy.run(step, args=(x, y))
    _assert_copies_are(model, reference)
    strategy.close()


def test_a_load_through_the_mirrored_model_is_unchanged() -> None:
    """``model.load_state_dict`` writes every copy (with ``assign=True`` too): the
    hook on replica 0's modules leaves each copy's as it was loaded."""
    data, state = _data(3), _trained(5)
    reference = _net()
    reference.load_state_dict(state)
    want = _reference_loss(reference, data)
    for assign in (False, True):
        strategy = _strategy()
        model = strategy.mirror(_net())
        model.load_state_dict({k: v.clone() for k, v in state.items()}, assign=assign)
        got = _eval_loss(strategy, model, data)
        assert abs(got - want) < 1e-12 * max(1.0, abs(want))
        _assert_copies_are(model, reference)
        strategy.close()


@pytest.mark.parametrize("into", ["the module", "a submodule"])
def test_an_assigning_load_into_the_original_module_is_refused(into: str) -> None:
    state = _trained(9)
    strategy = _strategy()
    net = _net()
    model = strategy.mirror(net)
    before = copy.deepcopy(net.state_dict())
    target, part = ((net, state) if into == "the module" else
                    (net[3], {"weight": state["3.weight"], "bias": state["3.bias"]}))
    with pytest.raises(RuntimeError, match=r"assign=True.*replica 0's copy"):
        target.load_state_dict(part, assign=True)
    for k, v in net.state_dict().items():  # (refused before anything was written)
        assert torch.equal(v, before[k]), k
    _assert_copies_are(model, _net())
    model.load_state_dict(state, assign=True)  # (the way that reaches every copy)
    reference = _net()
    reference.load_state_dict(state)
    _eval_loss(strategy, model, _data(2))
    _assert_copies_are(model, reference)
    strategy.close()


def test_a_load_inside_run_is_the_replicas_own() -> None:
    """Inside ``run`` each replica loads into its own copy: nothing is carried, and
    ``assign=True`` is not refused there."""
    state = _trained(11)
    strategy = _strategy()
    model = strategy.mirror(_net())
    reference = _net()
    reference.load_state_dict(state)

    def load(assign: bool) -> None:
        model.module.load_state_dict(  # type: ignore[operator]
            {k: v.clone() for k, v in state.items()}, assign=assign)

    for assign in (False, True):
        strategy.run(load, args=(assign,))
        _eval_loss(strategy, model, _data(2))
        _assert_copies_are(model, reference)
    strategy.close()


def test_the_original_module_still_pickles_and_copies() -> None:
    """The hook is a module-level function: ``torch.save``/``pickle``/``deepcopy`` of
    the model or of the module given to ``mirror`` keep working, and a load into such
    a plain copy changes nothing of the mirrored model."""
    strategy = _strategy()
    net = _net()
    model = strategy.mirror(net)
    for plain in (copy.deepcopy(net), copy.deepcopy(model), pickle.loads(pickle.dumps(net))):
        assert type(plain) is nn.Sequential
        plain.load_state_dict(_trained(3))
        plain.load_state_dict(_trained(3), assign=True)  # (not replica 0's copy)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    assert type(torch.load(buffer, weights_only=False)) is nn.Sequential
    _eval_loss(strategy, model, _data(2))
    _assert_copies_are(model, _net())
    strategy.close()


def test_a_change_to_every_copy_keeps_replica_0s_pending_changes() -> None:
    """A change made to every copy (``model.eval()``, ``model.x = v``) after a change
    that reached replica 0's copy alone (a restore into the module given to
    ``mirror``, an in-place edit of ``model.parameters()``) carries the latter first:
    the record of it was dropped before, and the copies differed silently."""
    data, state = _data(3), _trained(13)
    reference = _net()
    reference.load_state_dict(state)
    with torch.no_grad():
        for p in reference.parameters():
            p.clamp_(-0.2, 0.2)
    strategy = _strategy()
    net = _net()
    model = strategy.mirror(net)
    net.load_state_dict(state)
    model.note = "restored"
    with torch.no_grad():
        for p in model.parameters():
            p.clamp_(-0.2, 0.2)
    model.train()
    got = _eval_loss(strategy, model, data)
    want = _reference_loss(reference, data)
    assert abs(got - want) < 1e-12 * max(1.0, abs(want))
    _assert_copies_are(model, reference)
    strategy.close()
