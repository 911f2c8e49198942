"""Regression tests for bugs found in review: interrupts, concurrent runs, calls that
must be refused inside run, thread-local torch modes, one-replica and default-strategy
rules, dataclass fields, error messages."""

import dataclasses
import signal
import threading
import time

import pytest
import torch

import mirrored
from mirrored.experimental import CommunicationOptions

pytestmark = pytest.mark.timeout(20)


def rid():
    return mirrored.get_replica_context().replica_id_in_sync_group


class Interrupt(BaseException):
    """Stands in for KeyboardInterrupt, raised in the main thread by a signal."""


@pytest.fixture
def interrupt_after():
    def raise_interrupt(signum, frame):
        raise Interrupt

    previous = signal.signal(signal.SIGUSR1, raise_interrupt)
    timers = []

    def schedule(seconds):
        timer = threading.Timer(seconds, lambda: signal.pthread_kill(
            threading.main_thread().ident, signal.SIGUSR1))
        timers.append(timer)
        timer.start()

    yield schedule
    for timer in timers:
        timer.cancel()
    signal.signal(signal.SIGUSR1, previous)


def test_interrupted_wait_in_a_collective_leaves_no_stale_state(two, interrupt_after):
    def late_partner():
        if rid() == 0:
            interrupt_after(0.2)
        else:
            time.sleep(0.6)
        return mirrored.get_replica_context().all_reduce("SUM", torch.tensor(1.0))

    with pytest.raises(Interrupt):
        two.run(late_partner)

    def two_merges():
        ctx = mirrored.get_replica_context()
        if rid() == 1:
            time.sleep(0.1)
        first = ctx.merge_call(lambda s, v: ("first", v), args=(rid(),))
        second = ctx.merge_call(lambda s, v: ("second", v), args=(rid(),))
        return first, second

    for _ in range(3):
        (first, second) = two.run(two_merges)
        assert first[0] == "first" and second[0] == "second"
        assert first[1].values == (0, 1) and second[1].values == (0, 1)


def test_interrupted_run_waits_for_its_replicas(two, interrupt_after):
    seen = []

    def step(tag):
        if rid() == 0 and tag == "first":
            interrupt_after(0.1)
            time.sleep(1.0)
            return None
        if rid() == 1:
            time.sleep(0.4)
        return mirrored.get_replica_context().merge_call(
            lambda s, v: seen.append(v.values), args=(f"{tag}-{rid()}",))

    with pytest.raises(Interrupt):
        two.run(step, args=("first",))
    two.run(step, args=("second",))
    assert seen[-1] == ("second-0", "second-1")
    assert all("first" not in v for pair in seen for v in pair)


def test_concurrent_runs_with_collectives_from_two_threads(two):
    def step():
        if rid() == 1:
            time.sleep(0.05)
        return mirrored.get_replica_context().all_reduce("SUM", torch.tensor(1.0))

    out = {}

    def user(tag):
        out[tag] = [t.item() for t in two.run(step).values]

    threads = [threading.Thread(target=user, args=(tag,)) for tag in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert out == {"A": [2.0, 2.0], "B": [2.0, 2.0]}


def test_close_and_collectives_refused_inside_run(two):
    with pytest.raises(RuntimeError, match=r"close cannot be called inside run"):
        two.run(two.close)

    def backward_in_merge():
        x = torch.tensor(1.0, requires_grad=True)
        y = mirrored.get_replica_context().all_reduce("SUM", x)
        return mirrored.get_replica_context().merge_call(lambda s, v: v.values[0].backward(),
                                                         args=(y,))

    with pytest.raises(RuntimeError, match=r"gradient of all_reduce\(SUM\) at "
                                           r"test_review_regressions.py:\d+ was called inside a "
                                           r"merge_fn"):
        two.run(backward_in_merge)
    assert two.run(lambda: 1).values == (1, 1)  # (a number: one per replica)


def test_merge_fn_may_return_an_exception_object(two):
    error = ValueError("a value, not a failure")
    out = two.run(lambda: mirrored.get_replica_context().merge_call(lambda s: error))
    assert out is error


def test_huge_timeout_is_rejected():
    with pytest.raises(ValueError, match=r"timeout_seconds must be .* and <= "):
        CommunicationOptions(timeout_seconds=1e12)


def test_thread_modes_reach_every_replica_thread(two):
    barrier = threading.Barrier(2, timeout=5)  # forces both replicas onto their own threads

    def step():
        barrier.wait()
        return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                (torch.ones(2, 2) @ torch.ones(2, 2)).dtype)

    # Leaves that are the same object in both replicas collapse, so any replica that
    # differs would show up as a PerReplica here.
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.inference_mode():
        assert two.run(step) == (False, True, torch.bfloat16)
    with torch.no_grad():
        assert two.run(step) == (False, False, torch.float32)
    assert two.run(step) == (True, False, torch.float32)


def test_default_strategy_scope_and_device():
    default = mirrored.get_strategy()
    with default.scope():
        assert mirrored.get_replica_context() is not None
        assert not mirrored.in_cross_replica_context()
        assert mirrored.get_cross_replica_context() is None
    with torch.device("meta"):
        assert default.run(lambda: torch.zeros(1).device) == torch.device("meta")


def test_one_replica_strategy_notes_and_reduce_to():
    one = mirrored.MirroredStrategy(["CPU:0"])

    def fail():
        raise KeyError("k")

    with pytest.raises(KeyError) as info:
        one.run(fail)
    assert info.value.__notes__ == ["raised in replica 0 (CPU:0) of MirroredStrategy.run"]
    out = mirrored.OneDeviceStrategy("CPU:0").extended.reduce_to("SUM", torch.tensor(5.0),
                                                                 "CPU:0")
    assert out.item() == 5.0


def test_error_messages_name_what_and_where(two):
    m = mirrored.Mirrored([torch.tensor(1.0), torch.tensor(1.0)])
    with pytest.raises(ValueError, match=r"not per-replica at value \(Mirrored\)"):
        two.reduce("SUM", m)
    v = mirrored.PerReplica([{"a": 1}, {"a": 2}])
    with pytest.raises(TypeError, match=r"reduce_to expects tensors, Python numbers or NumPy "
                                        r"arrays; got dict at value_destination_pairs\[0\]"):
        two.extended.reduce_to("MEAN", v, "CPU:0")

    def bool_leaf():
        return mirrored.get_replica_context().all_reduce("SUM", {"mask": torch.tensor(True)})

    with pytest.raises(TypeError, match=r"cannot reduce bool tensors \(at value\['mask'\]\)"):
        two.run(bool_leaf)

    def repeated_axis():
        return mirrored.get_replica_context().all_reduce("SUM", [torch.ones(2, 2)],
                                                         axis=(0, -2))

    with pytest.raises(ValueError, match=r"names the same dimension twice for rank-2 values "
                                         r"at value\[0\]"):
        two.run(repeated_axis)

    def bad_merge():
        return mirrored.get_replica_context().merge_call(
            lambda s: {"k": mirrored.PerReplica([1, 2, 3])})

    with pytest.raises(ValueError, match=r"3 components at result\['k'\], but there are 2 "):
        two.run(bad_merge)

    def structures():
        value = {"a": 1} if rid() == 0 else {"a": 1, "b": [2, 3]}
        return mirrored.get_replica_context().all_reduce("SUM", value)

    with pytest.raises(mirrored.CollectiveMismatchError,
                       match=r"(?s)replica 0 \(CPU:0\): all_reduce\(SUM\) at .* has nothing at "
                             r"value\['b'\].*replica 1 \(CPU:1\): all_reduce\(SUM\) at .* has a "
                             r"list of 2 at value\['b'\]"):
        two.run(structures)


@dataclasses.dataclass
class WithDerived:
    x: object
    n: int = dataclasses.field(init=False, default=0)


def test_dataclass_fields_without_init_survive(two):
    value = WithDerived(mirrored.PerReplica([torch.tensor([1.0]), torch.tensor([2.0])]))
    value.n = 5
    out = two.gather(value, axis=0)
    assert out.n == 5
    assert out.x.tolist() == [1.0, 2.0]
    seen = two.run(lambda v: v.n, args=(value,))
    assert seen.values == (5, 5)  # (a number run returns: one per replica)


def test_axis_spellings_are_the_same_call(two):
    def step():
        axis = 0 if rid() == 0 else (0,)
        return mirrored.get_replica_context().all_reduce("SUM", torch.ones(rid() + 1), axis=axis)

    assert [t.item() for t in two.run(step).values] == [3.0, 3.0]


def test_default_strategy_collectives_keep_the_value_device():
    ctx = mirrored.get_replica_context()
    with torch.device("meta"):
        assert ctx.all_reduce("SUM", torch.zeros(1)).device == torch.device("meta")
        assert ctx.all_gather(torch.zeros(1), axis=0).device == torch.device("meta")


@pytest.mark.timeout(60)
def test_cross_worker_results_carry_no_state_of_earlier_calls():
    # A result buffer reused across calls once handed out view objects that kept an
    # earlier call's autograd state and in-place shape changes (review of a removed
    # optimization). One worker of a multi-worker strategy: the cross-worker path.
    strategy = mirrored.MultiWorkerMirroredStrategy(devices=["CPU:0", "CPU:1"])
    w = torch.ones(3, requires_grad=True)

    def step(x, mode):
        ctx = mirrored.get_replica_context()
        if mode == "no_grad":
            with torch.no_grad():
                out = ctx.all_reduce("SUM", [x, x[:1]])
        else:
            out = ctx.all_reduce("SUM", [x, x[:1]])
        if mode == "t_":
            out[0].t_()
        elif mode == "requires_grad":
            out[0].requires_grad_()
        elif mode == "grad":
            scaled = out[0].mul(w)  # the result enters autograd
            return scaled.sum(), out[0].shape, out[0].requires_grad
        return out[0].clone().detach(), out[0].shape, out[0].requires_grad

    try:
        modes = ["no_grad", "grad", "t_", None, "requires_grad", None, "grad"]
        for i, mode in enumerate(modes):
            x = torch.arange(9.0).view(3, 3)[0] + i if mode == "grad" else \
                torch.arange(9.0).view(3, 3) + i
            result = strategy.run(step, args=(x, mode))
            value, shape, requires_grad = (  # replica 0's (a value all share comes as is)
                r.values[0] if isinstance(r, mirrored.PerReplica) else r for r in result)
            if mode == "grad":
                assert value.requires_grad
                value.backward()
                assert torch.equal(w.grad, 2 * x)  # replica 0's sum of both replicas' x
                w.grad = None
            elif mode != "t_":
                assert torch.equal(value, 2 * x), mode
                assert shape == (3, 3) and requires_grad is (mode == "requires_grad"), mode
            del result, value
    finally:
        strategy.close()
