"""The forward and backward hooks of a mirrored model's copies must be alike.

A hook registered on the mirrored model itself (``model.register_forward_hook``) is
registered on every copy. One registered outside ``strategy.run`` through a
submodule of it (``model.encoder.register_forward_hook(fn)``, ``model[2].
register_full_backward_hook(fn)``) reaches replica 0's copy alone: that replica's
forward or backward then differed from the others', and the all-reduced gradients
trained another model than one device would, with no error (the copies stay equal).
`check_hooks` compares, at the next ``run``, the number of each kind of hook on every
module of every copy with replica 0's, and raises naming the first difference.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

__all__ = ["check_hooks"]

# (module attribute, what the user registered, the register method)
_KINDS = (("_forward_pre_hooks", "forward pre-hook", "register_forward_pre_hook"),
          ("_forward_hooks", "forward hook", "register_forward_hook"),
          ("_backward_pre_hooks", "backward pre-hook", "register_full_backward_pre_hook"),
          ("_backward_hooks", "backward hook", "register_full_backward_hook"))


def check_hooks(mods: Sequence[Sequence[nn.Module]]) -> None:
    """Raises if a module of a copy has another number of forward or backward hooks
    of one kind than the same module of replica 0's copy (``mods``: every copy's
    ``modules()``, in the same order).

    Also raises if the modules' buffers have other names: one registered or removed
    outside ``run`` through a reference to replica 0's copy kept from before a run
    (one registered through the mirrored model since the last run reached every copy:
    `outside_state`).

    Raises:
        RuntimeError: naming the submodule, the kind of hook (or the buffer) and the fix.
    """
    first = mods[0]
    for k, copy_modules in enumerate(mods[1:], start=1):
        for m0, m in zip(first, copy_modules, strict=True):
            if m0._buffers.keys() != m._buffers.keys():
                raise RuntimeError(_buffer_message(first[0], m0, m, k))
            for attr, kind, method in _KINDS:
                mine, theirs = len(getattr(m0, attr)), len(getattr(m, attr))
                if mine != theirs:
                    raise RuntimeError(_message(first[0], m0, kind, method, mine, theirs, k))


def _message(root: nn.Module, m0: nn.Module, kind: str, method: str, mine: int,
             theirs: int, k: int) -> str:
    name = next((n for n, m in root.named_modules() if m is m0), "")
    where = f"submodule {name!r}" if name else "the model"
    path = f".get_submodule({name!r})" if name else ""
    return (
        f"the copies of a mirrored model differ: {where} has {mine} {kind}(s) on replica 0's "
        f"copy and {theirs} on replica {k}'s, so the replicas' forward or backward passes "
        "would differ and the summed gradients train another model than one device (nothing "
        "ran). Outside strategy.run a submodule of the mirrored model (model.encoder, "
        "model[0], model.module) and the module given to mirror() are replica 0's copy, so "
        "a hook registered (or removed, with a handle from before mirror()) through them "
        "reaches that copy only. Register it on every copy (for copy in model.replicas: "
        f"copy{path}.{method}(fn)), or on the module before strategy.mirror() (a hook on the "
        f"whole model: model.{method}(fn) on the mirrored model reaches every copy); remove it "
        "with the handle that registration returned")


def _buffer_message(root: nn.Module, m0: nn.Module, m: nn.Module, k: int) -> str:
    name = next((n for n, mod in root.named_modules() if mod is m0), "")
    where = f"submodule {name!r}" if name else "the model"
    mine, theirs = list(m0._buffers), list(m._buffers)
    odd = [b for b in mine if b not in theirs]
    owner, lacks = ("replica 0's", f"replica {k}'s") if odd else (f"replica {k}'s", "replica 0's")
    odd = odd or [b for b in theirs if b not in mine] or mine
    path = f".get_submodule({name!r})" if name else ""
    return (
        f"the copies of a mirrored model differ: {where} has buffer {odd[0]!r} on {owner} copy "
        f"and {lacks} lacks it (nothing ran). A buffer registered or removed outside "
        "strategy.run through a reference to replica 0's copy kept from before a run (the "
        "module given to mirror(), or a submodule of the mirrored model taken before a run) "
        "reaches that copy only. Register it on the mirrored model itself "
        "(model.register_buffer(name, t) reaches every copy; for a submodule, take it from the "
        f"mirrored model right before: model{path}.register_buffer(name, t), which the next "
        "run carries to every copy), on every copy (for copy in model.replicas: "
        f"copy{path}.register_buffer(name, t.clone())), or before strategy.mirror()")
