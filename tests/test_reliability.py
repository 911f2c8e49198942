"""The runtime never hangs or leaks: stuck replicas, interrupts (real SIGINTs),
dropped strategies, the result pool, values that require grad, half-precision and
int64 means, thread settings, misuse from foreign threads, fork, random streams,
and the messages for odd inputs. Everything through the public API."""

import collections
import contextlib
import gc
import os
import random
import signal
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch

import mirrored
from mirrored.experimental import CommunicationOptions

pytestmark = pytest.mark.timeout(60)


def rid():
    return mirrored.get_replica_context().replica_id_in_sync_group


def exact_sum_step():
    ctx = mirrored.get_replica_context()
    return ctx.all_reduce("SUM", torch.tensor(float(ctx.replica_id_in_sync_group + 1)))


def assert_exact(strategy, n=2):
    out = strategy.experimental_local_results(strategy.run(exact_sum_step))
    assert [t.item() for t in out] == [n * (n + 1) / 2] * n


def rss_mib():
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


# 1. A stuck replica ---------------------------------------------------------------
@pytest.mark.parametrize("stuck", [0, 1])
def test_a_stuck_replica_does_not_hang_run(stuck):
    release = threading.Event()
    strategy = mirrored.MirroredStrategy(
        ["CPU:0", "CPU:1"], communication_options=CommunicationOptions(timeout_seconds=0.5))

    def step():
        if rid() == stuck:
            release.wait(30)  # stuck in "I/O"
            return None
        return exact_sum_step()

    start = time.monotonic()
    with pytest.raises(mirrored.CollectiveTimeoutError, match=r"timed out after 0.5 s"):
        strategy.run(step)
    assert time.monotonic() - start < 0.5 + 1.0
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"replica {stuck} \(CPU:{stuck}\) of "
                                           r"MirroredStrategy is still running"):
        strategy.run(exact_sum_step)
    assert time.monotonic() - start < 0.5 + 0.5
    release.set()
    time.sleep(0.1)
    assert_exact(strategy)  # works again once the straggler is back, and its outcome dropped


def test_a_per_call_timeout_frees_run_from_a_stuck_worker_replica(two):
    release = threading.Event()

    def step():
        if rid() == 1:
            release.wait(30)
            return None
        return mirrored.get_replica_context().all_reduce(
            "SUM", torch.ones(1), options=CommunicationOptions(timeout_seconds=0.3))

    start = time.monotonic()
    with pytest.raises(mirrored.CollectiveTimeoutError):
        two.run(step)
    assert time.monotonic() - start < 0.3 + 1.0
    release.set()
    time.sleep(0.1)
    assert_exact(two)


# 2. Interrupts ----------------------------------------------------------------------
class Armed:
    """A SIGINT handler that raises KeyboardInterrupt only while armed."""

    def __init__(self):
        self.armed = False
        self.fired_at = None

    def __call__(self, signum, frame):
        if self.armed and not _in_finalizer(frame):
            self.armed = False
            self.fired_at = time.monotonic()
            raise KeyboardInterrupt


def _in_finalizer(frame) -> bool:
    """Whether the signal landed in a weakref callback or a ``__del__`` (an object of
    a finished run collected just then: a ``weakref.finalize``, a ``WeakSet``'s or a
    weak dictionary's removal hook): Python swallows an exception raised there as
    "unraisable" (pytest fails the test), so a Ctrl-C there is lost, not delivered,
    whatever the library does. The handler lets such a signal pass."""
    for _ in range(6):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name == "__del__" or (code.co_filename.endswith(_WEAKREF_MODULES)
                                         and code.co_name in _WEAKREF_CALLBACKS):
            return True
        frame = frame.f_back
    return False


_WEAKREF_MODULES = ("/weakref.py", "/_weakrefset.py")
# the callbacks these modules hand to weakrefs and atexit (finalize, WeakSet, the weak
# dictionaries), not their ordinary methods
_WEAKREF_CALLBACKS = frozenset({"__call__", "remove", "_remove", "_exitfunc"})


@pytest.fixture
def no_gc_callbacks():
    """A signal landing in a gc callback (hypothesis registers one) is swallowed by
    Python as an "unraisable" exception, which pytest turns into a failure."""
    saved = list(gc.callbacks)
    gc.callbacks.clear()
    yield
    gc.callbacks.extend(saved)


@pytest.fixture
def sigint(no_gc_callbacks):
    handler = Armed()
    previous = signal.signal(signal.SIGINT, handler)
    yield handler
    signal.signal(signal.SIGINT, previous)


def test_interrupt_while_the_caller_waits_in_a_collective(two, sigint):
    import _thread

    def step():
        if rid() == 0:
            sigint.armed = True
            threading.Timer(0.1, _thread.interrupt_main, args=(signal.SIGINT,)).start()
        else:
            time.sleep(0.5)
        return exact_sum_step()

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        two.run(step)
    assert time.monotonic() - start < 1.1
    time.sleep(0.5)  # replica 1 finishes its sleep: not a straggler any more
    for _ in range(3):
        assert_exact(two)


@pytest.mark.timeout(120)
def test_sigint_soak_never_hangs_and_the_next_run_is_exact(sigint):
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    rng = random.Random(0)
    x = torch.randn(64, 64)

    def step():
        ctx = mirrored.get_replica_context()
        y = x @ x
        total = ctx.all_reduce("SUM", y.sum())
        merged = ctx.merge_call(lambda s, v: s.reduce("SUM", v), args=(total,))
        return ctx.all_reduce("MAX", merged + ctx.replica_id_in_sync_group)

    expected = strategy.experimental_local_results(strategy.run(step))
    interrupted = 0
    pid = os.getpid()
    for _ in range(300):
        delay = rng.uniform(0, 0.004)
        timer = threading.Timer(delay, os.kill, args=(pid, signal.SIGINT))
        sigint.fired_at = None
        try:  # the signal may land anywhere from arming to disarming: all inside here
            try:
                sigint.armed = True
                timer.start()
                strategy.run(step)
                time.sleep(0.005)  # let a late signal land while armed
            finally:
                sigint.armed = False
        except KeyboardInterrupt:
            interrupted += 1
            assert time.monotonic() - sigint.fired_at < 1.0
        timer.join()
        out = run_after_stragglers(strategy, step)
        assert [torch.equal(a, b) for a, b in zip(out, expected, strict=True)] == [True] * 3
    assert interrupted > 50


def run_after_stragglers(strategy, step):
    """The next run, once a straggler of an interrupted run (if any) is back."""
    for _ in range(20):
        try:
            return strategy.experimental_local_results(strategy.run(step))
        except RuntimeError as error:
            if "is still running its function" not in str(error):
                raise
    raise AssertionError("a straggler never came back")


# 3. Nothing leaks ------------------------------------------------------------------
def test_dropped_strategies_are_collected_with_their_threads():
    gc.collect()
    threads = threading.active_count()
    refs = []

    def use():
        strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
        big = mirrored.PerReplica([torch.ones(1 << 20)] * 3)
        strategy.run(lambda v: mirrored.get_replica_context().all_reduce("SUM", v),
                     args=(big,))
        refs.append(weakref.ref(strategy))

    for _ in range(20):
        use()
    assert all(ref() is None for ref in refs)  # no gc.collect needed: no cycles
    assert threading.active_count() == threads


def test_results_are_freed_when_the_user_drops_them(two):
    out = two.run(lambda: torch.ones(1 << 20) * rid())
    refs = [weakref.ref(t) for t in out.values]
    del out
    assert all(ref() is None for ref in refs)


_MEMORY_SCRIPT = """
import gc, os, torch, mirrored

def rss_mib():
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

gc.collect()
torch.ones(1)
base = rss_mib()
strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
for _ in range(16):  # dropped gathers of ~64 MiB
    gathered = strategy.gather(mirrored.PerReplica(
        [torch.ones(8_000_000), torch.ones(8_400_000)]), axis=0)
    del gathered
assert rss_mib() - base < 256 + 64 + 64, rss_mib() - base  # the pool's cap at most
del strategy
gc.collect()
assert rss_mib() - base < 64, rss_mib() - base  # the last strategy empties the pool
for _ in range(20):
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    big = mirrored.PerReplica([torch.ones(4_000_000)] * 2)
    out = strategy.run(lambda v: mirrored.get_replica_context().all_reduce("SUM", v),
                       args=(big,))
    del strategy, out, big
gc.collect()
assert rss_mib() - base < 128, rss_mib() - base
"""


@pytest.mark.timeout(120)
def test_memory_returns_near_baseline():
    # In a fresh interpreter: the result pool is shared by the open strategies and
    # emptied when the last one closes, so other tests' live strategies must not count.
    done = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT], capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]


# 4. The result pool ------------------------------------------------------------------
def test_pool_never_crosses_inference_mode(two):
    v = mirrored.PerReplica([torch.ones(1 << 19), torch.ones(1 << 19)])  # 2 MiB results
    with torch.inference_mode():
        inside = two.reduce("SUM", v)
    del inside
    for _ in range(3):
        out = two.reduce("SUM", v)
        out.add_(1)  # a normal tensor: in-place works
        assert out[0].item() == 3.0
        del out


def test_a_result_held_through_a_weakref_is_not_reused(two):
    v = mirrored.PerReplica([torch.ones(1 << 19), torch.ones(1 << 19)])
    first = two.reduce("SUM", v)
    held = weakref.ref(first)
    kept_storage = first.untyped_storage().data_ptr()
    del first
    second = two.reduce("SUM", v * 3 if False else mirrored.PerReplica(
        [torch.full((1 << 19,), 5.0), torch.full((1 << 19,), 5.0)]))
    if held() is not None:
        assert held()[0].item() == 2.0
        assert second.untyped_storage().data_ptr() != kept_storage


# 5. Values that require grad --------------------------------------------------------
def test_reduce_of_values_that_require_grad(two):
    w = torch.tensor([1.0, 2.0], requires_grad=True)

    def step():
        return (w * (rid() + 1)).sum()  # a loss, as TF users return it from run

    losses = two.run(step)
    assert two.reduce("SUM", losses).item() == 9.0
    assert two.reduce("MEAN", losses, axis=()).item() == 4.5
    assert two.gather(two.run(lambda: w * (rid() + 1)), axis=0).tolist() == [1, 2, 2, 4]
    assert two.reduce("MEAN", two.run(lambda: w * (rid() + 1)), axis=0).item() == 2.25
    assert two.extended.reduce_to("SUM", losses, "CPU:0").item() == 9.0
    assert not two.reduce("SUM", losses).requires_grad  # detached, as documented


# 6. Means of half precision and int64 -------------------------------------------------
def test_half_and_int64_means_equal_single_device_torch(two):
    for dtype in (torch.float16, torch.bfloat16):
        v = mirrored.PerReplica([torch.tensor(60000.0, dtype=dtype)] * 2)
        ref = torch.tensor([60000.0, 60000.0], dtype=dtype).mean()
        assert torch.equal(two.reduce("MEAN", v), ref)
        big = mirrored.PerReplica([torch.full((4000,), 30.0, dtype=dtype)] * 2)
        ref = torch.full((8000,), 30.0, dtype=dtype).mean()
        assert torch.equal(two.reduce("MEAN", big, axis=0), ref)
        assert torch.equal(two.extended.reduce_to("MEAN", v, "CPU:0"), torch.tensor(
            60000.0, dtype=dtype))
        out = two.run(lambda: mirrored.get_replica_context().all_reduce(
            "MEAN", torch.full((4000,), 30.0, dtype=torch.float16), axis=0))
        assert [t.item() for t in out.values] == [30.0, 30.0]
        assert out.values[0].dtype == torch.float16
    v = mirrored.PerReplica([torch.tensor(2**62), torch.tensor(2**62)])
    mean = two.reduce("MEAN", v)
    assert mean.dtype == torch.float64 and mean.item() == 2.0**62
    assert torch.tensor([2**62, 2**62]).to(torch.float64).mean().item() == mean.item()


# 7. Thread settings and misuse ------------------------------------------------------
def test_thread_count_and_saved_tensor_hooks_reach_every_replica(two):
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        counts = two.experimental_local_results(two.run(torch.get_num_threads))
        assert counts == (1, 1)
    finally:
        torch.set_num_threads(previous)
    packed = []

    def pack(t):
        packed.append(threading.get_ident())
        return t

    x = torch.ones(2, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        two.run(lambda: (x * x).sum())
    assert len(packed) >= 2  # the hook ran in both replicas, whichever thread


def test_torch_function_modes_are_refused_not_half_applied(two):
    class Counting(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Counting(), pytest.raises(RuntimeError, match=r"cannot carry Counting into its replica"):
        two.run(lambda: torch.ones(1) + 1)
    assert_exact(two)


def test_run_close_and_collectives_from_a_thread_started_inside_fn(two):
    errors = {}

    def in_thread(name, action):
        def target():
            try:
                action()
            except Exception as error:  # recorded for the test
                errors[name] = error
        thread = threading.Thread(target=target)
        thread.start()
        thread.join(10)
        assert not thread.is_alive()

    def step():
        if rid() == 0:
            in_thread("run", lambda: two.run(lambda: 1))
            in_thread("close", two.close)
            in_thread("all_reduce", lambda: mirrored.get_replica_context().all_reduce(
                "SUM", torch.ones(1)))
            in_thread("loss", lambda: mirrored.compute_average_loss(torch.ones(3)))
        return None

    start = time.monotonic()
    two.run(step)
    assert time.monotonic() - start < 2 + 2
    assert "deadlock" in str(errors["run"])
    assert "close was called from a thread that is not a replica" in str(errors["close"])
    assert "would return the value unreduced" in str(errors["all_reduce"])
    assert "compute_average_loss of the default strategy" in str(errors["loss"])
    assert_exact(two)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_collectives_work_in_a_forked_child(two):
    assert_exact(two)  # threads exist in the parent before the fork
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            out = two.experimental_local_results(two.run(exact_sum_step))
            code = 0 if [t.item() for t in out] == [3.0, 3.0] else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("a collective in the forked child hung")


# 8. Random numbers -------------------------------------------------------------------
def test_per_replica_random_streams_are_reproducible():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])

    def step():
        time.sleep(random.random() * 0.003)  # thread timing must not matter
        return torch.nn.functional.dropout(torch.ones(64), 0.5), torch.rand(4)

    runs = []
    for _ in range(5):
        torch.manual_seed(0)
        runs.append(strategy.experimental_local_results(strategy.run(step)))
    for other in runs[1:]:
        for (m1, r1), (m2, r2) in zip(runs[0], other, strict=True):
            assert torch.equal(m1, m2) and torch.equal(r1, r2)
    masks = [m for m, _ in runs[0]]
    assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[1], masks[2])
    torch.manual_seed(0)
    first = strategy.experimental_local_results(strategy.run(step))
    second = strategy.experimental_local_results(strategy.run(step))
    assert not torch.equal(first[0][0], second[0][0])  # successive runs differ
    g = torch.Generator().manual_seed(3)
    explicit = strategy.run(lambda: torch.rand(3, generator=g))
    assert explicit.values[0].shape == (3,)


# 9. Messages --------------------------------------------------------------------------
def test_messages_for_odd_inputs(two):
    v = mirrored.PerReplica([torch.ones(2, dtype=torch.uint16)] * 2)
    with pytest.raises(TypeError, match=r"reduce\(SUM, axis=None\) does not support dtype "
                                        r"uint16 \(at value\)"):
        two.reduce("SUM", v)
    with pytest.raises(TypeError, match=r"does not support dtype uint16"):
        two.run(lambda: mirrored.get_replica_context().all_reduce(
            "SUM", torch.ones(1, dtype=torch.uint16)))

    def ordered():
        items = [("a", 1), ("b", 2)]
        return collections.OrderedDict(items if rid() == 0 else items[::-1])

    with pytest.raises(ValueError, match=r"keys in the order \['a', 'b'\] but replica 1 "
                                         r"returned an OrderedDict of 2 with keys in the order "
                                         r"\['b', 'a'\]"):
        two.run(ordered)
    kept = two.run(mirrored.get_replica_context).values[0]
    with pytest.raises(RuntimeError, match=r"called from outside strategy.run \(a replica "
                                           r"context kept after its run returned"):
        kept.all_reduce("SUM", torch.ones(1))


# Review findings ---------------------------------------------------------------------
def test_a_replica_given_up_on_fails_the_run_even_if_its_partner_caught_the_timeout():
    strategy = mirrored.MirroredStrategy(
        ["CPU:0", "CPU:1"], communication_options=CommunicationOptions(timeout_seconds=0.3))
    done = threading.Event()

    def step():
        ctx = mirrored.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            done.wait(1.5)
            return None
        with contextlib.suppress(mirrored.CollectiveTimeoutError):  # user code swallows it
            ctx.all_reduce("SUM", torch.ones(1))
        return None

    with pytest.raises(RuntimeError, match=r"replica 1 \(CPU:1\) of MirroredStrategy was "
                                           r"still running its function when run gave up"):
        strategy.run(step)
    done.set()


def test_interrupt_main_reaches_a_caller_waiting_for_a_busy_replica(two, sigint):
    import _thread

    release, stop = threading.Event(), threading.Event()

    def busy():
        if rid() == 1:
            release.wait(5)
        return exact_sum_step()

    def interrupt():  # (again until one lands: one landing in a finalizer is lost)
        stop.wait(0.2)
        while not stop.is_set() and sigint.armed:
            _thread.interrupt_main(signal.SIGINT)
            stop.wait(0.1)

    sigint.armed = True
    threading.Thread(target=interrupt, daemon=True).start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            two.run(busy)
    finally:
        stop.set()
    assert sigint.fired_at - start < 1.0 and time.monotonic() - sigint.fired_at < 1.0
    release.set()
    time.sleep(0.2)
    run_after_stragglers(two, exact_sum_step)


def test_random_streams_cover_attention_merge_fn_and_the_input_pipeline():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    layer = strategy.mirror(torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.3,
                                                             batch_first=True))
    x = torch.randn(1, 6, 8)

    def step(batch):
        if rid() == 0:
            time.sleep(random.random() * 0.003)
        with torch.no_grad():
            merged = mirrored.get_replica_context().merge_call(lambda s: torch.rand(2))
            return layer(x), merged, torch.nn.functional.dropout2d(batch, 0.5)

    def source():
        for _ in range(3):
            yield torch.rand(4, 3, 2, 2)  # a random "augmentation" in the input pipeline

    def once():
        torch.manual_seed(0)
        return [strategy.experimental_local_results(strategy.run(step, args=(b,)))
                for b in strategy.experimental_distribute_dataset(source())]

    first, second = once(), once()
    flat = [t for steps in (first, second) for replicas in steps for out in replicas
            for t in out]
    half = len(flat) // 2
    assert all(torch.equal(a, b) for a, b in zip(flat[:half], flat[half:], strict=True))
