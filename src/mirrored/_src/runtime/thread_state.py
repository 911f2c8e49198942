"""Torch's thread-local state that a replica thread must share with the caller of
``run``: grad mode, inference mode, and CPU and CUDA autocast.

`capture` reads it on the caller's thread; `apply` enters it on a replica
thread for the duration of the replica's function (nothing is entered when the
replica thread already matches, the common case).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

__all__ = ["ThreadState", "capture"]


@dataclasses.dataclass(frozen=True, slots=True)
class ThreadState:
    """A snapshot of the caller's thread-local torch modes."""

    grad: bool
    inference: bool
    cpu_autocast: bool
    cpu_dtype: torch.dtype
    cuda_autocast: bool
    cuda_dtype: torch.dtype

    def apply(self, stack: contextlib.ExitStack) -> None:
        """Enters, on ``stack``, every mode of this thread that differs from the snapshot."""
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


def capture() -> ThreadState:
    """The calling thread's modes."""
    return ThreadState(torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                       torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
                       torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
