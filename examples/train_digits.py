"""Train a small CNN with BatchNorm on scikit-learn's digits, data-parallel over N replicas.

    python examples/train_digits.py                      # 4 logical CPU replicas, 10 epochs
    python examples/train_digits.py --replicas 1         # the same training on one replica
    python examples/train_digits.py --checkpoint-dir ckpt  # save every epoch, resume
    torchrun --nproc-per-node=2 --max-restarts=1 examples/train_digits.py --multi-worker \
        --checkpoint-dir ckpt                            # 2 workers, resumes after a restart
    torchrun --nproc-per-node=2 --max-restarts=1 examples/train_digits.py --multi-worker \
        --checkpoint-dir ckpt --preemption               # SIGTERM to a worker: all save, exit 42
    python examples/train_digits.py --elastic --worker-index 0 --num-workers 3  # one worker
        # of an elastic job on torchft (a lighthouse first; see train_digits_elastic.py)

`MirroredStrategy` runs one copy of the model per replica ("CPU:0" ... are logical CPU
devices, so this runs on any machine). Each step splits one global batch over the
replicas, every replica computes its loss with `compute_average_loss` (divided by the
global batch size), the optimizer all-reduces the gradients, and BatchNorm normalizes
with the statistics of the global batch (`sync_batch_norm=True`): N replicas train
the same model as one. The training set (1437 images) is not a multiple of the batch
size, so every epoch ends with a partial batch, which is split unevenly.

With `--multi-worker` the same loop runs on `MultiWorkerMirroredStrategy` (launched by
torchrun, or one process per worker with TF_CONFIG): `--replicas` is then the number of
local replicas per worker, every worker reads the same global batches and keeps its
replicas' chunks, the chief writes the checkpoints and every worker restores them.

With `--elastic` this script hands over to `train_digits_elastic.py` (the same model
on `mirrored.elastic.ElasticMirroredStrategy`, with its own options: a worker killed
without notice is left out and the others go on; started again, it rejoins).

stdout: one line per epoch (`epoch 3/10 loss 0.1234 accuracy 0.9600`), then
`test accuracy: 0.9xxx` (in a multi-worker job, the chief's). The progress bar (tqdm)
goes to stderr.
"""

import argparse
import os
import pathlib
import runpy
import sys

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm

import mirrored

# -----------------------------------------------------------------------------
# configuration

if "--elastic" in sys.argv[1:]:  # the elastic variant, with the remaining arguments
    sys.argv = [str(pathlib.Path(__file__).with_name("train_digits_elastic.py")),
                *(a for a in sys.argv[1:] if a != "--elastic")]
    runpy.run_path(sys.argv[0], run_name="__main__")
    sys.exit(0)

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--elastic", action="store_true",
                    help="run one worker of an elastic job (train_digits_elastic.py; pass "
                         "its options, e.g. --worker-index 0 --num-workers 3)")
parser.add_argument("--replicas", type=int, default=4, help="logical CPU replicas")
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--batch-size", type=int, default=100, help="global batch size")
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--checkpoint-dir", type=pathlib.Path, default=None,
                    help="save a checkpoint after every epoch; resume from it if present")
parser.add_argument("--save-final", type=pathlib.Path, default=None,
                    help="write the final model state dict here")
parser.add_argument("--multi-worker", action="store_true",
                    help="MultiWorkerMirroredStrategy over torchrun's (or TF_CONFIG's) workers")
parser.add_argument("--preemption", action="store_true",
                    help="on SIGTERM to any worker, every worker saves the same step to "
                         "--checkpoint-dir and exits with code 42 (torchrun then restarts)")
parser.add_argument("--crash-after-epoch", type=int, default=None,
                    help="(testing restarts) exit with an error after this epoch, once")
args = parser.parse_args()
if args.replicas < 1 or args.epochs < 0 or args.batch_size < 1:
    parser.error("--replicas and --batch-size must be >= 1, --epochs >= 0")
if args.preemption and args.checkpoint_dir is None:
    parser.error("--preemption saves to --checkpoint-dir: pass one")


# -----------------------------------------------------------------------------
# data: 1797 8x8 grey images bundled with scikit-learn (no download)

digits = load_digits()
images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)  # [N, 1, 8, 8]
labels = torch.tensor(digits.target, dtype=torch.int64)
# A fixed split (independent of --seed): 1437 train, 360 test.
split = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
train_idx, test_idx = split[:1437], split[1437:]
x_train, y_train = images[train_idx], labels[train_idx]
x_test, y_test = images[test_idx], labels[test_idx]


def global_batches(x, y, batch_size, shuffle_seed=None):
    """The global batches of one epoch (the last one partial), in a seeded order."""
    order = torch.arange(len(y))
    if shuffle_seed is not None:
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(shuffle_seed))
    return [(x[order[i:i + batch_size]], y[order[i:i + batch_size]])
            for i in range(0, len(y), batch_size)]


# -----------------------------------------------------------------------------
# model, strategy, optimizer

# Smooth activations (SiLU) and average pooling: with ReLU or MaxPool, float32 rounding
# differences (N replicas sum in another order than one) can flip an activation across
# the kink or a max-pool argmax, a discrete change in the gradient that momentum then
# carries: N-replica and 1-replica runs drift apart by ~1e-3 instead of ~1e-7 (in
# float64 they agree to 1e-14 either way).
torch.manual_seed(args.seed)
net = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.SiLU(),
    nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.SiLU(),
    nn.AvgPool2d(2),                                            # [B, 32, 4, 4]
    nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.SiLU(), nn.Linear(64, 10),
)

devices = [f"CPU:{i}" for i in range(args.replicas)]
if args.multi_worker:  # workers and their ranks come from torchrun's variables or TF_CONFIG
    strategy = mirrored.MultiWorkerMirroredStrategy(devices=devices)
else:
    strategy = mirrored.MirroredStrategy(devices)
chief = strategy.extended.should_checkpoint if args.multi_worker else True
if not chief:
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (the chief reports for the job)
model = strategy.mirror(net, sync_batch_norm=True)  # one copy per replica, global-batch BN
optimizer = strategy.mirror_optimizer(
    model, lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9, foreach=True))
print(f"{strategy.num_replicas_in_sync} replica{'s' if strategy.num_replicas_in_sync > 1 else ''}, "
      f"global batch {args.batch_size}, "
      f"{len(y_train)} training examples ({len(y_train) % args.batch_size} in the last batch), "
      f"{len(y_test)} test examples")

# -----------------------------------------------------------------------------
# resume from the latest checkpoint, if any

start_epoch = skip = 0
checkpoints = preemption = None
state = {"model": model, "optimizer": optimizer}
steps_per_epoch = -(-len(y_train) // args.batch_size)
if args.preemption:
    # Checkpoints numbered by steps: restores the newest, then watches for SIGTERM.
    preemption = mirrored.PreemptionCheckpointHandler(strategy, state, args.checkpoint_dir)
    checkpoints = preemption.checkpoint_manager
    start_epoch, skip = divmod(preemption.total_run_calls, steps_per_epoch)
    if preemption.total_run_calls:
        print(f"resumed from step {preemption.total_run_calls} (epoch {start_epoch + 1}, "
              f"batch {skip + 1})")
elif args.checkpoint_dir is not None:
    # The chief writes atomically (temporary file, fsync, rename); every worker restores
    # the newest epoch into every replica's copy.
    checkpoints = mirrored.CheckpointManager(strategy, args.checkpoint_dir)
    start_epoch = checkpoints.restore(state) or 0
    if start_epoch:
        print(f"resumed from epoch {start_epoch} ({checkpoints.path(start_epoch)})")


# -----------------------------------------------------------------------------
# the step functions: each runs on every replica, on its chunk of the global batch

def train_step(x, y):
    logits = model(x)
    per_example_loss = F.cross_entropy(logits, y, reduction="none")
    loss = mirrored.compute_average_loss(per_example_loss)  # / global batch size
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()  # all-reduces the gradients, then steps this replica's copy
    correct = (logits.argmax(1) == y).float()
    return per_example_loss.detach(), correct


@torch.no_grad()
def eval_step(x, y):
    return (model(x).argmax(1) == y).float()


def epoch_mean(chunks):
    """Exact mean over an epoch of per-example values: each replica's chunks are
    concatenated, then MEAN over axis 0 divides by the true number of examples."""
    per_replica = mirrored.PerReplica([torch.cat(c) for c in zip(*chunks, strict=True)],
                                      devices=strategy.extended.worker_devices)
    return strategy.reduce("MEAN", per_replica, axis=0).item()


# -----------------------------------------------------------------------------
# training loop

for epoch in range(start_epoch, args.epochs):
    model.train()
    batches = global_batches(x_train, y_train, args.batch_size,
                             shuffle_seed=args.seed * 100_003 + epoch)
    first, skip = skip, 0  # a preempted epoch resumes at its next batch
    batches = batches[first:]
    dataset = strategy.experimental_distribute_dataset(batches)  # yields PerReplica (x, y)
    losses, hits = [], []
    bar = tqdm(dataset, total=len(batches), desc=f"epoch {epoch + 1}/{args.epochs}",
               file=sys.stderr, leave=False, disable=not chief)
    for x, y in bar:
        if preemption is not None:  # checks for a notice on any worker, then runs the step
            per_example_loss, correct = preemption.run(strategy.run, train_step, args=(x, y))
        else:
            per_example_loss, correct = strategy.run(train_step, args=(x, y))
        losses.append(strategy.experimental_local_results(per_example_loss))
        hits.append(strategy.experimental_local_results(correct))
        bar.set_postfix(loss=f"{strategy.reduce('MEAN', per_example_loss, axis=0).item():.4f}")
    bar.close()
    print(f"epoch {epoch + 1}/{args.epochs} loss {epoch_mean(losses):.4f} "
          f"accuracy {epoch_mean(hits):.4f}" + (f" (batches {first + 1}-)" if first else ""),
          flush=True)
    if preemption is not None:
        checkpoints.save(preemption.total_run_calls, state)  # numbered by steps
    elif checkpoints is not None:
        checkpoints.save(epoch + 1, state)
    if args.crash_after_epoch == epoch + 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT",
                                                              "0") == "0":
        sys.exit(f"crashing after epoch {epoch + 1} (--crash-after-epoch)")

# -----------------------------------------------------------------------------
# evaluation, also distributed (BatchNorm uses its running statistics)

model.eval()
test_batches = global_batches(x_test, y_test, args.batch_size)
test_hits = [strategy.experimental_local_results(strategy.run(eval_step, args=batch))
             for batch in strategy.experimental_distribute_dataset(test_batches)]
print(f"test accuracy: {epoch_mean(test_hits):.4f}")

if args.save_final is not None and chief:
    torch.save(model.state_dict(), args.save_final)
if preemption is not None:
    preemption.close()  # the previous SIGTERM handler is back
strategy.close()  # a multi-worker strategy also leaves the job
