"""The copies of a mirrored model stay alike when code outside ``strategy.run``
changes replica 0's copy alone.

Outside ``run`` a mirrored model reads as replica 0's copy: ``model.parameters()``,
``model.encoder``, ``model[0]``, ``model.module`` and the module given to `mirror`
are that copy's. Two kinds of change made through them would reach that copy alone
and train another model than one device would:

- ``requires_grad`` (``for p in model.encoder.parameters(): p.requires_grad = False``,
  torch's way to freeze a part): the next ``run`` (and `mirror_optimizer`) gives every
  copy replica 0's flags, so the copies freeze and unfreeze together.
- the layout (a submodule or parameter added, replaced or removed through a
  submodule: ``model.encoder.append(...)``, ``model.head.weight =
  model.embed.weight``, a parametrization): the next ``run`` raises `RuntimeError`
  naming the first difference, before any replica runs.

When to look: reading a copy's insides outside ``run`` (the mirrored module's
``_current``/``_targets``) and registering a parameter or submodule on any module of
a copy (torch's global registration hooks, which also see the module given to
`mirror` changed through an old reference) bump `CHANGES`; ``run`` compares it
with the count it last checked at (one integer comparison per run). A
``requires_grad`` changed through an old reference is caught at the optimizer's
step instead (`frozen_message`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from .plain_optimizer import register_copies

__all__ = ["CHANGES", "check_copies", "check_module", "frozen_message", "watch"]

CHANGES = [0]  # bumped when code outside run may have changed one copy
_lock = threading.Lock()
_mirrored: Any = weakref.WeakSet()  # mirrored modules with two copies or more
_watched: Any = weakref.WeakSet()  # every submodule of their copies
_HOOKED = [False]


def _registered(module: nn.Module, name: str, value: Any) -> None:
    """torch's global registration hook: a parameter or submodule registered on a
    module of a copy (returns ``None``: the value is kept)."""
    if module in _watched:
        CHANGES[0] += 1


def watch(module: Any) -> None:
    """Watches mirrored ``module`` (a `MirroredModule` with two copies or more)."""
    module.__dict__["_param_ids"] = _identities(module._copies)
    module.__dict__["_lazy"] = _uninitialized(module._copies[0])
    with _lock:
        _mirrored.add(module)
        _watch_copies(module)
        if not _HOOKED[0]:
            nn.modules.module.register_module_parameter_registration_hook(_registered)
            nn.modules.module.register_module_module_registration_hook(_registered)
            _HOOKED[0] = True


def _watch_copies(module: Any) -> None:
    for c in module._copies:
        for m in c.modules():
            _watched.add(m)


def check_copies(strategy: Any, seen: list[int]) -> None:
    """At the start of ``strategy``'s run, when `CHANGES` moved since ``seen[0]``:
    `check_module` on each of its mirrored modules (again at every run while one has
    lazy parameters not initialized yet: each copy initializes its own in a run).

    Raises:
        RuntimeError: the copies of one differ in layout.
    """
    now, lazy = CHANGES[0], False
    for module in list(_mirrored):
        if module._strategy is strategy:
            check_module(module)
            lazy = lazy or bool(module.__dict__.get("_lazy"))
    seen[0] = now - 1 if lazy else now  # (not reached if one raised: checked again)


def check_module(module: Any) -> None:
    """Compares the copies of mirrored ``module`` with replica 0's: the layout (raises
    on a difference), ``requires_grad`` (copied from replica 0's), parameters sharing
    memory across copies (raises) and the values of parameters added or replaced
    since the last check (raises if they differ); re-registers the copies'
    parameters with the plain-optimizer guard if they changed.

    Raises:
        RuntimeError: the copies differ in submodules or parameters, or share memory.
    """
    copies = module._copies
    if len(copies) < 2:
        return
    first = _layout(copies[0])
    for k, c in enumerate(copies[1:], start=1):
        layout = _layout(c)
        if layout != first:
            raise RuntimeError(_layout_message(first, layout, k))
        for (name, p0), (_, p) in zip(copies[0].named_parameters(), c.named_parameters(),
                                      strict=True):
            if p.requires_grad != p0.requires_grad:
                p.requires_grad_(p0.requires_grad)
            if not is_lazy(p) and p.device == p0.device and p.numel() and (
                    p.untyped_storage().data_ptr() == p0.untyped_storage().data_ptr()):
                raise RuntimeError(
                    f"the copies of a mirrored model share memory: parameter {name!r} of "
                    f"replica {k}'s copy is stored in the same memory as replica 0's, so each "
                    "replica's optimizer would step it again (the copies must be separate: "
                    "p.data = t or the same tensor assigned on every copy makes them share "
                    "it). Assign on the mirrored model itself (copied to every copy), or copy "
                    "the values into each copy (p.copy_(t)); model.load_state_dict(sd, "
                    "assign=True) gives every copy its own")
    lazy = module.__dict__.get("_lazy")
    if lazy:  # lazy parameters initialized since (each copy by its own forward): replica 0's
        now = _uninitialized(copies[0])
        with torch.no_grad():
            for name in lazy - now:
                first = copies[0].get_parameter(name)
                for c in copies[1:]:
                    c.get_parameter(name).copy_(first)
        module.__dict__["_lazy"] = now
    ids = _identities(copies)
    known = module.__dict__.get("_param_ids")
    if known != ids:  # parameters added or replaced: alike on every copy?
        for name, p0 in copies[0].named_parameters():
            if any(now.get(name) != then.get(name) for now, then in zip(ids, known,
                                                                     strict=True)):
                _same_values(name, p0, [c.get_parameter(name) for c in copies])
        module.__dict__["_param_ids"] = ids
        register_copies(copies, module._strategy)
        with _lock:
            _watch_copies(module)


def _uninitialized(copy: nn.Module) -> set[str]:
    return {name for name, p in copy.named_parameters() if is_lazy(p)}


def _identities(copies: tuple[nn.Module, ...]) -> list[dict[str, int]]:
    return [{name: id(p) for name, p in c.named_parameters()} for c in copies]


def _same_values(name: str, first: torch.Tensor, params: list[torch.Tensor]) -> None:
    for k, p in enumerate(params[1:], start=1):
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


def _layout(copy: nn.Module) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    modules = [(name or "(the model)", type(m).__qualname__) for name, m in copy.named_modules()]
    params = [(name, _describe(p)) for name, p in copy.named_parameters()]
    return modules, params


def _describe(p: torch.Tensor) -> str:
    if is_lazy(p):  # (a lazy module's, before its first forward: no shape yet)
        return "uninitialized"
    return f"{str(p.dtype).removeprefix('torch.')}{list(p.shape)}"


def _layout_message(first: Any, other: Any, k: int) -> str:
    diff = ""
    for kind, a, b in (("submodule", first[0], other[0]), ("parameter", first[1], other[1])):
        if a == b:
            continue
        mine, theirs = dict(a), dict(b)
        only_mine = [n for n in mine if n not in theirs]
        only_theirs = [n for n in theirs if n not in mine]
        changed = [n for n in mine if n in theirs and mine[n] != theirs[n]]
        if changed:
            n = changed[0]
            diff = (f"{kind} {n!r} is {mine[n]} on replica 0's copy and {theirs[n]} on "
                    f"replica {k}'s")
        elif only_mine or only_theirs:
            n, where, lacks = ((only_mine[0], mine, f"replica {k}'s") if only_mine
                               else (only_theirs[0], theirs, "replica 0's"))
            owner = "replica 0's" if only_mine else f"replica {k}'s"
            diff = f"{owner} copy has {kind} {n!r} ({where[n]}) that {lacks} lacks"
            if kind == "parameter":
                diff += " (a parameter shared under two names, as a tied weight, counts once)"
        else:
            diff = f"the copies of replicas 0 and {k} list their {kind}s in another order"
        break
    if "Lazy" in diff or "uninitialized" in diff:
        diff += (" (a lazy module initialized by a forward outside strategy.run, which runs "
                 "replica 0's copy only: initialize it with a forward of the plain module "
                 "before strategy.mirror(), or inside strategy.run, where every copy runs)")
    return (f"the copies of a mirrored model differ: {diff}. Outside strategy.run a "
            "submodule or parameter of the mirrored model (model.encoder, model[0], "
            "model.parameters(), model.module) and the module given to mirror() are replica "
            "0's copy, so a change made through them reaches that copy only. Assign on the "
            "mirrored model itself (model.head = nn.Linear(...) is copied to every copy), make "
            "the change on every copy (for copy in model.replicas: ...), or make it before "
            "strategy.mirror()")


def frozen_message(name: str, flags: list[bool]) -> str:
    """The error for parameter ``name`` frozen on some local copies only (``flags``:
    each copy's ``requires_grad``), found at the optimizer's step."""
    on = [k for k, f in enumerate(flags) if f]
    off = [k for k, f in enumerate(flags) if not f]
    return (f"parameter {name!r} requires a gradient on the copies of replicas {on} but not on "
            f"those of replicas {off}, so the replicas would train different parts of the "
            "model. A requires_grad changed through a reference kept from before "
            "strategy.mirror() (the module given to it is replica 0's copy) reaches that copy "
            "only: freeze through the mirrored model (model.requires_grad_(False), "
            "model.encoder.requires_grad_(False), or p.requires_grad = False for p in "
            "model.parameters(): the next run copies it to every copy)")
