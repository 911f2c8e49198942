"""`WorkerVote`: how the workers of a multi-worker dataset agree on their steps (their
counts once per pass, or a vote per window of steps where a count is unknown)."""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["AnyWorker", "WorkerVote"]

AnyWorker = Callable[[bool], bool]


class WorkerVote:
    """A multi-worker dataset's vote (the ``any_worker`` of `DistributedIterator`):
    ``vote(has_data)`` says whether any worker has data (one collective), and
    ``steps(count)`` gives every worker's count of steps (``-1``: unknown; one
    collective), asked once per pass: when every count is known, no worker votes at
    each step. ``every_worker(value)``, if given, gives every worker's int ``value``
    (`window`). ``last_step()`` and ``first_step()``, if given, are told when a
    pass (or a voted window) whose steps are agreed hands out its last step, and
    before the steps are agreed or voted (`CallLedger.pass_ends`: the workers' calls
    predict no successor in between).

    Example:
        >>> vote = WorkerVote(lambda has_data: has_data, lambda count: [count, 3],
        ...                   lambda value: [value, 4 * 3])  # the peer: 3 steps read
        >>> vote(True), vote.steps(2), vote.window(2, True, False)
        (True, [2, 3], [(2, True, False), (3, False, False)])
    """

    __slots__ = ("_any", "_every", "first_step", "last_step", "steps")

    def __init__(self, any_worker: AnyWorker, steps: Callable[[int], list[int]],
                 every_worker: Callable[[int], list[int]] | None = None,
                 last_step: Callable[[], None] = lambda: None,
                 first_step: Callable[[], None] = lambda: None) -> None:
        self._any, self.steps, self._every = any_worker, steps, every_worker
        self.last_step, self.first_step = last_step, first_step

    def __call__(self, has_data: bool) -> bool:
        return self._any(has_data)

    @property
    def tells_each(self) -> bool:
        """Whether `window` can tell each worker's answer (``every_worker`` was given)."""
        return self._every is not None

    def window(self, count: int, ended: bool, none: bool
               ) -> list[tuple[int, bool, bool]]:
        """Every worker's steps read ahead, whether its source ended there, and whether
        it has had no batch in this pass (needs ``every_worker``)."""
        assert self._every is not None  # (callers check tells_each)
        return [(v // 4, bool(v & 1), bool(v & 2))
                for v in self._every(4 * count + 2 * none + ended)]
