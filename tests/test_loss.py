"""compute_average_loss: exact single-device means over uneven and empty batches."""

import math

import pytest
import torch

import mirrored


@pytest.mark.parametrize("sizes", [[4, 4], [3, 2], [2, 2, 2, 0], [0, 5], [1]])
def test_matches_single_device_mean(strategies, sizes):
    strategy = strategies[len(sizes)]
    gen = torch.Generator().manual_seed(sum(sizes))
    batch = torch.randn(sum(sizes), generator=gen)
    chunks = list(torch.split(batch, sizes))
    per_replica = mirrored.PerReplica(chunks) if len(sizes) > 1 else chunks[0]
    losses = strategy.run(mirrored.compute_average_loss, args=(per_replica,))
    total = strategy.reduce("SUM", losses) if len(sizes) > 1 else losses
    torch.testing.assert_close(total, batch.mean())


def test_given_global_batch_size(two):
    v = mirrored.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    out = two.run(lambda x: mirrored.compute_average_loss(x, global_batch_size=4), args=(v,))
    assert [t.item() for t in out.values] == [0.75, 0.75]


def test_gradients_match_single_device(two):
    w = torch.tensor(2.0)
    data = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0])]

    def step(x):
        weight = w.clone().requires_grad_(True)
        loss = mirrored.compute_average_loss((weight * x) ** 2)
        loss.backward()
        return weight.grad

    grads = two.run(step, args=(mirrored.PerReplica(data),))
    weight = w.clone().requires_grad_(True)
    ((weight * torch.cat(data)) ** 2).mean().backward()
    torch.testing.assert_close(sum(grads.values), weight.grad)


def test_all_empty_is_nan(two):
    v = mirrored.PerReplica([torch.zeros(0), torch.zeros(0)])
    out = two.run(mirrored.compute_average_loss, args=(v,))
    assert all(math.isnan(t.item()) for t in out.values)


def test_errors(two):
    with pytest.raises(ValueError, match=r"expects per-example losses with a batch dimension; "
                                         r"got a rank-0 tensor"):
        two.run(mirrored.compute_average_loss, args=(torch.tensor(1.0),))
    with pytest.raises(ValueError, match=r"global_batch_size must be a positive integer"):
        two.run(lambda: mirrored.compute_average_loss(torch.ones(2), global_batch_size=0))
    with two.scope(), pytest.raises(RuntimeError, match=r"must be called in replica context"):
        mirrored.compute_average_loss(torch.ones(2))


def test_outside_any_strategy_is_the_local_mean():
    assert mirrored.compute_average_loss(torch.tensor([1.0, 3.0])).item() == 2.0


def test_global_batch_size_accepts_integer_types(two):
    import numpy as np

    v = mirrored.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    for size in [4, np.int64(4), torch.tensor(4)]:
        out = two.run(lambda x, s=size: mirrored.compute_average_loss(x, global_batch_size=s),
                      args=(v,))
        assert [t.item() for t in out.values] == [0.75, 0.75]
    with pytest.raises(ValueError, match=r"positive integer"):
        two.run(lambda: mirrored.compute_average_loss(torch.ones(1), global_batch_size=2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_replica_divides_by_the_exact_global_count(two, dtype):
    # The count travels as plain ints; each replica's share is bitwise its local sum
    # divided by the global count as a tensor of the loss's dtype.
    gen = torch.Generator().manual_seed(7)
    chunks = [torch.randn(5, generator=gen, dtype=dtype), torch.randn(2, generator=gen,
                                                                     dtype=dtype)]
    out = two.run(mirrored.compute_average_loss, args=(mirrored.PerReplica(chunks),))
    for got, chunk in zip(out.values, chunks, strict=True):
        assert got.dtype == dtype
        assert torch.equal(got, chunk.sum() / torch.tensor(7, dtype=dtype))



def test_half_precision_divides_by_the_exact_count(two):
    # 1001 examples: bfloat16 cannot hold the count (it rounds to 1000); the divisor
    # stays the exact int (the loss keeps its dtype; the quotient is rounded once).
    gen = torch.Generator().manual_seed(3)
    chunks = [torch.rand(501, generator=gen).to(torch.bfloat16),
              torch.rand(500, generator=gen).to(torch.bfloat16)]
    out = two.run(mirrored.compute_average_loss, args=(mirrored.PerReplica(chunks),))
    for got, chunk in zip(out.values, chunks, strict=True):
        assert got.dtype == torch.bfloat16
        # the quotient computed in float32 (bfloat16's op math) by 1001, then rounded
        assert torch.equal(got, (chunk.sum().float() / 1001).to(torch.bfloat16))
