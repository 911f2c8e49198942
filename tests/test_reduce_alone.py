"""`reduce` with one replica in all takes a shortcut (no communicator): its results,
dtypes and errors equal torch's own reductions and the rules of the general path
(which passes these tests too), and never alias the input."""

from __future__ import annotations

import pytest
import torch

import mirrored

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("op", ["SUM", "MEAN", "MIN", "MAX"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int8])
@pytest.mark.parametrize("axis", [0, 1, -1, (0, 1), ()])
def test_one_replica_reduce_matches_torch(op: str, dtype: torch.dtype, axis: object) -> None:
    one = mirrored.MirroredStrategy(["CPU:0"])
    value = torch.arange(12).reshape(3, 4).to(dtype)
    before = value.clone()
    got = one.reduce(op, value, axis=axis)
    dims = (axis,) if isinstance(axis, int) else axis
    if op == "MEAN":
        result = {torch.int32: torch.float64, torch.int8: torch.float32}.get(dtype, dtype)
        count = 1
        for d in dims:
            count *= value.shape[d]
        expected = (value.to(torch.float64).sum(dim=dims) if dims else value.to(
            torch.float64)) / count
        expected = expected.to(result)
    elif op == "SUM":
        expected = value.sum(dim=dims, dtype=dtype) if dims else value
    else:
        fn = torch.amin if op == "MIN" else torch.amax
        expected = fn(value, dim=dims) if dims else value
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert torch.equal(value, before)  # the input is untouched
    if not dims:
        assert got.data_ptr() != value.data_ptr()  # a result of its own, never the input
    one.close()


def test_one_replica_reduce_edge_cases() -> None:
    one = mirrored.MirroredStrategy(["CPU:0"])
    assert torch.isnan(one.reduce("MEAN", torch.zeros(0), axis=0))
    with pytest.raises(ValueError, match="has no elements to reduce"):
        one.reduce("MIN", torch.zeros(0), axis=0)
    with pytest.raises(ValueError, match="axis 2"):
        one.reduce("SUM", torch.zeros(3), axis=2)
    with pytest.raises(TypeError):
        one.reduce("SUM", torch.zeros(3, dtype=torch.bool), axis=0)
    x = torch.ones(4, requires_grad=True)
    assert not one.reduce("SUM", x * 2, axis=0).requires_grad  # results are detached
    one.close()


@pytest.mark.parametrize("op", ["SUM", "MEAN", "MAX"])
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_reduce_to_of_a_nest_on_any_number_of_replicas(op: str, replicas: int) -> None:
    # A nest of per-replica values (what distribute_values_from_function makes of a
    # function returning a dict) reduces leaf by leaf; with one replica that nest's
    # leaves are the replica's values (it was refused as "got dict").
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    g = torch.Generator().manual_seed(replicas)
    a, b = torch.randn(replicas, 3, generator=g), torch.randn(replicas, 2, 2, generator=g)
    value = strategy.experimental_distribute_values_from_function(
        lambda c: {"a": a[c.replica_id_in_sync_group],
                   "b": (b[c.replica_id_in_sync_group], None)})
    fold = {"SUM": lambda t: t.sum(0), "MEAN": lambda t: t.mean(0),
            "MAX": lambda t: t.amax(0)}[op]
    single = strategy.extended.reduce_to(op, value, destinations="CPU:0")
    batched, again = strategy.extended.batch_reduce_to(
        op, [(value, "CPU:0"), ({"c": torch.tensor(5.0)}, "CPU:0")] if op != "SUM"
        else [(value, "CPU:0"), (value, "CPU:0")])
    for got in (single, batched):
        assert set(got) == {"a", "b"} and got["b"][1] is None
        torch.testing.assert_close(got["a"], fold(a))
        torch.testing.assert_close(got["b"][0], fold(b))
    if op != "SUM":  # a value that is not per-replica: every replica's
        torch.testing.assert_close(again["c"], torch.tensor(5.0))
    strategy.close()
