"""Core benchmarks: `run` overhead and host `reduce` bandwidth, as ratios against
baselines measured in the same run.

    python benchmarks/bench_core.py            # full sizes (64 MiB components)
    python benchmarks/bench_core.py --quick    # smaller, for a smoke run

(a) ``strategy.run`` of a trivial fn on 2, 4 and 8 logical CPU replicas, per call,
    against a direct call of the fn and a naive pool (``ThreadPoolExecutor``, one
    task per replica, wait for all). Target: <= 50 us per ``run`` on 2 replicas.
(b) ``strategy.reduce(SUM, axis=None)`` of N components of 64 MiB against the
    memory-traffic floor: one ``torch.add`` of two such tensors into a
    preallocated output. Targets: <= 1.3x the floor for N = 2, and
    <= 1.3 * (N + 1) / 3 x the floor for larger N (N inputs read, one output written).

Timings are medians of repeated measurements; the machine is shared and noisy,
so read ratios, not single figures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time
from collections.abc import Callable

import torch

import mirrored


def median_seconds(fn: Callable[[], object], repeats: int, inner: int) -> float:
    """Median over ``repeats`` of the mean time of ``inner`` calls of ``fn``."""
    for _ in range(max(2, inner // 10)):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples)


def verdict(ok: bool) -> str:
    return "meets target" if ok else "MISSES target"


def bench_run(replicas: list[int], inner: int) -> None:
    print("(a) strategy.run of a trivial fn, per call")
    print(f"{'replicas':>8} {'run us':>9} {'direct us':>10} {'naive pool us':>14} "
          f"{'run/pool':>9}")

    def trivial() -> None:
        return None

    for n in replicas:
        strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(n)])
        run_s = median_seconds(lambda s=strategy: s.run(trivial), 7, inner)
        direct_s = median_seconds(trivial, 7, inner)
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            def naive(p: concurrent.futures.ThreadPoolExecutor = pool, k: int = n) -> None:
                concurrent.futures.wait([p.submit(trivial) for _ in range(k)])
            pool_s = median_seconds(naive, 7, max(50, inner // 4))
        strategy.close()
        line = (f"{n:>8} {run_s * 1e6:>9.1f} {direct_s * 1e6:>10.2f} {pool_s * 1e6:>14.1f} "
                f"{run_s / pool_s:>9.2f}")
        if n == 2:
            line += f"   target <= 50 us: {verdict(run_s <= 50e-6)}"
        print(line)


def interleaved_medians(fns: list[Callable[[], object]], rounds: int) -> list[float]:
    """Times each fn once per round, alternating between them, so slow phases of a
    shared machine hit all of them alike; returns each fn's median seconds."""
    for fn in fns:
        fn()
        fn()
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, out in zip(fns, samples, strict=True):
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
    return [statistics.median(s) for s in samples]


def bench_reduce(replicas: list[int], mib: int, rounds: int) -> None:
    numel = mib * (1 << 20) // 4
    print(f"\n(b) strategy.reduce(SUM, axis=None) of N float32 components of {mib} MiB")
    print("    floor: one torch.add of two such tensors into a preallocated output, timed")
    print("    alternately with each reduce")
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(numel, generator=gen)
    b = torch.rand(numel, generator=gen)
    out = torch.empty(numel)
    floor_s, fresh_s = interleaved_medians(
        [lambda: torch.add(a, b, out=out), lambda: torch.add(a, b)], rounds)
    print(f"    torch.add into a fresh output: {fresh_s / floor_s:.2f}x the floor "
          "(page faults: why results come from a buffer pool)")
    print(f"{'N':>3} {'reduce ms':>10} {'floor ms':>9} {'x floor':>8} {'target':>7}")
    for n in replicas:
        strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(n)])
        parts = [torch.rand(numel, generator=gen) for _ in range(n)]
        value = mirrored.PerReplica(parts)
        expected = parts[0] + parts[1]
        for p in parts[2:]:
            expected += p
        assert torch.equal(strategy.reduce("SUM", value), expected)
        del expected
        reduce_s, floor_s = interleaved_medians(
            [lambda s=strategy, v=value: s.reduce("SUM", v),
             lambda: torch.add(a, b, out=out)], rounds)
        ratio = reduce_s / floor_s
        target = 1.3 if n == 2 else 1.3 * (n + 1) / 3
        print(f"{n:>3} {reduce_s * 1e3:>10.2f} {floor_s * 1e3:>9.2f} {ratio:>8.2f} "
              f"{target:>7.2f}   {verdict(ratio <= target)}")
        strategy.close()
        del parts, value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads\n")
    bench_run([2, 4, 8], inner=200 if args.quick else 2000)
    bench_reduce([2, 4, 8], mib=8 if args.quick else 64, rounds=5 if args.quick else 15)


if __name__ == "__main__":
    main()
