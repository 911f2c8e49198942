"""The steps of a `DistributedDataset`: each global batch split by the rule in
`split` over all ``N`` replicas, this worker's chunks moved to its replicas'
devices and packed as `PerReplica` values (plain values for one replica in one
process, as TF)."""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Generator, Iterable, Sequence
from itertools import repeat
from operator import attrgetter, is_
from typing import Any

import numpy as np
import torch

from .. import pytree
from ..topology import Topology
from ..values import PerReplica, StepExamples
from .ahead import ReadAhead
from .held import HeldBatches
from .split import chunk_bounds, flatten_batch, flatten_element, split_leaves, tuple_batch_size

__all__ = ["close_source", "global_batch_steps", "pack_step"]

_CPU = torch.device("cpu")


def _to_devices(chunks: Sequence[torch.Tensor],
                devices: Sequence[torch.device] | None) -> Sequence[torch.Tensor]:
    if devices is None:
        return chunks
    return [chunk if chunk.device == device else
            chunk.to(device, non_blocking=chunk.device == _CPU and device.type == "cuda")
            for chunk, device in zip(chunks, devices, strict=True)]


def close_source(iterator: Any) -> None:
    close = getattr(iterator, "close", None)
    if callable(close):
        close()


_TENSORS, _IS_CPU = repeat(torch.Tensor), attrgetter("is_cpu")


def _plain(topology: Topology) -> bool:
    """One replica in one process yields plain values, not `PerReplica` (as TF)."""
    return topology.num_local_replicas == 1 and topology.num_workers == 1


def pack_step(spec: Any, per_leaf: Sequence[Sequence[torch.Tensor]], topology: Topology,
          devices: Sequence[torch.device] | None, examples: StepExamples | None = None
          ) -> Any:
    """The step: one `PerReplica` per leaf (each tagged with ``examples`` if given)."""
    if _plain(topology):
        return pytree.unflatten(spec, [_to_devices(chunks, devices)[0] for chunks in per_leaf])
    names = _names(topology)
    values = [PerReplica._from_trusted(tuple(_to_devices(chunks, devices)), names)
              for chunks in per_leaf]
    if examples is not None:
        for value in values:
            value._examples = examples
    return tuple(values) if spec is None else pytree.unflatten(spec, values)


@functools.lru_cache(maxsize=64)
def _canonical(names: tuple[str, ...]) -> tuple[str, ...]:
    return PerReplica(names, devices=names).devices


def _names(topology: Topology) -> tuple[str, ...]:
    """The canonical names of the local replicas' devices (`PerReplica.devices`),
    made once per set of names."""
    return _canonical(topology.device_names)


def _as_is(batch: Any, device: torch.device | None) -> bool:
    """Whether one replica in one process takes ``batch`` exactly as it is: a tensor or a
    tuple of tensors, already on the replica's device (``None``: wherever it is).
    `_pack` would rebuild an equal tuple of the same tensors."""
    if type(batch) is torch.Tensor:
        return device is None or batch.device == device
    if type(batch) is not tuple or not batch:
        return False
    for leaf in batch:
        if type(leaf) is not torch.Tensor or (device is not None and leaf.device != device):
            return False
    return True


def global_batch_steps(source: Iterable[Any], topology: Topology,
                        fetch: bool, tag: bool = False, digest: bool = True,
                        held: HeldBatches | None = None, ahead: ReadAhead | None = None
                        ) -> Generator[Any, None, None]:
    """The steps of `DistributedDataset`; with ``tag`` (several workers) each step's
    `PerReplica` batches carry its `StepExamples`, whose digest hashes the step's place
    in the source (in the pass; of a one-shot source, counted on in ``ahead`` across
    passes, since a pass hands out the steps the last one read ahead) and, with
    ``digest``, a sample of its elements (`sample_digest`);
    ``held`` reads the source and notes the tensors the steps keep as they are (not
    copied to a device) until the loop is past them (`HeldBatches`)."""
    n, ids = topology.num_replicas_in_sync, topology.replica_ids
    devices = topology.torch_devices if fetch and not topology.follows_caller else None
    device = None if devices is None else devices[0]
    plain = _plain(topology)
    as_is = plain and (device is None or device == _CPU)  # a tensor's is_cpu: on device
    tags: dict[int, StepExamples | None] = {}  # per batch size (immutable: shared by steps)
    iterator = iter(source)
    kept = None if devices is None else frozenset(devices)  # (a copy elsewhere keeps none)
    counted = ahead if ahead is not None and ahead.keeps else None
    index = -1 if counted is None else counted.read - 1
    try:
        while True:
            index += 1
            try:
                batch = next(iterator) if held is None else held.read(iterator, index)
            except StopIteration:
                return
            if counted is not None:
                counted.read = index + 1
            if held is not None:  # ((x, y): no flattening, in C iterators)
                leaves = batch if type(batch) is tuple and all(
                    map(is_, map(type, batch), _TENSORS)) else pytree.flatten(batch)[0]
                held.hold(index, leaves if kept is None else [
                    t for t in leaves if isinstance(t, torch.Tensor) and t.device in kept])
            if n == 1:  # nothing to split: elements of any rank pass as they are (TF)
                # (`_as_is` of a tuple, in C iterators: no bytecode per leaf at each step)
                if as_is and type(batch) is tuple and batch and all(
                        map(is_, map(type, batch), _TENSORS)) and (
                        device is None or all(map(_IS_CPU, batch))):
                    yield batch
                    continue
                if plain and _as_is(batch, device):
                    yield batch
                    continue
                leaves, spec = flatten_element(batch, f"batch {index} of the dataset")
                yield pack_step(spec, [(leaf,) for leaf in leaves], topology, devices)
                continue
            size = tuple_batch_size(batch)
            if size is not None:  # (x, y): the leaves are the tuple, rebuilt by `_pack`
                leaves, spec, batch_size = batch, None, size
            else:
                leaves, spec, batch_size = flatten_batch(batch, f"batch {index} of the dataset")
            # (no tag where some replica gets no rows: its empty loss would match any
            # kind of loss, so every replica counts; the tag depends on the size only)
            if tag and batch_size not in tags:
                tags[batch_size] = StepExamples(batch_size, tuple(
                    b - a for a, b in (chunk_bounds(batch_size, n, i) for i in ids))) if (
                    chunk_bounds(batch_size, n, n - 1)[0] < batch_size) else None  # (the
                # last replica's chunk is the smallest)
            examples = tags[batch_size] if tag else None
            if examples is not None:  # (this step's own, alike on every worker: its place
                # in the pass, so that a worker that skipped a step's run, a `continue`
                # before strategy.run, gives its next run another place, also where no
                # element is sampled; and a sample of its elements; ints hash alike in
                # every process)
                examples = StepExamples(examples.total, examples.sizes, hash(
                    (index, sample_digest(leaves) if digest else 0)))
            yield pack_step(spec, split_leaves(leaves, batch_size, n, ids), topology, devices,
                        examples)
    finally:
        if iterator is not source:  # (a one-shot source goes on at the next pass)
            close_source(iterator)


_SAMPLES = 16  # elements sampled per tensor by `sample_digest`
# Fractions of the golden ratio's multiples: 16 positions spread over a tensor and off
# any row grid (every numel // 16-th element of a [16, L] batch is each row's first).
_SPREAD = (np.arange(_SAMPLES) * 0.6180339887498949) % 1.0
# Not sampled: floating tensors, uint8 (images) and bool (masks), which a random
# augmentation or masking may change on each worker while the examples are the same.
_SKIP = frozenset({torch.uint8, torch.bool})


def sample_digest(leaves: Sequence[Any]) -> int:
    """A hash of 16 elements, at spread positions, of each integer host tensor of a
    global batch (labels, token ids; not uint8 or bool), with every tensor's shape and
    every other leaf's type: workers whose sources yield the same examples in another
    order (a shuffle seeded differently on each) get other digests, almost surely.
    Floating, uint8 and bool tensors (inputs an augmentation or masking may change on
    each worker, which is no error) count by their shape only. A few µs a tensor
    (NumPy views, no copy of the batch).

    Example:
        >>> sample_digest([torch.arange(4)]) == sample_digest([torch.arange(4)])
        True
        >>> sample_digest([torch.arange(4)]) == sample_digest([torch.arange(4).flip(0)])
        False
        >>> sample_digest([torch.ones(2)]) == sample_digest([torch.zeros(2)])
        True
    """
    crc, shapes = 0, []
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            crc = zlib.crc32(type(t).__name__.encode(), crc)
            continue
        shapes.append(tuple(t.shape))
        if (t.is_floating_point() or t.is_complex() or t.dtype in _SKIP or not t.is_cpu
                or not t.numel()):
            continue
        try:
            array = t.numpy()  # (a view, strided as the tensor)
        except (TypeError, RuntimeError):  # (no NumPy view: a quantized tensor, say)
            continue
        sample = array[_positions(array.shape)] if array.ndim else array
        crc = zlib.crc32(np.ascontiguousarray(sample).tobytes(),
                         zlib.crc32(str(t.dtype).encode(), crc))
    return hash((crc, *shapes))  # (of ints only: a str's or bytes' hash is per process)


@functools.lru_cache(maxsize=64)
def _positions(shape: tuple[int, ...]) -> tuple[Any, ...]:
    """`sample_digest`'s sampled positions in an array of ``shape`` (a step's batches
    repeat their shapes)."""
    return np.unravel_index((_SPREAD * math.prod(shape)).astype(np.int64), shape)
