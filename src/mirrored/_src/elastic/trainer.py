"""`ElasticTrainer`: one worker of an elastic data-parallel job on torchft's `Manager`.

Each step starts with a quorum (`start_step`): the lighthouse names the live workers,
torchft reconfigures its fault-tolerant process group when they changed, and a worker
that is behind (a restarted one) receives a healthy peer's model and optimizer state
before the step, so every participant starts the step from the same state at the same
step index. The step's global batch is split over the participants (`StepInfo.shard`);
`finish_step` sums the gradients over them (one all-reduce), and the optimizer steps
only if every participant's all-reduce succeeded (torchft's commit vote). A step that
fails (a worker died in it) is not committed: the survivors redo it, with the same
global batch split over the workers still alive.

Semantics while degraded: the global batch and the loss divisor (the global batch
size) do not change, so a step's gradient is the one of the whole global batch on one
device, whatever the number of live workers; only each worker's shard grows.
`StepInfo.num_workers` is the number of workers in the step.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .lighthouse import new_manager, require_torchft

__all__ = ["ElasticTrainer", "StepInfo"]

_log = logging.getLogger("mirrored")
_V = TypeVar("_V", torch.Tensor, tuple[torch.Tensor, ...], list[torch.Tensor])


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepInfo:
    """One step as the quorum agreed it.

    Attributes:
        index: the step (the number of committed steps before it), the same on every
            participant: pick the step's global batch with it.
        rank: this worker's place among the participants (0 .. num_workers - 1).
        num_workers: how many workers take part in the step.
    """

    index: int
    rank: int
    num_workers: int

    def shard(self, value: _V) -> _V:
        """This worker's rows (dim 0) of the global batch: ``torch.tensor_split`` into
        ``num_workers`` parts (the first ``len % num_workers`` one row longer), part
        ``rank``. A tuple or list is split element-wise.

        Example:
            >>> StepInfo(index=0, rank=1, num_workers=2).shard(torch.arange(5))
            tensor([3, 4])
        """
        if isinstance(value, torch.Tensor):
            return torch.tensor_split(value, self.num_workers)[self.rank]
        if isinstance(value, tuple | list):
            return type(value)(self.shard(v) for v in value)
        raise TypeError(f"StepInfo.shard splits a tensor or a tuple/list of tensors; got "
                        f"{type(value).__name__}")


class ElasticTrainer:
    """Trains ``module`` with ``optimizer`` as one worker of an elastic job.

    Every worker builds one, with its own ``worker_id``, and loops::

        while trainer.step < steps:
            info = trainer.start_step()            # quorum; a rejoining worker heals here
            x, y = info.shard(global_batch(info.index))
            (loss_fn(module(x), y).sum() / GLOBAL_BATCH).backward()
            trainer.finish_step()                  # all-reduce, commit vote, optimizer step

    A worker that dies is left out of the next quorum (after the lighthouse's heartbeat
    timeout); the others go on without restarting. A worker started again with the
    same ``worker_id`` joins the next quorum and receives the state of a healthy peer.
    Each worker is one replica on one device (no local replicas).

    Args:
        module: this worker's model (its initial values are replaced by the first
            worker's at step 0, so every worker starts equal).
        optimizer: its optimizer.
        lighthouse_address: the `Lighthouse`'s address.
        worker_id: this worker's stable name in the job (a restart reuses it).
        min_workers: steps need at least this many workers (the commit vote fails with
            fewer, and the step is redone).
        timeout_seconds: bound on each all-reduce, commit vote and state transfer.
        quorum_timeout_seconds: bound on waiting for a quorum (`start_step` raises
            ``TimeoutError`` after it).

    Raises:
        ImportError: torchft is not installed.
        TypeError: a module that is not an ``nn.Module``, or a wrong optimizer type.
        ValueError: ``min_workers`` below 1, an empty ``worker_id``, a module with
            BatchNorm layers (their statistics are not synchronized across workers).
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *,
                 lighthouse_address: str, worker_id: str, min_workers: int = 1,
                 timeout_seconds: float = 10.0, quorum_timeout_seconds: float = 60.0) -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be a torch.nn.Module; got {type(module).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer; got "
                            f"{type(optimizer).__name__}")
        if isinstance(min_workers, bool) or not isinstance(min_workers, int) or min_workers < 1:
            raise ValueError(f"min_workers must be an int >= 1; got {min_workers!r}")
        batch_norms = [name for name, m in module.named_modules()
                       if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        if batch_norms:
            raise ValueError(
                f"ElasticTrainer does not synchronize BatchNorm across workers, so the "
                f"workers' running statistics would drift apart; {batch_norms} are "
                "BatchNorm layers. Use GroupNorm or LayerNorm (or MultiWorkerMirroredStrategy "
                "with sync_batch_norm=True)")
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id must be a non-empty str; got {worker_id!r}")
        require_torchft("ElasticTrainer")

        self._module = module
        self._optimizer = optimizer
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._store, self._manager = new_manager(
            worker_id=worker_id, lighthouse_address=lighthouse_address,
            min_workers=min_workers, timeout_seconds=timeout_seconds,
            quorum_timeout_seconds=quorum_timeout_seconds, state_dict=self._state,
            load_state_dict=self._load_state)
        self._info: StepInfo | None = None

    @property
    def step(self) -> int:
        """Committed steps (after a rejoin: the healthy peer's count)."""
        return int(self._manager.current_step())

    def start_step(self) -> StepInfo:
        """Joins this step's quorum: waits for it, reconfigures the process group when
        the workers changed, and (a worker behind the others) loads a healthy peer's
        state. Clears the gradients.

        Returns:
            The agreed step index, this worker's rank and the number of workers.

        Raises:
            TimeoutError: no quorum of ``min_workers`` within the quorum timeout.
        """
        self._optimizer.zero_grad(set_to_none=True)
        self._manager.start_quorum()
        rank = self._manager.participating_rank()
        assert rank is not None  # a synchronous quorum: every member takes part
        self._info = StepInfo(index=self.step, rank=rank,
                              num_workers=self._manager.num_participants())
        return self._info

    def finish_step(self) -> bool:
        """Sums the gradients over the step's workers and steps the optimizer if every
        worker's all-reduce succeeded (then every worker steps; otherwise none does,
        and `step` stays, so the step is redone).

        Returns:
            Whether the step was committed.

        Raises:
            RuntimeError: called without `start_step`.
        """
        if self._info is None:
            raise RuntimeError("ElasticTrainer.finish_step needs start_step first (one "
                               "start_step, forward and backward, then finish_step)")
        self._info = None
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._manager.allreduce(flat, reduce_op=dist.ReduceOp.SUM).wait()
        committed = bool(self._manager.should_commit())
        if committed:
            for p, g in zip(self._params, torch.split(flat, [g.numel() for g in grads]),
                            strict=True):
                p.grad = g.view_as(p).clone()
            self._optimizer.step()
        else:
            _log.warning("elastic: step %d not committed (a worker failed); redoing it",
                         self.step)
        return committed

    def close(self) -> None:
        """Leaves the job (the others drop this worker at their next quorum)."""
        self._manager.shutdown(wait=False)

    def _state(self) -> dict[str, Any]:
        return {"module": self._module.state_dict(), "optimizer": self._optimizer.state_dict()}

    def _load_state(self, state: dict[str, Any]) -> None:
        self._module.load_state_dict(state["module"])
        self._optimizer.load_state_dict(state["optimizer"])

