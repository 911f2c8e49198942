"""`HeldBatches`: the batches a distributed dataset read from its source and not yet
trained on, and the refusal of a source that writes into one of them.

Steps keep views of the source's tensors (a split is a view, not a copy), and a
dataset reads ahead of the loop in three places: the workers' vote on a source
without ``len()`` (up to 8 steps), a prefetch thread (``experimental_prefetch_depth``),
and ``distribute_datasets_from_function``, whose step takes one element per local
replica before any replica runs. A source that refills one tensor and yields it again
(``buf.copy_(x); yield buf``, a ring buffer's slot reused) then overwrites a batch
that is still waiting: every replica would train on a later batch's values, where one
device's loop, which trains on each batch before it reads the next, is right. TF's
tensors are immutable; torch's are not.

Each read of the source (`read`) notes the version counters of the tensors of the
batches still held, and after it raises if one of them changed (an in-place write
during the read) where the new element's memory overlaps it (a write elsewhere, to
another slot of a ring buffer built as views of one tensor, shares the counter but
leaves the held batch alone). A write through NumPy or ``.data`` bumps no counter and
is not seen. A batch is held from its read until the loop asks for the step after
its own (`DistributedIterator` sets ``released``): the loop's step runs on it until
then. A source yielding the same tensor unchanged, or a batch the step changes in
place, is no error: only writes made while the source is read count.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .. import pytree

__all__ = ["HeldBatches"]


class HeldBatches:
    """The source's tensors of the steps read and not released (see the module).

    Example:
        >>> def refill():
        ...     buf = torch.zeros(2)
        ...     for i in range(3):
        ...         buf.fill_(i)
        ...         yield buf
        >>> held, source = HeldBatches(), refill()
        >>> first = held.read(source, 0)
        >>> held.hold(0, [first])
        >>> held.read(source, 1)
        Traceback (most recent call last):
        ...
        ValueError: the dataset's source wrote into the batch of step 0 ...
    """

    __slots__ = ("_elements", "_held", "handed", "released")

    def __init__(self, elements: bool = False) -> None:
        self._elements = elements  # a step holds one element per local replica
        self._held: deque[tuple[int, tuple[torch.Tensor, ...]]] = deque()
        self.handed = 0  # steps the loop was given (`DistributedIterator`)
        self.released = 0  # steps numbered below this are trained on: not held

    def hold(self, step: int, leaves: Sequence[Any]) -> None:
        """Notes the tensors among ``leaves`` (the source's, as read; a tuple: all
        tensors) of step ``step``."""
        if leaves:
            self._held.append((step, tuple(leaves) if type(leaves) is tuple else tuple(
                t for t in leaves if isinstance(t, torch.Tensor))))

    def read(self, source: Iterator[Any], step: int) -> Any:
        """``next(source)`` for step ``step``.

        Raises:
            StopIteration: the source ended.
            ValueError: the read wrote into a held batch's tensor (see the module).
        """
        held, released = self._held, self.released
        while held and held[0][0] < released:
            held.popleft()
        if not held:
            return next(source)
        before = [[t._version for t in tensors] for _, tensors in held]
        element = next(source)
        for (number, tensors), versions in zip(held, before, strict=True):
            for t, version in zip(tensors, versions, strict=True):
                if t._version != version and _overlaps(t, element):
                    raise ValueError(_message(number, step, self._elements, t))
        return element


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The addresses ``t``'s elements lie within (its first, one past its last; torch's
    strides are never negative)."""
    if t.numel() == 0:
        return 0, 0
    extent = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (extent + 1) * t.element_size()


def _overlaps(t: torch.Tensor, element: Any) -> bool:
    """Whether a tensor of ``element`` (a nest) shares memory with ``t``."""
    a, b = _span(t)
    if a == b:
        return False
    for leaf in pytree.flatten(element)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.device == t.device:
            c, d = _span(leaf)
            if c < b and a < d:
                return True
    return False


def _message(number: int, step: int, elements: bool, tensor: torch.Tensor) -> str:
    reading = (f"another element of step {step}" if elements and step == number else
               f"the {'elements' if elements else 'batch'} of step {step}")
    what = f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}"
    return (
        f"the dataset's source wrote into the {'element' if elements else 'batch'} of "
        f"step {number} while reading {reading} (its tensor {what} on {tensor.device} was "
        "changed in place and the new one shares its memory: a source that refills one tensor "
        "and yields it again, as `buf.copy_(x); yield buf`, or reuses a ring buffer's "
        f"slot), and step {number} was not trained on yet: this dataset reads ahead of "
        "the loop (the workers' vote on a source without len(), a prefetch thread, or "
        "one element per local replica in distribute_datasets_from_function), so that "
        f"step would train on step {step}'s values. Yield a new tensor each time "
        "(`yield buf.clone()`); where that copy costs too much, avoid reading ahead: "
        "InputOptions(experimental_prefetch_depth=0) (across workers too: a vote at "
        "every step), and InputReplicationMode.PER_REPLICA in "
        "distribute_datasets_from_function")
