"""`StepSource`: the source of an elastic strategy's distributed dataset, indexed by
the job's step: element ``s`` of the user's iterable is the global batch of step
``s`` (``s`` = committed steps).

Taking the next element begins the step (its quorum) first, so that a worker that
rejoins with a peer's state skips to the job's element, and a step that was not
committed (a worker lost in it) is served its same element again: the survivors redo
it. Every worker of a step therefore splits the same global batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from ..data import InputOptions

__all__ = ["StepSource", "step_input"]


class Steps(Protocol):
    """What a `StepSource` needs of the worker's `ElasticSession`."""

    element: int

    @property
    def step(self) -> int: ...

    def begin(self) -> None: ...


def step_input(session: Steps, source: Any, options: Any, kind: str
               ) -> tuple[Any, Any]:
    """An elastic strategy's distributed dataset: its source indexed by step, and no
    prefetch thread (a step's batch is known only once its quorum is).

    Raises:
        NotImplementedError: ``distribute_datasets_from_function`` (its per-replica
            pipelines have no step index).
    """
    if kind != "dataset":
        raise NotImplementedError(
            "ElasticMirroredStrategy feeds steps through experimental_distribute_dataset "
            "(element s of the dataset is the global batch of step s, so a rejoining worker "
            "skips to the job's step and a failed step is redone); "
            "distribute_datasets_from_function's per-worker pipelines have no step index")
    if options is None:
        options = InputOptions()
    if isinstance(options, InputOptions):
        options = dataclasses.replace(options, experimental_prefetch_depth=0)
    if not isinstance(source, Iterable):
        return source, options  # DistributedDataset raises its TypeError
    return StepSource(source, session), options


class StepSource:
    """``source`` indexed by step (see the module's docstring); iterated once.

    Example:
        >>> StepSource.__name__  # made by the strategy's experimental_distribute_dataset
        'StepSource'
    """

    def __init__(self, source: Iterable[Any], session: Steps) -> None:
        self._source = source
        self._session = session
        self._iterated = False

    def __len__(self) -> int:
        return len(self._source)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        if self._iterated:
            raise RuntimeError(
                "an elastic distributed dataset is iterated once: element s is the global "
                "batch of step s for the whole training, so that workers that rejoin find "
                "their step. Put the epochs inside the dataset (a generator that loops over "
                "them, itertools.chain) instead of iterating it again")
        self._iterated = True
        return self._steps()

    def _steps(self) -> Iterator[Any]:
        iterator = iter(self._source)
        session = self._session
        read = 0  # elements taken from the source
        last: Any = None
        try:
            while True:
                session.begin()
                step = session.step
                if step < read - 1:
                    raise RuntimeError(f"the job is at step {step} but this worker's dataset "
                                       f"already served element {read - 1}")
                while read <= step:  # a new step (or a rejoin: skip to the job's)
                    try:
                        last = next(iterator)
                    except StopIteration:
                        return
                    read += 1
                session.element = step
                yield last  # a step not committed is served the same element again
        finally:
            close = getattr(iterator, "close", None)
            if callable(close):
                close()
