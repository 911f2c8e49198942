"""Distributed datasets: per-step `PerReplica` batches from a user's iterable (SPEC §9).

`DistributedDataset` splits each *global* batch by the rule in `split` over all
``N`` replicas and keeps this worker's chunks; `DistributedDatasetsFromFunction`
hands whole, already per-replica batches to the local replicas in turn. Both
move chunks to the replica devices, optionally on a `Prefetcher` thread, and
yield nests of `PerReplica`. With several workers an optional ``any_worker``
vote keeps every worker stepping (on empty batches) while any still has data.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Iterable, Sequence
from typing import Any

import torch

from .. import pytree
from ..topology import Topology
from ..values import PerReplica
from .input import InputContext, InputOptions
from .prefetch import InlineSteps, Prefetcher, default_depth
from .split import empty_like, flatten_batch, split_leaves

__all__ = ["DistributedDataset", "DistributedDatasetsFromFunction", "DistributedIterator"]

AnyWorker = Callable[[bool], bool]
_CPU = torch.device("cpu")


def _to_devices(chunks: Sequence[torch.Tensor],
                devices: Sequence[torch.device] | None) -> Sequence[torch.Tensor]:
    if devices is None:
        return chunks
    return [chunk if chunk.device == device else
            chunk.to(device, non_blocking=chunk.device == _CPU and device.type == "cuda")
            for chunk, device in zip(chunks, devices, strict=True)]


def _close_source(iterator: Any) -> None:
    close = getattr(iterator, "close", None)
    if callable(close):
        close()


def _global_batch_steps(source: Iterable[Any], topology: Topology,
                        fetch: bool) -> Generator[Any, None, None]:
    n, ids, names = topology.num_replicas_in_sync, topology.replica_ids, topology.device_names
    devices = topology.torch_devices if fetch else None
    iterator = iter(source)
    try:
        for index, batch in enumerate(iterator):
            leaves, spec, batch_size = flatten_batch(batch, f"batch {index} of the dataset")
            if topology.follows_caller:
                yield pytree.unflatten(spec, leaves)
                continue
            per_leaf = split_leaves(leaves, batch_size, n, ids)
            yield pytree.unflatten(spec, [PerReplica(_to_devices(chunks, devices), devices=names)
                                          for chunks in per_leaf])
    finally:
        _close_source(iterator)


def _whole_element_steps(elements: Iterable[Any], topology: Topology,
                         fetch: bool) -> Generator[Any, None, None]:
    num_local, names = topology.num_local_replicas, topology.device_names
    devices = topology.torch_devices if fetch else None
    iterator = iter(elements)
    index = 0
    try:
        while True:
            taken: list[list[torch.Tensor]] = []
            spec: Any = None
            first: Any = None
            for _ in range(num_local):
                try:
                    element = next(iterator)
                except StopIteration:
                    break
                leaves, element_spec, _ = flatten_batch(element, f"dataset element {index}")
                if spec is None:
                    spec, first = element_spec, element
                elif element_spec != spec:
                    where, got0, got = pytree.first_difference(first, element, "element") or (
                        "the element", str(spec), str(element_spec))
                    raise ValueError(
                        f"dataset elements of one step must share a structure: at {where}, "
                        f"element {index - len(taken)} has {got0} but element {index} has {got}"
                    )
                taken.append(leaves)
                index += 1
            if not taken:
                return
            ran_out = len(taken) < num_local
            while len(taken) < num_local:  # ran out mid-step: empties like the last element
                taken.append([empty_like(leaf) for leaf in taken[-1]])
            yield pytree.unflatten(spec, [PerReplica(_to_devices(chunks, devices), devices=names)
                                          for chunks in zip(*taken, strict=True)])
            if ran_out:
                return
    finally:
        _close_source(iterator)


def _empty_step(step: Any) -> Any:
    def empty(leaf: Any) -> Any:
        if isinstance(leaf, PerReplica):
            return PerReplica([empty_like(v) for v in leaf.values], devices=leaf.devices)
        return empty_like(leaf)

    return pytree.tree_map(empty, step)


class DistributedIterator:
    """One pass over a distributed dataset; yields one nest of `PerReplica` per step.

    Made by iterating a `DistributedDataset` or `DistributedDatasetsFromFunction`.
    Call `close` (or drop it) to stop its prefetch thread early.

    Example:
        >>> import torch
        >>> from mirrored._src.devices import parse_devices
        >>> t = Topology(devices=parse_devices(["CPU:0", "CPU:1"]))
        >>> it = iter(DistributedDataset([torch.arange(4)], t))
        >>> next(it).values
        (tensor([0, 1]), tensor([2, 3]))
        >>> it.close()
    """

    def __init__(self, steps: Generator[Any, None, None], options: InputOptions,
                 any_worker: AnyWorker | None, devices: Sequence[torch.device] = ()) -> None:
        depth = options.experimental_prefetch_depth
        if depth is None:
            depth = default_depth(devices, options.experimental_fetch_to_device)
        self._steps = Prefetcher(steps, depth) if depth else InlineSteps(steps)
        self._any_worker = any_worker
        self._last: Any = None
        self._exhausted = False
        self._finished = False

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        if not self._exhausted:
            try:
                step = self._steps.next_step()
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

    def close(self) -> None:
        """Ends the pass and stops the prefetch thread; later steps raise `StopIteration`."""
        self._finished = True
        self._last = None
        self._steps.close()


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


class DistributedDataset:
    """Global batches from ``source``, split over all replicas (SPEC §9).

    Every worker iterates the same global batches; of a batch of ``b`` rows, global
    replica ``i`` gets rows ``[i*c, min((i+1)*c, b))`` with ``c = ceil(b / N)``, moved
    to its device. On the source's device chunks are views of the batch (no copy).

    Args:
        source: an iterable of batches, each a tensor or nest of tensors (numbers and
            NumPy arrays are converted) with a shared leading batch dim.
        topology: the replicas to feed.
        options: an `InputOptions`; defaults to ``InputOptions()``.
        any_worker: with several workers, a vote ``any_worker(has_data) -> bool`` called
            once per step on every worker; while it says some worker has data, a worker
            whose source ran out yields empty batches shaped like its last one.

    Raises:
        TypeError: ``source`` is not iterable, or ``options`` not an `InputOptions`.

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
                 any_worker: AnyWorker | None = None) -> None:
        _check_iterable(source, "the dataset")
        self._source = source
        self._topology = topology
        self._options = _options(options)
        self._any_worker = any_worker

    def __iter__(self) -> DistributedIterator:
        steps = _global_batch_steps(self._source, self._topology,
                                    self._options.experimental_fetch_to_device)
        return DistributedIterator(steps, self._options, self._any_worker,
                                   self._topology.torch_devices)

    def __len__(self) -> int:
        """The number of batches of the source; `TypeError` when it has no ``len()``."""
        try:
            return len(self._source)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"this dataset's source ({type(self._source).__name__}) has no "
                            "len()") from None


class DistributedDatasetsFromFunction:
    """Per-replica batches from ``dataset_fn(InputContext)``, whole elements per replica.

    ``dataset_fn`` is called once, here, with this worker's `InputContext`; its result
    is an iterable already batched per replica. At each step local replica 0, 1, ...
    each take the next whole element; when it runs out mid-step the remaining replicas
    get an empty batch shaped like the last element (batch dim 0); iteration stops when
    no replica got data.

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
        self.input_context = InputContext(num_input_pipelines=topology.num_workers,
                                          input_pipeline_id=topology.worker_index,
                                          num_replicas_in_sync=topology.num_replicas_in_sync)
        elements = dataset_fn(self.input_context)
        _check_iterable(elements, "dataset_fn's result")
        self._elements = elements
        self._topology = topology
        self._any_worker = any_worker

    def __iter__(self) -> DistributedIterator:
        steps = _whole_element_steps(self._elements, self._topology,
                                     self._options.experimental_fetch_to_device)
        return DistributedIterator(steps, self._options, self._any_worker,
                                   self._topology.torch_devices)

    def __len__(self) -> int:
        """Steps on this worker: ``ceil(len(elements) / local replicas)``; else `TypeError`."""
        try:
            count = len(self._elements)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"dataset_fn's result ({type(self._elements).__name__}) has no "
                            "len()") from None
        return math.ceil(count / self._topology.num_local_replicas)
