"""`Communicator`: the only part of a strategy that moves data between replicas.

Every reduction of the library (``strategy.reduce``, ``gather``, the replica
context's ``all_reduce``/``all_gather``, ``extended.reduce_to``,
``batch_reduce_to`` and ``broadcast_to``) ends in one of these three calls. A
single-process strategy uses a `CrossDeviceOps` (which implements the protocol);
a multi-worker one wraps it in a two-level communicator (local replicas first,
then one ``torch.distributed`` collective across workers per pack); element
counts for exact means travel through ``sum_counts`` (a sum along an axis across
workers sends them in its ``reduce_packed`` call instead). The math
around the calls (axis pre-reduction, counts, MEAN division, promotion) lives
in ``reduction`` and never changes with the transport.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from ..devices import Device
from ..reduce_op import ReduceOp

__all__ = ["Communicator"]


@runtime_checkable
class Communicator(Protocol):
    """Moves data between the replicas of a job.

    All components passed in are this worker's *local* replicas' components, in
    local replica order; results are the *global* combination (across every
    worker), one new tensor per destination device, none aliasing an input or
    another result.
    """

    def reduce_packed(self, reduce_op: ReduceOp, per_replica: Sequence[Sequence[torch.Tensor]],
                      destinations: Sequence[tuple[Device, ...]], bytes_per_pack: int,
                      label: str = "") -> list[list[torch.Tensor]]:
        """Combines many values with SUM, MIN or MAX, fused into packs.

        Args:
            reduce_op: SUM, MIN or MAX (MEAN is SUM plus a division done by the caller).
            per_replica: ``per_replica[r][k]`` is local replica ``r``'s component of
                value ``k``; the components of one value have one shape and dtype.
            destinations: ``destinations[k]`` are the devices value ``k`` goes to.
            bytes_per_pack: the most bytes one pack of several values may hold (0: no
                limit).
            label: what the values are, when their shapes alone do not say (e.g.
                which mirrored optimizer's gradients): part of the call's identity
                that the workers compare; unused in one process, where the replicas'
                own meeting compares it.

        Returns:
            ``out[k][d]``: value ``k`` combined over every replica, on its ``d``-th
            destination.
        """
        ...

    def gather(self, per_replica: Sequence[torch.Tensor], dim: int,
               destinations: tuple[Device, ...]) -> tuple[list[torch.Tensor], list[int]]:
        """Concatenates every replica's component along ``dim``, in global replica order.

        Components may differ in size along ``dim`` only.

        Returns:
            One copy of the concatenation per destination, and the size along
            ``dim`` that each global replica contributed.
        """
        ...

    def broadcast(self, tensor: torch.Tensor, destinations: tuple[Device, ...]
                  ) -> list[torch.Tensor]:
        """One new copy of ``tensor`` per destination device."""
        ...

    def sum_counts(self, per_replica: Sequence[Sequence[int]], what: str = "") -> list[int]:
        """Global element counts: ``per_replica[r][k]`` is local replica ``r``'s count
        for value ``k``; returns each value's count summed over every replica
        (``what``: the counts' name in the call's identity, if not the default)."""
        ...
