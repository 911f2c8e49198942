"""`Parts`: what the collectives of a strategy work with (its topology, runtime,
communicators and default options), handed over explicitly by the strategy."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..comm.selection import CommunicatorSelector
from ..options import CommunicationOptions
from ..runtime.runtime import Runtime
from ..topology import Topology

__all__ = ["Parts"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Parts:
    """The parts of one strategy.

    ``strategy`` is only handed to ``merge_fn``s; ``name`` is the strategy's class
    name, for messages.
    """

    strategy: Any
    name: str
    topology: Topology
    runtime: Runtime
    communicators: CommunicatorSelector
    options: CommunicationOptions
