"""torch's optimizer hooks on a `MirroredOptimizer`, run as torch's own methods run them.

``Optimizer.step`` of a torch class runs the global and the optimizer's step hooks
around it (``profile_hook_step``): a pre hook sees the call's arguments, ``(optimizer,)``
for ``optimizer.step()``, may return new ``(args, kwargs)`` that the step then takes,
and anything else is refused. ``Optimizer.state_dict`` and ``load_state_dict`` run the
hooks registered with ``register_state_dict_pre_hook`` / ``_post_hook`` and
``register_load_state_dict_pre_hook`` / ``_post_hook``, and use what a state-dict post
hook or a load pre hook returns. A `MirroredOptimizer` overrides all three (it steps
every replica's optimizer, and its state dict is replica 0's), so it runs them here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .direct import GLOBAL_POST_HOOKS, GLOBAL_PRE_HOOKS

__all__ = ["load_state_dict", "state_dict", "step"]


def step(optimizer: torch.optim.Optimizer, call: Callable[..., Any],
         closure: Callable[[], Any] | None, **given: Any) -> Any:
    """``call(optimizer, closure, **given)`` inside torch's step hooks (global ones
    first before, last after), with the arguments the pre hooks return (they see those
    of ``given`` that are not ``None``: torch's hooks see the arguments passed).

    Raises:
        RuntimeError: a pre hook returned neither ``None`` nor ``(args, kwargs)``.

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.5)
        >>> h = opt.register_step_pre_hook(lambda o, args, kwargs: ((*args, "new"), kwargs))
        >>> step(opt, lambda o, closure=None: closure, None)
        'new'
    """
    args: tuple[Any, ...] = (optimizer,) if closure is None else (optimizer, closure)
    kwargs = {k: v for k, v in given.items() if v is not None}
    for pre in (*GLOBAL_PRE_HOOKS.values(), *optimizer._optimizer_step_pre_hooks.values()):
        result = pre(optimizer, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(
                    f"the optimizer step pre-hook {pre!r} must return None or a tuple of "
                    f"(new_args, new_kwargs), but got {result!r} (as torch requires)")
            args, kwargs = result
    out = call(*args, **kwargs)
    for post in (*optimizer._optimizer_step_post_hooks.values(), *GLOBAL_POST_HOOKS.values()):
        post(optimizer, args, kwargs)
    return out


def state_dict(optimizer: torch.optim.Optimizer, inner: torch.optim.Optimizer
               ) -> dict[str, Any]:
    """``inner.state_dict()`` within ``optimizer``'s state-dict hooks (a post hook's
    result replaces the state dict, as in torch).

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.5)
        >>> h = opt.register_state_dict_post_hook(lambda o, sd: {**sd, "extra": 1})
        >>> state_dict(opt, torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.5))["extra"]
        1
    """
    for pre in optimizer._optimizer_state_dict_pre_hooks.values():
        pre(optimizer)
    result = inner.state_dict()
    for post in optimizer._optimizer_state_dict_post_hooks.values():
        changed = post(optimizer, result)
        if changed is not None:
            result = changed
    return result


def load_state_dict(optimizer: torch.optim.Optimizer, state: dict[str, Any],
                    load: Callable[[dict[str, Any]], object]) -> None:
    """``load(state)`` within ``optimizer``'s load-state-dict hooks (a pre hook's result
    is what is loaded, as in torch; the hooks get a shallow copy of ``state``).

    Example:
        >>> import torch
        >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.5)
        >>> h = opt.register_load_state_dict_post_hook(lambda o: print("loaded"))
        >>> load_state_dict(opt, {}, lambda sd: None)
        loaded
    """
    state = state.copy()
    for pre in optimizer._optimizer_load_state_dict_pre_hooks.values():
        changed = pre(optimizer, state)
        if changed is not None:
            state = changed
    load(state)
    for post in optimizer._optimizer_load_state_dict_post_hooks.values():
        post(optimizer)
