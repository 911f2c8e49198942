"""GPU checks: correctness and speed of the README's loop on CUDA, as ratios against
peers measured in the same run. Without CUDA it prints why and exits 0.

    python benchmarks/gpu_check.py            # full run
    python benchmarks/gpu_check.py --quick    # fewer steps

One GPU:
  (a) the README's loop (``experimental_distribute_dataset`` with default options,
      ``run``, ``mirror``, ``mirror_optimizer``, ``compute_average_loss``,
      ``reduce``) on 1 replica against the plain PyTorch loop on the same GPU:
      examples/s and the ratio (target: overhead <= 5 %), with the default prefetch
      (2 steps ahead on CUDA) and with none; the final parameters must equal the
      plain loop's.
Two or more GPUs (k of them):
  (b) k replicas (NCCL through ``MirroredStrategy``'s default cross-device ops)
      against one device fed the same global batches: parameters equal within
      float32 rounding after the same steps;
  (c) k replicas in one process against ``DistributedDataParallel`` on NCCL with k
      processes: examples/s and the ratio (target: >= 1.0x).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import mirrored

IN, HIDDEN, CLASSES = 64, 256, 10


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def make_batches(batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(batch)
    return [(torch.randn(batch, IN, generator=g), torch.randint(0, CLASSES, (batch,), generator=g))
            for _ in range(steps)]


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)  # type: ignore[arg-type]


def plain_loop(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, nn.Module]:
    model = make_mlp().cuda()
    optimizer = sgd(model.parameters())
    torch.cuda.synchronize()
    start = time.perf_counter()
    for x, y in batches:
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        per_example_loss = F.cross_entropy(model(x), y, reduction="none")
        optimizer.zero_grad()
        (per_example_loss.sum() / len(y)).backward()
        optimizer.step()
        per_example_loss.detach().mean()
    torch.cuda.synchronize()
    return time.perf_counter() - start, model


def mirrored_loop(devices: list[str], batches: list[tuple[torch.Tensor, torch.Tensor]],
                  options: mirrored.InputOptions | None = None,
                  **optimizer_options: object) -> tuple[float, nn.Module]:
    strategy = mirrored.MirroredStrategy(devices)
    model = strategy.mirror(make_mlp())
    optimizer = strategy.mirror_optimizer(model, sgd, **optimizer_options)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example_loss = F.cross_entropy(model(x), y, reduction="none")
        loss = mirrored.compute_average_loss(per_example_loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return per_example_loss.detach()

    torch.cuda.synchronize()
    start = time.perf_counter()
    for x, y in strategy.experimental_distribute_dataset(batches, options):
        strategy.reduce("MEAN", strategy.run(train_step, args=(x, y)), axis=0)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    strategy.close()
    return seconds, model.module


def max_difference(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.detach().cpu() - q.detach().cpu()).abs().max())
               for p, q in zip(a.parameters(), b.parameters(), strict=True))


NO_PREFETCH = mirrored.InputOptions(experimental_prefetch_depth=0)


def one_gpu(steps: int, repeats: int, breakdown: bool = False) -> bool:
    print("(a) the README loop on 1 replica vs plain PyTorch, cuda:0")
    ok = True
    variants: dict[str, dict[str, object]] = {"no prefetch": {"options": NO_PREFETCH}}
    if breakdown:  # where the overhead goes: each default switched off alone, then all
        variants |= {"check off": {"check": "off"},
                     "both off": {"options": NO_PREFETCH, "check": "off"}}
    for batch in (64, 256):
        batches = make_batches(batch, steps)
        runs: dict[str, list[float]] = {"plain": [], "default": []} | {v: [] for v in variants}
        models: dict[str, nn.Module] = {}
        for _ in range(repeats):  # interleaved, so noise hits all variants alike
            runs["plain"].append((s := plain_loop(batches))[0])
            models["plain"] = s[1]
            runs["default"].append((s := mirrored_loop(["GPU:0"], batches))[0])
            models["default"] = s[1]
            for name, kwargs in variants.items():
                runs[name].append(mirrored_loop(["GPU:0"], batches, **kwargs)[0])  # type: ignore[arg-type]
        seconds = {name: statistics.median(v) for name, v in runs.items()}
        print(f"  batch {batch}: per step " + ", ".join(
            f"{name} {s / steps * 1e6:,.0f} us" for name, s in seconds.items()))
        diff = max_difference(models["plain"], models["default"])
        overhead = seconds["default"] / seconds["plain"] - 1
        print(f"  batch {batch}: " + ", ".join(
            f"{name} {batch * steps / s:,.0f} ex/s" for name, s in seconds.items())
            + f"; default overhead {overhead:+.1%} (target <= +5 %); parameters differ by "
            f"{diff:.1e}")
        ok &= diff <= 1e-5
    return ok


def many_gpus(k: int, steps: int) -> bool:
    devices = [f"GPU:{i}" for i in range(k)]
    print(f"(b) {k} replicas (NCCL) vs one device, same global batches")
    batches = make_batches(64 * k, steps)
    _, replicas = mirrored_loop(devices, batches)
    _, single = mirrored_loop(["GPU:0"], batches)
    diff = max_difference(replicas, single)
    print(f"  parameters differ by {diff:.1e} after {steps} steps (float32 rounding: <= 1e-5)")
    print(f"(c) {k} replicas in one process vs DDP on NCCL with {k} processes")
    for batch in (64 * k, 256 * k):
        batches = make_batches(batch, steps)
        mirrored_loop(devices, batches[:5])  # warm-up
        ours, _ = mirrored_loop(devices, batches)
        ddp = ddp_seconds(k, batch, steps)
        print(f"  global batch {batch}: mirrored {batch * steps / ours:,.0f} ex/s, DDP "
              f"{batch * steps / ddp:,.0f} ex/s: {ddp / ours:.2f}x DDP (target >= 1.0x)")
    return diff <= 1e-5


def _ddp_worker(rank: int, k: int, port: int, batch: int, steps: int, out: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=k)
    torch.cuda.set_device(rank)
    model = DistributedDataParallel(make_mlp().cuda(rank), device_ids=[rank])
    optimizer = sgd(model.parameters())
    local = batch // k
    batches = [(x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local])
               for x, y in make_batches(batch, steps)]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.cuda(rank, non_blocking=True), y.cuda(rank, non_blocking=True)
        loss = F.cross_entropy(model(x), y, reduction="none").sum() / batch
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    for x, y in batches[:5]:
        step(x, y)
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for x, y in batches:
        step(x, y)
    torch.cuda.synchronize()
    if rank == 0:
        with open(out, "w") as f:
            f.write(str(time.perf_counter() - start))
    dist.destroy_process_group()


def ddp_seconds(k: int, batch: int, steps: int) -> float:
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "seconds")
        mp.spawn(_ddp_worker, args=(k, port, batch, steps, out), nprocs=k, join=True)
        with open(out) as f:
            return float(f.read())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--breakdown", action="store_true",
                        help="(a) also with the divergence check off, and with both it and "
                             "the prefetch off: where the overhead goes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible (torch.cuda.is_available() is False); "
              "skipping the GPU checks")
        return 0
    k = torch.cuda.device_count()
    print(f"torch {torch.__version__}, {k} CUDA device(s): {torch.cuda.get_device_name(0)}")
    steps, repeats = (50, 3) if args.quick else (300, 5)
    ok = one_gpu(steps, repeats, args.breakdown)
    if k >= 2:
        ok &= many_gpus(k, steps)
    else:
        print("(b), (c): need two or more GPUs; skipped")
    print("all equality checks passed" if ok else "EQUALITY CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
