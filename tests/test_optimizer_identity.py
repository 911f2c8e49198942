"""Two mirrored optimizers whose steps meet across replicas or workers are a
`CollectiveMismatchError` naming both, on every path the step's gradients take: the
host sum (2 replicas), the packed all-reduce (3 replicas), gradient buckets, and
across workers (one and two local replicas, with and without buckets), under every
``check``. Before, a step of optimizer #1 on some replicas and of #2 on the others
summed the two models' gradients into one (models of the same shapes): with
``check="off"`` a silent wrong step, and with the default check a
`ReplicaDivergenceError` blaming a manual update.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mirrored
from mirrored._src.training import overlap as overlap_module
from mirrored.experimental import CommunicationOptions


def _pair(strategy: mirrored.Strategy, check: str, overlap: bool, width: int = 40
          ) -> tuple[list[mirrored.MirroredModule], list[torch.optim.Optimizer]]:
    """Two models of the same shapes (and the same initial values: the copies'
    fingerprints cannot tell them apart) and their mirrored optimizers; ``width``
    400: 1.2 MiB of parameters, past the host sum's limit on 3 replicas."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(strategy.mirror(nn.Sequential(nn.Linear(width, width),
                                                     nn.Linear(width, width))))
    opts = [strategy.mirror_optimizer(m, lambda p: torch.optim.SGD(p, lr=0.1), check=check,
                                      overlap=overlap) for m in models]
    return models, opts


def _crossed_step(models: list[mirrored.MirroredModule], opts: list[torch.optim.Optimizer],
                  which: int, width: int = 40) -> None:
    """A step where this replica trains model ``which`` only (the others the other)."""
    loss = models[which](torch.ones(2, width)).sum(1)
    mirrored.compute_average_loss(loss, global_batch_size=4).backward()
    opts[which].step()


def _params(model: mirrored.MirroredModule) -> list[torch.Tensor]:
    return [p.detach().clone() for c in model.replicas for p in c.parameters()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("check", ["off", "cheap", "full"])
@pytest.mark.parametrize(("replicas", "overlap"), [(2, False), (3, False), (3, True)])
def test_replicas_stepping_different_optimizers_raise_naming_both(
        monkeypatch: pytest.MonkeyPatch, replicas: int, overlap: bool, check: str) -> None:
    monkeypatch.setattr(overlap_module, "DEFAULT_BUCKET_BYTES", 4096)  # (overlap: 2 buckets)
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    try:
        width = 40 if replicas == 2 else 400
        models, opts = _pair(strategy, check, overlap, width)
        reducers = [o._reducer for o in opts]  # type: ignore[attr-defined]
        # (the path under test: the host sum on 2 replicas, else the packed all-reduce,
        # with buckets when asked)
        assert [r._host_sum is not None for r in reducers] == [replicas == 2] * 2
        assert [r.buckets is not None for r in reducers] == [overlap] * 2
        before = [_params(m) for m in models]

        def step() -> None:
            r = mirrored.get_replica_context().replica_id_in_sync_group
            _crossed_step(models, opts, min(r, 1), width)

        with pytest.raises(mirrored.CollectiveMismatchError) as raised:
            strategy.run(step)
        message = str(raised.value)
        assert "MirroredOptimizer.step (the optimizer of mirrored model #1)" in message
        assert "MirroredOptimizer.step (the optimizer of mirrored model #2)" in message
        for model, params in zip(models, before, strict=True):  # no step was applied
            assert all(torch.equal(a, b) for a, b in zip(_params(model), params, strict=True))
    finally:
        strategy.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("replicas", [2, 3])
def test_two_optimizers_stepped_alike_train_each_model_as_one_device(replicas: int) -> None:
    """The numbers only name the calls: every replica stepping both optimizers, in
    the same order, trains each model as one device does."""
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    try:
        models, opts = _pair(strategy, "cheap", False)
        x = torch.randn(3 * replicas, 40, generator=torch.Generator().manual_seed(1))
        plain = [nn.Sequential(nn.Linear(40, 40), nn.Linear(40, 40)) for _ in range(2)]
        for net, model, scale in zip(plain, models, (1.0, 2.0), strict=True):
            net.load_state_dict(model.replicas[0].state_dict())
            (scale * net(x).sum(1)).mean().backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= 0.1 * p.grad

        def step(xs: torch.Tensor) -> None:
            for model, opt, scale in zip(models, opts, (1.0, 2.0), strict=True):
                mirrored.compute_average_loss(scale * model(xs).sum(1)).backward()
                opt.step()

        dist_x = strategy.experimental_distribute_values_from_function(
            lambda ctx: x.chunk(replicas)[ctx.replica_id_in_sync_group])
        strategy.run(step, args=(dist_x,))
        for model, net in zip(models, plain, strict=True):
            for copy in model.replicas:
                for a, b in zip(copy.parameters(), net.parameters(), strict=True):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    finally:
        strategy.close()


def _crossed_workers(local: int, check: str, bucket_bytes: int) -> dict[str, object]:
    overlap_module.DEFAULT_BUCKET_BYTES = bucket_bytes  # (this worker process only)
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=30),
        devices=[f"CPU:{i}" for i in range(local)])
    try:
        models, opts = _pair(strategy, check, True)  # (overlap: the default across workers)
        buckets = [o._reducer.buckets is not None for o in opts]  # type: ignore[attr-defined]
        before = [_params(m) for m in models]
        worker = strategy.cluster_resolver.task_id
        try:
            strategy.run(_crossed_step, args=(models, opts, worker))
            error = "no error"
        except mirrored.CollectiveMismatchError as caught:
            error = str(caught)
        unchanged = [all(torch.equal(a, b) for a, b in zip(_params(m), p, strict=True))
                     for m, p in zip(models, before, strict=True)]
        return {"error": error, "unchanged": unchanged, "buckets": buckets}
    finally:
        strategy.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize(("local", "check", "bucket_bytes"), [
    (1, "off", 25 << 20), (1, "cheap", 4096), (2, "off", 25 << 20), (2, "cheap", 4096)])
def test_workers_stepping_different_optimizers_raise_naming_both(
        local: int, check: str, bucket_bytes: int) -> None:
    results = mirrored.testing.run_multi_process(_crossed_workers, 2,
                                                 args=(local, check, bucket_bytes), timeout=110)
    for result in results:
        assert result["buckets"] == [bucket_bytes == 4096] * 2
        assert "the optimizer of mirrored model #1" in result["error"], result["error"]
        assert "the optimizer of mirrored model #2" in result["error"], result["error"]
        assert result["unchanged"] == [True, True]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("concurrent", [False, True])
@pytest.mark.parametrize(("replicas", "width", "check", "which"), [
    (2, 40, "cheap", "original"), (2, 40, "full", "replicas[0]"),
    (3, 400, "cheap", "original"), (3, 40, "cheap", "replicas[1]")])
def test_a_step_running_another_replicas_copy_is_refused_naming_the_cause(
        replicas: int, width: int, check: str, which: str, concurrent: bool) -> None:
    """The port that keeps calling the module given to ``mirror`` (replica 0's copy)
    or ``model.replicas[i]``: every replica's backward reaches that copy."""
    options = CommunicationOptions(timeout_seconds=60) if concurrent else None
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)],
                                         communication_options=options)
    try:
        net = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 3))
        model = strategy.mirror(net)
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1),
                                        check=check)
        wrong = net if which == "original" else model.replicas[int(which[-2])]
        copy = 0 if which == "original" else int(which[-2])
        before = _params(model)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            loss = nn.functional.cross_entropy(wrong(x), y, reduction="none")
            mirrored.compute_average_loss(loss).backward()
            opt.step()

        x, y = torch.randn(4 * replicas, width), torch.randint(0, 3, (4 * replicas,))
        xb, yb = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
        # (the crossing, or, when the owner's step looks before another replica's hook
        # ran but after its accumulation into an unhooked parameter, the in-place
        # change with this cause named)
        with pytest.raises(mirrored.ReplicaDivergenceError,
                           match=rf"(replica \d's backward\(\) reached replica {copy}'s copy "
                                 r"of the mirrored model: the step function ran a module other "
                                 r"than the mirrored model .* Call the mirrored model itself)|("
                                 r"changed in place on replica .* another replica's backward\(\) "
                                 r"may have reached this replica's copy)"):
            strategy.run(step, args=(xb, yb))
        assert all(torch.equal(a, b) for a, b in zip(_params(model), before, strict=True))
        strategy.run(lambda: None)  # (waits for a replica the refused run left running)
        opt.zero_grad()  # (the refused step's gradients are dropped without a second error)
    finally:
        strategy.close()


@pytest.mark.timeout(60)
def test_each_replica_calling_the_mirrored_model_is_not_a_crossing() -> None:
    """Submodules reached through the mirrored model, a second backward, sync
    BatchNorm's backward all-reduce, activation checkpointing and a GradScaler: each
    replica's backward reaches only its own copy."""
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        model = strategy.mirror(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8),
                                              nn.Linear(8, 2)), sync_batch_norm=True)
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
        scaler = torch.amp.GradScaler("cpu")

        def step(x: torch.Tensor) -> None:
            # (zero_grad first: left gradients under a backward through submodules
            # raise, see test_carried_gradients)
            opt.zero_grad()
            h = torch.utils.checkpoint.checkpoint(model[0], x, use_reentrant=False)
            mirrored.compute_average_loss(model[2](model[1](h)).sum(1)).backward()
            scaler.scale(mirrored.compute_average_loss(model(x).sum(1))).backward()
            scaler.step(opt)
            scaler.update()

        for _ in range(3):
            strategy.run(step, args=(torch.randn(2, 8),))
        assert opt._reducer._watch.crossed == [None]  # type: ignore[attr-defined]
    finally:
        strategy.close()


def _extra_optimizer_on_worker_0() -> str:
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=30), devices=["CPU:0"])
    try:
        torch.manual_seed(0)
        model = strategy.mirror(nn.Linear(4, 1))
        if strategy.cluster_resolver.task_id == 0:  # built here only, never stepped
            strategy.mirror_optimizer(model, lambda p: torch.optim.Adam(p))
        strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=1.0))
        return "no error"
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    finally:
        strategy.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_an_optimizer_built_on_one_worker_only_is_refused_on_every_worker() -> None:
    """``mirror_optimizer`` agrees on the optimizer's settings across workers (a
    collective, as ``mirror`` is), so every worker builds the same mirrored optimizers
    in the same order: an extra one on one worker is a mismatch naming both calls."""
    results = mirrored.testing.run_multi_process(_extra_optimizer_on_worker_0, 2, timeout=110)
    for message in results:
        assert message.startswith("CollectiveMismatchError: workers made different calls"), \
            message
        assert message.count("Strategy.mirror_optimizer(agree(the mirrored optimizer's "
                             "settings)) at test_optimizer_identity.py:") == 2, message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("replicas", [2, 3])
def test_two_optimizers_of_one_model_over_other_parameters_raise_naming_both(
        replicas: int) -> None:
    """One model, one optimizer per layer: a replica stepping the first layer's while
    another steps the second's would sum one layer's gradients into the other's."""
    width = 40 if replicas == 2 else 400
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    try:
        model = strategy.mirror(nn.Sequential(nn.Linear(width, width), nn.Linear(width, width)))
        opts = [strategy.mirror_optimizer(model, lambda p, k=k: torch.optim.SGD(
            list(p)[2 * k:2 * k + 2], lr=0.1), check="off") for k in range(2)]
        before = _params(model)

        def step() -> None:
            r = mirrored.get_replica_context().replica_id_in_sync_group
            loss = model(torch.ones(2, width)).sum(1)
            mirrored.compute_average_loss(loss, global_batch_size=4).backward()
            opts[min(r, 1)].step()

        with pytest.raises(mirrored.CollectiveMismatchError) as raised:
            strategy.run(step)
        for part in ("0-1", "2-3"):
            assert (f"MirroredOptimizer.step (the optimizer of mirrored model #1, parameters "
                    f"{part})") in str(raised.value)
        assert all(torch.equal(a, b) for a, b in zip(_params(model), before, strict=True))
    finally:
        strategy.close()
