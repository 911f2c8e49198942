"""A replica's own optimizer stepped and zeroed without torch's per-call wrapper when
nothing observes it.

``Optimizer.step`` of every ``torch.optim`` class is wrapped by torch
(``Optimizer.profile_hook_step``): a ``record_function`` range, the global and
per-optimizer step hooks and the profiler's ``_optimizer_step_code`` entry point
around the class's own ``step``. ``Optimizer.zero_grad`` opens a ``record_function``
range too. With no profiler running those ranges record nothing, yet entering one
goes through torch's dispatcher: the wrapper costs about 50 µs and the range of
``zero_grad`` about 20 µs a step on the development machine, a tenth of a small
model's plain optimizer step. A `MirroredOptimizer` already runs the step hooks
registered on it and torch's global ones (`MirroredOptimizer.step`), and its
per-replica optimizers are its own: when none of them has a hook, an instance
``step`` of its own (an LR scheduler built on it patches one) or a subclass's
``zero_grad``, no profiler records, no torch function or dispatch mode is active (a
mode entered inside the step function sees the ranges' ops) and the functions
involved are torch's own (not patched by another library, before or after this
module's import: a class's ``step`` exactly torch's wrapper, ``zero_grad`` and the
step-tracing entry point ``_optimizer_step_code`` torch's code), `step` calls the
class's unwrapped ``step`` and `zero_grad` sets the gradients to ``None`` itself:
the same updates, bitwise. Otherwise both go through torch's wrappers, so a trace
shows their ranges, and hooks and tracers see every step, as on one device.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.optim.optimizer as _torch_optimizer

from ..runtime.replica_call import profiling
from .plain_optimizer import GUARD

__all__ = ["GLOBAL_POST_HOOKS", "GLOBAL_PRE_HOOKS", "hooked", "step", "zero_grad"]

# torch's registries of global optimizer hooks (empty dicts if this torch has none).
GLOBAL_PRE_HOOKS: dict[Any, Any] = getattr(_torch_optimizer, "_global_optimizer_pre_hooks", {})
GLOBAL_POST_HOOKS: dict[Any, Any] = vars(_torch_optimizer).get("_global_optimizer_post_hooks", {})
_Optimizer = torch.optim.Optimizer
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


def _nothing() -> None:
    """What `_WRAPPER_CODE` is taken from torch's wrapper around."""


def _torchs(fn: Any, name: str) -> Any:
    """``fn`` if it is torch's own (every layer's code in torch's package, the innermost
    named ``name``), else ``None``: patched by another library before this module was
    imported, so never skipped."""
    top, code = fn, None
    while fn is not None:
        code = getattr(fn, "__code__", None)
        if code is None or not code.co_filename.startswith(_TORCH_DIR):
            return None
        fn = getattr(fn, "__wrapped__", None)
    return top if code is not None and code.co_name == name else None


# The code of torch's wrapper (`profile_hook_step`'s inner function), to know it by.
_WRAPPER_CODE = getattr(getattr(_Optimizer, "profile_hook_step", None) and
                        _Optimizer.profile_hook_step(_nothing), "__code__", None)
if _WRAPPER_CODE is not None and not _WRAPPER_CODE.co_filename.startswith(_TORCH_DIR):
    _WRAPPER_CODE = None  # (another library's profile_hook_step: never skipped)
# torch's own zero_grad and step-tracing entry point (`_torchs`); patched later by
# another library, a class's are not these
_ZERO_GRAD = _torchs(_Optimizer.zero_grad, "zero_grad")
_STEP_CODE = _torchs(getattr(_Optimizer, "_optimizer_step_code", None), "_optimizer_step_code")
# modes entered inside the step function see the ranges' ops: kept for them
_function_modes = torch._C._len_torch_function_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack
# a class's step as found (the function object: a class patched later is looked up
# again) -> the function under torch's wrapper, or None (not torch's wrapper: called as
# is); emptied past 256 (classes made on the fly)
_raw_steps: dict[Any, Callable[..., Any] | None] = {}


def _raw_step(kind: type[torch.optim.Optimizer]) -> Callable[..., Any] | None:
    """The function torch's wrapper calls for ``kind.step`` (``None``: ``kind.step`` is
    not exactly torch's wrapper, e.g. another library's wrapper around it)."""
    wrapped = kind.step
    try:
        return _raw_steps[wrapped]
    except KeyError:
        pass
    raw = getattr(wrapped, "__wrapped__", None) if (
        _WRAPPER_CODE is not None and getattr(wrapped, "__code__", None) is _WRAPPER_CODE
    ) else None
    if len(_raw_steps) >= 256:
        _raw_steps.clear()
    _raw_steps[wrapped] = raw
    return raw


def hooked(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a step of ``optimizer`` has torch step hooks to run: its own, or global
    ones besides the plain-optimizer guard (`plain_optimizer.GUARD`, which trusts
    mirrored optimizers).

    Example:
        >>> import torch
        >>> hooked(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.5))
        False
    """
    return bool(optimizer._optimizer_step_pre_hooks or optimizer._optimizer_step_post_hooks
                or len(GLOBAL_PRE_HOOKS) > GUARD[0] or GLOBAL_POST_HOOKS)


def step(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.step()`` of a mirrored optimizer's own (trusted) replica optimizer;
    see the module's docstring.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> p.grad = torch.ones(2)
        >>> step(torch.optim.SGD([p], lr=0.5))
        >>> p.detach()
        tensor([0.5000, 0.5000])
    """
    raw = _raw_step(type(optimizer))
    if (raw is None or hooked(optimizer) or "step" in vars(optimizer) or profiling()
            or getattr(type(optimizer), "_optimizer_step_code", None) is not _STEP_CODE
            or _function_modes() or _dispatch_modes()):
        optimizer.step()
    else:
        raw(optimizer)


def zero_grad(optimizer: torch.optim.Optimizer, set_to_none: bool) -> None:
    """``optimizer.zero_grad(set_to_none)``; see the module's docstring.

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> p.grad = torch.ones(2)
        >>> zero_grad(torch.optim.SGD([p], lr=0.5), True)
        >>> p.grad is None
        True
    """
    if (not set_to_none or type(optimizer).zero_grad is not _ZERO_GRAD
            or "zero_grad" in vars(optimizer) or profiling() or _function_modes()
            or _dispatch_modes()):
        optimizer.zero_grad(set_to_none)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
