"""`StepHyperParameters`: the hyper-parameters every local replica steps with.

Each replica steps its own torch optimizer; the learning rate and the other entries
of the parameter groups are replica 0's (a scheduler sets them on replica 0's, see
`MirroredOptimizer.param_groups`). Replica 0 publishes them as its ``step()`` finds
them, before the step's all-reduce, and every other local replica takes them after
that all-reduce: the meeting orders the two. Read from replica 0's optimizer after
the meeting instead, a step function that changes the learning rate after
``optimizer.step()`` raced with the replicas still stepping (some took the next
step's rate).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["StepHyperParameters"]


class StepHyperParameters:
    """Replica 0's parameter groups (without their parameters) by step number.

    Example:
        >>> import torch
        >>> ps = [torch.zeros(1, requires_grad=True) for _ in range(2)]
        >>> opts = [torch.optim.SGD([p], lr=0.1) for p in ps]
        >>> hyper = StepHyperParameters(opts)
        >>> hyper.publish(0, 7)
        >>> opts[0].param_groups[0]["lr"] = 0.5  # replica 0 moved on
        >>> hyper.take(1, 7)
        >>> opts[1].param_groups[0]["lr"]
        0.1
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self._optimizers = optimizers
        self._by_step: dict[int, list[dict[str, Any]]] = {}

    def publish(self, r: int, step: int) -> None:
        """Replica ``r``'s call before the all-reduce of ``step``: replica 0 records."""
        if r == 0 and len(self._optimizers) > 1:
            self._by_step[step] = [
                {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                 for k, v in group.items() if k != "params"}
                for group in self._optimizers[0].param_groups]
            self._by_step.pop(step - 2, None)

    def take(self, r: int, step: int) -> None:
        """Replica ``r`` (not 0), after the all-reduce of ``step``: sets replica 0's."""
        for source, target in zip(self._by_step[step], self._optimizers[r].param_groups,
                                  strict=True):
            target.update(source)
