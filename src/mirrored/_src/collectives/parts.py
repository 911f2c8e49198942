"""`Parts`: what the collectives of a strategy work with (its topology, runtime,
communicators and default options), handed over explicitly by the strategy."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from ..comm.selection import CommunicatorSelector
from ..options import CommunicationOptions
from ..runtime.runtime import Runtime
from ..topology import Topology

__all__ = ["Parts"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Parts:
    """The parts of one strategy.

    ``strategy_ref`` (a weak reference, so that a dropped strategy is collected at
    once, with its threads) is only handed to ``merge_fn``s; ``name`` is the
    strategy's class name, for messages.
    """

    strategy_ref: weakref.ReferenceType[Any]
    name: str
    topology: Topology
    runtime: Runtime
    communicators: CommunicatorSelector
    options: CommunicationOptions

    @property
    def strategy(self) -> Any:
        """The strategy (alive while anything can reach these parts through it)."""
        return self.strategy_ref()
