"""The copies of a mirrored model stay alike when code outside ``strategy.run``
changes replica 0's copy alone.

Outside ``run`` a mirrored model reads as replica 0's copy: ``model.parameters()``,
``model.encoder``, ``model[0]``, ``model.module`` and the module given to `mirror`
are that copy's. Changes made through them would reach that copy alone and train
another model than one device would:

- ``requires_grad`` (``for p in model.encoder.parameters(): p.requires_grad = False``,
  torch's way to freeze a part), and train / eval mode set on a submodule
  (``model.encoder.eval()``, a BatchNorm frozen for fine-tuning, DDP's
  ``model.module.eval()``): the next ``run`` (and `mirror_optimizer`) gives every copy
  replica 0's flags, so the copies freeze and unfreeze together. Whatever the
  route, the optimizer's step sums every replica's flags in its all-reduce and
  raises before using a gradient if they differ (`frozen_message`).
- the layout (a submodule or parameter added, replaced or removed through a
  submodule: ``model.encoder.append(...)``, ``model.head.weight =
  model.embed.weight``, a parametrization): the next ``run`` raises `RuntimeError`
  naming the first difference, before any replica runs; so does a parameter that
  two copies share (each replica's optimizer would step it again).
- lazy parameters: initialized inside ``run``, each copy draws its own values;
  the next ``run`` gives every copy replica 0's.

When to look: code outside ``run`` taking hold of a copy's modules or parameters
(the mirrored module's accessors) bumps `CHANGES`; registering a parameter, a
submodule or a new buffer on any module of a copy (torch's global registration hooks, which also
see the module given to `mirror` changed through an old reference) bumps `LAYOUT`
too. ``run`` compares `CHANGES` with the count it last checked at (one integer
comparison per run). A check after `CHANGES` alone walks the parameter lists kept
from the last full check; after `LAYOUT`, it walks every copy's modules once.

A ``load_state_dict`` into any module of replica 0's copy outside ``run`` (a
checkpoint restored through the module given to `mirror`: ``net.load_state_dict(
torch.load(f))``) counts as a change through the mirrored model: a pre-hook on each
of that copy's modules (`_Loading`) has `expose` record every copy before the load
writes, and the next ``run`` carries what it wrote to the other copies
(`outside_state`). With ``assign=True`` it would replace that copy's tensors alone:
refused before anything is written.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .. import context
from .layout_message import layout_message
from .module_hooks import check_hooks
from .outside_state import carry_state, record, settle
from .plain_optimizer import register_copies

__all__ = ["CHANGES", "LAYOUT", "check_copies", "check_module", "expose", "frozen_message",
           "settle", "watch"]

CHANGES = [0]  # bumped when code outside run may have changed one copy
LAYOUT = [0]  # bumped when a parameter or module was registered on a copy's module
_lock = threading.Lock()
_mirrored: Any = weakref.WeakSet()  # mirrored modules with two copies or more
_watched: dict[int, weakref.ref[nn.Module]] = {}  # id -> every submodule of their copies
# id -> (a module of replica 0's copy, its mirrored module): `_Loading`'s lookup
_first_copy: dict[int, tuple[weakref.ref[nn.Module], weakref.ref[Any]]] = {}
_HOOKED = [False]


def _registered(module: nn.Module, name: str, value: Any) -> None:
    """torch's global registration hook: a parameter, submodule or buffer registered on a
    module of a copy (by identity: a module's own ``__hash__`` is not called; returns
    ``None``: the value is kept)."""
    ref = _watched.get(id(module))  # (a buffer registered again under its name: no change)
    if ref is not None and ref() is module and name not in module._buffers:
        LAYOUT[0] += 1
        CHANGES[0] += 1


def watch(module: Any) -> None:
    """Watches mirrored ``module`` (a `MirroredModule` with two copies or more)."""
    with _lock:
        _mirrored.add(module)
        _remember(module, [list(c.named_parameters()) for c in module._copies])
        module.__dict__["_lazy"] = {name for name, p in module.__dict__["_named"][0]
                                    if is_lazy(p)}
        CHANGES[0] += 1  # (its strategy's next run looks: lazy ones are followed from there)
        if not _HOOKED[0]:
            for kind in ("parameter", "module", "buffer"):
                getattr(nn.modules.module, f"register_module_{kind}_registration_hook")(_registered)
            _HOOKED[0] = True


def _remember(module: Any, named: list[list[tuple[str, nn.Parameter]]]) -> None:
    """Keeps the copies' parameter lists (with the module and name holding each) and
    watches every module of theirs (lock held)."""
    module.__dict__["_named"] = named
    module.__dict__["_owners"] = [[_owner(c, name) for name, _ in params]
                                  for c, params in zip(module._copies, named, strict=True)]
    module.__dict__["_layout_seen"] = LAYOUT[0]
    module.__dict__["_modules"] = mods = [list(c.modules()) for c in module._copies]
    for copy_modules in mods:
        for m in copy_modules:
            key = id(m)
            if key not in _watched:
                _watched[key] = weakref.ref(m, _forget(key))
    for key in [k for k, (_, owner) in _first_copy.items() if owner() is module]:
        del _first_copy[key]  # (modules no longer in replica 0's copy: not its own now)
    shell = weakref.ref(module)
    for m in mods[0]:
        _first_copy[id(m)] = (weakref.ref(m, _forget_first(id(m))), shell)
        if not any(isinstance(hook := getattr(h, "hook", None), _Loading) and hook.of() is m
                   for h in m._load_state_dict_pre_hooks.values()):
            m._register_load_state_dict_pre_hook(_Loading(m))


class _Loading:
    """torch's ``load_state_dict`` pre-hook on every module of replica 0's copy (run
    before the load writes; first by the module loaded into): outside ``run``,
    `expose` records every copy, so the next run carries what the load writes in
    place to the others. A load through the mirrored model (which writes every copy),
    a replica's own inside ``run``, and a module that is no longer replica 0's are
    left alone; so is a copy of one (``deepcopy``, ``pickle``: the hook pickles as
    ``functools.partial(itertools.chain)``, which does nothing, and holds its module
    weakly).

    Raises:
        RuntimeError: ``assign=True`` outside ``run`` (it would replace that copy's
            tensors alone); nothing was loaded.
    """

    def __init__(self, module: nn.Module | None = None) -> None:
        self._module = None if module is None else weakref.ref(module)

    def of(self) -> nn.Module | None:
        """The module it watches (``None`` for a copy's)."""
        return None if self._module is None else self._module()

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A hook that does nothing and needs nothing of this library to unpickle (a
        # model saved whole, torch.save(net), loads where mirrored is not installed).
        return functools.partial, (itertools.chain,)

    def __call__(self, state_dict: Any, prefix: str, local_metadata: dict[str, Any],
                 *_: Any) -> None:
        module = self.of()
        entry = None if module is None else _first_copy.get(id(module))
        mirrored = entry[1]() if entry is not None and entry[0]() is module else None
        if mirrored is None or mirrored.__dict__.get("_mirrored_loading"):
            return
        ctx = context.current_replica_context()
        if ctx is not None and ctx.strategy is mirrored._strategy:
            return  # (a replica loads into its own copy)
        if local_metadata.get("assign_to_params_buffers", False):
            name = prefix.rstrip(".") or type(module).__name__
            raise RuntimeError(
                f"load_state_dict(assign=True) into {name!r}, a module of replica 0's copy of "
                "a mirrored model, outside strategy.run: it would replace the parameters and "
                "buffers of that copy alone (the module given to mirror() and the mirrored "
                "model's submodules are replica 0's copy), and the copies would differ; "
                "nothing was loaded. Load without assign=True (written in place, carried to "
                "every copy at the next run), or through the mirrored model: "
                "model.load_state_dict(state, assign=True) gives every copy its own tensors")
        expose(mirrored, True)


def _forget_first(key: int) -> Any:
    def forget(_: Any) -> None:
        _first_copy.pop(key, None)
    return forget


def _owner(copy: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return copy.get_submodule(path), attr


def _forget(key: int) -> Any:
    def forget(_: Any) -> None:  # (a dropped module's id may be reused)
        _watched.pop(key, None)
    return forget


def check_copies(strategy: Any, seen: list[int]) -> None:
    """At the start of ``strategy``'s run, when `CHANGES` moved since ``seen[0]``:
    `check_module` on each of its mirrored modules (again at every run while one has
    lazy parameters not initialized yet: each copy initializes its own in a run).

    Raises:
        RuntimeError: the copies of one differ in layout, or share a parameter.
    """
    now, lazy = CHANGES[0], False
    for module in list(_mirrored):
        if module._strategy is strategy:
            check_module(module)
            lazy = lazy or bool(module.__dict__.get("_lazy"))
    seen[0] = now - 1 if lazy else now  # (not reached if one raised: checked again)


def check_module(module: Any, *, full: bool = False) -> None:
    """Compares the copies of mirrored ``module`` with replica 0's: ``requires_grad``
    (copied from replica 0's), parameters shared by two copies (raises) and lazy
    parameters initialized since (replica 0's values copied to the others), over the
    parameter lists kept from the last full check; a full check (``full``, a
    registration on a copy since (`LAYOUT`), a kept parameter no longer its module's,
    or a dtype or shape that differs) walks every copy first: the layout (raises on a
    difference) and the parameters added or replaced (their values must be equal on
    every copy; they are recorded with the plain-optimizer guard).

    Raises:
        RuntimeError: the copies differ in submodules or parameters, or share one.
    """
    copies = module._copies
    if len(copies) < 2:
        return
    named, owners = module.__dict__["_named"], module.__dict__["_owners"]
    if full or module.__dict__["_layout_seen"] != LAYOUT[0] or not _current(named, owners):
        named = _check_layout(module, copies, named)
    first = named[0]
    for k, params in enumerate(named[1:], start=1):
        for (name, p0), (_, p) in zip(first, params, strict=True):
            if p.requires_grad != p0.requires_grad:
                p.requires_grad_(p0.requires_grad)
            if is_lazy(p) or is_lazy(p0):
                continue
            if p.dtype != p0.dtype or p.shape != p0.shape:  # (changed in place, no hook)
                _check_layout(module, copies, named)  # raises, naming it
            if p.data_ptr() == p0.data_ptr() and p.numel() and p.device == p0.device:
                raise RuntimeError(
                    f"the copies of a mirrored model share memory: parameter {name!r} of "
                    f"replica {k}'s copy is stored in the same memory as replica 0's, so each "
                    "replica's optimizer would step it again (the copies must be separate: "
                    "p.data = t or the same tensor assigned on every copy makes them share "
                    "it). Assign on the mirrored model itself (copied to every copy), or copy "
                    "the values into each copy (p.copy_(t))")
    mods = module.__dict__["_modules"]  # train / eval set through a submodule: replica 0's
    seen = module.__dict__.pop("_plain_seen", None)
    if seen is not None and any(len(s) != len(mods[0]) for s in seen):
        seen = None
    for k, copy_modules in enumerate(mods[1:], start=1):
        for i, (m0, m) in enumerate(zip(mods[0], copy_modules, strict=True)):
            if m.training != m0.training:
                m.training = m0.training
            if seen is not None:
                carry_state(seen[0][i], seen[k][i], m0, m, module._devices[k])
    if module.__dict__["_lazy"]:  # initialized since (each copy by its own forward)
        _initialize(named, module.__dict__["_lazy"])
        module.__dict__["_lazy"] = {name for name, p in first if is_lazy(p)}
    check_hooks(mods)  # (a hook registered through a submodule: raises)


def expose(module: Any, outside_run: bool) -> None:
    """Replica 0's copy of mirrored ``module`` is handed out outside ``run``: the next
    run checks the copies, and gives the others what changes in replica 0's plain
    attributes until then (`_plain_state`), from a record of every copy's taken now
    (not while a run is in flight: a ``merge_fn`` sees replica 0's copy mid-run)."""
    if not outside_run:
        return
    CHANGES[0] += 1
    own = module.__dict__
    if (own.get("_plain_seen") is None and "_modules" in own and len(own["_copies"]) > 1
            and not context.run_in_flight(own["_strategy"])):
        own["_plain_seen"] = [[record(m) for m in mods] for mods in own["_modules"]]


def _current(named: list[list[tuple[str, nn.Parameter]]],
             owners: list[list[tuple[nn.Module, str]]]) -> bool:
    """Whether every kept parameter is still its module's (torch's registration hooks
    do not see ``module._parameters[name] = p``, as some loaders write)."""
    for params, places in zip(named, owners, strict=True):
        for (_, p), (owner, attr) in zip(params, places, strict=True):
            if owner._parameters.get(attr) is not p:
                return False
    return True


def _check_layout(module: Any, copies: Sequence[nn.Module],
                  known: list[list[tuple[str, nn.Parameter]]]
                  ) -> list[list[tuple[str, nn.Parameter]]]:
    named = [list(c.named_parameters()) for c in copies]
    first = _layout(copies[0], named[0])
    for k, c in enumerate(copies[1:], start=1):
        layout = _layout(c, named[k])
        if layout != first:
            raise RuntimeError(layout_message(first, layout, k))
    before = [dict((name, id(p)) for name, p in params) for params in known]
    changed = [i for i, (name, _) in enumerate(named[0])
               if any(b.get(name) != id(params[i][1]) for b, params in zip(before, named,
                                                                          strict=True))]
    for i in changed:
        _same_values(named[0][i][0], [params[i][1] for params in named])
    if changed:
        register_copies(copies, module._strategy)
    # (lazy ones added since; those known stay listed until every copy initialized them)
    module.__dict__["_lazy"] |= {name for name, p in named[0] if is_lazy(p)}
    with _lock:
        _remember(module, named)
    return named


def _initialize(named: list[list[tuple[str, nn.Parameter]]], lazy: set[str]) -> None:
    with torch.no_grad():
        for i, (name, p0) in enumerate(named[0]):
            if name not in lazy or is_lazy(p0):
                continue
            for k, params in enumerate(named[1:], start=1):
                p = params[i][1]
                if is_lazy(p):  # initialized on replica 0's copy alone: outside run
                    raise RuntimeError(
                        f"the copies of a mirrored model differ: lazy parameter {name!r} is "
                        f"initialized on replica 0's copy but not on replica {k}'s: a lazy "
                        "module's first forward outside strategy.run runs replica 0's copy "
                        "only. Initialize it with a forward of the plain module before "
                        "strategy.mirror(), or inside strategy.run, where every copy runs")
                with torch.inference_mode(p.is_inference()), torch.no_grad():  # (a dry
                    p.copy_(p0)                                      # run's, under it)


def _layout(copy: nn.Module, params: list[tuple[str, nn.Parameter]]
            ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    modules = [(name or "(the model)", type(m).__qualname__) for name, m in copy.named_modules()]
    return modules, [(name, _describe(p)) for name, p in params]


def _describe(p: torch.Tensor) -> str:
    if is_lazy(p):  # (a lazy module's, before its first forward: no shape yet)
        return "uninitialized"
    return f"{str(p.dtype).removeprefix('torch.')}{list(p.shape)}"


def _same_values(name: str, params: list[nn.Parameter]) -> None:
    first = params[0]
    for k, p in enumerate(params[1:], start=1):
        if is_lazy(p) or is_lazy(first):
            continue
        if not torch.equal(first.detach().to(p.device), p.detach()):
            raise RuntimeError(
                f"the copies of a mirrored model differ: parameter {name!r} was added or "
                f"replaced since the last run and its values on replica 0's copy differ from "
                f"replica {k}'s. A parameter assigned to a submodule outside strategy.run "
                "(model.head.weight = nn.Parameter(...), or through the module given to "
                "mirror()) reaches replica 0's copy only, and a module or parameter made "
                "for each copy gets its own random values. Assign it on the mirrored model "
                "itself (model.head = nn.Linear(...) is copied to every copy), on every copy "
                "with equal values, or before strategy.mirror()")


def frozen_message(names: Sequence[str], replica: int, requiring: int, replicas: int) -> str:
    """The error for parameters (``names``) that require a gradient on ``requiring`` of
    the ``replicas`` replicas' copies only, raised by every replica at the step (local
    replica ``replica`` among them)."""
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    return (f"parameter {names[0]!r}{more} requires a gradient on the copies of {requiring} "
            f"of the {replicas} replicas only, so the step would train it on some replicas "
            f"and not on others (found by local replica {replica} in the step's all-reduce; "
            "nothing was updated). A requires_grad set outside strategy.run through a "
            "reference that reaches replica 0's copy alone (the module given to "
            "strategy.mirror(), or a list of model.parameters() kept from before a run) "
            "changes that copy only: freeze through the mirrored model right before the run "
            "(model.requires_grad_(False), model.encoder.requires_grad_(False), or "
            "p.requires_grad = False for p in model.parameters(): the next run copies it to "
            "every copy), or on every copy (for copy in model.replicas: ...)")
