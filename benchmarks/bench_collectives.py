"""Collective benchmarks on logical CPU replicas, as ratios against baselines measured
in the same run.

    python benchmarks/bench_collectives.py            # full sizes
    python benchmarks/bench_collectives.py --quick    # smaller, for a smoke run

(a) ``run`` of a step doing one scalar ``all_reduce`` on 2 replicas, against ``run``
    of an empty step. Target: <= 60 us per step.
(b) 200 tensors of 1 KiB in one (fused) ``all_reduce`` against 200 separate
    ``all_reduce`` calls, in one step on 2 replicas. Target: fused >= 10x faster.
(c) ``all_reduce(SUM)`` of 64 MiB on 2 replicas (every replica gets its own copy)
    against one ``torch.add`` of two such tensors into a preallocated output.
    Target: <= 2x.
"""

from __future__ import annotations

import _thread
import argparse
import statistics
import threading
import time
from collections.abc import Callable

import torch

import mirrored


def interleaved_medians(fns: list[Callable[[], object]], rounds: int, inner: int) -> list[float]:
    """Median seconds per call of each fn, timed alternately so noise hits all alike."""
    for fn in fns:
        for _ in range(max(2, inner // 10)):
            fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, out in zip(fns, samples, strict=True):
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            out.append((time.perf_counter() - start) / inner)
    return [statistics.median(s) for s in samples]


def verdict(ok: bool) -> str:
    return "meets target" if ok else "MISSES target"


def handoff_round_trip(rounds: int) -> float:
    """Median seconds for thread A to wake thread B and B to wake A back (raw locks,
    the cheapest wake Python has): the floor of any step in which two replica threads
    meet, since the caller must wake a replica thread and be woken by it."""
    ping, pong = _thread.allocate_lock(), _thread.allocate_lock()
    ping.acquire()
    pong.acquire()

    def partner() -> None:
        for _ in range(rounds + 20):
            ping.acquire()
            pong.release()

    thread = threading.Thread(target=partner, daemon=True)
    thread.start()
    samples = []
    for k in range(rounds + 20):
        start = time.perf_counter()
        ping.release()
        pong.acquire()
        if k >= 20:
            samples.append(time.perf_counter() - start)
        time.sleep(0.0002)  # let both threads go idle, as between training steps
    thread.join()
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    args = parser.parse_args()
    quick = args.quick
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          "2 logical CPU replicas\n")

    one = torch.tensor(1.0)

    def scalar_step() -> object:
        return mirrored.get_replica_context().all_reduce("SUM", one)

    def empty_step() -> None:
        return None

    step_s, empty_s = interleaved_medians(
        [lambda: strategy.run(scalar_step), lambda: strategy.run(empty_step)],
        rounds=5 if quick else 15, inner=100 if quick else 500)
    handoff_s = handoff_round_trip(200 if quick else 1000)
    one_replica = mirrored.MirroredStrategy(["CPU:0"])
    (single_s,) = interleaved_medians([lambda: one_replica.run(scalar_step)],
                                      rounds=5 if quick else 15, inner=100 if quick else 500)
    print("(a) run + scalar all_reduce, per step")
    print(f"    {step_s * 1e6:.1f} us   target <= 60 us: {verdict(step_s <= 60e-6)}")
    print(f"    baselines: run of an empty step {empty_s * 1e6:.1f} us; the same step on one "
          f"replica (all the Python, no thread meets) {single_s * 1e6:.1f} us;")
    print(f"    two-thread wake round trip {handoff_s * 1e6:.1f} us "
          f"(step = {step_s / handoff_s:.1f}x a round trip)")

    leaves = [torch.full((256,), float(k)) for k in range(200)]  # 1 KiB each

    def fused() -> object:
        return mirrored.get_replica_context().all_reduce("SUM", leaves)

    def separate() -> object:
        ctx = mirrored.get_replica_context()
        return [ctx.all_reduce("SUM", leaf) for leaf in leaves]

    out = strategy.experimental_local_results(strategy.run(fused))[1]
    assert all(torch.equal(o, leaf * 2) for o, leaf in zip(out, leaves, strict=True))
    fused_s, separate_s = interleaved_medians(
        [lambda: strategy.run(fused), lambda: strategy.run(separate)],
        rounds=3 if quick else 7, inner=3 if quick else 10)
    speedup = separate_s / fused_s
    print("\n(b) 200 tensors of 1 KiB: one fused all_reduce vs 200 calls, per step")
    print(f"    fused {fused_s * 1e3:.2f} ms, separate {separate_s * 1e3:.2f} ms: "
          f"{speedup:.1f}x faster   target >= 10x: {verdict(speedup >= 10)}")

    mib = 8 if quick else 64
    numel = mib * (1 << 20) // 4
    gen = torch.Generator().manual_seed(0)
    big = [torch.rand(numel, generator=gen) for _ in range(2)]
    a, b, dest = torch.rand(numel, generator=gen), torch.rand(numel, generator=gen), torch.empty(
        numel)

    def big_step() -> object:
        return mirrored.get_replica_context().all_reduce(
            "SUM", big[mirrored.get_replica_context().replica_id_in_sync_group])

    results = strategy.experimental_local_results(strategy.run(big_step))
    assert all(torch.equal(r, big[0] + big[1]) for r in results)
    del results
    reduce_s, floor_s = interleaved_medians(
        [lambda: strategy.run(big_step), lambda: torch.add(a, b, out=dest)],
        rounds=5 if quick else 15, inner=1)
    ratio = reduce_s / floor_s
    print(f"\n(c) all_reduce(SUM) of {mib} MiB on 2 replicas, each getting its own copy")
    print(f"    {reduce_s * 1e3:.2f} ms vs torch.add into a preallocated output "
          f"{floor_s * 1e3:.2f} ms: {ratio:.2f}x   target <= 2x: {verdict(ratio <= 2)}")
    strategy.close()


if __name__ == "__main__":
    main()
