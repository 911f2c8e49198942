"""`ReadAhead`: the steps a worker read ahead for the dataset's vote (see
`iterator.DistributedIterator`), kept from one pass to the next of a one-shot source."""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from .. import pytree
from ..values import PerReplica

__all__ = ["ReadAhead", "continues", "step_nbytes", "untag"]


class ReadAhead:
    """The steps a worker read ahead of its loop and not yet handed out, and a source
    error held behind them. A pass over a one-shot source (an iterator: a new pass
    continues it) leaves them to the next pass (its dataset keeps this object), as a
    loop over the source itself would go on where it stopped; a re-iterable source
    starts again, and its pass's are dropped with it (``keeps=False``: its dataset keeps
    this object only for `settle`, since a new pass of a source whose passes share state,
    a ``DataLoader`` with persistent workers or a file rewound by ``__iter__``, must not
    start while a closed pass's thread still reads it)."""

    __slots__ = ("error", "keeps", "owner", "producer", "read", "steps")

    def __init__(self, keeps: bool = True) -> None:
        self.keeps = keeps
        # Steps read from a one-shot source by all passes so far: a step's place in the
        # source, which its digest carries (`global_batch_steps`), is where it was read,
        # alike on every worker whichever pass hands it out.
        self.read = 0
        self.steps: deque[Any] = deque()
        self.error: Exception | None = None
        self.owner: Any = None  # a weakref to the pass that holds it
        # A closed pass's prefetch thread still inside a read of the source: what it
        # reads goes to ``steps``, and the next pass waits for it first (`settle`).
        self.producer: threading.Thread | None = None

    def settle(self) -> None:
        """Waits for a closed pass's prefetch thread still reading (a new pass starts
        after what it reads, as one loop over the source would; a re-iterable source's
        new pass, after that read moved any state the passes share)."""
        producer, self.producer = self.producer, None
        if producer is not None and producer is not threading.current_thread():
            producer.join()

    def claim(self, owner: Any) -> bool:
        """``owner`` (a new pass) takes the steps. A pass of the dataset still live (the
        ``iterator = iter(dataset)`` of each epoch while the variable holds the last
        epoch's) is superseded first: closed, its steps read ahead left here, and
        refused if used again (two passes at once would count each other's steps,
        and the new one, reading alone, lost or reordered what the old had read)."""
        current = None if self.owner is None else self.owner()
        if current is not None and not current._finished:
            current.supersede()
        self.owner = weakref.ref(owner)
        return True


def continues(source: Any) -> bool:
    """Whether a new pass over ``source`` goes on where the last one stopped: an
    iterator (``iter(a_list)``, ``map(...)``, a generator), as a new ``for`` loop over
    it would; a re-iterable source starts again.

    Example:
        >>> continues(iter([1, 2])), continues(x for x in [1]), continues([1, 2])
        (True, True, False)
    """
    return isinstance(source, Iterator)


def step_nbytes(step: Any) -> int:
    """The bytes of ``step``'s tensors (a `PerReplica`'s components)."""
    total = 0
    for leaf in pytree.flatten(step)[0]:
        for value in leaf.values if isinstance(leaf, PerReplica) else (leaf,):
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def untag(step: Any) -> None:
    """Drops the `StepExamples` of ``step``'s batches (see `DistributedIterator`)."""
    for leaf in pytree.flatten(step)[0]:
        if isinstance(leaf, PerReplica):
            leaf._examples = None
