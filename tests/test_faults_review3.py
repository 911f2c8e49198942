"""Fault injection into the README's multi-worker training loop, on the default fast
paths (the call check's trailer, the two-worker exchange, the dataset's count or
vote, the example count taken from batches): every live worker ends with an error
naming the cause and the worker, within its bound, and every value a worker used
before it is the one a single device computes (no step mixes two steps' data).

Each scenario runs in real processes (Gloo over 127.0.0.1); the scenarios that end
in an error but leave the processes alive run one after another in the same
processes, each with a new strategy (a new job on the same port).
"""

from __future__ import annotations

import math
import os
import pathlib
import pickle
import re
import signal
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import mirrored
from mirrored.experimental import CommunicationOptions

pytestmark = pytest.mark.multiprocess

ROWS, FEATURES, CLASSES, STEPS, K = 8, 4, 3, 5, 2  # the fault comes at step K
TIMEOUT = 6.0  # CommunicationOptions(timeout_seconds=...)
FAILURE = 2.0  # failure_timeout_seconds of the scenarios that kill a worker
WAIT = 1.0  # a worker that waits in a collective for its peer's fault


def _batches(regression: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Classification (integer labels, which the batch comparison samples) or
    regression (float targets: no element is sampled, only the batch's place)."""
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(ROWS, FEATURES, generator=g),
             torch.randn(ROWS, CLASSES, generator=g) if regression else
             torch.randint(0, CLASSES, (ROWS,), generator=g)) for _ in range(STEPS)]


def _per_example(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if y.is_floating_point():
        return ((out - y) ** 2).mean(dim=1)
    return F.cross_entropy(out, y, reduction="none")


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, CLASSES))


def _reference(rows_of_last: int = ROWS, regression: bool = False
               ) -> list[tuple[float, list[torch.Tensor]]]:
    """One device: each step's mean loss and parameters after it."""
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step, (x, y) in enumerate(_batches(regression)):
        if step == STEPS - 1:
            x, y = x[:rows_of_last], y[:rows_of_last]
        loss = _per_example(model(x), y)
        opt.zero_grad()
        loss.mean().backward()
        opt.step()
        out.append((loss.mean().item(), [p.detach().clone() for p in model.parameters()]))
    return out


def _step_sizes(strategy: mirrored.MultiWorkerMirroredStrategy) -> int:
    """How many elements the last gradient all-reduce sent (from its call's text), so
    that an extra call of that size meets it with the sizes every worker predicted
    (the trailer path: sizes agree, calls differ)."""
    texts = strategy._parts.communicators.default._ledger.texts
    step = [str(t) for t in texts.values() if str(t).startswith("MirroredOptimizer.step(")]
    shapes = re.findall(r"float32\[([\d, ]*)\]", step[-1].partition(" at ")[0])
    return sum(math.prod(int(d) for d in s.split(",") if d.strip()) for s in shapes)


def _train(fault: str, odd: int, source: str = "list", timeout: float = TIMEOUT,
           failure: float = 10.0, regression: bool = False) -> dict:
    """The README's loop on this worker, with ``fault`` injected on worker ``odd``.
    Reports the steps it completed (mean loss, parameters), the error it met (type,
    message, ``workers``) and the seconds from the fault's step (or the start) to it."""
    rank = int(os.environ["RANK"])
    me = rank == odd
    report: dict = {"steps": [], "error": None, "sizes": None}
    began = [time.monotonic()]
    strategy = None
    try:
        if fault == "slow start" and me:
            time.sleep(TIMEOUT / 2)
        began[0] = time.monotonic()
        strategy = mirrored.MultiWorkerMirroredStrategy(
            communication_options=CommunicationOptions(timeout_seconds=timeout),
            devices=["CPU:0"], failure_timeout_seconds=failure,
            check_collectives=not (fault == "check_collectives" and me))
        if fault == "exit before the first collective" and me:
            os._exit(3)
        model = strategy.mirror(_net())
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
        data = _batches(regression)
        if me and fault in ("rows", "features", "dtype"):
            x, y = data[K]
            data[K] = {"rows": (torch.cat([x, x[:2]]), torch.cat([y, y[:2]])),
                       "features": (torch.randn(ROWS, FEATURES + 1), y),
                       "dtype": (x.double(), y)}[fault]
        if me and fault == "short":
            data = data[:-1]
        at = [0]

        def generator():
            for step, batch in enumerate(data):
                if me and fault == "source raises" and step == K:
                    raise OSError("this worker's source broke")
                yield batch

        def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            per_example = _per_example(model(x), y)
            if me and fault == "loss rows" and at[0] == K:  # loss[mask], on one worker
                loss = mirrored.compute_average_loss(per_example[:-1])
            else:
                loss = mirrored.compute_average_loss(per_example)
            opt.zero_grad()
            loss.backward()
            if at[0] == K:
                if me and fault.startswith("raise"):
                    raise ValueError("a bug in this worker's step")
                if me and fault == "extra all_reduce":
                    mirrored.get_replica_context().all_reduce(
                        "SUM", torch.ones(report["sizes"]))
                if me and fault == "SIGKILL mid-step":
                    os.kill(os.getpid(), signal.SIGKILL)
                if fault == "SIGKILL in the exchange":  # dies while its peer waits in it
                    if me:
                        threading.Timer(WAIT / 3, os.kill, (os.getpid(), signal.SIGKILL)).start()
                    else:
                        time.sleep(WAIT)
            if not (me and fault == "skip opt.step()" and at[0] == K):
                opt.step()
            return per_example.detach()

        for step, (x, y) in enumerate(strategy.experimental_distribute_dataset(
                data if source == "list" else generator())):
            at[0] = step
            if me and fault == "skip a run" and step == K:
                continue  # (e.g. "if the batch looks bad: skip it", on one worker only)
            if step == K:
                began[0] = time.monotonic()
                report["sizes"] = _step_sizes(strategy)
                if me and fault in ("extra reduce", "extra MAX reduce"):
                    strategy.reduce(fault.split()[1] if "MAX" in fault else "SUM",
                                    torch.ones(report["sizes"]), axis=None)
            per_example = strategy.run(step_fn, args=(x, y))
            mean = strategy.reduce("MEAN", per_example, axis=0)
            report["steps"].append((float(mean), [p.detach().clone()
                                                  for p in model.parameters()]))
    except Exception as error:
        report["error"] = (type(error).__name__, str(error), getattr(error, "workers", None))
        report["seconds"] = time.monotonic() - began[0]
        if strategy is not None and me and fault == "raise, close in except":
            strategy.close()  # (as a `finally:` or `with` that closes while it propagates)
        if me and fault == "raise, no close":
            time.sleep(timeout + 1)  # goes on without its peers for longer than the timeout
    finally:
        if strategy is not None:
            strategy.close()
    return report


def _scenarios(cases: list[tuple], directory: str) -> dict:
    """Every case in turn in these processes; each report also saved to ``directory``
    (a killed worker's peers report there)."""
    rank = int(os.environ["RANK"])
    reports = {}
    for case in cases:
        name, args, kwargs = case[0], case[1:], {}
        if args and isinstance(args[-1], dict):
            args, kwargs = args[:-1], args[-1]
        reports[name] = _train(*args, **kwargs)
        path = pathlib.Path(directory, f"{name}-{rank}.pkl")
        path.write_bytes(pickle.dumps(reports[name]))
    return reports


def _assert_no_mixed_step(report: dict, reference: list, steps: int) -> None:
    assert len(report["steps"]) == steps, report["error"]
    for (mean, params), (ref_mean, ref_params) in zip(report["steps"], reference, strict=False):
        assert abs(mean - ref_mean) < 1e-5
        for p, q in zip(params, ref_params, strict=True):
            torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


# ------------------------------------------------ two workers: calls that differ

TWO = [  # (name, fault, odd worker, options)
    ("none", "none", 1),
    ("extra reduce", "extra reduce", 1),
    ("extra reduce on the chief", "extra reduce", 0),
    ("extra MAX reduce", "extra MAX reduce", 1),
    ("extra all_reduce", "extra all_reduce", 1),
    ("skip opt.step()", "skip opt.step()", 1),
    ("skip opt.step(), voted source", "skip opt.step()", 1, {"source": "generator"}),
    ("rows", "rows", 1),
    ("rows, voted source", "rows", 1, {"source": "generator"}),
    ("loss rows", "loss rows", 1),
    ("skip a run", "skip a run", 1),
    ("skip a run, float batches", "skip a run", 1, {"regression": True}),
    ("skip a run, float batches, voted source", "skip a run", 1,
     {"regression": True, "source": "generator"}),
    ("source raises", "source raises", 1, {"source": "generator"}),
    ("features", "features", 1),
    ("dtype", "dtype", 1),
    ("raise, close after", "raise", 1),
    ("raise, close in except", "raise, close in except", 1),
    ("raise, no close", "raise, no close", 1, {"timeout": 3.0}),
    ("check_collectives", "check_collectives", 1),
    ("slow start", "slow start", 1),
]
MISMATCH = "workers made different calls as collective #"


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    directory = tmp_path_factory.mktemp("two")
    reports = mirrored.testing.run_multi_process(_scenarios, 2, args=(TWO, str(directory)),
                                                 timeout=100)
    return {name: [r[name] for r in reports] for name, *_ in TWO}


@pytest.mark.timeout(120)
def test_two_workers_every_fault_is_an_error_on_both_and_no_step_mixes_data(two_workers):
    reference = _reference()
    for name in ("none", "slow start"):  # (a start later than the timeout's half works)
        for report in two_workers[name]:
            assert report["error"] is None, (name, report["error"])
            _assert_no_mixed_step(report, reference, STEPS)
    for name, fault, odd, *options in TWO:
        if name in ("none", "slow start"):
            continue
        reports = two_workers[name]
        for rank, report in enumerate(reports):
            # every value used before the error is one device's: steps 0..K-1 only
            steps = 0 if fault == "check_collectives" else K
            _assert_no_mixed_step(report, _reference(regression=True) if options and
                                  options[0].get("regression") else reference, steps)
            kind, message, _ = report["error"]
            if rank == odd and (fault in ("features", "dtype", "source raises")
                                or fault.startswith("raise")):
                assert kind in ("RuntimeError", "ValueError", "OSError"), (name, report["error"])
                continue  # its own error (torch's, or the injected one)
            # (not a wall-clock target: detected, not timed out; a timeout's error comes
            # at the collective timeout, well inside the test's bound)
            assert report["seconds"] < (3.0 + 10.0 if fault == "raise, no close" else TIMEOUT), (
                name, rank, report["seconds"])
            if fault == "check_collectives":
                assert kind == "ValueError", (name, report["error"])
                assert "the same check_collectives; got worker 0: True, worker 1: False" in \
                    message
            elif fault in ("features", "dtype", "raise", "source raises"):
                assert kind == "CollectiveMismatchError", (name, report["error"])
                assert message.startswith(f"worker {odd} left after "), message
                assert "ended its loop early (an error it caught" in message
            elif fault == "raise, close in except":
                assert (kind, report["error"][2]) == ("WorkerFailureError", (odd,)), name
                assert message.startswith(f"worker {odd} left the job (worker {odd} on "
                                          "ValueError) while worker"), message
            elif fault == "raise, no close":
                assert kind == "CollectiveTimeoutError", (name, report["error"])
                assert report["seconds"] >= 3.0
                assert "peers that never joined" in message
            else:
                assert kind == "CollectiveMismatchError", (name, report["error"])
                assert MISMATCH in message and "no data of it was used" in message
                odd_call = message.partition(f"worker {odd}: ")[2]
                even_call = message.partition(f"worker {1 - odd}: ")[2]
                assert even_call.startswith("MirroredOptimizer.step("), message
                if fault == "skip a run":  # the same call, given the next step's batch
                    assert odd_call.partition(" [")[0] == even_call.partition(" [")[0]
                    assert "[batches taken: " in message, message
                expected = {"extra reduce": "Strategy.reduce(SUM of float32[",
                            "extra MAX reduce": "Strategy.reduce(MAX of float32[",
                            "loss rows": "compute_average_loss(the step's example count",
                            "skip a run": "MirroredOptimizer.step(",
                            "extra all_reduce": "ReplicaContext.all_reduce(SUM of float32[",
                            "skip opt.step()": "Strategy.reduce(MEAN",
                            "rows": "MirroredOptimizer.step("}[fault]
                assert odd_call.startswith(expected), message
                if fault.startswith("extra"):  # of the gradients' sizes: the trailer path
                    assert f"float32[{report['sizes']}])" in odd_call, message
                if fault == "rows":
                    assert "their sources differ" in message
                if fault == "loss rows":
                    assert "pass global_batch_size" in message
    # the injected error itself, on the odd worker
    assert two_workers["raise, close after"][1]["error"][:2] == (
        "ValueError", "a bug in this worker's step")


# ----------------------------------------------- three workers: who is the odd one

THREE = [
    ("extra reduce", "extra reduce", 2),
    ("skip opt.step()", "skip opt.step()", 2),
    ("rows", "rows", 2),
    ("raise, close in except", "raise, close in except", 2),
    ("check_collectives", "check_collectives", 2),
]


@pytest.fixture(scope="module")
def three_workers(tmp_path_factory):
    directory = tmp_path_factory.mktemp("three")
    reports = mirrored.testing.run_multi_process(_scenarios, 3, args=(THREE, str(directory)),
                                                 timeout=100)
    return {name: [r[name] for r in reports] for name, *_ in THREE}


@pytest.mark.timeout(120)
def test_three_workers_two_agree_and_the_odd_one_is_named(three_workers):
    reference = _reference()
    for name, fault, odd in THREE:
        for rank, report in enumerate(three_workers[name]):
            _assert_no_mixed_step(report, reference, 0 if fault == "check_collectives" else K)
            kind, message, workers = report["error"]
            if rank == odd and fault.startswith("raise"):
                continue
            assert report["seconds"] < TIMEOUT, (name, rank, report["seconds"])  # (detected)
            if fault == "check_collectives":
                assert message.endswith("got worker 0: True, worker 1: True, worker 2: False. "
                                        "Pass the same value on every worker"), message
            elif fault.startswith("raise"):
                assert (kind, workers) == ("WorkerFailureError", (2,)), report["error"]
            else:
                assert kind == "CollectiveMismatchError", report["error"]
                # the majority names the odd one, in the message and in error.workers
                assert workers == (odd,), report["error"]
                assert f". Worker {odd} differs from workers 0, 1, which agree" in message
                calls = {r: message.partition(f"worker {r}: ")[2].partition(" at ")[0]
                         for r in range(3)}
                if fault == "rows":  # the same call; the odd one's batches differ
                    taken = [message.partition(f"worker {r}: ")[2].partition(
                        "[batches taken: ")[2][:16] for r in range(3)]
                    assert calls[0] == calls[1] == calls[2], message
                    assert taken[0] == taken[1] != taken[2], message
                else:
                    assert calls[0] == calls[1] != calls[2], message  # the odd one stands out


# ---------------------------------------------------------- deaths: only the dead


def _killed(fault: str, odd: int, directory: str) -> dict:
    return _scenarios([(fault, fault, odd, {"failure": FAILURE})], directory)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("fault", "odd", "world"), [
    ("SIGKILL mid-step", 1, 2),
    ("SIGKILL in the exchange", 0, 2),  # the chief, the store's host
    ("exit before the first collective", 1, 2),
    ("SIGKILL mid-step", 1, 3),
])
def test_a_killed_worker_is_named_by_every_survivor_within_the_bound(tmp_path, fault, odd,
                                                                     world):
    with pytest.raises(mirrored.testing.MultiProcessError, match=f"rank {odd} of {world}"):
        mirrored.testing.run_multi_process(_killed, world, args=(fault, odd, str(tmp_path)),
                                           timeout=45, grace=20)
    reference = _reference()
    bound = FAILURE + 3 * 0.2 + 2.0  # + the machine's scheduling delays
    for rank in range(world):
        if rank == odd:
            assert not (tmp_path / f"{fault}-{rank}.pkl").exists()
            continue
        report = pickle.loads((tmp_path / f"{fault}-{rank}.pkl").read_bytes())
        kind, message, workers = report["error"]
        assert (kind, workers) == ("WorkerFailureError", (odd,)), report["error"]
        assert message.startswith(f"worker {odd} failed (no heartbeat for {FAILURE:g} s)")
        before = 0 if fault.startswith("exit") else K
        _assert_no_mixed_step(report, reference, before)
        # (the documented bound, plus room for a loaded machine's scheduling delays)
        assert report["seconds"] < bound + 3.0 + (WAIT if "exchange" in fault else 0), report


# --------------------------------------------- a source one batch short: not seen


@pytest.mark.timeout(60)
@pytest.mark.parametrize("source", ["list", "generator"])
def test_a_worker_whose_source_is_one_batch_short_steps_on_an_empty_batch(source):
    # Uneven sources are allowed, as in TF: a worker out of batches steps on empty ones
    # (docs/multi_worker.md, Input). Here worker 1's source is one batch short, so the
    # last step trains on worker 0's half of the global batch only, on both workers,
    # and with the mean over those rows, what one device does with that smaller batch.
    reports = mirrored.testing.run_multi_process(_train, 2, args=("short", 1, source),
                                                 timeout=50)
    half = _reference(rows_of_last=ROWS // 2)
    for report in reports:
        assert report["error"] is None, report["error"]
        _assert_no_mixed_step(report, half, STEPS)


def _killed_short_timeout(directory: str) -> dict:
    return _scenarios([("SIGKILL mid-step", "SIGKILL mid-step", 1,
                        {"failure": 8.0, "timeout": 2.0})], directory)


@pytest.mark.timeout(60)
def test_a_killed_peer_ends_the_survivors_wait_within_the_collective_timeout(tmp_path):
    # timeout_seconds is "the longest a worker waits in one cross-worker collective";
    # with a failure timeout longer than it, the survivor of a SIGKILL waited about
    # failure_timeout + 1 s (9 s here, 11 s with the default 10 s against a 4 s timeout).
    with pytest.raises(mirrored.testing.MultiProcessError, match="rank 1 of 2"):
        mirrored.testing.run_multi_process(_killed_short_timeout, 2, args=(str(tmp_path),),
                                           timeout=45, grace=20)
    report = pickle.loads((tmp_path / "SIGKILL mid-step-0.pkl").read_bytes())
    _assert_no_mixed_step(report, _reference(), K)
    assert report["error"][0] in ("WorkerFailureError", "CollectiveTimeoutError")
    # the collective timeout (2 s), far from the failure timeout's verdict (8 s + 1 s)
    assert report["seconds"] < 2.0 + 4.0, report
