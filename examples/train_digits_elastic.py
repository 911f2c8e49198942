"""Train a small CNN on scikit-learn's digits with elastic data parallelism: the mirrored
loop on `mirrored.elastic.ElasticMirroredStrategy` (torchft underneath). A worker that
dies is left out of the next step; one started again rejoins with a healthy peer's
state; the others never restart.

    torchft_lighthouse --min_replicas 2 --bind 127.0.0.1:29510 --join_timeout_ms 1000 &
    for i in 0 1 2; do
        python examples/train_digits_elastic.py --worker-index $i --num-workers 3 &
    done
    kill -9 %3                                            # lose worker 1: the others go on
    python examples/train_digits_elastic.py --worker-index 1 --num-workers 3  # rejoins

Each worker has `--replicas` local CPU replicas. Step s trains global batch s (a
function of the step, so a rejoining worker finds its batch); the batch is split over
the job's `num_workers x replicas` replicas, a missing worker's rows are skipped in
that step, and `compute_average_loss` divides by the examples actually combined.
BatchNorm normalizes with the statistics of the live replicas (`sync_batch_norm`).

stdout: every 20 steps `step 40 workers 3 loss 0.1234`, then `test accuracy: 0.9xxx`.
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import mirrored
from mirrored import elastic

# -----------------------------------------------------------------------------
# configuration

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--worker-index", type=int, required=True,
                    help="this worker's place in the job (a restart reuses it)")
parser.add_argument("--num-workers", type=int, default=3, help="the job's nominal size")
parser.add_argument("--replicas", type=int, default=2, help="local CPU replicas per worker")
parser.add_argument("--lighthouse", default="http://127.0.0.1:29510")
parser.add_argument("--min-workers", type=int, default=2)
parser.add_argument("--steps", type=int, default=300)
parser.add_argument("--batch-size", type=int, default=96, help="global batch size")
parser.add_argument("--lr", type=float, default=0.05)
args = parser.parse_args()
torch.set_num_threads(1)

# -----------------------------------------------------------------------------
# data: 1797 8x8 grey images bundled with scikit-learn (no download)

digits = load_digits()
images = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)  # [N, 1, 8, 8]
labels = torch.tensor(digits.target, dtype=torch.int64)
split = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
x_train, y_train = images[split[:1437]], labels[split[:1437]]
x_test, y_test = images[split[1437:]], labels[split[1437:]]


def global_batches():
    """The whole training as one iterable: element s is the global batch of step s."""
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        idx = torch.randint(len(y_train), (args.batch_size,), generator=g)
        yield x_train[idx], y_train[idx]


# -----------------------------------------------------------------------------
# strategy, model, optimizer: the mirrored ones

strategy = elastic.ElasticMirroredStrategy(
    args.lighthouse, worker_index=args.worker_index, num_workers=args.num_workers,
    devices=[f"CPU:{i}" for i in range(args.replicas)], min_workers=args.min_workers)
torch.manual_seed(0)  # (the first step gives every worker the first one's values anyway)
net = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.SiLU(),
    nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.SiLU(),
    nn.AvgPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.SiLU(), nn.Linear(64, 10),
)
with strategy.scope():
    model = strategy.mirror(net, sync_batch_norm=True)
    optimizer = strategy.mirror_optimizer(
        model, lambda params: torch.optim.SGD(params, lr=args.lr, momentum=0.9))
dataset = strategy.experimental_distribute_dataset(global_batches())


def train_step(x, y):
    loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
    loss.backward()
    optimizer.step()  # all-reduce, then torchft's commit vote: every live worker or none
    optimizer.zero_grad()
    return loss


# -----------------------------------------------------------------------------
# training loop: a quorum per step, taken with the batch

for x, y in dataset:
    step = strategy.elastic.step  # the job's step (a rejoining worker starts at the job's)
    loss = strategy.reduce("SUM", strategy.run(train_step, args=(x, y)))
    committed = strategy.elastic.step == step + 1  # else: the same batch comes again
    if committed and step % 20 == 0:
        print(f"step {step} workers {strategy.elastic.num_workers} loss {loss.item():.4f}",
              flush=True)

model.eval()
with torch.no_grad():
    accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
print(f"test accuracy: {accuracy:.4f}")
strategy.close()
