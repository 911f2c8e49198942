"""What code outside ``strategy.run`` changes on replica 0's copy of a mirrored model
through the model (a method, a forward, an in-place edit of ``model.parameters()``),
carried to the other copies at the next ``run`` (`structure.check_module`).

Outside ``run`` the mirrored model reads as replica 0's copy. When it is handed out
(`structure.expose`), every copy's modules are recorded (`record`): their plain
attributes, and their buffers' and parameters' tensors and version counters. At the
next ``run`` (`carry_state`; or before a change made to every copy, `settle`), what
changed on replica 0's copy since, and not on the other copy, is given to the other
copy: plain attributes of immutable values, buffers registered
(``model[3].register_buffer(name, t)``), written in place or replaced
(``model.reset_state()``, ``reset_running_stats()``, a
forward in train mode updating an EMA or BatchNorm's statistics), and parameters
written in place (``with torch.no_grad(): for p in model.parameters(): p.clamp_(-c, c)``,
a WGAN critic's clipping; TF's assignment to a mirrored variable outside a replica
updates every copy), also replaced through ``.data`` (``vector_to_parameters``: the
memory moves). A change made on that copy too is its own and kept. Writes in place
through ``.data`` move no version counter and are not seen; the divergence check
finds a parameter changed that way at its next checked step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy

__all__ = ["carry_state", "record", "settle"]

Record = tuple[dict[str, Any], dict[str, tuple[torch.Tensor, Any]],
               dict[str, tuple[torch.Tensor, Any]]]


def record(module: nn.Module) -> Record:
    """``module``'s plain attributes, and its buffers' and parameters' tensors and
    versions, as they are now."""
    return (_plain(module), _versions(module, module._buffers),
            _versions(module, module._parameters))


def carry_state(before: Record, theirs_before: Record, first: nn.Module,
                other: nn.Module, device: torch.device) -> None:
    """Gives ``other`` (a module of the copy on ``device``) what replica 0's ``first``
    changed since ``before`` was recorded, where ``other`` is as ``theirs_before``
    recorded it (see the module)."""
    _plain_state(before[0], theirs_before[0], first, other)
    _added_buffers(before[1], theirs_before[1], first, other, device)
    _tensor_state(before[1], theirs_before[1], first, other, buffers=True)
    _tensor_state(before[2], theirs_before[2], first, other, buffers=False)


def settle(module: Any) -> None:
    """Before a change made to every copy of mirrored ``module`` outside ``run``
    (``model.eval()``, ``model.x = v``, ``model.load_state_dict``): what replica 0's
    copy changed since the pending `expose` record (a load into the module given to
    `mirror`, a method's reset) is carried to the others now, and the record dropped
    (the change to come is every copy's own)."""
    own = module.__dict__
    seen = own.pop("_plain_seen", None)
    mods = own.get("_modules")
    if seen is None or mods is None or any(len(s) != len(m) for s, m in zip(seen, mods,
                                                                              strict=True)):
        return  # (a layout changed since: the next run's check raises or takes it)
    for k, copy_modules in enumerate(mods[1:], start=1):
        for i, (m0, m) in enumerate(zip(mods[0], copy_modules, strict=True)):
            carry_state(seen[0][i], seen[k][i], m0, m, own["_devices"][k])


_TORCH_OWN = frozenset(nn.Module().__dict__)  # (what torch keeps in a module's __dict__)
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _plain(module: nn.Module) -> dict[str, Any]:
    return {name: value for name, value in module.__dict__.items() if name not in _TORCH_OWN}


_GONE = object()


def _plain_state(before: dict[str, Any], theirs_before: dict[str, Any], first: nn.Module,
                 other: nn.Module) -> None:
    """Gives ``other`` the plain attributes of immutable values (None, numbers, strings,
    tuples of them) that replica 0's ``first`` changed outside ``run`` since ``before``
    was recorded, where ``other``'s are as ``theirs_before`` recorded: a method of the
    user's module called through the mirrored model there (``model.reset_state()``)
    ran on replica 0's copy alone. One a copy set itself (in ``run``, or through
    ``model.replicas``) is its own, and kept; tensors and other objects are not copied."""
    now, theirs = first.__dict__, other.__dict__
    for name in (now.keys() | before.keys()) - _TORCH_OWN:
        value = now.get(name, _GONE)
        if (_same(before.get(name, _GONE), value) or not _immutable(value)
                or not _same(theirs_before.get(name, _GONE), theirs.get(name, _GONE))):
            continue  # (unchanged on replica 0, not plain, or changed on this copy)
        if value is _GONE:  # (deleted on replica 0's copy)
            theirs.pop(name, None)
        else:
            theirs[name] = value


def _versions(module: nn.Module, tensors: dict[str, Any]) -> dict[str, tuple[torch.Tensor, Any]]:
    return {n: (t, _version(module, n, t)) for n, t in tensors.items() if t is not None}


def _version(module: nn.Module, name: str, t: torch.Tensor) -> Any:
    """``t``'s version and memory, with ``num_batches_tracked``'s version for BatchNorm's
    running statistics (torch's kernel updates them in a forward in train mode without
    moving theirs). The memory moves when ``t.data = v`` replaces its values (torch's
    ``vector_to_parameters``), which leaves the version counter as it was."""
    running = name in ("running_mean", "running_var")
    tracked = module._buffers.get("num_batches_tracked") if running else None
    return (t._version, None if is_lazy(t) else t.data_ptr(),
            None if tracked is None else tracked._version)


def _tensor_state(before: dict[str, tuple[torch.Tensor, Any]],
                  theirs_before: dict[str, tuple[torch.Tensor, Any]], first: nn.Module,
                  other: nn.Module, *, buffers: bool) -> None:
    """Gives ``other`` the buffers (``buffers``) or parameters that replica 0's ``first``
    changed outside ``run`` (written in place; a buffer also replaced) since ``before``
    was recorded, where ``other``'s are as ``theirs_before`` recorded: else the next
    step averaged replica 0's reset buffer with the others' old one, and a parameter
    clipped on replica 0 alone made the copies differ. A tensor added (a
    buffer: `_added_buffers`), or written through ``.data`` (torch's version counter
    does not move), is left alone here; so is a
    parameter replaced or reshaped (the layout check names it), and a lazy one (its
    initialization is the layout check's)."""
    own: dict[str, Any] = first._buffers if buffers else first._parameters
    theirs: dict[str, Any] = other._buffers if buffers else other._parameters
    for name, t in own.items():
        was, mine = before.get(name), theirs.get(name)
        if t is None or mine is None or is_lazy(t) or is_lazy(mine) or (
                was is not None and was[0] is t
                                         and was[1] == _version(first, name, t)):
            continue
        kept = theirs_before.get(name)
        if kept is None or kept[0] is not mine or kept[1] != _version(other, name, mine):
            continue  # (changed on this copy too: its own)
        if mine.shape == t.shape and mine.dtype == t.dtype:
            with torch.no_grad():
                mine.copy_(t)
        elif buffers:
            theirs[name] = t.detach().to(mine.device, copy=True)


def _added_buffers(before: dict[str, Any], theirs_before: dict[str, Any], first: nn.Module,
                   other: nn.Module, device: torch.device) -> None:
    """Registers on ``other`` (a copy on ``device`` of it, persistent or not as there) each
    buffer registered on replica 0's ``first`` since ``before`` was recorded that ``other``
    lacks: ``model[3].register_buffer(name, t)`` outside ``run`` (a submodule is replica
    0's copy there), or a cache a forward outside ``run`` registers, as one device has it."""
    for name, t in list(first._buffers.items()):
        if name in before or name in theirs_before or hasattr(other, name):
            continue  # (not new, or a name the other copy holds: `check_hooks` compares)
        other.register_buffer(name, None if t is None else t.detach().to(device, copy=True),
                              persistent=name not in first._non_persistent_buffers_set)


def _immutable(value: Any) -> bool:
    if isinstance(value, tuple | frozenset):
        return all(_immutable(v) for v in value)
    return value is _GONE or isinstance(value, _IMMUTABLE)


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and _immutable(a) and bool(a == b))


