"""`host.combine` of three or more large host parts runs chunk by chunk: bitwise the
result of the whole-tensor ops in replica order (special values included), for
every op and dtype, and the whole-tensor path where chunks do not apply."""

from __future__ import annotations

import pytest
import torch

from mirrored._src.comm import host
from mirrored._src.reduce_op import ReduceOp

CPU = torch.device("cpu")
FOLD = {ReduceOp.SUM: torch.add, ReduceOp.MEAN: torch.add, ReduceOp.MIN: torch.minimum,
        ReduceOp.MAX: torch.maximum}


def _parts(n: int, numel: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        parts = [(torch.randn(numel, generator=g) * 1e3).to(dtype) for _ in range(n)]
        special = torch.tensor([-0.0, 0.0, float("nan"), float("inf"), -float("inf"), 1e-30],
                               dtype=dtype)
        for r, p in enumerate(parts):  # signed zeros, NaN and infinities in every part
            p[r:r + len(special)] = special.roll(r)
            p[-1] = -0.0  # an element whose every part is -0.0 sums to -0.0
        return parts
    return [torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype) for _ in range(n)]


def _reference(op: ReduceOp, parts: list[torch.Tensor]) -> torch.Tensor:
    expected = FOLD[op](parts[0], parts[1])
    for p in parts[2:]:
        expected = FOLD[op](expected, p)
    return expected


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _counting(monkeypatch, op: ReduceOp) -> list[int]:
    """Counts the combine's element-wise ops of ``op`` (one per chunk and part)."""
    calls: list[int] = []
    fold = FOLD[op]

    def counting(*args, **kwargs):
        calls.append(1)
        return fold(*args, **kwargs)

    monkeypatch.setitem(host._COMBINE, op, counting)
    return calls


@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.MEAN, ReduceOp.MIN, ReduceOp.MAX])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("n", [3, 4, 8])
def test_chunked_combine_is_bitwise_the_whole_ops_in_order(monkeypatch, op, dtype, n):
    monkeypatch.setattr(host, "CHUNK_BYTES", 64)  # many chunks, a partial last one
    numel = 1000 + n  # not a multiple of the chunk
    parts = _parts(n, numel, dtype, seed=n)
    calls = _counting(monkeypatch, op)
    got = host.combine(op, parts, CPU)
    chunk = 64 // parts[0].element_size()
    assert len(calls) == -(-numel // chunk) * (n - 1)  # the chunked path ran
    assert torch.equal(_bits(got), _bits(_reference(op, parts)))


def test_chunked_sum_keeps_the_sign_of_an_all_negative_zero(monkeypatch):
    monkeypatch.setattr(host, "CHUNK_BYTES", 16)
    calls = _counting(monkeypatch, ReduceOp.SUM)
    parts = [torch.full((64,), -0.0) for _ in range(3)]
    got = host.combine(ReduceOp.SUM, parts, CPU)
    assert len(calls) == 16 * 2  # in chunks of 4 floats
    assert torch.equal(_bits(got), _bits(torch.full((64,), -0.0)))


def test_parts_of_another_shape_keep_the_whole_tensor_ops(monkeypatch):
    monkeypatch.setattr(host, "CHUNK_BYTES", 64)
    g = torch.Generator().manual_seed(3)
    same_size = [torch.randn(32, 32, generator=g), torch.randn(32, 32, generator=g),
                 torch.randn(16, 64, generator=g)]
    with pytest.raises(RuntimeError, match="size"):  # not summed as flat buffers
        host.combine(ReduceOp.SUM, same_size, CPU)
    broadcast = [torch.randn(1024, generator=g), torch.randn(1, generator=g),
                 torch.randn(1024, generator=g)]
    got = host.combine(ReduceOp.SUM, broadcast, CPU)
    assert torch.equal(got, _reference(ReduceOp.SUM, broadcast))


@pytest.mark.parametrize("case", ["two parts", "small", "non-contiguous"])
def test_whole_tensor_path_where_chunks_do_not_apply(monkeypatch, case):
    monkeypatch.setattr(host, "CHUNK_BYTES", 64)
    g = torch.Generator().manual_seed(7)
    if case == "two parts":
        parts = [torch.randn(1000, generator=g) for _ in range(2)]
    elif case == "small":  # under CHUNKED_FROM chunks
        parts = [torch.randn(20, generator=g) for _ in range(4)]
    else:
        parts = [torch.randn(40, 50, generator=g).t() for _ in range(4)]
    calls = _counting(monkeypatch, ReduceOp.SUM)
    got = host.combine(ReduceOp.SUM, parts, CPU)
    assert len(calls) == len(parts) - 1  # one op per part after the first
    assert torch.equal(got, _reference(ReduceOp.SUM, parts))
    assert got.shape == parts[0].shape


def test_large_reduce_through_the_strategy_equals_the_fold(monkeypatch):
    import mirrored

    monkeypatch.setattr(host, "CHUNK_BYTES", 4096)
    calls = _counting(monkeypatch, ReduceOp.SUM)
    numel = 40_000  # above the direct-combine size
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(4)])
    try:
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: torch.arange(numel, dtype=torch.float32)
            * (ctx.replica_id_in_sync_group + 1) / 7)
        got = strategy.reduce("SUM", values, axis=None)
    finally:
        strategy.close()
    parts = [torch.arange(numel, dtype=torch.float32) * (r + 1) / 7 for r in range(4)]
    assert torch.equal(got, _reference(ReduceOp.SUM, parts))
    assert len(calls) == -(-numel // 1024) * 3  # in chunks of 1024 floats


@pytest.mark.parametrize("chunks", [host.CHUNKED_FROM - 1, host.CHUNKED_FROM])
def test_chunks_start_at_chunked_from_chunks_per_part(monkeypatch, chunks):
    # Parts that fit the cache anyway are summed whole (chunks only add dispatch).
    monkeypatch.setattr(host, "CHUNK_BYTES", 64)
    calls = _counting(monkeypatch, ReduceOp.SUM)
    parts = _parts(3, chunks * 16, torch.float32, seed=chunks)
    got = host.combine(ReduceOp.SUM, parts, CPU)
    assert len(calls) == (2 * chunks if chunks >= host.CHUNKED_FROM else 2)
    assert torch.equal(_bits(got), _bits(_reference(ReduceOp.SUM, parts)))
