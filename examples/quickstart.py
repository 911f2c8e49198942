"""Quick start: the seed example of `strategy.reduce` and the partial-batch MEAN.

Runs on any machine: two logical CPU replicas ("CPU:0", "CPU:1") share the host CPU.
"""

import torch

import mirrored

strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
print(f"strategy: {strategy}, {strategy.num_replicas_in_sync} replicas in sync")


# The seed example: each replica returns its id; SUM reduces them on the host.
def step_fn():
    i = mirrored.get_replica_context().replica_id_in_sync_group
    return torch.tensor(i)


per_replica_result = strategy.run(step_fn)
print(f"per-replica result: {per_replica_result}")
for result, device in zip(strategy.experimental_local_results(per_replica_result),
                          per_replica_result.devices, strict=True):
    print(f"  {result!r} on {device}")

total = strategy.reduce("SUM", per_replica_result, axis=None)
print(f"reduce(SUM, axis=None) = {total!r} on {total.device} (the host CPU)")

# A partial last batch of 6 examples split 4 + 2: MEAN over axis 0 is the mean of
# all 6 examples (15 / 6 = 2.5), not the mean of the two replicas' means (3.0).
per_example = mirrored.PerReplica([torch.tensor([0.0, 1, 2, 3]), torch.tensor([4.0, 5])],
                                  devices=strategy.extended.worker_devices)
mean = strategy.reduce("MEAN", per_example, axis=0)
print(f"partial batch {per_example}: reduce(MEAN, axis=0) = {mean.item()}")
try:
    strategy.reduce("MEAN", per_example, axis=None)
except ValueError as error:
    print(f"reduce(MEAN, axis=None) raises ValueError: {error}")

# Inside a step, replicas combine values with all_reduce; with axis=0 the MEAN
# is exact over uneven per-replica batches, and each replica gets its own copy.
batches = [torch.tensor([0.0, 1, 2, 3]), torch.tensor([4.0, 5])]


def mean_step():
    ctx = mirrored.get_replica_context()
    return ctx.all_reduce("MEAN", batches[ctx.replica_id_in_sync_group], axis=0)


print(f"all_reduce(MEAN, axis=0) in each replica: {strategy.run(mean_step)}")
