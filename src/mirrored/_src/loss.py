"""`compute_average_loss`: the per-example loss averaged over the global batch."""

from __future__ import annotations

import numbers
from typing import Any

import torch

from . import context
from .lazy_torch import skip_in_dynamo
from .values import StepExamples

__all__ = ["compute_average_loss", "scale_regularization_loss"]


_MARKED_BELOW = 1 << 22  # (sizes whose + 0.5 float32 holds exactly)


def compute_average_loss(per_example_loss: Any, global_batch_size: int | None = None
                         ) -> torch.Tensor:
    """Sums this replica's per-example losses and divides by the global batch size.

    Summing the result over replicas (what gradient all-reduce does) gives the
    mean over the global batch. With ``global_batch_size=None`` the divisor is the
    true number of examples in this step across all replicas (in one process the
    replicas' sizes are met at their rendezvous; across workers one small checked
    collective per step, its own meeting point, except where the loss has the rows
    of a batch of ``experimental_distribute_dataset``, whose global rows every
    worker knows; when every global batch has the same size, pass
    ``global_batch_size`` to skip it), so partial and empty per-replica batches
    give exactly the single-device mean (TF uses local size x replicas, which is
    wrong for uneven splits). An all-empty step gives NaN, like
    ``torch.tensor([]).mean()``.

    Args:
        per_example_loss: losses with a leading batch dimension (``[batch, ...]``;
            every element is summed, the batch size is ``shape[0]``).
        global_batch_size: the number of examples across all replicas, if known;
            the same on every replica (a mirrored optimizer's step raises
            ``ValueError`` before using the gradients if replicas of a run passed
            different values before it).

    Raises:
        ValueError: a rank-0 loss, or a ``global_batch_size`` that is not a positive int.
        RuntimeError: called in cross-replica context.
        CollectiveMismatchError: across workers, in a step whose per-example losses have
            their ``experimental_distribute_dataset`` batch's rows on some replicas
            only (those count with a collective the others do not make).

    Example:
        >>> import torch, mirrored
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> losses = mirrored.PerReplica([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([6.0])])
        >>> per_replica = strategy.run(mirrored.compute_average_loss, args=(losses,))
        >>> strategy.reduce("SUM", per_replica)
        tensor(3.)
    """
    # inside run (the hot path): current_replica_context, inlined
    replica = s[-1].replica_context if (s := context._state.stack) and s[-1].in_run else None
    in_run = replica is not None
    if replica is None:
        replica = context.get_replica_context()  # a merge_fn, a scope or the default's
        in_run = context.in_run()
    if replica is None:
        raise RuntimeError("compute_average_loss must be called in replica context (inside "
                           "strategy.run); in cross-replica context reduce the losses with "
                           "strategy.reduce('MEAN', per_example_loss, axis=0)")
    loss = per_example_loss if isinstance(per_example_loss, torch.Tensor) else torch.as_tensor(
        per_example_loss)
    if loss.dim() == 0:
        raise ValueError("compute_average_loss expects per-example losses with a batch "
                         f"dimension; got a rank-0 tensor ({loss.item()!r}), already reduced. "
                         "Ask the loss function for one loss per example "
                         "(F.cross_entropy(..., reduction='none'), nn.MSELoss(reduction="
                         "'none')): a mean over this replica's batch cannot be turned into "
                         "the global batch's mean when the replicas' batches differ in size. "
                         "(reduce='none' is torch's legacy boolean argument, read as True: it "
                         "still gives the mean; loss[None] is only right for one example)")
    if not (loss.dtype.is_floating_point or loss.dtype.is_complex):
        loss = loss.to(torch.get_default_dtype())
    total = loss.sum()
    many = replica.num_replicas_in_sync > 1
    if many and total.requires_grad:  # (a mirrored optimizer's step asks; an evaluation's
        replica._parts.loss_calls[replica._index] += 1  # loss, with no gradient, is not it)
    if global_batch_size is not None:
        size = global_batch_size
        if isinstance(size, torch.Tensor) and size.dim() == 0 and not (
                size.is_floating_point() or size.dtype == torch.bool):
            size = int(size.item())
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size <= 0:
            raise ValueError("global_batch_size must be a positive integer (int, NumPy integer "
                             f"or integer 0-d tensor), or None to count the examples; got "
                             f"{global_batch_size!r}")
        size = int(size)
        if many:  # compared across replicas at the all-reduce
            divisors = replica._parts.loss_divisors
            index = replica._index
            # Marked (+ 0.5, exact in the step's float32 slots) when it is this loss's
            # own row count, which every replica giving is a per-replica size.
            own = size == loss.shape[0] and size < _MARKED_BELOW
            if size > divisors[index]:
                divisors[index] = size + 0.5 if own else size
            elif size == int(divisors[index]) and not own:
                divisors[index] = size
        return total / size
    if not many:  # the local count is the global one
        if not in_run and replica.strategy is not None and (
                replica.strategy.default_replica_context is replica):
            context.refuse_default_context_in_foreign_thread("compute_average_loss")
        return total / loss.shape[0]
    rows = loss.shape[0]
    parts = replica._parts
    index = replica._index
    parts.count_calls[index] += 1
    examples: StepExamples | None = parts.step_examples[0] if in_run else None
    if examples is not None:
        if rows == examples.sizes[index]:
            # A batch of a multi-worker distributed dataset, whose global rows every
            # worker knows: when every replica's loss has its batch's rows, their sum is
            # that count. A replica whose loss has other rows counts (below); all of them
            # doing so is exact, some of them a mismatched collective that raises.
            divisors = parts.loss_divisors  # compared across replicas at the all-reduce
            if examples.total > divisors[index]:
                divisors[index] = examples.total
            return total / examples.total
        note = (f"this replica's per-example loss has {rows} rows, its batch from "
                f"experimental_distribute_dataset {examples.sizes[index]}")
    else:
        note = ""
    # One exchange of plain ints (across workers one checked header-only call); dividing by
    # the int is bitwise the division by the count as a tensor of total's dtype.
    average: torch.Tensor = total / replica._sum_examples(rows, note)
    return average


# Eager under torch.compile (one graph break in the caller's frame): traced, its
# bookkeeping (a per-replica call count, the divisors compared at the step, the example
# count's exchange) made Dynamo guard on values that change every step, so a compiled
# loss function was compiled again at every step until the recompile limit.
skip_in_dynamo(compute_average_loss, inside=True, reason=(
    "mirrored.compute_average_loss runs eagerly under torch.compile (it counts the step's "
    "examples across replicas): a graph break there; drop fullgraph=True, or return the "
    "per-example loss from the compiled function and call compute_average_loss on it"))


def scale_regularization_loss(regularization_loss: Any) -> torch.Tensor:
    """A loss term that is not per example (an L2 penalty on the weights, an auxiliary
    loss over the model), divided by the number of replicas in sync (TF's
    ``tf.nn.scale_regularization_loss``): every replica adds it to its loss and the
    gradients are summed over the replicas, so unscaled it would count N times.
    A list or tuple of terms is summed first.

    Raises:
        RuntimeError: called in cross-replica context.

    Example:
        >>> import torch, mirrored
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> w = torch.tensor([1.0, 2.0])
        >>> per_replica = strategy.run(
        ...     lambda: mirrored.scale_regularization_loss(w.pow(2).sum()))
        >>> strategy.reduce("SUM", per_replica)  # the penalty once, as on one device
        tensor(5.)
    """
    replica = context.get_replica_context()
    if replica is None:
        raise RuntimeError("scale_regularization_loss must be called in replica context "
                           "(inside strategy.run), where each replica adds it to its loss")
    terms = (list(regularization_loss) if isinstance(regularization_loss, list | tuple)
             else [regularization_loss])
    total: torch.Tensor = torch.as_tensor(terms[0]).sum()
    for term in terms[1:]:
        total = total + torch.as_tensor(term).sum()
    scaled: torch.Tensor = total / replica.num_replicas_in_sync
    return scaled
