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

import threading
from collections.abc import Iterable
from typing import Any, TypeVar

import torch
import torch.optim.optimizer as _torch_optimizer
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["GUARD", "register_copies", "trust"]

T = TypeVar("T")
_TRUSTED = "_mirrored_trusted"
_lock = threading.Lock()
# parameter of a copy -> (copy's index, its name, the strategy's replica count)
_copies: WeakIdKeyDictionary = WeakIdKeyDictionary()
# optimizer -> the number of parameters it had when found clear of copies
_clear: WeakIdKeyDictionary = WeakIdKeyDictionary()
GUARD = [0]  # global pre-hooks of this module's: 1 once installed


def register_copies(copies: Iterable[torch.nn.Module], num_replicas: int) -> None:
    """Records the parameters of a mirrored module's ``copies`` (``num_replicas`` in
    sync; with one, a plain optimizer trains the one copy as one device: nothing is
    recorded) and installs the hook once."""
    if num_replicas < 2:
        return
    with _lock:
        for k, copy in enumerate(copies):
            for name, p in copy.named_parameters():
                _copies[p] = (k, name, num_replicas)
        if not GUARD[0]:
            _torch_optimizer.register_optimizer_step_pre_hook(_refuse)
            GUARD[0] = 1


def trust(mirrored: T, *optimizers: torch.optim.Optimizer) -> T:
    """Marks a mirrored optimizer and its per-replica ``optimizers`` (stepped as part of
    its step) as trusted; returns ``mirrored``."""
    for optimizer in (mirrored, *optimizers):
        setattr(optimizer, _TRUSTED, True)
    return mirrored


def _refuse(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The pre-hook: raises if ``optimizer`` holds a parameter of a mirrored copy."""
    if getattr(optimizer, _TRUSTED, False):
        return
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _clear.get(optimizer) == count:  # type: ignore[no-untyped-call]
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            found = _copies.get(p)  # type: ignore[no-untyped-call]
            if found is not None:
                k, name, n = found
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
    _clear[optimizer] = count
