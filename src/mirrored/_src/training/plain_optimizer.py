"""A plain ``torch.optim`` optimizer stepping the parameters of a model mirrored over
several replicas is refused: it never all-reduces the gradients, so every copy (every
worker) would train on its own batch and the copies drift apart, silently. DDP's
habit (``torch.optim.SGD(model.parameters())`` with the averaging done in backward)
ported as is does exactly that; ``strategy.mirror_optimizer`` is the way.

One global optimizer step pre-hook (``torch.optim.optimizer.
register_optimizer_step_pre_hook``), installed when the first module is mirrored
over more than one replica, looks up every parameter of an optimizer it has not
cleared yet in a table of the copies' parameters (weakly held); the mirrored
optimizer and its per-replica optimizers are trusted (`trust`): the hook costs them
one attribute lookup per step, and the mirrored optimizer's own step does not count
it among the hooks it must run.
"""

from __future__ import annotations

import sys
import threading
import weakref
import zlib
from collections.abc import Iterable, Sequence
from types import FrameType
from typing import Any, TypeVar

import torch
import torch.optim.optimizer as _torch_optimizer
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["GUARD", "SCHEDULERS", "forget", "refuse_scheduler", "register_copies",
           "subset_text", "trust"]

T = TypeVar("T")
_TRUSTED = "_mirrored_trusted"
_lock = threading.Lock()
# parameter of a copy -> (copy's index, its name, the replica count, the strategy, weakly)
_copies: Any = WeakIdKeyDictionary()
# optimizer -> the number of parameters it had when found clear of copies
_clear: Any = WeakIdKeyDictionary()
GUARD = [0]  # global pre-hooks of this module's: 1 once installed
_generation = [0]  # mirrorings so far: a check that overlapped one is not cached


def register_copies(copies: Iterable[torch.nn.Module], strategy: Any) -> None:
    """Records the parameters of ``strategy``'s mirrored module's ``copies`` (with one
    replica in all a plain optimizer trains the one copy as one device: their records,
    from an earlier mirroring, are dropped instead) and installs the hook once."""
    n = strategy.num_replicas_in_sync
    with _lock:
        _clear.clear()  # (an optimizer cleared before may hold these parameters)
        _generation[0] += 1
        for k, copy in enumerate(copies):
            for name, p in copy.named_parameters():
                if n > 1:
                    _copies[p] = (k, name, n, weakref.ref(strategy))
                else:
                    _copies.pop(p, None)
        if n > 1 and not GUARD[0]:
            _torch_optimizer.register_optimizer_step_pre_hook(_refuse)
            GUARD[0] = 1


def forget(strategy: Any) -> None:
    """Drops the records of ``strategy``'s copies (``strategy.close()``): their
    parameters may be trained as plain modules afterwards."""
    with _lock:
        for p in [p for p, (*_, ref) in _copies.items() if ref() in (None, strategy)]:
            del _copies[p]


def trust(owner: torch.optim.Optimizer, optimizers: T) -> T:
    """Marks a mirrored optimizer (``owner``) and its per-replica ``optimizers``
    (stepped as part of its step) as trusted; returns ``optimizers``."""
    for optimizer in (owner, *optimizers):  # type: ignore[misc]
        setattr(optimizer, _TRUSTED, True)
    return optimizers


def _refuse(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The pre-hook: raises if ``optimizer`` holds a parameter of a mirrored copy."""
    if getattr(optimizer, _TRUSTED, False):
        return
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    generation = _generation[0]
    if _clear.get(optimizer) == count:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            found = _copies.get(p)
            if found is not None and found[3]() is not None:  # (a strategy still alive)
                k, name, n, _ = found
                kind = type(optimizer)
                plain = kind.__qualname__
                plain = (f"torch.optim.{plain}" if getattr(torch.optim, plain, None) is kind
                         else f"{kind.__module__}.{plain}")
                raise RuntimeError(
                    f"{plain}.step() would update the "
                    f"parameters of a model mirrored over {n} replicas (copy {k}'s "
                    f"{name!r}) with a plain optimizer, which never all-reduces the "
                    "gradients: each copy (each worker) would train on its own batch and "
                    "the copies drift apart (DDP averages the gradients in backward; "
                    "mirrored does in the mirrored optimizer's step). Nothing was updated. "
                    "Build it with strategy.mirror_optimizer(model, lambda params: "
                    f"{plain}(params, ...)) and step that")
    if generation == _generation[0]:
        _clear[optimizer] = count


# The modules whose code steps a torch LR scheduler (every scheduler's ``step``, and
# its construction's first step, reach the optimizer's ``param_groups`` from here).
SCHEDULERS = frozenset({"torch.optim.lr_scheduler"})


def refuse_scheduler(replicas: int) -> None:
    """Raises `RuntimeError` if the caller's caller (the code reading a mirrored
    optimizer's ``param_groups`` inside ``run``) is a torch LR scheduler: every local
    replica runs the step function, so a scheduler stepped there advances once per
    replica and training step (on one device, once), a schedule ``replicas`` (the
    process's) times too fast with nothing else to show for it. Refused on one
    replica too, so that the step that runs there runs on N.

    Example:
        >>> refuse_scheduler(2)  # (called from elsewhere: nothing to refuse)
    """
    frame: FrameType | None = sys._getframe(2)
    if frame is None or frame.f_globals.get("__name__") not in SCHEDULERS:
        return
    owner = None  # (the scheduler stepped: the outermost `self` of the module's frames, so
    # SequentialLR, not the child it steps)
    while frame is not None and frame.f_globals.get("__name__") in SCHEDULERS:
        owner, frame = frame.f_locals.get("self", owner), frame.f_back
    name = type(owner).__name__ if owner is not None else "an LR scheduler"
    times = (f"{replicas} times per training step (this process's {replicas} replicas)"
             if replicas > 1 else "N times per training step on N replicas in a process "
             "(refused on one replica too, so that this step runs on N)")
    raise RuntimeError(
        f"{name} was stepped (or built) inside strategy.run: every replica runs the step "
        f"function, so it would advance {times}, where one device advances it once. Call "
        "scheduler.step() after "
        "strategy.run returns, in the training loop (ReduceLROnPlateau: with a metric "
        "reduced by strategy.reduce), and build schedulers outside strategy.run")


def subset_text(copy: torch.nn.Module, params: Sequence[torch.nn.Parameter]) -> str:
    """How a mirrored optimizer's step names the part of ``copy`` it trains: ``""``
    for every parameter, else ``", parameters 0-1, 4"`` (indices in
    ``copy.parameters()`` order; 40 characters at most, then a count and a checksum):
    two optimizers of one model over other parameters make other calls.

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
        >>> subset_text(net, list(net.parameters())), subset_text(net, list(net[1].parameters()))
        ('', ', parameters 2-3')
    """
    index = {id(p): k for k, p in enumerate(copy.parameters())}
    ks = sorted(index.get(id(p), -1) for p in params)
    if ks == list(range(len(index))):
        return ""
    spans: list[list[int]] = []
    for k in ks:
        if spans and k == spans[-1][1] + 1:
            spans[-1][1] = k
        else:
            spans.append([k, k])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    if len(text) > 40:
        text = f"{len(ks)} of {len(index)}, #{zlib.crc32(str(ks).encode()):08x}"
    return f", parameters {text}"
