"""`ReduceOp`: how values from several replicas are combined."""

from __future__ import annotations

import enum

__all__ = ["ReduceOp", "op_label"]


class ReduceOp(enum.Enum):
    """How to combine per-replica values.

    ``SUM`` adds, ``MEAN`` divides the sum by the number of contributions (replicas,
    or examples when an ``axis`` is given), ``MIN`` and ``MAX`` take the
    element-wise extremes. Every API that takes a ``ReduceOp`` also takes its
    name as a string in any case.

    Example:
        >>> from mirrored import ReduceOp
        >>> ReduceOp.from_value("mean")
        <ReduceOp.MEAN: 'MEAN'>
    """

    SUM = "SUM"
    MEAN = "MEAN"
    MIN = "MIN"
    MAX = "MAX"

    @classmethod
    def from_value(cls, reduce_op: ReduceOp | str) -> ReduceOp:
        """Returns the `ReduceOp` for ``reduce_op`` (a `ReduceOp` or its name in any case).

        Raises:
            ValueError: ``reduce_op`` is a string that names no op.
            TypeError: ``reduce_op`` is neither a string nor a `ReduceOp`.
        """
        if isinstance(reduce_op, ReduceOp):
            return reduce_op
        if isinstance(reduce_op, str):
            try:
                return cls[reduce_op.upper()]
            except KeyError:
                raise ValueError(
                    f"{reduce_op!r} is not a valid ReduceOp; use one of SUM, MEAN, MIN, MAX"
                ) from None
        raise TypeError(
            "reduce_op must be a mirrored.ReduceOp or one of the strings "
            f"'SUM', 'MEAN', 'MIN', 'MAX'; got {type(reduce_op).__name__} {reduce_op!r}"
        )


def op_label(label: str, op: ReduceOp) -> str:
    """The label the workers compare (`Communicator.reduce_packed`) for a reduction by
    ``op``: a MEAN travels as a SUM (divided after), with the same sizes and data as a
    SUM's, so it names itself there; a MEAN on one worker and a SUM on another at the
    same call would otherwise combine without an error, and differ.

    Example:
        >>> op_label("", ReduceOp.MEAN), op_label("x", ReduceOp.MEAN), op_label("", ReduceOp.SUM)
        ('MEAN', 'x (MEAN)', '')
    """
    if op is not ReduceOp.MEAN:
        return label
    return f"{label} (MEAN)" if label else "MEAN"
