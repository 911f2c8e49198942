"""``ReplicaContext.all_reduce``: prepared on each replica's thread (leaves planned and
reduced over ``axis`` locally), combined once by the last replica to arrive (every
replica's partials through the communicator, fused into packs), finished on each
replica's thread (MEAN division and promotion). Differentiable: the backward pass
is an all-reduce too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import pytree
from ..comm.cross_device_ops import sums_directly
from ..comm.host import DIRECT_BYTES, combine_each
from ..comm.watch import COUNT, DESPITE
from ..options import CommunicationOptions
from ..reduce_op import ReduceOp, op_label
from ..reduction import (
    LeafPlan,
    finish,
    no_elements_message,
    normalize_axis,
    op_title,
    plan_leaf,
    prepare,
)
from ..runtime.contract import Arrival, CallSpec, CollectiveFailure
from .call import (
    call_spec,
    counts_ride,
    paths_of,
    refuse_in_merge_fn,
    sum_with_counts,
    tensors_of,
    with_paths,
)
from .parts import Parts

__all__ = ["AllReduce", "Payload", "Result", "all_reduce", "direct", "sum_examples"]


class Payload:
    """One replica's partials (one per leaf) and element counts."""

    __slots__ = ("counts", "partials")

    def __init__(self, partials: list[torch.Tensor], counts: list[int]) -> None:
        self.partials = partials
        self.counts = counts


class Result:
    """One replica's totals (one per leaf) and, for an axis, the global counts."""

    __slots__ = ("counts", "totals")

    def __init__(self, totals: list[torch.Tensor], counts: list[int] | None) -> None:
        self.totals = totals
        self.counts = counts  # global element counts, for an axis


class AllReduce:
    """One replica's side of one all-reduce: the plan, the exchange, the finish.

    Kept by the autograd function, whose backward pass needs the plan (dims, global
    counts) to route the gradient.
    """

    def __init__(self, parts: Parts, index: int, op: ReduceOp, axes: tuple[int, ...] | None,
                 options: CommunicationOptions, title: str, site: str, value: Any,
                 label: str = "", generation: int | None = None) -> None:
        self.parts = parts
        # The run of the forward pass, for its backward pass (set by the autograd
        # function): torch runs a CUDA replica's backward pass on another thread.
        self.generation = generation
        self.label = label  # (`all_reduce`)
        self.index = index
        self.op = op
        self.axes = axes
        self.options = options
        self.title = title
        self.site = site
        self.value = value
        self.plans: list[LeafPlan] = []
        self.global_counts: list[int] | None = None

    def forward(self, tensors: Sequence[torch.Tensor], spec: pytree.PyTreeSpec
                ) -> list[torch.Tensor]:
        title, op, axes = self.title, self.op, self.axes
        self.plans = with_paths(self.value, len(tensors), lambda wheres: [
            plan_leaf(title, op, t, axes, w) for t, w in zip(tensors, wheres, strict=True)])
        prepared = [prepare(p, t) for p, t in zip(self.plans, tensors, strict=True)]
        call = call_spec(title, self.site, spec, tensors, [p.dims or () for p in self.plans],
                         self.value)
        payload = Payload([p for p, _ in prepared], [c for _, c in prepared])
        result = self.parts.runtime.exchange(self.index, Arrival(call, payload, self._combine),
                                             self.options.timeout_seconds, self.generation)
        self.global_counts = result.counts
        n = self.parts.topology.num_replicas_in_sync
        return [finish(plan, total, n if result.counts is None else result.counts[k],
                       in_place=True)
                for k, (plan, total) in enumerate(zip(self.plans, result.totals, strict=True))]

    def _combine(self, payloads: Sequence[Payload]) -> list[Result]:
        topology = self.parts.topology
        counts: list[int] | None = None
        base_op = ReduceOp.SUM if self.op is ReduceOp.MEAN else self.op
        ride = self.axes is not None and counts_ride(self.parts, base_op)
        # Elastic: a MEAN divides by the replicas of the step (some may be missing).
        if not ride and (self.axes is not None or (self.op is ReduceOp.MEAN
                                                   and topology.elastic)):
            counts = self.parts.communicators.for_options(self.options).sum_counts(
                [p.counts for p in payloads]) if topology.num_replicas_in_sync > 1 else list(
                payloads[0].counts)
            if self.op in (ReduceOp.MIN, ReduceOp.MAX) and 0 in counts:
                where = paths_of(self.value)[counts.index(0)]
                raise CollectiveFailure(ValueError, no_elements_message(self.title, where))
        if topology.num_replicas_in_sync == 1:
            # One replica: a copy on the value's own device (the default strategy's device
            # is whatever the caller's is, so no communicator is involved).
            return [Result([p.clone() for p in payloads[0].partials], counts)]
        devices = topology.devices
        communicator = self.parts.communicators.for_options(self.options)
        first = payloads[0].partials
        if ride:
            reduced, counts = sum_with_counts(communicator, [p.partials for p in payloads],
                                              [p.counts for p in payloads],
                                              [devices] * len(first), self.options.bytes_per_pack,
                                              op_label(self.label, self.op))
            return [Result([per_value[r] for per_value in reduced], counts)
                    for r in range(len(payloads))]
        if counts is None and direct(communicator, topology.torch_devices, payloads):
            totals = combine_each(base_op, [p.partials[0] for p in payloads])
            return [Result([total], None) for total in totals]
        reduced = communicator.reduce_packed(base_op, [p.partials for p in payloads],
                                             [devices] * len(first), self.options.bytes_per_pack,
                                             op_label(self.label, self.op))
        return [Result([per_value[r] for per_value in reduced], counts)
                for r in range(len(payloads))]


def direct(communicator: object, devices: Sequence[torch.device],
           payloads: Sequence[Payload]) -> bool:
    """Whether every replica brings one small contiguous host tensor, all replicas are on
    the host, and the communicator combines as `combine_each` does."""
    for payload in payloads:
        if len(payload.partials) != 1:
            return False
        t = payload.partials[0]
        if not t.is_cpu or not t.is_contiguous() or t.nbytes >= DIRECT_BYTES:
            return False
    return all(d.type == "cpu" for d in devices) and sums_directly(communicator)


class _AllReduceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, job: AllReduce, spec: pytree.PyTreeSpec, *tensors: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        outputs = job.forward(tensors, spec)
        job.generation = job.parts.runtime.generation()
        ctx.job = job
        ctx.shapes = [t.shape for t in tensors]
        ctx.outputs = [(t.shape, t.dtype, t.device) for t in outputs]
        if job.op in (ReduceOp.MIN, ReduceOp.MAX):
            ctx.save_for_backward(*tensors, *outputs)
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        job: AllReduce = ctx.job
        n_in = len(ctx.shapes)
        upstream = zeros_for_none(grads, ctx.outputs)
        dims = [p.dims or () for p in job.plans]
        if job.op in (ReduceOp.MIN, ReduceOp.MAX):
            # The gradient goes to the elements that attain the extreme, split evenly
            # among ties across replicas (as torch.amin/amax do within one tensor).
            saved = ctx.saved_tensors
            masks = [(x == _expand(out, d, x.shape)).to(g.dtype)
                     for x, out, d, g in zip(saved[:n_in], saved[n_in:], dims, upstream,
                                             strict=True)]
            ties = [m.sum(dim=d, dtype=m.dtype) if d else m
                    for m, d in zip(masks, dims, strict=True)]
            summed = gradient_all_reduce(job.parts, job.index, job.options, job.site,
                                         f"gradient of {job.title}", [*upstream, *ties],
                                         job.label, job.generation)
            return (None, None, *(_expand(g / t.clamp(min=1), d, shape) * m
                                  for g, t, d, shape, m in zip(summed[:n_in], summed[n_in:], dims,
                                                               ctx.shapes, masks, strict=True)))
        total = gradient_all_reduce(job.parts, job.index, job.options, job.site,
                                    f"gradient of {job.title}", upstream, job.label,
                                    job.generation)
        result = []
        for k in range(n_in):
            g = total[k]
            if job.op is ReduceOp.MEAN:
                counts = job.global_counts
                g = g / (job.parts.topology.num_replicas_in_sync if counts is None
                         else counts[k])
            result.append(_expand(g, dims[k], ctx.shapes[k]))
        return (None, None, *result)


def zeros_for_none(grads: Sequence[torch.Tensor | None],
                   outputs: Sequence[tuple[torch.Size, torch.dtype, torch.device]]
                   ) -> list[torch.Tensor]:
    """Upstream gradients, with zeros for outputs that got none."""
    return [g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
            for g, (shape, dtype, device) in zip(grads, outputs, strict=True)]


def _expand(g: torch.Tensor, dims: Sequence[int], shape: torch.Size) -> torch.Tensor:
    for d in sorted(dims):
        g = g.unsqueeze(d)
    return g.expand(shape)


def gradient_all_reduce(parts: Parts, index: int, options: CommunicationOptions, site: str,
                        title: str, grads: list[torch.Tensor], label: str = "",
                        generation: int | None = None) -> list[torch.Tensor]:
    """The SUM all-reduce of a backward pass (itself a collective of every replica;
    ``label``: the forward call's, see `all_reduce`; ``generation``: the forward's run,
    as torch runs a CUDA replica's backward pass on its device's autograd thread)."""
    refuse_in_merge_fn(parts, title, site)
    if torch.is_grad_enabled() and any(g.requires_grad for g in grads):
        raise RuntimeError(
            f"{title} at {site}: a backward pass with create_graph=True (a gradient penalty, "
            "a second-order gradient) goes through a collective, whose own gradient is not "
            "differentiable again; compute such terms outside the collectives (e.g. on the "
            "replica's own loss before it is all-reduced)")
    job = AllReduce(parts, index, ReduceOp.SUM, None, options, title, site, grads, label,
                    generation)
    return job.forward(grads, pytree.flatten(grads)[1])


def all_reduce(parts: Parts, index: int, reduce_op: ReduceOp | str, value: Any,
               options: CommunicationOptions | None, axis: Any, site: str,
               title: str = "", label: str = "") -> Any:
    """`ReplicaContext.all_reduce` of local replica ``index``; see its docstring.
    The library's own calls may give the call's ``title``, which the replicas
    compare, and the ``label`` the workers compare (`Communicator.reduce_packed`),
    e.g. which mirrored optimizer's step it is."""
    op = ReduceOp.from_value(reduce_op)
    axes = normalize_axis(axis)
    merged = parts.options.merge(options)
    title = title or op_title("all_reduce", op, axes)
    refuse_in_merge_fn(parts, title, site)
    tensors, spec = tensors_of(value, title)
    if axes is None and parts.topology.num_replicas_in_sync == 1:
        # One replica: each leaf is its own result (a copy, promoted for an integer
        # MEAN). clone/to are differentiable, with the identity as gradient.
        plans = with_paths(value, len(tensors), lambda wheres: [
            plan_leaf(title, op, t, None, w) for t, w in zip(tensors, wheres, strict=True)])
        return pytree.unflatten(spec, [t.clone() if p.result == t.dtype else t.to(p.result)
                                       for t, p in zip(tensors, plans, strict=True)])
    job = AllReduce(parts, index, op, axes, merged, title, site, value, label)
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        outputs = list(_AllReduceFunction.apply(job, spec, *tensors))  # type: ignore[no-untyped-call]
    else:
        outputs = job.forward(tensors, spec)
    return pytree.unflatten(spec, outputs)


def sum_examples(parts: Parts, index: int, count: int, site: str, note: str = "") -> int:
    """The number of examples in this step over every replica (``count`` is local
    replica ``index``'s): plain ints in one process, one checked call across workers
    (``Communicator.sum_counts``: the count in the header row), with none of a tensor
    all-reduce's planning, packing and result copies. Used by
    ``compute_average_loss``. Across workers the call names which of the run's
    ``compute_average_loss`` calls it is, and whether its batch carried its count
    (``note``: why it counts anyway), so that a replica counting while its peers took
    their batches' counts meets no count of theirs and the error says why."""
    title = "compute_average_loss"
    refuse_in_merge_fn(parts, title, site)
    options = parts.options
    what = COUNT if parts.topology.num_workers == 1 else (
        f"{COUNT} (compute_average_loss call {parts.count_calls[index]} of the run"
        + (f"; {DESPITE})" if note else ")"))

    def combine(payloads: Sequence[int]) -> list[int]:
        total = parts.communicators.for_options(options).sum_counts(
            [[c] for c in payloads], what)[0]
        return [total] * len(payloads)

    call = CallSpec(f"{title} ({note})" if note else title, site, (title, what))
    result: int = parts.runtime.exchange(index, Arrival(call, count, combine),
                                         options.timeout_seconds)
    return result
