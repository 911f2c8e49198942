"""The seed example (TF's MirroredStrategy.reduce documentation) and the partial batch."""

import pytest
import torch

import mirrored


def test_seed_example():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])

    def step_fn():
        i = mirrored.get_replica_context().replica_id_in_sync_group
        return torch.tensor(i)

    per_replica_result = strategy.run(step_fn)
    total = strategy.reduce("SUM", per_replica_result, axis=None)
    assert total.dtype == torch.int64
    assert torch.equal(total, torch.tensor(1))
    assert total.device == torch.device("cpu")
    local = strategy.experimental_local_results(per_replica_result)
    assert [t.item() for t in local] == [0, 1]
    assert per_replica_result.devices == ("/job:localhost/replica:0/task:0/device:CPU:0",
                                          "/job:localhost/replica:0/task:0/device:CPU:1")
    assert all(t.device == torch.device("cpu") for t in local)


def test_partial_batch_mean():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    v = mirrored.PerReplica([torch.tensor([0.0, 1, 2, 3]), torch.tensor([4.0, 5])])
    assert strategy.reduce("MEAN", v, axis=0).item() == 2.5
    with pytest.raises(ValueError, match=r"float32\[4\].*float32\[2\].*axis=0"):
        strategy.reduce("MEAN", v, axis=None)
