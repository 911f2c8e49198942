"""`Parts`: what the collectives of a strategy work with (its topology, runtime,
communicators and default options), handed over explicitly by the strategy."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ..comm.selection import CommunicatorSelector
from ..options import CommunicationOptions
from ..runtime.runtime import Runtime
from ..topology import Topology

__all__ = ["Cluster", "Parts", "StepControl"]


class StepControl(Protocol):
    """What an elastic strategy adds (`mirrored.elastic`): steps that begin with a
    quorum of the live workers and end with a commit vote."""

    @property
    def step(self) -> int:
        """The job's committed steps (the same on every worker of a step)."""
        ...

    def begin(self) -> None:
        """Starts a step (its quorum) unless one is open; called by ``run`` and by the
        distributed dataset before a batch is split."""
        ...

    def commit(self) -> bool:
        """Ends the step: whether every live worker may apply its optimizer step."""
        ...

    def track(self, obj: Any) -> None:
        """A mirrored module or optimizer whose state a rejoining worker receives."""
        ...

    def feed(self, source: Any, options: Any, kind: str) -> tuple[Any, Any]:
        """The input pipeline of a distributed dataset (``kind``: "dataset" or
        "function"), aligned with the steps."""
        ...


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Cluster:
    """What a multi-worker strategy adds to its parts.

    With a cluster, a value that is not per-replica is *this worker's* value:
    ``strategy.reduce`` combines it across workers (once per worker, whatever the
    local replica count).

    Args:
        resolver: the strategy's cluster resolver (``strategy.cluster_resolver``).
        vote: ``vote(has_data) -> any worker has data``, for distributed datasets.
        sync: overwrites tensors in place with worker 0's values (``strategy.mirror``
            starts every worker from the chief's parameters and buffers).
        leave: leaves the job (``strategy.close()``: the process group ends).
        next_phase: called when a ``run`` starts and ends, so every worker's calls
            carry the phase of the program they belong to (a skipped collective is
            caught even when the calls look alike).
        steps: the elastic strategy's step control (quorum, commit vote); ``None``
            for a fixed job.
        count_examples: whether ``experimental_distribute_dataset`` tags its steps'
            batches with their example counts (a fixed job whose calls are checked).
        took_examples: called with the global count of each run's tagged batch and a
            digest of its elements (folded into the identity of every later call:
            workers whose batches differ in size, whose ``compute_average_loss`` would
            divide by different counts, or in content, disagree at their next
            collective).
        agree: ``agree(what, value) -> every worker's value`` (one int each, in worker
            order): ``strategy.mirror`` and ``mirror_optimizer`` compare a digest of the
            module's structure and of the optimizer's settings (`training.agreement`);
            ``None``: not compared (an elastic job, whose workers join at any step).
    """

    resolver: Any
    vote: Callable[[bool], bool]
    sync: Callable[[Sequence[torch.Tensor]], None]
    leave: Callable[[], None] = lambda: None
    next_phase: Callable[[], None] = lambda: None
    steps: StepControl | None = None
    count_examples: bool = False
    took_examples: Callable[[int, int], None] = lambda total, digest: None
    agree: Callable[[str, int], list[int]] | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Parts:
    """The parts of one strategy.

    ``strategy_ref`` (a weak reference, so that a dropped strategy is collected at
    once, with its threads) is only handed to ``merge_fn``s; ``name`` is the
    strategy's class name, for messages. ``loss_divisors[i]``: the largest
    ``global_batch_size`` local replica ``i`` gave ``compute_average_loss`` since
    its run started or its gradients were last all-reduced (0: none; a mirrored
    optimizer compares them across replicas), plus 0.5 when every call that gave it
    had exactly that many rows in its loss (a per-replica size: see
    ``check.same_divisors``); ``loss_calls[i]``: how many times it
    called ``compute_average_loss`` (each mirrored optimizer notes the count at its
    step, so several optimizers stepping after one loss each see the call).
    ``copies_checked[0]``: the count of possible changes to a mirrored module's copies
    at which ``run`` last compared this strategy's copies (``training.structure``).
    ``step_examples[0]``: the `StepExamples` of the batch passed to the current ``run``
    (several workers only; ``None``: none, ``compute_average_loss`` counts);
    ``count_calls[i]``: local replica ``i``'s ``compute_average_loss`` calls without a
    size in the current run (several workers: reset when a run starts).
    ``run_args[0]``: the current ``run``'s per-replica arguments (its ``ReplicaArgs``,
    ``None`` for none): a mirrored optimizer's step leaves a replica whose batch is
    empty out of the buffers' average (`buffers.BufferSync`).
    ``models[0]``: the modules mirrored on this strategy so far; each takes the next
    number, which names its optimizers' step calls (a fixed job's workers mirror them
    in the same order: ``mirror`` starts each from the chief's values, a collective;
    an elastic job's do not, and its steps carry no call identity).
    ``bucket_owners``: weak references to the gradient buckets of the mirrored
    optimizers built on this strategy, oldest first (only the newest launches during
    backward: `training.overlap`).
    """

    strategy_ref: weakref.ReferenceType[Any]
    name: str
    topology: Topology
    runtime: Runtime
    communicators: CommunicatorSelector
    options: CommunicationOptions
    cluster: Cluster | None = None
    loss_divisors: list[float] = dataclasses.field(init=False)
    loss_calls: list[int] = dataclasses.field(init=False)
    copies_checked: list[int] = dataclasses.field(init=False)
    step_examples: list[Any] = dataclasses.field(init=False)
    count_calls: list[int] = dataclasses.field(init=False)
    models: list[int] = dataclasses.field(init=False)
    run_args: list[Any] = dataclasses.field(init=False)
    bucket_owners: list[Any] = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "loss_divisors", [0] * self.topology.num_local_replicas)
        object.__setattr__(self, "loss_calls", [0] * self.topology.num_local_replicas)
        object.__setattr__(self, "copies_checked", [0])
        object.__setattr__(self, "step_examples", [None])
        object.__setattr__(self, "count_calls", [0] * self.topology.num_local_replicas)
        object.__setattr__(self, "models", [0])
        object.__setattr__(self, "run_args", [None])
        object.__setattr__(self, "bucket_owners", [])

    def next_model(self) -> int:
        """The number of a module mirrored now (`models`)."""
        self.models[0] += 1
        return self.models[0]

    @property
    def strategy(self) -> Any:
        """The strategy (alive while anything can reach these parts through it)."""
        return self.strategy_ref()
