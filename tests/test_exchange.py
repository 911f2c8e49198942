"""The two-worker SUM as one exchange (`comm/exchange.py`): bitwise Gloo's all-reduce
for every dtype it takes (a NaN where Gloo's is one), on inputs with infinities,
signed zeros, subnormals and values far apart in magnitude; the same bits on both
workers where a NaN meets a NaN; waited for across the watch's polls; used for SUM
only, and only on two workers."""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mirrored
from mirrored._src.comm import exchange
from mirrored._src.comm.distributed import DistributedCommunicator
from mirrored._src.devices import parse_devices
from mirrored._src.reduce_op import ReduceOp
from mirrored._src.topology import Topology

pytestmark = pytest.mark.multiprocess


def _values(rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    """Rank ``rank``'s inputs: random magnitudes over a wide range of exponents, with
    specials (±inf, ±0, subnormals, the largest finite) at fixed places."""
    g = torch.Generator().manual_seed(1000 + rank)
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        x = torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64)
        x[:3] = torch.tensor([info.max, info.min, -1])  # (a SUM wraps, as Gloo's does)
        return x.to(dtype)
    finfo = torch.finfo(dtype)
    wide = torch.randn(n, generator=g, dtype=torch.float64) * torch.exp2(
        torch.randint(-30, 30, (n,), generator=g).double())
    x = wide.to(dtype)
    specials = [float("inf"), float("-inf"), 0.0, -0.0, finfo.tiny / 4, -finfo.tiny / 8,
                finfo.max, -finfo.max, finfo.eps]
    at = 5 + rank  # (the two workers' specials meet each other and ordinary values)
    x[at:at + len(specials)] = torch.tensor(specials, dtype=torch.float64).to(dtype)
    return x


def _bits(t: torch.Tensor) -> list[int]:
    ints = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
    flat = t.reshape(-1)
    return (flat.view(ints[t.element_size()]) if t.is_floating_point() else flat).tolist()


def _compare_with_all_reduce() -> dict[str, Any]:
    dist.init_process_group("gloo")
    try:
        pair = exchange.pair_exchange(None, world=2, host=True)
        assert pair is not None
        launch = pair.sum
        rank, out = dist.get_rank(), {}
        for dtype in sorted(exchange.EXCHANGED, key=str):
            for n in (40, 300_000):  # (the larger from the buffer pool)
                x = _values(rank, dtype, n)
                expected = x.clone()
                dist.all_reduce(expected)
                got = x.clone()
                work = launch(got)
                assert work.wait(datetime.timedelta(seconds=30)) is True
                assert work.is_completed() and work.wait() is True  # (added once)
                # bitwise, except which NaN an invalid sum (inf + -inf) gives: in bfloat16
                # Gloo's rounding keeps float32's sign of the NaN and torch's does not
                nan = got.isnan() if dtype.is_floating_point else torch.zeros(n, dtype=torch.bool)
                same = bool((nan == expected.isnan()).all()) if dtype.is_floating_point else True
                out[f"{dtype}/{n}"] = (same and _bits(got[~nan]) == _bits(expected[~nan]),
                                       _bits(got)[:20])
        nan = torch.tensor([float("nan"), 1.0, float("nan")])  # payloads differ by rank
        nan.view(torch.int32)[0] += rank + 1
        launch(nan).wait()
        out["nan"] = _bits(nan)
        return out
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_the_exchange_is_bitwise_gloos_all_reduce_and_alike_on_both_workers() -> None:
    first, second = mirrored.testing.run_multi_process(_compare_with_all_reduce, 2,
                                                       timeout=100)
    assert first.keys() == second.keys()
    for key in first:
        if key == "nan":
            continue
        assert first[key][0] and second[key][0], f"{key}: differs from dist.all_reduce"
        assert first[key][1] == second[key][1], key
    assert first["nan"] == second["nan"]  # (worker 0's values first on both)


def _calls(local: int, delay: float) -> dict[str, Any]:
    from mirrored._src.cluster.process_group import Job, JobSpec
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    job = Job.start(JobSpec(backend="gloo", rank=rank, world_size=world,
                            master_port=int(os.environ["MASTER_PORT"]), timeout_seconds=30,
                            failure_timeout_seconds=1.0))  # (the watch polls every 0.1 s)
    launched, sourced = [], []
    real = exchange.Pair.sum

    def spy(self: exchange.Pair, buffer: torch.Tensor,
            source: torch.Tensor | None = None) -> exchange.Exchange:
        launched.append(buffer.numel())
        sourced.append(source is not None)
        return real(self, buffer, source)
    exchange.Pair.sum = spy  # type: ignore[method-assign]
    try:
        topology = Topology(devices=parse_devices([f"CPU:{i}" for i in range(local)]),
                            worker_index=rank, num_workers=world)
        comm = DistributedCommunicator(mirrored.ReductionToOneDevice(), topology, job=job)
        values = [[torch.full((1000,), float(r + 1)), torch.arange(6)] for r in
                  topology.replica_ids]
        out: dict[str, Any] = {}
        for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.SUM):
            if rank == 1:
                time.sleep(delay)  # the other worker waits through several polls
            before = len(launched)
            result = comm.reduce_packed(op, values, [topology.devices] * 2, 0)
            out[f"{op.name}{len(out)}"] = ([r[0].tolist() for r in result],
                                           len(launched) - before)
        # A large value travels in chunks; those without the trailer are sent from the
        # input itself (no copy first), which stays as it was.
        big = torch.arange(5 << 20, dtype=torch.float32) * (rank + 1)
        before, was = len(sourced), big.clone()
        for _ in range(2):
            total = comm.reduce_packed(ReduceOp.SUM, [[big]], [topology.devices], 0)[0][0]
        out["big"] = (torch.equal(big, was), torch.equal(total, big / (rank + 1) * 3),
                      sum(sourced[before:]))
        return out
    finally:
        exchange.Pair.sum = real  # type: ignore[method-assign]
        job.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "local"), [(2, 1), (2, 2), (3, 1)])
def test_sums_of_two_workers_are_exchanged_and_waited_for_across_polls(world: int,
                                                                      local: int) -> None:
    results = mirrored.testing.run_multi_process(_calls, world, args=(local, 0.5),
                                                 timeout=100)
    replicas = world * local
    total = float(replicas * (replicas + 1) // 2)
    for out in results:
        untouched, exact, sent_as_is = out.pop("big")
        assert untouched and (exact or world != 2 or local != 1)
        assert (sent_as_is >= 2) if world == 2 else sent_as_is == 0
        for key, (values, exchanges) in out.items():
            floats, ints = values
            if key.startswith("SUM"):
                assert floats == [total] * 1000 and ints == [replicas * k for k in range(6)]
                # (a plan's first call: a gathered header, then its data exchanged)
                assert (exchanges >= 1) if world == 2 else (exchanges == 0), (key, exchanges)
            else:
                assert floats == [float(replicas)] * 1000 and ints == list(range(6))
                assert exchanges == 0, key  # (a MAX stays Gloo's all-reduce)


def _with_history(check: bool) -> list[Any]:
    from mirrored._src.cluster.process_group import Job, JobSpec
    rank = int(os.environ["RANK"])
    job = Job.start(JobSpec(backend="gloo", rank=rank, world_size=2,
                            master_port=int(os.environ["MASTER_PORT"]), timeout_seconds=30))
    try:
        topology = Topology(devices=parse_devices(["CPU:0"]), worker_index=rank, num_workers=2)
        comm = DistributedCommunicator(mirrored.ReductionToOneDevice(), topology, job=job,
                                       check_calls=check)
        out = []
        # One chunk each (with the trailer when checked). (A value cut into chunks is
        # refused with autograd history, before and after the exchange: the public
        # calls detach their inputs.)
        for n in (5, 300_000):
            leaf = torch.full((n,), float(rank + 1), requires_grad=True)
            for _ in range(2):  # (the header's call, then the predicted one)
                x = leaf * 1  # autograd history, in grad mode
                total = comm.reduce_packed(ReduceOp.SUM, [[x]], [topology.devices], 0)[0][0]
                out.append((bool((total == 3.0).all()), total.requires_grad,
                            bool((x == rank + 1).all())))
        return out
    finally:
        job.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", [True, False])
def test_inputs_with_autograd_history_are_summed_and_keep_the_copys_history(
        check: bool) -> None:
    for out in mirrored.testing.run_multi_process(_with_history, 2, args=(check,),
                                                  timeout=100):
        assert out == [(True, True, True)] * 4
