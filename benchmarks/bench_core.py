"""Core benchmarks: `run` overhead and host `reduce` bandwidth, as ratios against
baselines measured in the same run.

    python benchmarks/bench_core.py            # full sizes (64 MiB components)
    python benchmarks/bench_core.py --quick    # smaller, for a smoke run

(a) ``strategy.run`` of a trivial fn on 2, 4 and 8 logical CPU replicas, per call,
    against a direct call of the fn and a naive pool (``ThreadPoolExecutor``, one
    task per replica, wait for all). Target: <= 20 us per ``run`` on 2 replicas.
(a2) 2 replicas, interleaved: ``run`` of a no-op, of ``t + 0`` (target <= 35 us) and
    of a scalar ``all_reduce`` (target <= 0.5x JAX ``pmap`` + ``psum`` on 2 CPU
    devices, measured in a subprocess in the same run when jax is installed:
    ``pip install -e .[bench]``).
(a3) ``--bytecodes``: the Python bytecodes executed per ``run`` of the (a2) steps, on
    every thread (``sys.settrace`` with opcode events; baton runs kept as such): a
    measure of the library's own work that does not move with the machine's load.
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
import functools
import importlib.util
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

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
            line += f"   target <= 20 us: {verdict(run_s <= 20e-6)}"
        print(line)


def _scalar_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """A replica's SUM of ``t`` (the step of ``run`` + ``all_reduce``)."""
    ctx = mirrored.get_replica_context()
    assert ctx is not None
    return ctx.all_reduce("SUM", t)


def bench_small_steps(rounds: int) -> None:
    print("\n(a2) 2 replicas: run of small steps, interleaved (p50 of short samples)")
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    t = torch.ones(())

    scalar_all_reduce = functools.partial(_scalar_all_reduce, t)
    fns: dict[str, Callable[[], object]] = {
        "t + 0 direct": lambda: t + 0,
        "run no-op": lambda: strategy.run(lambda: None),
        "run t + 0": lambda: strategy.run(lambda: t + 0),
        "run + all_reduce": lambda: strategy.run(scalar_all_reduce),
    }
    seconds = dict(zip(fns, interleaved_medians(
        [lambda f=f: [f() for _ in range(20)] for f in fns.values()], rounds), strict=True))
    jax_s = jax_pmap_psum_seconds()
    targets = {"run no-op": 20e-6, "run t + 0": 35e-6}
    for name, s in seconds.items():
        line = f"    {name:<18} {s / 20 * 1e6:8.1f} us"
        if name in targets:
            line += f"   target <= {targets[name] * 1e6:.0f} us: {verdict(s / 20 <= targets[name])}"
        if name == "run + all_reduce" and jax_s is not None:
            ratio = s / 20 / jax_s
            line += (f"   JAX pmap+psum {jax_s * 1e6:.1f} us: {ratio:.2f}x, target <= 0.5x: "
                     f"{verdict(ratio <= 0.5)}")
        print(line)
    if jax_s is None:
        print("    (jax is not installed: pip install -e .[bench] to measure pmap+psum)")
    strategy.close()


JAX_SCRIPT = """
import os, statistics, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp
f = jax.pmap(lambda x: jax.lax.psum(x, "i"), axis_name="i")
x = jnp.ones((2,))
for _ in range(100):
    f(x).block_until_ready()
samples = []
for _ in range(200):
    start = time.perf_counter()
    for _ in range(20):
        f(x).block_until_ready()
    samples.append((time.perf_counter() - start) / 20)
print(statistics.median(samples))
"""


def jax_pmap_psum_seconds() -> float | None:
    """JAX's pmap + psum of a scalar on 2 host CPU devices, per call (None without jax)."""
    if importlib.util.find_spec("jax") is None:
        return None
    done = subprocess.run([sys.executable, "-c", JAX_SCRIPT], capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0:
        print(f"    (jax failed: {done.stderr.strip().splitlines()[-1:]})")
        return None
    return float(done.stdout.strip().splitlines()[-1])


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


def count_bytecodes(runs: int = 200) -> None:
    """(a3): bytecodes and Python calls per ``run`` of each (a2) step, on every thread."""
    import threading

    from mirrored._src.runtime import runtime

    counts = {"opcode": 0, "call": 0}
    on = [False]

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if not on[0]:
            return None
        frame.f_trace_opcodes = True
        if event in counts:
            counts[event] += 1
        return tracer

    threading.settrace(tracer)  # the replica threads start below, traced
    saved, runtime.BATON_SECONDS = runtime.BATON_SECONDS, float("inf")  # tracing is slow
    try:
        strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        t = torch.ones(())

        scalar_all_reduce = functools.partial(_scalar_all_reduce, t)

        print("\n(a3) 2 replicas: Python bytecodes (and calls) per run, every thread")
        for name, fn in [("run no-op", lambda: None), ("run t + 0", lambda: t + 0),
                         ("run + all_reduce", scalar_all_reduce)]:
            for _ in range(50):
                strategy.run(fn)
            counts.update(opcode=0, call=0)
            on[0] = True
            sys.settrace(tracer)
            for _ in range(runs):
                strategy.run(fn)
            sys.settrace(None)
            on[0] = False
            print(f"    {name:<18} {counts['opcode'] / runs:8.0f} bytecodes "
                  f"{counts['call'] / runs:6.0f} calls")
        strategy.close()
    finally:
        threading.settrace(None)
        runtime.BATON_SECONDS = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    parser.add_argument("--bytecodes", action="store_true",
                        help="only (a3): bytecodes per run, independent of the load")
    args = parser.parse_args()
    if args.bytecodes:
        count_bytecodes()
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads\n")
    bench_run([2, 4, 8], inner=200 if args.quick else 2000)
    bench_small_steps(rounds=50 if args.quick else 300)
    bench_reduce([2, 4, 8], mib=8 if args.quick else 64, rounds=5 if args.quick else 15)


if __name__ == "__main__":
    main()
