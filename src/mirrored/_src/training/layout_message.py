"""The message for copies of a mirrored model whose layouts differ (`structure`'s
layout check): the first difference, and the fix."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["layout_message"]


def layout_message(first: Any, other: Any, k: int) -> str:
    """The error for copies of replicas 0 and ``k`` whose layouts (``(submodules,
    parameters)``, each a list of ``(name, description)``) differ."""
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
    found = (re.search(r"submodule '([^']*)' is Parametrized", diff)
             or re.search(r"'([^']*?)\.?parametrizations[.']", diff))
    if found is not None:
        path = found.group(1)  # (a random state drawn per copy: not "on every copy")
        path = "" if path == "(the model)" else path  # (the root: get_submodule('') is it)
        return (f"the copies of a mirrored model differ: {diff}. A parametrization "
                "registered outside strategy.run through a submodule of the mirrored model "
                "(spectral_norm(model[2]), model.module, or the module given to mirror()) "
                "reaches replica 0's copy only. Register it through the mirrored model's "
                f"apply: subs = [c.get_submodule({path!r}) for c in model.replicas]; "
                "model.apply(lambda m: spectral_norm(m) if m in subs else None) (apply on "
                "the mirrored model gives every copy replica 0's values, which are what one "
                "device draws), or register it before "
                "strategy.mirror(). Registered on each copy (for copy in model.replicas), a "
                "parametrization with random state (spectral_norm's u and v) draws other "
                "values on each copy than one device")
    return (f"the copies of a mirrored model differ: {diff}. Outside strategy.run a "
            "submodule or parameter of the mirrored model (model.encoder, model[0], "
            "model.parameters(), model.module) and the module given to mirror() are replica "
            "0's copy, so a change made through them reaches that copy only. Assign on the "
            "mirrored model itself (model.head = nn.Linear(...) is copied to every copy), make "
            "the change on every copy (for copy in model.replicas: ...), or make it before "
            "strategy.mirror()")
