"""Torch's thread-local state that a replica thread must share with the caller of
``run``: grad mode, inference mode, CPU and CUDA autocast, the intra-op thread
count (``torch.set_num_threads``) and saved-tensor hooks.

`capture` reads it on the caller's thread; `ThreadState.apply` enters it on a
replica thread for the duration of the replica's function (nothing is entered when
the replica thread already matches, the common case). Torch function and dispatch
modes (other than ``torch.device(...)``, which `run` handles) are *not* carried:
one mode object cannot be active on several threads at once, so `refused_modes`
names them and ``run`` refuses to start rather than apply them to one replica only.

The runtime runs each replica on a replica thread in a copy of the caller's
context variables: torch keeps the user's ``torch._dynamo.config`` and
``torch._inductor.config`` settings per thread (in ``ContextVar``s), so without it
replicas 1..N-1 would compile with torch's defaults while replica 0 (on the
caller's thread) uses the caller's settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

__all__ = ["ThreadState", "capture", "plain_thread", "refused_modes"]

_Hooks = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None


def _hooks() -> _Hooks:
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


@dataclasses.dataclass(frozen=True, slots=True)
class ThreadState:
    """A snapshot of the caller's thread-local torch settings."""

    grad: bool
    inference: bool
    cpu_autocast: bool
    cpu_dtype: torch.dtype
    cuda_autocast: bool
    cuda_dtype: torch.dtype
    num_threads: int
    hooks: _Hooks

    def is_plain(self) -> bool:
        """Whether these are torch's defaults for a new thread (but the thread count):
        grad on, no inference mode, no autocast, no saved-tensor hooks."""
        return (self.grad and not self.inference and not self.cpu_autocast
                and not self.cuda_autocast and self.hooks is None)

    def apply(self, stack: contextlib.ExitStack) -> None:
        """Enters, on ``stack``, every setting of this thread that differs from the
        snapshot (the thread count is set, and stays set on the replica thread)."""
        if torch.is_inference_mode_enabled() != self.inference:
            stack.enter_context(torch.inference_mode(self.inference))
        if torch.is_grad_enabled() != self.grad:
            stack.enter_context(torch.set_grad_enabled(self.grad))
        if (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) != (
                self.cpu_autocast, self.cpu_dtype):
            stack.enter_context(torch.autocast("cpu", dtype=self.cpu_dtype,
                                               enabled=self.cpu_autocast))
        if (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")) != (
                self.cuda_autocast, self.cuda_dtype):
            stack.enter_context(torch.autocast("cuda", dtype=self.cuda_dtype,
                                               enabled=self.cuda_autocast))
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        if self.hooks is not None and _hooks() != self.hooks:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.hooks))


def plain_thread() -> bool:
    """Whether this thread has torch's defaults for a new thread (what a replica thread
    has): grad on, no inference mode, no autocast, no saved-tensor hooks. Cheaper than
    `capture` (no snapshot); see `ThreadState.is_plain`."""
    return (torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
            and not torch._C._is_any_autocast_enabled()
            and torch._C._autograd._top_saved_tensors_default_hooks(False) is None)  # (_hooks)


def capture() -> ThreadState:
    """The calling thread's settings."""
    return ThreadState(torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                       torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                       torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
                       torch.get_num_threads(), _hooks())


def refused_modes() -> list[str]:
    """The active torch function/dispatch modes `run` cannot carry into replica threads."""
    if torch._C._len_torch_function_stack() == 0 and not _get_current_dispatch_mode_stack():
        return []
    stack = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]
    modes = [m for m in stack if not isinstance(m, DeviceContext)]
    return [type(m).__name__ for m in [*modes, *_get_current_dispatch_mode_stack()]]
