"""The SUM of two workers on Gloo as one exchange: each worker sends its whole buffer
to the other (one ``all_to_all_single``), then adds the two in rank order, in place.

Gloo's ring all-reduce takes several round trips and thread hand-offs for one call;
between two processes on one host a 336 KiB all-reduce took about 1 ms where the
exchange took 0.33 ms, and at 64 MiB the exchange took 0.9-1.0x the all-reduce's time
(`benchmarks/bench_multi_worker.py` measures both). The bytes sent are the same: on
two workers the ring sends half the buffer each way twice.

The result is bitwise the all-reduce's: on two workers each element is one addition
of the two workers' values (half and bfloat16 added in float32 and rounded once, as
Gloo adds them). Only a NaN's bits may differ (an ``inf + -inf`` in bfloat16: Gloo's
rounding keeps float32's sign of the NaN): a NaN either way. Both workers compute
``worker 0's + worker 1's``, so they agree bit for bit, NaNs included. The choice
depends only on what every worker agrees on (the call's kind and dtype, the job's
backend and size), so every worker makes the same collective.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from .buffers import default_pool

__all__ = ["EXCHANGED", "Exchange", "pair_exchange"]

# The dtypes whose SUM the exchange computes exactly as Gloo's all-reduce does
# (tests/test_exchange.py compares them bitwise); others keep the all-reduce.
EXCHANGED = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16,
                       torch.int32, torch.int64})


class Exchange:
    """A launched exchange: waits like the collective's work, and leaves the sum in
    ``buffer`` once a wait succeeds (as an in-place all-reduce would)."""

    __slots__ = ("_buffer", "_first", "_peer", "_work")

    def __init__(self, work: Any, buffer: torch.Tensor, peer: torch.Tensor,
                 first: bool) -> None:
        self._work: Any = work
        self._buffer = buffer
        self._peer: torch.Tensor | None = peer
        self._first = first  # this worker is worker 0: its values come first

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Waits for the peer's buffer (raises as the work's wait does), then adds it."""
        if self._peer is None:
            return True
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        if done is False:
            return False
        peer, self._peer = self._peer, None
        if self._first:
            torch.add(self._buffer, peer, out=self._buffer)
        else:
            torch.add(peer, self._buffer, out=self._buffer)
        self._work = None  # (it holds both buffers: the peer's goes back to the pool)
        return True

    def is_completed(self) -> bool:
        return self._peer is None or bool(self._work.is_completed())

    def get_future(self) -> torch.futures.Future[Any]:
        """The transfer's future (completed when the peer's buffer is here; the sum
        is made by the first successful `wait`)."""
        if self._work is not None:
            return self._work.get_future()  # type: ignore[no-any-return]
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(None)
        return done


def pair_exchange(group: Any, world: int, host: bool) -> Any:
    """A function that launches the exchange of a flat buffer (-> `Exchange`), where
    it replaces the all-reduce (SUM): two workers, host buffers, a Gloo group; else
    ``None``.

    Example:
        >>> pair_exchange(None, world=3, host=True) is None
        True
    """
    if world != 2 or not host:
        return None
    try:
        backend = str(dist.get_backend(group))
        rank = dist.get_rank(group)
    except (RuntimeError, ValueError):
        return None
    if backend != "gloo":
        return None
    pool = default_pool()
    first = rank == 0

    def launch(buffer: torch.Tensor) -> Exchange:
        n = buffer.numel()
        splits = [0, n] if first else [n, 0]  # (nothing to itself, all to the peer)
        peer = pool.empty(tuple(buffer.shape), buffer.dtype, buffer.device)
        work = dist.all_to_all_single(peer.view(-1), buffer.reshape(-1), splits, splits,
                                      group=group, async_op=True)
        return Exchange(work, buffer, peer, first)
    return launch
