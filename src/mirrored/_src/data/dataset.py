"""Distributed datasets: per-step `PerReplica` batches from a user's iterable (SPEC §9).

`DistributedDataset` splits each *global* batch by the rule in `split` over all
``N`` replicas and keeps this worker's chunks; `DistributedDatasetsFromFunction`
hands whole per-replica elements (of any rank) to the local replicas in turn, or
gives each replica a pipeline of its own (``PER_REPLICA``). Both move chunks to
the replica devices, optionally on a `Prefetcher` thread, and yield nests of
`PerReplica` (plain values for one replica in one process, as TF). With several
workers an optional ``any_worker`` vote keeps every worker stepping (on empty
batches) while any still has data; a `DistributedDataset` whose every worker's
source has an exact ``len()`` agrees on its steps once instead.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any

import torch

from .. import pytree
from ..runtime.replica_call import on_device
from ..topology import Topology
from .ahead import ReadAhead, continues
from .held import HeldBatches
from .input import InputContext, InputOptions, InputReplicationMode
from .iterator import DistributedIterator
from .split import empty_like, flatten_element
from .steps import close_source, global_batch_steps, pack_step
from .vote import AnyWorker, WorkerVote

__all__ = ["DistributedDataset", "DistributedDatasetsFromFunction"]

class _Pipelines:
    """Where each local replica takes its next element: one shared iterator
    (``PER_WORKER``) or one per replica (``PER_REPLICA``), each advanced under its
    replica's device when ``place`` (``experimental_place_dataset_on_device``)."""

    def __init__(self, sources: Sequence[Iterable[Any]], topology: Topology,
                 place: bool) -> None:
        self.shared = len(sources) == 1
        self._devices = topology.torch_devices if place else None
        self._iterators: list[Any] = []
        for k, source in enumerate(sources):
            with self._on(k):
                self._iterators.append(iter(source))
        self._done = [False] * len(self._iterators)

    def _on(self, k: int) -> contextlib.AbstractContextManager[Any]:
        # (the default device, and for a GPU the current CUDA device: "cuda" means it)
        return contextlib.nullcontext() if self._devices is None else on_device(
            self._devices[k], as_default=True)

    def next(self, replica: int, held: HeldBatches, step: int) -> tuple[bool, Any]:
        """``(True, element)`` or ``(False, None)`` once the replica's pipeline ran out
        (read for step ``step`` through ``held``: `HeldBatches`)."""
        k = 0 if self.shared else replica
        if self._done[k]:
            return False, None
        try:
            with self._on(k):
                return True, held.read(self._iterators[k], step)
        except StopIteration:
            self._done[k] = True
            return False, None

    def close(self) -> None:
        for iterator in self._iterators:
            close_source(iterator)


def _whole_element_steps(pipelines: _Pipelines, topology: Topology,
                         fetch: bool, held: HeldBatches) -> Generator[Any, None, None]:
    num_local = topology.num_local_replicas
    devices = topology.torch_devices if fetch and not topology.follows_caller else None
    index = step = 0
    try:
        while True:
            taken: list[list[torch.Tensor] | None] = []
            spec: Any = None
            first: Any = None
            first_index = index
            for replica in range(num_local):
                got, element = pipelines.next(replica, held, step)
                if not got:
                    if pipelines.shared:
                        break
                    taken.append(None)
                    continue
                leaves, element_spec = flatten_element(element, f"dataset element {index}")
                held.hold(step, leaves if devices is None else [
                    t for t in leaves if t.device == devices[replica]])  # (else a copy)
                if spec is None:
                    spec, first, first_index = element_spec, element, index
                elif element_spec != spec:
                    where, got0, got_i = pytree.first_difference(first, element, "element") or (
                        "the element", str(spec), str(element_spec))
                    raise ValueError(
                        f"dataset elements of one step must share a structure: at {where}, "
                        f"element {first_index} has {got0} but element {index} has {got_i}")
                taken.append(leaves)
                index += 1
            present = [leaves for leaves in taken if leaves is not None]
            if not present:
                return
            ran_out = len(present) < num_local
            if ran_out and any(t.dim() == 0 for leaves in present for t in leaves):
                # Scalars have no batch dim to empty: the incomplete step is dropped, as
                # TF does for elements of static shape.
                return
            filled = [leaves if leaves is not None else [empty_like(t) for t in present[-1]]
                      for leaves in taken]
            filled += [[empty_like(t) for t in present[-1]]] * (num_local - len(filled))
            yield pack_step(spec, list(zip(*filled, strict=True)), topology, devices)
            step += 1
            if ran_out and pipelines.shared:
                return
    finally:
        pipelines.close()


def _options(options: InputOptions | None) -> InputOptions:
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(f"options must be an InputOptions or None; got "
                        f"{type(options).__name__}")
    return options


def _check_iterable(value: Any, what: str) -> None:
    if not isinstance(value, Iterable):
        raise TypeError(f"{what} must be an iterable of batches (a DataLoader, a generator, "
                        f"a list); got {type(value).__name__}")


def _length(source: Any) -> int:
    """The number of global batches ``source`` yields, if its ``len()`` says so exactly
    (``-1``: unknown, and the workers vote per window of steps). An iterable dataset's, or
    a ``DataLoader``'s over one, is only a hint (each loader worker may add a partial
    batch): unknown."""
    iterable = torch.utils.data.IterableDataset
    if isinstance(source, iterable) or isinstance(getattr(source, "dataset", None), iterable):
        return -1
    try:
        return len(source)
    except (TypeError, NotImplementedError):
        return -1


class DistributedDataset:
    """Global batches from ``source``, split over all replicas (SPEC §9).

    Every worker iterates the same global batches; of a batch of ``b`` rows, global
    replica ``i`` gets rows ``[i*c, min((i+1)*c, b))`` with ``c = ceil(b / N)``, moved
    to its device. On the source's device chunks are views of the batch (no copy).

    With one replica in all (``N = 1``) nothing is split: elements of any rank pass
    as they are (TF rebatches only for ``N > 1``, and refuses unbatched data there).

    Args:
        source: an iterable of batches, each a tensor or nest of tensors (numbers and
            NumPy arrays are converted) with a shared leading batch dim.
        topology: the replicas to feed.
        options: an `InputOptions`; defaults to ``InputOptions()``.
        any_worker: with several workers, a vote ``any_worker(has_data) -> bool`` called
            once per step on every worker; while it says some worker has data, a worker
            whose source ran out yields empty batches shaped like its last one. A
            `WorkerVote` first asks every worker's count of steps (its source's exact
            ``len()``): when all are known, they step to the largest without voting.
        count_examples: with a `WorkerVote`, tag each step's batches with their
            `StepExamples` where every worker has a batch of the same global source
            (``compute_average_loss`` then needs no collective to count them).

    Raises:
        TypeError: ``source`` is not iterable, or ``options`` not an `InputOptions`.
        NotImplementedError: ``PER_REPLICA`` replication (``distribute_datasets_from_function``
            only, as in TF).

    Example:
        >>> import torch
        >>> from mirrored._src.devices import parse_devices
        >>> t = Topology(devices=parse_devices(["CPU:0", "CPU:1"]))
        >>> ds = DistributedDataset([torch.arange(4), torch.arange(4, 7)], t)
        >>> len(ds), [[v.tolist() for v in b.values] for b in ds]
        (2, [[[0, 1], [2, 3]], [[4, 5], [6]]])
    """

    def __init__(self, source: Iterable[Any], topology: Topology,
                 options: InputOptions | None = None, *,
                 any_worker: AnyWorker | None = None, count_examples: bool = False) -> None:
        _check_iterable(source, "the dataset")
        self._source = source
        self._topology = topology
        self._options = _options(options)
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            raise NotImplementedError(
                "InputReplicationMode.PER_REPLICA is only supported by "
                "distribute_datasets_from_function (as in TF); experimental_distribute_dataset "
                "splits one global pipeline")
        self._any_worker = any_worker
        self._count = (count_examples and isinstance(any_worker, WorkerVote)
                       and any_worker.tells_each)
        self._ahead = ReadAhead(keeps=continues(source))  # (see `ReadAhead`)

    def __iter__(self) -> DistributedIterator:
        held = HeldBatches()
        steps = global_batch_steps(self._source, self._topology,
                                    self._options.experimental_fetch_to_device, self._count,
                                    self._options.experimental_compare_batches, held,
                                    self._ahead)
        # (the tags are kept only at the steps where every worker has data)
        return DistributedIterator(steps, self._options, self._any_worker,
                                   self._topology.torch_devices, _length(self._source),
                                   tagged=self._count, ahead=self._ahead, held=held)

    def __len__(self) -> int:
        """The number of batches of the source; `TypeError` when it has no ``len()``."""
        try:
            return len(self._source)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"this dataset's source ({type(self._source).__name__}) has no "
                            "len()") from None


class DistributedDatasetsFromFunction:
    """Per-replica elements from ``dataset_fn(InputContext)``, whole elements per replica.

    ``dataset_fn`` is called here, once per worker with this worker's `InputContext`
    (``PER_WORKER``, the default), or once per local replica with
    ``InputContext(N, replica id, N)`` (``PER_REPLICA``). Its result is an iterable of
    per-replica elements: tensors (or nests) of any rank, handed over as they are (a
    batch, or one example: no batch dim is needed). At each step local replica
    0, 1, ... each take the next element of the worker's pipeline (or of its own);
    a replica left without one gets an empty batch shaped like the last element (batch
    dim 0), or, when that element has a scalar leaf (no batch dim to empty), the
    incomplete step is dropped, as TF does. Iteration stops when no replica got data.

    Args:
        dataset_fn: ``InputContext -> iterable of per-replica batches``.
        topology: the replicas to feed.
        options: an `InputOptions`; defaults to ``InputOptions()``.
        any_worker: the multi-worker vote, as for `DistributedDataset`.

    Raises:
        TypeError: ``dataset_fn`` is not callable, returns no iterable, or ``options``
            is not an `InputOptions`.

    Example:
        >>> import torch
        >>> from mirrored._src.devices import parse_devices
        >>> t = Topology(devices=parse_devices(["CPU:0", "CPU:1"]))
        >>> ds = DistributedDatasetsFromFunction(
        ...     lambda ctx: [torch.full((2,), i) for i in range(3)], t)
        >>> len(ds), [[v.tolist() for v in b.values] for b in ds]
        (2, [[[0, 0], [1, 1]], [[2, 2], []]])
    """

    def __init__(self, dataset_fn: Callable[[InputContext], Iterable[Any]], topology: Topology,
                 options: InputOptions | None = None, *,
                 any_worker: AnyWorker | None = None) -> None:
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable (InputContext -> iterable); got "
                            f"{type(dataset_fn).__name__}")
        self._options = _options(options)
        n = topology.num_replicas_in_sync
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            self.input_contexts = tuple(InputContext(n, i, n) for i in topology.replica_ids)
        else:
            self.input_contexts = (InputContext(topology.num_workers, topology.worker_index, n),)
        self.input_context = self.input_contexts[0]
        place = self._options.experimental_place_dataset_on_device
        elements = []
        for k, input_context in enumerate(self.input_contexts):
            with (on_device(topology.torch_devices[k], as_default=True) if place
                  else contextlib.nullcontext()):
                result = dataset_fn(input_context)
            _check_iterable(result, "dataset_fn's result")
            elements.append(result)
        self._elements = elements
        self._topology = topology
        self._any_worker = any_worker
        self._ahead = ReadAhead(keeps=all(map(continues, elements)))

    def __iter__(self) -> DistributedIterator:
        self._ahead.settle()  # (before iter() of the sources: see `ReadAhead`)
        pipelines = _Pipelines(self._elements, self._topology,
                               self._options.experimental_place_dataset_on_device)
        held = HeldBatches(elements=True)
        steps = _whole_element_steps(pipelines, self._topology,
                                     self._options.experimental_fetch_to_device, held)
        return DistributedIterator(steps, self._options, self._any_worker,
                                   self._topology.torch_devices, self._steps_known(),
                                   ahead=self._ahead, held=held)

    def _steps_known(self) -> int:
        """This worker's steps when the pipelines' exact ``len()`` fixes them whatever the
        elements hold (``-1``: unknown, and the workers vote per window): a shared
        pipeline whose length the local replicas divide (no incomplete last step, which
        scalar elements would drop), or per-replica pipelines of one length."""
        lengths = [_length(e) for e in self._elements]
        if min(lengths) < 0:
            return -1
        if len(lengths) == 1:
            count, local = lengths[0], self._topology.num_local_replicas
            return count // local if count % local == 0 else -1
        return lengths[0] if len(set(lengths)) == 1 else -1

    def __len__(self) -> int:
        """Steps on this worker: ``ceil(len(elements) / local replicas)`` (``PER_REPLICA``:
        the longest pipeline's length); else `TypeError`."""
        try:
            counts = [len(e) for e in self._elements]  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"dataset_fn's result ({type(self._elements[0]).__name__}) has no "
                            "len()") from None
        if len(counts) > 1:
            return max(counts)
        return math.ceil(counts[0] / self._topology.num_local_replicas)
