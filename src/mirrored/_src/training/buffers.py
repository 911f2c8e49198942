"""The rule for buffers other than BatchNorm's (a running counter, an EMA updated in
``forward``), applied at every optimizer step so the copies never drift apart.

``"average"`` (the default): floating-point buffers become their mean over the
replicas, as BatchNorm's running statistics do; integer and bool buffers are taken
from replica 0. ``"broadcast"``: every such buffer is taken from replica 0
(``DistributedDataParallel(broadcast_buffers=True)``). ``"off"``: buffers are left
alone, and the optimizer's check raises if they differ. The values travel in the
step's fused all-reduce (SUM): a buffer taken from replica 0 is sent by replica 0
and as zeros by the others, so the sum is replica 0's value exactly.

Two refinements keep the average one device's where it can be:

- A buffer whose value no replica changed since the last step (each copy compares
  its value with a snapshot of what the last step left: a positional encoding, a
  mask) is left as it is. Averaged, it drifted: ``(x + x + x) / 3`` is not ``x`` in
  floating point for about 15 % of random float32 values, so on 3, 5, 6, 7 replicas
  such a buffer moved by an ulp at every step, where one device keeps it constant.
  The comparison is by value, not by torch's version counter: a write through
  ``.data`` (common in EMA codebooks) leaves the counter as it was, and a buffer so
  updated was never averaged, its copies drifting apart silently.
- A replica whose batch in the step is empty (the first tensor among ``run``'s
  arguments has 0 rows) is left out of the average: its update came from no
  example (``x.mean(0)`` of an empty batch is NaN, which made every copy NaN).
  One float32 flag tensor carries both: a changed flag per buffer and the replica's
  weight (0 or 1), summed with the buffers (float32 counts exactly to 2**24
  replicas; bfloat16 stopped at 256).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .check import bit_patterns

__all__ = ["BUFFER_RULES", "LATE_BYTES", "BufferRule", "BufferSync", "batch_weight",
           "leaf_names", "other_buffers", "take_statistics", "weighted_statistics"]

BufferRule = Literal["average", "broadcast", "off"]
BUFFER_RULES: tuple[BufferRule, ...] = ("average", "broadcast", "off")


def other_buffers(module: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """``(owner, attribute, qualified name)`` of every buffer of ``module`` but
    BatchNorm's running statistics and batch counter.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.BatchNorm1d(2))
        >>> net.register_buffer("steps", torch.zeros(()))
        >>> [name for _, _, name in other_buffers(net)]
        ['steps']
    """
    out = []
    for prefix, m in module.named_modules():
        if isinstance(m, _BatchNorm):
            continue
        for name in m._buffers:
            out.append((m, name, f"{prefix}.{name}" if prefix else name))
    return out


LATE_BYTES = 64 * 1024  # a larger CPU buffer travels only at a step some replica changed it
QUIET_STEPS = 8  # ... once no replica changed it for this many steps
_WIDE = (torch.float16, torch.bfloat16, torch.float32)  # averaged in float64


class BufferSync:
    """One replica's side of the buffer rule: what it sends, and how it applies the
    sums. ``owners`` are `other_buffers` of the replica's copy (a buffer may be
    ``None``, as InstanceNorm's are without running statistics: it is not sent).
    ``defer``: a CPU buffer over `LATE_BYTES` that no replica changed in the last
    `QUIET_STEPS` steps rides only as its flag in the step's all-reduce, and its
    values follow in a second one (`late`) at a step some replica changed it: a
    constant table or mask stops travelling, and a buffer changed every step or
    every few steps (an EMA) pays no second all-reduce. Every replica decides alike
    (from the summed flags). Averages of float16, bfloat16 and float32 buffers are
    taken in float64: a sum of N equal values is then exact, and the mean is the
    value (in float32, ``(y + y + y) / 3`` is not always ``y``, so a buffer every
    replica updated alike, as ``ema.mul_(0.9).add_(0.1)``, drifted from one
    device's on 3 replicas)."""

    def __init__(self, rule: BufferRule, owners: Sequence[tuple[nn.Module, str, str]],
                 num_replicas: int, *, defer: bool = False) -> None:
        self.rule = rule
        self.all = list(owners)
        self.owners = [] if rule == "off" else self.all
        self.num_replicas = num_replicas
        self.defer = defer
        self._sent: list[int] = []  # the owners whose buffer this step sends
        self._current: list[torch.Tensor] = []  # their buffers
        self._early: list[int] = []  # (indices into _current) sent with the flags
        self._late: list[int] = []  # (indices into _current) changed, sent by `late`
        self._from = (0, 1, 1.0)  # this step's global id, weight, and the weights' sum
        self._quiet = [0] * len(self.owners)  # per owner: steps since some replica changed it
        # per owner: a copy of the value the last step left (equal on every copy then,
        # and at `mirror`), or None
        self._last = [_snapshot(m._buffers[name], None) for m, name, _ in self.owners]

    def sent_names(self) -> list[str]:
        """The qualified names of the buffers a step sends with its flags now."""
        return [qualified for k, (m, name, qualified) in enumerate(self.owners)
                if (t := m._buffers[name]) is not None and not self._deferred(k, t)]

    def _deferred(self, k: int, t: torch.Tensor) -> bool:
        return (self.defer and self._quiet[k] >= QUIET_STEPS and t.device.type == "cpu"
                and t.nbytes > LATE_BYTES)

    def _contribution(self, t: torch.Tensor) -> torch.Tensor:
        global_id, weight, _ = self._from
        averaged = self.rule == "average" and t.is_floating_point()
        wire = t.detach().to(torch.uint8 if t.dtype == torch.bool else torch.float64
                             if averaged and t.dtype in _WIDE else t.dtype)
        return (wire if (averaged and weight) or (not averaged and global_id == 0)
                else torch.zeros_like(wire))

    def send(self, global_id: int, weight: int = 1) -> list[torch.Tensor]:
        """This replica's contributions (empty when there is nothing to do), then the
        flag tensor; ``weight``: 0 if its batch was empty (left out of averages)."""
        self._sent = [k for k, (m, name, _) in enumerate(self.owners)
                      if m._buffers[name] is not None]
        if not self._sent:
            return []
        self._current = [self.owners[k][0]._buffers[self.owners[k][1]]  # type: ignore[misc]
                         for k in self._sent]
        self._from = (global_id, weight, 1.0)
        self._early = [i for i, (k, t) in enumerate(zip(self._sent, self._current, strict=True))
                       if not self._deferred(k, t)]
        out = [self._contribution(self._current[i]) for i in self._early]
        pairs = [(t, self._last[k]) for k, t in zip(self._sent, self._current, strict=True)]
        device = self._current[0].device
        if device.type == "cpu":
            out.append(torch.tensor([*(float(not _same(t, last)) for t, last in pairs),
                                     float(weight)]))
        else:  # (no device sync, no copy from the host)
            out.append(torch.stack([
                *(torch.ones((), device=device) if last is None or not _alike(t, last)
                  else (bit_patterns(t) != bit_patterns(last)).any().float() for t, last in pairs),
                torch.full((), float(weight), device=device)]))
        return out

    def apply(self, sums: Sequence[torch.Tensor]) -> None:
        """Copies the all-reduced values into this replica's buffers that some replica
        changed since the last step (a deferred one's values follow: `late`)."""
        *totals, flags = sums
        self._late = []
        with torch.no_grad():
            if flags.is_cpu:
                *changed, weight = flags.tolist()
                self._from = (*self._from[:2], weight)
                early = dict(zip(self._early, totals, strict=True))
                for i, c in enumerate(changed):
                    k = self._sent[i]
                    self._quiet[k] = 0 if c else self._quiet[k] + 1
                    if c == 0:
                        continue
                    if i not in early:
                        self._late.append(i)
                        continue
                    self._take(i, early[i])
            else:  # (no device sync: chosen on the device; every buffer was sent)
                weight = flags[-1]
                for i, (t, total) in enumerate(zip(self._current, totals, strict=True)):
                    take = flags[i] > 0
                    if self.rule == "average" and t.is_floating_point():
                        take = take & (weight > 0)
                        total = total / weight
                    t.copy_(torch.where(take, total.to(t.dtype), t))
                    self._refresh(i)
        if not self._late:
            self._current = []

    def late(self) -> list[torch.Tensor]:
        """This replica's contributions of the deferred buffers some replica changed
        (the same list on every replica: the flags were summed), for a second SUM."""
        return [self._contribution(self._current[i]) for i in self._late]

    def apply_late(self, sums: Sequence[torch.Tensor]) -> None:
        """Takes the second all-reduce's sums (`late`) into the deferred buffers."""
        with torch.no_grad():
            for i, total in zip(self._late, sums, strict=True):
                self._take(i, total)
        self._late, self._current = [], []

    def _take(self, i: int, total: torch.Tensor) -> None:
        t, weight = self._current[i], self._from[2]
        if self.rule == "average" and t.is_floating_point():
            if weight == 0:  # (every replica's batch empty: nothing to take)
                self._refresh(i)
                return
            total = total / weight
        t.copy_(total)
        self._refresh(i)

    def _refresh(self, i: int) -> None:
        """The last step's value of buffer ``i`` is its value now (unchanged ones
        equal it already)."""
        k = self._sent[i]
        self._last[k] = _snapshot(self._current[i], self._last[k])

    def fingerprinted(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, buffer)`` of the buffers the divergence check compares: all of them
        under ``"off"`` (nothing keeps them equal), none otherwise."""
        if self.rule != "off":
            return []
        return [(qualified, t) for m, name, qualified in self.all
                if (t := m._buffers[name]) is not None]

    def refuse_from_first(self, rule: BufferRule) -> None:
        """Under an elastic strategy (replica 0's worker may be missing from a step):
        raises `ValueError` if the rule would take a buffer from replica 0."""
        from_first = [name for m, attr, name in self.owners
                      if (t := m._buffers[attr]) is not None
                      and (rule == "broadcast" or not t.is_floating_point())]
        if from_first:
            raise ValueError(
                f"under an elastic strategy no buffer can be taken from replica 0, whose "
                f"worker may be missing from a step; {from_first} would be (buffers="
                f"{rule!r}). Use buffers='average' with floating-point buffers, or "
                "buffers='off' and keep them equal yourself")


def batch_weight(run_args: object, r: int) -> int:
    """0 if local replica ``r``'s batch in the current ``run`` is empty (the first
    tensor among its arguments, at the top or one tuple, list or dict down, has 0
    rows), else 1 (also when it has no tensor: nothing says it is empty)."""
    if run_args is None:
        return 1
    args, kwargs = run_args(r)  # type: ignore[operator]
    for arg in (*args, *kwargs.values()):
        items = (arg.values() if isinstance(arg, dict) else arg
                 if isinstance(arg, tuple | list) else (arg,))
        for item in items:
            if isinstance(item, torch.Tensor):
                return 0 if item.dim() > 0 and item.shape[0] == 0 else 1
    return 1


def weighted_statistics(stats: list[torch.Tensor], weight: int) -> list[torch.Tensor]:
    """A replica's BatchNorm running statistics for the step's SUM, then its weight:
    zeros and 0 if its batch was empty (torch leaves the statistics of an empty batch
    as they were, so averaging them in took a fraction of the others' update)."""
    if not stats:
        return []
    sent = stats if weight else [torch.zeros_like(t) for t in stats]
    # (float32: bfloat16 counted to 256 replicas only; filled on the device, no copy)
    return [*sent, torch.full((1,), float(weight), device=stats[0].device)]


def take_statistics(stats: list[torch.Tensor], sums: Sequence[torch.Tensor]) -> None:
    """Copies the mean over the replicas that had rows into ``stats`` (unchanged when
    none had); ``sums``: `weighted_statistics` summed over the replicas."""
    *totals, weights = sums
    with torch.no_grad():
        if weights.is_cpu:
            total = weights.item()
            if total > 0:
                torch._foreach_div_(totals, total)
                torch._foreach_copy_(stats, totals)
        else:  # (no device sync: chosen on the device)
            for t, value in zip(stats, totals, strict=True):
                t.copy_(torch.where(weights > 0, value / weights, t))


def leaf_names(params: Sequence[str], stats: int, sync: BufferSync) -> list[str]:
    """How messages name the leaves of a step's all-reduce, in order: the gradients,
    the step's flags, the BatchNorm statistics and their weight, the other buffers
    and their flags."""
    return [*(f"the gradient of {name!r}" for name in params), "the step's flags",
            *["a BatchNorm running statistic"] * stats, *["their weight"] * bool(stats),
            *(f"buffer {qualified!r}" for qualified in sync.sent_names()),
            *["their flags"] * bool(sync.sent_names())]


def _alike(t: torch.Tensor, last: torch.Tensor) -> bool:
    return t.shape == last.shape and t.dtype == last.dtype and t.device == last.device


def _same(t: torch.Tensor, last: torch.Tensor | None) -> bool:
    """Whether buffer ``t`` holds the value ``last`` recorded, bit for bit (a NaN equals
    itself: compared as floats, a constant buffer with a NaN read as changed at every
    step, and averaging moved its other values by an ulp)."""
    if last is None or not _alike(t, last):
        return False
    if t.is_contiguous() and _MEMCMP and t.is_cpu:  # (3x NumPy's speed, 5x torch.equal's)
        return int(_MEMCMP[0](t.data_ptr(), last.data_ptr(), t.nbytes)) == 0
    a, b = bit_patterns(t.detach()), bit_patterns(last)
    try:
        return bool(np.array_equal(a.numpy(), b.numpy()))
    except (TypeError, RuntimeError):  # (a dtype NumPy lacks)
        return torch.equal(a, b)


def _libc_memcmp() -> list[Any]:
    """The C library's ``memcmp`` (it releases the GIL), or nothing where ctypes
    cannot find it."""
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError, TypeError):  # pragma: no cover (not Linux or macOS)
        return []
    memcmp.restype = ctypes.c_int
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    return [memcmp]


_MEMCMP = _libc_memcmp()


def _snapshot(t: torch.Tensor | None, last: torch.Tensor | None) -> torch.Tensor | None:
    """A copy of ``t``'s value, in ``last`` when it fits."""
    if t is None:
        return None
    if last is not None and _alike(t, last):
        return last.copy_(t.detach())
    return t.detach().clone()
