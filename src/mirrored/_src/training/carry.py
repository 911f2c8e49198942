"""`CarriedGradients`: a step's gradients left in ``.grad`` count once, as on one device.

On one device, a ``backward()`` after ``optimizer.step()`` without ``zero_grad()``
adds to the gradient the step used: the next step sees that old gradient once plus
the new one. On N replicas every copy holds the old (all-reduced) gradient, and a
plain all-reduce would sum it N times. So the old gradient is taken out of every
replica's ``.grad`` before the next backward adds to it, kept aside (each replica
keeps its own copy, and they are equal), and added back to the all-reduced sum of
the new gradients: one device's ``old + new``.

What is "left": at the end of each step a replica's gradients are recorded with
their version counters. A gradient that is still the same tensor at the same
version when the next backward starts was not touched since (``zero_grad()``
replaces it or, with ``set_to_none=False``, zeroes it in place: either way it is
no longer left). Backward starts are seen by a hook on the mirrored model's
outputs, registered only while some replica holds recorded gradients (a loop that
calls ``zero_grad()`` before the forward pass registers none). A step reached with
no backward since the last one (``step()`` twice) finds its gradients untouched and
treats them the same way. A backward whose start was not seen (the forward ran a
submodule or ``model.module`` directly) onto gradients left from the last step
cannot be told from one after an in-place ``p.grad.zero_()``: the step raises
rather than guess.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree

__all__ = ["CarriedGradients", "add_kept", "hook_outputs", "skip_in_dynamo"]


class CarriedGradients:
    """The gradients each local replica's last step left in ``.grad``.

    Args:
        params: each local replica's parameters (one optimizer's).
        pending: the mirrored module's per-replica lists of the `CarriedGradients`
            whose replica holds recorded gradients (its forward hooks the outputs).
    """

    def __init__(self, params: Sequence[Sequence[nn.Parameter]],
                 pending: Sequence[list[CarriedGradients]]) -> None:
        self._params = params
        self._pending = pending
        self._left: list[list[tuple[torch.Tensor, int] | None] | None] = [None] * len(params)
        self._kept: list[list[torch.Tensor | None] | None] = [None] * len(params)

    def record(self, r: int) -> None:
        """At the end of replica ``r``'s step: its gradients, as the step leaves them."""
        self._left[r] = [None if (g := p.grad) is None else (g, g._version)
                         for p in self._params[r]]
        if self not in self._pending[r]:
            self._pending[r].append(self)

    def forget(self, r: int) -> None:
        """Replica ``r``'s gradients were reset (``zero_grad``)."""
        self._left[r] = self._kept[r] = None
        if self in self._pending[r]:
            self._pending[r].remove(self)

    def backward_starts(self, r: int) -> None:
        """Keeps aside replica ``r``'s gradients untouched since its step, so that
        the backward now starting writes only the new ones."""
        left = self._left[r]
        if left is None:
            return
        self.forget(r)
        self._kept[r] = self._keep(r, left, strict=False)

    def take(self, r: int) -> list[torch.Tensor | None] | None:
        """At replica ``r``'s all-reduce: the gradients kept aside, to add to the sum
        (``None``: none). Untouched ones still in ``.grad`` (no backward since the
        last step) are kept aside now.

        Raises:
            RuntimeError: a gradient left by the last step was changed in place by a
                backward whose start was not seen (see the module's docstring).
        """
        left, kept = self._left[r], self._kept[r]
        if left is not None:
            self.forget(r)
            kept = self._keep(r, left, strict=True)
        self._kept[r] = None
        return kept

    def _keep(self, r: int, left: list[tuple[torch.Tensor, int] | None], *, strict: bool
              ) -> list[torch.Tensor | None] | None:
        kept: list[torch.Tensor | None] | None = None
        changed: list[int] = []
        for k, (p, was) in enumerate(zip(self._params[r], left, strict=True)):
            if was is None or p.grad is not was[0]:
                continue
            if was[0]._version != was[1]:
                changed.append(k)
                continue
            if kept is None:
                kept = [None] * len(left)
            kept[k] = was[0]
            p.grad = None
        if strict and changed:
            raise RuntimeError(_CHANGED.format(n=len(changed)))
        return kept


def add_kept(params: Sequence[nn.Parameter], kept: list[torch.Tensor | None]) -> None:
    """Adds the gradients kept aside to the all-reduced ones (one device's
    ``old + new``; an old gradient alone where no replica had a new one)."""
    for p, old in zip(params, kept, strict=True):
        if old is not None:
            p.grad = old if p.grad is None else p.grad + old


def hook_outputs(output: Any, pending: list[CarriedGradients], r: int) -> None:
    """Registers, on the tensors of a mirrored model's ``output`` that require a
    gradient, a hook that tells ``pending``'s `CarriedGradients` when a backward
    through them starts (before it reaches any parameter used in the forward)."""
    tensors = [output] if isinstance(output, torch.Tensor) else _pytree.tree_leaves(output)
    starts = _Starts(pending, r)
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(starts)  # type: ignore[no-untyped-call]


class _Starts:
    """The outputs' hook: tells ``pending`` that replica ``r``'s backward starts."""

    def __init__(self, pending: list[CarriedGradients], r: int) -> None:
        self.pending, self.r = pending, r

    def __call__(self, _: torch.Tensor) -> None:
        for carried in list(self.pending):
            carried.backward_starts(self.r)


_CHANGED = (
    "MirroredOptimizer.step: {n} gradient(s) left in .grad by the last step were changed "
    "in place since (no zero_grad() in between), by a backward() that did not go through "
    "the mirrored model's call (a submodule or model.module called directly) or by an "
    "in-place change (p.grad.zero_()). Each replica holds the last step's all-reduced "
    "gradient, so summing it again would count it once per replica where one device "
    "counts it once, and the two cases cannot be told apart. Call optimizer.zero_grad() "
    "(or model.zero_grad()) between steps, or call the mirrored model itself")


def skip_in_dynamo(code: Any, *, inside: bool = False) -> None:
    """Dynamo skips the frame of ``code`` and compiles what it calls, or runs all of
    that eagerly too (``inside``). Through torch's C extension: importing
    ``torch._dynamo`` takes seconds. Older torch without it traces the frames."""
    try:
        from torch._C._dynamo.eval_frame import (
            _FrameAction,
            _FrameExecStrategy,
            set_code_exec_strategy,
        )
    except ImportError:  # pragma: no cover
        return
    inner = _FrameAction.SKIP if inside else _FrameAction.DEFAULT
    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, inner))


# (eager code between compiled frames: nothing here is traced)
skip_in_dynamo(hook_outputs.__code__, inside=True)
skip_in_dynamo(_Starts.__call__.__code__, inside=True)
