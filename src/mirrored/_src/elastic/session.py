"""`ElasticSession`: one worker's side of an elastic job, on torchft's `Manager`.

A step begins with a quorum (`begin`: the lighthouse names the live workers, torchft
rebuilds its Gloo process group when they changed, and a worker behind the others
loads a healthy peer's state, sent by torchft's checkpoint transport from the
callbacks registered here) and ends with the commit vote (`commit`: every live
worker applies its optimizer step, or none does). Between the two, every
cross-worker collective of the strategy goes through `allreduce`, torchft's
fault-tolerant all-reduce: an error in it (a peer died) makes the vote fail.

Before the vote, one small all-reduce checks that every worker of the step is at the
same step, in the same quorum, on the same dataset element (`agree`), so no step's
gradient mixes data of different steps even if torchft's quorum were wrong.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from ..reduce_op import ReduceOp
from .input import step_input
from .lighthouse import new_manager, require_torchft

__all__ = ["ElasticSession", "agree"]

_log = logging.getLogger("mirrored")
_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.MIN: dist.ReduceOp.MIN,
        ReduceOp.MAX: dist.ReduceOp.MAX}


def agree(local: list[int], sums: list[int]) -> list[int]:
    """The positions of ``local`` (this worker's values) that some worker of the step
    does not share, from ``sums``: the all-reduced SUM of ``[1, v, v*v for v in
    local]`` (``sum(x) == n*v`` and ``sum(x*x) == n*v*v`` hold only when every ``x``
    is ``v``).

    Example:
        >>> agree([5, 7], [2, 10, 50, 14, 98])  # two workers at step 5, element 7
        []
        >>> agree([5, 7], [2, 11, 61, 14, 98])  # one at step 5, one at step 6
        [0]
    """
    n = sums[0]
    return [k for k, v in enumerate(local)
            if sums[1 + 2 * k] != n * v or sums[2 + 2 * k] != n * v * v]


class ElasticSession:
    """Quorum, commit vote and live recovery for one worker (see the module's
    docstring). Read-only members tell where the job stands: `step`, `num_workers`.

    Args:
        lighthouse_address: the `Lighthouse`'s address.
        worker_index: this worker's place in the job (its replicas' ids follow from it).
        min_workers: a step is committed only with at least this many workers.
        timeout_seconds: bound on each all-reduce, commit vote and state transfer.
        quorum_timeout_seconds: bound on waiting for a quorum.

    Raises:
        ImportError: torchft is not installed.
    """

    def __init__(self, *, lighthouse_address: str, worker_index: int, min_workers: int,
                 timeout_seconds: float, quorum_timeout_seconds: float) -> None:
        require_torchft("ElasticMirroredStrategy")
        self._tracked: list[Any] = []
        self._open = False  # a step has begun and is not voted yet
        self._begun = False  # a quorum was ever asked for
        self.element = -1  # the dataset element of the open step (-1: none)
        self._members = (-1, 0)
        self._store, self._manager = new_manager(
            worker_id=f"worker{worker_index}", lighthouse_address=lighthouse_address,
            min_workers=min_workers, timeout_seconds=timeout_seconds,
            quorum_timeout_seconds=quorum_timeout_seconds, state_dict=self._state,
            load_state_dict=self._load)

    @property
    def step(self) -> int:
        """Committed steps of the job (after a rejoin: the healthy peer's count)."""
        return int(self._manager.current_step())

    @property
    def num_workers(self) -> int:
        """How many workers take part in the current step (0 before the first)."""
        return int(self._manager.num_participants())

    def track(self, obj: Any) -> None:
        """Registers an object whose ``state_dict`` goes to a rejoining worker, which
        loads it: the strategy tracks every mirrored module and optimizer; track an LR
        scheduler, a ``GradScaler`` or an EMA model yourself (every worker tracks the
        same objects, in the same order)."""
        self._tracked.append(obj)

    def feed(self, source: Any, options: Any, kind: str) -> tuple[Any, Any]:
        """A distributed dataset's source indexed by step (`StepSource`)."""
        return step_input(self, source, options, kind)

    def begin(self) -> None:
        """Starts a step unless one is open: waits for the quorum, and (a worker behind
        the others) loads a healthy peer's state. Main thread, outside ``run``."""
        if self._open:
            return
        self._manager.start_quorum()
        self._open = self._begun = True
        members = (self._quorum_id(), self.num_workers)
        if members != self._members:
            _log.info("elastic: step %d with %d worker(s) (quorum %d)", self.step, members[1],
                      members[0])
            self._members = members

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        """``tensor`` (host) combined in place over the workers of the step. After an
        error (a peer lost) the result is this worker's own, and the step is not
        committed."""
        if not self._begun:  # a reduction before the first step: the first quorum
            self.begin()
        self._manager.allreduce(tensor, reduce_op=_OPS[op]).wait()

    def commit(self) -> bool:
        """The step's vote: whether every worker of the step applies its update.

        Raises:
            RuntimeError: no step is open (a second optimizer step in one step).
        """
        if not self._open:
            raise RuntimeError(
                "an elastic step has one optimizer step: this one was already voted on. "
                "Begin the next step with the next batch of the distributed dataset or the "
                "next strategy.run")
        local = [self.step, self.element, self._quorum_id()]
        check = torch.tensor([1, *(x for v in local for x in (v, v * v))], dtype=torch.int64)
        self._manager.allreduce(check, reduce_op=dist.ReduceOp.SUM).wait()
        if self._manager.errored() is None and (differ := agree(local, check.tolist())):
            names = ", ".join(("step", "dataset element", "quorum")[k] for k in differ)
            self._manager.report_error(RuntimeError(f"the workers of the step differ in {names}"))
            _log.error("elastic: the workers of step %d differ in %s; not committed", local[0],
                       names)
        self._open = False
        self.element = -1
        committed = bool(self._manager.should_commit())
        if not committed:
            _log.warning("elastic: step %d not committed (a worker was lost or failed)",
                         local[0])
        return committed

    def close(self) -> None:
        """Leaves the job (the others drop this worker at their next quorum)."""
        self._manager.shutdown(wait=False)

    def _quorum_id(self) -> int:
        # torchft 0.2.0 keeps the quorum id private (Manager._quorum_id).
        return int(getattr(self._manager, "_quorum_id", -1))

    def _state(self) -> dict[str, Any]:
        return {"tracked": [obj.state_dict() for obj in self._tracked]}

    def _load(self, state: dict[str, Any]) -> None:
        states = state["tracked"]
        if len(states) != len(self._tracked):
            raise RuntimeError(f"a healthy peer sent the state of {len(states)} mirrored "
                               f"modules and optimizers; this worker has {len(self._tracked)}: "
                               "every worker must build the same ones, in the same order")
        for obj, obj_state in zip(self._tracked, states, strict=True):
            obj.load_state_dict(obj_state)

