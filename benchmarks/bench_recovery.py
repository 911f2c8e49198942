"""What losing one of 3 workers costs: elastic training (torchft) against a torchrun
restart of the whole job from its last checkpoint, same model, same machine, one run.

    python benchmarks/bench_recovery.py

(a) elastic: 3 workers train with `mirrored.elastic.ElasticMirroredStrategy` (the
    mirrored loop on torchft); worker 2 is SIGKILLed in step 30 (after backward, before
    the optimizer step) and started again (the survivors go on past step 80 until it is
    back). Reported: the
    survivors' longest pause between two committed steps (against their median step),
    the steps they redid, and when the restarted worker was back in a step.
(b) restart: ``torchrun --nproc-per-node=3 --max-restarts=1`` trains the same model
    with `MultiWorkerMirroredStrategy`, checkpointing every 10 steps; worker 2 exits
    with an error in step 35. Reported: the time from the failure to the first step of
    the restarted job, and the steps lost (done since the last checkpoint, redone).

Each worker is one CPU replica; steps sleep 20 ms to stand for compute.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn

import mirrored
from mirrored import elastic

GLOBAL_BATCH = 48
STEPS = 80
COMPUTE_SECONDS = 0.02


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(GLOBAL_BATCH, 16, generator=g)
    return x, x.sum(1, keepdim=True)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))


def elastic_worker(index: int, address: str, kill_at: int | None, conn: Any) -> None:
    torch.set_num_threads(1)
    strategy = elastic.ElasticMirroredStrategy(address, worker_index=index, num_workers=3,
                                               min_workers=2)
    with strategy.scope():
        net = strategy.mirror(model())
        opt = strategy.mirror_optimizer(net, lambda p: torch.optim.SGD(p, lr=0.01))
    dataset = strategy.experimental_distribute_dataset(batch(s) for s in itertools.count())

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> None:
        mirrored.compute_average_loss(((net(x) - y) ** 2).squeeze(1)).backward()
        time.sleep(COMPUTE_SECONDS)
        if strategy.elastic.step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        opt.zero_grad()

    log = []
    for x, y in dataset:  # past STEPS, until the restarted worker is back in a step
        step, workers = strategy.elastic.step, strategy.elastic.num_workers
        strategy.run(step_fn, args=(x, y))
        committed = strategy.elastic.step == step + 1
        log.append((step, committed, time.time()))
        if committed and strategy.elastic.step >= STEPS and workers == 3:
            break
    strategy.close()
    conn.send(log)


def run_elastic() -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    lighthouse = elastic.Lighthouse(min_workers=2)
    procs, readers = [], []

    def start(index: int, kill_at: int | None) -> None:
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=elastic_worker, args=(index, lighthouse.address, kill_at,
                                                        writer))
        proc.start()
        writer.close()
        procs.append(proc)
        readers.append(reader)

    try:
        for index in range(3):
            start(index, 30 if index == 2 else None)
        procs[2].join(120)
        killed = time.time()
        start(2, None)
        logs = [readers[i].recv() for i in (0, 1, 3)]
    finally:
        for proc in procs:
            proc.kill()
        lighthouse.close()
    times = [t for _, ok, t in logs[0] if ok]
    gaps = sorted(b - a for a, b in itertools.pairwise(times))
    return {"pause_s": gaps[-1], "median_step_s": gaps[len(gaps) // 2],
            "steps_redone": sum(not ok for _, ok, _ in logs[0]),
            "rejoined_after_s": logs[2][0][2] - killed, "rejoined_at_step": logs[2][0][0]}


def restart_worker(directory: str, log_path: str) -> None:
    strategy = mirrored.MultiWorkerMirroredStrategy()
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    net = strategy.mirror(model())
    opt = strategy.mirror_optimizer(net, lambda p: torch.optim.SGD(p, lr=0.01))
    manager = mirrored.CheckpointManager(strategy, directory)
    start = manager.restore({"model": net, "optimizer": opt}) or 0

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> None:
        mirrored.compute_average_loss(((net(x) - y) ** 2).squeeze(1)).backward()
        opt.step()
        opt.zero_grad()

    for step in range(start, STEPS):
        (x, y), = strategy.experimental_distribute_dataset([batch(step)])
        strategy.run(step_fn, args=(x, y))
        time.sleep(COMPUTE_SECONDS)
        if strategy.cluster_resolver.worker_index == 0:
            with open(log_path, "a") as f:
                f.write(json.dumps([restarts, step, time.time()]) + "\n")
        if (step + 1) % 10 == 0:
            manager.save(step + 1, {"model": net, "optimizer": opt})
        if step == 35 and restarts == 0 and strategy.cluster_resolver.worker_index == 2:
            with open(log_path, "a") as f:
                f.write(json.dumps(["failed", step, time.time()]) + "\n")
            os._exit(1)
    strategy.close()


def run_restart() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        log = pathlib.Path(tmp) / "log.jsonl"
        job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node=3", "--max-restarts=1",
                              "--monitor-interval=0.1", __file__, "--restart-worker", tmp,
                              str(log)], capture_output=True, text=True, timeout=600)
        if job.returncode != 0:
            raise RuntimeError(f"torchrun failed: {job.stderr[-3000:]}")
        entries = [json.loads(line) for line in log.read_text().splitlines()]
    failed = next(e for e in entries if e[0] == "failed")
    first_after = next(e for e in entries if e[0] == 1)
    before = [e[2] for e in entries if e[0] == 0]
    gaps = sorted(b - a for a, b in itertools.pairwise(before))
    return {"restart_s": first_after[2] - failed[2], "resumed_at_step": first_after[1],
            "steps_lost": failed[1] + 1 - first_after[1], "median_step_s": gaps[len(gaps) // 2]}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--restart-worker":
        torch.set_num_threads(1)
        restart_worker(sys.argv[2], sys.argv[3])
        sys.exit(0)
    import argparse  # (no options: one run of each scenario, a few minutes in all)
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    a = run_elastic()
    print(f"(a) elastic: survivors paused {a['pause_s']:.2f} s once (median step "
          f"{a['median_step_s']:.3f} s), redid {a['steps_redone']} step; the restarted worker "
          f"was back in step {a['rejoined_at_step']} after {a['rejoined_after_s']:.1f} s")
    b = run_restart()
    print(f"(b) torchrun restart: {b['restart_s']:.1f} s from the failure to the first step "
          f"of the restarted job; {b['steps_lost']} steps lost (resumed at step "
          f"{b['resumed_at_step']}, checkpoint every 10); median step "
          f"{b['median_step_s']:.3f} s (MultiWorkerMirroredStrategy, no failure)")
    print(f"survivors' pause: elastic {a['pause_s']:.2f} s vs restart {b['restart_s']:.1f} s "
          f"({b['restart_s'] / a['pause_s']:.0f}x)")
