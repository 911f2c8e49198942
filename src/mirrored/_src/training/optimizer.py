"""`MirroredOptimizer`: one torch optimizer per copy of a `MirroredModule`, stepped
in lockstep on all-reduced gradients.

``step()`` (in every replica, inside ``strategy.run``) makes ONE all-reduce (SUM) of
the replica's gradients, a presence flag per parameter, the copies' fingerprints
(`check`), the BatchNorm running statistics to average and the other buffers
(`buffers`), packed per dtype into few transfers. Every replica then assigns the
reduced gradients (views of the packed result, no copy), compares the fingerprints,
optionally clips the gradients by their global norm, copies replica 0's
hyper-parameters into its own optimizer and steps it. The reduced values are bitwise
identical on every replica, so the copies stay bitwise equal.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import context
from ..errors import ReplicaDivergenceError
from . import agreement, amp, clipping, direct, torch_hooks
from . import overlap as _overlap
from .buffers import BUFFER_RULES, BufferRule
from .check import CHECKS, STEPS, Check, discarded_message
from .gradient_watch import GradientWatch
from .hyper import StepHyperParameters
from .module import MirroredModule, as_mirrored_module, replica_index, replica_of
from .plain_optimizer import check_made, refuse_scheduler, trust
from .reducer import GradientReducer
from .structure import check_module

if TYPE_CHECKING:
    from mirrored import ReplicaContext, Strategy

__all__ = ["MirroredOptimizer", "mirror_optimizer"]

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class MirroredOptimizer(torch.optim.Optimizer):
    """Steps every replica's optimizer with gradients all-reduced across replicas.

    A ``torch.optim.Optimizer`` (so LR schedulers accept it) whose ``param_groups``,
    ``state`` and ``defaults`` are replica 0's optimizer's: a scheduler or user changing
    ``param_groups[i]["lr"]`` changes replica 0's, and each replica copies replica 0's
    hyper-parameters into its own optimizer at ``step()``. Build with `mirror_optimizer`.

    Gradients that are ``None`` on a replica (an unused parameter, an empty batch that
    skipped a branch) count as zeros in the all-reduce, so every replica makes the same
    collective; a parameter whose gradient is ``None`` on every replica keeps ``None``
    and is skipped by the optimizer, as in single-device training.

    Example:
        >>> import torch, mirrored
        >>> from mirrored._src.training.module import mirror
        >>> from mirrored._src.training.optimizer import mirror_optimizer
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> model = mirror(strategy, torch.nn.Linear(1, 1, bias=False))
        >>> model.load_state_dict({"weight": torch.tensor([[0.0]])})
        <All keys matched successfully>
        >>> opt = mirror_optimizer(strategy, model, lambda p: torch.optim.SGD(p, lr=1.0))
        >>> def step(x):
        ...     loss = mirrored.compute_average_loss(model(x).squeeze(1) - x.squeeze(1))
        ...     loss.backward()
        ...     opt.step()
        >>> x = mirrored.PerReplica([torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0]])])
        >>> strategy.run(step, args=(x,))
        >>> model.state_dict()["weight"]  # grad = mean(x) = 2, on both copies
        tensor([[-2.]])
    """

    def __init__(self, module: MirroredModule, optimizers: tuple[torch.optim.Optimizer, ...],
                 params: tuple[list[nn.Parameter], ...], names: list[str], *,
                 check: Check = "cheap", buffers: BufferRule = "average",
                 overlap: bool = False) -> None:
        # Not Optimizer.__init__ (its own param groups): its hook tables, for torch's hooks.
        for table in ("step_pre", "step_post", "state_dict_pre", "state_dict_post",
                      "load_state_dict_pre", "load_state_dict_post"):
            setattr(self, f"_optimizer_{table}_hooks", OrderedDict())
        self._module, self._strategy = module, module.strategy
        self._known = module._known  # replica context -> local index (the fast lookup)
        self._optimizers, self._params, self._names = trust(self, optimizers), params, names
        parts = module.strategy._parts  # one replica in all: no reducer call, the same refusals
        self._solo = parts.topology.num_replicas_in_sync == 1 and parts.cluster is None
        self._watch = GradientWatch(params, check) if self._solo and check != "off" else None
        self._hyper = StepHyperParameters(self._optimizers, params)
        self._reducer = GradientReducer(module, params, names,
                                        check="off" if self._solo else check, buffers=buffers,
                                        overlap=overlap, bucket_bytes=_overlap.DEFAULT_BUCKET_BYTES)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The parameter groups: the calling replica's optimizer's inside ``run``
        (its own gradients, for ``GradScaler.unscale_``), replica 0's elsewhere
        (the hyper-parameters of all: every replica copies them at ``step()``)."""
        r = replica_index(self._strategy, "MirroredOptimizer.param_groups", required=False)
        if r is not None:  # (inside run: not a scheduler's step; see `refuse_scheduler`)
            refuse_scheduler(len(self._optimizers))
        else:  # (the groups' parameters may change: checked at the next step)
            self._hyper.groups_handed_out()
        return self._optimizers[r or 0].param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The calling replica's optimizer's state inside ``run``, replica 0's elsewhere
        (changes to it reach every replica at the next step: `StepHyperParameters`)."""
        if (r := replica_index(self._strategy, "MirroredOptimizer.state", required=False)) is None:
            self._hyper.state_handed_out()
        return self._optimizers[r or 0].state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """Replica 0's optimizer's defaults."""
        return self._optimizers[0].defaults

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """Every replica's optimizer, in local replica order."""
        self._hyper.groups_handed_out()
        return self._optimizers

    @property
    def module(self) -> MirroredModule:
        """The mirrored module this optimizer trains."""
        return self._module

    def step(self, closure: Callable[[], Any] | None = None, *,
             clip_grad_norm: float | None = None, clip_grad_value: float | None = None) -> Any:
        """All-reduces the gradients (SUM) and steps this replica's optimizer.

        Call it in every replica, inside ``strategy.run``, after ``backward()``. With
        losses from ``compute_average_loss`` the summed gradients are those of the
        global-batch mean loss. With a ``torch.amp.GradScaler``, call
        ``scaler.step(optimizer)`` as on one device.

        Args:
            closure: optional; called once (with grad enabled) before the all-reduce,
                and its result returned (not LBFGS, which calls it several times).
            clip_grad_norm: if given, the reduced gradients are scaled so their global
                2-norm is at most this (``clip_grad_norm_`` on the reduced gradients;
                Keras' ``global_clipnorm``).
            clip_grad_value: if given, the reduced gradients are clamped to
                ``[-clip_grad_value, clip_grad_value]`` (``clip_grad_value_``; after
                the norm's clipping when both are given).

        Returns:
            The closure's result, or ``None``.

        Raises:
            RuntimeError: called outside ``run`` of the module's strategy.
            ValueError: a bad ``clip_grad_*``; replicas' ``global_batch_size``s differ.
            ReplicaDivergenceError: the copies differ, or a gradient was changed in
                place after ``backward()`` on some replica (see ``check``).
        """
        if direct.hooked(self):  # torch's step hooks (but the guard), in every replica
            return torch_hooks.step(self, MirroredOptimizer._call, closure,
                                    clip_grad_norm=clip_grad_norm, clip_grad_value=clip_grad_value)
        return self._call(closure, clip_grad_norm=clip_grad_norm, clip_grad_value=clip_grad_value)

    def _call(self, closure: Callable[[], Any] | None = None, *,
              clip_grad_norm: float | None = None, clip_grad_value: float | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step(clip_grad_norm, clip_grad_value)
        return loss

    def _step(self, clip_grad_norm: float | None, clip_grad_value: float | None) -> None:
        STEPS[0] += 1  # (`GradientWatch.discards`)
        ctx = context.current_replica_context()  # (replica_of's lookup, inlined)
        r = None if ctx is None else self._known.get(ctx)
        if ctx is None or r is None:
            ctx, r = replica_of(self._strategy, "MirroredOptimizer.step")
        if clip_grad_norm is not None or clip_grad_value is not None:
            clipping.validate(clip_grad_norm, clip_grad_value)
        params, optimizer, reducer = self._params[r], self._optimizers[r], self._reducer
        if not reducer.reduced[r]:
            self._settle(ctx, r)
        elif r == 0:  # (all-reduced by GradScaler.unscale_: published then)
            self._hyper.check(reducer.seq[0] - 1)
        reducer.reduced[r] = False
        if not reducer.committed[r]:  # elastic: a step the workers did not commit
            return
        if r:  # replica 0's, as its step() found them (it may have changed them since)
            self._hyper.take(r, reducer.seq[r] - 1)
        if clip_grad_norm is not None or clip_grad_value is not None:
            clipping.clip(params, clip_grad_norm, clip_grad_value)
        direct.step(optimizer)  # (its own hooks and ranges if it has any)
        if reducer.carried is not None:  # (a gradient left in .grad counts once: `carry`)
            reducer.carried.record(r)

    def _settle(self, ctx: ReplicaContext, r: int) -> None:
        """All-reduces replica ``r``'s gradients (one replica in all: the watch's refusals)."""
        if not self._solo:
            self._hyper.publish(r, self._reducer.seq[r])
            try:
                self._reducer.reduce(ctx, r)
            except BaseException:  # refused or released: zero_grad() then drops the grads
                if (watch := self._reducer._watch) is not None:
                    # of every local replica: the run failed as a whole, and a backward that
                    # reached another's copy may have left records there after its step failed
                    watch.clear_all()
                raise
            return
        if self._watch is not None:
            self._watch.settle(r, self._names, lambda: ctx.replica_id_in_sync_group, 1)
        self._reducer.reduced[r] = True

    # ------------------------------------------------------------ GradScaler
    def amp_replica(self) -> int | None:
        """The calling replica's index when a ``GradScaler`` acts for N (`amp`), or ``None``."""
        if self._strategy.num_replicas_in_sync == 1:
            return None
        return replica_index(self._strategy, "GradScaler.step", required=False)

    def amp_settle(self, stepped: bool) -> None:
        """torch's own scaler (one replica, or disabled): gradients settled (on N, all-reduced)
        before its ``unscale_`` (changed since ``backward()``: refused), used up after ``step``."""
        r = replica_index(self._strategy, "GradScaler.unscale_", required=False)
        if r is not None and stepped:
            self._reducer.reduced[r] = False
        elif r is not None and not self._reducer.reduced[r]:
            self._settle(*replica_of(self._strategy, "GradScaler.unscale_"))

    def amp_unscale(self, inv_scale: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``GradScaler.unscale_`` on the all-reduced gradients (unscaled, inf/NaN found)."""
        ctx, r = replica_of(self._strategy, "GradScaler.unscale_")
        self._hyper.publish(r, self._reducer.seq[r])
        self._reducer.reduce(ctx, r)
        found = amp.unscale_grads(self._params[r], inv_scale)
        return found, self._reducer.seq[r]

    def amp_step(self, found_inf: torch.Tensor, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        """Steps every copy, or none if ``found_inf`` (in the reduced gradients: alike)."""
        if found_inf.item():  # (skipped alike everywhere: a step for `discards` too)
            STEPS[0] += 1
            r = replica_index(self._strategy, "GradScaler.step", required=True)
            self._reducer.reduced[r or 0] = False
            return None
        return self.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets gradients: this replica's inside ``run``, every replica's outside.

        Raises:
            ReplicaDivergenceError: the gradients of a ``backward()`` were never all-reduced
                and no mirrored optimizer stepped since, or the parameters changed since:
                a manual update (one replica in all, ``"cheap"``: on the steps it watches).
        """
        ctx = context.current_replica_context()  # (replica_index's lookup, inlined)
        r = None if ctx is None else self._known.get(ctx)
        if r is None:
            r = replica_index(self._strategy, "MirroredOptimizer.zero_grad", required=False)
        replicas = range(len(self._optimizers)) if r is None else (r,)
        watch, reduced = self._watch, self._reducer.reduced
        lost = [i for i in replicas if ((watch.discards(i) and not reduced[i])
                                        if watch is not None else self._reducer.discards(i))]
        if lost:  # (said once: the records go, and the next zero_grad() drops them)
            for w, i in ((w, i) for w in (watch, self._reducer._watch) if w for i in replicas):
                w.clear(i)
            raise ReplicaDivergenceError(discarded_message(lost[0]))
        for i in replicas:  # (all-reduced by unscale_: discarded now)
            reduced[i] = False
            if (carried := self._reducer.carried) is not None:
                carried.forget(i)
            direct.zero_grad(self._optimizers[i], set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Replica 0's optimizer's state dict (interchangeable with a plain optimizer's),
        through this optimizer's state-dict hooks (`torch_hooks`)."""
        return torch_hooks.state_dict(self, self._optimizers[0])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads ``state_dict`` into every replica's optimizer (each its own copy),
        through this optimizer's load-state-dict hooks (`torch_hooks`).

        Raises:
            RuntimeError: called from a replica.
        """
        if replica_index(self._strategy, "MirroredOptimizer.load_state_dict",
                         required=False) is not None:
            raise RuntimeError("MirroredOptimizer.load_state_dict changes every replica's "
                               "optimizer; call it outside strategy.run")
        torch_hooks.load_state_dict(self, state_dict, lambda state: [
            optimizer.load_state_dict(copy.deepcopy(state)) for optimizer in self._optimizers])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: build the optimizer with all its groups in ``make_optimizer``."""
        raise NotImplementedError("MirroredOptimizer cannot add parameter groups after "
                                  "creation; create them all in make_optimizer")

    def __repr__(self) -> str:
        return f"MirroredOptimizer({len(self._optimizers)} x {self._optimizers[0]!r})"


def mirror_optimizer(strategy: Strategy, mirrored_module: MirroredModule,
                     make_optimizer: MakeOptimizer, *, check: Check = "cheap",
                     buffers: BufferRule = "average", overlap: bool | None = None
                     ) -> MirroredOptimizer:
    """Builds ``make_optimizer(list(copy.parameters()))`` for every copy of
    ``mirrored_module`` and wraps them in a `MirroredOptimizer`.

    Args:
        strategy: the strategy ``mirrored_module`` was mirrored by.
        mirrored_module: a `MirroredModule`.
        make_optimizer: builds any ``torch.optim`` optimizer from a list of
            parameters (param groups allowed, if built the same way for every copy:
            e.g. two comprehensions over the list for decay and no-decay groups).
            Ask for ``foreach=True`` (or ``fused=True``) for speed on CPU.
        check: how ``step()`` makes sure the copies stay equal. ``"cheap"`` (the
            default): one 2-norm per parameter, compared across replicas bit for bit
            in the step's all-reduce at the first step and every 8th after, and
            gradients changed in place between ``backward()`` and ``step()`` refused at
            every step (one replica in all: the first and every 8th); ``"full"``
            (for debugging): at every step, the norms and the sum of every tensor's
            bit patterns (a one-bit difference shows); ``"off"``: no checks. A
            difference raises `ReplicaDivergenceError` at the next checked step.
        buffers: the rule for buffers other than BatchNorm's, applied at every
            step: ``"average"`` (the default: floating-point buffers averaged over
            the replicas, others taken from replica 0), ``"broadcast"`` (all taken
            from replica 0, as DDP's ``broadcast_buffers``) or ``"off"``.
        overlap: all-reduce the gradients in buckets of 25 MiB launched as backward
            produces them, so that the communication runs while backward goes on
            (as DDP's reducer); the last bucket rides in the step's all-reduce.
            ``None`` (the default): on across workers
            (`MultiWorkerMirroredStrategy`; a model under 25 MiB of gradients is one
            bucket, sent as without overlap), off between the replicas of one
            process (the sum is made by a replica thread: nothing to hide).
            ``True`` or ``False`` forces it. The parameters are bitwise the same
            either way (with 3 or more workers, up to the last bit: Gloo's ring adds
            in an order that depends on the position in the transfer).

    Raises:
        TypeError: not a `MirroredModule`, ``make_optimizer`` returned no optimizer, or
            one whose ``step`` requires a closure (LBFGS), or ``overlap`` is not a bool
            or ``None``.
        ValueError: another strategy's module, optimizers over other parameters on
            some copy, a bad ``check`` or ``buffers``, or workers' optimizers that differ.
        RuntimeError: the copies differ in layout (see `MirroredModule`).

    Example:
        >>> import torch, mirrored
        >>> from mirrored._src.training.module import mirror
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> model = mirror(strategy, torch.nn.Linear(2, 2))
        >>> opt = mirror_optimizer(strategy, model, lambda p: torch.optim.Adam(p, lr=0.1))
        >>> opt.param_groups[0]["lr"]
        0.1
    """
    if (unwrapped := as_mirrored_module(mirrored_module)) is None:  # torch.compile'd too
        raise TypeError(f"mirror_optimizer takes a MirroredModule (from strategy.mirror); got "
                        f"{type(mirrored_module).__name__}")
    mirrored_module = unwrapped
    if mirrored_module.strategy is not strategy:
        raise ValueError(f"the module was mirrored by {mirrored_module.strategy!r}, not by "
                         f"{strategy!r}; build the optimizer with the module's own strategy")
    if not callable(make_optimizer):
        raise TypeError(f"make_optimizer must be callable; got {type(make_optimizer).__name__}")
    if check not in CHECKS:
        raise ValueError(f"check must be one of {', '.join(map(repr, CHECKS))}; got {check!r}")
    if buffers not in BUFFER_RULES:
        raise ValueError(f"buffers must be one of {', '.join(map(repr, BUFFER_RULES))}; "
                         f"got {buffers!r}")
    if overlap is not None and not isinstance(overlap, bool):
        raise TypeError(f"overlap must be True, False or None (automatic); got "
                        f"{type(overlap).__name__} {overlap!r}")
    if overlap is None:  # across workers; elastic: one all-reduce carries the step's vote
        overlap = (topology := strategy._parts.topology).num_workers > 1 and not topology.elastic
    check_module(mirrored_module, full=True)  # (requires_grad set on replica 0's: copied)
    amp.install()
    optimizers, params = [], []
    positions: list[int] | None = None
    for r, module in enumerate(mirrored_module.replicas):
        optimizer = make_optimizer(list(module.parameters()))
        check_made(optimizer, r)  # (an optimizer, whose step() needs no closure)
        index = {id(p): k for k, p in enumerate(module.parameters())}
        ordered = [p for group in optimizer.param_groups for p in group["params"]]
        where = [index.get(id(p), -1) for p in ordered]
        if -1 in where or not ordered:
            raise ValueError(f"make_optimizer must build an optimizer over the parameters it "
                             f"is given; replica {r}'s optimizer has "
                             + ("none" if not ordered else "parameters of another module"))
        if positions is not None and where != positions:
            raise ValueError("make_optimizer built different parameter groups for replica "
                             f"{r} than for replica 0; build it the same way for every copy")
        positions = where
        optimizers.append(optimizer)
        params.append(ordered)
    named = {id(p): name for name, p in mirrored_module.replicas[0].named_parameters()}
    names = [named[id(p)] for p in params[0]]
    agreement.agree_on_optimizer(strategy._parts, optimizers[0])  # (multi-worker: settings)
    return MirroredOptimizer(mirrored_module, tuple(optimizers), tuple(params), names,
                             check=check, buffers=buffers, overlap=overlap)
