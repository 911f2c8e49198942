"""`MirroredModule`: one copy of a torch module per local replica device, itself a
``torch.nn.Module`` that behaves like the module it wraps.

Owns the copies and the rule for which copy the current code sees: a replica
inside ``strategy.run`` sees its own copy; cross-replica code (a scope, a
``merge_fn``, or plain code while no ``run`` is in flight) sees replica 0's.
Any other thread is refused. The ``nn.Module`` members are in `CopiesModule`;
here are the lookup (one dict probe on the hot path), attribute delegation,
pickling as replica 0's plain module, ``torch.compile`` before and after
`mirror`, and the BatchNorm statistics a mirrored optimizer averages after each
step (the other buffers follow ``mirror_optimizer(buffers=)``)."""

from __future__ import annotations

import copyreg
import sys
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, SupportsIndex, cast

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .. import context
from ..devices import parse_device
from ..lazy_torch import skip_in_dynamo
from .batch_norm import convert_batch_norm
from .carry import hook_outputs
from .copies import CopiesModule
from .copying import copy_to, refuse_per_replica_layers, warn_gradient_hooks
from .plain_optimizer import register_copies
from .structure import CHANGES, expose, settle, watch

if TYPE_CHECKING:
    from mirrored import ReplicaContext, Strategy

__all__ = ["MirroredModule", "as_mirrored_module", "mirror", "replica_index", "replica_of"]

_PLAIN = (bool, int, float, complex, str, bytes, type(None))  # (read: nothing to change)


def replica_index(strategy: Strategy, what: str, *, required: bool,
                  known: dict[Any, int] | None = None) -> int | None:
    """The local index of the calling replica of ``strategy``, or ``None`` for
    cross-replica code (only when ``required`` is false). ``known``: the strategy's
    replica contexts mapped to their local indices (`MirroredModule`'s), a faster
    lookup for the common case.

    Raises:
        RuntimeError: the caller is a replica of another strategy, a thread that is
            not a replica while ``strategy.run`` is in flight, or (``required``)
            not inside ``strategy.run``.
    """
    ctx = context.current_replica_context()
    if known is not None and (index := known.get(ctx)) is not None:
        return index
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


def replica_of(strategy: Strategy, what: str, known: dict[Any, int] | None = None
               ) -> tuple[ReplicaContext, int]:
    """The calling replica's context and local index; raises as `replica_index`
    with ``required=True``."""
    ctx = context.current_replica_context()
    if known is not None and ctx is not None and (index := known.get(ctx)) is not None:
        return ctx, index
    if ctx is None or ctx.strategy is not strategy:
        replica_index(strategy, what, required=True)  # raises the right error
        raise RuntimeError(f"{what} must be called inside strategy.run")  # unreachable
    return ctx, ctx.replica_id_in_sync_group % len(strategy.extended.worker_devices)


class MirroredModule(CopiesModule):
    """One copy of a module per local replica device, equal at creation; a
    ``torch.nn.Module`` that behaves like the module it wraps.

    Inside ``strategy.run`` each replica calls (and sees the parameters and
    attributes of) its own copy; elsewhere the module behaves like replica 0's copy.
    Members that change the module (``train``, ``apply``, ``half``, hooks, attribute
    assignment) act on every copy outside ``run`` and on the replica's own copy
    inside it. ``parameters()`` yields one model's parameters, once. Outside ``run``,
    ``requires_grad`` set on replica 0's copy reaches every copy at the next ``run``; a
    layout change on that copy alone raises there. ``pickle``/``torch.save``/
    ``copy.deepcopy`` give a plain module: a copy of replica 0's. Replica 0's copy is
    the module given to `mirror` (moved to the first device); the others are deep
    copies. Build with `mirror`, train with `mirror_optimizer`.

    Example:
        >>> import torch, mirrored
        >>> from mirrored._src.training.module import mirror
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> model = mirror(strategy, torch.nn.Linear(2, 1))
        >>> out = strategy.run(model, args=(mirrored.PerReplica([torch.ones(1, 2),
        ...                                                     torch.ones(3, 2)]),))
        >>> [tuple(o.shape) for o in out.values]
        [(1, 1), (3, 1)]
        >>> sorted(model.state_dict()), sum(p.numel() for p in model.parameters())
        (['bias', 'weight'], 3)
        >>> isinstance(model, torch.nn.Module), model.in_features
        (True, 2)
    """

    _strategy: Strategy
    _calls: tuple[nn.Module, ...]
    _sync_batch_norm: bool
    _averaged: tuple[list[torch.Tensor], ...] | None
    _known: dict[Any, int]

    def __init__(self, strategy: Strategy, copies: tuple[nn.Module, ...], *,
                 sync_batch_norm: bool,
                 calls: tuple[nn.Module, ...] | None = None) -> None:
        super().__init__()
        own = self.__dict__
        own["_strategy"] = strategy
        own["_devices"] = tuple(parse_device(name).torch_device
                                for name in strategy.extended.worker_devices)
        own["_calls"] = copies if calls is None else calls
        own["_sync_batch_norm"] = sync_batch_norm
        own["_averaged"] = None
        # ReplicaContext -> local index: the hot path's one lookup. Filled once here, so a
        # compiled step that inlines __call__ guards on a dict that never changes.
        n = len(copies)
        own["_known"] = {ctx: ctx.replica_id_in_sync_group % n
                         for ctx in getattr(strategy, "_contexts", ())}
        own["_mirrored_number"] = strategy._parts.next_model()  # (names optimizers' steps)
        own["_carrying"] = tuple([] for _ in copies)  # (`carry`: hooks the outputs)
        own["_carried"] = weakref.WeakSet()  # (`carry`: every optimizer's, for zero_grad)
        own["_copies"] = copies  # last: its presence marks the shell as built

    # ---------------------------------------------------- which copy code sees
    def _index(self) -> int | None:
        ctx = context.current_replica_context()
        if ctx is not None:
            index: int | None = self._known.get(ctx)
            if index is not None:
                return index
        return replica_index(self._strategy, "MirroredModule", required=False)

    def _current(self) -> nn.Module:
        return self._copies[self._index() or 0]

    def _exposed(self) -> nn.Module:
        index = self._index()
        expose(self, index is None)  # (replica 0's insides handed out: the next run checks)
        return self._copies[index or 0]

    def _targets(self) -> tuple[nn.Module, ...]:
        index = self._index()
        if index is None:  # (every copy changes: pending changes of replica 0 carried first)
            CHANGES[0] += 1
            settle(self)
            return self._copies
        return (self._copies[index],)

    def _cross_replica(self, what: str) -> None:
        if self._index() is not None:
            raise RuntimeError(f"{what} changes every replica's copy; call it outside "
                               "strategy.run, not from a replica")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Calls the current copy (see `module`; the replica lookup inlined: a hot path)."""
        ctx = s[-1].replica_context if (s := context._state.stack) and s[-1].in_run else None
        index = self._known.get(ctx) if ctx is not None else None
        if index is None:
            index = self._index()
            if index is None:  # replica 0's copy, outside run: what it writes (buffers,
                expose(self, True)  # a lazy module's init) reaches the others at the next run
                index = 0
        output = _run_copy(self._calls[index], *args, **kwargs)
        if self._carrying[index]:
            hook_outputs(output, self._carrying[index], index)
        return output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The current copy's ``forward`` (without its hooks, as in torch)."""
        return self._calls[self._index() or 0].forward(*args, **kwargs)

    # ------------------------------------------------------------- properties
    @property
    def strategy(self) -> Strategy:
        """The strategy whose replicas own the copies."""
        return self._strategy

    @property
    def replicas(self) -> tuple[nn.Module, ...]:
        """Every local copy (plain modules), in local replica order (index 0 is replica 0's)."""
        CHANGES[0] += 1  # (changed one by one: the next run compares them)
        return self._copies

    @property
    def sync_batch_norm(self) -> bool:
        """Whether BatchNorm layers normalize with global batch statistics."""
        return self._sync_batch_norm

    @property
    def module(self) -> nn.Module:
        """The copy the calling code sees: its own in a replica, else replica 0's."""
        return self._exposed()

    # --------------------------------------------------- attribute delegation
    def __getattr__(self, name: str) -> Any:
        if "_copies" not in self.__dict__:  # during construction or unpickling
            raise AttributeError(name)
        index = self._index()  # (once: methods such as init_hidden are read in every step)
        value = getattr(self._copies[index or 0], name)
        expose(self, index is None and not isinstance(value, _PLAIN))  # (as `_exposed`)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        if "_copies" not in self.__dict__ or name in _OWN:
            object.__setattr__(self, name, value)
            return
        targets = self._targets()
        for c, v in zip(targets, self._replicated(value, targets), strict=True):
            setattr(c, name, v)

    def __delattr__(self, name: str) -> None:
        for c in self._targets():
            delattr(c, name)

    def __dir__(self) -> list[str]:
        return sorted(set(object.__dir__(self)) | set(dir(self._current())))

    def __getitem__(self, key: Any) -> Any:
        return self._exposed()[key]  # type: ignore[index]

    def __len__(self) -> int:
        return len(self._current())  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._exposed())  # type: ignore[call-overload,no-any-return]

    def __bool__(self) -> bool:
        return True

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        """``pickle``, ``torch.save`` and ``copy.deepcopy`` see replica 0's copy: they
        give a plain module (the copies are equal)."""
        reduced = self._copies[0].__reduce_ex__(protocol)
        if isinstance(reduced, tuple) and reduced[0] is _NEWOBJ and len(reduced[1]) == 1:
            # pickle checks that __newobj__ builds the class of the object pickled
            return (_RECONSTRUCTOR, (reduced[1][0], object, None), *reduced[2:])
        return reduced

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``torch.nn.Module.compile`` of every copy (in place, same arguments)."""
        self._cross_replica("MirroredModule.compile")
        for c in self._calls:
            c.compile(*args, **kwargs)

    # ----------------------------------------------------------------- buffers
    def averaged_buffers(self, index: int) -> list[torch.Tensor]:
        """The buffers of copy ``index`` that a mirrored optimizer averages across
        replicas after each step: BatchNorm running means and variances, unless
        ``sync_batch_norm`` keeps them equal already."""
        if self._averaged is None:
            self._averaged = tuple([] if self._sync_batch_norm else [
                t for m in c.modules() if isinstance(m, _BatchNorm) and m.track_running_stats
                for t in (m.running_mean, m.running_var) if t is not None] for c in self._copies)
        return self._averaged[index]

    def __repr__(self) -> str:
        return (f"MirroredModule({len(self._copies)} copies of "
                f"{type(self._copies[0]).__name__}, sync_batch_norm={self._sync_batch_norm})")


_NEWOBJ = getattr(copyreg, "__newobj__")  # noqa: B009 (not in typeshed)
_RECONSTRUCTOR = getattr(copyreg, "_reconstructor")  # noqa: B009
# Attributes of the shell itself (assigned on it, never forwarded to the copies).
_OWN = frozenset({"_strategy", "_devices", "_calls", "_sync_batch_norm",
                  "_averaged", "_known", "_mirrored_number", "_copies", "training"})


def _run_copy(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Calls one copy. Under ``torch.compile`` this is the frame dynamo compiles (a
    compiled function calling the model breaks its graph at ``MirroredModule.__call__``):
    its guards name that copy alone, and no library bookkeeping is traced."""
    return module(*args, **kwargs)


skip_in_dynamo(MirroredModule.__call__, reason="a mirrored model picks the replica's copy "
               "eagerly (each copy compiled on its own): a graph break; drop fullgraph=True")


def _compiled_wrapper(module: nn.Module) -> Any:
    """The ``torch.compile`` context of ``module`` if it is an ``OptimizedModule``
    (looked up only if dynamo was imported: nothing is compiled otherwise)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    optimized = getattr(eval_frame, "OptimizedModule", None)
    return module.dynamo_ctx if optimized is not None and isinstance(module, optimized) else None


def as_mirrored_module(obj: object) -> MirroredModule | None:
    """``obj`` as a `MirroredModule`: itself, or the mirrored module that
    ``torch.compile`` wrapped; ``None`` for anything else."""
    if isinstance(obj, MirroredModule):
        return obj
    if isinstance(obj, nn.Module) and _compiled_wrapper(obj) is not None:
        inner = obj._orig_mod
        return inner if isinstance(inner, MirroredModule) else None
    return None


def mirror(strategy: Strategy, module: nn.Module, *,
           sync_batch_norm: bool = False) -> MirroredModule:
    """Mirrors ``module`` over the local replica devices of ``strategy``.

    ``module`` itself becomes replica 0's copy (moved to the first device in place);
    the other copies are deep copies moved to their devices. With
    ``sync_batch_norm=True`` every BatchNorm layer (in every copy, ``module``
    included) is replaced by a `MirroredBatchNorm` that normalizes with the
    statistics of the global batch; state dict keys do not change. A module
    compiled with ``torch.compile`` is mirrored as the module it wraps, and every
    copy is compiled with the same settings.

    Args:
        strategy: the strategy whose replicas train the module.
        module: a ``torch.nn.Module`` (or ``torch.compile`` of one).
        sync_batch_norm: use global-batch BatchNorm statistics.

    Returns:
        The `MirroredModule`.

    Raises:
        TypeError: ``module`` is not a ``torch.nn.Module``, or was compiled in place
            with ``module.compile()`` (compile the mirrored module instead).
        ValueError: an ``nn.Embedding`` or ``nn.EmbeddingBag`` with ``max_norm``, on
            more than one replica (it changes its weight from each replica's batch).
        RuntimeError: called inside ``strategy.run``.

    Example:
        >>> import torch, mirrored
        >>> from mirrored._src.training.module import mirror
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> model = mirror(strategy, torch.nn.BatchNorm1d(3), sync_batch_norm=True)
        >>> type(model.replicas[1]).__name__
        'MirroredBatchNorm1d'
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"mirror(strategy, module) takes a torch.nn.Module; got "
                        f"{type(module).__name__}")
    if not isinstance(sync_batch_norm, bool):
        raise TypeError(f"sync_batch_norm must be a bool; got {sync_batch_norm!r}")
    if context.current_replica_context() is not None and context.has_strategy():
        raise RuntimeError("mirror(strategy, module) must be called outside strategy.run")
    if isinstance(module, MirroredModule):
        raise TypeError("mirror(strategy, module) got a MirroredModule; mirror the plain "
                        "module once")
    compiler = _compiled_wrapper(module)
    if compiler is not None:  # torch.compile(module): mirror the module it wraps
        module = cast(nn.Module, module._orig_mod)
    inplace = [name or "the module" for name, m in module.named_modules()
               if getattr(m, "_compiled_call_impl", None) is not None]
    if inplace:
        raise TypeError(f"mirror(strategy, module): {inplace[0]} was compiled in place with "
                        ".compile(), which a copy cannot carry over; mirror the plain module and "
                        "call model.compile() on the mirrored model (or mirror torch.compile(m))")
    refuse_per_replica_layers(module, sync_batch_norm, strategy.num_replicas_in_sync)
    devices = [parse_device(name).torch_device for name in strategy.extended.worker_devices]
    if sync_batch_norm:
        module = convert_batch_norm(module)
    if strategy.num_replicas_in_sync > 1:
        warn_gradient_hooks(module)
    copies = [module.to(devices[0]), *(copy_to(module, device) for device in devices[1:])]
    calls = None if compiler is None else tuple(compiler(c) for c in copies)
    register_copies(copies, strategy)  # (a plain optimizer over them is refused)
    mirrored = MirroredModule(strategy, tuple(copies), sync_batch_norm=sync_batch_norm,
                              calls=calls)
    if len(copies) > 1:
        watch(mirrored)  # (changes reaching replica 0's copy alone are caught)
    return mirrored
