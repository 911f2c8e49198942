"""The fast paths of ``run`` and of ``all_reduce`` of one tensor (`OneTensor`) give what
the general paths give, bit for bit, and keep every check.

References are today's combine (``reduce_packed`` of the packed partials, then
``finish``), computed in the same test, plus exact NumPy values.
"""

import numpy as np
import pytest
import torch

import mirrored
from mirrored._src.collectives import all_reduce as general
from mirrored._src.collectives import one_tensor
from mirrored._src.comm import host
from mirrored._src.devices import parse_devices
from mirrored._src.reduce_op import ReduceOp
from mirrored._src.reduction import finish, plan_leaf, prepare

pytestmark = pytest.mark.timeout(120)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
          torch.int64, torch.int8, torch.uint8]


def rid():
    return mirrored.get_replica_context().replica_id_in_sync_group


def component(i, dtype, shape):
    """Replica i's input: random floats, or integers near the int8/uint8 limits."""
    gen = torch.Generator().manual_seed(100 + i)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)
    low, high = (100, 127) if dtype in (torch.int8, torch.uint8) else (-10**6, 10**6)
    return torch.randint(low, high, shape, generator=gen, dtype=dtype)


def todays_result(op, values):
    """What every replica got before the fast paths: prepare, pack, reduce_packed, finish."""
    n = len(values)
    plan = plan_leaf("all_reduce", op, values[0], None, "value")
    partials = [prepare(plan, v)[0] for v in values]
    devices = tuple(parse_devices([f"CPU:{i}" for i in range(n)]))
    ops = mirrored.ReductionToOneDevice()
    reduced = ops.reduce_packed(plan.base_op, [[p] for p in partials], [devices], 0)[0]
    return [finish(plan, total, n, in_place=True) for total in reduced]


def numpy_reference(op, values):
    if op == "SUM" and not values[0].is_floating_point():  # wraps, as in torch and TF
        native = np.stack([v.numpy() for v in values])
        return native.sum(0, dtype=native.dtype).astype(np.float64)
    stacked = np.stack([v.to(torch.float64).numpy() for v in values])
    return {"SUM": stacked.sum(0), "MEAN": stacked.mean(0), "MIN": stacked.min(0),
            "MAX": stacked.max(0)}[op]


class Spy:
    """Counts calls of the general all_reduce entry point."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = general.all_reduce

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(general, "all_reduce", counted)


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("op", ["SUM", "MEAN", "MIN", "MAX"])
def test_one_tensor_all_reduce_is_bitwise_todays_combine(strategies, monkeypatch, n, op):
    strategy = strategies[n]
    spy = Spy(monkeypatch)
    for dtype in DTYPES:
        for shape in [(), (5,), (3, 4)]:
            values = [component(i, dtype, shape) for i in range(n)]

            def step(values=values):
                return mirrored.get_replica_context().all_reduce(op, values[rid()])

            strategy.run(step)  # a first call of a dtype and rank plans on the general path
            spy.calls = 0
            results = strategy.experimental_local_results(strategy.run(step))
            assert spy.calls == 0, "the fast path was not taken"
            expected = todays_result(ReduceOp[op], values)
            reference = numpy_reference(op, values)
            for r, (got, want) in enumerate(zip(results, expected, strict=True)):
                assert got.dtype == want.dtype and got.shape == want.shape
                assert torch.equal(got, want), (op, dtype, shape, r)
                np.testing.assert_allclose(got.to(torch.float64).numpy(), reference,
                                           rtol=2e-2 if dtype in (torch.float16, torch.bfloat16)
                                           else 1e-6, atol=1e-2)
            # every replica owns its result (MEAN divides in place)
            assert len({got.data_ptr() for got in results}) == n


def test_mean_of_integers_promotes_exactly(two):
    values = [torch.tensor([2**62, 3, -7], dtype=torch.int64),
              torch.tensor([2**62, 4, 8], dtype=torch.int64)]
    narrow = [torch.tensor([127, -128], dtype=torch.int8),
              torch.tensor([127, -127], dtype=torch.int8)]
    for vals, dtype in [(values, torch.float64), (narrow, torch.float32)]:
        two.run(lambda v=vals: mirrored.get_replica_context().all_reduce("MEAN", v[rid()]))
        got = two.experimental_local_results(two.run(
            lambda v=vals: mirrored.get_replica_context().all_reduce("mean", v[rid()])))
        # no wrap-around: 2**62 + 2**62 is exact in float64
        exact = (vals[0].to(torch.float64) + vals[1].to(torch.float64)).to(dtype) / 2
        for g in got:
            assert g.dtype == dtype and torch.equal(g, exact)
        assert torch.equal(got[0], todays_result(ReduceOp.MEAN, vals)[0])


def test_fast_and_general_replicas_meet_and_agree(two, monkeypatch):
    # Replica 1's tensor is a non-contiguous view (general path); replica 0's is plain.
    base = [torch.arange(6.0).reshape(2, 3) + 0.25, torch.arange(6.0).reshape(3, 2).t() * 1.5]
    assert not base[1].is_contiguous()
    two.run(lambda: mirrored.get_replica_context().all_reduce("SUM", base[0]))  # plans it
    spy = Spy(monkeypatch)
    for order in (base, base[::-1]):
        got = two.experimental_local_results(two.run(
            lambda o=order: mirrored.get_replica_context().all_reduce("SUM", o[rid()])))
        expected = todays_result(ReduceOp.SUM, [order[0], order[1].contiguous()])
        for g, e in zip(got, expected, strict=True):
            assert torch.equal(g, e)
    assert spy.calls == 2  # one general call per run: the non-contiguous replica's


def test_a_large_tensor_takes_todays_pooled_combine(two):
    values = [component(i, torch.float32, (host.DIRECT_BYTES // 4 + 3,)) for i in range(2)]
    got = two.experimental_local_results(two.run(
        lambda: mirrored.get_replica_context().all_reduce("SUM", values[rid()])))
    for g, e in zip(got, todays_result(ReduceOp.SUM, values), strict=True):
        assert torch.equal(g, e)


def test_gradients_through_all_reduce_of_one_tensor(two, monkeypatch):
    spy = Spy(monkeypatch)
    c = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([-2.0, 0.5, 4.0])]
    k = [torch.tensor([1.0, 1.0, 2.0]), torch.tensor([3.0, -1.0, 0.0])]

    def step():
        i = rid()
        w = torch.ones(3, requires_grad=True)
        y = mirrored.get_replica_context().all_reduce("SUM", w * c[i])
        (y * k[i]).sum().backward()
        return y.detach(), w.grad

    for _ in range(2):
        spy.calls = 0
        results = two.experimental_local_results(two.run(step))
        for i, (y, grad) in enumerate(results):
            assert torch.equal(y, c[0] + c[1])
            assert torch.equal(grad, c[i] * (k[0] + k[1]))  # d/dw_i of sum_r (y * k_r)
        assert spy.calls == 2  # requires_grad: the general (autograd) path


@pytest.mark.parametrize(("second", "match"), [
    (torch.ones(4), r"mismatched inputs \(first difference at value\)"),
    (torch.ones(3, dtype=torch.float64), r"mismatched inputs"),
    ([torch.ones(3)], r"different structures"),
    (torch.ones(()), r"mismatched inputs"),
])
def test_mismatched_calls_raise_naming_both_replicas(two, second, match):
    first = torch.ones(3)
    two.run(lambda: mirrored.get_replica_context().all_reduce("SUM", first))  # plans float32
    values = [first, second]
    with pytest.raises(mirrored.CollectiveMismatchError, match=match) as info:
        two.run(lambda: mirrored.get_replica_context().all_reduce("SUM", values[rid()]))
    message = str(info.value)
    assert "replica 0" in message and "replica 1" in message
    assert "test_fast_paths.py" in message  # the call site
    # the strategy works again afterwards
    assert torch.equal(two.experimental_local_results(two.run(
        lambda: mirrored.get_replica_context().all_reduce("SUM", first)))[1], first * 2)


def test_different_ops_across_replicas_are_a_mismatch(two):
    ops = ["SUM", "MAX"]
    t = torch.ones(2)
    for op in ops:  # both planned: both replicas take the fast path below
        two.run(lambda op=op: mirrored.get_replica_context().all_reduce(op, t))
    with pytest.raises(mirrored.CollectiveMismatchError, match="different collectives"):
        two.run(lambda: mirrored.get_replica_context().all_reduce(ops[rid()], t))


def test_an_accumulation_fn_is_still_used():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=(
        mirrored.ReductionToOneDevice(accumulation_fn=lambda parts: parts[0] * 0 + 7)))
    t = torch.ones(2)
    try:
        for _ in range(2):
            got = strategy.experimental_local_results(strategy.run(
                lambda: mirrored.get_replica_context().all_reduce("SUM", t)))
            assert all(torch.equal(g, torch.full((2,), 7.0)) for g in got)
    finally:
        strategy.close()


def test_bad_ops_and_merge_fn_calls_keep_their_errors(two):
    t = torch.ones(2)
    two.run(lambda: mirrored.get_replica_context().all_reduce("SUM", t))
    with pytest.raises(ValueError, match="'median' is not a valid ReduceOp"):
        two.run(lambda: mirrored.get_replica_context().all_reduce("median", t))

    def step():
        ctx = mirrored.get_replica_context()
        return ctx.merge_call(lambda s: s.run(
            lambda: mirrored.get_replica_context().all_reduce("SUM", t)))

    with pytest.raises(RuntimeError, match="was called inside a merge_fn"):
        two.run(step)
    assert torch.equal(two.experimental_local_results(two.run(
        lambda: mirrored.get_replica_context().all_reduce(ReduceOp.MAX, t)))[0], t)


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_combine_each_is_combine_then_copies(op, n):
    parts = [component(i, torch.float32, (7,)) for i in range(n)]
    got = host.combine_each(op, parts)
    total = host.combine(op, parts, torch.device("cpu"))
    assert len(got) == n and all(torch.equal(g, total) for g in got)
    assert len({g.data_ptr() for g in got} | {p.data_ptr() for p in parts}) == 2 * n


def test_one_tensor_is_only_for_single_process_strategies(strategies):
    assert one_tensor.OneTensor.make(strategies[1]._parts, 0) is None
    assert one_tensor.OneTensor.make(strategies[2]._parts, 1) is not None


def test_run_results_regroup_as_before(two):
    t = torch.ones(())
    assert two.run(lambda: None) is None
    assert two.run(lambda: t) is t
    both = two.run(lambda: t + rid())
    assert isinstance(both, mirrored.PerReplica)
    assert [v.item() for v in both.values] == [1.0, 2.0]
    assert both.devices == ("/job:localhost/replica:0/task:0/device:CPU:0",
                            "/job:localhost/replica:0/task:0/device:CPU:1")
    with pytest.raises(ValueError, match="replica 0 returned None but replica 1 returned a leaf"):
        two.run(lambda: None if rid() == 0 else t)
    pair = two.run(lambda: (rid(), t))
    assert pair[1] is t and pair[0].values == (0, 1)


def test_a_device_mode_of_the_caller_is_not_the_plain_case(two):
    # Under `torch.device("meta")` the caller is not on the host: every replica runs
    # under its own device (the CPU), on the caller's thread too.
    with torch.device("meta"):
        out = two.run(lambda: torch.ones(1) + rid())
        assert torch.ones(1).device.type == "meta"
    assert [v.device.type for v in out.values] == ["cpu", "cpu"]
    assert [v.item() for v in out.values] == [1.0, 2.0]


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_no_grad_and_inference_mode_take_the_fast_path_without_autograd(two, monkeypatch,
                                                                          mode):
    values = [component(i, torch.float32, (5,)).requires_grad_() for i in range(2)]
    two.run(lambda: mirrored.get_replica_context().all_reduce("MEAN", values[rid()].detach()))
    spy = Spy(monkeypatch)

    def step():
        with mode():
            return mirrored.get_replica_context().all_reduce("MEAN", values[rid()])

    got = two.experimental_local_results(two.run(step))
    expected = todays_result(ReduceOp.MEAN, [v.detach() for v in values])
    assert spy.calls == 0  # nothing to differentiate: the fast path
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e) and not g.requires_grad
        assert g.is_inference() == (mode is torch.inference_mode)
