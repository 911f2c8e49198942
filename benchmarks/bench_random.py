"""What per-replica random streams cost, and what they do under ``torch.compile``.

    python benchmarks/bench_random.py            # full run
    python benchmarks/bench_random.py --quick    # fewer steps, for a smoke run

(a) Per call, on one thread: a non-random op (``t + t``) and ``F.dropout`` of 64
    floats, before the routing kernels exist, after (outside ``run``) and inside a
    replica's stream.
(b) Training steps (forward, backward, SGD) on 2 logical CPU replicas with
    per-replica streams (the default) against ``per_replica_random=False`` (torch's
    shared generator: not reproducible) and against the same global batch in a plain
    one-thread loop: a dropout-heavy MLP (64-256-256-256-10, dropout 0.2 after each
    hidden layer), a 2-layer Transformer encoder (d 64, 4 heads, dropout 0.1), and
    the README's digits MLP (no dropout: nothing random runs). Target: streams cost
    <= 5 % of a dropout-heavy step.
(c) ``torch.compile`` of a small GPT-like block with dropout, called inside ``run`` on
    2 replicas: graph breaks counted by Dynamo, and compiled against eager step time,
    next to plain torch (no strategy) running the same two batches in turn, eager and
    compiled: whether compiling pays on this model at all, and what the strategy adds.

Medians over interleaved repeats (variants alternate, so machine noise hits them
alike). The machine may be shared: read the ratios, not single figures.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import timeit
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import mirrored


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, inner: int,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each fn; one sample of each in turn, ``repeats`` times,
    the order rotated each round. ``clock=time.process_time`` counts the CPU time of all
    threads instead of wall time (steadier on a shared machine, where wall time includes
    waiting for a core)."""
    for fn in fns.values():
        for _ in range(max(3, inner // 5)):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for round_ in range(repeats):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:
            fn = fns[name]
            start = clock()
            for _ in range(inner):
                fn()
            samples[name].append((clock() - start) / inner)
    return {name: statistics.median(s) for name, s in samples.items()}


def per_call() -> None:
    from mirrored._src.runtime.random import RandomStreams, install

    t = torch.ones(64)

    def cost(fn: Callable[[], object]) -> float:  # CPU time of this thread, best of 7
        return min(timeit.repeat(fn, number=2000, repeat=7, timer=time.thread_time)
                   ) / 2000 * 1e6

    def add() -> object:
        return t + t

    def dropout() -> object:
        return F.dropout(t, 0.5)

    rows = [("before the kernels exist", cost(add), cost(dropout))]
    install()
    rows.append(("kernels installed, outside run", cost(add), cost(dropout)))
    streams = RandomStreams([0])
    streams.start_run()
    with streams.mode(0):
        rows.append(("inside a replica's stream", cost(add), cost(dropout)))
    print("(a) per call, µs            t + t   F.dropout(64 floats)")
    for name, a, d in rows:
        print(f"    {name:<30} {a:6.2f}   {d:6.2f}")
    # One replica's share of a dropout-heavy training step (batch 64), on this thread,
    # inside a replica's stream or not: the streams' cost without thread noise.
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g)
    model = dropout_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> object:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    def in_stream() -> object:
        streams.start_run()
        with streams.mode(0):
            return step()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each of 2 replicas on a 2-core machine
    times = interleaved({"off": step, "stream": in_stream}, repeats=41, inner=20,
                        clock=time.thread_time)
    torch.set_num_threads(threads)
    print(f"    dropout-MLP step on one thread: {times['off'] * 1e3:.3f} ms CPU, in a "
          f"fresh stream each step {times['stream'] * 1e3:.3f} ms "
          f"({times['stream'] / times['off']:.3f})")


def dropout_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 256),
                         nn.ReLU(), nn.Dropout(0.2), nn.Linear(256, 256), nn.ReLU(),
                         nn.Dropout(0.2), nn.Linear(256, 10))


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(64, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(1))


def digits_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 10))


def steps(make: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor
          ) -> dict[str, Callable[[], object]]:
    torch.manual_seed(0)
    plain = make()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.01)

    def plain_step() -> object:
        loss = F.cross_entropy(plain(x), y)
        plain_opt.zero_grad()
        loss.backward()
        plain_opt.step()
        return loss

    fns: dict[str, Callable[[], object]] = {"plain loop": plain_step}
    for name, random in (("2 replicas, streams", True), ("2 replicas, off", False)):
        strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"], per_replica_random=random)
        torch.manual_seed(0)
        model = strategy.mirror(make())
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.01))
        batches = strategy.experimental_distribute_values_from_function(
            lambda ctx: (x.chunk(2)[ctx.replica_id_in_sync_group],
                         y.chunk(2)[ctx.replica_id_in_sync_group]))

        def train(xb: torch.Tensor, yb: torch.Tensor, model: nn.Module = model,
                  opt: torch.optim.Optimizer = opt) -> torch.Tensor:
            per_example = F.cross_entropy(model(xb), yb, reduction="none")
            loss = mirrored.compute_average_loss(per_example)
            opt.zero_grad()
            loss.backward()
            opt.step()
            return per_example.detach()

        def step(strategy: mirrored.MirroredStrategy = strategy, train: Callable[
                ..., torch.Tensor] = train, batches: object = batches) -> object:
            return strategy.run(lambda b: train(*b), args=(batches,))

        fns[name] = step
    return fns


def training(quick: bool) -> None:
    print("(b) training step, 2 replicas (global batch 128): median ms (wall, then CPU "
          "time of all threads), ratio to 'off'")
    g = torch.Generator().manual_seed(0)
    models = {"dropout MLP": (dropout_mlp, torch.randn(128, 64, generator=g)),
              "Transformer encoder": (Encoder, torch.randn(128, 16, 64, generator=g)),
              "digits MLP (no dropout)": (digits_mlp, torch.randn(128, 64, generator=g))}
    y = torch.randint(0, 10, (128,), generator=g)
    for label, (make, x) in models.items():
        for clock_name, clock in (("wall", time.perf_counter), ("cpu", time.process_time)):
            fns = steps(make, x, y)
            plain = {"plain loop": fns.pop("plain loop")}  # (timed apart: its OpenMP
            # threads spin on after it and slow whatever runs next, about 15 %)
            times = interleaved(plain, repeats=3 if quick else 5, inner=5 if quick else 20,
                                clock=clock)
            times |= interleaved(fns, repeats=6 if quick else 16, inner=5 if quick else 20,
                                 clock=clock)
            off = times["2 replicas, off"]
            cells = ", ".join(f"{k} {v * 1e3:.2f} ({v / off:.3f})" for k, v in times.items())
            print(f"    {label}, {clock_name}: {cells}")


class Block(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d),
                                 nn.Dropout(0.1))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0,
                                           is_causal=True)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, t, d)), 0.1, self.training)
        return x + self.mlp(self.ln2(x))


def compiled(quick: bool) -> None:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(128, 64), Block(), Block(), nn.LayerNorm(64),
                          nn.Linear(64, 128))
    fast = torch.compile(model)
    tokens = torch.randint(0, 128, (2, 8, 32))
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])

    def make(net: nn.Module) -> Callable[[], object]:
        def train() -> torch.Tensor:
            i = mirrored.get_replica_context().replica_id_in_sync_group
            loss = net(tokens[i]).logsumexp(-1).mean()
            loss.backward()
            return loss.detach()
        return lambda: strategy.run(train)

    counters.clear()
    step = make(fast)
    step()  # compiles
    torch.manual_seed(0)
    first = strategy.experimental_local_results(step())
    torch.manual_seed(0)
    again = strategy.experimental_local_results(step())
    breaks = sum(counters["graph_break"].values())
    same = all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    plain = torch.compile(copy.deepcopy(model))

    def alone(net: nn.Module) -> Callable[[], object]:
        def train() -> None:  # plain torch, no strategy: both replicas' batches in turn
            for i in range(2):
                net(tokens[i]).logsumexp(-1).mean().backward()
        return train

    alone(plain)()  # compiles
    times = interleaved({"eager": make(model), "compiled": step, "plain eager": alone(model),
                         "plain compiled": alone(plain)},
                        repeats=5 if quick else 15, inner=3 if quick else 10)
    e, c, pe, pc = (times[k] * 1e3 for k in ("eager", "compiled", "plain eager",
                                             "plain compiled"))
    print(f"(c) GPT-like, 2 blocks, 2 replicas: graph breaks {breaks}, compiled reproducible "
          f"from manual_seed: {same}; step eager {e:.2f} ms, compiled {c:.2f} ms "
          f"({c / e:.2f}x); plain torch, the same two batches in turn on one thread: eager "
          f"{pe:.2f} ms, compiled {pc:.2f} ms ({pc / pe:.2f}x); mirrored vs plain: eager "
          f"{e / pe:.2f}x, compiled {c / pc:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["a", "b", "c"])
    args = parser.parse_args()
    if args.only in (None, "a"):
        per_call()
    if args.only in (None, "b"):
        training(args.quick)
    if args.only in (None, "c"):
        compiled(args.quick)


if __name__ == "__main__":
    main()
