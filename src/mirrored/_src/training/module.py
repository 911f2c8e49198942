"""`MirroredModule`: one copy of a torch module per local replica device.

Owns the copies and the rule for which copy the current code sees: a replica
inside ``strategy.run`` sees its own copy; cross-replica code (a scope, a
``merge_fn``, or plain code while no ``run`` is in flight) sees replica 0's.
Any other thread is refused. It also knows which buffers a mirrored optimizer
averages after each step (BatchNorm running statistics without sync BN).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .. import context
from ..devices import parse_device
from .batch_norm import convert_batch_norm

if TYPE_CHECKING:
    from mirrored import ReplicaContext, Strategy

__all__ = ["MirroredModule", "mirror", "replica_index", "replica_of"]


def replica_index(strategy: Strategy, what: str, *, required: bool) -> int | None:
    """The local index of the calling replica of ``strategy``, or ``None`` for
    cross-replica code (only when ``required`` is false).

    Raises:
        RuntimeError: the caller is a replica of another strategy, a thread that is
            not a replica while ``strategy.run`` is in flight, or (``required``)
            not inside ``strategy.run``.
    """
    ctx = context.current_replica_context()
    if ctx is not None and ctx.strategy is strategy:
        local = len(strategy.extended.worker_devices)
        return int(ctx.replica_id_in_sync_group) % local
    if ctx is not None and context.has_strategy():
        raise RuntimeError(
            f"{what} belongs to {strategy!r} but was called inside the run of another strategy "
            f"({ctx.strategy!r}, replica {ctx.replica_id_in_sync_group}); use it inside its "
            "own strategy's run")
    if required:
        raise RuntimeError(
            f"{what} must be called inside strategy.run of {strategy!r}, by every replica "
            "(it all-reduces across replicas); it was called "
            + ("in cross-replica context" if context.in_cross_replica_context()
               else "outside strategy.run"))
    if not context.in_cross_replica_context() and context.run_in_flight(strategy):
        raise RuntimeError(
            f"{what} was called from a thread that is not a replica of {strategy!r} while its "
            "run is in flight (e.g. a thread started inside fn); call it from the replica "
            "functions themselves, or after run returns")
    return None


def replica_of(strategy: Strategy, what: str) -> tuple[ReplicaContext, int]:
    """The calling replica's context and local index; raises as `replica_index`
    with ``required=True``."""
    ctx = context.current_replica_context()
    if ctx is None or ctx.strategy is not strategy:
        replica_index(strategy, what, required=True)  # raises the right error
        raise RuntimeError(f"{what} must be called inside strategy.run")  # unreachable
    return ctx, ctx.replica_id_in_sync_group % len(strategy.extended.worker_devices)


class MirroredModule:
    """One copy of a module per local replica device, equal at creation.

    Inside ``strategy.run`` each replica calls (and sees the parameters of) its
    own copy; elsewhere the module behaves like replica 0's copy. Replica 0's
    copy is the module given to `mirror` (moved to the first device); the others
    are deep copies. Build with `mirror`, train with `mirror_optimizer`.

    Example:
        >>> import torch, mirrored
        >>> from mirrored._src.training.module import mirror
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> model = mirror(strategy, torch.nn.Linear(2, 1))
        >>> out = strategy.run(model, args=(mirrored.PerReplica([torch.ones(1, 2),
        ...                                                     torch.ones(3, 2)]),))
        >>> [tuple(o.shape) for o in out.values]
        [(1, 1), (3, 1)]
        >>> sorted(model.state_dict())
        ['bias', 'weight']
    """

    __slots__ = ("_averaged", "_copies", "_strategy", "_sync_batch_norm")

    def __init__(self, strategy: Strategy, copies: tuple[nn.Module, ...], *,
                 sync_batch_norm: bool) -> None:
        self._strategy = strategy
        self._copies = copies
        self._sync_batch_norm = sync_batch_norm
        self._averaged: tuple[list[torch.Tensor], ...] | None = None

    @property
    def strategy(self) -> Strategy:
        """The strategy whose replicas own the copies."""
        return self._strategy

    @property
    def replicas(self) -> tuple[nn.Module, ...]:
        """Every local copy, in local replica order (index 0 is replica 0's)."""
        return self._copies

    @property
    def sync_batch_norm(self) -> bool:
        """Whether BatchNorm layers normalize with global batch statistics."""
        return self._sync_batch_norm

    @property
    def module(self) -> nn.Module:
        """The copy the calling code sees: its own in a replica, else replica 0's."""
        r = replica_index(self._strategy, "MirroredModule", required=False)
        return self._copies[0 if r is None else r]

    @property
    def training(self) -> bool:
        """Whether the copies are in training mode."""
        return self._copies[0].training

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the current copy (see `module`)."""
        return self.module(*args, **kwargs)

    forward = __call__

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The current copy's parameters (`torch.nn.Module.parameters`)."""
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True
                         ) -> Iterator[tuple[str, nn.Parameter]]:
        """The current copy's named parameters."""
        return self.module.named_parameters(prefix, recurse)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        """The current copy's buffers."""
        return self.module.buffers(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """The current copy's named buffers."""
        return self.module.named_buffers(prefix, recurse)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The current copy's state dict: the same keys as the plain module's."""
        return self.module.state_dict(*args, **kwargs)

    def _cross_replica(self, what: str) -> None:
        if replica_index(self._strategy, what, required=False) is not None:
            raise RuntimeError(f"{what} changes every replica's copy; call it outside "
                               "strategy.run, not from a replica")

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Loads ``state_dict`` (a plain module's or a mirrored one's) into every copy.

        Returns:
            Replica 0's ``(missing_keys, unexpected_keys)``.

        Raises:
            RuntimeError: called from a replica, or keys do not match (``strict``).
        """
        self._cross_replica("MirroredModule.load_state_dict")
        results = [c.load_state_dict(state_dict, strict) for c in self._copies]
        return results[0]

    def train(self, mode: bool = True) -> MirroredModule:
        """Sets training mode on every copy; returns ``self``."""
        self._cross_replica("MirroredModule.train")
        for c in self._copies:
            c.train(mode)
        return self

    def eval(self) -> MirroredModule:
        """Sets evaluation mode on every copy; returns ``self``."""
        return self.train(False)

    def averaged_buffers(self, index: int) -> list[torch.Tensor]:
        """The buffers of copy ``index`` that a mirrored optimizer averages across
        replicas after each step: BatchNorm running means and variances, unless
        ``sync_batch_norm`` keeps them equal already."""
        if self._averaged is None:
            self._averaged = tuple(
                [] if self._sync_batch_norm else [
                    t for m in c.modules() if isinstance(m, _BatchNorm)
                    and m.track_running_stats
                    for t in (m.running_mean, m.running_var) if t is not None]
                for c in self._copies)
        return self._averaged[index]

    def __repr__(self) -> str:
        return (f"MirroredModule({len(self._copies)} copies of "
                f"{type(self._copies[0]).__name__}, sync_batch_norm={self._sync_batch_norm})")


def mirror(strategy: Strategy, module: nn.Module, *, sync_batch_norm: bool = False
           ) -> MirroredModule:
    """Mirrors ``module`` over the local replica devices of ``strategy``.

    ``module`` itself becomes replica 0's copy (moved to the first device in place);
    the other copies are deep copies moved to their devices. With
    ``sync_batch_norm=True`` every BatchNorm layer (in every copy, ``module``
    included) is replaced by a `MirroredBatchNorm` that normalizes with the
    statistics of the global batch; state dict keys do not change.

    Args:
        strategy: the strategy whose replicas train the module.
        module: a ``torch.nn.Module``.
        sync_batch_norm: use global-batch BatchNorm statistics.

    Returns:
        The `MirroredModule`.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``.
        RuntimeError: called inside ``strategy.run``.

    Example:
        >>> import torch, mirrored
        >>> from mirrored._src.training.module import mirror
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> model = mirror(strategy, torch.nn.BatchNorm1d(3), sync_batch_norm=True)
        >>> type(model.replicas[1]).__name__
        'MirroredBatchNorm'
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"mirror(strategy, module) takes a torch.nn.Module; got "
                        f"{type(module).__name__}")
    if not isinstance(sync_batch_norm, bool):
        raise TypeError(f"sync_batch_norm must be a bool; got {sync_batch_norm!r}")
    if context.current_replica_context() is not None and context.has_strategy():
        raise RuntimeError("mirror(strategy, module) must be called outside strategy.run "
                           "(create the mirrored module once, then use it in run)")
    devices = [parse_device(name).torch_device for name in strategy.extended.worker_devices]
    if sync_batch_norm:
        module = convert_batch_norm(module)
    copies = [module.to(devices[0])]
    for device in devices[1:]:
        copies.append(copy.deepcopy(module).to(device))
    return MirroredModule(strategy, tuple(copies), sync_batch_norm=sync_batch_norm)
