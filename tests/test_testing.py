"""`mirrored.testing.run_multi_process`: results in rank order, torchrun's variables in
each child, failures and deaths reported with rank and traceback, timeouts, a real Gloo
all_reduce, and no process left behind on any path.

The functions the children run are module-level, so the children can import them (a
forked rank unpickles its function as a "spawn" child does). The ranks fork from a
server that imported torch once; a "spawn" rank imports it itself (~1-2 s).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from mirrored.testing import MultiProcessError, find_free_port, run_multi_process

ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
             "MASTER_PORT", "MIRRORED_TEST_VALUE")


# --- what the children run ----------------------------------------------------------


def _rank() -> int:
    return int(os.environ["RANK"])


def _note_pid(pid_dir: str, pid: int | None = None, tag: str = "") -> None:
    path = Path(pid_dir) / f"{_rank()}{tag}.pid"
    path.write_text(str(os.getpid() if pid is None else pid))


def _describe(base: int, *, scale: int) -> dict[str, object]:
    return {"value": base + scale * _rank(), "env": {n: os.environ.get(n) for n in ENV_NAMES},
            "threads": torch.get_num_threads(), "pid": os.getpid(), "pgid": os.getpgid(0)}


def _fail_on_rank_1(pid_dir: str) -> object:
    _note_pid(pid_dir)
    if _rank() == 1:
        raise ValueError(f"bad value on rank {_rank()}")
    if _rank() == 2:
        return threading.Lock()  # does not pickle
    return _rank()


def _hang_on_rank_1(pid_dir: str) -> int:
    _note_pid(pid_dir)
    if _rank() == 1:
        grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        _note_pid(pid_dir, grandchild.pid, tag="-grandchild")
        time.sleep(300)
    return _rank()


def _hold_the_gil_on_rank_1(pid_dir: str) -> int:
    _note_pid(pid_dir)
    if _rank() == 1:  # a C call that keeps the GIL: the rank's watcher thread never runs
        import ctypes

        ctypes.PyDLL(None).sleep(300)
    return _rank()


def _die_without_reporting(pid_dir: str) -> None:
    _note_pid(pid_dir)
    if _rank() == 0:  # fail after rank 1, so that rank 1 is the first to fail
        end = time.monotonic() + 60
        while not (Path(pid_dir) / "1.pid").exists() and time.monotonic() < end:
            time.sleep(0.05)
        time.sleep(0.5)
        os._exit(3)
    if _rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(300)


def _gloo_all_reduce() -> tuple[torch.Tensor, int]:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # env://: the variables run_multi_process set
    try:
        value = torch.tensor([_rank() + 1.0, 10.0 ** _rank()])
        dist.all_reduce(value)
        return value, torch.get_num_threads()
    finally:
        dist.destroy_process_group()


# --- helpers in the parent ----------------------------------------------------------


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie awaiting its reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _pids(pid_dir: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in pid_dir.glob("*.pid")}


def _assert_all_dead(pids: dict[str, int]) -> None:
    end = time.monotonic() + 20.0  # SIGKILL is asynchronous, and a rank notices its
    # parent's death on a watcher thread, which load (CI's two test processes on two
    # cores) may schedule late: a bound, not a wait
    while time.monotonic() < end and any(_alive(pid) for pid in pids.values()):
        time.sleep(0.05)
    assert {name: pid for name, pid in pids.items() if _alive(pid)} == {}


# --- multi-process tests ------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_results_in_rank_order_with_torchrun_variables(start_method):
    results = run_multi_process(_describe, 3, args=(100,), kwargs={"scale": 7},
                                env={"MIRRORED_TEST_VALUE": "hello"},
                                start_method=start_method)
    assert [r["value"] for r in results] == [100 + 7 * rank for rank in range(3)]
    port = results[0]["env"]["MASTER_PORT"]
    assert 1 <= int(port) <= 65535
    for rank, r in enumerate(results):
        assert r["env"] == {"RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank),
                            "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                            "MASTER_PORT": port, "MIRRORED_TEST_VALUE": "hello"}
        assert r["threads"] == 1
        assert r["pgid"] == r["pid"] != os.getpid()  # each rank leads its own group
    assert len({r["pid"] for r in results}) == 3
    _assert_all_dead({str(i): r["pid"] for i, r in enumerate(results)})


def _environment(name: str) -> tuple[str | None, str | None]:
    return os.environ.get(name), os.environ.get("RANK")


@pytest.mark.timeout(90)
def test_ranks_get_the_callers_environment_as_it_is_at_each_call(monkeypatch):
    # (the fork server keeps the environment it started with; each call's ranks get
    # the caller's, as "spawn" children would)
    name = "MIRRORED_CALLER_VALUE"
    monkeypatch.setenv(name, "first")
    assert run_multi_process(_environment, 2, args=(name,)) == [("first", "0"), ("first", "1")]
    monkeypatch.setenv(name, "second")
    assert run_multi_process(_environment, 1, args=(name,)) == [("second", "0")]
    monkeypatch.delenv(name)
    assert run_multi_process(_environment, 1, args=(name,)) == [(None, "0")]


def _numpy_draw() -> float:
    return float(np.random.random())


@pytest.mark.timeout(90)
def test_each_rank_draws_its_own_numpy_random_numbers():
    # (a forked rank starts from the fork server's NumPy state: reseeded, as a fresh
    # process would be, else every rank of every call drew the same numbers)
    first, second = run_multi_process(_numpy_draw, 2), run_multi_process(_numpy_draw, 2)
    assert len({*first, *second}) == 4


@pytest.mark.timeout(90)
def test_exceptions_come_back_with_rank_and_traceback(tmp_path):
    with pytest.raises(MultiProcessError, match=r"^run_multi_process: rank 1 of 3 raised "
                                                r"ValueError: bad value on rank 1\n") as info:
        run_multi_process(_fail_on_rank_1, 3, args=(str(tmp_path),))
    message = str(info.value)
    assert ("other ranks: rank 2 returned a value that cannot be pickled: TypeError: cannot "
            "pickle '_thread.lock' object\n") in message
    assert "--- traceback of rank 1 ---\nTraceback (most recent call last):" in message
    assert 'in _fail_on_rank_1\n    raise ValueError(f"bad value on rank {_rank()}")' in message
    assert info.value.rank == 1
    assert info.value.failures == {1: "raised ValueError: bad value on rank 1",
                                   2: "returned a value that cannot be pickled: TypeError: "
                                      "cannot pickle '_thread.lock' object"}
    assert info.value.remote_traceback.rstrip().endswith("ValueError: bad value on rank 1")
    pids = _pids(tmp_path)
    assert sorted(pids) == ["0", "1", "2"]
    _assert_all_dead(pids)


@pytest.mark.timeout(90)
def test_timeout_kills_every_rank_and_its_process_group(tmp_path):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"timed out after 12 s: rank\(s\) 1 of 2 still "
                                           r"running .*; rank\(s\) 0 finished"):
        run_multi_process(_hang_on_rank_1, 2, args=(str(tmp_path),), timeout=12)
    assert time.monotonic() - start < 30
    pids = _pids(tmp_path)
    assert sorted(pids) == ["0", "1", "1-grandchild"]  # the ranks started in time
    _assert_all_dead(pids)


@pytest.mark.timeout(90)
def test_ranks_that_die_without_reporting(tmp_path):
    with pytest.raises(MultiProcessError, match=r"^run_multi_process: rank 0 of 3 exited "
                                                r"with code 3 before reporting a result\n"
                                                r"other ranks: rank 1 was killed by signal "
                                                r"SIGKILL \(9\) before reporting a result; "
                                                r"rank 2 was still running and was killed"
                       ) as info:
        run_multi_process(_die_without_reporting, 3, args=(str(tmp_path),))
    assert info.value.remote_traceback == ""
    assert "\nrank 1 was the first to fail\n" in str(info.value)
    assert "rank 0 left no traceback" in str(info.value)
    _assert_all_dead(_pids(tmp_path))


@pytest.mark.timeout(90)
def test_gloo_all_reduce_across_two_processes():
    results = run_multi_process(_gloo_all_reduce, 2, env={"OMP_NUM_THREADS": "2"})
    inputs = np.array([[rank + 1.0, 10.0 ** rank] for rank in range(2)])
    for value, threads in results:
        np.testing.assert_array_equal(value.numpy(), inputs.sum(axis=0))
        assert threads == 2


def _kill_the_caller(tmp_path: Path, fn: str, start_method: str, names: list[str]
                     ) -> dict[str, int]:
    """Runs ``fn`` on 2 ranks from a caller process, waits until ``names`` noted their
    pids, SIGKILLs the caller (no chance to clean up: the ranks must notice by
    themselves) and returns the pids."""
    import mirrored

    paths = [str(Path(__file__).parent), str(Path(mirrored.__file__).parents[1])]
    script = (f"import sys; sys.path[:0] = {paths!r}\n"
              "from mirrored.testing import run_multi_process\n"
              f"from test_testing import {fn}\n"
              f"run_multi_process({fn}, 2, args=({str(tmp_path)!r},), timeout=80, "
              f"start_method={start_method!r})\n")
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        end = time.monotonic() + 60
        while (len(_pids(tmp_path)) < len(names) and time.monotonic() < end
               and parent.poll() is None):
            time.sleep(0.1)
        pids = _pids(tmp_path)
        assert sorted(pids) == names
        time.sleep(0.5)  # (rank 1 inside its last call)
        assert all(_alive(pids[name]) for name in names if name != "0")
    finally:
        parent.kill()
        parent.wait()
    return pids


@pytest.mark.timeout(90)
def test_a_forked_rank_that_holds_the_gil_ends_when_the_parent_is_killed(tmp_path):
    # (the kernel's parent-death signal: a forked rank's parent, the fork server, ends
    # with the caller, no rank keeping it alive)
    _assert_all_dead(_kill_the_caller(tmp_path, "_hold_the_gil_on_rank_1", "forkserver",
                                      ["0", "1"]))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_ranks_end_with_their_process_groups_when_the_parent_is_killed(tmp_path, start_method):
    # (a forked rank's parent is the fork server: the ranks watch a pipe from the caller)
    _assert_all_dead(_kill_the_caller(tmp_path, "_hang_on_rank_1", start_method,
                                      ["0", "1", "1-grandchild"]))


# --- argument checks (no processes) -------------------------------------------------


def _unused() -> None:
    raise AssertionError("never runs")


@pytest.mark.parametrize(("call", "error", "match"), [
    (lambda: run_multi_process(42, 2), TypeError, r"fn must be a callable; got int"),
    (lambda: run_multi_process(_unused, 2.0), TypeError, r"world_size must be an int; got float"),
    (lambda: run_multi_process(_unused, 0), ValueError, r"world_size must be >= 1; got 0"),
    (lambda: run_multi_process(_unused, 1, timeout="5"), TypeError,
     r"timeout must be a number of seconds; got str"),
    (lambda: run_multi_process(_unused, 1, timeout=0), ValueError,
     r"timeout must be a finite number of seconds > 0; got 0"),
    (lambda: run_multi_process(_unused, 1, timeout=float("inf")), ValueError, r"got inf"),
    (lambda: run_multi_process(_unused, 1, args="ab"), TypeError,
     r"args must be a tuple or list; got str"),
    (lambda: run_multi_process(_unused, 1, kwargs=[1]), TypeError,
     r"kwargs must be a mapping or None; got list"),
    (lambda: run_multi_process(_unused, 1, env=["A"]), TypeError,
     r"env must be a mapping of str to str or None; got list"),
    (lambda: run_multi_process(_unused, 1, env={"A": 1}), TypeError,
     r"env must map str to str; got 'A': int 1"),
    (lambda: run_multi_process(_unused, 1, env={"OMP_NUM_THREADS": "0"}), ValueError,
     r"env\['OMP_NUM_THREADS'\] must be an integer >= 1; got '0'"),
    (lambda: run_multi_process(lambda: 1, 1), TypeError,
     r"must pickle \(use a module-level function, not a lambda or a closure\); pickling "
     r"failed: .*lambda"),
    (lambda: run_multi_process(_unused, 1, args=(lambda: 1,)), TypeError, r"must pickle"),
    (lambda: run_multi_process(_unused, 1, start_method="fork"), ValueError,
     r"start_method must be one of \('forkserver', 'spawn'\); got 'fork'"),
])
def test_argument_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_find_free_port_can_be_bound():
    import socket

    port = find_free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        assert sock.getsockname()[1] == port
