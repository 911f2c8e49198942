"""`GradientReducer`: the all-reduce of a mirrored optimizer's step, with the checks
and the buffer rule riding on it.

One fused all-reduce (SUM) per step and replica carries the gradients, a presence
flag per parameter (a gradient that is ``None`` on every replica stays ``None``),
each replica's fingerprint of the copies (`check`), whether each replica called
``compute_average_loss`` and with which ``global_batch_size`` (different sizes
raise before any gradient is used; no call on any replica warns, see
`LossScalingWarning`), the BatchNorm statistics to average and the other buffers
(`buffers`; large ones only as a flag, their values in a second all-reduce at a step
that changed them). The reduced gradients replace ``.grad`` (views of the packed
result, no copy).

Under an elastic strategy (`mirrored.elastic`) the all-reduce also carries one
presence slot per global replica, so that divisors and the copies' comparison count
only the replicas of the step, and the workers then vote (torchft's commit): a step
that is not committed leaves no gradient and steps no optimizer.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..collectives.all_reduce import all_reduce
from ..collectives.call import call_site, user_stacklevel
from ..errors import LossScalingWarning, ReplicaDivergenceError
from ..reduce_op import ReduceOp
from ..runtime.contract import Arrival, CallSpec
from .buffers import (
    BufferRule,
    BufferSync,
    batch_weight,
    leaf_names,
    other_buffers,
    take_statistics,
    weighted_statistics,
)
from .carry import CarriedGradients, add_kept
from .check import (
    CHEAP_EVERY,
    NO_LOSS,
    Check,
    compare,
    equal_rows,
    fingerprint,
    modified_message,
    same_divisors,
    slots_per_tensor,
)
from .gradient_watch import GradientWatch
from .host_sum import HostSum
from .module import MirroredModule
from .overlap import Finished, GradientBuckets, bucket_plan
from .plain_optimizer import subset_text
from .structure import frozen_message

if TYPE_CHECKING:
    from mirrored import ReplicaContext

__all__ = ["CHEAP_EVERY", "GradientReducer"]


class GradientReducer:
    """Each local replica's side of the step's all-reduce.

    Args:
        module: the mirrored module (its copies' BatchNorm statistics and buffers).
        params: each replica's parameters, in the optimizers' order.
        names: the parameters' qualified names, in the same order.
        check: the fingerprint compared across replicas at every step (`check`).
        buffers: the rule for buffers other than BatchNorm's (`buffers`).
        overlap: all-reduce the gradients in buckets launched while backward runs
            (`GradientBuckets`), of at most ``bucket_bytes`` each.
    """

    def __init__(self, module: MirroredModule, params: tuple[list[nn.Parameter], ...],
                 names: list[str], *, check: Check, buffers: BufferRule,
                 overlap: bool = False, bucket_bytes: int = 0) -> None:
        strategy = module.strategy
        local, n = len(params), strategy.num_replicas_in_sync
        self._num_replicas = n
        self._parts = strategy._parts
        self._params = params
        self._check: Check = check
        # Replicas on a GPU and on the CPU compute norms in other orders: bit sums instead;
        # also in an elastic job, whose workers join with no start-up exchange that would
        # tell each the others' devices (every worker must compare the same fingerprint).
        self._exact = self._parts.topology.mixed_kinds or self._parts.topology.elastic
        self._steps = None if self._parts.cluster is None else self._parts.cluster.steps
        self.optimizer_name = (f"the optimizer of mirrored model #{module._mirrored_number}"
                               f"{subset_text(module.replicas[0], params[0])}")
        self.label = f"MirroredOptimizer.step ({self.optimizer_name})"  # (in the step's calls)
        self.committed = [True] * local  # elastic: the last all-reduce's step was committed
        if self._steps is not None and overlap:
            raise ValueError("mirror_optimizer(overlap=True) is not available under an elastic "
                             "strategy (one all-reduce per step carries the commit vote's "
                             "inputs); leave overlap at its default")
        self._stats = tuple(module.averaged_buffers(r) for r in range(local))
        self._sync = tuple(BufferSync(buffers, other_buffers(c), n, defer=self._steps is None)
                           for c in module.replicas)  # (elastic: one all-reduce per step)
        self._names = names + [name for name, _ in self._sync[0].fingerprinted()]
        if self._steps is not None:  # elastic: replica 0's worker may be missing
            self._sync[0].refuse_from_first(buffers)
        # On one replica too: the same step raises on 1 replica as on N.
        self._watch = (GradientWatch(params, known=module._known,
                                     ids=self._parts.topology.replica_ids,
                                     measure_every=1 if check == "full" else CHEAP_EVERY)
                       if check != "off" else None)
        self.reduced = [False] * local  # the replica's gradients are all-reduced already
        self.carried = CarriedGradients(params, module._carrying, None if self._watch is None
                                        else self._watch.ends, names) if n > 1 else None
        if self.carried is not None:
            module._carried.add(self.carried)
        self.seq = [0] * local  # all-reduces made by each replica (equal on every one)
        first = params[0][0]
        meta_dtype = torch.float64 if first.dtype == torch.float64 else torch.float32
        self._width = len(self._names) * slots_per_tensor(check)
        self._every = 1 if check == "full" else CHEAP_EVERY
        # Per replica: all-present flags, one per parameter, then a fingerprint slot per
        # global replica, then a loss-divisor slot per global replica (sent as is on the
        # common path; the replica fills its own).
        # ... and each parameter's requires_grad (`_frozen`).
        self._meta = tuple(torch.cat([torch.ones(len(p), dtype=meta_dtype, device=p[0].device),
                                      torch.zeros(n * self._width + n + len(p),
                                                  dtype=meta_dtype, device=p[0].device)])
                           for p in params)
        self._flags: list[list[bool] | None] = [None] * local  # requires_grad last sent
        # Read at every step on the CPU; on a GPU (a device sync) at the checked steps.
        self._flags_every_step = first.device.type == "cpu"
        self._divisor_sent: list[float] = [0] * local  # the value in the replica's divisor slot
        # Once a replica has sent a divisor, or seen one on a step the check reads its
        # table (every replica reads the slots then), it compares at every step, also
        # one in which it made no such call (a skipped loss on an empty batch).
        self._divisor_seen = [False] * local
        self._loss_calls = list(self._parts.loss_calls)  # (as of its last step, or now)
        if self._steps is not None:  # elastic: a presence slot per global replica, own set
            ids = self._parts.topology.replica_ids
            self._meta = tuple(torch.cat([m, (torch.arange(n, device=m.device) == g).to(m.dtype)])
                               for m, g in zip(self._meta, ids, strict=True))
        # In-process host replicas add each other's gradients on their own threads.
        self._host_sum = HostSum(self._parts, f"the gradients of {names[0]}, ...", self.label,
                                 leaf_names(names, len(self._stats[0]), self._sync[0])
                                 ) if HostSum.applies(self._parts, params[0]) else None
        self.buckets: GradientBuckets | None = None
        if overlap and n > 1 and len(bucket_plan(params[0], bucket_bytes)) > 1:
            self.buckets = GradientBuckets(params, self._parts.communicators.default,
                                           self._parts.topology.devices, bucket_bytes,
                                           self.optimizer_name, self._parts.bucket_owners)
            # + this replica's stale, accumulated and late flags (see GradientBuckets)
            self._meta = tuple(torch.cat([m, m.new_zeros(3)]) for m in self._meta)

    def _finish_buckets(self, r: int) -> Finished:
        """Every local replica meets; the last to arrive finishes the buckets (the
        runtime's rendezvous: bounded, and aborted with the run; no merge_call, whose
        helper thread costs more than a small model's step)."""
        buckets = self.buckets
        assert buckets is not None  # callers check

        def combine(payloads: Sequence[None]) -> list[Finished]:
            return [Finished(*buckets.finish())] * len(payloads)

        parts = self._parts
        call = CallSpec(self.label, "the gradient buckets", ("buckets", self.label))
        return parts.runtime.exchange(r, Arrival(call, None, combine),
                                      parts.options.timeout_seconds)

    def _sum(self, ctx: ReplicaContext, leaves: list[Any]) -> list[torch.Tensor]:
        """``ctx.all_reduce("SUM", leaves)``, titled with this optimizer. A worker with one
        replica, whose only peers are other workers, hands float leaves straight to the
        communicator: the same call and packs (so the same sums, bitwise), without the
        in-process rendezvous and per-leaf planning that only several replicas need."""
        parts = self._parts
        topology = parts.topology
        if (topology.num_local_replicas == 1 and topology.num_workers > 1
                and all(t.is_floating_point() for t in leaves)):
            options = parts.options
            reduced = parts.communicators.for_options(options).reduce_packed(
                ReduceOp.SUM, [leaves], [topology.devices] * len(leaves),
                options.bytes_per_pack, self.optimizer_name)
            return [per_value[0] for per_value in reduced]
        result: list[torch.Tensor] = all_reduce(parts, ctx._index, "SUM", leaves, None, None,
                                                call_site(1), self.label, self.optimizer_name)
        return result

    def discards(self, r: int) -> bool:
        """Whether replica ``r`` holds gradients of a ``backward()`` not yet all-reduced,
        and no mirrored optimizer stepped since (`GradientWatch.discards`)."""
        return self._watch is not None and self._watch.discards(r) and not self.reduced[r]

    def reduce(self, ctx: ReplicaContext, r: int) -> None:
        """One fused all-reduce of local replica ``r``'s gradients, flags, fingerprints
        and buffers; the reduced gradients replace ``.grad``.

        Raises:
            ReplicaDivergenceError: a gradient changed in place since ``backward()``, a
                backward reached another replica's copy, or the copies differ.
        """
        g = ctx.replica_id_in_sync_group
        params = self._params[r]
        n = len(params)
        if self._watch is not None:
            changed = self._watch.modified(r, params)
            if changed:
                raise ReplicaDivergenceError(modified_message(
                    [self._names[k] for k in changed], g, self._num_replicas))
        if self._num_replicas == 1:
            # One replica in all: its gradients are the global ones, BatchNorm statistics
            # and buffers averaged over one replica are themselves, and there is no other
            # copy to compare. Only the watch's refusal above (and zero_grad's) remains.
            if self._watch is not None:
                self._watch.clear(r)
            self.reduced[r] = True
            return
        kept = self.carried.take(r) if self.carried is not None else None
        grads = [p.grad for p in params]
        if any(t is not None and t.is_sparse for t in grads):
            raise TypeError("MirroredOptimizer.step all-reduces dense gradients; a parameter has "
                            "a sparse gradient (e.g. nn.Embedding(sparse=True)): use dense "
                            "gradients (sparse=False)")
        missing = [k for k, t in enumerate(grads) if t is None]
        meta = self._meta[r]
        parts = self._parts
        divisor = parts.loss_divisors[r]
        # The slot: the largest global_batch_size given, -1 for compute_average_loss
        # calls without one, 0 for none (`same_divisors`, `NO_LOSS`).
        calls = parts.loss_calls[r]
        value = divisor or -int(calls != self._loss_calls[r])
        self._loss_calls[r] = calls
        at = n + self._num_replicas * self._width  # the divisor slots
        if value != self._divisor_sent[r]:
            meta[at + g] = value
            self._divisor_sent[r] = value
            self._divisor_seen[r] |= value > 0
        parts.loss_divisors[r] = 0
        flags = [p.requires_grad for p in params]
        if flags != self._flags[r]:  # (the slots: `_frozen`)
            at_flags = at + self._num_replicas
            meta[at_flags:at_flags + n] = torch.tensor(flags, dtype=meta.dtype)
            self._flags[r] = flags
        buckets = self.buckets
        if missing or buckets is not None:
            meta = meta.clone()
            meta[missing] = 0
            for k in missing:
                grads[k] = torch.zeros_like(params[k])
        if buckets is not None:
            sums, *flags = self._finish_buckets(r)
            meta[-3:] = torch.tensor([float(flag) for flag in flags])
        sync = self._sync[r]
        # Elastic: the job's step paces the check (a rejoined worker's own count differs).
        count = self.seq[r] if self._steps is None else self._steps.step
        width = self._width if count % self._every == 0 else 0
        if width:
            watched = [*params, *(t for _, t in sync.fingerprinted())]
            fingerprint(watched, self._check, meta[n + g * width:n + (g + 1) * width],
                        self._exact)
        weight = (batch_weight(self._parts.run_args[0], r)
                  if sync.owners or self._stats[r] else 1)  # (0: an empty batch)
        stats = weighted_statistics(self._stats[r], weight)
        sends = sync.send(g, weight) if sync.owners else []
        live: int | None = None  # elastic: the replicas of the step
        if buckets is None:
            leaves = [*grads, meta, *stats, *sends]
            reduced = (self._sum(ctx, leaves) if self._host_sum is None or (
                torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in grads))
                else self._host_sum(r, leaves, 1 + len(stats) + len(sends)))
            self.seq[r] += 1
            if self._steps is not None:
                live = self._live(ctx, r, reduced[n])
            if live == 0:  # not committed: nothing of this step is used
                return
            # (elastic: after the vote, which every worker makes)
            values = reduced[n].tolist() if width else None  # (checked: read once)
            self._frozen(r, reduced[n], at, live, width, values)
            slots = self._divisors(r, reduced[n], at, width, values)
            for p, t in zip(params, reduced[:n], strict=True):
                p.grad = t
        else:  # the last bucket's gradients and the rest follow in one all-reduce
            last = buckets.plan[-1]
            reduced = self._sum(ctx, [*(grads[k] for k in last), meta, *stats, *sends])
            self.seq[r] += 1
            values = reduced[len(last)].tolist() if width else None
            self._frozen(r, reduced[len(last)], at, None, width, values)
            slots = self._divisors(r, reduced[len(last)], at, width, values)
            for k, t in zip(last, reduced, strict=False):
                params[k].grad = t
            reduced = [*params, *reduced[len(last):]]
            stale, accumulated, reached = (bool(v > 0) for v in reduced[n][-3:].tolist())
            buckets.decide(stale, accumulated, reached)
            if stale:  # a second backward changed launched buckets: as without overlap
                for p, t in zip(params, self._sum(ctx, grads), strict=True):
                    p.grad = t
            else:
                buckets.assign(r, sums)
        if missing:
            present = reduced[n][:n].tolist()
            for k in missing:
                if present[k] == 0:
                    params[k].grad = None
        if kept is not None:  # (the last step's gradients left in .grad: `carry`)
            add_kept(params, kept)
        if stats:
            take_statistics(self._stats[r], reduced[n + 1:n + 1 + len(stats)])
        if sends:
            sync.num_replicas = live or self._num_replicas
            sync.apply(reduced[n + 1 + len(stats):])
            if late := sync.late():  # (large buffers some replica changed)
                sync.apply_late(self._sum(ctx, late))
        if self._watch is not None:
            self._watch.clear(r)
        if width and (live is not None or not equal_rows(values, n, width,
                                                     self._num_replicas)):
            table = reduced[n][n:n + self._num_replicas * width].view(self._num_replicas, width)
            if live is not None:  # elastic: the rows of the replicas in the step
                table = table[reduced[n][-self._num_replicas:] > 0]
            compare(table, self._names, self.seq[r], params=n,
                    since=max(self.seq[r] - self._every, 0), local=len(self.seq) * (live is None),
                    what="bit-sum fingerprints" if self._exact else "2-norms")
        self.reduced[r] = True
        # Last (a warning made an error leaves the step whole), once per worker.
        if width and r == 0 and slots is not None and not any(slots):
            warnings.warn(NO_LOSS.format(n=live or self._num_replicas), LossScalingWarning,
                          stacklevel=user_stacklevel())

    def _divisors(self, r: int, meta: torch.Tensor, at: int, width: int,
                  read: list[float] | None = None) -> list[float] | None:
        """The step's divisor slots (of the reduced ``meta``, from ``at``; ``read``: all of
        it, read already), read when local replica ``r`` compares them (it sent or saw a
        ``global_batch_size``) or the check reads its table (``width``), else ``None``
        (not even sliced); raises (`same_divisors`) if they differ."""
        if not (width or self._divisor_seen[r]):
            return None
        values = (meta[at:at + self._num_replicas].tolist() if read is None
                  else read[at:at + self._num_replicas])
        if self._divisor_seen[r] or any(v > 0 for v in values):
            self._divisor_seen[r] = True
            same_divisors(values)
        return values

    def _frozen(self, r: int, meta: torch.Tensor, at: int, live: int | None,
                width: int, read: list[float] | None = None) -> None:
        """Raises on every replica, before any gradient is used, if some parameter
        requires a gradient on some replicas' copies and not on others' (its slot of
        the reduced ``meta``, each replica's ``requires_grad`` summed, is neither 0 nor
        the number of replicas in the step): it would be stepped with the others'
        gradients, or not at all on some. Every step on CPU replicas; on GPUs (a
        device sync) at the checked steps (``width``) only."""
        if not (self._flags_every_step or width):
            return
        n = len(self._params[r])
        whole = float(self._num_replicas if live is None else live)
        at_flags = at + self._num_replicas
        if read is not None:  # (all of the meta, read already)
            values = read[at_flags:at_flags + n]
        else:  # (many: one comparison on the device, then the names only if it fails)
            slots = meta[at_flags:at_flags + n]
            if n > 64 and not bool(((slots != 0) & (slots != whole)).any()):
                return
            values = slots.tolist()
        names = [self._names[k] for k, v in enumerate(values) if v not in (0.0, whole)]
        if names:
            raise RuntimeError(frozen_message(names, r, int(next(
                v for v in values if v not in (0.0, whole))), int(whole)))

    def _live(self, ctx: ReplicaContext, r: int, meta: torch.Tensor) -> int:
        """Elastic: the workers' commit vote (once per worker, by the last local replica
        to arrive); the replicas in the step if committed, else 0 (the gradients are
        dropped, this replica's reduction is done)."""
        steps = self._steps
        assert steps is not None  # callers check
        presence = meta[-self._num_replicas:]
        doubled = (presence > 1).nonzero().flatten().tolist()

        def vote(payloads: Sequence[None]) -> list[bool]:
            return [steps.commit()] * len(payloads)

        call = CallSpec("MirroredOptimizer.step", "the commit vote", ("commit",))
        committed = self._parts.runtime.exchange(r, Arrival(call, None, vote),
                                                 self._parts.options.timeout_seconds)
        if committed and doubled:
            raise ValueError(
                f"two live workers of the elastic job hold replica(s) {doubled} (replica "
                f"{ctx.replica_id_in_sync_group} saw them twice in one step): every worker "
                "needs its own worker_index; a restarted worker reuses the lost one's")
        self.committed[r] = committed
        if not committed:
            for p in self._params[r]:
                p.grad = None
            if self._watch is not None:
                self._watch.clear(r)
            self.reduced[r] = True
            return 0
        return int(presence.sum())
