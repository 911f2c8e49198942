"""The math of combining replica components: axis handling, sum + count for MEAN,
dtype promotion, and the checks that turn bad input into clear errors.

Everything here works on a list of one tensor per replica (``components``) and
is pure: no strategies, no threads. Components are always combined in replica
order, so results are bitwise reproducible.

With ``axis``, the MEAN is the global sum over the global count::

    mean = (sum_i sum_{axis}(x_i)) / (sum_i prod_{a in axis} x_i.shape[a])

so replicas may hold different numbers of examples (a partial last batch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from .buffers import default_pool
from .reduce_op import ReduceOp

__all__ = [
    "combine",
    "copy_to",
    "describe",
    "describe_spec",
    "gather_components",
    "mean_dtype",
    "normalize_axis",
    "reduce_components",
    "sum_dtype",
]

_FLOAT32_MEAN = (torch.int8, torch.uint8, torch.int16)


def describe(tensor: torch.Tensor) -> str:
    """``float32[4, 3]``: a tensor's dtype and shape, as error messages print them."""
    return describe_spec(tensor.dtype, tuple(tensor.shape))


def describe_spec(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    """`describe` from a dtype and a shape."""
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


def normalize_axis(axis: Any) -> tuple[int, ...] | None:
    """``None``, an int, or a tuple/list of ints -> ``None`` or a tuple of ints.

    Raises:
        TypeError: ``axis`` is of another type (``bool`` included).
    """
    if axis is None:
        return None
    if isinstance(axis, bool) or not isinstance(axis, int | tuple | list):
        raise TypeError(
            f"axis must be None, an int or a tuple of ints; got {type(axis).__name__} {axis!r}"
        )
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    for a in axes:
        if isinstance(a, bool) or not isinstance(a, int):
            raise TypeError(f"axis must contain only ints; got {type(a).__name__} {a!r} in "
                            f"{axis!r}")
    return axes


def sum_dtype(op: ReduceOp, dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are accumulated in: integer MEANs sum exactly in int64 before the
    true division (no int8 overflow on the way to a float32 mean); everything else
    keeps its dtype (SUM of int8 wraps, as it does in TF)."""
    if op is ReduceOp.MEAN and not (dtype.is_floating_point or dtype.is_complex):
        return torch.int64
    return dtype


def mean_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a MEAN: floats keep theirs; int8/uint8/int16 -> float32; other
    integers -> float64 (true division, as in TF)."""
    if dtype.is_floating_point or dtype.is_complex:
        return dtype
    if dtype in _FLOAT32_MEAN:
        return torch.float32
    return torch.float64


def _listing(components: Sequence[torch.Tensor], labels: Sequence[str]) -> str:
    return "; ".join(f"{label}: {describe(c)}" for label, c in zip(labels, components,
                                                                   strict=True))


def _check_dtypes(name: str, op: ReduceOp | None, components: Sequence[torch.Tensor],
                  labels: Sequence[str], where: str) -> torch.dtype:
    dtype = components[0].dtype
    if any(c.dtype != dtype for c in components):
        raise ValueError(
            f"{name} needs components of one dtype at {where}; got "
            f"{_listing(components, labels)}"
        )
    if op is not None and dtype == torch.bool:
        raise TypeError(
            f"{name} cannot reduce bool tensors (at {where}); cast them first, e.g. "
            "x.to(torch.int32)"
        )
    if op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.is_complex:
        raise TypeError(f"{name} is not defined for complex dtype {dtype} (at {where})")
    return dtype


def _normalize_dims(name: str, axes: tuple[int, ...], components: Sequence[torch.Tensor],
                    labels: Sequence[str], where: str) -> tuple[int, ...]:
    rank = components[0].dim()
    if any(c.dim() != rank for c in components):
        raise ValueError(
            f"{name} needs components of one rank at {where}; got "
            f"{_listing(components, labels)}"
        )
    if rank == 0 and axes:
        raise ValueError(
            f"{name} got rank-0 components at {where} ({_listing(components, labels)}), which "
            f"have no axis {axes[0]}; use axis=None to reduce scalars across replicas"
        )
    dims = []
    for a in axes:
        if not -rank <= a < rank:
            raise ValueError(
                f"{name}: axis {a} is out of range for rank-{rank} components at {where} "
                f"(valid axes are {-rank}..{rank - 1}); got {_listing(components, labels)}"
            )
        dims.append(a % rank)
    if len(set(dims)) != len(dims):
        raise ValueError(f"{name}: axis {axes} names the same dimension twice for rank-{rank} "
                         f"components at {where}")
    return tuple(dims)


def _sum_into(out: torch.Tensor, parts: Sequence[torch.Tensor], divisor: int | None) -> None:
    """``out = (((p0 + p1) + p2) + ...) [/ divisor]``, element-wise, in this order.

    One out-of-place add, then in-place adds. Measured on the 2-core CI machines,
    this beats summing in cache-sized chunks: ``out`` stays in the last-level
    cache between the adds, so each input is read from memory once, and per-op
    dispatch (which wakes torch's intra-op threads) is paid N - 1 times, not
    N - 1 times per chunk. See benchmarks/bench_core.py.
    """
    if len(parts) == 1:
        out.copy_(parts[0])
    else:
        torch.add(parts[0], parts[1], out=out)
        for p in parts[2:]:
            out.add_(p)
    if divisor is not None:
        out.div_(divisor)


def combine(op: ReduceOp, parts: Sequence[torch.Tensor], device: torch.device,
             divisor: int | None = None) -> torch.Tensor:
    """Element-wise combination of equally shaped parts, in order, into a new tensor on
    ``device`` (SUM/MEAN add, with ``divisor`` dividing the sum; MIN/MAX)."""
    parts = [p if p.device == device else p.to(device) for p in parts]
    first = parts[0]
    out = default_pool().empty(tuple(first.shape), first.dtype, device)
    if op is ReduceOp.SUM or op is ReduceOp.MEAN:
        _sum_into(out, parts, divisor)
    elif len(parts) == 1:
        out.copy_(first)
    else:
        fn = torch.minimum if op is ReduceOp.MIN else torch.maximum
        fn(parts[0], parts[1], out=out)
        for p in parts[2:]:
            fn(out, p, out=out)
    return out


def copy_to(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A new copy of ``tensor`` on ``device`` (large host copies reuse pooled buffers)."""
    out = default_pool().empty(tuple(tensor.shape), tensor.dtype, device)
    return out.copy_(tensor)


def reduce_components(op: ReduceOp, components: Sequence[torch.Tensor],
                      axis: tuple[int, ...] | None, device: torch.device, *,
                      labels: Sequence[str], where: str = "value") -> torch.Tensor:
    """Combines one tensor per replica with ``op``, optionally over ``axis`` too.

    Args:
        op: the reduction.
        components: one tensor per replica, in replica order.
        axis: ``None`` to combine across replicas only, else the dims each
            component is reduced over first (from `normalize_axis`).
        device: where the result goes.
        labels: how error messages name each component (``"replica 0 (CPU:0)"``).
        where: how error messages name the value (a pytree path).

    Returns:
        A new tensor on ``device`` (never one of the components).

    Raises:
        ValueError: mismatched shapes, dtypes or ranks, a bad axis, or MIN/MAX
            of no elements.
        TypeError: bool components, or MIN/MAX of complex ones.
    """
    axis_text = "None" if axis is None else (str(axis[0]) if len(axis) == 1 else str(axis))
    name = f"reduce({op.name}, axis={axis_text})"
    dtype = _check_dtypes(name, op, components, labels, where)
    promote = mean_dtype(dtype) if op is ReduceOp.MEAN else dtype

    if axis is None:
        shape = components[0].shape
        if any(c.shape != shape for c in components):
            raise ValueError(
                f"{name} needs components of one shape at {where}; got "
                f"{_listing(components, labels)}. For per-example values with uneven "
                "batches, reduce over the batch too with axis=0"
            )
        if op is not ReduceOp.MEAN:
            return combine(op, components, device)
        if promote == dtype:
            return combine(ReduceOp.SUM, components, device, divisor=len(components))
        exact = [c.to(torch.int64) for c in components]
        return combine(ReduceOp.SUM, exact, device).to(promote).div_(len(components))

    dims = _normalize_dims(name, axis, components, labels, where)
    kept = [tuple(s for d, s in enumerate(c.shape) if d not in dims) for c in components]
    if any(k != kept[0] for k in kept):
        raise ValueError(
            f"{name} needs components that differ only along axis {axis_text} at {where}; "
            f"got {_listing(components, labels)}"
        )
    counts = [math.prod(c.shape[d] for d in dims) for c in components]

    if op is ReduceOp.SUM or op is ReduceOp.MEAN:
        accumulate = sum_dtype(op, dtype)
        partials = [c.sum(dim=dims, dtype=accumulate) if dims else c.to(accumulate)
                    for c in components]
        total = combine(ReduceOp.SUM, partials, device)
        if op is ReduceOp.SUM:
            return total
        return total.to(promote).div_(sum(counts))

    amin_or_amax = torch.amin if op is ReduceOp.MIN else torch.amax
    partials = [amin_or_amax(c, dim=dims) if dims else c
                for c, n in zip(components, counts, strict=True) if n > 0]
    if not partials:
        raise ValueError(
            f"{name} has no elements to reduce at {where}: every component is empty along "
            f"axis {axis_text} ({_listing(components, labels)})"
        )
    return combine(op, partials, device)


def gather_components(components: Sequence[torch.Tensor], axis: int, device: torch.device,
                      *, labels: Sequence[str], where: str = "value",
                      name: str = "gather") -> torch.Tensor:
    """Concatenates one tensor per replica along ``axis``, in replica order, on ``device``.

    Components may differ only in their size along ``axis``.

    Raises:
        ValueError: rank-0 components, an axis out of range, or other mismatches.
        TypeError: ``axis`` is not an int.
    """
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"{name}: axis must be an int; got {type(axis).__name__} {axis!r}")
    full = f"{name}(axis={axis})"
    _check_dtypes(full, None, components, labels, where)
    rank = components[0].dim()
    if rank == 0:
        raise ValueError(
            f"{full} cannot concatenate rank-0 components at {where} "
            f"({_listing(components, labels)}); give each a dimension first, e.g. x[None]"
        )
    (dim,) = _normalize_dims(full, (axis,), components, labels, where)
    base = list(components[0].shape)
    for c in components:
        if [s for d, s in enumerate(c.shape) if d != dim] != [
                s for d, s in enumerate(base) if d != dim]:
            raise ValueError(
                f"{full} needs components that differ only along axis {axis} at {where}; "
                f"got {_listing(components, labels)}"
            )
    base[dim] = sum(c.shape[dim] for c in components)
    parts = [c if c.device == device else c.to(device) for c in components]
    out = default_pool().empty(tuple(base), components[0].dtype, device)
    return torch.cat(parts, dim=dim, out=out)
