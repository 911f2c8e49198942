"""`DistributedIterator`: one pass over a distributed dataset, and `DistributedOptional`,
what its ``get_next_as_optional`` returns (TF's iterator members, SPEC §9).

The iterator pulls prepared steps from a `Prefetcher` (or inline), keeps every
worker stepping while any still has data (empty batches shaped like this worker's
last one: the workers agree on their counts of steps once, from their sources'
``len()`` (`WorkerVote`), or, when a count is unknown, vote once per window of steps
each worker has read ahead), and refuses to be advanced from inside a replica, as TF
does.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import Any

import torch

from .. import context, pytree
from ..values import PerReplica
from .ahead import ReadAhead, continues, step_nbytes, untag
from .held import HeldBatches
from .input import InputOptions
from .optional import DistributedOptional
from .prefetch import InlineSteps, Prefetcher, default_depth
from .split import empty_like
from .vote import AnyWorker, WorkerVote

__all__ = ["DistributedIterator", "DistributedOptional", "ReadAhead", "WorkerVote", "continues"]

# Where a worker's count of steps is unknown, each worker reads up to VOTE_AHEAD steps
# ahead of the loop (while they hold under VOTE_AHEAD_BYTES and the window's reads took
# under VOTE_AHEAD_SECONDS; at least one) and the workers vote once for the whole
# window: a vote at every step took 0.6 ms of a 1.5 ms step of the digits MLP on two
# workers (2026-12-03). The time bound keeps a slow source's peers from waiting in one
# vote for many of its reads (a wait the collective timeout bounds): where one read
# takes that long, a vote per step costs nothing next to it.
VOTE_AHEAD = 8
VOTE_AHEAD_BYTES = 32 << 20
VOTE_AHEAD_SECONDS = 0.05


def _empty_step(step: Any) -> Any:
    def empty(leaf: Any) -> Any:
        if isinstance(leaf, PerReplica):
            return PerReplica([empty(v) for v in leaf.values], devices=leaf.devices)
        if leaf.dim() == 0:
            raise RuntimeError(
                "this worker's dataset ran out while other workers still have data, and its "
                "elements have no batch dim (a scalar), so no empty batch can stand for them; "
                "give every worker the same number of steps (e.g. shard evenly, or batch "
                "the elements)")
        return empty_like(leaf)

    return pytree.tree_map(empty, step)


class DistributedIterator:
    """One pass over a distributed dataset; yields one nest of `PerReplica` per step
    (plain values with a single replica in a single process, as TF).

    Made by iterating a `DistributedDataset` or `DistributedDatasetsFromFunction`.
    Call `close` (or drop it) to stop its prefetch thread early. ``next(it)`` and
    `get_next` refuse to run inside a replica (``strategy.run``), as in TF: every
    replica would take its own step.

    Example:
        >>> import torch
        >>> from mirrored._src.devices import parse_devices
        >>> from mirrored._src.topology import Topology
        >>> from mirrored._src.data import DistributedDataset
        >>> t = Topology(devices=parse_devices(["CPU:0", "CPU:1"]))
        >>> it = iter(DistributedDataset([torch.arange(4)], t))
        >>> it.get_next().values
        (tensor([0, 1]), tensor([2, 3]))
        >>> it.get_next_as_optional().has_value()
        False
        >>> it.close()
    """

    def __init__(self, steps: Generator[Any, None, None], options: InputOptions,
                 any_worker: AnyWorker | None, devices: Sequence[torch.device] = (),
                 length: int | None = None, tagged: bool = False,
                 ahead: ReadAhead | None = None, held: HeldBatches | None = None) -> None:
        depth = options.prefetch_depth
        if depth is None:
            depth = default_depth(devices, options.experimental_fetch_to_device)
        # A dataset passes its own `ReadAhead`. A one-shot source's (``keeps``): the steps
        # a pass read ahead (the vote's, the prefetch thread's) and did not hand out go
        # to the next. A re-iterable source's: the next pass only waits for a closed
        # pass's thread still inside a read.
        self._keeps = ahead is not None and ahead.keeps and ahead.claim(self)
        self._held = ahead if ahead is not None and self._keeps else ReadAhead()
        self._ahead = self._held.steps
        if ahead is not None:
            ahead.settle()  # (the last pass's thread, if still reading: first)
        self._steps = (Prefetcher(steps, depth, ahead) if depth else InlineSteps(steps))
        # The next step: the generator's own __next__ when inline (no frame in between).
        self._next_step = self._steps.next_step if depth else steps.__next__
        self._any_worker = any_worker
        self._last: Any = None
        self._exhausted = False
        self._finished = False
        self._superseded = False
        # Multi-worker: this worker's steps (``length``: its source's len(), -1 if
        # unknown; None: not asked, e.g. per-worker pipelines) and, once every worker's
        # is known (`WorkerVote.steps`, at the first step), the most of them: then no
        # vote. _total -1: not asked yet; None: vote (per window, `_window_step`).
        self._length = -1 if length is None else length
        self._total: int | None = (-1 if isinstance(any_worker, WorkerVote)
                                   and length is not None else None)
        self._taken = 0
        # Steps that carry their `StepExamples` keep them only while every worker still
        # has batches of its own (agreed counts, up to the smallest): a vote, or a worker
        # stepping on empty batches, leaves the count to compute_average_loss.
        self._tagged = tagged
        self._everyone = 0  # the steps every worker has (known at the agreement)
        # A vote per window (`_window_step`): the steps read ahead (`_ahead`), the
        # window's steps left and handed out so far.
        self._windowed = isinstance(any_worker, WorkerVote) and any_worker.tells_each
        if self._ahead and not self._windowed:  # what the last pass left, first
            self._next_step = _left_first(self._ahead, self._next_step)
        self._left = self._handed = 0
        self._final = False  # the window is the last: every source had ended
        # Steps read ahead: VOTE_AHEAD by default; an explicit prefetch depth bounds it
        # (0: none, a vote at each step). A source's error is held (in `_held`) until
        # the steps read before it are handed out.
        self._depth = None if options.prefetch_depth is None else max(1, depth)
        # The source's tensors of the steps not trained on yet (`HeldBatches`): a step
        # is released when the loop asks for the one after it.
        self._held_batches = held

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        held = self._held_batches
        if held is None:
            return self._next()
        held.released = held.handed
        step = self._next()
        held.handed += 1
        return step

    def _next(self) -> Any:
        if (s := context._state.stack) and s[-1].in_run and s[-1].replica_context is not None:
            raise ValueError(
                "next() of a distributed iterator was called inside strategy.run (replica "
                "context), where every replica would take a step of its own; take the step "
                "outside and pass it in: strategy.run(fn, args=(next(iterator),))")
        if self._finished:
            if self._superseded:
                raise RuntimeError(
                    "this distributed iterator was superseded by a new pass over the same "
                    "one-shot source (iter(dataset) again while this one was still live): "
                    "the new pass goes on where this one stopped, with the steps it had "
                    "read ahead. Use the new iterator; two live passes over one iterator "
                    "or generator would each lose or reorder the other's steps")
            raise StopIteration
        if self._total is not None:
            return self._counted_step()
        if self._windowed:
            return self._window_step()
        if not self._exhausted:
            try:
                step = self._next_step()
            except StopIteration:
                self._exhausted = True
            except BaseException:
                self._finished = True
                raise
            else:
                if self._any_worker is not None:
                    self._any_worker(True)
                    self._last = step
                return step
        # This worker's data ran out; others may still have some.
        if self._any_worker is None or not self._any_worker(False):
            self._finished = True
            self._last = None
            raise StopIteration
        if self._last is None:
            raise RuntimeError(
                "this worker's dataset yielded no batches while other workers still have "
                "data; it cannot make empty batches shaped like theirs. Give every worker "
                "at least one batch"
            )
        return _empty_step(self._last)

    def _window_step(self) -> Any:
        """`__next__` where some worker's count of steps is unknown: at a window's
        start every worker reads ahead (`_read_ahead`) and they vote once on how many
        steps each read and whether its source ended there. The window lasts as many
        steps as the fewest any worker still reading has (all ended: the most any has,
        and no vote after it); a worker out of batches steps on empty ones, as with a
        vote at each step."""
        vote = self._any_worker
        assert isinstance(vote, WorkerVote)  # (windowed only so)
        if self._left == 0:
            if not self._final:  # (final: every source had ended at the last vote)
                self._vote_window(vote)
            if self._left == 0:
                self._finished = True
                self._last = None
                raise StopIteration
        self._left -= 1
        self._handed += 1
        if self._left == 0:  # (on every worker: the window's lengths are agreed)
            # The run of a window's last step predicts no successor: what follows is the
            # next window's vote (or the pass's end), not the loop's next call, which a
            # prediction would meet with zeros of that call's sizes.
            vote.last_step()
        if self._ahead:
            step = self._ahead.popleft()
            if self._tagged and self._handed > self._everyone:
                untag(step)  # (a worker on empty batches: the count is not known)
            self._last = step
            return step
        assert self._last is not None  # (a worker with none raised at the vote)
        return _empty_step(self._last)

    def _vote_window(self, vote: WorkerVote) -> None:
        """Reads ahead and votes: sets the window's steps (`_left`), the steps every
        worker has (`_everyone`) and whether it is the last (`_final`)."""
        vote.first_step()  # (calls predict their successors again)
        self._read_ahead()
        none = self._last is None and not self._ahead  # (no batch in this pass)
        votes = vote.window(len(self._ahead), self._exhausted, none)
        going = [c for c, ended, _ in votes if not ended]
        self._left = min(going) if going else max(c for c, _, _ in votes)
        self._everyone, self._handed = min(c for c, _, _ in votes), 0
        self._final = not going
        empty = [w for w, (_, _, none) in enumerate(votes) if none]
        if empty and self._left:  # (every worker raises, at the same step)
            self._finish()
            raise RuntimeError(
                f"the dataset has no batches on worker(s) {empty} while others have "
                f"some (steps each worker read ahead: {[c for c, _, _ in votes]}); a "
                "worker without any batch cannot make empty batches shaped like the "
                "others'. Give every worker at least one batch")

    def _read_ahead(self) -> None:
        """Reads steps ahead until `VOTE_AHEAD` (or the explicit prefetch depth) are
        held, or their tensors take `VOTE_AHEAD_BYTES`, or these reads took
        `VOTE_AHEAD_SECONDS`, or the source ends. A source's error is held while steps
        read before it wait (however many windows that takes: another worker's window
        may be shorter), and raised at the first read after them."""
        held = self._held
        if held.error is not None:
            if self._ahead:  # (the vote counts these; the error comes after them)
                return
            error, held.error = held.error, None
            self._finish()
            raise error
        limit = VOTE_AHEAD if self._depth is None else self._depth
        nbytes = sum(step_nbytes(step) for step in self._ahead)
        deadline = time.monotonic() + VOTE_AHEAD_SECONDS
        while not self._exhausted and len(self._ahead) < limit and (not self._ahead or (
                nbytes < VOTE_AHEAD_BYTES and time.monotonic() < deadline)):
            try:
                step = self._next_step()
            except StopIteration:
                self._exhausted = True
            except Exception as error:
                if not self._ahead:
                    self._finish()
                    raise
                held.error = error  # (the steps read before it go first)
                return
            except BaseException:
                self._finish()
                raise
            else:
                self._ahead.append(step)
                nbytes += step_nbytes(step)

    def _finish(self) -> None:
        self._finished = True
        self._ahead.clear()
        self._held.error = None

    def _counted_step(self) -> Any:
        """`__next__` when every worker's count of steps is known (asked at the first):
        this worker's batches, then empty ones shaped like its last until the longest
        worker's count, with no vote; a count unknown anywhere: the workers vote."""
        total = self._total
        if total == -1:
            assert isinstance(self._any_worker, WorkerVote)  # (set so in __init__)
            self._any_worker.first_step()
            counts = self._any_worker.steps(self._length)
            self._total = max(counts) if min(counts) >= 0 else None
            self._everyone = min(counts)
            if self._total and not min(counts):  # (every worker raises, at the same step)
                self._finished = True
                self._steps.close()
                raise RuntimeError(
                    f"the dataset has no batches on worker(s) "
                    f"{[w for w, c in enumerate(counts) if c == 0]} while others have "
                    f"{self._total} (the workers' len(): {counts}); a worker without any "
                    "batch cannot make empty batches shaped like the others'. Give every "
                    "worker at least one batch")
            return self._next()
        assert total is not None  # (callers check)
        if self._taken >= total:
            self._finished = True
            self._last = None
            if not self._exhausted:  # (a source longer than its len(): found, not dropped)
                try:
                    self._next_step()
                except StopIteration:
                    pass
                else:
                    self._steps.close()
                    raise RuntimeError(
                        f"this worker's dataset yielded more than the {self._length} batches "
                        f"its len() promised; the workers agreed on {total} steps from their "
                        "len()s and the others have stopped. Give the source a true len(), or "
                        "none")
            raise StopIteration
        self._taken += 1
        if self._taken == total:
            assert isinstance(self._any_worker, WorkerVote)  # (counted steps are agreed)
            self._any_worker.last_step()
        if not self._exhausted:
            try:
                self._last = self._next_step()
                if self._tagged and self._taken > self._everyone:
                    untag(self._last)
                return self._last
            except StopIteration:
                self._exhausted = True
                if self._taken <= self._length:  # (the workers counted on its len())
                    self._finished = True
                    raise RuntimeError(
                        f"this worker's dataset yielded {self._taken - 1} batches, fewer than "
                        f"the {self._length} its len() promised; the workers agreed on {total} "
                        "steps from their len()s, and empty steps in their place would still "
                        "step the optimizers. Give the source a true len(), or none") from None
            except BaseException:
                self._finished = True
                raise
        # (a batch was yielded: a worker with none raised at the agreement, or above)
        return _empty_step(self._last)

    def get_next(self) -> Any:
        """The next step (TF's ``get_next``): ``next(iterator)``.

        Raises:
            StopIteration: the dataset ran out (TF: ``OutOfRangeError``).
            ValueError: called inside ``strategy.run``.
        """
        return next(self)

    def get_next_as_optional(self) -> DistributedOptional[Any]:
        """The next step as a `DistributedOptional`, empty once the dataset ran out.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> it = iter(strategy.experimental_distribute_dataset([torch.arange(2)]))
            >>> first = it.get_next_as_optional()
            >>> first.has_value(), first.get_value().values
            (True, (tensor([0]), tensor([1])))
            >>> it.get_next_as_optional().has_value()
            False
        """
        try:
            return DistributedOptional(next(self))
        except StopIteration:
            return DistributedOptional.empty()

    def supersede(self) -> None:
        """Closes the pass for a new one over the same one-shot source (`ReadAhead`);
        later steps raise `RuntimeError`."""
        self.close()
        self._superseded = True

    def close(self) -> None:
        """Ends the pass and stops the prefetch thread; later steps raise `StopIteration`.
        Steps read ahead for a vote stay for the next pass of a one-shot source (see
        `ReadAhead`)."""
        self._finished = True
        self._last = None
        if not self._keeps:
            self._ahead.clear()
        self._steps.close()


def _left_first(left: deque[Any], next_step: Callable[[], Any]) -> Callable[[], Any]:
    """``next_step`` after the steps in ``left`` (what the last pass left)."""
    def step() -> Any:
        return left.popleft() if left else next_step()
    return step
