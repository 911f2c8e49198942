"""The README's training loop with default settings, on 1 replica, against the same
loop in plain PyTorch: examples per second, as ratios measured in the same run.

    python benchmarks/bench_loop.py            # full run: batch 64 and 256, torch's
                                               # intra-op threads and 1 thread
    python benchmarks/bench_loop.py --quick    # fewer epochs, for a smoke run
    python benchmarks/bench_loop.py --threads 1   # one thread setting only (0: torch's)

The mirrored loop is the README's, unchanged and with every option at its default:
``MirroredStrategy(["CPU:0"])``, ``strategy.mirror(net)``, ``mirror_optimizer`` (SGD
with momentum), ``experimental_distribute_dataset`` over a list of global batches,
``strategy.run(train_step)`` with ``compute_average_loss``, ``zero_grad``,
``backward``, ``step``, and ``strategy.reduce("MEAN", per_example_loss, axis=0)``
after each step. The plain loop computes the same loss, step and mean over the same
batches (``per_example_loss.detach().mean()``). Variants, interleaved epoch by epoch
so machine noise hits them alike:

- ``plain``: the plain loop;
- ``default``: the README loop (on CPU replicas: no prefetch thread);
- ``one device``: the same with ``OneDeviceStrategy("CPU:0")``;
- ``prefetch 2``: the README loop with ``experimental_prefetch_depth=2`` (a background
  thread prepares two steps ahead);
- ``no reduce``: the README loop without the per-step ``strategy.reduce``;
- ``run only``: ``strategy.run`` of the plain step (plain model and optimizer);
- ``plain again``: the plain loop once more, built last: its ratio to ``plain`` is the
  measurement's own spread (where tensors land in memory, build order), to read the
  other ratios against.

Target: ``default`` within 5 % of ``plain`` at batch 64 and 256. Each figure is the
median over the interleaved repeats; the line "overhead" also gives the median of the
per-repeat ratios (each ``default`` epoch against the ``plain`` epoch next to it), the
steadier figure on a loaded machine. CPU time (all threads of the process) is the
steadier measure under load; wall time also shows what overlaps.
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
                   options: mirrored.InputOptions | None, reduce: bool = True,
                   strategy: mirrored.Strategy | None = None) -> Callable[[], object]:
    strategy = strategy or mirrored.MirroredStrategy(["CPU:0"])
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
                ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds (every thread of the process) of each call of each fn,
    taken in turn ``repeats`` times after one warm-up call each."""
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
    return wall, cpu


def report(batch: int, label: str, samples: dict[str, list[float]], steps: int) -> float:
    """Prints one line per time kind; returns the default loop's overhead (the median
    of its per-repeat ratios to the plain loop, minus 1)."""
    medians = {name: statistics.median(s) for name, s in samples.items()}
    base = medians["plain"]
    line = ", ".join(f"{name} {EXAMPLES / s:,.0f} ({base / s:.3f})"
                     for name, s in medians.items())
    paired = statistics.median(d / p for d, p in zip(samples["default"], samples["plain"],
                                                     strict=True)) - 1
    overhead = medians["default"] / base - 1
    per_step = (medians["default"] - base) / steps * 1e6
    ok = "meets" if max(paired, overhead) <= 0.05 else "MISSES"
    print(f"batch {batch}, {label} time: {line}\n  default loop overhead: {overhead:+.1%} "
          f"(ratio of medians), {paired:+.1%} (median of paired ratios), {per_step:+.0f} us "
          f"per step: {ok} target <= +5 %")
    return paired


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs")
    parser.add_argument("--threads", type=int, nargs="*", default=[0, 1],
                        help="intra-op thread settings to measure, in turn (0: torch's "
                        "default; 1 is the steadier setting on a loaded machine, where "
                        "OpenMP teams spin against other processes)")
    parser.add_argument("--batches", type=int, nargs="*", default=[64, 256])
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {EXAMPLES} examples per epoch; examples/s (ratio to "
          "plain), medians of interleaved epochs")
    for threads in args.threads:
        torch.set_num_threads(threads or default_threads)
        print(f"--- {torch.get_num_threads()} intra-op threads")
        for batch in args.batches:
            batches = make_batches(batch)
            fns = {
                "plain": plain_epoch(batches),
                "default": mirrored_epoch(batches, None),
                "one device": mirrored_epoch(
                    batches, None, strategy=mirrored.OneDeviceStrategy("CPU:0")),
                "prefetch 2": mirrored_epoch(
                    batches, mirrored.InputOptions(experimental_prefetch_depth=2)),
                "no reduce": mirrored_epoch(batches, None, reduce=False),
                "run only": run_only_epoch(batches),
                "plain again": plain_epoch(batches),  # A/A: the spread between equal loops
            }
            wall, cpu = interleaved(fns, 5 if args.quick else 21)
            for label, samples in (("wall", wall), ("CPU", cpu)):
                report(batch, label, samples, len(batches))


if __name__ == "__main__":
    main()
