"""all_reduce, all_gather and merge_call against single-replica references, 1-8 replicas."""

import threading
import time

import numpy as np
import pytest
import torch

import mirrored

pytestmark = pytest.mark.timeout(60)

REPLICAS = [1, 2, 3, 4, 8]


def rid():
    return mirrored.get_replica_context().replica_id_in_sync_group


def inputs(i):
    """Replica i's closed-form inputs: a nest of several dtypes (int8 near its limits)."""
    return {"w": torch.arange(6.0).reshape(2, 3) * (i + 1),
            "b": [torch.tensor([i, -i, 2 * i], dtype=torch.int32), torch.tensor(float(i)),
                  torch.tensor([120 - i, -120 + i], dtype=torch.int8)]}


@pytest.mark.parametrize("n", REPLICAS)
@pytest.mark.parametrize("op", ["SUM", "MEAN", "MIN", "MAX"])
def test_all_reduce_of_a_nest_matches_reference(strategies, n, op):
    strategy = strategies[n]
    results = strategy.experimental_local_results(
        strategy.run(lambda: mirrored.get_replica_context().all_reduce(op, inputs(rid()))))
    everyone = [inputs(i) for i in range(n)]
    for result in results:
        for path in [("w",), ("b", 0), ("b", 1), ("b", 2)]:
            values = [e[path[0]] if len(path) == 1 else e[path[0]][path[1]] for e in everyone]
            got = result[path[0]] if len(path) == 1 else result[path[0]][path[1]]
            expected = single_replica_reference(op, values)
            assert got.dtype == expected.dtype
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


def single_replica_reference(op, values):
    stacked = torch.stack(values)
    if op == "SUM":
        return stacked.sum(0, dtype=values[0].dtype)
    if op == "MEAN":  # exact (int64) sums for integers, then true division
        if values[0].is_floating_point():
            return stacked.sum(0) / len(values)
        narrow = values[0].dtype in (torch.int8, torch.uint8, torch.int16)
        dtype = torch.float32 if narrow else torch.float64
        return stacked.sum(0, dtype=torch.int64).to(dtype) / len(values)
    return stacked.amin(0) if op == "MIN" else stacked.amax(0)


@pytest.mark.parametrize("n", REPLICAS)
def test_all_reduce_mean_with_axis_is_the_mean_over_uneven_batches(strategies, n):
    strategy = strategies[n]
    batches = [torch.arange(float(i * 10), float(i * 10 + i % 3)) for i in range(n)]

    def step():
        return mirrored.get_replica_context().all_reduce("MEAN", batches[rid()], axis=0)

    results = strategy.experimental_local_results(strategy.run(step))
    concatenated = torch.cat(batches)
    expected = concatenated.mean() if concatenated.numel() else torch.tensor(float("nan"))
    for r in results:
        torch.testing.assert_close(r, expected, equal_nan=True)


def test_all_reduce_with_axis_tuples_and_negative_axes(strategies):
    strategy = strategies[3]
    parts = [torch.arange(12.0).reshape(3, 4)[: i + 1] for i in range(3)]

    def step():
        ctx = mirrored.get_replica_context()
        x = parts[rid()]
        return (ctx.all_reduce("SUM", x, axis=(0, -1)), ctx.all_reduce("MAX", x, axis=-2),
                ctx.all_reduce("MEAN", x, axis=0), ctx.all_reduce("MIN", x[:1], axis=()))

    total, maximum, mean, elementwise = strategy.experimental_local_results(
        strategy.run(step))[2]
    cat = torch.cat(parts)
    assert total.item() == cat.sum().item()
    assert torch.equal(maximum, cat.amax(0))
    torch.testing.assert_close(mean, cat.mean(0))
    assert torch.equal(elementwise, parts[0][:1])  # every replica starts with row 0


def test_all_reduce_min_max_with_empty_replicas(strategies):
    strategy = strategies[2]
    parts = [torch.tensor([3, -2, 5]), torch.zeros(0, dtype=torch.int64)]

    def step():
        ctx = mirrored.get_replica_context()
        return ctx.all_reduce("MIN", parts[rid()], axis=0), ctx.all_reduce("MAX", parts[rid()],
                                                                          axis=0)

    for low, high in strategy.experimental_local_results(strategy.run(step)):
        assert (low.item(), high.item()) == (-2, 5)

    def all_empty():
        return mirrored.get_replica_context().all_reduce("MIN", torch.zeros(0), axis=0)

    with pytest.raises(ValueError, match=r"all_reduce\(MIN, axis=0\) has no elements to reduce "
                                         r"at value"):
        strategy.run(all_empty)


def test_each_replica_gets_its_own_copy(strategies):
    strategy = strategies[2]

    def step():
        ctx = mirrored.get_replica_context()
        out = ctx.all_reduce("SUM", torch.ones(3))
        gathered = ctx.all_gather(torch.ones(2), axis=0)
        if rid() == 1:
            out.add_(100)
            gathered.add_(100)
        ctx.merge_call(lambda s: None)  # make replica 0 wait until replica 1 has mutated
        return out, gathered

    (out0, g0), (out1, g1) = strategy.experimental_local_results(strategy.run(step))
    assert out0.tolist() == [2.0] * 3 and out1.tolist() == [102.0] * 3
    assert g0.tolist() == [1.0] * 4 and g1.tolist() == [101.0] * 4


@pytest.mark.parametrize("n", REPLICAS)
def test_all_gather_uneven_along_axis(strategies, n):
    strategy = strategies[n]
    parts = [torch.full((i % 3, 2), float(i)) for i in range(n)]
    other = [torch.arange(3 * (i + 1)).reshape(3, i + 1) for i in range(n)]

    def step():
        ctx = mirrored.get_replica_context()
        return (ctx.all_gather({"rows": parts[rid()], "twice": [parts[rid()]]}, axis=0),
                ctx.all_gather(other[rid()], axis=-1))

    for nest, columns in strategy.experimental_local_results(strategy.run(step)):
        assert torch.equal(nest["rows"], torch.cat(parts, 0))
        assert torch.equal(nest["twice"][0], torch.cat(parts, 0))
        assert torch.equal(columns, torch.cat(other, dim=1))


def test_all_gather_errors(two):
    def rank0():
        return mirrored.get_replica_context().all_gather(torch.tensor(1.0), axis=0)

    with pytest.raises(ValueError, match=r"all_gather\(axis=0\) cannot concatenate rank-0 "
                                         r"values at value; give each a dimension first"):
        two.run(rank0)
    with pytest.raises(TypeError, match=r"all_gather: axis must be an int; got NoneType"):
        two.run(lambda: mirrored.get_replica_context().all_gather(torch.ones(1), axis=None))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_merge_call_regroups_and_returns_components(strategies, n):
    strategy = strategies[n]
    shared = torch.tensor(7.0)
    seen = {}

    def merge_fn(s, values, constant, *, scale):
        seen["strategy"] = s
        seen["cross"] = mirrored.in_cross_replica_context()
        seen["constant"] = constant
        total = s.reduce("SUM", values)
        per_replica = s.experimental_distribute_values_from_function(
            lambda ctx: torch.tensor(ctx.replica_id_in_sync_group * scale))
        return total, per_replica

    def step():
        ctx = mirrored.get_replica_context()
        return ctx.merge_call(merge_fn, args=(torch.tensor(float(rid())), shared),
                              kwargs={"scale": 10})

    results = strategy.experimental_local_results(strategy.run(step))
    assert seen["strategy"] is strategy and seen["cross"] is True
    assert seen["constant"] is shared  # identical objects are not wrapped
    for i, (total, mine) in enumerate(results):
        assert total.item() == sum(range(n))
        assert mine.item() == i * 10


def test_merge_call_exception_is_raised_from_run(two):
    def step():
        return mirrored.get_replica_context().merge_call(lambda s: 1 / 0)

    with pytest.raises(ZeroDivisionError) as info:
        two.run(step)
    assert "raised in replica 0" in info.value.__notes__[0]
    assert two.run(lambda: 3).values == (3, 3)  # (a number: one per replica)


def test_collectives_refuse_cross_replica_context(two):
    def merge_fn(s, contexts):
        return contexts.values[0].all_reduce("SUM", torch.ones(1))

    def step():
        ctx = mirrored.get_replica_context()
        return ctx.merge_call(merge_fn, args=(ctx,))

    with pytest.raises(RuntimeError, match=r"ReplicaContext.all_reduce of replica 0 must be "
                                           r"called by that replica, inside strategy.run; it was "
                                           r"called from cross-replica context"):
        two.run(step)


def test_default_and_one_device_strategies():
    default = mirrored.get_replica_context()
    x = torch.tensor([1.0, 2.0])
    assert torch.equal(default.all_reduce("SUM", x), x)
    assert default.all_reduce("MEAN", torch.tensor([1, 2]), axis=0).item() == 1.5
    assert torch.equal(default.all_gather(x, axis=0), x)
    assert default.merge_call(lambda s, v: (s, v), args=(5,)) == (mirrored.get_strategy(), 5)
    one = mirrored.OneDeviceStrategy("CPU:0")
    out = one.run(lambda: mirrored.get_replica_context().all_reduce("SUM", {"a": x}))
    assert torch.equal(out["a"], x) and out["a"] is not x


def test_string_ops_any_case_and_bad_ops(two):
    def step(op):
        return mirrored.get_replica_context().all_reduce(op, torch.tensor(float(rid() + 1)))

    for op in ["sum", "Sum", mirrored.ReduceOp.SUM]:
        assert two.experimental_local_results(two.run(step, args=(op,)))[0].item() == 3.0
    with pytest.raises(ValueError, match="'MAXX' is not a valid ReduceOp"):
        two.run(step, args=("MAXX",))
    with pytest.raises(TypeError, match="cannot reduce bool tensors"):
        two.run(lambda: mirrored.get_replica_context().all_reduce("SUM", torch.tensor(True)))


def test_sum_all_reduce_is_deterministic_under_random_timing():
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(4)])
    rng = np.random.default_rng(0)
    vectors = [torch.from_numpy(rng.standard_normal(1000).astype(np.float32) * 10 ** (i - 2))
               for i in range(4)]
    delays = rng.uniform(0, 0.003, size=(20, 4))

    def step(k):
        time.sleep(delays[k][rid()])
        return mirrored.get_replica_context().all_reduce("SUM", vectors[rid()])

    outputs = []
    for k in range(20):
        outputs.extend(strategy.experimental_local_results(strategy.run(step, args=(k,))))
    reference = ((vectors[0] + vectors[1]) + vectors[2]) + vectors[3]
    for out in outputs:
        assert torch.equal(out, reference)  # bitwise, replica-ordered


def test_replicas_wait_for_each_other_in_collectives(strategies):
    strategy = strategies[3]
    order = []
    lock = threading.Lock()

    def step():
        time.sleep(0.02 * rid())
        with lock:
            order.append(("before", rid()))
        mirrored.get_replica_context().all_reduce("SUM", torch.ones(1))
        with lock:
            order.append(("after", rid()))

    strategy.run(step)
    assert [kind for kind, _ in order[:3]] == ["before"] * 3


def test_run_inside_merge_fn_runs_instead_of_deadlocking(two):
    # TF runs it (issue 13); here the replicas go in turn on the merging thread.
    def step():
        return mirrored.get_replica_context().merge_call(lambda s: s.run(lambda: 1))

    assert two.run(step).values == (1, 1)
    with pytest.raises(RuntimeError, match=r"run cannot be called inside a replica \(from the fn "
                                           r"of another run\)"):
        two.run(lambda: two.run(lambda: 1))
    assert two.run(lambda: 2).values == (2, 2)


def test_run_hands_each_replica_its_components_of_tuple_arguments(strategies):
    # run(fn, args=(x, y)) with per-replica values and shared tensors: each replica
    # gets its own component and the shared object itself; a value with the wrong
    # number of components is named by its place.
    strategy = strategies[2]
    shared = torch.ones(2)
    x = mirrored.PerReplica([torch.tensor(0.0), torch.tensor(1.0)])
    y = mirrored.PerReplica([torch.tensor(10.0), torch.tensor(11.0)])
    seen = {}

    def step(a, b, c):
        seen[rid()] = (a, b, c)
        return a + c

    out = strategy.experimental_local_results(strategy.run(step, args=(x, shared, y)))
    assert [t.item() for t in out] == [10.0, 12.0]
    for r in (0, 1):
        a, b, c = seen[r]
        assert a is x.values[r] and b is shared and c is y.values[r]
    three = mirrored.PerReplica([torch.tensor(0.0)] * 3)
    with pytest.raises(ValueError, match=r"args\[1\] is a PerReplica with 3 components but "
                                         r"this strategy has 2 replicas"):
        strategy.run(step, args=(x, three, y))
    assert strategy.run(lambda a: a * 2, args=(shared,)) is not None  # no per-replica value


def test_merge_call_args_of_different_structures_are_named_as_args(two):
    """Replicas passing merge_call different nests: the error names merge_call, its call
    site and the argument (not `run`'s result, as it did)."""
    def fn():
        ctx = mirrored.get_replica_context()
        extra = (torch.ones(1),) if ctx.replica_id_in_sync_group else ()
        return ctx.merge_call(lambda s, *a: None, args=(torch.zeros(1), *extra))

    with pytest.raises(ValueError, match=r"replicas passed different structures to merge_call "
                       r"at test_collectives\.py:\d+: at \(args, kwargs\)\[0\]\[1\], replica 0 "
                       r"passed nothing but replica 1 passed a leaf"):
        two.run(fn)
