"""The math of every reduction, once: axis handling, local pre-reduction, sum + count
for MEAN, accumulation and result dtypes, and the checks that turn bad input into
clear errors.

Everything here is pure (no strategies, threads or transports) and works one
leaf at a time. A reduction of a leaf is planned (`LeafPlan`), each replica's
component is *prepared* (reduced over ``axis`` locally, counted, cast to the
accumulation dtype), the partials are combined across replicas by a
communicator, and the total is *finished* (MEAN division, promotion)::

    mean = (sum_i sum_{axis}(x_i)) / (sum_i prod_{a in axis} x_i.shape[a])

so replicas may hold different numbers of examples (a partial last batch).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import torch

from .reduce_op import ReduceOp

__all__ = [
    "SUM_IS_MEAN",
    "LeafPlan",
    "cached_plan",
    "check_dtype",
    "describe",
    "describe_spec",
    "gather_dim",
    "finish",
    "leaf_dims",
    "masked_shape",
    "mean_dtype",
    "normalize_axis",
    "op_title",
    "plan_components",
    "plan_gather",
    "plan_leaf",
    "prepare",
    "sum_dtype",
]

# Dtypes whose CPU `Tensor.mean` is the sum divided by the count, as a MEAN reduction
# computes it: for one replica the reduction may be torch's mean, bit for bit.
SUM_IS_MEAN = frozenset({torch.float32, torch.float64})

_FLOAT32_MEAN = (torch.int8, torch.uint8, torch.int16)
_HALF = (torch.float16, torch.bfloat16)
# dtypes torch cannot add or compare on the CPU (they raise NotImplementedError deep
# inside), and the quantized ones (whose add is a quantized op with a scale of its own).
_UNSUPPORTED = frozenset(
    getattr(torch, name) for name in (
        "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
        "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2", "qint8", "quint8", "qint32",
        "quint4x2", "quint2x4")
    if hasattr(torch, name))


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

    Example:
        >>> normalize_axis(0), normalize_axis([0, -1]), normalize_axis(None)
        ((0,), (0, -1), None)
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
            raise TypeError(f"axis must be None, an int or a tuple of ints; got "
                            f"{type(a).__name__} {a!r} in {axis!r}")
    return axes


def op_title(name: str, op: ReduceOp, axes: tuple[int, ...] | None, *,
             show_none: bool = False) -> str:
    """``reduce(MEAN, axis=0)``: how messages name a call. ``axis=0`` and ``axis=(0,)``
    print alike, so equal calls compare equal."""
    if axes is None:
        return f"{name}({op.name}, axis=None)" if show_none else f"{name}({op.name})"
    text = str(axes[0]) if len(axes) == 1 else str(axes)
    return f"{name}({op.name}, axis={text})"


def sum_dtype(op: ReduceOp, dtype: torch.dtype) -> torch.dtype:
    """The dtype a reduction accumulates in.

    MEAN accumulates float16/bfloat16 in float32 (no overflow on the way to a mean
    that fits, as ``torch.mean`` does), int64 in float64 (no wrap-around), other
    integers exactly in int64. SUM, MIN and MAX keep the input dtype (SUM of int8
    wraps, as it does in TF and torch).
    """
    if op is not ReduceOp.MEAN:
        return dtype
    if dtype in _HALF:
        return torch.float32
    if dtype.is_floating_point or dtype.is_complex:
        return dtype
    if dtype == torch.int64:
        return torch.float64
    return torch.int64


def mean_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a MEAN: floats keep theirs; int8/uint8/int16 -> float32; other
    integers -> float64 (true division, as in TF)."""
    if dtype.is_floating_point or dtype.is_complex:
        return dtype
    if dtype in _FLOAT32_MEAN:
        return torch.float32
    return torch.float64


def check_dtype(title: str, op: ReduceOp | None, dtype: torch.dtype, where: str) -> None:
    """Refuses dtypes a reduction is not defined for (``op=None``: a gather).

    Raises:
        TypeError: bool (reductions), complex (MIN/MAX), or a dtype torch cannot
            combine (uint16/32/64, float8).
    """
    if dtype in _UNSUPPORTED:
        raise TypeError(
            f"{title} does not support dtype {str(dtype).removeprefix('torch.')} (at {where}): "
            "torch cannot add or compare it; cast it first, e.g. x.to(torch.int64) or "
            "x.to(torch.float32) (a quantized tensor: x.dequantize())")
    if op is None:
        return
    if dtype == torch.bool:
        raise TypeError(f"{title} cannot reduce bool tensors (at {where}); cast them first, "
                        "e.g. x.to(torch.int32)")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and dtype.is_complex:
        raise TypeError(f"{title} is not defined for complex dtype "
                        f"{str(dtype).removeprefix('torch.')} (at {where})")


def leaf_dims(title: str, shape: Sequence[int], axes: tuple[int, ...], where: str
              ) -> tuple[int, ...]:
    """The non-negative dims that ``axes`` name for a value of ``shape``.

    Raises:
        ValueError: a rank-0 value with an axis, an axis out of range, or a dim
            named twice.
    """
    rank = len(shape)
    if rank == 0 and axes:
        raise ValueError(f"{title}: rank-0 values at {where} have no axis {axes[0]}; use "
                         "axis=None to reduce scalars across replicas")
    dims = []
    for a in axes:
        if not -rank <= a < rank:
            raise ValueError(f"{title}: axis {a} is out of range for rank-{rank} values at "
                             f"{where} (valid axes are {-rank}..{rank - 1}); got shape "
                             f"{list(shape)}")
        dims.append(a % rank)
    if len(set(dims)) != len(dims):
        raise ValueError(f"{title}: axis {axes} names the same dimension twice for rank-{rank} "
                         f"values at {where}")
    return tuple(dims)


def masked_shape(shape: Sequence[int], dims: Sequence[int]) -> tuple[int, ...]:
    """``shape`` with the reduced/gathered dims replaced by -1 (they may differ)."""
    return tuple(-1 if d in dims else s for d, s in enumerate(shape))


@dataclasses.dataclass(frozen=True, slots=True)
class LeafPlan:
    """How one leaf is reduced: over which local dims, in which dtypes.

    ``dims`` is ``None`` without an axis (replicas combined element-wise).
    """

    op: ReduceOp
    dims: tuple[int, ...] | None
    dtype: torch.dtype
    accumulate: torch.dtype
    result: torch.dtype

    @property
    def base_op(self) -> ReduceOp:
        """What the communicator combines with: MEAN travels as a SUM."""
        return ReduceOp.SUM if self.op is ReduceOp.MEAN else self.op

    @property
    def counts(self) -> bool:
        """Whether the global element count is needed (MEAN and MIN/MAX over an axis)."""
        return self.dims is not None and self.op is not ReduceOp.SUM


# Keyed by the op's value: an Enum's __hash__ (and .value) is a Python call, and this
# runs per step.
_plans: dict[tuple[str, torch.dtype, int, tuple[int, ...] | None], LeafPlan] = {}


def cached_plan(op: ReduceOp, tensor: torch.Tensor, axes: tuple[int, ...] | None
                ) -> LeafPlan | None:
    """The plan `plan_leaf` made earlier for a tensor of this dtype and rank (it checked
    them then), or ``None``: a hot path that skips building a message.

    Example:
        >>> t = torch.ones(3)
        >>> plan = plan_leaf("reduce(MEAN, axis=0)", ReduceOp.MEAN, t, (0,), "value")
        >>> cached_plan(ReduceOp.MEAN, t, (0,)) is plan
        True
    """
    return _plans.get((op._value_, tensor.dtype, tensor.dim(), axes))


def plan_leaf(title: str, op: ReduceOp, tensor: torch.Tensor, axes: tuple[int, ...] | None,
              where: str) -> LeafPlan:
    """Plans the reduction of one replica's ``tensor`` (checks dtype and axis).

    Plans depend only on the op, dtype, rank and axes, so valid ones are cached
    (a gradient all-reduce plans hundreds of leaves per step).
    """
    key = (op._value_, tensor.dtype, tensor.dim(), axes)
    plan = _plans.get(key)
    if plan is not None:
        return plan
    dtype = tensor.dtype
    check_dtype(title, op, dtype, where)
    if axes is not None and dtype == torch.complex32:  # (no sum over a dim in torch)
        raise TypeError(f"{title} over an axis does not support complex32 (at {where}): "
                        "torch cannot sum it along a dim; cast it first, e.g. "
                        "x.to(torch.complex64)")
    dims = None if axes is None else leaf_dims(title, tensor.shape, axes, where)
    plan = LeafPlan(op, dims, dtype, sum_dtype(op, dtype),
                    mean_dtype(dtype) if op is ReduceOp.MEAN else dtype)
    if len(_plans) < 4096:
        _plans[key] = plan
    return plan


def plan_components(title: str, op: ReduceOp, components: Sequence[torch.Tensor],
                    axes: tuple[int, ...] | None, labels: Sequence[str], where: str
                    ) -> LeafPlan:
    """Plans the reduction of one tensor per replica, all seen at once (cross-replica
    ``reduce``): they must share dtype, and shape except along ``axis``.

    Raises:
        ValueError: mismatched dtypes, ranks or shapes, or a bad axis.
        TypeError: a dtype the op is not defined for.
    """
    first = components[0]
    if any(c.dtype != first.dtype for c in components):
        raise ValueError(f"{title} needs components of one dtype at {where}; got "
                         f"{_listing(components, labels)}")
    if axes is None:
        if any(c.shape != first.shape for c in components):
            hint = (". For per-example values with uneven batches, reduce over the batch "
                    "too with axis=0") if title.startswith("reduce(") else ""
            raise ValueError(f"{title} needs components of one shape at {where}; got "
                             f"{_listing(components, labels)}{hint}")
        return plan_leaf(title, op, first, None, where)
    if any(c.dim() != first.dim() for c in components):
        raise ValueError(f"{title} needs components of one rank at {where}; got "
                         f"{_listing(components, labels)}")
    plan = plan_leaf(title, op, first, axes, where)
    kept = masked_shape(first.shape, plan.dims or ())
    if any(masked_shape(c.shape, plan.dims or ()) != kept for c in components):
        axis_text = str(axes[0]) if len(axes) == 1 else str(axes)
        raise ValueError(f"{title} needs components that differ only along axis {axis_text} "
                         f"at {where}; got {_listing(components, labels)}")
    return plan


def gather_dim(title: str, shape: Sequence[int], axis: int, where: str) -> int:
    """The non-negative dim a gather of a value of ``shape`` concatenates along.

    Raises:
        ValueError: a rank-0 value, or an axis out of range.
    """
    if len(shape) == 0:
        raise ValueError(f"{title} cannot concatenate rank-0 values at {where}; give each a "
                         "dimension first, e.g. x[None]")
    return leaf_dims(title, shape, (axis,), where)[0]


def plan_gather(title: str, components: Sequence[torch.Tensor], axis: int,
                labels: Sequence[str], where: str) -> int:
    """Checks one tensor per replica for a gather along ``axis`` (one dtype and rank,
    equal shapes but along ``axis``) and returns the dim.

    Raises:
        ValueError: mismatched dtypes, ranks or shapes, rank-0 values, a bad axis.
        TypeError: a dtype torch cannot concatenate.
    """
    first = components[0]
    check_dtype(title, None, first.dtype, where)
    if any(c.dtype != first.dtype for c in components):
        raise ValueError(f"{title} needs components of one dtype at {where}; got "
                         f"{_listing(components, labels)}")
    if any(c.dim() != first.dim() for c in components):
        raise ValueError(f"{title} needs components of one rank at {where}; got "
                         f"{_listing(components, labels)}")
    dim = gather_dim(title, first.shape, axis, where)
    kept = masked_shape(first.shape, (dim,))
    if any(masked_shape(c.shape, (dim,)) != kept for c in components):
        raise ValueError(f"{title} needs components that differ only along axis {axis} at "
                         f"{where}; got {_listing(components, labels)}")
    return dim


def _listing(components: Sequence[torch.Tensor], labels: Sequence[str]) -> str:
    return "; ".join(f"{label}: {describe(c)}" for label, c in zip(labels, components,
                                                                   strict=True))


def _identity(op: ReduceOp, dtype: torch.dtype) -> float | int:
    if dtype.is_floating_point:
        return math.inf if op is ReduceOp.MIN else -math.inf
    info = torch.iinfo(dtype)
    return info.max if op is ReduceOp.MIN else info.min


def prepare(plan: LeafPlan, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """One replica's partial result and element count.

    Without an axis the partial is the tensor itself (cast to the accumulation
    dtype); with one, the sum (SUM/MEAN) or amin/amax (MIN/MAX; the op's identity
    for an empty component) over the planned dims.
    """
    dims = plan.dims
    if dims is None:
        partial = tensor if tensor.dtype == plan.accumulate else tensor.to(plan.accumulate)
        return partial, 1
    count = math.prod(tensor.shape[d] for d in dims)
    if plan.op is ReduceOp.SUM or plan.op is ReduceOp.MEAN:
        if dims:
            return tensor.sum(dim=dims, dtype=plan.accumulate), count
        return tensor.to(plan.accumulate), count
    if count == 0:
        kept = [s for d, s in enumerate(tensor.shape) if d not in dims]
        return torch.full(kept, _identity(plan.op, tensor.dtype), dtype=tensor.dtype,
                          device=tensor.device), 0
    fn = torch.amin if plan.op is ReduceOp.MIN else torch.amax
    return (fn(tensor, dim=dims) if dims else tensor), count


def finish(plan: LeafPlan, total: torch.Tensor, divisor: int, *, in_place: bool) -> torch.Tensor:
    """The result from the combined partials: MEAN divides by ``divisor`` (the replica
    count, or the global element count with an axis) and casts to the result dtype.

    ``in_place`` allows dividing ``total`` itself (it is a fresh buffer nobody else
    holds).
    """
    if plan.op is not ReduceOp.MEAN:
        return total
    if total.dtype == plan.result and in_place:
        return total.div_(divisor)
    if total.dtype == plan.result:
        return total / divisor
    if total.dtype.is_floating_point and plan.result.is_floating_point:
        return (total / divisor).to(plan.result)  # float32 accumulator of a half MEAN
    return total.to(plan.result).div_(divisor)


def no_elements_message(title: str, where: str) -> str:
    """The message for MIN/MAX over an axis where no replica has an element."""
    return (f"{title} has no elements to reduce at {where}: every replica's value is empty "
            "along the reduced axis")
