"""Multi-worker communicator benchmarks: 2 spawned workers, Gloo over 127.0.0.1,
one replica each, as ratios against raw ``torch.distributed`` in the same run.

    python benchmarks/bench_multi_worker.py            # full sizes
    python benchmarks/bench_multi_worker.py --quick    # smaller, for a smoke run

(a) 64 MiB all-reduce (SUM) through ``DistributedCommunicator.reduce_packed`` (a
    new tensor: one copy into a pooled buffer, in 4 chunks whose copies overlap the
    transfer) against raw in-place ``dist.all_reduce``, interleaved. Target: <= 1.1x.
(b) 200 tensors of 1 KiB in one ``reduce_packed`` against 200 raw
    ``dist.all_reduce`` calls. Target: fused >= 10x faster.
(c) the call check's cost: a 1 MiB ``reduce_packed`` with ``check_calls=True``
    against ``check_calls=False`` (and raw ``dist.all_reduce``), interleaved, a
    barrier before each call, judged on the median of the per-round ratios (each
    round samples both back to back). Target: <= 5 % more. (c2): the same with 10
    calls back to back after each barrier, as a loop repeats its call.
Strategy level (``MultiWorkerMirroredStrategy``, one CPU replica per worker):
(d) 64 MiB ``ctx.all_reduce`` inside ``strategy.run`` against raw ``dist.all_reduce``,
    interleaved. Target: <= 1.1x.
(e) 200 x 1 KiB in one ``extended.batch_reduce_to`` against 200 raw ``dist.all_reduce``.
    Target: >= 10x faster.
(f) digits-like training (8x8 images, batch 64 per worker, SGD), a CNN and an MLP,
    default settings, the README's loop (the documented step, ``compute_average_loss``
    without ``global_batch_size``, over ``experimental_distribute_dataset`` of a list:
    the workers agree on the steps once and take each step's example count from the
    batches), examples/s against ``DistributedDataParallel`` on the same 2 processes,
    11 rounds of one epoch each in rotating order; also the median of the per-round
    ratios with its 90 % bootstrap interval. Target: >= 1.0x (aim 1.2x). Also: its
    source as a generator (a vote per window of steps read ahead, which also tells
    whether every worker has a batch), the documented step fed tensors directly (the
    example count summed across workers: one more collective per step), and with
    ``global_batch_size`` given (no count; not for the wide MLP).
    With ``mirror_optimizer(overlap=False)`` too (the same path for these one-bucket
    models: a second measurement of it), and the share of the bucket communication
    that ran during backward (``--training``: this part only, in rounds, with a wide
    MLP of 12.6 MiB of gradients, one bucket at the default 25 MiB and also forced
    into 4 MiB buckets to show what overlap hides).
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from bench_loop import median_ci

import mirrored
from mirrored._src.comm.distributed import DistributedCommunicator
from mirrored._src.devices import parse_devices
from mirrored._src.reduce_op import ReduceOp
from mirrored._src.topology import Topology
from mirrored._src.training import overlap as overlap_module
from mirrored.experimental import CommunicationOptions


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


def _interleaved(fns: dict[str, Callable[[], object]], repeats: int,
                 samples: dict[str, list[float]] | None = None) -> dict[str, float]:
    """Median seconds per call of each of ``fns``, sampled in turn (machine noise hits
    them alike), the order rotated every round: on the loaded 2-core machine a
    variant always sampled right after a raw all-reduce measured 20-50 % slower
    than the same variant rotated (1 MiB, checked vs unchecked). ``samples``, if
    given, receives every sample, in rounds (`_paired`)."""
    if samples is None:
        samples = {}
    samples.update({name: [] for name in fns})
    names = list(fns)
    for i in range(repeats):
        for name in names[i % len(names):] + names[:i % len(names)]:
            samples[name].append(_time(fns[name], 1))
    return {name: statistics.median(samples[name]) for name in fns}


def _paired(samples: dict[str, list[float]], a: str, b: str) -> tuple[float, float, float]:
    """The median of ``a``'s time over ``b``'s in each round (the two sampled back to
    back: a slow minute slows both) and its 90 % bootstrap interval. On this machine
    the ratio of the two medians moved from +0.7 % to +36 % between runs of the same
    code, the per-round median within a few percent."""
    return median_ci([x / y for x, y in zip(samples[a], samples[b], strict=True)],
                     random.Random(0))


def _cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(32 * 8 * 8, 10))


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10))


def _wide() -> torch.nn.Module:
    """An MLP with 12.6 MiB of gradients (one bucket of the default 25 MiB; 4 of 4 MiB)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 1024), torch.nn.ReLU(),
                               *(m for _ in range(3) for m in (torch.nn.Linear(1024, 1024),
                                                               torch.nn.ReLU())),
                               torch.nn.Linear(1024, 10))


def _strategy_figures(strategy: mirrored.Strategy, quick: bool, results: dict[str, float]
                      ) -> None:
    repeats = 5 if quick else 21
    big = torch.ones((16 if quick else 64) * 2**18)

    def all_reduce() -> object:
        return mirrored.get_replica_context().all_reduce("SUM", big)

    timed = _interleaved({"raw": lambda: dist.all_reduce(big),
                          "strategy": lambda: strategy.run(all_reduce)}, repeats)
    results["s_big_raw"], results["s_big_strategy"] = timed["raw"], timed["strategy"]
    small = [torch.ones(256) for _ in range(200)]
    values = [mirrored.PerReplica([t]) for t in small]
    results["s_many_raw"] = _time(lambda: [dist.all_reduce(t) for t in small], repeats)
    results["s_many_strategy"] = _time(lambda: strategy.extended.batch_reduce_to(
        "SUM", [(v, "CPU:0") for v in values]), repeats * 4)
    _training_figures(strategy, quick, results, "train")
    _training_figures(strategy, quick, results, "train_mlp", make=_mlp)


def _training_figures(strategy: mirrored.Strategy, quick: bool, results: dict[str, float],
                      key: str, make: Callable[[], torch.nn.Module] = _cnn,
                      small_buckets: bool = False) -> None:
    """Training throughput: mirrored against DDP on the same processes and data."""
    steps = 10 if quick else 30
    batch = 64
    g = torch.Generator().manual_seed(dist.get_rank())
    data = [(torch.randn(batch, 1, 8, 8, generator=g), torch.randint(0, 10, (batch,),
                                                                      generator=g))
            for _ in range(steps)]
    ddp = torch.nn.parallel.DistributedDataParallel(make())
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def ddp_epoch() -> None:
        for x, y in data:
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            ddp_opt.step()
            ddp_opt.zero_grad()

    # The README's loop: the same global batches on every worker (each keeps its half),
    # through experimental_distribute_dataset, of a list (a len(): the workers agree on
    # the steps once) or of a generator (no len(): a vote per window of steps read ahead).
    shared = torch.Generator().manual_seed(12345)
    global_batches = [(torch.randn(2 * batch, 1, 8, 8, generator=shared),
                       torch.randint(0, 10, (2 * batch,), generator=shared))
                      for _ in range(steps)]

    def mirrored_epoch_fn(overlap: bool | None, bucket_bytes: int = 0,
                          global_batch_size: int | None = None, dataset: str = ""
                          ) -> tuple[Callable[[], None], Any]:
        model = strategy.mirror(make())
        default_bytes = overlap_module.DEFAULT_BUCKET_BYTES
        overlap_module.DEFAULT_BUCKET_BYTES = bucket_bytes or default_bytes
        try:
            opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.01),
                                            overlap=overlap)
        finally:
            overlap_module.DEFAULT_BUCKET_BYTES = default_bytes

        def step(x: torch.Tensor, y: torch.Tensor) -> None:  # the documented step
            loss = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
            mirrored.compute_average_loss(loss, global_batch_size=global_batch_size
                                          ).backward()
            opt.step()
            opt.zero_grad()

        def epoch() -> None:
            for x, y in data:
                strategy.run(step, args=(x, y))

        def dataset_epoch() -> None:
            source = global_batches if dataset == "len" else (b for b in global_batches)
            for x, y in strategy.experimental_distribute_dataset(source):
                strategy.run(step, args=(x, y))
        return (dataset_epoch if dataset else epoch), opt

    mirrored_epoch, opt = mirrored_epoch_fn(None)  # the default: overlap across workers
    plain_epoch, _ = mirrored_epoch_fn(False)
    # compute_average_loss without global_batch_size (the docs' loop) sums the step's
    # example count across workers: one more small collective per step; given, none.
    epochs = {"ddp": ddp_epoch, "mirrored": mirrored_epoch, "no_overlap": plain_epoch}
    if small_buckets:  # overlap forced into 4 MiB buckets (the default before 25 MiB)
        epochs["small_buckets"], opt = mirrored_epoch_fn(None, 4 << 20)
    else:  # (the wide MLP shows overlap; its rounds are long already)
        epochs["given_batch"], _ = mirrored_epoch_fn(None, global_batch_size=2 * batch)
        epochs["dataset"], _ = mirrored_epoch_fn(None, dataset="len")
        epochs["dataset_vote"], _ = mirrored_epoch_fn(None, dataset="vote")
    times: dict[str, list[float]] = {name: [] for name in epochs}
    # CPU seconds per epoch (main thread, whole process): robust under load, where the
    # wall clock also counts the time other processes hold the cores.
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name in epochs}
    names = list(epochs)
    for i in range(3 if quick else 11):  # interleaved, the order rotated: noise hits all alike
        for name in names[i % len(names):] + names[:i % len(names)]:
            main, process = time.thread_time(), time.process_time()
            times[name].append(_time(epochs[name], 1))
            cpu[name].append((time.thread_time() - main, time.process_time() - process))
    for name, samples in times.items():
        results[f"{key}_{name}"] = 2 * batch * steps / statistics.median(samples)
        # (one warm-up epoch and one timed epoch per sample: two epochs of CPU)
        results[f"{key}_{name}_main_us"] = statistics.median(
            m for m, _ in cpu[name]) / (2 * steps) * 1e6
        results[f"{key}_{name}_cpu_us"] = statistics.median(
            c for _, c in cpu[name]) / (2 * steps) * 1e6
    # The headline: the README's loop (the documented step on the dataset's batches).
    head = "dataset" if "dataset" in times else "mirrored"
    ratios = [d / m for d, m in zip(times["ddp"], times[head], strict=True)]
    results[f"{key}_ratio_lo"], results[f"{key}_ratio_hi"] = min(ratios), max(ratios)
    # The median of the per-round ratios and its 90 % bootstrap interval (bench_loop's).
    (results[f"{key}_ratio_med"], results[f"{key}_ratio_ci_lo"],
     results[f"{key}_ratio_ci_hi"]) = median_ci(ratios, random.Random(0))
    buckets = opt._reducer.buckets
    if buckets is not None and buckets.stats["comm_s"]:
        results[f"{key}_hidden"] = buckets.stats["hidden_s"] / buckets.stats["comm_s"]
        results[f"{key}_buckets"] = len(buckets.plan)


def _worker(rank: int, port: int, quick: bool, training: bool,
            out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    torch.set_num_threads(1)
    resolver = mirrored.cluster_resolver.SimpleClusterResolver(
        num_workers=2, worker_index=rank, master_port=port)
    strategy = mirrored.MultiWorkerMirroredStrategy(
        resolver, CommunicationOptions(timeout_seconds=60), devices=["CPU:0"])
    if training:  # (f) only
        results_f: dict[str, float] = {"rounds": 2 if quick else 3}
        for i in range(int(results_f["rounds"])):  # rounds: CNN and MLP interleaved
            round_: dict[str, float] = {}
            _training_figures(strategy, quick, round_, "train")
            _training_figures(strategy, quick, round_, "train_mlp", make=_mlp)
            _training_figures(strategy, quick, round_, "train_wide", make=_wide,
                              small_buckets=True)
            results_f.update({f"{k}#{i}": v for k, v in round_.items()})
        strategy.close()
        if rank == 0:
            out.put(results_f)
        return
    topology = Topology(devices=parse_devices(["CPU:0"]), worker_index=rank, num_workers=2)
    local = mirrored.ReductionToOneDevice()
    checked = DistributedCommunicator(local, topology, timeout_seconds=60)
    unchecked = DistributedCommunicator(local, topology, timeout_seconds=60, check_calls=False)
    dests = [topology.devices]
    repeats = 5 if quick else 21
    results: dict[str, float] = {}

    big = torch.ones((16 if quick else 64) * 2**18)  # float32: 16 or 64 MiB
    timed = _interleaved({"raw": lambda: dist.all_reduce(big), "comm": lambda: (
        checked.reduce_packed(ReduceOp.SUM, [[big]], dests, 0))}, repeats)
    results["big_raw"], results["big_comm"] = timed["raw"], timed["comm"]

    small = [torch.ones(256) for _ in range(200)]  # 200 x 1 KiB
    results["many_raw"] = _time(lambda: [dist.all_reduce(t) for t in small], repeats)
    results["many_comm"] = _time(
        lambda: checked.reduce_packed(ReduceOp.SUM, [small], dests * 200, 0), repeats * 4)

    mib = torch.ones(2**18)  # 1 MiB
    n = 20 if quick else 200
    # Interleave the two variants so machine noise hits both alike.
    samples: dict[str, list[float]] = {}
    timed = _interleaved({
        "checked": lambda: checked.reduce_packed(ReduceOp.SUM, [[mib]], dests, 0),
        "unchecked": lambda: unchecked.reduce_packed(ReduceOp.SUM, [[mib]], dests, 0),
        "raw": lambda: dist.all_reduce(mib)}, n, samples)
    results.update({f"mib_{name}": t for name, t in timed.items()})
    (results["mib_paired"], results["mib_paired_lo"],
     results["mib_paired_hi"]) = _paired(samples, "checked", "unchecked")
    # (c2) back to back, as a loop repeats its call: a barrier only before every 10
    # calls, so a worker's Python before a launch overlaps the peer's instead of
    # adding to the barrier's exit skew.
    timed = _interleaved({
        "checked": lambda: [checked.reduce_packed(ReduceOp.SUM, [[mib]], dests, 0)
                            for _ in range(10)],
        "unchecked": lambda: [unchecked.reduce_packed(ReduceOp.SUM, [[mib]], dests, 0)
                              for _ in range(10)],
        "raw": lambda: [dist.all_reduce(mib) for _ in range(10)]}, max(n // 4, 5), samples)
    results.update({f"mib10_{name}": t / 10 for name, t in timed.items()})
    (results["mib10_paired"], results["mib10_paired_lo"],
     results["mib10_paired_hi"]) = _paired(samples, "checked", "unchecked")
    _strategy_figures(strategy, quick, results)
    strategy.close()  # leaves the job; the same training without the per-call check:
    unchecked_strategy = mirrored.MultiWorkerMirroredStrategy(
        resolver, CommunicationOptions(timeout_seconds=60), devices=["CPU:0"],
        check_collectives=False)
    _training_figures(unchecked_strategy, quick, results, "train_unchecked")
    unchecked_strategy.close()
    if rank == 0:
        out.put(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    parser.add_argument("--training", action="store_true",
                        help="(f) only, in rounds: DDP, mirrored (default: overlap), "
                             "mirrored with overlap=False, with global_batch_size given "
                             "(CNN, MLP), in 4 MiB buckets (wide MLP)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, args.quick, args.training, out))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        r = out.get(timeout=1500 if args.training else 600)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if args.training:
        _print_training(r)
        return
    size = "16 MiB" if args.quick else "64 MiB"
    print(f"(a) {size} all_reduce: communicator {r['big_comm'] * 1e3:.1f} ms, raw "
          f"{r['big_raw'] * 1e3:.1f} ms: {r['big_comm'] / r['big_raw']:.2f}x (target <= 1.1x)")
    print(f"(b) 200 x 1 KiB: one reduce_packed {r['many_comm'] * 1e3:.2f} ms, 200 raw "
          f"all_reduce {r['many_raw'] * 1e3:.2f} ms: {r['many_raw'] / r['many_comm']:.1f}x "
          "faster (target >= 10x)")
    cost = r["mib_checked"] / r["mib_unchecked"] - 1
    print(f"(c) 1 MiB reduce_packed: checked {r['mib_checked'] * 1e6:.0f} us, unchecked "
          f"{r['mib_unchecked'] * 1e6:.0f} us, raw all_reduce {r['mib_raw'] * 1e6:.0f} us: "
          f"check costs {cost * 100:+.1f} % on the medians; per-round median "
          f"{(r['mib_paired'] - 1) * 100:+.1f} % [90 % CI {(r['mib_paired_lo'] - 1) * 100:+.1f}, "
          f"{(r['mib_paired_hi'] - 1) * 100:+.1f}] (target <= 5 %)")
    cost = r["mib10_checked"] / r["mib10_unchecked"] - 1
    print(f"(c2) the same, 10 calls back to back per sample: checked "
          f"{r['mib10_checked'] * 1e6:.0f} us, unchecked {r['mib10_unchecked'] * 1e6:.0f} us, "
          f"raw {r['mib10_raw'] * 1e6:.0f} us per call: check costs {cost * 100:+.1f} %; "
          f"per-round median {(r['mib10_paired'] - 1) * 100:+.1f} % [90 % CI "
          f"{(r['mib10_paired_lo'] - 1) * 100:+.1f}, {(r['mib10_paired_hi'] - 1) * 100:+.1f}]")
    print(f"(d) {size} strategy ctx.all_reduce {r['s_big_strategy'] * 1e3:.1f} ms, raw "
          f"{r['s_big_raw'] * 1e3:.1f} ms: {r['s_big_strategy'] / r['s_big_raw']:.2f}x "
          "(target <= 1.1x)")
    print(f"(e) 200 x 1 KiB: one batch_reduce_to {r['s_many_strategy'] * 1e3:.2f} ms, 200 raw "
          f"all_reduce {r['s_many_raw'] * 1e3:.2f} ms: "
          f"{r['s_many_raw'] / r['s_many_strategy']:.1f}x faster (target >= 10x)")
    for key, name in (("train", "CNN"), ("train_mlp", "MLP")):
        print(f"(f) digits {name} training, the README loop (experimental_distribute_dataset "
              f"of a list; the example count taken from the batches): mirrored "
              f"{r[f'{key}_dataset']:.0f} examples/s, DDP {r[f'{key}_ddp']:.0f} examples/s: "
              f"{r[f'{key}_dataset'] / r[f'{key}_ddp']:.2f}x; per-round median "
              f"{r[f'{key}_ratio_med']:.2f}x [90 % CI {r[f'{key}_ratio_ci_lo']:.2f}-"
              f"{r[f'{key}_ratio_ci_hi']:.2f}] (target >= 1.0x)")
        print(f"    its source without len() (a vote per window of steps): "
              f"{r[f'{key}_dataset_vote'] / r[f'{key}_ddp']:.2f}x; the documented step fed "
              f"tensors (the count summed across workers): "
              f"{r[f'{key}_mirrored'] / r[f'{key}_ddp']:.2f}x; with global_batch_size given: "
              f"{r[f'{key}_given_batch'] / r[f'{key}_ddp']:.2f}x")
    print(f"(g) the same with check_collectives=False: mirrored {r['train_unchecked_mirrored']:.0f}"
          f" examples/s, DDP {r['train_unchecked_ddp']:.0f} examples/s: "
          f"{r['train_unchecked_mirrored'] / r['train_unchecked_ddp']:.2f}x (no target)")

    _print_overlap(r, "train", "CNN")
    _print_overlap(r, "train_mlp", "MLP")


def _print_overlap(r: dict[str, float], key: str, name: str) -> None:
    hidden = r.get(f"{key}_hidden")
    print(f"    {name}: CPU per step, main thread / whole process: mirrored "
          f"{r[f'{key}_mirrored_main_us']:.0f} / {r[f'{key}_mirrored_cpu_us']:.0f} us, DDP "
          f"{r[f'{key}_ddp_main_us']:.0f} / {r[f'{key}_ddp_cpu_us']:.0f} us")
    print(f"    {name}: overlap=False {r[f'{key}_no_overlap'] / r[f'{key}_ddp']:.2f}x DDP; "
          f"per-epoch ratios of the README loop {r[f'{key}_ratio_lo']:.2f}-"
          f"{r[f'{key}_ratio_hi']:.2f}x; "
          + (f"{hidden:.0%} of the bucket communication ran during backward "
             f"({r[f'{key}_buckets']:.0f} buckets)" if hidden is not None else "no buckets"))


def _print_training(r: dict[str, float]) -> None:
    rounds = int(r["rounds"])
    for key, name in (("train", "digits CNN"), ("train_mlp", "digits MLP"),
                      ("train_wide", "wide MLP (12.6 MiB of gradients)")):
        on = [r[f"{key}_mirrored#{i}"] / r[f"{key}_ddp#{i}"] for i in range(rounds)]
        off = [r[f"{key}_no_overlap#{i}"] / r[f"{key}_ddp#{i}"] for i in range(rounds)]
        given = [r[f"{key}_given_batch#{i}"] / r[f"{key}_ddp#{i}"] for i in range(rounds)
                 if f"{key}_given_batch#{i}" in r]
        readme = [r[f"{key}_dataset#{i}"] / r[f"{key}_ddp#{i}"] for i in range(rounds)
                  if f"{key}_dataset#{i}" in r]
        hidden = [r[f"{key}_hidden#{i}"] for i in range(rounds) if f"{key}_hidden#{i}" in r]
        small = [r[f"{key}_small_buckets#{i}"] / r[f"{key}_ddp#{i}"] for i in range(rounds)
                 if f"{key}_small_buckets#{i}" in r]
        where = ("one bucket at the default size: sent at the step, as with overlap=False"
                 + (f"; forced into 4 MiB buckets {min(small):.2f}-{max(small):.2f}x DDP "
                    f"({', '.join(f'{v:.2f}' for v in small)}), "
                    f"{r[f'{key}_buckets#0']:.0f} buckets, {min(hidden):.0%}-{max(hidden):.0%} "
                    "of the early buckets' communication during backward" if small else ""))
        print(f"(f) {name}, {rounds} rounds (each the median of interleaved epochs): "
              + (f"the README loop {min(readme):.2f}-{max(readme):.2f}x DDP "
                 f"({', '.join(f'{v:.2f}' for v in readme)}); " if readme else "")
              + f"the documented step fed tensors {min(on):.2f}-{max(on):.2f}x DDP "
              f"({', '.join(f'{v:.2f}' for v in on)}); overlap=False "
              f"{min(off):.2f}-{max(off):.2f}x ({', '.join(f'{v:.2f}' for v in off)}); "
              + (f"global_batch_size given {min(given):.2f}-{max(given):.2f}x; " if given
                 else "") + where)
        main = [r[f"{key}_mirrored_main_us#{i}"] / r[f"{key}_ddp_main_us#{i}"]
                for i in range(rounds)]
        print(f"    main-thread CPU per step, mirrored / DDP: "
              f"{', '.join(f'{v:.2f}' for v in main)} (holds under load)")


if __name__ == "__main__":
    main()
