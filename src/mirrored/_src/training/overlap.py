"""`GradientBuckets`: gradients all-reduced while backward runs.

The parameters are grouped into buckets in reverse order (the order backward
produces their gradients, as DDP's reducer starts), one dtype and device per
bucket. A post-accumulate-grad hook on every parameter of every local replica
counts the gradients in; when a bucket holds every local replica's gradients, the
replica thread that completed it packs them, sums them in replica order (the
step's own local sum) and launches the bucket's all-reduce: across workers an
asynchronous ``torch.distributed`` call that runs while backward goes on. Buckets
are launched strictly in order; the parameters a replica's backward pass will not
reach count in as zeros when it starts (`premark`), and any gradient still missing
when it ends does, so every worker makes the same calls in the same order before
``backward()`` returns, a bucket completing at the same point of backward on all.
The last bucket is not launched ahead: it rides in the step's all-reduce
with the presence flags, fingerprints, BatchNorm statistics and buffers, so a
model of one bucket makes exactly the calls it makes without overlap.
``step()`` waits for the others (`GradientReducer`).

Exactness: each element is the same sum of the same values as without buckets
(the local sum in replica order, then one cross-worker SUM). A second backward
before ``step()`` (gradient accumulation) would make launched buckets stale: the
hooks see it, the step's all-reduce tells every worker, and the step all-reduces
the gradients again as without overlap; the next steps then launch at ``step()``
(every worker decides alike from the same sums) until a step has one backward.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.autograd import Variable

from ..comm import packing
from ..reduce_op import ReduceOp

__all__ = ["DEFAULT_BUCKET_BYTES", "Finished", "GradientBuckets", "Pending", "bucket_plan",
           "hidden_time"]

# Each bucket is one more round trip, paid in CPU even when hidden: a model with fewer
# gradient bytes than this is one bucket, which the reducer sends as without overlap
# (the last bucket always rides in the step's all-reduce). DDP's bucket size (its
# ``bucket_cap_mb=25``): 4 MiB buckets made a 12.6 MiB model 0.88-1.00x DDP against
# 1.05-1.21x in one bucket on a quiet 2-worker machine. See docs/design.md.
DEFAULT_BUCKET_BYTES = 25 << 20


class Pending(Protocol):
    """A launched bucket: ``works`` (asynchronous collectives, possibly none)."""

    works: list[Any]


class AsyncSum(Protocol):
    """What the buckets need from a communicator (`DistributedCommunicator`)."""

    def overlaps(self, dtype: torch.dtype) -> bool: ...

    def launch_sum(self, what: str, flats: Sequence[torch.Tensor], *, sync: bool
                   ) -> Pending: ...

    def finish_sum(self, pending: Pending) -> list[torch.Tensor]: ...


class _Done:
    """A bucket reduced at once (in-process replicas): nothing to wait for."""

    def __init__(self, copies: list[torch.Tensor]) -> None:
        self.works: list[Any] = []
        self.copies = copies


class _LocalSum:
    """In-process replicas: the bucket's sum is made by the launching thread."""

    def __init__(self, communicator: Any, devices: tuple[Any, ...]) -> None:
        self._comm = communicator
        self._devices = devices

    def overlaps(self, dtype: torch.dtype) -> bool:
        return True

    def launch_sum(self, what: str, flats: Sequence[torch.Tensor], *, sync: bool) -> Pending:
        reduced = self._comm.reduce_packed(ReduceOp.SUM, [[f] for f in flats],
                                           [self._devices], 0)
        return _Done(list(reduced[0]))

    def finish_sum(self, pending: Pending) -> list[torch.Tensor]:
        assert isinstance(pending, _Done)  # made by launch_sum
        return pending.copies


def bucket_plan(params: Sequence[nn.Parameter], bucket_bytes: int) -> list[list[int]]:
    """Parameter indices grouped into buckets, last parameter first; a bucket holds
    one dtype and device and is closed once it holds ``bucket_bytes`` or more (as
    DDP's buckets: a large weight takes its bias along instead of leaving it a
    round trip of its own).

    Example:
        >>> ps = [nn.Parameter(torch.zeros(n)) for n in (4, 4, 8, 2)]
        >>> bucket_plan(ps, bucket_bytes=40)
        [[3, 2], [1, 0]]
    """
    buckets: list[list[int]] = []
    size = 0
    key: tuple[torch.dtype, torch.device] | None = None
    closed = True
    for k in reversed(range(len(params))):
        p = params[k]
        here = (p.dtype, p.device)
        if closed or here != key:
            buckets.append([])
            size = 0
            key = here
        buckets[-1].append(k)
        size += p.numel() * p.element_size()
        closed = size >= bucket_bytes
    return buckets


def hidden_time(spans: Sequence[tuple[float, float]], backward_end: float
                ) -> tuple[float, float]:
    """(time covered by ``spans``, of it before ``backward_end``): the union of the
    intervals, so concurrent calls count once.

    Example:
        >>> hidden_time([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)], backward_end=2.5)
        (4.0, 2.5)
    """
    total = hidden = 0.0
    end = float("-inf")
    for start, stop in sorted(spans):
        start = max(start, end)
        if stop <= start:
            continue
        total += stop - start
        hidden += max(0.0, min(stop, backward_end) - start)
        end = stop
    return total, hidden


def _hook(ref: weakref.ReferenceType[GradientBuckets], r: int, k: int
          ) -> Callable[[torch.Tensor], None]:
    def hook(_: torch.Tensor) -> None:
        buckets = ref()
        if buckets is not None:
            buckets.hook(r, k)
    return hook


def _accumulator(p: nn.Parameter) -> Any:
    """``p``'s gradient accumulator (torch's AccumulateGrad node, held as DDP holds it), or
    ``None`` for a frozen parameter."""
    with torch.enable_grad():
        view = p.view_as(p)
        return None if view.grad_fn is None else view.grad_fn.next_functions[0][0]


def _remove(handles: Sequence[Any]) -> None:
    for h in handles:
        h.remove()


class GradientBuckets:
    """The buckets of one mirrored optimizer, and their state for the current step.

    Args:
        params: each local replica's parameters, in the optimizer's order.
        comm: launches and finishes a bucket's sum (`AsyncSum`), or a local
            communicator (in-process replicas).
        devices: the local replicas' devices (destinations of the sums).
        bucket_bytes: the most bytes of gradients per bucket.
        label: the optimizer (``"the optimizer of mirrored model #1"``), which the
            workers' calls name.
        owners: the strategy's `GradientBuckets` so far (weak references, oldest
            first; this one is added). Only the newest launches during backward: the
            launches of two would interleave in an order of their own on each worker
            (a parameter unused on one worker's data completes its bucket at the end
            of that worker's backward, mid-way on the others; the local replicas'
            timing), and an optimizer replaced but not yet collected, or kept, would
            go on launching on some workers only. The others launch at their
            ``step()``, in program order.
    """

    def __init__(self, params: tuple[list[nn.Parameter], ...], comm: Any,
                 devices: tuple[Any, ...], bucket_bytes: int,
                 label: str = "the optimizer", owners: list[Any] | None = None) -> None:
        self._params = params
        self._label = label
        self._sum: AsyncSum = comm if hasattr(comm, "launch_sum") else _LocalSum(comm, devices)
        self._local = len(params)
        self.plan = bucket_plan(params[0], bucket_bytes)
        self.early = len(self.plan) - 1  # the last bucket rides in the step's all-reduce
        # A bucket whose dtype cannot carry its call check in the data waits for the step.
        self._early = [self._sum.overlaps(params[0][m[0]].dtype) for m in self.plan]
        self._bucket_of = [0] * len(params[0])
        for b, members in enumerate(self.plan):
            for k in members:
                self._bucket_of[k] = b
        self._lock = threading.Lock()
        self.armed = False  # launch during backward this step (agreed by every worker)
        self.newest = True  # no GradientBuckets of this strategy was built after this one
        if owners is not None:  # (built in the same order on every worker: agreed)
            for ref in owners:
                if (older := ref()) is not None:
                    older.retire()
            owners[:] = [ref for ref in owners if ref() is not None]
            owners.append(weakref.ref(self))
        self.verified = False  # the plan went through one fully checked step
        # At the first hook of a backward pass, the parameters it will not reach count in
        # as zeros at once (DDP's find_unused_parameters), not at its end: a bucket with a
        # parameter that only some workers' data reaches then completes at the same point
        # of backward on every worker, before a collective made in backward after it
        # (sync BatchNorm's). Off for good (agreed) once a parameter so counted was
        # reached in the same pass after all (a nested backward: reentrant checkpoint).
        self.premark = True
        self._accumulators = [[_accumulator(p) for p in ps] for ps in params]
        self._passes = [0] * self._local  # backward passes begun, per replica
        # steps, bucket communication (s), of it during backward (s), stale steps here,
        # buckets launched during backward
        self.stats = {"steps": 0.0, "comm_s": 0.0, "hidden_s": 0.0, "redone": 0.0,
                      "early": 0.0}
        self._reset()
        # A frozen parameter gets no hook (torch refuses one), so its bucket waits for the
        # step: thawed later, its gradients would come in unseen (a second backward's
        # too, which would not mark the bucket stale).
        self.handles = [p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                            _hook(weakref.ref(self), r, k))
                        for r, ps in enumerate(params) for k, p in enumerate(ps)
                        if p.requires_grad]
        for b, members in enumerate(self.plan):
            if any(not ps[k].requires_grad for ps in params for k in members):
                self._early[b] = False
        # An optimizer dropped (or replaced) must not launch collectives any more.
        weakref.finalize(self, _remove, self.handles)

    def _reset(self) -> None:
        n = len(self._params[0])
        self._ready = [[False] * n for _ in range(self._local)]
        self._left = [self._local * len(m) for m in self.plan]
        self._next = 0  # the next bucket to launch
        self._pending: list[Pending] = []
        self._spans: list[list[float]] = []
        self._queued = [False] * self._local
        self.stale = False  # a launched bucket's gradient changed (a second backward)
        self.accumulated = False  # a gradient was accumulated twice before the step
        self.late = False  # a parameter counted in at a pass's start was reached in it
        self._premarked = [[-1] * n for _ in range(self._local)]  # ... in pass number

    def remove(self) -> None:
        """Removes every hook."""
        _remove(self.handles)

    def retire(self) -> None:
        """Another optimizer's buckets were built on the strategy: from now on this
        one launches at ``step()`` only."""
        with self._lock:
            self.newest = self.armed = False

    # ------------------------------------------------------------- backward
    def hook(self, r: int, k: int) -> None:
        """Replica ``r``'s gradient ``k`` was accumulated (a backward pass)."""
        with self._lock:
            self._mark(r, k)
            if self.armed and not self._queued[r]:
                self._queued[r] = True
                self._passes[r] += 1
                # torch runs queued callbacks when this backward pass ends
                # (a private entry point, stable since torch 1.x; DDP uses it).
                Variable._execution_engine.queue_callback(lambda: self._backward_end(r))
                if self.premark:
                    self._unreached(r)

    def _unreached(self, r: int) -> None:
        """Counts in replica ``r``'s gradients this backward pass will not reach (lock
        held; `premark`)."""
        ready, premarked = self._ready[r], self._premarked[r]
        for k, node in enumerate(self._accumulators[r]):
            if not ready[k] and node is not None and not torch._C._will_engine_execute_node(
                    node):
                premarked[k] = self._passes[r]
                self._mark(r, k)

    def _mark(self, r: int, k: int) -> None:
        """Replica ``r``'s gradient ``k`` is in (lock held)."""
        if self._ready[r][k]:
            self.accumulated = True
            if self._queued[r] and self._premarked[r][k] == self._passes[r]:
                self.late = True
            if self._bucket_of[k] < self._next:
                self.stale = True
            return
        self._ready[r][k] = True
        b = self._bucket_of[k]
        self._left[b] -= 1
        if self.armed and self._left[b] == 0 and b == self._next:
            self._launch_ready()

    def _backward_end(self, r: int) -> None:
        with self._lock:
            self._queued[r] = False
            for k in range(len(self._ready[r])):
                if not self._ready[r][k]:
                    self._mark(r, k)  # unused in this pass: zeros, as at the step

    def _launch_ready(self) -> None:
        """Launches every complete bucket in order (lock held)."""
        while (self._next < self.early and self._left[self._next] == 0
               and self._early[self._next]):
            self._launch(self._next, sync=False)
            self._next += 1
            self.stats["early"] += 1

    def _launch(self, b: int, *, sync: bool) -> None:
        members = self.plan[b]
        flats = []
        for ps in self._params:
            grads = [ps[k].grad for k in members]
            flats.append(packing.pack([g.detach() if g is not None else torch.zeros_like(ps[k])
                                       for k, g in zip(members, grads, strict=True)]))
        start = time.perf_counter()
        pending = self._sum.launch_sum(
            f"gradient bucket {b + 1} of {len(self.plan)} of {self._label}", flats, sync=sync)
        # [launch, launch returned, completed (0: not seen yet)]
        span = [start, time.perf_counter(), 0.0 if pending.works else time.perf_counter()]
        self._spans.append(span)
        for work in pending.works:
            work.get_future().add_done_callback(
                lambda _f, s=span: s.__setitem__(2, time.perf_counter()))
        self._pending.append(pending)

    # ----------------------------------------------------------------- step
    def finish(self) -> tuple[list[list[torch.Tensor]], bool, bool, bool]:
        """At the step, once every local replica is there: launches the buckets not
        launched yet (missing gradients as zeros), waits for all; returns each
        bucket's sums (one flat tensor per local replica) and this step's stale,
        accumulated and late flags, and starts the next step's count."""
        with self._lock:
            backward_end = time.perf_counter()
            for b in range(self._next, self.early):
                self._launch(b, sync=not self.verified)
            self._next = self.early
            out = []
            for pending, span in zip(self._pending, self._spans, strict=True):
                out.append(self._sum.finish_sum(pending))
                if not span[2]:  # done, but its callback has not run yet
                    span[2] = time.perf_counter()
            total, hidden = hidden_time([(s[0], s[2]) for s in self._spans], backward_end)
            self.stats["steps"] += 1
            self.stats["comm_s"] += total
            self.stats["hidden_s"] += hidden
            self.stats["redone"] += self.stale
            flags = (self.stale, self.accumulated, self.late)
            self.armed = False  # until the step's all-reduce says (decide)
            self._reset()
            return out, *flags

    def assign(self, r: int, sums: list[list[torch.Tensor]]) -> None:
        """Sets replica ``r``'s ``.grad`` to views of the bucket sums (all buckets but
        the last)."""
        params = self._params[r]
        for members, per_replica in zip(self.plan[:self.early], sums, strict=True):
            like = [params[k] for k in members]
            for k, part in zip(members, packing.unpack(per_replica[r], like), strict=True):
                params[k].grad = part

    def decide(self, stale: bool, accumulated: bool, late: bool) -> None:
        """After the step's all-reduce (every local replica, before it leaves the
        step; all decide alike): the next step launches during backward unless some
        replica of some worker accumulated or went stale in this one; ``late``: some
        replica reached a parameter counted in at its pass's start (`premark` off)."""
        with self._lock:
            self.verified = True
            self.armed = self.newest and not (stale or accumulated)
            self.premark = self.premark and not late


class Finished:
    """`GradientBuckets.finish`'s result, handed to every replica as one object."""

    def __init__(self, sums: list[list[torch.Tensor]], *flags: bool) -> None:
        self.sums, self.flags = sums, flags  # stale, accumulated, late

    def __iter__(self) -> Iterator[Any]:
        return iter((self.sums, *self.flags))
