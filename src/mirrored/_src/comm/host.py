"""Moving and combining tensors in this process: the data movers behind
`ReductionToOneDevice` (combine in replica order, copy, concatenate).

Large host outputs come from the buffer pool (`buffers`), which skips the
page-fault cost of a fresh allocation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..reduce_op import ReduceOp
from .buffers import default_pool

__all__ = ["CHUNKED_FROM", "CHUNK_BYTES", "DIRECT_BYTES", "combine", "combine_each", "concat",
           "copy_to"]

# Below this size a combine is all per-op dispatch: `combine_each` skips packing.
DIRECT_BYTES = 1 << 16
# Host combines of three parts or more, of at least CHUNKED_FROM chunks each, run in
# chunks of CHUNK_BYTES (`combine`): 2 MiB measured best on the 2-core machine (1.5-4
# MiB within 10 %, 1 and 8 MiB worse), each chunk's parts and result well inside its
# 32 MiB L3 cache. Smaller parts are in the cache anyway: chunks lost up to 1.5x at
# 4.5-8 MiB, broke even at 12.6-16 MiB and won from 16-25 MiB (0.67-0.91x at 25 MiB).
CHUNK_BYTES = 2 << 20
CHUNKED_FROM = 8  # chunks: 16 MiB parts
_COMBINE: dict[ReduceOp, Callable[..., torch.Tensor]] = {
    ReduceOp.SUM: torch.add, ReduceOp.MEAN: torch.add, ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum}


def _combine_into(out: torch.Tensor, parts: Sequence[torch.Tensor],
                  fn: Callable[..., torch.Tensor]) -> None:
    """``out = fn(fn(fn(p0, p1), p2), ...)``, element-wise, in this order (``fn``:
    ``torch.add``, ``torch.minimum`` or ``torch.maximum``).

    From three large host parts on (16 MiB each), chunk by chunk: each `CHUNK_BYTES`
    of ``out`` takes every part's contribution while it is in the cache, so memory carries
    each part once and ``out`` once, instead of ``out`` read and written again per
    part (4 x 64 MiB: 1.84x one ``torch.add`` of two parts, against 2.47x whole;
    8 x 64 MiB: 3.64x against 5.40x; see benchmarks/bench_core.py). Each element
    sees the same operations in the same order either way, so the results are
    bitwise the same. Otherwise (two parts, small ones, parts not contiguous or
    not of ``out``'s shape, GPU) one out-of-place op and in-place ones: per-op
    dispatch (which wakes torch's intra-op threads) is paid N - 1 times.
    """
    if len(parts) == 1:
        out.copy_(parts[0])
        return
    n = out.numel()
    step = CHUNK_BYTES // out.element_size()
    if (len(parts) == 2 or n < CHUNKED_FROM * step or not out.is_cpu
            or not all(p.is_contiguous() and p.shape == out.shape for p in parts)):
        fn(parts[0], parts[1], out=out)
        for p in parts[2:]:
            fn(out, p, out=out)
        return
    flat = out.view(-1)
    first, second, *rest = [p.view(-1) for p in parts]
    for a in range(0, n, step):
        b = a + step
        chunk = flat[a:b]
        fn(first[a:b], second[a:b], out=chunk)
        for p in rest:
            fn(chunk, p[a:b], out=chunk)


def combine(op: ReduceOp, parts: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Element-wise SUM, MIN or MAX of equally shaped parts, in order, into a new tensor
    on ``device``.

    Example:
        >>> import torch
        >>> combine(ReduceOp.MAX, [torch.tensor([1, 5]), torch.tensor([3, 2])],
        ...         torch.device("cpu"))
        tensor([3, 5])
    """
    parts = [p if p.device == device else p.to(device) for p in parts]
    first = parts[0]
    out = default_pool().empty(tuple(first.shape), first.dtype, device)
    _combine_into(out, parts, _COMBINE[op])
    return out


def combine_each(op: ReduceOp, parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`combine` of small, contiguous, equally shaped tensors on one device, plus a copy
    of the result per further part: one new tensor per part, bitwise equal to what
    `combine` and `copy_to` give (the same kernels in the same order), in two ops for
    two parts instead of a pack, a pooled output and views.

    Example:
        >>> combine_each(ReduceOp.SUM, [torch.tensor([1, 5]), torch.tensor([3, 2])])
        [tensor([4, 7]), tensor([4, 7])]
    """
    first = parts[0]
    if len(parts) == 1:
        total = first.clone()
    elif op is ReduceOp.SUM or op is ReduceOp.MEAN:
        total = torch.add(first, parts[1])
        for p in parts[2:]:
            total.add_(p)
    else:
        fn = torch.minimum if op is ReduceOp.MIN else torch.maximum
        total = fn(first, parts[1])
        for p in parts[2:]:
            fn(total, p, out=total)
    return [total, *[total.clone() for _ in parts[1:]]]


def copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new copy of ``tensor`` on ``device`` (large host copies reuse pooled buffers)."""
    out = default_pool().empty(tuple(tensor.shape), tensor.dtype, device)
    return out.copy_(tensor)


def concat(parts: Sequence[torch.Tensor], dim: int, device: torch.device) -> torch.Tensor:
    """A new concatenation of ``parts`` along ``dim`` on ``device``."""
    parts = [p if p.device == device else p.to(device) for p in parts]
    shape = list(parts[0].shape)
    shape[dim] = sum(p.shape[dim] for p in parts)
    out = default_pool().empty(tuple(shape), parts[0].dtype, device)
    return torch.cat(parts, dim=dim, out=out)
