"""`DistributedOptional`: what `DistributedIterator.get_next_as_optional` returns (TF's
``tf.experimental.Optional``)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

__all__ = ["DistributedOptional"]

T = TypeVar("T")


class DistributedOptional(Generic[T]):
    """A step that may be missing: what `DistributedIterator.get_next_as_optional` returns
    (TF's ``tf.experimental.Optional``).

    Example:
        >>> DistributedOptional(3).get_value(), DistributedOptional.empty().has_value()
        (3, False)
    """

    __slots__ = ("_has", "_value")

    def __init__(self, value: T) -> None:
        self._value: T | None = value
        self._has = True

    @classmethod
    def empty(cls) -> DistributedOptional[Any]:
        """An optional with no value (the iterator ran out)."""
        made: DistributedOptional[Any] = cls.__new__(cls)
        made._value = None
        made._has = False
        return made

    def has_value(self) -> bool:
        """Whether there is a step."""
        return self._has

    def get_value(self) -> T:
        """The step.

        Raises:
            ValueError: there is none (the iterator ran out); check `has_value` first.
        """
        if not self._has:
            raise ValueError("this optional has no value: the distributed iterator ran out; "
                             "check has_value() before get_value()")
        return self._value  # type: ignore[return-value]

    def __repr__(self) -> str:
        return f"DistributedOptional({self._value!r})" if self._has else \
            "DistributedOptional(<empty>)"
