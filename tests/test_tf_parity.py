"""Programs whose results TF and mirrored must agree on (each TF result is written in
the test, as TF 2.x prints it, converted to torch)."""

import pytest
import torch

import mirrored

pytestmark = pytest.mark.timeout(30)


def pr(*values):
    return mirrored.PerReplica([torch.as_tensor(v) for v in values], devices=["CPU:0", "CPU:1"])


def test_the_default_strategy_works_inside_its_own_scope():
    default = mirrored.get_strategy()
    with default.scope():
        assert mirrored.get_strategy() is default
        assert mirrored.get_strategy().run(lambda: 1) == 1  # TF: 1
        x = torch.tensor([1.0, 2.0])
        assert torch.equal(default.reduce("MEAN", x), x)  # TF: the value
        assert torch.equal(default.reduce("SUM", x, axis=0), torch.tensor(3.0))
        assert default.gather(x, axis=0) is x  # TF: the value
        assert torch.equal(default.extended.reduce_to("SUM", x, "CPU:0"), x)


def test_a_mirrored_scope_inside_the_default_scope():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    with mirrored.get_strategy().scope():
        with strategy.scope():  # TF allows it
            assert mirrored.get_strategy() is strategy
            assert mirrored.in_cross_replica_context()
        assert not mirrored.has_strategy()
    other = mirrored.MirroredStrategy(["CPU:0"])
    with strategy.scope(), pytest.raises(RuntimeError, match="cannot enter the scope"), \
            other.scope():
        pass


def test_reduce_to_maps_over_a_nest(two):
    out = two.extended.reduce_to("SUM", {"a": pr(1.0, 2.0), "b": [pr(3, 4)]}, "CPU:0")
    # TF: {'a': <tf.Tensor: 3.0>, 'b': [<tf.Tensor: 7>]}
    assert set(out) == {"a", "b"}
    assert out["a"].item() == 3.0 and out["b"][0].item() == 7
    both = two.extended.batch_reduce_to("MEAN", [({"a": pr(1.0, 2.0)}, pr(0.0, 0.0))])
    assert [t.item() for t in both[0]["a"].values] == [1.5, 1.5]


def test_local_results_of_values_without_distributed_leaves(two):
    assert two.experimental_local_results([1, 2]) == ([1, 2], [1, 2])  # TF: ([1, 2], [1, 2])
    same = torch.tensor(5.0)
    result = two.run(lambda: same)  # every replica returns the same object
    assert result is same
    assert two.experimental_local_results(result) == (same, same)  # TF: one per replica


def test_distribute_values_gives_per_replica_values():
    two = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    none = two.experimental_distribute_values_from_function(lambda ctx: None)
    assert isinstance(none, mirrored.PerReplica) and none.values == (None, None)  # TF: PerReplica
    one = mirrored.MirroredStrategy(["CPU:0"])
    value = one.experimental_distribute_values_from_function(lambda ctx: torch.tensor(7))
    assert isinstance(value, mirrored.PerReplica) and value.values[0].item() == 7  # TF too
    # OneDeviceStrategy and the default strategy give the raw value, as TF does.
    assert mirrored.OneDeviceStrategy("CPU:0").experimental_distribute_values_from_function(
        lambda ctx: 3) == 3
    assert mirrored.get_strategy().experimental_distribute_values_from_function(
        lambda ctx: 3) == 3


def test_broadcast_to_a_mirrored_value_broadcasts_its_value(two):
    m = mirrored.Mirrored([torch.tensor(2.0), torch.tensor(2.0)])
    out = two.extended.broadcast_to(m, pr(0.0, 0.0))
    assert isinstance(out, mirrored.Mirrored)
    assert [t.item() for t in out.values] == [2.0, 2.0]  # TF: Mirrored of 2.0
    with pytest.raises(ValueError, match="broadcast_to got a PerReplica"):
        two.extended.broadcast_to(pr(1.0, 2.0), "CPU:0")
