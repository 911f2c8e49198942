"""Train a small CNN on scikit-learn's digits with elastic data parallelism (torchft):
a worker that dies is left out of the next step, and one started again rejoins with a
healthy peer's state; the others never restart.

    torchft_lighthouse --min_replicas 2 --bind 127.0.0.1:29510 --join_timeout_ms 1000 &
    for i in 0 1 2; do
        python examples/train_digits_elastic.py --worker-id w$i &   # 3 workers
    done
    kill -9 %2                                             # lose one: the others go on
    python examples/train_digits_elastic.py --worker-id w1   # it rejoins at a step boundary

Every step has one global batch (a function of the step, so every worker picks the
same one); the workers in the step split it (`StepInfo.shard`), divide their summed
loss by the global batch size, and `finish_step` sums the gradients over them: a
step's gradient is that of the whole global batch, however many workers are alive.

stdout: every 20 steps `step 40 workers 3 loss 0.1234`, then `test accuracy: 0.9xxx`.
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from mirrored import elastic

# -----------------------------------------------------------------------------
# configuration

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--worker-id", required=True, help="this worker's name (reuse it on restart)")
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


def global_batch(step):
    """The global batch of a step: the same on every worker, whenever it asks."""
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(len(y_train), (args.batch_size,), generator=g)
    return x_train[idx], y_train[idx]


# -----------------------------------------------------------------------------
# model (GroupNorm: BatchNorm statistics would differ between workers), optimizer

torch.manual_seed(0)  # (step 0 copies the first worker's values to all anyway)
model = nn.Sequential(
    nn.Conv2d(1, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
    nn.Conv2d(16, 32, 3, padding=1), nn.GroupNorm(8, 32), nn.SiLU(),
    nn.AvgPool2d(2), nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.SiLU(), nn.Linear(64, 10),
)
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
trainer = elastic.ElasticTrainer(model, optimizer, lighthouse_address=args.lighthouse,
                                 worker_id=args.worker_id, min_workers=args.min_workers)

# -----------------------------------------------------------------------------
# training loop: one quorum per step

while trainer.step < args.steps:
    info = trainer.start_step()  # who is in this step; a rejoining worker catches up here
    x, y = info.shard(global_batch(info.index))
    loss = F.cross_entropy(model(x), y, reduction="sum") / args.batch_size
    loss.backward()
    committed = trainer.finish_step()  # sum over the step's workers, then optimizer.step()
    if committed and info.index % 20 == 0:
        print(f"step {info.index} workers {info.num_workers} loss "
              f"{loss.item() * info.num_workers:.4f}", flush=True)  # ~ the global mean

with torch.no_grad():
    accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
print(f"test accuracy: {accuracy:.4f}")
trainer.close()
