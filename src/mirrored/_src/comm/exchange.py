"""The SUM of two workers on Gloo as one exchange: each worker sends its whole buffer
to the other (one ``all_to_all_single``), then adds the two in rank order, in place.

Gloo's ring all-reduce takes several round trips and thread hand-offs for one call;
between two processes on one host a 336 KiB all-reduce took about 1 ms where the
exchange took 0.33 ms, and at 64 MiB the exchange took 0.9-1.0x the all-reduce's time
(`benchmarks/bench_multi_worker.py` measures both). The bytes sent are the same: on
two workers the ring sends half the buffer each way twice.

The result is bitwise the all-reduce's: on two workers each element is one addition
of the two workers' values (half and bfloat16 added in float32 and rounded once, as
Gloo adds them). Only a NaN's own bits may differ: an ``inf + -inf`` in bfloat16 or
float16 gives a NaN whose bits depend on whether torch's vectorised loop or its scalar
tail made it (and where the tail starts depends on the worker's thread count), so two
workers may hold NaNs of different bits there, where Gloo sent both the same; a NaN
either way. Both workers compute ``worker 0's + worker 1's``. The choice
depends only on what every worker agrees on (the call's kind and dtype, the job's
backend and size), so every worker makes the same collective.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from .buffers import default_pool

__all__ = ["EXCHANGED", "Exchange", "Pair", "pair_exchange"]

# The dtypes whose SUM the exchange computes exactly as Gloo's all-reduce does
# (tests/test_exchange.py compares them bitwise); others keep the all-reduce.
EXCHANGED = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16,
                       torch.int32, torch.int64})


class Exchange:
    """A launched exchange: waits like the collective's work, and leaves the sum in
    ``buffer`` once a wait succeeds (as an in-place all-reduce would)."""

    __slots__ = ("_buffer", "_first", "_mine", "_peer", "_work")

    def __init__(self, work: Any, buffer: torch.Tensor, peer: torch.Tensor,
                 first: bool, mine: torch.Tensor) -> None:
        self._work: Any = work
        self._buffer = buffer
        self._mine: torch.Tensor | None = mine  # what this worker sent (``buffer``'s)
        self._peer: torch.Tensor | None = peer
        self._first = first  # this worker is worker 0: its values come first

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Waits for the peer's buffer (raises as the work's wait does), then adds it."""
        peer, mine = self._peer, self._mine
        if peer is None or mine is None:
            return True
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        if done is False:
            return False
        # Detached, as the all-reduce writes: a buffer with autograd history (the copy
        # of an input that requires grad) keeps the copy's history, and the add is
        # never refused for it. Done before anything is forgotten: a failed add leaves
        # the work unfinished, so every later wait raises again.
        with torch.no_grad():
            first, second = (mine, peer) if self._first else (peer, mine)
            torch.add(first.detach(), second, out=self._buffer.detach())
        self._peer = self._mine = None
        self._work = None  # (it holds both buffers: the peer's goes back to the pool)
        return True

    def is_completed(self) -> bool:
        """Whether the transfer is done (the sum is made by the next `wait`)."""
        return self._peer is None or bool(self._work.is_completed())

    def get_future(self) -> torch.futures.Future[Any]:
        """The transfer's future (completed when the peer's buffer is here; the sum
        is made by the first successful `wait`)."""
        if self._work is not None:
            return self._work.get_future()  # type: ignore[no-any-return]
        done: torch.futures.Future[Any] = torch.futures.Future()
        done.set_result(None)
        return done


class Pair:
    """The SUM of a two-worker Gloo group as an exchange (`sum`): one
    ``all_to_all_single`` launched straight on the process group
    (``dist.all_to_all_single`` less its per-call checks).

    Only SUMs are exchanged. A header's all-gather stays Gloo's ``all_gather``: Gloo
    matches messages by collective and call number, so a worker whose call meets
    another call of its peer (a launched gradient bucket against a header) must not
    meet it in the same collective, where a message larger than the receiver's
    buffer ends the process (Gloo's "Received data size doesn't match expected
    size"); a SUM meets a SUM only with sizes the workers agreed on."""

    def __init__(self, group: Any, rank: int) -> None:
        self._group = group
        self._rank = rank
        self._pool = default_pool()
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        self._direct = getattr(pg, "all_to_all_single", None) or getattr(pg, "alltoall_base",
                                                                         None)
        self._options = dist.AllToAllOptions()
        if hasattr(self._options, "asyncOp"):
            self._options.asyncOp = True

    def _launch(self, out: torch.Tensor, mine: torch.Tensor) -> Any:
        """Sends flat ``mine`` to the peer and receives the peer's into flat ``out``."""
        n = mine.numel()
        splits = [0, n] if self._rank == 0 else [n, 0]  # (nothing to itself)
        if self._direct is not None:
            return self._direct(out, mine, splits, splits, self._options)
        return dist.all_to_all_single(out, mine, splits, splits, group=self._group,
                                      async_op=True)

    def sum(self, buffer: torch.Tensor, source: torch.Tensor | None = None) -> Exchange:
        """Launches the SUM of ``buffer``'s values, or of ``source``'s (as many, of
        its dtype and device: sent as they are, no copy into ``buffer`` first); the
        returned work's wait leaves the sum in ``buffer``."""
        mine = buffer if source is None else source
        peer = self._pool.empty(tuple(buffer.shape), buffer.dtype, buffer.device)
        work = self._launch(peer.view(-1), mine.reshape(-1))
        return Exchange(work, buffer, peer, self._rank == 0, mine.view(buffer.shape))


def pair_exchange(group: Any, world: int, host: bool) -> Pair | None:
    """The `Pair` of a group where an exchange replaces the all-reduce (SUM): two
    workers, host buffers, Gloo; else ``None``.

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
    return Pair(group, rank) if backend == "gloo" else None
