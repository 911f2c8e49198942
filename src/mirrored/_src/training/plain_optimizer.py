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

The same hook refuses a plain optimizer stepped by two replicas of one ``run`` (one
shared by the replicas, over a parameter outside the mirrored model: N steps per
global step, on the one ``.grad`` they share): it keeps the replica and run that last
stepped it, one lookup per step inside ``run``. Torch has no global ``zero_grad`` hook: the
hook, when it first clears an optimizer, wraps that instance's ``zero_grad``
(`_watch_zero_grad`; torch's pickling and deep copies drop it), so a ``zero_grad()``
by two replicas of one run is refused from the optimizer's first step on.
"""

from __future__ import annotations

import functools
import inspect
import os
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

from .. import context

__all__ = ["GUARD", "SCHEDULERS", "check_made", "forget", "install", "refuse_scheduler",
           "register_copies", "subset_text", "trust"]

T = TypeVar("T")
_TRUSTED = "_mirrored_trusted"
_lock = threading.Lock()
# parameter of a copy -> (copy's index, its name, the replica count, the strategy, weakly)
_copies: Any = WeakIdKeyDictionary()
# optimizer -> the number of parameters it had when found clear of copies
_clear: Any = WeakIdKeyDictionary()
GUARD = [0]  # global pre-hooks of this module's: 1 once installed
_generation = [0]  # mirrorings so far: a check that overlapped one is not cached
# optimizer -> ((id of the run's parts, its generation), the replica, what it did) that
# last stepped or zeroed it inside a run (`_one_replica`)
_used: Any = WeakIdKeyDictionary()
_used_lock = [threading.Lock()]
_WATCHED = "_mirrored_watches_zero_grad"


def _after_fork_in_child() -> None:
    # (a child's runtimes count their runs from 1 again; a lock may have been held)
    _used.clear()
    _used_lock[0] = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def install() -> None:
    """Installs the hook (once): a strategy with several local replicas, or a module
    mirrored over several replicas, exists."""
    with _lock:
        _install_locked()


def _install_locked() -> None:
    if not GUARD[0]:
        _torch_optimizer.register_optimizer_step_pre_hook(_refuse)
        GUARD[0] = 1


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
        if n > 1:
            _install_locked()


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


def _name(optimizer: torch.optim.Optimizer) -> str:
    """``torch.optim.SGD`` (torch's own), else the class's module and name."""
    kind = type(optimizer)
    plain = kind.__qualname__
    return (f"torch.optim.{plain}" if getattr(torch.optim, plain, None) is kind
            else f"{kind.__module__}.{plain}")


def _refuse(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The pre-hook: raises if ``optimizer`` holds a parameter of a mirrored copy, or
    another replica of this run stepped or zeroed it."""
    if getattr(optimizer, _TRUSTED, False):
        return
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _clear.get(optimizer) != count:
        _refuse_copies(optimizer, count)
    if (ctx := context.current_replica_context()) is not None:
        _one_replica(optimizer, ctx, "stepped")


def _refuse_copies(optimizer: torch.optim.Optimizer, count: int) -> None:
    """Raises if ``optimizer`` holds a parameter of a mirrored copy; else clears it
    (cached) and watches its ``zero_grad``."""
    generation = _generation[0]
    for group in optimizer.param_groups:
        for p in group["params"]:
            found = _copies.get(p)
            if found is not None and found[3]() is not None:  # (a strategy still alive)
                k, name, n, _ = found
                plain = _name(optimizer)
                raise RuntimeError(
                    f"{plain}.step() would update the "
                    f"parameters of a model mirrored over {n} replicas (copy {k}'s "
                    f"{name!r}) with a plain optimizer, which never all-reduces the "
                    "gradients: each copy (each worker) would train on its own batch and "
                    "the copies drift apart (DDP averages the gradients in backward; "
                    "mirrored does in the mirrored optimizer's step). Nothing was updated. "
                    "Build it with strategy.mirror_optimizer(model, lambda params: "
                    f"{plain}(params, ...)) and step that")
    _watch_zero_grad(optimizer)
    if generation == _generation[0]:
        _clear[optimizer] = count


def _one_replica(optimizer: torch.optim.Optimizer, ctx: Any, what: str) -> None:
    """Records that replica ``ctx`` ``what`` (stepped, zeroed) ``optimizer`` in its run;
    raises if another replica of the same run did (one-replica runs: never)."""
    parts = ctx._parts
    generation = parts.runtime.generation()  # (0: a run on the caller, one local replica)
    if not generation:
        return
    key, replica = (id(parts), generation), ctx._replica_id
    with _used_lock[0]:
        last = _used.get(optimizer)
        if last is None or last[0] != key or last[1] == replica:
            _used[optimizer] = (key, replica, what)
            return
    first = last[2] + " by"
    then = "" if last[2] == what else f"{what} by "
    n = parts.topology.num_local_replicas
    harm = (f"each replica would step it, {n} steps per global step where one device takes "
            "one, on a gradient the replicas share" if "stepped" in (what, last[2]) else
            "one replica's zero_grad() wipes what another's backward() summed into the .grad "
            "the replicas share, and a step after run sees part of the global gradient")
    raise RuntimeError(
        f"A plain {_name(optimizer)} (not made by strategy.mirror_optimizer) was {first} "
        f"replica {last[1]} and {then}replica {replica} in one strategy.run: {harm}. "
        f"Replica {replica}'s call was refused. Step and zero it "
        "outside strategy.run, after run returns: the replicas' backward passes sum into a "
        "shared parameter's .grad, which with compute_average_loss is the global gradient, "
        "as on one device. Or make it with strategy.mirror_optimizer (a mirrored model's "
        "parameters). One optimizer per replica over that replica's own parameters may be "
        "stepped inside run")


def _watch_zero_grad(optimizer: torch.optim.Optimizer) -> None:
    """Wraps ``optimizer``'s ``zero_grad`` (its instance's, once) so that a call inside
    ``run`` counts as a use by the calling replica (`_one_replica`)."""
    inner = vars(optimizer).get("zero_grad")  # (None: the class's, looked up at each call)
    if getattr(inner, _WATCHED, False):
        return
    ref = weakref.ref(optimizer)  # (no cycle: the optimizer's state is freed with it)

    @functools.wraps(type(optimizer).zero_grad)
    def zero_grad(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        if opt is None:
            return None
        if (ctx := context.current_replica_context()) is not None:
            _one_replica(opt, ctx, "zeroed")
        return (inner if inner is not None else type(opt).zero_grad.__get__(opt))(
            *args, **kwargs)

    setattr(zero_grad, _WATCHED, True)
    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]


def check_made(optimizer: Any, r: int) -> None:
    """Raises unless ``optimizer`` (``make_optimizer``'s for replica ``r``) is a torch
    optimizer whose ``step()`` needs no argument: a mirrored step calls it with none.

    Raises:
        TypeError: not an optimizer; its ``step`` requires a closure (LBFGS).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"make_optimizer must return a torch.optim.Optimizer; got "
                        f"{type(optimizer).__name__} for replica {r}")
    try:
        parameters = inspect.signature(optimizer.step).parameters.values()
    except (TypeError, ValueError):  # (no signature to read: stepped as is)
        return
    required = [p.name for p in parameters if p.default is p.empty
                and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if required:
        raise TypeError(
            f"make_optimizer built a {_name(optimizer)} whose step() requires "
            f"{required[0]!r}: optimizers whose step takes a closure that re-evaluates the "
            "loss several times per step (LBFGS) are not supported by mirror_optimizer, "
            "whose step() all-reduces the gradients of the backward passes made before it "
            "and steps each replica's optimizer once, without a closure (a closure given to "
            "it is called once, before). Use a first-order optimizer (SGD, Adam, ...), or "
            "run LBFGS as a plain torch optimizer without a strategy")


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
