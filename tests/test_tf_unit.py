"""TF's own distribute unit tests, translated to torch: each test names the TF test
(``tensorflow/python/distribute/<file>::<Class>.<method>``) whose expectation it checks."""

import collections

import pytest
import torch

import mirrored

pytestmark = pytest.mark.timeout(30)


def rid():
    return mirrored.get_replica_context().replica_id_in_sync_group


@pytest.fixture
def two():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    yield strategy
    strategy.close()


# --- scopes: distribute_lib_test ---------------------------------------------------------


def test_same_scope_nesting(two):
    # distribute_lib_test::TestStrategyTest.testSameScopeNesting
    scope_a = two.scope()
    with scope_a:
        scope_b = two.scope()
        with scope_b:
            with scope_a:  # the same active scope object, entered again
                assert mirrored.get_strategy() is two
            assert mirrored.get_strategy() is two
        other = mirrored.MirroredStrategy(["CPU:0"])
        with pytest.raises(RuntimeError, match="Mixing different mirrored Strategy objects"), \
                other.scope():
            pass
        assert mirrored.get_strategy() is two
    assert not mirrored.has_strategy()
    with scope_b:  # an exited scope object can be entered again
        assert mirrored.get_strategy() is two
    assert not mirrored.has_strategy()


def test_methods_refuse_inside_another_strategys_scope(two):
    # distribute_lib_test::_run_in_and_out_of_scope (testReduce, testReduceTo,
    # testBatchReduceTo): "Mixing different .*Strategy objects"
    v = mirrored.PerReplica([torch.tensor(1.0), torch.tensor(3.0)])
    expected = torch.tensor(2.0)  # the one-device mean of 1. and 3.
    assert torch.equal(two.reduce("MEAN", v), expected)
    with two.scope():
        assert torch.equal(two.reduce("MEAN", v), expected)
    other = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    calls = {
        "reduce": lambda: two.reduce("MEAN", v),
        "gather": lambda: two.gather(v, axis=0),
        "extended.batch_reduce_to": lambda: two.extended.reduce_to("MEAN", v, "CPU:0"),
        "extended.broadcast_to": lambda: two.extended.broadcast_to(torch.tensor(1.0), "CPU:0"),
        "run": lambda: two.run(lambda: 1),
    }
    for name, call in calls.items():
        with other.scope(), pytest.raises(
                RuntimeError, match=f"Mixing different mirrored Strategy objects: "
                                    f"MirroredStrategy.{name} of"):
            call()
    # Inside a replica of the other strategy too.
    with pytest.raises(RuntimeError, match="Mixing different mirrored Strategy objects"):
        other.run(lambda: two.reduce("MEAN", v))
    # The default strategy's scope is no other strategy (as SPEC §2 allows).
    with mirrored.get_strategy().scope():
        assert torch.equal(two.reduce("MEAN", v), expected)


def test_set_strategy():
    # distribute_lib_test::TestStrategyTest.testSetStrategy
    dist, dist2 = mirrored.MirroredStrategy(["CPU:0"]), mirrored.MirroredStrategy(["CPU:1"])
    mirrored.experimental_set_strategy(dist)
    try:
        assert mirrored.get_replica_context() is None
        assert mirrored.get_cross_replica_context() is dist
        assert mirrored.in_cross_replica_context() and mirrored.has_strategy()
        assert mirrored.get_strategy() is dist
        mirrored.experimental_set_strategy(dist2)
        assert mirrored.get_strategy() is dist2
    finally:
        mirrored.experimental_set_strategy(None)
    assert not mirrored.has_strategy()
    assert mirrored.get_replica_context() is not None  # the default replica context


def test_set_strategy_in_scope():
    # distribute_lib_test::TestStrategyTest.testSetStrategyInScope
    dist = mirrored.MirroredStrategy(["CPU:0"])
    with dist.scope():
        for target in (mirrored.MirroredStrategy(["CPU:1"]), dist, None):
            with pytest.raises(RuntimeError, match="must not be called inside a strategy"):
                mirrored.experimental_set_strategy(target)
    assert not mirrored.has_strategy()


# --- run and merge_call ------------------------------------------------------------------


def test_run_inside_merge_fn(two):
    # mirrored_run: a merge_fn is cross-replica code; strategy.run there calls fn once
    # per replica (TF starts new replica threads), each with its own component.
    def merge_fn(strategy, value):
        return strategy.run(lambda x: x * 10 + rid(), args=(value,))

    def step():
        x = torch.tensor(float(rid() + 1))
        return mirrored.get_replica_context().merge_call(merge_fn, args=(x,))

    result = two.experimental_local_results(two.run(step))
    assert [t.item() for t in result] == [1 * 10 + 0, 2 * 10 + 1]


def test_collectives_in_a_run_inside_merge_fn_are_refused(two):
    def merge_fn(strategy):
        return strategy.run(
            lambda: mirrored.get_replica_context().all_reduce("SUM", torch.tensor(1.0)))

    with pytest.raises(RuntimeError, match="inside a merge_fn"):
        two.run(lambda: mirrored.get_replica_context().merge_call(merge_fn))
    assert torch.equal(two.reduce("SUM", two.run(lambda: torch.tensor(1.0))),
                       torch.tensor(2.0))  # still usable


def test_run_inside_a_replica_is_still_refused(two):
    with pytest.raises(RuntimeError, match="cannot be called inside a replica"):
        two.run(lambda: two.run(lambda: 1))


class DictSubclass(dict):
    pass


class ListSubclass(list):
    pass


def test_dict_and_list_subclasses_keep_their_type_with_per_replica_leaves(two):
    # values_test / distribute_utils regroup: nest keeps Mapping and Sequence subclasses
    # (rebuilt with type(instance)(items)); OrderedDict and defaultdict too.
    for make in (DictSubclass, collections.OrderedDict,
                 lambda **kw: collections.defaultdict(int, **kw)):
        result = two.run(lambda make=make: make(a=torch.tensor(float(rid())), b=7))
        assert type(result) is type(make(a=0))
        # (TF returns the plain 7, the same object on every replica; here a number stays
        # one per replica, so equal counts still sum once per replica, and equals 7)
        assert isinstance(result["a"], mirrored.PerReplica) and result["b"] == 7
        assert result["b"].values == (7, 7)
        assert [t.item() for t in result["a"].values] == [0.0, 1.0]
        reduced = two.reduce("SUM", result["a"])
        assert reduced.item() == 1.0
    listed = two.run(lambda: ListSubclass([torch.tensor(rid())]))
    assert type(listed) is ListSubclass and isinstance(listed[0], mirrored.PerReplica)
    local = two.experimental_local_results(two.run(lambda: DictSubclass(x=torch.tensor(rid()))))
    assert [type(v) for v in local] == [DictSubclass, DictSubclass]
    assert [v["x"].item() for v in local] == [0, 1]


# --- input: custom_training_loop_input_test, input_lib_test -------------------------------


def test_datasets_from_function_hands_out_unbatched_elements(two):
    # custom_training_loop_input_test::testDistributeDatasetIteratorWithoutFunction
    data = [5.0, 6.0, 7.0, 8.0]
    it = iter(two.distribute_datasets_from_function(
        lambda _: [torch.tensor(v) for v in data]))
    assert [t.item() for t in two.experimental_local_results(it.get_next())] == data[:2]
    assert [t.item() for t in two.experimental_local_results(it.get_next())] == data[2:]
    with pytest.raises(StopIteration):  # TF: OutOfRangeError
        it.get_next()


def test_datasets_from_function_captured_data_mean(two):
    # custom_training_loop_input_test::testMultiDeviceDataCapturedFunction: 7.5 on 2
    inputs = torch.tensor([2.0, 3.0])
    it = iter(two.distribute_datasets_from_function(lambda _: list(inputs) * 5))
    var = torch.tensor(1.0)
    for _ in range(2):
        out = two.run(lambda x: x * x + var, args=(next(it),))
        mean = two.reduce("MEAN", out, axis=None)
    assert mean.item() == pytest.approx(((2.0**2 + 1) + (3.0**2 + 1)) / 2)


def test_datasets_from_function_tuple_elements(two):
    # input_lib_test::testTupleDataset (input_fn): [(i, i**2), (i+1, (i+1)**2)]
    steps = list(two.distribute_datasets_from_function(
        lambda _: [(torch.tensor(i), torch.tensor(i * i)) for i in range(10)]))
    assert len(steps) == 5
    for k, (a, b) in enumerate(steps):
        assert [t.item() for t in a.values] == [2 * k, 2 * k + 1]
        assert [t.item() for t in b.values] == [(2 * k) ** 2, (2 * k + 1) ** 2]


def test_datasets_from_function_uneven_batches(two):
    # input_lib_test::testUnevenDatasetBatches (input_fn): range(9).batch(2)
    batches = [torch.arange(s, min(s + 2, 9)) for s in range(0, 9, 2)]
    steps = [[t.tolist() for t in step.values]
             for step in two.distribute_datasets_from_function(lambda _: batches)]
    assert steps == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], []]]
    # drop_remainder=True: the full batches only; the steps are whole.
    full = [b for b in batches if len(b) == 2]
    assert [[t.tolist() for t in step.values] for step in
            two.distribute_datasets_from_function(lambda _: full)] == [
        [[0, 1], [2, 3]], [[4, 5], [6, 7]]]


def test_drop_remainder_in_dataset_fn_keeps_the_last_step():
    # input_lib_test::testRaggedSparse: 5 full batches of 4 round-robined over 2 replicas;
    # TF sums 310 in tf.function for-loops (the 5th batch kept), 200 in eager get_next.
    # mirrored keeps it (empty batch for the replica without one): the 310 of TF's loop.
    two = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    data = torch.arange(20, dtype=torch.float32)
    batches = list(data.split(4))  # drop_remainder=True: 20 / 4, all full
    total = torch.tensor(0.0)
    for step in two.distribute_datasets_from_function(lambda _: batches):
        total += two.reduce("SUM", two.run(torch.sum, args=(step,)))
    assert total.item() == data.sum().item() == 190.0


def test_unbatched_incomplete_last_step_is_dropped(two):
    # TF: scalar elements are statically shaped, so no partial-batch handling: a last
    # step with fewer elements than replicas ends the iteration.
    steps = list(two.distribute_datasets_from_function(
        lambda _: [torch.tensor(float(i)) for i in range(5)]))
    assert [[t.item() for t in s.values] for s in steps] == [[0.0, 1.0], [2.0, 3.0]]


def test_default_strategy_datasets_are_plain():
    # distribute_lib_test (default strategy): dataset_fn's dataset itself, plain tensors
    default = mirrored.get_strategy()
    from_fn = list(default.distribute_datasets_from_function(
        lambda ctx: [torch.ones(2), torch.tensor(3.0)]))
    assert all(type(x) is torch.Tensor for x in from_fn)
    assert [x.tolist() for x in from_fn] == [[1.0, 1.0], 3.0]
    plain = list(default.experimental_distribute_dataset([torch.tensor(4.0)]))
    assert type(plain[0]) is torch.Tensor and plain[0].item() == 4.0


def test_one_device_datasets_are_plain_and_accept_unbatched_elements():
    # input_lib_test::testOneDeviceCPU / testIterableIterator: range(10) unbatched,
    # element i at step i, a plain tensor (TF regroups one value to itself).
    for strategy in (mirrored.OneDeviceStrategy("CPU:0"), mirrored.MirroredStrategy(["CPU:0"])):
        steps = list(strategy.experimental_distribute_dataset([torch.tensor(i) for i in range(10)]))
        assert all(type(s) is torch.Tensor for s in steps)
        assert [s.item() for s in steps] == list(range(10))
        from_fn = list(strategy.distribute_datasets_from_function(
            lambda _: [torch.tensor(i) for i in range(3)]))
        assert [s.item() for s in from_fn] == [0, 1, 2]


def test_unbatched_data_with_several_replicas_is_refused(two):
    # input_lib (rebatch): "Call the `batch` method on the input Dataset in order to be
    # able to split your input across N replicas"
    with pytest.raises(ValueError, match=r"needs one leading batch dim.*Batch the dataset"):
        list(two.experimental_distribute_dataset([torch.tensor(1.0), torch.tensor(2.0)]))


def test_batch_of_one_on_two_replicas(two):
    # custom_training_loop_input_test::testDatasetDistributeNotDivisibleDrop: [5.], []
    data = next(iter(two.experimental_distribute_dataset([torch.tensor([5.0])])))
    assert [t.tolist() for t in two.experimental_local_results(data)] == [[5.0], []]


def test_next_inside_run_raises(two):
    # TF: a distributed iterator cannot be advanced inside the replica function
    it = iter(two.experimental_distribute_dataset([torch.arange(4), torch.arange(4)]))
    with pytest.raises(ValueError, match=r"next\(\) of a distributed iterator was called "
                                         r"inside strategy\.run"):
        two.run(lambda: next(it))
    step = next(it)  # nothing was consumed by the refused calls
    assert [t.tolist() for t in step.values] == [[0, 1], [2, 3]]


def test_get_next_as_optional(two):
    # custom_training_loop_input_test::testGetNextAsOptional / ...ExampleUsage
    it = iter(two.experimental_distribute_dataset(
        [torch.tensor([5.0, 6.0]), torch.tensor([7.0, 8.0])]))
    out = two.run(torch.square, args=(it.get_next_as_optional().get_value(),))
    assert [t.tolist() for t in two.experimental_local_results(out)] == [[25.0], [36.0]]
    seen = 0
    for _ in range(6):
        optional = it.get_next_as_optional()
        if not optional.has_value():
            break
        two.run(lambda x: x, args=(optional.get_value(),))
        seen += 1
    assert seen == 1
    with pytest.raises(ValueError, match="has no value"):
        it.get_next_as_optional().get_value()


def test_input_options_replication_mode_per_replica(two):
    # InputOptions(experimental_replication_mode=PER_REPLICA): dataset_fn per replica
    contexts = []

    def dataset_fn(ctx):
        contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id))
        return [torch.full((2,), 10 * ctx.input_pipeline_id + k) for k in
                range(ctx.input_pipeline_id + 1)]

    options = mirrored.InputOptions(
        experimental_replication_mode=mirrored.InputReplicationMode.PER_REPLICA)
    ds = two.distribute_datasets_from_function(dataset_fn, options)
    assert contexts == [(2, 0), (2, 1)]
    steps = [[t.tolist() for t in s.values] for s in ds]
    assert steps == [[[0, 0], [10, 10]], [[], [11, 11]]]
    with pytest.raises(NotImplementedError, match="PER_REPLICA is only supported by"):
        two.experimental_distribute_dataset([torch.arange(2)], options)


def test_input_options_validation():
    with pytest.raises(ValueError, match="needs experimental_replication_mode=PER_REPLICA"):
        mirrored.InputOptions(experimental_place_dataset_on_device=True,
                              experimental_fetch_to_device=False)
    with pytest.raises(ValueError, match="needs experimental_fetch_to_device=False"):
        mirrored.InputOptions(experimental_place_dataset_on_device=True,
                              experimental_replication_mode="PER_REPLICA")
    with pytest.raises(ValueError, match="must be InputReplicationMode"):
        mirrored.InputOptions(experimental_replication_mode="PER_HOST")
    with pytest.raises(ValueError, match="experimental_per_replica_buffer_size must be >= 0"):
        mirrored.InputOptions(experimental_per_replica_buffer_size=-1)
    with pytest.raises(TypeError, match="experimental_per_replica_buffer_size must be an int"):
        mirrored.InputOptions(experimental_per_replica_buffer_size=1.5)
    assert mirrored.InputOptions(experimental_per_replica_buffer_size=0).prefetch_depth == 0
    assert mirrored.InputOptions().prefetch_depth is None  # chosen by the devices
    assert mirrored.InputOptions(experimental_prefetch_depth=3).prefetch_depth == 3


def test_place_dataset_on_device_builds_each_pipeline_under_its_device():
    seen = []

    def dataset_fn(ctx):
        seen.append(torch.get_default_device())
        return iter([torch.zeros(1)])

    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    options = mirrored.InputOptions(experimental_replication_mode="PER_REPLICA",
                                    experimental_place_dataset_on_device=True,
                                    experimental_fetch_to_device=False)
    steps = list(strategy.distribute_datasets_from_function(dataset_fn, options))
    assert seen == [torch.device("cpu")] * 2 and len(steps) == 1


# --- cross_device_ops_test -----------------------------------------------------------------


def test_reduction_to_one_device_accumulation_fn():
    # cross_device_ops_test: ReductionToOneDevice(accumulation_fn=math_ops.add_n)
    calls = []

    def add_n(tensors):
        calls.append(len(tensors))
        return torch.stack(tensors).sum(0)

    ops = mirrored.ReductionToOneDevice(accumulation_fn=add_n)
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=ops)
    v = mirrored.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 5.0])])
    reference = v.values[0] + v.values[1]
    assert torch.equal(strategy.reduce("SUM", v), reference)
    assert torch.equal(strategy.reduce("MEAN", v), reference / 2)
    assert torch.equal(strategy.reduce("MAX", v), torch.tensor([3.0, 5.0]))  # not accumulated
    assert calls == [2, 2]
    same = mirrored.ReductionToOneDevice(accumulation_fn=lambda xs: xs[0]).reduce("SUM", v, v)
    assert all(t.data_ptr() != v.values[0].data_ptr() for t in same.values)  # no aliasing
    with pytest.raises(TypeError, match="accumulation_fn must be a callable"):
        mirrored.ReductionToOneDevice(accumulation_fn=3)  # type: ignore[arg-type]
    bad = mirrored.ReductionToOneDevice(accumulation_fn=lambda xs: xs[0][:1])
    with pytest.raises(ValueError, match=r"expected torch.float32 \[2\], got torch.float32 \[1\]"):
        bad.reduce("SUM", v, "CPU:0")
