"""Multi-worker communicator benchmarks: 2 spawned workers, Gloo over 127.0.0.1,
one replica each, as ratios against raw ``torch.distributed`` in the same run.

    python benchmarks/bench_multi_worker.py            # full sizes
    python benchmarks/bench_multi_worker.py --quick    # smaller, for a smoke run

(a) 64 MiB all-reduce (SUM) through ``DistributedCommunicator.reduce_packed``
    against raw in-place ``dist.all_reduce``. Target: <= 1.1x.
(b) 200 tensors of 1 KiB in one ``reduce_packed`` against 200 raw
    ``dist.all_reduce`` calls. Target: fused >= 10x faster.
(c) the call check's cost: a 1 MiB ``reduce_packed`` with ``check_calls=True``
    against ``check_calls=False``. Target: <= 5 % more.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import mirrored
from mirrored._src.cluster import process_group
from mirrored._src.comm.distributed import DistributedCommunicator
from mirrored._src.devices import parse_devices
from mirrored._src.reduce_op import ReduceOp
from mirrored._src.runtime.topology import Topology


def _time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds per call (ranks agree on when each sample starts via a barrier)."""
    fn()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _worker(rank: int, port: int, quick: bool, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    process_group.init_process_group("gloo", rank, 2, "127.0.0.1", port, timeout_seconds=60)
    topology = Topology(devices=parse_devices(["CPU:0"]), worker_index=rank, num_workers=2)
    local = mirrored.ReductionToOneDevice()
    checked = DistributedCommunicator(local, topology, timeout_seconds=60)
    unchecked = DistributedCommunicator(local, topology, timeout_seconds=60, check_calls=False)
    dests = [topology.devices]
    repeats = 5 if quick else 15
    results: dict[str, float] = {}

    big = torch.ones((16 if quick else 64) * 2**18)  # float32: 16 or 64 MiB
    results["big_raw"] = _time(lambda: dist.all_reduce(big), repeats)
    results["big_comm"] = _time(
        lambda: checked.reduce_packed(ReduceOp.SUM, [[big]], dests, 0), repeats)

    small = [torch.ones(256) for _ in range(200)]  # 200 x 1 KiB
    results["many_raw"] = _time(lambda: [dist.all_reduce(t) for t in small], repeats)
    results["many_comm"] = _time(
        lambda: checked.reduce_packed(ReduceOp.SUM, [small], dests * 200, 0), repeats * 4)

    mib = torch.ones(2**18)  # 1 MiB
    n = 20 if quick else 100
    # Interleave the two variants so machine noise hits both alike.
    on, off = [], []
    for _ in range(n):
        on.append(_time(lambda: checked.reduce_packed(ReduceOp.SUM, [[mib]], dests, 0), 1))
        off.append(_time(lambda: unchecked.reduce_packed(ReduceOp.SUM, [[mib]], dests, 0), 1))
    results["mib_checked"] = statistics.median(on)
    results["mib_unchecked"] = statistics.median(off)
    results["mib_raw"] = _time(lambda: dist.all_reduce(mib), n)
    if rank == 0:
        out.put(results)
    process_group.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args.quick, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        r = out.get(timeout=600)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    size = "16 MiB" if args.quick else "64 MiB"
    print(f"(a) {size} all_reduce: communicator {r['big_comm'] * 1e3:.1f} ms, raw "
          f"{r['big_raw'] * 1e3:.1f} ms: {r['big_comm'] / r['big_raw']:.2f}x (target <= 1.1x)")
    print(f"(b) 200 x 1 KiB: one reduce_packed {r['many_comm'] * 1e3:.2f} ms, 200 raw "
          f"all_reduce {r['many_raw'] * 1e3:.2f} ms: {r['many_raw'] / r['many_comm']:.1f}x "
          "faster (target >= 10x)")
    cost = r["mib_checked"] / r["mib_unchecked"] - 1
    print(f"(c) 1 MiB reduce_packed: checked {r['mib_checked'] * 1e6:.0f} us, unchecked "
          f"{r['mib_unchecked'] * 1e6:.0f} us, raw all_reduce {r['mib_raw'] * 1e6:.0f} us: "
          f"check costs {cost * 100:+.1f} % (target <= 5 %)")


if __name__ == "__main__":
    main()
