"""`ReadAhead`: the steps a worker read ahead for the dataset's vote (see
`iterator.DistributedIterator`), kept from one pass to the next of a one-shot source."""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

__all__ = ["ReadAhead", "continues"]


class ReadAhead:
    """The steps a worker read ahead of its loop and not yet handed out, and a source
    error held behind them. A pass over a one-shot source (an iterator: a new pass
    continues it) leaves them to the next pass (its dataset keeps this object), as a
    loop over the source itself would go on where it stopped; a re-iterable source
    starts again, and its pass's are dropped with it."""

    __slots__ = ("error", "owner", "steps")

    def __init__(self) -> None:
        self.steps: deque[Any] = deque()
        self.error: Exception | None = None
        self.owner: Any = None  # a weakref to the pass that holds it

    def claim(self, owner: Any) -> bool:
        """Whether ``owner`` (a new pass) may take the steps: no other pass of the
        dataset is live (two passes at once would count each other's steps)."""
        current = None if self.owner is None else self.owner()
        if current is not None and not current._finished:
            return False
        self.owner = weakref.ref(owner)
        return True


def continues(source: Any) -> bool:
    """Whether a new pass over ``source`` goes on where the last one stopped: an
    iterator with no ``close`` (``iter(a_list)``, ``map(...)``). A generator is closed
    when its pass ends (the loop's own ``break`` would leave it open, but the pass's
    end closes it, with nothing after); a re-iterable source starts again.

    Example:
        >>> continues(iter([1, 2])), continues(x for x in [1]), continues([1, 2])
        (True, False, False)
    """
    return isinstance(source, Iterator) and not callable(getattr(source, "close", None))
