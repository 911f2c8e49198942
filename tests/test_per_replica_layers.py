"""Layers that would train per replica, or cannot be copied, are refused by mirror
before any copy is made (review findings: a torch.nn.SyncBatchNorm left in from DDP
code normalized each replica's batch alone, silently; a LazyBatchNorm failed inside
deepcopy with torch's own message)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mirrored

pytestmark = pytest.mark.timeout(60)


def test_a_ddp_sync_batch_norm_needs_sync_batch_norm_true() -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    torch.manual_seed(0)
    net = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(3, 4),
                                                                nn.BatchNorm1d(4)))
    with pytest.raises(ValueError, match=r"torch.nn.SyncBatchNorm .*Pass sync_batch_norm=True"):
        strategy.mirror(net)
    model = strategy.mirror(net, sync_batch_norm=True)  # the global batch's statistics
    x = torch.randn(8, 3)
    halves = mirrored.PerReplica([x[:5], x[5:]])
    out = strategy.gather(strategy.run(model, args=(halves,)), axis=0)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    torch.testing.assert_close(out, plain(x), rtol=1e-5, atol=1e-6)


def test_a_lazy_batch_norm_is_refused_naming_the_fix() -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    with pytest.raises(ValueError, match=r"LazyBatchNorm1d\) is a lazy layer.*forward pass"):
        strategy.mirror(nn.Sequential(nn.Linear(3, 4), nn.LazyBatchNorm1d()))
    initialized = nn.Sequential(nn.Linear(3, 4), nn.LazyBatchNorm1d())
    initialized(torch.randn(2, 3))  # one forward: the sizes are known
    strategy.mirror(initialized)
    assert isinstance(mirrored.MirroredStrategy(["CPU:0"]).mirror(
        nn.LazyBatchNorm1d()), nn.Module)  # (one replica: no copy to make)
