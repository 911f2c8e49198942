"""``torch.amp.GradScaler`` shared by the replicas of ``strategy.run``.

torch's scaler keeps one state per optimizer (``id(optimizer)``) and expects one
thread: N replicas calling ``scaler.step(opt)`` and ``scaler.update()`` on one
object and one `MirroredOptimizer` would unscale replica 0's gradients N times,
step some copies and not others, and update the scale N times. The first
`MirroredOptimizer` therefore wraps four of ``GradScaler``'s methods (once per
process; torch 2.3-2.13 keep these names). Outside a replica of a multi-replica
strategy, or with another optimizer, they are torch's own. Inside one, with a
`MirroredOptimizer`:

- ``unscale_(opt)`` all-reduces the gradients (the step's fused all-reduce),
  then unscales the *reduced* gradients and checks them for inf/NaN, as DDP's
  gradients are checked after its all-reduce: an inf or NaN on any replica is in
  the sum, so every replica finds the same ``found_inf``. Clipping after it
  clips the global gradients, so torch's documented clipping recipe is exact.
- ``step(opt)`` unscales if needed and steps every copy, or none.
- ``update()``: the first replica to call it for a step updates the shared
  scale; the others' calls for that step do nothing. The scale stays one tensor.
- the scale's lazy creation is locked (replicas call ``scale`` at once).

A disabled scaler (``GradScaler(enabled=use_amp)`` with ``use_amp`` false, as nanoGPT
builds it for bfloat16) is torch's own, but for ``unscale_(opt)``, which all-reduces
the gradients as an enabled one's does (on one device it does nothing, and the
gradients are already the global batch's there), so the clipping after it clips the
global gradients on N replicas too.

The per-replica stage (ready, unscaled, stepped) keeps torch's errors: a second
``unscale_`` or ``step`` before ``update`` raises as it does on one device.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from .. import context

__all__ = ["ScaledOptimizer", "install", "unscale_grads"]

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"
_LOCK = threading.Lock()
_ORIGINAL: dict[str, Callable[..., Any]] = {}


@runtime_checkable
class ScaledOptimizer(Protocol):
    """What a mirrored optimizer offers the scaler (see `MirroredOptimizer`)."""

    def amp_replica(self) -> int | None:
        """The calling replica's local index, or ``None`` if the scaler should act as
        torch's own (one replica in sync, or not in a replica)."""
        ...

    def amp_unscale(self, inv_scale: torch.Tensor) -> tuple[torch.Tensor, int]:
        """All-reduces this replica's gradients, unscales them; returns ``found_inf``
        and the step's sequence number (equal on every replica)."""
        ...

    def amp_step(self, found_inf: torch.Tensor, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> Any:
        """Steps (gradients already reduced and unscaled) unless ``found_inf``."""
        ...

    def amp_settle(self, stepped: bool) -> None:
        """Where the scaler acts as torch's own with one replica in sync: called before
        its ``unscale_`` (``stepped=False``) and after its ``step`` (``True``)."""
        ...


@dataclasses.dataclass
class _State:
    stage: str = _READY
    found_inf: torch.Tensor | None = None
    seq: int = 0


@dataclasses.dataclass
class _Record:
    """A scaler's replica-side state: per global replica id, per optimizer."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    states: dict[int, dict[int, _State]] = dataclasses.field(default_factory=dict)
    applied: list[tuple[tuple[int, int], ...]] = dataclasses.field(default_factory=list)


# Keyed by the user's scaler (weakly): the replica-side state of each scaler in use.
_RECORDS: weakref.WeakKeyDictionary[Any, _Record] = weakref.WeakKeyDictionary()


def _record(scaler: Any) -> _Record:
    with _LOCK:
        record = _RECORDS.get(scaler)
        if record is None:
            record = _RECORDS[scaler] = _Record()
        return record


def _target(scaler: Any, optimizer: Any) -> tuple[ScaledOptimizer, _State] | None:
    """The mirrored optimizer and the calling replica's state, or ``None`` where the
    scaler acts as torch's own."""
    if not getattr(scaler, "_enabled", False) or not isinstance(optimizer, ScaledOptimizer):
        return None
    if optimizer.amp_replica() is None:
        return None
    ctx = context.current_replica_context()
    assert ctx is not None  # amp_replica found one
    record = _record(scaler)
    with record.lock:
        per = record.states.setdefault(ctx.replica_id_in_sync_group, {})
        return optimizer, per.setdefault(_serial(optimizer), _State())


_SERIALS = itertools.count(1)


def _serial(optimizer: Any) -> int:
    """A number no other optimizer of this process has, ever (an ``id()`` is reused once
    its object is freed: a new optimizer's update was taken as a freed one's, done)."""
    serial: int | None = optimizer.__dict__.get("_mirrored_amp_serial")
    if serial is None:
        serial = optimizer.__dict__["_mirrored_amp_serial"] = next(_SERIALS)
    return serial


def _unscale(scaler: Any, optimizer: ScaledOptimizer, state: _State) -> None:
    if state.stage == _UNSCALED:
        raise RuntimeError("unscale_() has already been called on this optimizer since the "
                           "last update().")
    if state.stage == _STEPPED:
        raise RuntimeError("unscale_() is being called after step().")
    scale = scaler._scale
    if scale is None:
        raise RuntimeError("GradScaler.unscale_/step was called before scaler.scale(loss) in "
                           "this replica; scale the loss first")
    # Taken before the all-reduce: no replica can update the scale until all arrive.
    inv_scale = scale.double().reciprocal().float()
    state.found_inf, state.seq = optimizer.amp_unscale(inv_scale)
    state.stage = _UNSCALED


def _wrapped_unscale(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def unscale_(self: Any, optimizer: Any) -> None:
        target = _target(self, optimizer)
        if target is None:
            if isinstance(optimizer, ScaledOptimizer):  # one replica, or a disabled scaler:
                optimizer.amp_settle(stepped=False)  # all-reduced (once) as enabled on N
            return original(self, optimizer)  # type: ignore[no-any-return]
        _unscale(self, *target)
        return None
    return unscale_


def _wrapped_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def step(self: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        target = _target(self, optimizer)
        if target is None:
            result = original(self, optimizer, *args, **kwargs)
            if isinstance(optimizer, ScaledOptimizer):
                optimizer.amp_settle(stepped=True)
            return result
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is "
                               "enabled.")
        opt, state = target
        if state.stage == _STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state.stage == _READY:
            _unscale(self, opt, state)
        assert state.found_inf is not None  # set by _unscale
        result = opt.amp_step(state.found_inf, args, kwargs)
        state.stage = _STEPPED
        return result
    return step


def _wrapped_update(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def update(self: Any, new_scale: Any = None) -> None:
        record = _RECORDS.get(self) if getattr(self, "_enabled", False) else None
        if record is None:
            return original(self, new_scale)  # type: ignore[no-any-return]
        ctx = context.current_replica_context()
        with record.lock:
            if ctx is not None and ctx.num_replicas_in_sync > 1:
                steps = [record.states.pop(ctx.replica_id_in_sync_group, {})]
            else:  # outside run: every replica's step at once
                steps = list(record.states.values())
                record.states.clear()
            per = next((p for p in steps if p), None)
            if per is None:  # no mirrored step since the last update: torch's own
                return original(self, new_scale)  # type: ignore[no-any-return]
            key = tuple(sorted((oid, s.seq) for oid, s in per.items()))
            if key in record.applied:  # another replica updated the scale for this step
                return None
            record.applied = [*record.applied[-7:], key]
            if new_scale is not None:
                return original(self, new_scale)  # type: ignore[no-any-return]
            scale = self._scale
            found = [s.found_inf.to(scale.device) for s in per.values()
                     if s.found_inf is not None]
            total = found[0].clone()
            for f in found[1:]:
                total += f
            torch._amp_update_scale_(scale, self._growth_tracker, total, self._growth_factor,
                                     self._backoff_factor, self._growth_interval)
        return None
    return update


def _wrapped_lazy_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def lazy_init(self: Any, dev: torch.device) -> None:
        with _LOCK:  # replicas scale their losses at once on the first step
            if self._scale is None or self._growth_tracker is None:
                original(self, dev)
    return lazy_init


def install() -> None:
    """Wraps ``torch.amp.GradScaler``'s methods once per process (idempotent)."""
    with _LOCK:
        if _ORIGINAL:
            return
        cls = torch.amp.GradScaler
        for name, wrap in (("unscale_", _wrapped_unscale), ("step", _wrapped_step),
                           ("update", _wrapped_update),
                           ("_lazy_init_scale_growth_tracker", _wrapped_lazy_init)):
            original = getattr(cls, name)
            _ORIGINAL[name] = original
            setattr(cls, name, wrap(original))


def unscale_grads(params: list[nn.Parameter], inv_scale: torch.Tensor) -> torch.Tensor:
    """Multiplies the gradients of ``params`` by ``inv_scale`` in place and returns 1.0
    if any is inf or NaN, else 0.0 (``GradScaler.unscale_``'s kernel, per device and
    dtype).

    Raises:
        ValueError: a gradient is float16 (as torch's scaler).

    Example:
        >>> p = nn.Parameter(torch.ones(2))
        >>> p.grad = torch.tensor([4.0, float("inf")])
        >>> unscale_grads([p], torch.tensor(0.5)), p.grad
        (tensor(1.), tensor([2., inf]))
    """
    found = torch.zeros((), dtype=torch.float32, device=params[0].device)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            if p.grad.dtype == torch.float16:
                raise ValueError("Attempting to unscale FP16 gradients: keep the "
                                 "parameters in float32 and autocast the forward pass")
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for (device, _), grads in groups.items():
        here = found if device == found.device else torch.zeros_like(found, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, here, inv_scale.to(device))
        if here is not found:
            found += here.to(found.device)
    return found
