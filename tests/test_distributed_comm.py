"""DistributedCommunicator across real processes: Gloo over 127.0.0.1.

Each test starts 2 or 3 workers (1-2 logical CPU replicas each; forked from the
fork server of `process_context`) with a small private helper; results come back
to the parent, which compares them with a single-process reference built from the
same closed-form inputs.
"""

from __future__ import annotations

import functools
import os
import pickle
import queue
import re
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

import mirrored
from mirrored._src.cluster.process_group import Job, JobSpec
from mirrored._src.comm.distributed import DistributedCommunicator
from mirrored._src.devices import parse_devices
from mirrored._src.errors import WorkerFailureError
from mirrored._src.reduce_op import ReduceOp
from mirrored._src.testing import process_context
from mirrored._src.topology import Topology

pytestmark = pytest.mark.multiprocess

# ------------------------------------------------------------------ spawn helper


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(fn: Callable[..., Any], rank: int, world: int, local: int, port: int,
           options: dict[str, float], results: Any) -> None:
    job = None
    try:
        job = Job.start(JobSpec(backend="gloo", rank=rank, world_size=world, master_port=port,
                                timeout_seconds=30,
                                failure_timeout_seconds=options.pop("failure", 10.0)))
        topology = Topology(devices=parse_devices([f"CPU:{i}" for i in range(local)]),
                            worker_index=rank, num_workers=world)
        comm = DistributedCommunicator(mirrored.ReductionToOneDevice(), topology, job=job,
                                       **options)
        out = fn(comm, topology)
        results.put(pickle.dumps((rank, "ok", out)))  # plain bytes: no shared fds
    except BaseException as error:  # reported to the parent, which asserts on it
        results.put(pickle.dumps((rank, "error", (type(error).__name__, str(error),
                                                  traceback.format_exc()))))
        results.close()
        results.join_thread()  # flush before leaving without teardown
        if job is not None:  # what the job's finalizer does when an uncaught exception
            job._departure()  # ends a program: it departs on it, and worker 0 keeps its
            # store up until its peers have read their messages there
        os._exit(0)  # the group may hold abandoned work: no clean teardown
    job.close()


def _spawn(fn: Callable[..., Any], world: int, local: int = 1, *, hard_timeout: float = 60,
           **options: float) -> dict[int, tuple[str, Any]]:
    """Runs ``fn(comm, topology)`` on ``world`` workers; rank -> ("ok", value) or
    ("error", (type name, message, traceback)). Kills every child on the way out."""
    ctx = process_context()  # forked from a server that imported torch once
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, local, port, dict(options),
                                              results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + hard_timeout
    try:
        while len(got) < world:
            alive = any(p.is_alive() for p in procs)
            try:
                rank, status, value = pickle.loads(results.get(timeout=0.5 if alive else 0.1))
            except queue.Empty:
                if not alive or time.monotonic() > deadline:
                    break
                continue
            got[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return got


def _values(got: dict[int, tuple[str, Any]], world: int) -> list[Any]:
    for rank in range(world):
        assert rank in got, f"worker {rank} reported nothing: {got}"
        status, value = got[rank]
        assert status == "ok", f"worker {rank} failed:\n{value[2]}"
    return [got[r][1] for r in range(world)]


# ---------------------------------------------------------------- the workloads


def _inputs(replica: int) -> list[torch.Tensor]:
    """Replica ``replica``'s components of three values (two dtypes), closed form."""
    g = torch.Generator().manual_seed(replica)
    return [torch.randn(3, 4, generator=g), torch.randint(-50, 50, (5,), generator=g),
            torch.randn(7, generator=g)]


def _reduce_and_gather(comm: DistributedCommunicator, topology: Topology) -> dict[str, Any]:
    per_replica = [_inputs(r) for r in topology.replica_ids]
    dests = [topology.devices] * 3
    out: dict[str, Any] = {}
    for op in (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX):
        # 40 bytes per pack: the two float values travel in separate packs.
        result = comm.reduce_packed(op, per_replica, dests, bytes_per_pack=40)
        out[op.name] = [[t.clone() for t in per_dest] for per_dest in result]
    rows = [torch.full((r + 1, 2), float(r)) for r in topology.replica_ids]  # uneven
    out["gather"] = comm.gather(rows, 0, topology.devices)
    out["any"] = (comm.any(topology.worker_index == 1), comm.any(False))
    return out


def _check_reduce_and_gather(world: int, local: int) -> None:
    got = _values(_spawn(_reduce_and_gather, world, local), world)
    n = world * local
    every = [_inputs(r) for r in range(n)]
    for op, fold in (("SUM", torch.add), ("MIN", torch.minimum), ("MAX", torch.maximum)):
        for k in range(3):
            expected = every[0][k]
            for r in range(1, n):
                expected = fold(expected, every[r][k])
            for w in range(world):
                assert len(got[w][op][k]) == local
                for copy in got[w][op][k]:
                    assert copy.dtype == expected.dtype
                    torch.testing.assert_close(copy, expected, rtol=1e-6, atol=1e-6)
    expected_rows = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(n)])
    for w in range(world):
        copies, sizes = got[w]["gather"]
        assert sizes == [r + 1 for r in range(n)]
        assert len(copies) == local
        for copy in copies:
            assert torch.equal(copy, expected_rows)
        assert got[w]["any"] == (True, False)


@pytest.mark.timeout(90)
def test_two_workers_two_replicas_match_the_single_process_reference() -> None:
    _check_reduce_and_gather(world=2, local=2)


@pytest.mark.timeout(90)
def test_three_workers_one_replica_match_the_single_process_reference() -> None:
    _check_reduce_and_gather(world=3, local=1)


def _different_shape(comm: DistributedCommunicator, topology: Topology) -> Any:
    size = 4 if topology.worker_index == 0 else 5
    comm.reduce_packed(ReduceOp.SUM, [[torch.ones(size)]], [topology.devices], 0)


def _skip_one(comm: DistributedCommunicator, topology: Topology) -> Any:
    if topology.worker_index != 2:  # worker 2 skips the first call
        comm.reduce_packed(ReduceOp.SUM, [[torch.ones(4)]], [topology.devices], 0)
    comm.gather([torch.ones(2, 3)], 0, topology.devices)


def _mismatches(got: dict[int, tuple[str, Any]], world: int) -> list[str]:
    assert sorted(got) == list(range(world)), got
    for rank, (status, value) in got.items():
        assert status == "error" and value[0] == "CollectiveMismatchError", (rank, value)
    return [got[r][1][1] for r in range(world)]


@pytest.mark.timeout(90)
def test_a_different_shape_raises_mismatch_on_every_worker() -> None:
    messages = _mismatches(_spawn(_different_shape, 2, timeout_seconds=20), 2)
    for message in messages:
        assert "collective #1" in message and "no data of it was used" in message
        assert re.search(r"worker 0: DistributedCommunicator.reduce_packed\(SUM of float32\[4\]\) "
                         r"at test_distributed_comm.py:\d+", message), message
        assert "worker 1: DistributedCommunicator.reduce_packed(SUM of float32[5])" in message


@pytest.mark.timeout(90)
def test_a_skipped_call_raises_mismatch_on_every_worker() -> None:
    messages = _mismatches(_spawn(_skip_one, 3, timeout_seconds=20), 3)
    for message in messages:
        assert "worker 2: DistributedCommunicator.gather(gather of float32[-1, 3] along 0)" in (
            message)
        assert "worker 0: DistributedCommunicator.reduce_packed" in message


def _skip_last_and_leave(comm: DistributedCommunicator, topology: Topology) -> Any:
    comm.any(True)
    if topology.worker_index == 0:
        start = time.monotonic()
        try:
            comm.any(True)
        finally:
            assert time.monotonic() - start < 10


@pytest.mark.timeout(90)
def test_a_worker_that_leaves_early_is_a_mismatch_not_a_hang() -> None:
    got = _spawn(_skip_last_and_leave, 2, timeout_seconds=30, failure=2.0)
    assert got[1] == ("ok", None)
    status, (name, message, _) = got[0]
    assert (status, name) == ("error", "CollectiveMismatchError"), got[0]
    assert "worker 1 left after 1 collectives" in message
    assert "or ended its loop early (an error it caught, a break)" in message


def _host_leaves_early(comm: DistributedCommunicator, topology: Topology) -> Any:
    comm.any(True)
    if topology.worker_index == 1:  # worker 0, the store's host, has left normally
        time.sleep(0.3)
        start = time.monotonic()
        try:
            comm.any(True)
        finally:
            assert time.monotonic() - start < 5


@pytest.mark.timeout(90)
def test_the_store_host_leaving_early_is_a_mismatch_not_a_death() -> None:
    # Its record must outlive it long enough for its peers to read (a few beats): else
    # the store vanishes with it and they see a silent host, a failure timeout later.
    got = _spawn(_host_leaves_early, 2, timeout_seconds=30, failure=10.0)
    assert got[0] == ("ok", None)
    status, (name, message, _) = got[1]
    assert (status, name) == ("error", "CollectiveMismatchError"), got[1]
    assert "worker 0 left after 1 collectives" in message


def _die(comm: DistributedCommunicator, topology: Topology) -> Any:
    comm.any(True)
    if topology.worker_index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        comm.reduce_packed(ReduceOp.SUM, [[torch.ones(8)]], [topology.devices], 0)
    except WorkerFailureError as error:
        return (str(error), error.workers, time.monotonic() - start)
    return None


@pytest.mark.timeout(90)
def test_a_killed_worker_is_named_by_the_survivors_within_the_bound() -> None:
    got = _spawn(_die, 3, timeout_seconds=60, failure=3.0)
    assert 1 not in got  # killed: it reports nothing
    for rank in (0, 2):
        status, value = got[rank]
        assert status == "ok" and value is not None, (rank, value)
        message, workers, elapsed = value
        assert workers == (1,)
        assert message.startswith("worker 1 failed")
        assert elapsed < 3.0 + 5.0


def _late(comm: DistributedCommunicator, topology: Topology) -> Any:
    if topology.worker_index == 1:
        time.sleep(6)  # alive, but never joins
        return None
    start = time.monotonic()
    with pytest.raises(mirrored.CollectiveTimeoutError,  # our deadline, or Gloo's if first
                       match=r"waited 2 s in .*collective #1"):
        comm.reduce_packed(ReduceOp.MAX, [[torch.ones(3)]], [topology.devices], 0)
    return time.monotonic() - start


@pytest.mark.timeout(90)
def test_a_peer_that_never_joins_times_out() -> None:
    elapsed, _ = _values(_spawn(_late, 2, timeout_seconds=2), 2)
    assert 1.9 <= elapsed < 8.0  # generous: a loaded CI machine


# ------------------------------------------------------- large packs, in chunks

_BIG = (4 << 20) // 4 + 3  # float32 elements: just over CHUNK_MIN_BYTES, uneven chunks


def _big_inputs(replica: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + replica)
    return [torch.randn(_BIG, generator=g), torch.randn(3 << 18, generator=g),
            torch.randn(3 << 18, generator=g)]


def _big_calls(comm: DistributedCommunicator, topology: Topology) -> dict[str, Any]:
    per_replica = [_big_inputs(r) for r in topology.replica_ids]
    before = [[t.clone() for t in leaves] for leaves in per_replica]
    out: dict[str, Any] = {}
    for i in range(3):  # the first call in two steps, then the check in the data
        sums = comm.reduce_packed(ReduceOp.SUM, [leaves[:1] for leaves in per_replica],
                                  [topology.devices], 0)
        out[f"sum{i}"] = [t.clone() for t in sums[0]]
        assert all(t.data_ptr() != leaves[0].data_ptr()
                   for t in sums[0] for leaves in per_replica)
    # two 3 MiB leaves in one pack (copied leaf by leaf), then a MAX
    both = comm.reduce_packed(ReduceOp.SUM, [leaves[1:] for leaves in per_replica],
                              [topology.devices] * 2, 0)
    out["pack"] = [[t.clone() for t in per_dest] for per_dest in both]
    out["max"] = comm.reduce_packed(ReduceOp.MAX, [leaves[:1] for leaves in per_replica],
                                    [topology.devices], 0)[0][0].clone()
    out["unchanged"] = all(torch.equal(a, b) for la, lb in zip(per_replica, before, strict=True)
                           for a, b in zip(la, lb, strict=True))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local", [1, 2])
def test_large_packs_in_chunks_equal_the_single_process_reference_bitwise(local: int) -> None:
    got = _values(_spawn(_big_calls, 2, local, hard_timeout=100), 2)
    every = [_big_inputs(r) for r in range(2 * local)]

    def local_then_across(k: int, fold: Callable[..., torch.Tensor]) -> torch.Tensor:
        per_worker = []
        for w in range(2):
            part = every[w * local][k]
            for r in range(w * local + 1, (w + 1) * local):
                part = fold(part, every[r][k])
            per_worker.append(part)
        return fold(per_worker[0], per_worker[1])

    expected = [local_then_across(k, torch.add) for k in range(3)]
    for w in range(2):
        assert got[w]["unchanged"]
        for i in range(3):
            assert len(got[w][f"sum{i}"]) == local
            for copy in got[w][f"sum{i}"]:
                assert torch.equal(copy, expected[0])
        for k in (1, 2):
            for copy in got[w]["pack"][k - 1]:
                assert torch.equal(copy, expected[k])
        assert torch.equal(got[w]["max"], local_then_across(0, torch.maximum))


def _big_then_different(comm: DistributedCommunicator, topology: Topology) -> Any:
    big = torch.ones(_BIG)
    for _ in range(2):  # the workers agree on the next call's chunks
        comm.reduce_packed(ReduceOp.SUM, [[big]], [topology.devices], 0)
    size = _BIG if topology.worker_index == 0 else _BIG + 4
    comm.reduce_packed(ReduceOp.SUM, [[torch.ones(size)]], [topology.devices], 0)


@pytest.mark.timeout(90)
def test_a_different_size_after_agreed_chunks_raises_mismatch_on_every_worker() -> None:
    messages = _mismatches(_spawn(_big_then_different, 2, timeout_seconds=20), 2)
    for message in messages:
        assert "collective #3" in message and "no data of it was used" in message
        assert f"worker 1: DistributedCommunicator.reduce_packed(SUM of float32[{_BIG + 4}])" in (
            message)


def test_chunks_cover_the_buffer_and_copy_the_source() -> None:
    from mirrored._src.comm.slots import CHUNK_MIN_BYTES, CHUNKS, ResultSlot

    n, extra = CHUNK_MIN_BYTES // 4 + 5, 6
    slot = ResultSlot([(n, torch.float32, extra, True)], [True], torch.device("cpu"),
                      kept=True)
    [buffer], [parts] = slot.buffers, slot.parts
    assert len(parts) == CHUNKS
    assert sum(c.numel() for c, _, _ in parts) == n + extra
    assert parts[0][0][-extra:].data_ptr() == buffer[n:].data_ptr()  # the trailer's, first
    source = torch.arange(n, dtype=torch.float32)
    buffer.fill_(-1.0)
    for _, (a, b), dst in parts:  # type: ignore[misc]
        dst.copy_(source[a:b])
    assert torch.equal(buffer[:n], source) and bool((buffer[n:] == -1).all())
    # from leaves: one collective, the whole buffer, copied into views shaped like them
    small = ResultSlot([(10, torch.float32, extra, True)], [False], torch.device("cpu"),
                       kept=True)
    [[(whole, span, dst)]] = small.parts
    assert whole is small.buffers[0] and span is None and dst is None
    payload, shaped = small.results(0, [torch.empty(2, 3, device="meta"),
                                        torch.empty(4, device="meta")])
    assert payload.data_ptr() == whole.data_ptr() and payload.numel() == 10
    assert [t.shape for t in shaped] == [(2, 3), (4,)]
    unsplit = ResultSlot([(n, torch.float32, extra, False)], [True], torch.device("cpu"),
                         kept=True)
    assert len(unsplit.parts[0]) == 1


def test_a_kept_slot_is_free_only_when_nothing_else_holds_it() -> None:
    import weakref

    from mirrored._src.comm.slots import ResultSlot

    slot = ResultSlot([(6, torch.float32, 2, True)], [True], torch.device("cpu"), kept=True)
    like = [torch.empty(2, 3, device="meta")]
    assert slot.free()
    result = slot.results(0, like)[1][0]
    assert not slot.free()  # a result (a view of the buffer)
    del result
    assert slot.free()
    p = torch.nn.Parameter(torch.zeros(2, 3))
    p.grad = slot.results(0, like)[1][0]
    assert not slot.free()  # a parameter's .grad (held in C++ only)
    p.grad = None
    assert slot.free()
    detached = slot.results(0, like)[1][0].detach()
    assert not slot.free()  # another tensor on the storage
    del detached
    array = slot.results(0, like)[0].numpy()
    assert not slot.free()
    del array
    storage = slot.results(0, like)[0].untyped_storage()
    assert not slot.free()  # the storage object itself
    del storage
    saved = slot.results(0, like)[1][0] * torch.ones(2, 3, requires_grad=True)
    assert not slot.free()  # autograd saved it for backward
    del saved
    assert slot.free()
    ref = weakref.ref(slot.buffers[0])
    assert not slot.free()  # a weak reference to the slot's own tensor
    del ref
    held = slot.parts[0][0][0]
    assert not slot.free()  # its own tensors, held elsewhere (a collective's)
    del held
    assert slot.free()
    not_kept = ResultSlot([(6, torch.float32, 2, True)], [True], torch.device("cpu"),
                          kept=False)
    assert not not_kept.free()
    assert not slot.stuck()
    slot.results(0, like)[0].share_memory_()  # another process may read it: never again
    assert not slot.free() and slot.stuck()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_repeated_half_precision_calls_reuse_buffers_only_once_released(dtype) -> None:
    # Half precision carries its check in a header, not a trailer: the kept buffers
    # hold the payload only, and a held result keeps its values.
    job = Job.start(JobSpec(backend="gloo", rank=0, world_size=1, timeout_seconds=10,
                            master_port=mirrored.testing.find_free_port()))
    try:
        topology = Topology(devices=parse_devices(["CPU:0"]))
        comm = DistributedCommunicator(mirrored.ReductionToOneDevice(), topology, job=job)

        def call(value: float) -> list[torch.Tensor]:
            leaves = [torch.full((3, 2), value, dtype=dtype), torch.full((5,), -value,
                                                                          dtype=dtype)]
            return [v[0] for v in comm.reduce_packed(ReduceOp.SUM, [leaves],
                                                     [topology.devices] * 2, 0)]

        held = [call(float(k)) for k in range(4)]  # every result held: never overwritten
        for k, (a, b) in enumerate(held):
            assert a.dtype == dtype and torch.equal(a, torch.full((3, 2), float(k), dtype=dtype))
            assert torch.equal(b, torch.full((5,), -float(k), dtype=dtype))
        assert len({a.data_ptr() for a, _ in held}) == 4
        kept = [a.data_ptr() for a, _ in held[1:3]]  # (a plan keeps from its second call)
        del held
        again = call(0.5)
        assert again[0].data_ptr() in kept and torch.equal(
            again[1], torch.full((5,), -0.5, dtype=dtype))
    finally:
        job.close()


def test_repeated_calls_reuse_results_only_once_released() -> None:
    # One worker: a kept slot's results come back at the next call once released, never
    # while held (a held result keeps its values; the call takes the other slot).
    job = Job.start(JobSpec(backend="gloo", rank=0, world_size=1, timeout_seconds=10,
                            master_port=mirrored.testing.find_free_port()))
    try:
        topology = Topology(devices=parse_devices(["CPU:0"]))
        comm = DistributedCommunicator(mirrored.ReductionToOneDevice(), topology, job=job)
        leaves = [torch.ones(2, 3), torch.full((4,), 2.0)]

        def call(scale: float) -> list[torch.Tensor]:
            out = comm.reduce_packed(ReduceOp.SUM, [[t * scale for t in leaves]],
                                     [topology.devices] * 2, 0)
            return [values[0] for values in out]

        call(0.5)  # a plan's first call keeps nothing (it may never repeat)
        assert comm._kept_bytes == 0
        first = call(1.0)
        first_ptr = first[0].data_ptr()
        held = call(2.0)  # `first` held: another slot
        held_ptr = held[0].data_ptr()
        assert held_ptr != first_ptr
        assert torch.equal(first[0], torch.ones(2, 3)) and torch.equal(first[1], leaves[1])
        del first
        again = call(3.0)  # `first`'s slot is free again
        assert again[0].data_ptr() == first_ptr
        assert torch.equal(held[0], torch.full((2, 3), 2.0))
        assert torch.equal(again[1], torch.full((4,), 6.0))
        third = call(4.0)  # both kept slots held: new buffers, the held ones untouched
        assert third[0].data_ptr() not in (first_ptr, held[0].data_ptr())
        assert torch.equal(held[1], torch.full((4,), 4.0))
        assert torch.equal(again[0], torch.full((2, 3), 3.0))
        assert torch.equal(third[0], torch.full((2, 3), 4.0))
        # A result's state never reaches the next call's results (new views each call).
        again[0].requires_grad_()
        again[1].unsqueeze_(0)
        assert again[0].data_ptr() == first_ptr
        del again, held, third
        with torch.no_grad():
            made = call(5.0)
        assert made[0].data_ptr() in (first_ptr, held_ptr)  # a kept buffer, reused
        del made
        fresh = call(6.0)
        assert fresh[0].data_ptr() in (first_ptr, held_ptr)
        assert not fresh[0].requires_grad and fresh[1].shape == (4,)
        assert fresh[0].grad_fn is None and fresh[1]._base is not None
        fresh[0].add_(torch.ones(2, 3, requires_grad=True))  # fine in grad mode
        assert torch.equal(fresh[1], torch.full((4,), 12.0))
        del fresh
        # Inputs that require grad, in grad mode, through the same plan: new buffers,
        # the kept ones untouched (a kept one would chain each call's graph to the last).
        [slots] = [known[3] for known in comm._plans.values() if len(known[3]) == 2]
        w = torch.ones(2, 3, requires_grad=True)
        for scale in (1.0, 2.0):
            out = comm.reduce_packed(ReduceOp.SUM, [[w * scale, leaves[1]]],
                                     [topology.devices] * 2, 0)
            assert out[0][0].requires_grad and out[0][0].data_ptr() not in (first_ptr, held_ptr)
            assert torch.equal(out[0][0], torch.full((2, 3), scale))
            del out
        assert len(slots) == 2  # (one took history from `fresh`'s add_ above: dropped below)
        ptrs = set()
        for scale in (1.0, 2.0, 3.0):
            out = comm.reduce_packed(ReduceOp.SUM, [[w * scale]], [topology.devices], 0)
            total = out[0][0]
            assert total.requires_grad and torch.equal(total, torch.full((2, 3), scale))
            (grad,) = torch.autograd.grad(total.sum(), w)
            assert torch.equal(grad, torch.full((2, 3), scale))  # this call's graph only
            ptrs.add(total.data_ptr())
            del out, total
        assert not ptrs & {first_ptr, held_ptr}
        plain = call(7.0)  # and the kept buffers still serve plain calls
        assert plain[0].data_ptr() in (first_ptr, held_ptr) and not plain[0].requires_grad
        # A result given autograd history in place: its slot can never be free again,
        # and is dropped (with the graph it holds) at the next call that needs one.
        plain[0].mul_(w)
        del plain
        kept = comm._kept_bytes
        with torch.inference_mode():  # inference slots stay apart from the others
            inferred = call(8.0)
        # (by the slot that holds it: a dropped slot's freed address may come back)
        owner = [s for s in slots if s.buffers[0].data_ptr() == inferred[0].data_ptr()]
        assert all(s.inference for s in owner)
        del inferred
        again = call(9.0), call(9.5)
        assert len(slots) == 2 and comm._kept_bytes <= kept
        assert not any(t.requires_grad for s in slots for t in s.buffers)
        del again
        # A call whose destinations are a new tuple each time keeps nothing.
        before = comm._kept_bytes
        places = [tuple(list(topology.devices)) for _ in range(5)]  # (alive: new ids)
        for place in places:
            comm.reduce_packed(ReduceOp.SUM, [[torch.ones(6)]], [place], 0)
        assert comm._kept_bytes == before
    finally:
        job.close()


def _replica_counts(comm: DistributedCommunicator, topology: Topology) -> list[bool]:
    # The same leaves from one replica, then from two: one collective over the leaves,
    # then a flat local sum in chunks (`CHUNKS`): a plan of its own each, so the call's
    # wire sizes, and where its trailer ends, are the buffer's.
    from mirrored._src.comm.distributed import CHUNK_MIN_BYTES

    def inputs(worker: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(worker)
        return torch.randn(CHUNK_MIN_BYTES // 4 + 7, generator=g), torch.randn(3, 5, generator=g)

    a, b = inputs(topology.worker_index)
    everyone = [inputs(w) for w in range(topology.num_workers)]
    want_a, want_b = sum(x for x, _ in everyone), sum(y for _, y in everyone)
    out = []
    for replicas in (1, 1, 1, 2, 2, 1):
        got = comm.reduce_packed(ReduceOp.SUM, [[a, b]] * replicas, [topology.devices] * 2, 0)
        out.append(torch.allclose(got[0][0], replicas * want_a, rtol=1e-6, atol=1e-5)
                   and torch.allclose(got[1][0], replicas * want_b, rtol=1e-6, atol=1e-5))
    return out


def _against_raw(comm: DistributedCommunicator, topology: Topology) -> bool:
    from mirrored._src.comm import trailer

    x = _big_inputs(topology.worker_index)[0]
    ours = comm.reduce_packed(ReduceOp.SUM, [[x]], [topology.devices], 0)[0][0]
    # raw Gloo on a buffer laid out as the call's (the trailer's zeros after the data)
    extra = trailer.length("sum", torch.float32, topology.num_workers)
    raw = torch.cat([x, torch.zeros(extra)])
    torch.distributed.all_reduce(raw)
    return torch.equal(ours, raw[:_BIG])


@pytest.mark.timeout(120)
def test_one_and_two_local_replicas_of_the_same_leaves_are_two_plans() -> None:
    results = _spawn(_replica_counts, 2)
    assert results == {0: ("ok", [True] * 6), 1: ("ok", [True] * 6)}, results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_a_large_float_sum_is_bitwise_the_raw_collectives_sum(world: int) -> None:
    # 2 workers: in chunks (a + b either way); 3: one collective (a ring's order of
    # addition follows an element's position in the transfer).
    assert _values(_spawn(_against_raw, world, hard_timeout=100), world) == [True] * world


# ------------------------------------------------ a large SUM between 2 workers


def _large_inputs(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    n = (4 << 20) // 4 + 7  # odd: the chunks differ in size
    return [torch.randn(n, 1, generator=g), torch.randn(n, generator=g).double(),
            torch.randint(-2**40, 2**40, (n,), generator=g),
            torch.randn(3, n // 3, generator=g).t()]  # not contiguous


def _large_calls(comm: DistributedCommunicator, topology: Topology) -> list[bool]:
    same = []
    for x in _large_inputs(topology.worker_index):
        before = x.clone()
        raw = x.clone()
        torch.distributed.all_reduce(raw)
        for _ in range(3):  # the first call checked by a header, then by prediction
            out = comm.reduce_packed(ReduceOp.SUM, [[x]], [topology.devices], 0)[0][0]
            same.append(torch.equal(out, raw) and out.shape == x.shape
                        and out.data_ptr() != x.data_ptr() and torch.equal(x, before))
    return same


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", [True, False])
def test_a_large_sum_between_two_workers_is_bitwise_the_raw_all_reduce(check: bool) -> None:
    for values in _values(_spawn(_large_calls, 2, hard_timeout=100, check_calls=check), 2):
        assert values == [True] * len(values)


def _large_then_other_shape(comm: DistributedCommunicator, topology: Topology) -> Any:
    x = torch.ones(_BIG)
    for _ in range(2):  # the workers agree on the next call's sizes
        comm.reduce_packed(ReduceOp.SUM, [[x]], [topology.devices], 0)
    mine = x.view(1, -1) if topology.worker_index == 1 else x  # same sizes, another call
    try:
        comm.reduce_packed(ReduceOp.SUM, [[mine]], [topology.devices], 0)
    finally:
        assert bool((x == 1).all())  # the input is never written


@pytest.mark.timeout(90)
def test_a_different_call_of_the_same_large_size_raises_mismatch() -> None:
    messages = _mismatches(_spawn(_large_then_other_shape, 2, timeout_seconds=20), 2)
    for message in messages:
        assert "collective #3" in message and "no data of it was used" in message
        assert f"worker 1: DistributedCommunicator.reduce_packed(SUM of float32[1, {_BIG}])" in (
            message)


def _large_late(comm: DistributedCommunicator, topology: Topology) -> Any:
    if topology.worker_index == 1:
        time.sleep(6)  # alive, but never joins
        return None
    start = time.monotonic()
    with pytest.raises(mirrored.CollectiveTimeoutError, match=r"waited 2 s in .*collective #1"):
        comm.reduce_packed(ReduceOp.SUM, [[torch.ones(_BIG)]], [topology.devices], 0)
    return time.monotonic() - start


@pytest.mark.timeout(90)
def test_a_peer_that_never_joins_a_large_sum_times_out() -> None:
    # unchecked: straight to the data's collectives
    elapsed, _ = _values(_spawn(_large_late, 2, timeout_seconds=2, check_calls=False), 2)
    assert 1.9 <= elapsed < 8.0


def _large_die(comm: DistributedCommunicator, topology: Topology) -> Any:
    comm.any(True)
    if topology.worker_index == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        comm.reduce_packed(ReduceOp.SUM, [[torch.ones(_BIG)]], [topology.devices], 0)
    except WorkerFailureError as error:
        return (str(error), error.workers, time.monotonic() - start)
    return None


@pytest.mark.timeout(90)
def test_a_peer_killed_before_a_large_sum_is_named() -> None:
    got = _spawn(_large_die, 2, timeout_seconds=60, failure=3.0, check_calls=False)
    status, value = got[0]
    assert status == "ok" and value is not None, value
    message, workers, elapsed = value
    assert workers == (1,) and message.startswith("worker 1 failed"), message
    assert elapsed < 3.0 + 5.0


def _half_then_different(comm: DistributedCommunicator, topology: Topology) -> Any:
    # float16 carries no trailer: its check is a header all-gathered beside the data.
    x = torch.full((6,), 1.5 + topology.worker_index, dtype=torch.float16)
    sums = [comm.reduce_packed(ReduceOp.SUM, [[x]], [topology.devices], 0)[0][0]
            for _ in range(3)]  # the second and third travel with their agreed header
    size = 6 if topology.worker_index == 0 else 7  # then worker 1 misses the agreed sizes
    try:
        comm.reduce_packed(ReduceOp.SUM, [[torch.ones(size, dtype=torch.float16)]],
                           [topology.devices], 0)
    except Exception as error:  # (reported to the test)
        return [s.tolist() for s in sums], type(error).__name__, str(error)
    return [s.tolist() for s in sums], None, ""


@pytest.mark.timeout(90)
def test_half_precision_sums_travel_with_a_header_and_a_missed_size_is_a_mismatch() -> None:
    for sums, error, message in _values(_spawn(_half_then_different, 2, timeout_seconds=20), 2):
        assert sums == [[4.0] * 6] * 3  # 1.5 + 2.5 on every call, exact in float16
        assert error == "CollectiveMismatchError", message
        assert "collective #4" in message and "no data of it was used" in message
        assert "worker 1: DistributedCommunicator.reduce_packed(SUM of float16[7])" in message


def _counts_then_different(comm: DistributedCommunicator, topology: Topology, final: str,
                           flat: bool) -> Any:
    # One count (compute_average_loss's) travels in the header row itself (on two
    # workers, an exchanged int64 SUM); several counts, in an int64 all-reduce; looped
    # with a float32 sum (its check rides in the data) and a float16 sum (header beside
    # the data), as a training loop repeats its calls: the predictions agree from the
    # second step on.
    if not flat:  # a torch whose Gloo lacks the flat all-gather: header rows as a list
        from mirrored._src.comm import cross_call

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("no support for _allgather_base in Gloo process group")
        cross_call._GATHER_INTO = refuse
    me = topology.worker_index
    got = []

    def sums(dtype: torch.dtype, n: int) -> None:
        comm.reduce_packed(ReduceOp.SUM, [[torch.ones(n, dtype=dtype)]], [topology.devices], 0)
    for step in range(4):
        got.append(comm.sum_counts([[3 * me + step]]))
        got.append(comm.sum_counts([[me, 10 * me + step]]))
        sums(torch.float32, 5)
        sums(torch.float16, 6)
    got.append(comm.sum_counts([[3 * me + 4]]))
    got.append(comm.sum_counts([[me, 10 * me + 4]]))
    try:  # worker 0 sums a count where the others make the predicted data call
        if final == "float16":
            sums(torch.float32, 5)
        if me == 0:
            comm.sum_counts([[7]])
        else:
            sums(getattr(torch, final), 5 if final == "float32" else 6)
    except Exception as error:  # (reported to the test)
        return got, type(error).__name__, str(error)
    return got, None, ""


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("final", "flat", "world"), [("float32", True, 3),
                                                      ("float16", False, 2)])
def test_example_counts_are_exact_and_a_count_for_a_predicted_sum_is_a_mismatch(
        final: str, flat: bool, world: int) -> None:
    got = _values(_spawn(functools.partial(_counts_then_different, final=final, flat=flat),
                         world, timeout_seconds=20), world)
    w = sum(range(world))
    for counts, error, message in got:
        # worker k's counts: 3k + step (one value); k and 10k + step (two values)
        assert counts == [v for step in range(5)
                          for v in ([3 * w + world * step], [w, 10 * w + world * step])]
        assert error == "CollectiveMismatchError", message
        index = 19 if final == "float32" else 20
        assert f"collective #{index}" in message and "no data of it was used" in message
        assert "worker 0: DistributedCommunicator.sum_counts(element count of 1 value)" in (
            message), message
        size = 5 if final == "float32" else 6
        assert f"worker 1: DistributedCommunicator.reduce_packed(SUM of {final}[{size}])" in (
            message), message
