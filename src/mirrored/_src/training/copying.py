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

__all__ = ["copy_to", "refuse_per_replica_layers", "warn_gradient_hooks"]


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


def refuse_per_replica_layers(module: nn.Module, sync_batch_norm: bool, replicas: int) -> None:
    """Refuses, before any copy is made, layers that would train per replica (or could
    not be copied) on ``replicas`` replicas in all.

    Raises:
        ValueError: an embedding with ``max_norm`` (it renormalizes the rows its own
            batch looks up), a ``torch.nn.SyncBatchNorm`` without
            ``sync_batch_norm=True`` (outside a process group it normalizes each
            replica's batch alone), or a lazy layer with uninitialized buffers
            (``LazyBatchNorm``: no copy can be made before its first forward).
    """
    if replicas < 2:
        return
    for name, m in module.named_modules():
        name = name or "the module"
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.max_norm is not None:
            raise ValueError(
                f"mirror(strategy, module): {name} is an embedding with max_norm, which "
                "renormalizes in place, during forward, the rows its batch looks up: each "
                "replica would renormalize the rows of its own part of the batch, where one "
                "device renormalizes those of the whole batch, and the copies would drift "
                "apart. Leave max_norm=None (and constrain the weights after "
                "optimizer.step() if you need to)")
        if isinstance(m, nn.SyncBatchNorm) and not sync_batch_norm:
            raise ValueError(
                f"mirror(strategy, module): {name} is a torch.nn.SyncBatchNorm (DDP's, from "
                "convert_sync_batchnorm), which outside a process group normalizes each "
                "replica's batch alone, where one device (and DDP) normalizes the global "
                "batch. Pass sync_batch_norm=True to mirror, which gives every BatchNorm "
                "the global batch's statistics, or convert the layer back to BatchNorm")
        if any(isinstance(b, nn.parameter.UninitializedBuffer) for b in m.buffers(False)):
            raise ValueError(
                f"mirror(strategy, module): {name} ({type(m).__name__}) is a lazy layer "
                "whose buffers are not initialized yet, which no copy can be made of; run "
                "one forward pass on the module (a batch of the real shape) before mirror, "
                "or give the layer its size (BatchNorm1d(num_features))")
