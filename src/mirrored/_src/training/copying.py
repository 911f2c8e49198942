"""How a mirrored model's copy is made: a deep copy on the replica's device that
keeps what ``copy.deepcopy`` loses (gradient hooks on its tensors, a parametrized
module's own class), and the warning about gradient hooks that run per replica."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..collectives.call import user_stacklevel
from ..errors import GradientHookWarning

__all__ = ["copy_to", "warn_gradient_hooks"]


def copy_to(module: nn.Module, device: torch.device) -> nn.Module:
    """A copy of ``module`` on ``device`` (a replica's), with the hooks its parameters
    and buffers had (``tensor.register_hook``, which ``copy.deepcopy`` drops: a
    gradient scaled by a hook on one device is scaled on every replica)."""
    other = copy.deepcopy(module).to(device)
    for t0, t in zip([*module.parameters(), *module.buffers()],
                     [*other.parameters(), *other.buffers()], strict=True):
        for hook in (t0._backward_hooks or {}).values():
            if t.requires_grad:
                t.register_hook(hook)  # type: ignore[no-untyped-call]
    for m in other.modules():
        if parametrize.is_parametrized(m):
            _own_parametrized_class(m)
    return other


def warn_gradient_hooks(module: nn.Module) -> None:
    """Warns (`GradientHookWarning`) if parameters of ``module``, mirrored on several
    replicas, have gradient hooks: each runs on its replica's local gradient."""
    hooked = [name for name, p in module.named_parameters() if p._backward_hooks]
    if hooked:
        more = f" (and {len(hooked) - 1} more)" if len(hooked) > 1 else ""
        warnings.warn(GradientHookWarning(
            f"mirror(strategy, module): parameter {hooked[0]!r}{more} has gradient hooks "
            "(Tensor.register_hook), which run on each replica's local gradient before the "
            "step's all-reduce, where one device runs them on the whole batch's gradient: "
            "a hook linear in the gradient (g * s) gives one device's result, any other "
            "(g.clamp(-c, c), g.sign(), a normalisation) trains a different model. Clip "
            "with optimizer.step(clip_grad_value=c) or step(clip_grad_norm=c) instead; for "
            "linear hooks, silence this with warnings.filterwarnings('ignore', "
            "category=mirrored.GradientHookWarning)"), stacklevel=user_stacklevel())


def _own_parametrized_class(module: nn.Module) -> None:
    """Gives a deep copy of a parametrized module a class of its own. ``deepcopy``
    keeps the original's, whose properties key ``parametrize.cached()``'s cache by
    the *original* module: under ``cached()`` every copy then read the tensor the
    first replica computed, and its backward went into that replica's gradients."""
    module.__class__ = type(module).__bases__[0]
    parametrize._inject_new_class(module)  # (torch's own, as register_parametrization)
    for name in list(module.parametrizations):  # type: ignore[arg-type]
        parametrize._inject_property(module, name)
