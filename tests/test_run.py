"""strategy.run: per-replica arguments, concurrency, exceptions, grad mode."""

import threading
import time

import pytest
import torch

import mirrored
from conftest import cpu_strategy

pytestmark = pytest.mark.timeout(30)


def test_args_select_components_and_pass_plain_values(two):
    x = mirrored.PerReplica([torch.tensor(1.0), torch.tensor(3.0)])
    m = mirrored.Mirrored([torch.tensor(10.0), torch.tensor(10.0)])
    out = two.run(lambda a, b, *, c: a * b + c, args=[x, m], kwargs={"c": 2.0})
    assert [t.item() for t in out.values] == [12.0, 32.0]
    assert out.devices == two.extended.worker_devices


def test_args_must_be_tuple_or_list(two):
    with pytest.raises(ValueError, match=r"takes a tuple or list of positional arguments; got "
                                         r"Tensor. Write args=\(x,\)"):
        two.run(lambda x: x, args=torch.tensor(1.0))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"kwargs=\.\.\.\) takes a dict; got list"):
        two.run(lambda: 1, kwargs=[1])  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [2, 3, 8])
def test_replicas_run_concurrently(n):
    # Every replica waits at a barrier that only opens when all N are inside fn at
    # the same time: one-at-a-time execution would time out.
    strategy = cpu_strategy(n)
    barrier = threading.Barrier(n, timeout=10)
    threads = strategy.run(lambda: (barrier.wait(), threading.get_ident())[1])
    assert len(set(strategy.experimental_local_results(threads))) == n


def test_threads_are_persistent(two):
    def slow_ident():
        time.sleep(0.05)
        return threading.get_ident()

    first = set(two.experimental_local_results(two.run(slow_ident)))
    second = set(two.experimental_local_results(two.run(slow_ident)))
    assert first == second
    assert threading.get_ident() in first  # replica 0 runs on the calling thread


def test_exception_carries_type_and_replica_id_and_strategy_stays_usable(two):
    class StepError(Exception):
        pass

    def step():
        if mirrored.get_replica_context().replica_id_in_sync_group == 1:
            raise StepError("bad batch")
        return torch.tensor(0)

    with pytest.raises(StepError, match="bad batch") as info:
        two.run(step)
    assert info.value.__notes__ == ["raised in replica 1 (CPU:1) of MirroredStrategy.run"]
    again = two.run(lambda: torch.tensor(mirrored.get_replica_context().replica_id_in_sync_group))
    assert two.reduce("SUM", again).item() == 1


def test_exception_while_other_replica_works(two):
    def step():
        if mirrored.get_replica_context().replica_id_in_sync_group == 0:
            raise KeyError("k")
        time.sleep(0.1)
        return 1

    with pytest.raises(KeyError):
        two.run(step)
    assert two.run(lambda: 5).values == (5, 5)  # (a number: one per replica)


def test_grad_mode_follows_the_caller(two):
    barrier = threading.Barrier(2, timeout=5)  # both replicas on their own threads

    def step():
        barrier.wait()
        return torch.is_grad_enabled()

    with torch.no_grad():
        assert two.run(step) is False  # both replicas returned the same object
    with torch.enable_grad():
        assert two.run(step) is True


def test_autograd_inside_replicas(two):
    x = mirrored.PerReplica([torch.tensor(2.0, requires_grad=True),
                             torch.tensor(3.0, requires_grad=True)])

    def step(v):
        (v**2).backward()
        return v.grad

    grads = two.run(step, args=(x,))
    assert [g.item() for g in grads.values] == [4.0, 6.0]


def test_single_replica_run_calls_fn_directly():
    one = mirrored.MirroredStrategy(["CPU:0"])
    ident = one.run(threading.get_ident)
    assert ident == threading.get_ident()
    assert one.run(lambda: mirrored.get_replica_context().replica_id_in_sync_group) == 0


def test_one_device_strategy():
    one = mirrored.OneDeviceStrategy("cpu")
    assert one.num_replicas_in_sync == 1
    assert one.extended.worker_devices == ("/job:localhost/replica:0/task:0/device:CPU:0",)
    assert one.run(lambda x: x + 1, args=(torch.tensor(1),)).item() == 2
    assert one.reduce("SUM", torch.tensor(3.0)).item() == 3.0


def test_results_are_replica_ordered_whatever_the_timing():
    strategy = cpu_strategy(4)

    def step():
        i = mirrored.get_replica_context().replica_id_in_sync_group
        time.sleep(0.01 * (3 - i))
        return torch.tensor(i)

    for _ in range(3):
        out = strategy.run(step)
        assert [t.item() for t in out.values] == [0, 1, 2, 3]


def test_closed_strategy_refuses_run():
    strategy = cpu_strategy(2)
    strategy.close()
    with pytest.raises(RuntimeError, match="replica threads were closed"):
        strategy.run(lambda: 1)


def test_concurrent_runs_from_two_threads_are_serialized(two):
    errors = []

    def worker():
        try:
            for _ in range(50):
                out = two.run(lambda: mirrored.get_replica_context().replica_id_in_sync_group)
                assert out.values == (0, 1)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert errors == []


def test_a_run_lock_held_by_another_thread_is_never_taken(monkeypatch):
    # Another thread holds the run lock at a moment where no run is marked in progress
    # (just after acquiring it, or just before releasing it): a waiter that times out
    # must raise, not release that thread's lock and run alongside it.
    from mirrored._src.runtime import runtime as runtime_module

    monkeypatch.setattr(runtime_module, "MISUSE_SECONDS", 0.2)
    strategy = cpu_strategy(2)
    lock = strategy._parts.runtime._run_lock
    held, done = threading.Event(), threading.Event()

    def holder():
        with lock:
            held.set()
            done.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(10)
        with pytest.raises(RuntimeError, match=r"waited 0.2 s for another run"):
            strategy.run(lambda: 1)
        assert not lock.acquire(blocking=False)  # still the holder's
    finally:
        done.set()
        thread.join(10)
    assert strategy.run(lambda: 2).values == (2, 2)  # (a number: one per replica)


def test_a_run_lock_leaked_by_an_interrupt_is_taken_back_by_its_thread():
    # An interrupt right after run acquired its lock leaves it held by this thread with
    # no run in progress: the thread's next run goes ahead at once.
    strategy = cpu_strategy(2)
    lock = strategy._parts.runtime._run_lock
    assert lock.acquire(blocking=False)  # what the interrupt left behind
    start = time.monotonic()
    out = strategy.run(lambda: mirrored.get_replica_context().replica_id_in_sync_group)
    assert out.values == (0, 1) and time.monotonic() - start < 1.0
    released = threading.Thread(target=lambda: strategy.run(lambda: 3))
    released.start()
    released.join(10)
    assert not released.is_alive()  # another thread can take it: it was released


def test_an_error_in_a_step_with_an_empty_batch_says_which_replica_had_none() -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    (batch,) = strategy.experimental_distribute_dataset([torch.ones(2, 2)])  # rows 1, 1, 0
    with pytest.raises(RuntimeError) as raised:
        # (torch refuses reshape(-1, 0) of 0 elements: replica 2 raises)
        strategy.run(lambda x: x.reshape(-1, x.numel() // max(len(x), 1)), args=(batch,))
    notes = " ".join(getattr(raised.value, "__notes__", []))
    assert "the batch of replica 2 (CPU:2) was empty" in notes, notes
    assert "replica 0" not in notes.split("was empty")[0].split("the batch of")[-1]
    (full,) = strategy.experimental_distribute_dataset([torch.ones(3, 2)])
    with pytest.raises(RuntimeError) as raised:
        strategy.run(lambda x: x.reshape(-1, 5), args=(full,))  # every replica has rows
    assert "was empty" not in " ".join(getattr(raised.value, "__notes__", []))


def test_a_run_inside_a_merge_fn_sets_a_default_device_only_where_the_caller_did():
    # merge_call used to enter torch.device(caller's device) around every merge_fn, so
    # a run nested there always made the replica's device torch's default device
    # (a GPU replica's factories without a device then landed on the GPU there, and on
    # the CPU at the top level).
    from mirrored._src.devices import default_device_set
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    seen = []

    def merge_fn(s):
        s.run(lambda: seen.append(default_device_set()))

    try:
        strategy.run(lambda: mirrored.get_replica_context().merge_call(merge_fn))
        assert seen == [False, False]
        seen.clear()
        with torch.device("cpu"):
            strategy.run(lambda: mirrored.get_replica_context().merge_call(merge_fn))
        assert seen == [True, True]
    finally:
        strategy.close()
