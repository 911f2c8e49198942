"""Review 3 of the mirrored optimizer's in-process fast paths (`training/direct.py`,
`host_sum.py`, `hyper.py`): real training loops on 2 and 3 logical CPU replicas against
one device in plain torch (float64, same init and data), comparing the parameters, the
optimizer's state dict (``step`` counts included), the parameter groups, torch's hooks,
LR schedulers and their warnings."""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.optim.optimizer as torch_optimizer
from torch import nn
from torch.optim import lr_scheduler as L

import mirrored

pytestmark = pytest.mark.timeout(120)

optim = torch.optim
Make = Callable[[Any], torch.optim.Optimizer]
Sched = Callable[[torch.optim.Optimizer], Any] | None


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def batches(steps: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(7, 3, generator=g, dtype=torch.float64),
             torch.randn(7, 2, generator=g, dtype=torch.float64)) for _ in range(steps)]


def split(t: torch.Tensor, n: int) -> mirrored.PerReplica[torch.Tensor]:
    c = math.ceil(t.shape[0] / n)  # 7 rows: 4 + 3, 3 + 3 + 1
    return mirrored.PerReplica([t[i * c:min((i + 1) * c, t.shape[0])] for i in range(n)])


def loss_rows(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).sum(1)


def one_device(make: Make, sched: Sched = None, steps: int = 4, closure: bool = False
               ) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = net()
    opt = make(list(model.parameters()))
    scheduler = sched(opt) if sched else None
    for x, y in batches(steps):
        opt.zero_grad()
        if closure:
            def c(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                loss = loss_rows(model(x), y).mean()
                loss.backward()
                return loss
            opt.step(c)
        else:
            loss_rows(model(x), y).mean().backward()
            opt.step()
        if scheduler is not None:
            scheduler.step()
    return model, opt, scheduler


def replicas(n: int, make: Make, sched: Sched = None, steps: int = 4, closure: bool = False
             ) -> tuple[mirrored.MirroredStrategy, mirrored.MirroredModule,
                        mirrored.MirroredOptimizer, Any]:
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(n)])
    model = strategy.mirror(net())
    opt = strategy.mirror_optimizer(model, make)
    scheduler = sched(opt) if sched else None

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        if closure:
            def c() -> torch.Tensor:
                loss = mirrored.compute_average_loss(loss_rows(model(x), y))
                loss.backward()
                return loss
            assert opt.step(c) is not None
        else:
            mirrored.compute_average_loss(loss_rows(model(x), y)).backward()
            opt.step()

    for x, y in batches(steps):
        strategy.run(step, args=(split(x, n), split(y, n)))
        if scheduler is not None:
            scheduler.step()
    return strategy, model, opt, scheduler


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Nested state dicts equal (tensors to 1e-12, with dtype and device)."""
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            assert_same(u, v, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device), where
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=where)
    elif isinstance(a, float) and isinstance(b, float):
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15), (where, a, b)
    elif callable(a):
        return
    else:
        assert a == b, (where, a, b)


def assert_trained_alike(n: int, make: Make, sched: Sched = None, closure: bool = False,
                         inner_groups: bool = True) -> None:
    ref, ref_opt, ref_sched = one_device(make, sched, closure=closure)
    strategy, model, opt, scheduler = replicas(n, make, sched, closure=closure)
    try:
        for copy in model.replicas:
            for p, q in zip(copy.parameters(), ref.parameters(), strict=True):
                torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-12)
        assert_same(ref_opt.state_dict(), opt.state_dict(), "state_dict")
        for r, inner in enumerate(opt.optimizers):  # every replica's state, `step` included
            assert_same(ref_opt.state_dict()["state"], inner.state_dict()["state"], f"r{r}")
            if inner_groups:
                assert_same(ref_opt.state_dict()["param_groups"],
                            inner.state_dict()["param_groups"], f"r{r} groups")
        if ref_sched is not None:
            assert_same(ref_sched.state_dict(), scheduler.state_dict(), "scheduler")
    finally:
        strategy.close()


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd_nesterov": lambda p, **k: optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True,
                                         weight_decay=0.01, **k),
    "adam_amsgrad": lambda p, **k: optim.Adam(p, lr=0.01, amsgrad=True, weight_decay=0.01, **k),
    "adamw": lambda p, **k: optim.AdamW(p, lr=0.01, **k),
    "adamax": lambda p, **k: optim.Adamax(p, lr=0.01, **k),
    "nadam_decoupled": lambda p, **k: optim.NAdam(p, lr=0.01, weight_decay=0.1,
                                              decoupled_weight_decay=True, **k),
    "radam": lambda p, **k: optim.RAdam(p, lr=0.01, **k),
    "rmsprop_centered": lambda p, **k: optim.RMSprop(p, lr=0.01, centered=True, momentum=0.5,
                                                 **k),
    "adagrad": lambda p, **k: optim.Adagrad(p, lr=0.1, **k),
    "adadelta": lambda p, **k: optim.Adadelta(p, lr=1.0, **k),
    "asgd": lambda p, **k: optim.ASGD(p, lr=0.01, t0=1, **k),
    "rprop": lambda p, **k: optim.Rprop(p, lr=0.01, **k),
}
if hasattr(optim, "Adafactor"):
    OPTIMIZERS["adafactor"] = lambda p, **k: optim.Adafactor(p, lr=0.01, **k)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_torch_optimizer_trains_as_one_device(name: str, n: int) -> None:
    for foreach in (True, False):
        for maximize in (False, True):
            kwargs: dict[str, bool] = {"foreach": foreach, "maximize": maximize}
            if name != "adafactor":  # (torch's defaults, said explicitly where taken)
                kwargs["differentiable"] = False
            if name not in ("sgd_nesterov", "adagrad", "adafactor"):
                kwargs["capturable"] = False
            assert_trained_alike(n, lambda p, kw=kwargs: OPTIMIZERS[name](p, **kw))


@pytest.mark.parametrize("n", [2, 3])
def test_fused_and_tensor_learning_rates_train_as_one_device(n: int) -> None:
    assert_trained_alike(n, lambda p: optim.Adam(p, lr=0.01, fused=True))
    assert_trained_alike(n, lambda p: optim.SGD(p, lr=0.1, momentum=0.9, fused=True))
    assert_trained_alike(n, lambda p: optim.Adam(p, lr=torch.tensor(0.01), foreach=False))


SCHEDULERS: dict[str, tuple[Make, Callable[[Any], Any]]] = {
    "onecycle_adam_betas": (lambda p: optim.Adam(p, lr=0.01),
                            lambda o: L.OneCycleLR(o, max_lr=0.1, total_steps=10)),
    "cyclic_sgd_momentum": (lambda p: optim.SGD(p, lr=0.01, momentum=0.9),
                            lambda o: L.CyclicLR(o, 0.01, 0.1, step_size_up=2,
                                                 cycle_momentum=True)),
    "sequential": (lambda p: optim.SGD(p, lr=0.1),
                   lambda o: L.SequentialLR(o, [L.LinearLR(o, 0.1, total_iters=2),
                                                L.ExponentialLR(o, 0.9)], milestones=[2])),
    "chained": (lambda p: optim.SGD(p, lr=0.1),
                lambda o: L.ChainedScheduler([L.StepLR(o, 1, 0.5), L.ExponentialLR(o, 0.9)])),
    "lambda": (lambda p: optim.SGD(p, lr=0.1), lambda o: L.LambdaLR(o, lambda e: 1 / (e + 1))),
    "two_groups_onecycle": (
        lambda p: optim.SGD([{"params": p[:2], "lr": 0.2}, {"params": p[2:]}], lr=0.1,
                        momentum=0.5),
        lambda o: L.OneCycleLR(o, max_lr=[0.3, 0.2], total_steps=10)),
}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_schedulers_train_as_one_device(name: str, n: int) -> None:
    make, sched = SCHEDULERS[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no order warning: none on one device either)
        # the other replicas' own groups take replica 0's at their next step: compared
        # through the mirrored optimizer's (replica 0's) only
        assert_trained_alike(n, make, sched, inner_groups=False)


@pytest.mark.parametrize("n", [2, 3])
def test_reduce_lr_on_plateau_fed_a_reduced_loss_is_one_devices(n: int) -> None:
    model = net()
    ref_opt = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_sched = L.ReduceLROnPlateau(ref_opt, patience=0, factor=0.5, threshold=10.0)
    for x, y in batches(5):
        ref_opt.zero_grad()
        loss = loss_rows(model(x), y).mean()
        loss.backward()
        ref_opt.step()
        ref_sched.step(loss.item())
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(n)])
    mm = strategy.mirror(net())
    opt = strategy.mirror_optimizer(mm, lambda p: optim.SGD(p, lr=0.1, momentum=0.9))
    sched = L.ReduceLROnPlateau(opt, patience=0, factor=0.5, threshold=10.0)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = mirrored.compute_average_loss(loss_rows(mm(x), y))
        loss.backward()
        opt.step()
        return loss.detach()

    for x, y in batches(5):
        loss = strategy.run(step, args=(split(x, n), split(y, n)))
        sched.step(strategy.reduce("SUM", loss, axis=None).item())
    assert ref_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"] < 0.1
    for p, q in zip(mm.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-12)
    assert_same(ref_opt.state_dict(), opt.state_dict())
    strategy.close()


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("scheduler_first", [False, True])
def test_the_scheduler_order_warning_is_torchs(n: int, scheduler_first: bool) -> None:
    def messages(mirror: bool) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mirror:
                strategy, model, opt, _ = replicas(n, lambda p: optim.SGD(p, lr=0.1), steps=0)
            else:
                model = net()
                opt = optim.SGD(model.parameters(), lr=0.1)
            sched = L.StepLR(opt, 1, 0.5)
            for i, (x, y) in enumerate(batches(2)):
                if scheduler_first and i == 0:
                    sched.step()

                def step(x: torch.Tensor, y: torch.Tensor) -> None:
                    opt.zero_grad()
                    if mirror:
                        mirrored.compute_average_loss(loss_rows(model(x), y)).backward()
                    else:
                        loss_rows(model(x), y).mean().backward()
                    opt.step()

                if mirror:
                    strategy.run(step, args=(split(x, n), split(y, n)))
                else:
                    step(x, y)
                if not scheduler_first:
                    sched.step()
            if mirror:
                strategy.close()
        return [str(w.message).split(".")[0] for w in caught]

    expected = messages(False)
    assert bool(expected) == scheduler_first
    assert messages(True) == expected


@pytest.mark.parametrize("n", [1, 2, 3])
def test_an_sgd_step_with_a_closure_is_one_devices(n: int) -> None:
    assert_trained_alike(n, lambda p: optim.SGD(p, lr=0.1, momentum=0.9), closure=True)


# ---------------------------------------------------------------- torch's hooks
def test_state_dict_hooks_on_the_mirrored_optimizer_run_as_torchs(
        two: mirrored.MirroredStrategy) -> None:
    """torch runs a state_dict pre/post hook and a load_state_dict pre/post hook, and
    uses what the post hook / load pre hook return; on the mirrored optimizer none ran."""
    def hooks(opt: torch.optim.Optimizer, log: list[str]) -> None:
        opt.register_state_dict_pre_hook(lambda o: log.append("save pre"))

        def post(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
            log.append("save post")
            return {**sd, "extra": 7}

        def load_pre(o: Any, sd: dict[str, Any]) -> dict[str, Any]:
            log.append("load pre")
            sd = dict(sd)
            sd.pop("extra")
            sd["param_groups"] = [{**g, "lr": 0.05} for g in sd["param_groups"]]
            return sd

        opt.register_state_dict_post_hook(post)
        opt.register_load_state_dict_pre_hook(load_pre)
        opt.register_load_state_dict_post_hook(lambda o: log.append("load post"))

    ref_log: list[str] = []
    ref_opt = optim.SGD(net().parameters(), lr=0.1)
    hooks(ref_opt, ref_log)
    ref_sd = ref_opt.state_dict()
    ref_opt.load_state_dict(ref_sd)

    log: list[str] = []
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, lambda p: optim.SGD(p, lr=0.1))
    hooks(opt, log)
    sd = opt.state_dict()
    assert sd["extra"] == ref_sd["extra"] == 7
    opt.load_state_dict(sd)
    assert log == ref_log == ["save pre", "save post", "load pre", "load post"]
    assert [o.param_groups[0]["lr"] for o in opt.optimizers] == [0.05, 0.05]
    assert ref_opt.param_groups[0]["lr"] == 0.05


def test_a_step_pre_hooks_result_is_used_as_torch_uses_it(
        two: mirrored.MirroredStrategy) -> None:
    """A pre hook sees torch's arguments (``opt.step()``: ``(opt,)`` and ``{}``), may
    return new ones (here: a closure), and one returning anything else is refused."""
    seen: list[Any] = []
    lock = threading.Lock()
    called: list[int] = []

    def pre(o: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with lock:
            seen.append((len(args), dict(kwargs)))
        return (*args, lambda: called.append(1)), kwargs

    def check(opt: torch.optim.Optimizer, stepped: Callable[[], None]) -> list[Any]:
        seen.clear()
        called.clear()
        handle = opt.register_step_pre_hook(pre)
        stepped()
        handle.remove()
        return [list(seen), list(called)]

    ref_opt = optim.SGD(net().parameters(), lr=0.1)
    expected = check(ref_opt, ref_opt.step)
    assert expected == [[(1, {})], [1]]
    model = two.mirror(net())
    opt = two.mirror_optimizer(model, lambda p: optim.SGD(p, lr=0.1))

    def step() -> None:
        opt.zero_grad()
        mirrored.compute_average_loss(model(torch.ones(2, 3, dtype=torch.float64)).sum(1)
                                      ).backward()
        opt.step()

    got = check(opt, lambda: two.run(step))
    assert got == [expected[0] * 2, expected[1] * 2]  # (once per replica, as step)

    def bad(o: Any, args: Any, kwargs: Any) -> Any:
        return 1

    for optimizer, stepped in ((ref_opt, ref_opt.step), (opt, lambda: two.run(step))):
        handle = optimizer.register_step_pre_hook(bad)
        with pytest.raises(RuntimeError, match="must return None or a tuple"):
            stepped()
        handle.remove()


def test_global_hooks_registered_mid_training_see_the_steps(
        two: mirrored.MirroredStrategy) -> None:
    seen: list[str] = []
    lock = threading.Lock()

    def note(o: Any, args: Any, kwargs: Any) -> None:
        with lock:
            seen.append("mirrored" if o is opt else "replica" if any(
                o is inner for inner in opt.optimizers) else "plain" if o is ref_opt else "?")

    model = two.mirror(net())
    opt = two.mirror_optimizer(model, lambda p: optim.SGD(p, lr=0.1, momentum=0.9))
    ref = net()
    ref_opt = optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        mirrored.compute_average_loss(loss_rows(model(x), y)).backward()
        opt.step()

    handle = None
    try:
        for i, (x, y) in enumerate(batches(3)):
            if i == 1:
                handle = torch_optimizer.register_optimizer_step_post_hook(note)
            two.run(step, args=(split(x, 2), split(y, 2)))
            ref_opt.zero_grad()
            loss_rows(ref(x), y).mean().backward()
            ref_opt.step()
    finally:
        if handle is not None:
            handle.remove()
    # one device: once per step. Here the mirrored optimizer's step in each replica, and
    # each replica's own optimizer (torch's wrapper, kept while a global hook exists)
    assert sorted(seen) == ["mirrored"] * 4 + ["plain"] * 2 + ["replica"] * 4
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------- parameter groups changed
def _groups_edits() -> dict[str, Callable[[mirrored.MirroredOptimizer], None]]:
    extra = nn.Parameter(torch.ones(2, dtype=torch.float64))

    def append(opt: mirrored.MirroredOptimizer) -> None:
        opt.param_groups.append({**{k: v for k, v in opt.param_groups[0].items()
                                    if k != "params"}, "params": [extra]})

    def shrink(opt: mirrored.MirroredOptimizer) -> None:
        opt.param_groups[0]["params"] = opt.param_groups[0]["params"][:2]

    def pop(opt: mirrored.MirroredOptimizer) -> None:
        opt.param_groups[0]["params"].pop()

    def move(opt: mirrored.MirroredOptimizer) -> None:  # (to a group of its own)
        p = opt.param_groups[0]["params"].pop()
        opt.param_groups.append({**{k: v for k, v in opt.param_groups[0].items()
                                    if k != "params"}, "params": [p], "lr": 0.5})

    def inner_add(opt: mirrored.MirroredOptimizer) -> None:
        opt.optimizers[0].add_param_group({"params": [extra]})

    def other_replica(opt: mirrored.MirroredOptimizer) -> None:
        opt.optimizers[1].param_groups[0]["params"].pop()

    return {"append": append, "shrink": shrink, "pop": pop, "move": move,
            "inner_add": inner_add, "other_replica": other_replica}


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("edit", sorted(_groups_edits()))
def test_parameter_groups_changed_outside_run_are_refused_before_any_copy_steps(
        edit: str, n: int) -> None:
    """On one device a parameter taken out of (or moved between) the optimizer's groups
    stops training (or trains at its new group's rate). The other replicas' optimizers
    were built by make_optimizer and kept their groups: replica 0 trained one model and
    the others another (``shrink``: silently, until a checked step), or a bare
    ``zip()`` ValueError came from deep inside (``append``)."""
    strategy, model, opt, _ = replicas(n, lambda p: optim.SGD(p, lr=0.1, momentum=0.9), steps=1)
    try:
        before = [p.detach().clone() for p in model.replicas[0].parameters()]
        _groups_edits()[edit](opt)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            mirrored.compute_average_loss(loss_rows(model(x), y)).backward()
            opt.step()

        x, y = batches(2)[1]
        with pytest.raises(RuntimeError, match=r"parameter groups .*changed since "
                                               r"make_optimizer built them"):
            strategy.run(step, args=(split(x, n), split(y, n)))
        for copy in model.replicas:  # no copy stepped
            for p, q in zip(copy.parameters(), before, strict=True):
                assert torch.equal(p.detach(), q)
    finally:
        strategy.close()


def test_parameter_group_values_changed_outside_run_still_train_as_one_device() -> None:
    """What stays allowed: any value of a group (not its parameters) set between steps."""
    ref, ref_opt, _ = one_device(lambda p: optim.SGD(p, lr=0.1, momentum=0.9), steps=0)
    strategy, model, opt, _ = replicas(2, lambda p: optim.SGD(p, lr=0.1, momentum=0.9), steps=0)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        mirrored.compute_average_loss(loss_rows(model(x), y)).backward()
        opt.step()

    for i, (x, y) in enumerate(batches(4)):
        for o in (ref_opt, opt):
            o.param_groups[0]["lr"] = 0.1 / (i + 1)
            o.param_groups[0]["momentum"] = 0.5 + 0.1 * i
        ref_opt.zero_grad()
        loss_rows(ref(x), y).mean().backward()
        ref_opt.step()
        strategy.run(step, args=(split(x, 2), split(y, 2)))
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-12)
    assert_same(ref_opt.state_dict(), opt.state_dict())
    opt.load_state_dict(ref_opt.state_dict())  # (its groups: still the same parameters)
    strategy.run(step, args=(split(x, 2), split(y, 2)))
    strategy.close()
