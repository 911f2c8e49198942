"""Clipping the all-reduced gradients, in ``MirroredOptimizer.step``.

On one device ``clip_grad_norm_`` or ``clip_grad_value_`` between ``backward()`` and
``optimizer.step()`` clips the whole batch's gradient. On N replicas each replica's
``.grad`` holds its own part until the step's all-reduce, and the sum of clipped
parts is not the clipped sum (the watch refuses such a change: `gradient_watch`).
``step(clip_grad_norm=c)`` and ``step(clip_grad_value=c)`` clip the sum, after the
all-reduce and before the local optimizer steps, as one device does (the norm
first, then the values, when both are given).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

__all__ = ["clip", "validate"]


def validate(clip_grad_norm: object, clip_grad_value: object) -> None:
    """Raises `ValueError` unless each is ``None`` or a positive finite number.

    Example:
        >>> validate(1.0, None)
        >>> validate(None, -1)
        Traceback (most recent call last):
        ...
        ValueError: clip_grad_value must be a positive finite number or None; got -1
    """
    for name, value in (("clip_grad_norm", clip_grad_norm), ("clip_grad_value", clip_grad_value)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not value > 0 or math.isinf(value)):
            raise ValueError(f"{name} must be a positive finite number or None; got {value!r}")


def clip(params: Sequence[nn.Parameter], clip_grad_norm: float | None,
         clip_grad_value: float | None) -> None:
    """Clips the (all-reduced) gradients of ``params`` in place, as torch's
    ``clip_grad_norm_`` and ``clip_grad_value_`` do."""
    if clip_grad_norm is not None:
        nn.utils.clip_grad_norm_(params, clip_grad_norm)
    if clip_grad_value is not None:
        nn.utils.clip_grad_value_(params, clip_grad_value)
