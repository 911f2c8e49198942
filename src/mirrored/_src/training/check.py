"""The checks that keep N replicas training what one device would: the copies'
fingerprints compared across replicas at every optimizer step, and the messages of
the watch on gradients changed between ``backward()`` and the all-reduce
(`gradient_watch`).

Fingerprints travel in the step's own fused all-reduce (SUM): replica ``g`` writes
its values into slot ``g`` of a vector that is zero elsewhere, so the sum is every
replica's table (``x + 0`` is exact), compared bit for bit. ``"cheap"`` takes one
2-norm per tensor (one multi-tensor kernel); ``"full"`` adds the sum of each
tensor's bit patterns, so a change of one bit anywhere shows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from ..errors import ReplicaDivergenceError

__all__ = ["CHEAP_EVERY", "CHECKS", "Check", "bit_patterns", "compare", "crossed_message",
           "NO_LOSS", "STEPS", "discarded_message", "equal_rows", "fingerprint",
           "modified_message", "same_divisors"]

Check = Literal["cheap", "full", "off"]
# Mirrored optimizer steps taken in this process, by any optimizer (`GradientWatch.discards`).
STEPS = [0]
CHECKS: tuple[Check, ...] = ("cheap", "full", "off")
# check="cheap" compares fingerprints at the first step and every CHEAP_EVERY-th after
# (~50 us per check on the benchmark MLP under load; under 1 % of a step amortized).
CHEAP_EVERY = 8

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def bit_patterns(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bit patterns as integers of its element size (complex as its real and
    imaginary parts), ``t`` itself when it is not floating point: compared or summed,
    a NaN equals itself and -0.0 differs from 0.0.

    Example:
        >>> bit_patterns(torch.tensor([1.0])).tolist()
        [1065353216]
    """
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.view(_INT_VIEW[t.element_size()]) if t.is_floating_point() else t


_BITS = 1 << 24  # integers below 2**24 are exact in float32 (and summed with zeros)
# The two largest primes below 2**24: a change of any bit (also above bit 24) moves a
# bit sum's remainder modulo either; "full" takes both (a sum modulo their product).
_PRIMES = (16777213, 16777199)


def slots_per_tensor(check: Check) -> int:
    """How many fingerprint values one tensor contributes."""
    return {"cheap": 1, "full": 2, "off": 0}[check]


def fingerprint(tensors: Sequence[torch.Tensor], check: Check, out: torch.Tensor,
                exact: bool = False) -> None:
    """Writes the fingerprint of ``tensors`` into ``out`` (``len(tensors) *
    slots_per_tensor(check)`` values, in ``out``'s dtype).

    ``exact``: integer sums of the bit patterns instead of 2-norms, for replicas on
    different kinds of device: the same tensor's 2-norm on a GPU and on the CPU may
    differ in the last bit (another summation order), its bit sum never does.

    Example:
        >>> out = torch.zeros(2)
        >>> fingerprint([torch.tensor([3.0, 4.0]), torch.zeros(2)], "cheap", out)
        >>> out
        tensor([5., 0.])
    """
    if not tensors:
        return
    with torch.no_grad():
        if exact:
            sums = torch.stack([_bit_sum(t) for t in tensors])
            primes = _PRIMES[:slots_per_tensor(check)]
            out.copy_(torch.stack([sums % p for p in primes], dim=1).reshape(-1))
            return
        if check == "cheap" and all(t.dtype == out.dtype for t in tensors):
            # The common case in two ops: each op of a replica thread may wait for the
            # GIL behind the other replica's, so the op count is what costs on N replicas.
            torch.stack(torch._foreach_norm(list(tensors)), out=out)
            return
        floats = [t if t.is_floating_point() or t.is_complex() else t.double() for t in tensors]
        norms = torch._foreach_norm([t.detach() for t in floats])
        if check == "cheap":
            out.copy_(torch.stack(norms))
            return
        bits = [_bit_sum(t) % _BITS for t in tensors]
        values = torch.stack([torch.stack([n.to(torch.float64) for n in norms]),
                              torch.stack(bits).to(torch.float64)], dim=1)
        out.copy_(values.reshape(-1))


def _bit_sum(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return bit_patterns(flat).sum(dtype=torch.int64)


def compare(table: torch.Tensor, names: Sequence[str], step: int, params: int = -1,
            since: int = 0, what: str = "2-norms", local: int = 0) -> None:
    """Raises `ReplicaDivergenceError` if the rows of ``table`` (one per global
    replica, ``slots`` values per name) are not bitwise equal; ``names[params:]`` are
    buffers (all are parameters by default); ``since``: the step of the last check;
    ``local``: the replicas per worker when the rows are every worker's replicas in
    order (0: not known), so that a difference on another worker than replica 0's can
    say that a setting differing between workers also makes the copies differ.

    Example:
        >>> compare(torch.tensor([[1.0], [1.0]]), ["weight"], step=1)
        >>> compare(torch.tensor([[1.0], [2.0]]), ["weight"], step=1)
        Traceback (most recent call last):
        ...
        mirrored._src.errors.ReplicaDivergenceError: ...
    """
    bits = bit_patterns(table)
    rows = bits.tolist()  # exact integers: one op, compared in Python (a table is small)
    if all(row == rows[0] for row in rows):
        return
    slots = table.shape[1] // max(len(names), 1)
    differs = (bits != bits[:1]).view(table.shape[0], len(names), slots).any(dim=2)
    column = int(differs.any(dim=0).nonzero()[0])
    replicas = [int(g) for g in differs[:, column].nonzero().flatten()]
    values = table[:, column * slots].tolist()
    when = (f"optimizer step {step}" if step - since <= 1 else
            f"optimizer step {step} (equal at step {since}; check='full' checks every step)")
    where = (f"the copies of the mirrored model differ at {when}: "
             f"{names[column]!r} on replica(s) {replicas} differs from replica 0 ({what} "
             + ", ".join(f"replica {g}: {v!r}" for g, v in enumerate(values)) + "). ")
    if local and any(g // local for g in replicas):
        where += (f"Replica(s) {[g for g in replicas if g // local]} run on another worker "
                  "than replica 0: a setting that differs between workers also makes the "
                  "copies differ (a learning rate set on some workers only, a scheduler "
                  "stepped on some workers only, e.g. under `if is_chief:`, an optimizer "
                  "option, or a module changed on one worker after strategy.mirror); make "
                  "every change on every worker alike. ")
    if 0 <= params <= column:
        raise ReplicaDivergenceError(
            where + "It is a buffer, and mirror_optimizer(buffers='off') leaves buffers to "
            "you: use buffers='average' (the mean over the replicas at every step) or "
            "'broadcast' (replica 0's, as DDP) for a buffer updated in forward")
    raise ReplicaDivergenceError(
        where + "The gradients were all-reduced, so the copies were changed outside "
        "optimizer.step(): a manual update (p.data.add_(p.grad, alpha=-lr), or "
        "p -= lr * p.grad under no_grad) trains each copy on its own batch, and code that "
        "changes one copy (model.replicas[i]) breaks the mirror, as does a forward pass "
        "that changes a parameter in place from its replica's own batch (F.embedding's "
        "max_norm renormalizes the rows that batch looks up). Make every update "
        "through optimizer.step() (it all-reduces first), and change the copies outside "
        "strategy.run with model.load_state_dict")


def equal_rows(values: list[float] | None, start: int, width: int, rows: int) -> bool:
    """Whether the ``rows`` fingerprint rows of ``width`` values from ``start`` in
    ``values`` (a reduced table, read) hold the same values: then `compare`, which
    compares bits, has nothing to find (equal values have equal bits: a norm or a bit
    sum is never -0.0). A NaN or a difference is for `compare`.

    Example:
        >>> equal_rows([0.0, 2.0, 3.0, 2.0, 3.0], 1, 2, 2)
        True
        >>> equal_rows([0.0, float("nan"), float("nan")], 1, 1, 2)
        False
    """
    if values is None:
        return False
    first = values[start:start + width]
    return all(values[start + g * width:start + (g + 1) * width] == first
               for g in range(1, rows))


def modified_message(names: Sequence[str], replica: int, replicas: int = 2) -> str:
    """The error for gradients changed in place between backward and step (with
    ``replicas`` in sync: one replica is refused too, so that the code that runs on one
    replica runs on N)."""
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    alone = (" With one replica the gradients are already the global ones, but the same "
             "step would be wrong on N replicas, so it is refused here too."
             if replicas == 1 else "")
    return (
        f"the gradient of {names[0]!r}{more} was changed in place on replica {replica} "
        "between backward() and optimizer.step() (torch.nn.utils.clip_grad_norm_, "
        "clip_grad_value_, p.grad.mul_ or p.grad.data.clamp_): each replica would change its "
        "own local gradient "
        f"before the all-reduce, which trains a different model than one device.{alone} "
        "Clip the all-reduced gradients with optimizer.step(clip_grad_norm=c) or "
        "optimizer.step(clip_grad_value=c) (with a GradScaler: scaler.step(optimizer, "
        "clip_grad_norm=c), or scaler.unscale_(optimizer) first, which all-reduces, then "
        "clip); to scale gradients, scale the loss instead"
        + ("" if replicas == 1 else ". If no code changes gradients: another replica's "
           "backward() may have reached this replica's copy (the step ran the original "
           "module, a part of it, or model.replicas[i]); call the mirrored model, model(x)"))


def discarded_message(replica: int) -> str:
    """The error for ``zero_grad()`` discarding gradients of a ``backward()`` that were
    never all-reduced (local ``replica``)."""
    return (f"MirroredOptimizer.zero_grad discards gradients of local replica {replica} that "
            "were never all-reduced (backward() ran, but no optimizer.step() since): a manual "
            "update (p.data.add_(p.grad, alpha=-lr)) trains each copy on its own batch, so the "
            "copies drift apart. Update with optimizer.step(), which all-reduces first; to drop "
            "a step's gradients on purpose (a step skipped alike on every replica), call "
            "model.zero_grad() on the mirrored model")


def crossed_message(running: int, copy: int) -> str:
    """Why a step is refused whose backward on replica ``running`` reached the copy of
    replica ``copy`` (replica ids)."""
    return (f"replica {running}'s backward() reached replica {copy}'s copy of the mirrored "
            f"model: the step function ran a module other than the mirrored model (the "
            f"original module given to strategy.mirror is replica 0's copy, and "
            f"model.replicas[i] is replica i's), so replica {copy}'s gradients mix several "
            "replicas' batches and the others' copies get none. Call the mirrored model "
            "itself, model(x): it runs each replica's own copy")


def same_divisors(slots: list[float]) -> None:
    """Raises unless every replica that gave ``compute_average_loss`` a
    ``global_batch_size`` in this step gave the same (the largest of its calls'; 0:
    none, e.g. a replica that skipped its loss on an empty batch), and unless every
    replica gave its own loss's row count (marked ``+ 0.5`` by ``compute_average_loss``):
    equal sizes on every replica, each its own rows, sum to N times the size given,
    so that is a per-replica size on any batch.

    Example:
        >>> same_divisors([16, 16, 0])
        >>> same_divisors([8.5, 8.5])
        Traceback (most recent call last):
        ...
        ValueError: MirroredOptimizer.step: every replica gave ...
    """
    values = [int(v) for v in slots]
    given = {v for v in values if v > 0}
    if len(given) <= 1:
        if len(slots) > 1 and all(v > 0 and v != int(v) for v in slots):
            raise ValueError(_PER_REPLICA_SIZE.format(size=values[0], n=len(slots)))
        return
    listing = ", ".join(f"replica {i}: {v if v > 0 else 'none'}" for i, v in enumerate(values))
    raise ValueError(
        f"MirroredOptimizer.step: compute_average_loss(per_example_loss, global_batch_size="
        f"...) was given different values on different replicas in this step ({listing}; "
        "expected one value on every replica that passed one). Each replica divides by "
        "its own value, so the all-reduced gradient is not the mean over the global batch "
        "that one device computes; no replica applied the step. Pass the size of the whole "
        "global batch, the same on every replica (a per-replica formula such as len(x) * "
        "num_replicas_in_sync is wrong on an uneven batch), or leave global_batch_size="
        "None to count each step's examples exactly")


_PER_REPLICA_SIZE = (
    "MirroredOptimizer.step: every replica gave compute_average_loss(per_example_loss, "
    "global_batch_size={size}) the number of rows of its own per_example_loss ({size}, as "
    "len(x) gives): each replica then averages over its own batch, and the all-reduced "
    "gradient is the sum of {n} replicas' means, {n} times the mean over the global batch "
    "that one device computes; no replica applied the step. Pass the size of the whole "
    "global batch, the same on every replica (len(x) * num_replicas_in_sync on an even "
    "batch), or leave global_batch_size=None to count each step's examples exactly")


NO_LOSS = (
    "MirroredOptimizer.step on {n} replicas: no replica called compute_average_loss since "
    "the last step. The step sums the replicas' gradients (as TensorFlow does), so a loss "
    "averaged per replica (loss.mean(), or a criterion's default reduction='mean', as "
    "with DDP) trains with {n} times the gradients of one device. Write "
    "mirrored.compute_average_loss(per_example_loss) with reduction='none'. A loss "
    "already divided by the global batch size is right: silence this with "
    "warnings.filterwarnings('ignore', category=mirrored.LossScalingWarning)")
