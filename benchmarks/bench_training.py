"""Training-step benchmarks: an MLP 64-256-256-10 (digits-sized inputs, random data),
SGD, in examples per second, as ratios against baselines measured in the same run.

    python benchmarks/bench_training.py            # full run
    python benchmarks/bench_training.py --quick    # fewer steps, for a smoke run

(a) 1 replica (``strategy.run`` + ``mirror`` + ``mirror_optimizer`` +
    ``compute_average_loss``) against the same loop in plain PyTorch, global batch
    64 and 256, with an A/A pair (the plain loop twice) for the harness's spread.
    Target: overhead <= 5 %.
(b) 2 replicas in this process, fed as the README's loop is (the next batch of a
    distributed dataset each step), against ``DistributedDataParallel`` on Gloo with 2
    processes on 127.0.0.1 (1 intra-op thread each), same model and global batch
    (64 and 256); also the same step fed one batch again and again. Target: >= 1.2x
    DDP's examples/s at both sizes (floor 1x). DDP runs before and after the
    replicas (the machine's speed drifts between minutes; the verdict takes the
    lower ratio), and also under ``no_sync`` (its processes with no communication
    at all, timed alternately with DDP): the share of DDP's step that its all-reduce
    takes. Also measured: the same 2 replicas with every replica thread limited to
    1 intra-op thread (``torch.set_num_threads(1)`` run once in each replica
    thread), a prototype of a library-side change.
(c) 4 replicas: examples/s, and where a step's time goes, from timers around the
    phases: compute (forward + backward, per replica), all-reduce (the mirrored
    ``step()`` minus the local optimizer step), optimizer step, and hand-off (the
    rest of ``run``: waking replica threads, waiting for the slowest, regrouping), and
    the count exchange of ``compute_average_loss``.
(d) the divergence check (``mirror_optimizer(check=...)``) on 2 replicas: the default
    ``"cheap"`` and the debugging ``"full"`` against ``"off"``, with an A/A pair.
    Target: < 2 %.
(e) gradients all-reduced while backward runs (``mirror_optimizer(overlap=True)``)
    against ``overlap=False`` (the in-process default), 2 replicas, with the
    share of the buckets' reduction time that ran during backward. No target:
    decides the default (``--overlap`` runs this part only).
(f) buffers other than BatchNorm's (``mirror_optimizer(buffers="average")``, the
    default), 2 replicas: the MLP beside 8 MiB of constant buffers and a small EMA
    against the MLP alone (``--buffers`` runs this part only). No target: what a
    transformer's registered masks and tables cost each step.

Timings are medians over repeats; variants are interleaved so machine noise hits
them alike ((a) and (d): several copies of each variant, per-round ratios with a
bootstrap confidence interval). The machine is shared and noisy: read ratios, not
single figures.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mirrored
from mirrored._src.training import overlap as overlap_module
from mirrored.testing import run_multi_process

IN, HIDDEN, CLASSES = 64, 256, 10
LR = 0.01


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


class WithBuffers(nn.Module):
    """The MLP beside ``mib`` MiB of constant buffers (causal masks, rotary tables, as
    transformers register them) and a small EMA of the input updated at every step."""

    def __init__(self, mib: int) -> None:
        super().__init__()
        self.mlp = make_mlp()
        for k in range(mib):
            self.register_buffer(f"table{k}", torch.tril(torch.ones(512, 512)))
        self.register_buffer("ema", torch.zeros(IN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.ema.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return self.mlp(x)  # type: ignore[no-any-return]


def make_batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(size)
    return torch.randn(size, IN, generator=g), torch.randint(0, CLASSES, (size,), generator=g)


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, foreach=True)  # type: ignore[arg-type]


def interleaved(fns: dict[str, Callable[[], object]], repeats: int,
                inner: int) -> dict[str, float]:
    """Median seconds per call of each fn; one sample of each in turn, ``repeats`` times."""
    for fn in fns.values():
        for _ in range(max(3, inner // 5)):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            samples[name].append((time.perf_counter() - start) / inner)
    return {name: statistics.median(s) for name, s in samples.items()}


def paired_rounds(builders: dict[str, Callable[[], Callable[[], object]]], copies: int,
                  rounds: int, block: int, clock: Callable[[], float] = time.perf_counter
                  ) -> dict[str, tuple[float, float, float]]:
    """Each variant's time per step against the first variant's, minus 1: the median over
    rounds and its 90 % bootstrap confidence interval. Every variant is built ``copies``
    times (memory placements averaged); a round runs ``block`` steps of every copy, in
    a shuffled order, so that load changes hit every variant alike. ``clock``: wall
    time by default; ``time.process_time`` counts the CPU of every thread."""
    steps = [(name, build()) for _ in range(copies) for name, build in builders.items()]
    for _, step in steps:
        for _ in range(2 * block):
            step()
    names = list(builders)
    per_round: dict[str, list[float]] = {n: [] for n in names}
    rng = random.Random(0)
    order = list(range(len(steps)))
    for _ in range(rounds):
        rng.shuffle(order)
        spent = dict.fromkeys(names, 0.0)
        for i in order:
            name, step = steps[i]
            start = clock()
            for _ in range(block):
                step()
            spent[name] += clock() - start
        for n in names:
            per_round[n].append(spent[n])
    for _, step in steps:
        if isinstance(step, Mirrored):
            step.strategy.close()
    base = per_round[names[0]]
    out = {}
    for n in names[1:]:
        ratios = [a / b - 1 for a, b in zip(per_round[n], base, strict=True)]
        medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                         for _ in range(400))
        out[n] = statistics.median(ratios), medians[20], medians[379]
    out[names[0]] = (statistics.median(base) / (copies * block), 0.0, 0.0)  # s per step
    return out


def verdict(ok: bool) -> str:
    return "meets target" if ok else "MISSES target"


# -----------------------------------------------------------------------------
# the loops

def plain_step(batch: int) -> Callable[[], object]:
    model, (x, y) = make_mlp(), make_batch(batch)
    opt = sgd(model.parameters())

    def step() -> None:
        # The same loss as the mirrored loop: per-example losses over the batch size.
        loss = F.cross_entropy(model(x), y, reduction="none").sum() / len(y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


class Mirrored:
    """A mirrored training step on ``n`` logical CPU replicas, with optional phase timers."""

    def __init__(self, n: int, batch: int, *, one_thread: bool = False,
                 timed: bool = False, buffers_mib: int = 0, **options: object) -> None:
        self.strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(n)])
        self.model = self.strategy.mirror(WithBuffers(buffers_mib) if buffers_mib
                                          else make_mlp())
        self.opt = self.strategy.mirror_optimizer(self.model, sgd, **options)
        (self.xy,) = list(self.strategy.experimental_distribute_dataset(
            [make_batch(batch)], mirrored.InputOptions(experimental_prefetch_depth=0)))
        self.one_thread = one_thread
        self.limited: set[int] = set()
        self.timed = timed
        self.phases: list[list[float]] = [[0.0, 0.0, 0.0] for _ in range(n)]
        self.local_step = [0.0] * n
        if timed:
            for r, opt in enumerate(self.opt.optimizers):
                opt.step = self._timed_local(r, opt.step)  # type: ignore[method-assign]

    def _timed_local(self, r: int, step: Callable[[], object]) -> Callable[[], object]:
        def timed_step(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            out = step(*args, **kwargs)
            self.local_step[r] += time.perf_counter() - start
            return out
        return timed_step

    def _fn(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.one_thread:
            ident = mirrored.get_replica_context().replica_id_in_sync_group
            if ident not in self.limited:  # prototype: 1 intra-op thread per replica thread
                torch.set_num_threads(1)
                self.limited.add(ident)
        t0 = time.perf_counter()
        per_example = F.cross_entropy(self.model(x), y, reduction="none")
        ta = time.perf_counter()
        loss = mirrored.compute_average_loss(per_example)  # one exchange of the count
        tb = time.perf_counter()
        self.opt.zero_grad()
        loss.backward()
        t1 = time.perf_counter()
        self.opt.step()
        if self.timed:
            r = mirrored.get_replica_context().replica_id_in_sync_group
            t2 = time.perf_counter()
            self.phases[r][0] += (ta - t0) + (t1 - tb)
            self.phases[r][1] += t2 - t1
            self.phases[r][2] += tb - ta

    def __call__(self) -> None:
        self.strategy.run(self._fn, args=self.xy)


class ReadmeLoop(Mirrored):
    """`Mirrored`, fed as the README's loop is: each step the next batch of
    ``experimental_distribute_dataset`` over a list of global batches, default options
    (in one process ``compute_average_loss`` still meets the other replica to count
    the examples); a new pass when one ends."""

    def __init__(self, n: int, batch: int, **options: object) -> None:
        super().__init__(n, batch, **options)
        self.dataset = self.strategy.experimental_distribute_dataset([make_batch(batch)] * 16)
        self.batches = iter(self.dataset)

    def __call__(self) -> None:
        xy = next(self.batches, None)
        if xy is None:
            self.batches = iter(self.dataset)
            xy = next(self.batches)
        self.strategy.run(self._fn, args=xy)


def ddp_worker(batches: list[int], repeats: int, inner: int) -> list[tuple[float, float]]:
    """One DDP rank (started by run_multi_process): median seconds per step per batch,
    with its all-reduce and without (``no_sync``: the same two processes computing
    alone, alternating with the synced samples)."""
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    model = nn.parallel.DistributedDataParallel(make_mlp())
    opt = sgd(model.parameters())
    out = []
    for batch in batches:
        x, y = make_batch(batch)
        per = batch // world
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]

        def step(x: torch.Tensor = x, y: torch.Tensor = y) -> None:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

        for _ in range(max(3, inner // 5)):
            step()
        samples: dict[bool, list[float]] = {True: [], False: []}
        for i in range(2 * repeats):
            synced = i % 2 == 0
            dist.barrier()
            start = time.perf_counter()
            with contextlib.nullcontext() if synced else model.no_sync():
                for _ in range(inner):
                    step()
            samples[synced].append((time.perf_counter() - start) / inner)
        out.append((statistics.median(samples[True]), statistics.median(samples[False])))
    dist.destroy_process_group()
    return out


# -----------------------------------------------------------------------------
# the measurements

def bench_one_replica(batches: list[int], repeats: int, inner: int) -> None:
    print("(a) 1 replica vs the same loop in plain PyTorch: overhead per step, median "
          "[90 % CI] of per-round ratios (3 copies of each, blocks of 4 steps in shuffled "
          "order; 'plain again' is the A/A spread)")
    for batch in batches:
        builders: dict[str, Callable[[], Callable[[], object]]] = {
            "plain": functools.partial(plain_step, batch),
            "mirrored": functools.partial(Mirrored, 1, batch),
            "plain again": functools.partial(plain_step, batch)}
        t = paired_rounds(builders, copies=3, rounds=repeats * inner // 4, block=4)
        m, lo, hi = t["mirrored"]
        a, a_lo, a_hi = t["plain again"]
        print(f"  batch {batch:>3}: plain {t['plain'][0] * 1e6:.0f} us/step; 1 replica "
              f"{m:+.1%} [{lo:+.1%}, {hi:+.1%}] (target <= 5 %: {verdict(hi <= 0.05)}); "
              f"A/A {a:+.1%} [{a_lo:+.1%}, {a_hi:+.1%}]")


def bench_two_replicas(batches: list[int], repeats: int, inner: int, *,
                       quick: bool = False) -> None:
    print("(b) 2 replicas in one process vs DDP (Gloo, 2 processes, 1 thread each), "
          "examples/s; DDP measured before and after the replicas (the machine's speed "
          "drifts between minutes), the verdict on the lower ratio")

    def ddp() -> tuple[list[float], list[float]]:
        # (fresh interpreters: a forked DDP rank's teardown deadlocked once, its Gloo
        # thread waiting for the GIL that ~Reducer held while joining it)
        ranks = run_multi_process(ddp_worker, 2, args=(batches, repeats, inner),
                                  timeout=300, start_method="spawn")
        return ([max(rank[k][0] for rank in ranks) for k in range(len(batches))],
                [max(rank[k][1] for rank in ranks) for k in range(len(batches))])

    before, alone = ddp()
    ours = []
    for batch in batches:
        loops = {"two": ReadmeLoop(2, batch), "fed": Mirrored(2, batch)}
        if not quick:
            loops["two_1t"] = ReadmeLoop(2, batch, one_thread=True)
        ours.append(interleaved({"plain": plain_step(batch), **loops}, repeats, inner))
        for loop in loops.values():
            loop.strategy.close()
    after, alone_after = (before, alone) if quick else ddp()  # (--quick: DDP once)
    for k, (batch, t) in enumerate(zip(batches, ours, strict=True)):
        ratios = (before[k] / t["two"], after[k] / t["two"])
        print(f"  batch {batch:>3}: DDP {batch / before[k]:>8.0f} / {batch / after[k]:.0f}, "
              f"2 replicas (the README loop) {batch / t['two']:>8.0f} ({ratios[0]:.2f}x / "
              f"{ratios[1]:.2f}x DDP; target >= 1.2x, floor 1x: {verdict(min(ratios) >= 1.2)}),"
              f" plain loop {batch / t['plain']:>8.0f} examples/s")
        print(f"             the same step fed one batch again and again (the example count "
              f"summed by a meeting each step): {batch / t['fed']:>8.0f} examples/s "
              f"({before[k] / t['fed']:.2f}x / {after[k] / t['fed']:.2f}x DDP)")
        if "two_1t" in t:
            print(f"             prototype, 1 intra-op thread per replica thread: "
                  f"{batch / t['two_1t']:>8.0f} examples/s")
        # DDP's processes without any communication: how much of DDP's step its
        # all-reduce takes.
        print(f"             DDP under no_sync (no communication): {batch / alone[k]:>8.0f} "
              f"/ {batch / alone_after[k]:.0f} examples/s")


def bench_four_replicas(batches: list[int], repeats: int, inner: int) -> None:
    print("(c) 4 replicas: examples/s and where a step's time goes (per step, mean over "
          "replicas)")
    for batch in batches:
        four = Mirrored(4, batch, timed=True)
        for _ in range(max(3, inner // 5)):
            four()
        four.phases = [[0.0, 0.0, 0.0] for _ in range(4)]
        four.local_step = [0.0] * 4
        steps = repeats * inner
        start = time.perf_counter()
        for _ in range(steps):
            four()
        total = (time.perf_counter() - start) / steps
        four.strategy.close()
        compute = statistics.mean(p[0] for p in four.phases) / steps
        mirrored_step = statistics.mean(p[1] for p in four.phases) / steps
        loss_count = statistics.mean(p[2] for p in four.phases) / steps
        local = statistics.mean(four.local_step) / steps
        slowest = max(p[0] + p[1] + p[2] for p in four.phases) / steps
        us = 1e6
        print(f"  batch {batch:>3}: {batch / total:>8.0f} examples/s, {total * us:.0f} us/step "
              f"(no target; for reference)")
        print(f"    compute (forward+backward):  {compute * us:>6.0f} us")
        print(f"    all-reduce (step - local):    {(mirrored_step - local) * us:>6.0f} us")
        print(f"    compute_average_loss (count): {loss_count * us:>6.0f} us")
        print(f"    optimizer step (local):       {local * us:>6.0f} us")
        print(f"    hand-off (run - slowest fn):  {(total - slowest) * us:>6.0f} us")


def bench_check(batches: list[int], repeats: int, inner: int) -> None:
    print("(d) the divergence check of mirror_optimizer, 2 replicas: cost against "
          "check='off' (target < 2 %); 2 copies of each, blocks of 8 steps (one checked "
          "step each for 'cheap') in shuffled order; median [90 % CI] of per-round ratios")
    for batch in batches:
        builders: dict[str, Callable[[], Callable[[], object]]] = {
            name: functools.partial(Mirrored, 2, batch, check=name.strip())
            for name in ("off", "cheap", "full", "off ")}
        t = paired_rounds(builders, copies=2, rounds=repeats * 5, block=8)
        line = "; ".join(f"{name.strip() + (' again' if name == 'off ' else '')} "
                         f"{m:+.1%} [{lo:+.1%}, {hi:+.1%}]"
                         for name, (m, lo, hi) in t.items() if name != "off")
        cheap = t["cheap"]
        print(f"  batch {batch:>3}: off {t['off'][0] * 1e6:.0f} us/step; {line} "
              f"({verdict(cheap[0] < 0.02)} for 'cheap')")


def bench_overlap(batches: list[int], repeats: int, inner: int) -> None:
    print("(e) overlap of the gradient all-reduce with backward, 2 replicas: overlap=True "
          "with 64 KiB buckets (the MLP's 330 KiB of gradients are one bucket at the "
          "default 25 MiB) against overlap=False (no target; decides the default)")
    default_bytes = overlap_module.DEFAULT_BUCKET_BYTES
    overlap_module.DEFAULT_BUCKET_BYTES = 64 << 10
    for batch in batches:
        runs = {f"{on}": Mirrored(2, batch, overlap=on) for on in (False, True)}
        t = interleaved(dict(runs), repeats, inner)
        buckets = runs["True"].opt._reducer.buckets
        assert buckets is not None
        stats = buckets.stats
        for run in runs.values():
            run.strategy.close()
        hidden = stats["hidden_s"] / stats["comm_s"] if stats["comm_s"] else 0.0
        print(f"  batch {batch:>3}: off {t['False'] * 1e6:.0f} us/step, on "
              f"{t['True'] * 1e6:.0f} us/step: {t['False'] / t['True']:.2f}x; "
              f"{len(buckets.plan)} buckets, {hidden:.0%} of the early ones' reduction "
              "during backward")
    overlap_module.DEFAULT_BUCKET_BYTES = default_bytes


def bench_buffers(batches: list[int], repeats: int) -> None:
    print("(f) buffers other than BatchNorm's, 2 replicas, default options: the MLP "
          "beside 8 MiB of constant buffers and a small EMA, against the MLP alone "
          "(a constant buffer is compared at each step, not sent after 8 quiet steps); 2 copies of "
          "each, blocks of 8 steps in shuffled order; median [90 % CI] of per-round "
          "ratios")
    for batch in batches:
        builders: dict[str, Callable[[], Callable[[], object]]] = {
            "alone": functools.partial(Mirrored, 2, batch),
            "8 MiB": functools.partial(Mirrored, 2, batch, buffers_mib=8)}
        t = paired_rounds(builders, copies=2, rounds=repeats * 3, block=8)
        m, lo, hi = t["8 MiB"]
        print(f"  batch {batch:>3}: alone {t['alone'][0] * 1e6:.0f} us/step; with the "
              f"buffers {m:+.1%} [{lo:+.1%}, {hi:+.1%}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps, for a smoke run")
    parser.add_argument("--overlap", action="store_true", help="part (e) only")
    parser.add_argument("--buffers", action="store_true", help="part (f) only")
    parser.add_argument("--check", action="store_true", help="part (d) only")
    args = parser.parse_args()
    quick = args.quick
    repeats, inner = (3, 10) if quick else (9, 60)
    batches = [64, 256]
    if args.overlap:
        bench_overlap(batches, repeats, inner)
        return
    if args.buffers:
        bench_buffers(batches, repeats)
        return
    if args.check:
        bench_check(batches, repeats, inner)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"{os.cpu_count()} CPUs")
    bench_one_replica(batches, repeats, inner)
    bench_two_replicas(batches, repeats, inner, quick=quick)
    bench_four_replicas(batches, repeats, inner)
    bench_check(batches, repeats, inner)
    bench_overlap(batches, repeats, inner)
    bench_buffers(batches, repeats)


if __name__ == "__main__":
    main()
