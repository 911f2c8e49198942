"""Contexts and scope: default strategy, scope nesting, replica vs cross-replica."""

import threading

import pytest
import torch

import mirrored


def test_default_strategy_outside_any_scope():
    default = mirrored.get_strategy()
    assert default.num_replicas_in_sync == 1
    assert not mirrored.has_strategy()
    assert mirrored.get_replica_context() is not None
    assert mirrored.get_replica_context().replica_id_in_sync_group == 0
    assert mirrored.get_cross_replica_context() is None
    assert not mirrored.in_cross_replica_context()
    x = torch.tensor([1, 2])
    assert default.run(lambda: x) is x
    assert default.reduce("MEAN", x) is x
    assert torch.equal(default.reduce("SUM", x), x)
    assert default.experimental_local_results(x) == (x,)  # one replica


def test_scope_makes_strategy_current(two):
    with two.scope() as entered:
        assert entered is two
        assert mirrored.get_strategy() is two
        assert mirrored.has_strategy()
        assert mirrored.in_cross_replica_context()
        assert mirrored.get_cross_replica_context() is two
        assert mirrored.get_replica_context() is None
        with two.scope():  # nesting the same strategy is allowed
            assert mirrored.get_strategy() is two
    assert not mirrored.has_strategy()


def test_mixing_strategies_raises(two):
    other = mirrored.MirroredStrategy(["CPU:0"])
    with two.scope(), pytest.raises(RuntimeError, match=r"cannot enter the scope of "
                                                        r"MirroredStrategy\(devices=\['CPU:0'\]\)"
                                                        r" inside the scope of "
                                                        r"MirroredStrategy\(devices=\['CPU:0', "
                                                        r"'CPU:1'\]\)"), other.scope():
        pass


def test_replica_context_inside_run(two):
    def step():
        ctx = mirrored.get_replica_context()
        return (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync, ctx.strategy,
                mirrored.get_strategy(), mirrored.in_cross_replica_context(),
                mirrored.get_cross_replica_context(), ctx.devices, mirrored.has_strategy())

    results = two.experimental_local_results(two.run(step))
    for i, (rid, n, strategy, current, cross, cross_ctx, devices, has) in enumerate(results):
        assert rid == i and type(rid) is int
        assert n == 2
        assert strategy is two and current is two
        assert cross is False and cross_ctx is None and has is True
        assert devices == (f"/job:localhost/replica:0/task:0/device:CPU:{i}",)


def test_scope_is_per_thread(two):
    seen = []
    with two.scope():
        thread = threading.Thread(target=lambda: seen.append(mirrored.has_strategy()))
        thread.start()
        thread.join(5)
    assert seen == [False]


@pytest.mark.parametrize("method", ["reduce", "gather"])
def test_cross_replica_methods_refuse_replica_context(two, method):
    def step():
        if method == "reduce":
            return two.reduce("SUM", torch.tensor(1.0))
        return two.gather(torch.tensor([1.0]), axis=0)

    with pytest.raises(RuntimeError, match=rf"MirroredStrategy.{method} requires cross-replica "
                                           r"context; use get_replica_context\(\).merge_call\(\)"
                                           r" or call it outside strategy.run"):
        two.run(step)


def test_nested_run_raises(two):
    with pytest.raises(RuntimeError, match="run cannot be called inside a replica"):
        two.run(lambda: two.run(lambda: 1))
