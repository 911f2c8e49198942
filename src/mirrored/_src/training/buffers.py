"""The rule for buffers other than BatchNorm's (a running counter, an EMA updated in
``forward``), applied at every optimizer step so the copies never drift apart.

``"average"`` (the default): floating-point buffers become their mean over the
replicas, as BatchNorm's running statistics do; integer and bool buffers are taken
from replica 0. ``"broadcast"``: every such buffer is taken from replica 0
(``DistributedDataParallel(broadcast_buffers=True)``). ``"off"``: buffers are left
alone, and the optimizer's check raises if they differ. The values travel in the
step's fused all-reduce (SUM): a buffer taken from replica 0 is sent by replica 0
and as zeros by the others, so the sum is replica 0's value exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["BUFFER_RULES", "BufferRule", "BufferSync", "other_buffers"]

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


class BufferSync:
    """One replica's side of the buffer rule: what it sends, and how it applies the
    sums. ``owners`` are `other_buffers` of the replica's copy."""

    def __init__(self, rule: BufferRule, owners: Sequence[tuple[nn.Module, str, str]],
                 num_replicas: int) -> None:
        self.rule = rule
        self.all = list(owners)
        self.owners = [] if rule == "off" else self.all
        self.num_replicas = num_replicas
        self._current: list[torch.Tensor] = []

    def send(self, global_id: int) -> list[torch.Tensor]:
        """This replica's contributions (empty when there is nothing to do)."""
        if not self.owners:
            return []
        self._current = [t for m, name, _ in self.owners
                         if (t := m._buffers[name]) is not None]
        out = []
        for t in self._current:
            wire = t.detach().to(torch.uint8) if t.dtype == torch.bool else t.detach()
            averaged = self.rule == "average" and t.is_floating_point()
            out.append(wire if averaged or global_id == 0 else torch.zeros_like(wire))
        return out

    def apply(self, sums: Sequence[torch.Tensor]) -> None:
        """Copies the all-reduced values into this replica's buffers."""
        with torch.no_grad():
            for t, total in zip(self._current, sums, strict=True):
                if self.rule == "average" and t.is_floating_point():
                    total = total / self.num_replicas
                t.copy_(total)
        self._current = []

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
