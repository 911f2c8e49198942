"""The copies of a mirrored model stay one model when code outside ``run`` reaches
replica 0's copy alone: ``requires_grad`` set through ``model.parameters()``, a
submodule or ``model.module`` is copied to every copy at the next run (torch's
freezing idioms train as on one device); a frozen parameter may sit in the
optimizer (as torch allows); a change of layout (a submodule appended, a weight
tied or replaced) through a submodule or through the module given to ``mirror``
raises at the next run, and ``requires_grad`` changed through that old reference
raises at the step, both before anything is updated. Each training case is checked
against a one-device reference (float64)."""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import mirrored

pytestmark = pytest.mark.timeout(60)


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()


X = torch.randn(12, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def _mirrored_net() -> tuple[mirrored.MirroredStrategy, nn.Module, mirrored.MirroredModule,
                             torch.optim.Optimizer]:
    """Two replicas of `_net` (the module given to ``mirror`` too) and their SGD."""
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    net = _net()
    model = strategy.mirror(net)
    return strategy, net, model, strategy.mirror_optimizer(
        model, lambda p: torch.optim.SGD(p, lr=0.1))


def _steps(strategy: mirrored.MirroredStrategy, model: nn.Module,
           opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    def step(x: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss((model(x) ** 2).sum(1))
        loss.backward()
        opt.step()
        opt.zero_grad()

    n = strategy.num_replicas_in_sync
    for batch in batches:
        strategy.run(step, args=(strategy.experimental_distribute_values_from_function(
            lambda ctx, b=batch: b.chunk(n)[ctx.replica_id_in_sync_group]),))


def _reference_steps(model: nn.Module, opt: torch.optim.Optimizer,
                     batches: list[torch.Tensor]) -> None:
    for batch in batches:
        ((model(batch) ** 2).sum(1).sum() / len(batch)).backward()
        opt.step()
        opt.zero_grad()


def _assert_copies_equal(model: mirrored.MirroredModule, reference: nn.Module) -> None:
    for c in model.replicas:
        for (name, p), q in zip(c.named_parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12, msg=name)
            assert p.requires_grad == q.requires_grad, name


def _assert_trains_alike(strategy: mirrored.MirroredStrategy, model: mirrored.MirroredModule,
                         opt: torch.optim.Optimizer, reference: nn.Module,
                         ref_opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> None:
    """``batches`` through the mirrored model and through ``reference`` on one device:
    every copy ends equal to the reference, its requires_grad flags too."""
    _steps(strategy, model, opt, batches)
    _reference_steps(reference, ref_opt, batches)
    _assert_copies_equal(model, reference)


FREEZE: dict[str, Callable[[mirrored.MirroredModule, bool], None]] = {
    "submodule.requires_grad_": lambda m, flag: m[0].requires_grad_(flag),
    "for p in submodule.parameters()": lambda m, flag: [
        p.requires_grad_(flag) for p in m[0].parameters()],
    "for p in model.parameters() by name": lambda m, flag: [
        p.requires_grad_(flag) for name, p in m.named_parameters() if name.startswith("0.")],
    "model.module": lambda m, flag: m.module[0].requires_grad_(flag),
    "every copy": lambda m, flag: [c[0].requires_grad_(flag) for c in m.replicas],
}


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("how", list(FREEZE))
def test_a_part_frozen_outside_run_stays_frozen_on_every_copy_and_thaws_alike(how, overlap):
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_net())
    FREEZE[how](model, False)
    # (the optimizer holds the frozen parameters too, as torch allows)
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                    overlap=overlap)
    reference = _net()
    reference[0].requires_grad_(False)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    batches = list(X.split(4))
    _assert_trains_alike(strategy, model, opt, reference, ref_opt, batches)
    FREEZE[how](model, True)  # thawed: trained from the next run on
    reference[0].requires_grad_(True)
    _assert_trains_alike(strategy, model, opt, reference, ref_opt, batches)
    assert not torch.equal(model.replicas[0][0].weight, _net()[0].weight)


def test_an_optimizer_over_the_parameters_left_trainable_builds_alike_on_every_copy():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_net())
    for p in model[0].parameters():
        p.requires_grad = False
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.Adam(
        [q for q in p if q.requires_grad], lr=0.01))
    reference = _net()
    reference[0].requires_grad_(False)
    ref_opt = torch.optim.Adam([q for q in reference.parameters() if q.requires_grad], lr=0.01)
    _assert_trains_alike(strategy, model, opt, reference, ref_opt, list(X.split(6)))


def test_requires_grad_changed_through_the_module_given_to_mirror_raises_at_the_step():
    strategy, net, model, opt = _mirrored_net()
    _steps(strategy, model, opt, [X[:4]])  # (the copies checked at this run)
    before = [[p.clone() for p in c.parameters()] for c in model.replicas]
    strategy.run(lambda: None)  # (the copies checked again: `replicas` was read)
    for p in net[0].parameters():  # replica 0's copy, reached without the mirrored model
        p.requires_grad = False
    with pytest.raises(RuntimeError, match=r"parameter '0\.weight' \(and 1 more\) requires a "
                       r"gradient on the copies of 1 of the 2 replicas only"):
        _steps(strategy, model, opt, [X[4:8]])
    for c, saved in zip(model.replicas, before, strict=True):
        assert all(torch.equal(p, q) for p, q in zip(c.parameters(), saved, strict=True))


LAYOUTS: dict[str, tuple[Callable[[mirrored.MirroredModule, nn.Module], None], str]] = {
    "appended through the model": (lambda m, net: m.append(nn.Linear(2, 2).double()),
                                   r"replica 0's copy has submodule '3' \(Linear\) that "
                                   r"replica 1's lacks"),
    "parameter on a submodule": (
        lambda m, net: setattr(m[0], "scale", nn.Parameter(torch.ones(5, dtype=torch.float64))),
        r"replica 0's copy has parameter '0\.scale' \(float64\[5\]\) that replica 1's lacks"),
    "head replaced through the old reference": (
        lambda m, net: net.__setitem__(2, nn.Sequential(nn.Linear(5, 2).double())),
        r"submodule '2' is Sequential on replica 0's copy and Linear on replica 1's"),
    "weight replaced through the old reference": (
        lambda m, net: setattr(net[2], "weight", nn.Parameter(torch.zeros(2, 5,
                                                                          dtype=torch.float64))),
        r"parameter '2\.weight' was added or replaced since the last run and its values on "
        r"replica 0's copy differ from replica 1's"),
    "a head made for each copy": (
        lambda m, net: [setattr(c, "head", nn.Linear(2, 2).double()) for c in m.replicas],
        r"parameter 'head\.weight' was added or replaced since the last run and its values "
        r"on replica 0's copy differ from replica 1's"),
}


@pytest.mark.parametrize("change", list(LAYOUTS))
def test_a_change_of_layout_on_replica_0s_copy_alone_raises_at_the_next_run(change):
    strategy, net, model, opt = _mirrored_net()
    _steps(strategy, model, opt, [X[:4]])
    make, message = LAYOUTS[change]
    make(model, net)
    saved = [p.clone() for p in model.replicas[1].parameters()]
    for _ in range(2):  # refused again at the next run: the copies still differ
        with pytest.raises(RuntimeError, match=message):
            _steps(strategy, model, opt, [X[4:8]])
    assert all(torch.equal(p, q) for p, q in zip(model.replicas[1].parameters(), saved,
                                                  strict=True))


def test_a_weight_tied_on_replica_0s_copy_alone_raises_naming_it():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    torch.manual_seed(0)
    model = strategy.mirror(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    model[1].weight = model[0].weight  # (the usual lm_head.weight = embed.weight)
    with pytest.raises(RuntimeError, match=r"replica 1's copy has parameter '1\.weight' "
                       r"\(float32\[4, 4\]\) that replica 0's lacks \(a parameter shared under "
                       r"two names, as a tied weight, counts once\)"):
        strategy.run(lambda: None)
    with pytest.raises(RuntimeError, match="the copies of a mirrored model differ"):
        strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))


def test_changes_made_on_the_mirrored_model_or_on_every_copy_train_as_one_device():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_net())
    torch.manual_seed(3)
    head = nn.Linear(2, 3).double()
    model.head = copy.deepcopy(head)  # copied to every copy (and run, as forward ignores it)
    for c in model.replicas:  # changed on every copy alike
        c[1] = nn.Sigmoid()
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    reference = _net()
    reference.head = copy.deepcopy(head)
    reference[1] = nn.Sigmoid()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    _assert_trains_alike(strategy, model, opt, reference, ref_opt, list(X.split(4)))
    # the parameters added on the mirrored model are the copies' too: a plain optimizer
    # over them is refused like one over the others
    with pytest.raises(RuntimeError, match=r"copy 0's 'head\.weight'"):
        torch.optim.SGD(model.head.parameters(), lr=0.1).step()


def _bn_net() -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Tanh(), nn.Linear(5, 2)).double()
    net[1].running_mean.fill_(0.3)  # "pretrained" statistics, kept frozen
    net[1].running_var.fill_(2.0)
    return net


def _freeze_batch_norm(model: nn.Module) -> None:  # the fine-tuning idiom
    model.train()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.eval()


@pytest.mark.parametrize("sync", [False, True])
def test_a_batch_norm_put_in_eval_mode_through_a_submodule_is_frozen_on_every_copy(sync):
    # model.modules() outside run reaches replica 0's copy: its train / eval flags go to
    # every copy at the next run; with sync_batch_norm the layers are still BatchNorm1d.
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_bn_net(), sync_batch_norm=sync)
    _freeze_batch_norm(model)
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    reference = _bn_net()
    _freeze_batch_norm(reference)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    _assert_trains_alike(strategy, model, opt, reference, ref_opt, list(X.split(4)))
    assert [c[1].training for c in model.replicas] == [False, False]
    for k, v in reference.state_dict().items():  # the statistics stayed frozen too
        torch.testing.assert_close(model.state_dict()[k], v, rtol=0, atol=1e-12)
    model.module.eval()  # DDP's idiom before an evaluation
    strategy.run(lambda: None)
    assert [c.training for c in model.replicas] == [False, False]


def test_a_random_initializer_applied_to_the_mirrored_model_draws_as_one_model():
    # model.apply(init) reaches every copy; with a random initializer each copy would
    # draw its own values: they take replica 0's, which are one model's, and the
    # caller's generator ends where one model's apply leaves it.
    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight)
            nn.init.uniform_(m.bias)

    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    model = strategy.mirror(_net())
    torch.manual_seed(5)
    model.apply(init)
    after = torch.rand(3)
    reference = _net()
    torch.manual_seed(5)
    reference.apply(init)
    assert torch.equal(after, torch.rand(3))
    for copy_ in model.replicas:
        for (name, p), q in zip(copy_.named_parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, q), name


def test_a_state_dict_loaded_with_assign_gives_every_copy_its_own_tensors():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    torch.manual_seed(5)
    state = copy.deepcopy(_net().state_dict())
    model = strategy.mirror(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double())
    model.load_state_dict(state, assign=True)  # (torch's way to load into a meta model)
    ptrs = [c[0].weight.data_ptr() for c in model.replicas]
    assert ptrs[0] == state["0.weight"].data_ptr() and ptrs[1] != ptrs[0]
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    reference = _net()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    _steps(strategy, model, opt, list(X.split(4)))
    _reference_steps(reference, ref_opt, list(X.split(4)))
    _assert_copies_equal(model, reference)  # (sharing them, each replica stepped them again)


def test_copies_made_to_share_a_parameters_memory_raise_at_the_next_run():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_net())
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    _steps(strategy, model, opt, [X[:4]])
    shared = torch.zeros(2, 5, dtype=torch.float64)
    for c in model.replicas:  # the same tensor on every copy, through the mirrored model
        c[2].weight.data = shared
    with pytest.raises(RuntimeError, match=r"the copies of a mirrored model share memory: "
                       r"parameter '2\.weight' of replica 1's copy"):
        _steps(strategy, model, opt, [X[4:8]])


def _lazy_net() -> nn.Sequential:
    with warnings.catch_warnings():  # torch warns that lazy modules are experimental
        warnings.simplefilter("ignore", UserWarning)
        return nn.Sequential(nn.LazyLinear(5), nn.Tanh(), nn.Linear(5, 2)).double()


@pytest.mark.parametrize("via_run", [False, True])
def test_lazy_modules_initialized_inside_run_start_from_replica_0s_values(via_run):
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_lazy_net())
    strategy.run(model, args=(X[:4],))  # the dry run: each copy initializes its own
    if via_run:  # replica 0's values given to the others at the next run's start
        strategy.run(lambda: None)
        first = model.replicas[0]
        assert all(torch.equal(p, q) for p, q in zip(first.parameters(),
                                                     model.replicas[1].parameters(), strict=True))
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    first = model.replicas[0]
    assert all(torch.equal(p, q) for c in model.replicas[1:]
               for p, q in zip(first.parameters(), c.parameters(), strict=True))
    reference = copy.deepcopy(first)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    _assert_trains_alike(strategy, model, opt, reference, ref_opt, list(X.split(4)))


def test_a_lazy_module_initialized_outside_run_is_refused_naming_the_fix():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_lazy_net())
    model(X[:4])  # replica 0's copy only
    with pytest.raises(RuntimeError, match=r"lazy parameter '0\.weight' is initialized on "
                       r"replica 0's copy but not on replica 1's: a lazy module's first forward "
                       r"outside strategy.run runs replica 0's copy only"):
        strategy.run(model, args=(X[:4],))


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.embed = nn.Embedding(6, 4).double()
        self.head = nn.Linear(4, 6, bias=False).double()
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def test_assign_loading_keeps_a_tied_weight_tied_on_every_copy():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_Tied())
    model.load_state_dict(_Tied().state_dict(), assign=True)
    for c in model.replicas:  # (torch's assign makes two parameters of one memory)
        assert c.head.weight.data_ptr() == c.embed.weight.data_ptr()
    assert model.replicas[0].embed.weight.data_ptr() != model.replicas[1].embed.weight.data_ptr()
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    tokens = torch.randint(0, 6, (8,), generator=torch.Generator().manual_seed(2))

    def step(x: torch.Tensor) -> None:
        mirrored.compute_average_loss((model(x) ** 2).sum(1)).backward()
        opt.step()
        opt.zero_grad()

    reference = _Tied()  # what torch makes of the same load
    reference.load_state_dict(_Tied().state_dict(), assign=True)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(3):
        strategy.run(step, args=(mirrored.PerReplica([tokens[:4], tokens[4:]]),))
        ((reference(tokens) ** 2).sum(1).sum() / 8).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    _assert_copies_equal(model, reference)


def test_an_old_reference_freeze_with_zeroed_gradients_is_refused_at_the_step():
    # zero_grad(set_to_none=False): the frozen copy sends zeros, not a missing gradient
    strategy, net, model, opt = _mirrored_net()

    def step(x: torch.Tensor) -> None:
        mirrored.compute_average_loss((model(x) ** 2).sum(1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    batch = strategy.experimental_distribute_values_from_function(
        lambda ctx: X[:8].chunk(2)[ctx.replica_id_in_sync_group])
    strategy.run(step, args=(batch,))
    copies = model.replicas
    saved = [p.clone() for c in copies for p in c.parameters()]
    strategy.run(lambda: None)  # (the copies checked again: `replicas` was read)
    net[0].weight.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"parameter '0\.weight' requires a gradient on the "
                       r"copies of 1 of the 2 replicas only"):
        strategy.run(step, args=(batch,))
    assert all(torch.equal(p, q) for p, q in zip(
        [p for c in copies for p in c.parameters()], saved, strict=True))


def test_a_freeze_made_alike_inside_run_is_no_error_whatever_the_timing():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_net())
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

    def step(x: torch.Tensor) -> None:
        if mirrored.get_replica_context().replica_id_in_sync_group == 0:
            time.sleep(0.2)  # (replica 1 reaches the step first)
        model[0].requires_grad_(False)
        ((model(x) ** 2).sum(1).sum() / 8).backward()
        opt.step()
        opt.zero_grad()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mirrored.LossScalingWarning)
        strategy.run(step, args=(strategy.experimental_distribute_values_from_function(
            lambda ctx: X[:8].chunk(2)[ctx.replica_id_in_sync_group]),))
    reference = _net()
    reference[0].requires_grad_(False)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    _reference_steps(reference, ref_opt, [X[:8]])
    _assert_copies_equal(model, reference)


def test_modules_hashed_by_their_own_fields_build_while_a_model_is_mirrored():
    class Named(nn.Module):  # hashes a field set after a submodule is registered
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)
            self.name = "named"

        def __hash__(self) -> int:
            return hash(self.name)

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Named) and other.name == self.name

    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    strategy.mirror(_net())
    assert Named().name == "named"


class _Parts(nn.Module):
    """A model with a method of its own that freezes a part (as many libraries have)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = _net()

    def freeze_first(self) -> None:
        self.body[0].requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def test_a_models_own_freezing_method_called_outside_run_freezes_every_copy():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_Parts())
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    strategy.run(lambda: None)
    model.freeze_first()  # replica 0's copy's method: copied at the next run
    reference = _Parts()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    reference.freeze_first()
    _assert_trains_alike(strategy, model, opt, reference, ref_opt, list(X.split(4)))


def test_frozen_sets_that_differ_but_count_alike_are_refused():
    strategy, net, model, opt = _mirrored_net()
    copies = model.replicas
    _steps(strategy, model, opt, [X[:4]])
    mine, theirs = list(net.parameters()), list(copies[1].parameters())
    for p in (mine[0], mine[3]):
        p.requires_grad_(False)
    for p in (theirs[1], theirs[2]):
        p.requires_grad_(False)
    with pytest.raises(RuntimeError, match=r"parameter '0\.weight' \(and 3 more\) requires a "
                       r"gradient on the copies of 1 of the 2 replicas only"):
        _steps(strategy, model, opt, [X[4:8]])


def test_parameters_replaced_without_torchs_hook_are_still_checked():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_net())
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    _steps(strategy, model, opt, [X[:4]])
    shared = nn.Parameter(torch.zeros(2, 5, dtype=torch.float64))
    for c in model.replicas:  # (as some loaders write: no registration hook fires)
        c[2]._parameters["weight"] = shared
    with pytest.raises(RuntimeError, match=r"share memory: parameter '2\.weight'"):
        _steps(strategy, model, opt, [X[4:8]])


def test_a_dtype_changed_through_a_submodule_is_named_at_the_next_run():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_net())
    strategy.run(lambda: None)
    model[0].float()  # replica 0's copy's first layer only
    with pytest.raises(RuntimeError, match=r"parameter '0\.weight' is float32\[5, 4\] on "
                       r"replica 0's copy and float64\[5, 4\] on replica 1's"):
        strategy.run(lambda: None)


def test_a_lazy_module_added_after_mirror_starts_from_replica_0s_values():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_net())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model.head = nn.LazyLinear(3).double()  # on every copy, uninitialized (runs last)
    strategy.run(model, args=(X[:4],))  # each copy initializes its own
    strategy.run(lambda: None)
    first, second = model.replicas
    assert torch.equal(first.head.weight, second.head.weight)


def test_assign_loading_a_conjugate_view_gives_every_copy_its_values():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(nn.Linear(2, 2, dtype=torch.complex64))
    z = torch.randn(2, 2, dtype=torch.complex64, generator=torch.Generator().manual_seed(3))
    state = {"weight": z.conj(), "bias": torch.zeros(2, dtype=torch.complex64)}
    model.load_state_dict(state, assign=True)
    for c in model.replicas:
        assert torch.equal(c.weight.resolve_conj(), z.conj().resolve_conj())


def test_a_lazy_model_mirrored_on_a_strategy_that_already_ran_starts_alike():
    # (dry run under inference mode, as an evaluation would; the next run outside it)
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    strategy.run(lambda: None)  # the strategy's copies checked once already
    model = strategy.mirror(_lazy_net())
    with torch.inference_mode():
        strategy.run(model, args=(X[:4],))
    strategy.run(lambda: None)
    first, second = model.replicas
    assert all(torch.equal(p, q) for p, q in zip(first.parameters(), second.parameters(),
                                                  strict=True))


def test_a_dropped_mirrored_model_is_freed_with_what_the_check_kept_of_it():
    import gc
    import weakref

    from mirrored._src.training import structure

    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_net())
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    _steps(strategy, model, opt, [X[:4]])
    copies = [weakref.ref(c) for c in model.replicas]
    watched = len(structure._watched)
    del model, opt
    gc.collect()
    assert all(c() is None for c in copies)
    assert len(structure._watched) < watched  # (its modules' entries went with them)
    strategy.run(lambda: None)  # nothing left to check, no error


def test_gradient_hooks_registered_before_mirror_act_on_every_copy():
    # p.register_hook on the module given to mirror: copy.deepcopy drops tensor hooks,
    # so only replica 0's gradients were scaled; every copy's are now.
    def make() -> nn.Sequential:
        net = _net()
        for p in net.parameters():
            p.register_hook(lambda g: g * 0.5)
        return net

    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    with pytest.warns(mirrored.GradientHookWarning, match="linear in the gradient"):
        model = strategy.mirror(make())  # (this one is linear: right on N replicas)
    opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    reference = make()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    _assert_trains_alike(strategy, model, opt, reference, ref_opt, list(X.split(4)))


def test_a_module_assigned_on_the_mirrored_model_keeps_its_gradient_hooks_on_every_copy():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(_net())
    head = nn.Linear(2, 1).double()
    head.weight.register_hook(lambda g: g * 0.0)
    model.head = head
    for copy_ in model.replicas:
        out = copy_.head(torch.ones(1, 2, dtype=torch.float64)).sum()
        out.backward()
        assert torch.equal(copy_.head.weight.grad, torch.zeros(1, 2, dtype=torch.float64))


class Stateful(nn.Module):
    """Adds the last batch's column sums to the next input until `reset_state`."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2).double()
        self.state: torch.Tensor | None = None
        self.phase = "warm"

    def reset_state(self) -> None:
        self.state, self.phase = None, "fresh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.state is not None:
            x = x + self.state
        self.state = x.detach().sum(0)
        return self.linear(x) * (2.0 if self.phase == "fresh" else 1.0)


def test_a_method_that_resets_plain_state_outside_run_reaches_every_copy() -> None:
    # It runs on replica 0's copy (outside run the mirrored model reads as that copy);
    # the others kept their state and phase, silently, before.
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    model = strategy.mirror(Stateful())
    x = torch.arange(12, dtype=torch.float64).reshape(4, 3)
    one = [Stateful(), Stateful()]  # one device per replica's stream of rows
    for c in one:
        c.load_state_dict(model.replicas[0].state_dict())

    def step(x: torch.Tensor) -> torch.Tensor:
        return model(x)

    def compare(out: Any) -> None:
        for r, c in enumerate(one):
            torch.testing.assert_close(out.values[r], c(x[2 * r:2 * r + 2]), rtol=0, atol=0)

    compare(strategy.run(step, args=(mirrored.PerReplica([x[:2], x[2:]]),)))
    model.reset_state()
    for c in one:
        c.reset_state()
    compare(strategy.run(step, args=(mirrored.PerReplica([x[:2], x[2:]]),)))
    assert [c.phase for c in model.replicas] == ["fresh", "fresh"]
    assert not torch.equal(model.replicas[0].state, model.replicas[1].state)  # own tensors
