"""PerReplica / Mirrored, regroup, local results, values from a function."""

import collections
import dataclasses

import pytest
import torch

import mirrored
from mirrored._src.values import regroup

Pair = collections.namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: int


def test_repr_and_devices():
    v = mirrored.PerReplica([torch.tensor(0), torch.tensor(1)], devices=["CPU:0", "cpu:1"])
    assert repr(v) == "PerReplica:{0: tensor(0), 1: tensor(1)}"
    assert v.devices == ("/job:localhost/replica:0/task:0/device:CPU:0",
                         "/job:localhost/replica:0/task:0/device:CPU:1")
    m = mirrored.Mirrored([1.0, 1.0])
    assert repr(m) == "Mirrored:{0: 1.0, 1: 1.0}"
    assert m.devices == ("/job:localhost/replica:0/task:0/device:CPU:0",) * 2


def test_no_attribute_forwarding():
    v = mirrored.PerReplica([torch.tensor([1.0]), torch.tensor([2.0])])
    with pytest.raises(AttributeError):
        _ = v.shape  # type: ignore[attr-defined]
    with pytest.raises(TypeError):
        _ = v + 1  # type: ignore[operator]


def test_constructor_errors():
    with pytest.raises(ValueError, match="at least one component"):
        mirrored.PerReplica([])
    with pytest.raises(ValueError, match="got 2 values but 1 devices"):
        mirrored.PerReplica([1, 2], devices=["CPU:0"])
    with pytest.raises(TypeError, match="takes a sequence with one value per replica"):
        mirrored.PerReplica(torch.tensor([1, 2]))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="abstract"):
        mirrored.DistributedValues([1])


def test_regroup_collapses_identical_objects_only():
    shared = torch.tensor(5)
    a, b = torch.tensor(1), torch.tensor(2)
    out = regroup([{"s": shared, "v": a}, {"s": shared, "v": b}], ("CPU:0", "CPU:1"))
    assert out["s"] is shared
    assert isinstance(out["v"], mirrored.PerReplica)
    assert out["v"].values == (a, b)
    assert regroup([a], ("CPU:0",)) is a


@pytest.mark.parametrize("replicas", [2, 4])
def test_equal_numbers_returned_by_run_stay_per_replica(replicas):
    # Python caches small ints, so equal counts (.item(), len()) are one object and
    # came back as a plain value: a SUM then raised on exactly the batches where the
    # counts tied (and, across workers, counted them once per worker).
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    y = torch.arange(4 * replicas)
    for predictions in (y.clone(), torch.where(y % 2 == 0, y, -1), torch.full_like(y, -1)):
        chunks = mirrored.PerReplica(list(predictions.chunk(replicas)))
        labels = mirrored.PerReplica(list(y.chunk(replicas)))
        correct = strategy.run(lambda p, t: (p == t).sum().item(), args=(chunks, labels))
        assert isinstance(correct, mirrored.PerReplica)
        assert strategy.reduce("SUM", correct, axis=None).item() == (predictions == y).sum()
        sizes = strategy.run(lambda t: {"n": len(t), "f": 0.5, "ok": True}, args=(labels,))
        assert sizes["n"].values == (4,) * replicas and sizes["ok"] is True
        assert strategy.reduce("SUM", sizes["n"], axis=None).item() == len(y)
        assert strategy.reduce("SUM", sizes["f"], axis=None).item() == 0.5 * replicas
        assert strategy.extended.reduce_to("SUM", sizes["n"], "CPU:0").item() == len(y)
    # ... and still compares equal to the number they all are, as TF's plain value did
    assert strategy.run(lambda: 5) == 5 and strategy.run(lambda: 5) != 6
    assert strategy.run(lambda: 0.5) == 0.5
    assert mirrored.PerReplica([torch.tensor(1)] * replicas) != 1  # (tensors: themselves)
    # merge_call's arguments keep TF's rule (the same object stays as it is)
    merged = strategy.run(lambda: mirrored.get_replica_context().merge_call(
        lambda _, n: type(n) is int and n == 3, args=(3,)))
    assert merged is True
    strategy.close()


def test_regroup_structure_mismatch_names_path_and_replicas():
    with pytest.raises(ValueError, match=r"at result\['x'\]\[1\], replica 0 returned a leaf "
                                         r"\(int\) but replica 2 returned a list of 2"):
        regroup([{"x": [1, 2]}, {"x": [3, 4]}, {"x": [5, [6, 7]]}], ("a", "b", "c"))
    with pytest.raises(ValueError, match=r"at result\['y'\], replica 0 returned nothing but "
                                         r"replica 1 returned a leaf \(int\)"):
        regroup([{"x": 1}, {"x": 1, "y": 2}], ("a", "b"))


def test_run_regroups_nests(two):
    shared = torch.zeros(1)

    def step():
        i = mirrored.get_replica_context().replica_id_in_sync_group
        return {"pair": Pair(torch.tensor(i), shared), "batch": Batch(torch.tensor([i]), 7),
                "none": None}

    out = two.run(step)
    assert isinstance(out["pair"], Pair)
    assert isinstance(out["pair"].a, mirrored.PerReplica)
    assert out["pair"].b is shared
    assert isinstance(out["batch"], Batch)
    assert out["batch"].y.values == (7, 7)  # (a number: one per replica)
    assert [t.item() for t in out["batch"].x.values] == [0, 1]
    assert out["none"] is None
    locals_ = two.experimental_local_results(out)
    assert locals_[1]["batch"].x.item() == 1
    assert locals_[0]["pair"].a.item() == 0


def test_run_structure_mismatch(two):
    def step():
        i = mirrored.get_replica_context().replica_id_in_sync_group
        return [1] * (i + 1)

    with pytest.raises(ValueError, match="replicas returned different structures"):
        two.run(step)


def test_local_results_of_plain_and_distributed(two):
    v = mirrored.PerReplica([torch.tensor(0), torch.tensor(1)])
    assert two.experimental_local_results(v) == v.values
    assert two.experimental_local_results(3) == (3, 3)  # once per replica, as TF
    nest = two.experimental_local_results([v, "s"])
    assert nest[0][0].item() == 0 and nest[1][0].item() == 1 and nest[1][1] == "s"


def test_wrong_component_count_rejected_everywhere(two):
    v = mirrored.PerReplica([torch.tensor(0.0)] * 3)
    match = r"is a PerReplica with 3 components but this strategy has 2 replicas"
    with pytest.raises(ValueError, match=r"value " + match):
        two.reduce("SUM", v)
    with pytest.raises(ValueError, match=r"value\['a'\] " + match):
        two.gather({"a": v}, axis=0)
    with pytest.raises(ValueError, match=r"value " + match):
        two.experimental_local_results(v)
    with pytest.raises(ValueError, match=r"args\[1\]\['k'\] " + match):
        two.run(lambda a, b: a, args=(1, {"k": v}))
    with pytest.raises(ValueError, match=r"kwargs\['x'\] " + match):
        two.run(lambda x: x, kwargs={"x": v})


def test_distribute_values_from_function(two):
    seen = []

    def value_fn(ctx):
        seen.append(ctx)
        return {"x": torch.tensor(ctx.replica_id_in_sync_group * 10), "k": "same"}

    out = two.experimental_distribute_values_from_function(value_fn)
    assert seen == [mirrored.ValueContext(0, 2), mirrored.ValueContext(1, 2)]
    assert isinstance(out["x"], mirrored.PerReplica)
    assert [t.item() for t in out["x"].values] == [0, 10]
    # always a PerReplica, even where replicas return the same object
    assert isinstance(out["k"], mirrored.PerReplica)
    one = mirrored.OneDeviceStrategy("CPU:0")
    assert one.experimental_distribute_values_from_function(lambda c: 4) == 4
