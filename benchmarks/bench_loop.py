"""The README's training loop with default settings, on 1 replica, against the same
loop in plain PyTorch: examples per second, as ratios measured in the same run.

    python benchmarks/bench_loop.py            # full run
    python benchmarks/bench_loop.py --quick    # fewer epochs, for a smoke run

The mirrored loop is the README's, unchanged: ``experimental_distribute_dataset``
over a list of global batches, ``strategy.run(train_step)`` with a mirrored MLP
(64-256-256-10, digits-sized inputs), ``mirror_optimizer`` (SGD),
``compute_average_loss`` and ``strategy.reduce("MEAN", ..., axis=0)`` of the
per-example losses. The plain loop computes the same loss and mean over the same
batches. Variants, interleaved epoch by epoch so machine noise hits them alike:

- ``plain``: the plain loop;
- ``default``: the mirrored loop with default ``InputOptions`` (on CPU replicas:
  no prefetch thread);
- ``prefetch 2``: the same with ``experimental_prefetch_depth=2`` (a background
  thread prepares two steps ahead);
- ``no reduce``: the default loop without the per-step ``strategy.reduce``;
- ``run only``: ``strategy.run`` of the plain step (plain model and optimizer),
  what the strategy itself costs.

Target: ``default`` within 5 % of ``plain`` at batch 64 and 256. The machine is
shared and noisy: read ratios, not single figures; CPU time (all threads of the
process) is the steadier measure under load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

import mirrored

IN, HIDDEN, CLASSES = 64, 256, 10
EXAMPLES = 4096


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def make_batches(batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(EXAMPLES, IN, generator=g)
    y = torch.randint(0, CLASSES, (EXAMPLES,), generator=g)
    return [(x[i:i + batch], y[i:i + batch]) for i in range(0, EXAMPLES, batch)]


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # type: ignore[arg-type]


def plain_epoch(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], object]:
    model = make_mlp()
    optimizer = sgd(model.parameters())

    def epoch() -> None:
        for x, y in batches:
            per_example_loss = F.cross_entropy(model(x), y, reduction="none")
            loss = per_example_loss.sum() / len(y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            per_example_loss.detach().mean()

    return epoch


def mirrored_epoch(batches: list[tuple[torch.Tensor, torch.Tensor]],
                   options: mirrored.InputOptions | None, reduce: bool = True
                   ) -> Callable[[], object]:
    strategy = mirrored.MirroredStrategy(["CPU:0"])
    model = strategy.mirror(make_mlp())
    optimizer = strategy.mirror_optimizer(model, sgd)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example_loss = F.cross_entropy(model(x), y, reduction="none")
        loss = mirrored.compute_average_loss(per_example_loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return per_example_loss.detach()

    def epoch() -> None:
        for x, y in strategy.experimental_distribute_dataset(batches, options):
            per_example_loss = strategy.run(train_step, args=(x, y))
            if reduce:
                strategy.reduce("MEAN", per_example_loss, axis=0)

    return epoch


def run_only_epoch(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], object]:
    strategy = mirrored.MirroredStrategy(["CPU:0"])
    model = make_mlp()
    optimizer = sgd(model.parameters())

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example_loss = F.cross_entropy(model(x), y, reduction="none")
        loss = per_example_loss.sum() / len(y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return per_example_loss.detach()

    def epoch() -> None:
        for x, y in batches:
            strategy.run(train_step, args=(x, y)).mean()

    return epoch


def interleaved(fns: dict[str, Callable[[], object]], repeats: int
                ) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall and CPU seconds (every thread of the process) of one call of each
    fn, taken in turn ``repeats`` times. On a loaded machine CPU time is the steadier
    measure of the work a loop does; wall time also shows what overlaps."""
    for fn in fns.values():
        fn()
    wall: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    return ({name: statistics.median(s) for name, s in wall.items()},
            {name: statistics.median(s) for name, s in cpu.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads (default: torch's); 1 on a loaded machine, "
                        "where OpenMP teams spin against other processes")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, "
          f"{EXAMPLES} examples per epoch; examples/s (ratio to plain)")
    for batch in (64, 256):
        batches = make_batches(batch)
        fns = {
            "plain": plain_epoch(batches),
            "default": mirrored_epoch(batches, None),
            "prefetch 2": mirrored_epoch(
                batches, mirrored.InputOptions(experimental_prefetch_depth=2)),
            "no reduce": mirrored_epoch(batches, None, reduce=False),
            "run only": run_only_epoch(batches),
        }
        wall, cpu = interleaved(fns, 5 if args.quick else 21)
        for label, seconds in (("wall", wall), ("CPU", cpu)):
            base = seconds["plain"]
            line = ", ".join(f"{name} {EXAMPLES / s:,.0f} ({base / s:.3f})"
                             for name, s in seconds.items())
            overhead = seconds["default"] / base - 1
            ok = "meets" if overhead <= 0.05 else "MISSES"
            print(f"batch {batch}, {label} time: {line}\n  default loop overhead "
                  f"{overhead:+.1%}: {ok} target <= +5 %")


if __name__ == "__main__":
    main()
