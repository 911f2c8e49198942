"""The split rule of SPEC §9: one global batch into contiguous per-replica chunks.

A batch of ``b`` rows on ``N`` replicas is cut into chunks of ``c = ceil(b / N)``
rows; global replica ``i`` gets rows ``[i*c, min((i+1)*c, b))``, possibly none.
The rule reads global replica ids, so one worker and several split alike: each
worker keeps the chunks of its own replicas. This module is pure (no devices,
no threads): it validates batches and slices them into views.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import pytree
from ..values import to_tensor

__all__ = ["chunk_bounds", "empty_like", "flatten_batch", "flatten_element",
           "refuse_sharded_source", "split_batch", "split_leaves", "tuple_batch_size"]


def chunk_bounds(batch_size: int, num_replicas_in_sync: int, replica_id: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` of a ``batch_size``-row batch that replica ``replica_id`` gets.

    Example:
        >>> [chunk_bounds(6, 4, i) for i in range(4)]
        [(0, 2), (2, 4), (4, 6), (6, 6)]
    """
    chunk = -(-batch_size // num_replicas_in_sync)
    start = min(replica_id * chunk, batch_size)
    return start, min(start + chunk, batch_size)


def refuse_sharded_source(source: Any) -> None:
    """Refuses a ``DataLoader`` whose sampler shards the data by process (torch's
    ``DistributedSampler``, DDP's habit) as the source of global batches: each worker
    would split its own shard's batches and keep its replicas' rows, training on a
    fraction of the data that no error would show.

    Raises:
        ValueError: naming the sampler and what to do instead.
    """
    if not isinstance(source, torch.utils.data.DataLoader):
        return
    for sampler in (source.sampler, getattr(source.batch_sampler, "sampler", None)):
        if isinstance(sampler, torch.utils.data.DistributedSampler) and sampler.num_replicas > 1:
            n = sampler.num_replicas
            raise ValueError(
                "experimental_distribute_dataset expects global batches, the same on every "
                "worker (each keeps its replicas' rows of each); got a DataLoader whose "
                f"sampler is a DistributedSampler(num_replicas={n}, rank={sampler.rank}), "
                f"which gives each process its own shard: each worker would keep 1/{n} of "
                "the rows of its own shard's batches. Drop the sampler (a loader over the "
                "whole dataset, shuffled with the same seed on every worker), or keep "
                "per-worker shards with strategy.distribute_datasets_from_function("
                "lambda ctx: loader), whose elements are per-replica batches")


def flatten_batch(batch: Any, what: str = "a batch") -> tuple[list[torch.Tensor], Any, int]:
    """The leaves of ``batch`` as tensors, its structure and its batch size.

    Python numbers and NumPy arrays are converted with `torch.as_tensor`.

    Args:
        batch: a tensor or a nest of tensors sharing a leading batch dim.
        what: how errors name the batch (``"a batch"``, ``"dataset element 3"``).

    Returns:
        ``(leaves, spec, batch_size)``.

    Raises:
        TypeError: a leaf that is not a tensor, number or array, or a tensor that is not
            strided (sparse, nested): its rows cannot be sliced.
        ValueError: no leaves, a leaf without a batch dim, or leaves that disagree on it;
            the message names the pytree path and the shapes.

    Example:
        >>> import numpy as np, torch
        >>> leaves, _, b = flatten_batch({"x": torch.zeros(4, 3), "y": np.arange(4)})
        >>> [tuple(t.shape) for t in leaves], b
        ([(4, 3), (4,)], 4)
    """
    paths, tensors, spec = _tensors(batch, what)
    for path, tensor in zip(paths, tensors, strict=True):
        if tensor.layout is not torch.strided:  # (slicing rows fails deep in torch)
            raise TypeError(
                f"{what} has a {tensor.layout} tensor at {pytree.format_path(path, 'batch')} "
                f"(shape {list(tensor.shape)}); only strided (dense) tensors can be split "
                "by rows across replicas. Make it dense in the pipeline (.to_dense(); a "
                "nested tensor: torch.nested.to_padded_tensor), or "
                "give per-replica elements through distribute_datasets_from_function, "
                "which hands them over whole")
    first = tensors[0]
    batch_size = first.shape[0] if first.dim() else -1
    for path, tensor in zip(paths, tensors, strict=True):
        if tensor.dim() == 0 or tensor.shape[0] != batch_size:
            shapes = "; ".join(f"{pytree.format_path(p, 'batch')}: {list(t.shape)}"
                               for p, t in zip(paths, tensors, strict=True))
            problem = ("a scalar (shape [])" if tensor.dim() == 0 else
                       f"batch dim {tensor.shape[0]}, not {batch_size}")
            raise ValueError(
                f"{what} needs one leading batch dim shared by every tensor, to be split "
                f"across replicas; {pytree.format_path(path, 'batch')} has {problem} (shapes: "
                f"{shapes}). Batch the dataset (e.g. DataLoader(batch_size=...)), or give "
                "per-replica elements through distribute_datasets_from_function"
            )
    return tensors, spec, batch_size


def _tensors(element: Any, what: str) -> tuple[list[Any], list[torch.Tensor], Any]:
    paths, leaves, spec = pytree.flatten_with_path(element)
    if not leaves:
        raise ValueError(f"{what} has no tensors; expected a tensor or a nest of tensors, "
                         f"got {type(element).__name__}")
    tensors = [leaf if isinstance(leaf, torch.Tensor) else
               to_tensor(leaf, pytree.format_path(path, "batch"), "distributing a dataset")
               for path, leaf in zip(paths, leaves, strict=True)]
    return paths, tensors, spec


def flatten_element(element: Any, what: str = "a dataset element"
                    ) -> tuple[list[torch.Tensor], Any]:
    """The leaves of ``element`` as tensors of any rank (no batch dim needed), and its
    structure; Python numbers and NumPy arrays are converted with `torch.as_tensor`.

    Raises:
        TypeError: a leaf that is not a tensor, number or array.
        ValueError: no leaves.

    Example:
        >>> leaves, _ = flatten_element((1.5, [2, 3]))
        >>> leaves
        [tensor(1.5000), tensor(2), tensor(3)]
    """
    _, tensors, spec = _tensors(element, what)
    return tensors, spec


def _check_ids(num_replicas_in_sync: int, replica_ids: Sequence[int]) -> None:
    if isinstance(num_replicas_in_sync, bool) or not isinstance(num_replicas_in_sync, int) \
            or num_replicas_in_sync < 1:
        raise ValueError(f"num_replicas_in_sync must be an int >= 1; got "
                         f"{num_replicas_in_sync!r}")
    for i in replica_ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_replicas_in_sync:
            raise ValueError(f"replica ids must be ints in 0..{num_replicas_in_sync - 1}; got "
                             f"{i!r} in {list(replica_ids)}")


def split_leaves(leaves: Sequence[torch.Tensor], batch_size: int, num_replicas_in_sync: int,
                 replica_ids: Sequence[int]) -> list[tuple[torch.Tensor, ...]]:
    """Per leaf, the chunk of each replica in ``replica_ids`` (views, no copies).

    The hot path under `split_batch`: the leaves are already checked by
    `flatten_batch`, the ids by the caller.

    Example:
        >>> import torch
        >>> split_leaves([torch.arange(5)], 5, 2, [0, 1])
        [(tensor([0, 1, 2]), tensor([3, 4]))]
    """
    chunk = -(-batch_size // num_replicas_in_sync)
    bounds = [(i * chunk, (i + 1) * chunk) for i in replica_ids]
    # Slicing clamps to the batch: rows past its end give an empty (0, ...) view.
    return [tuple(leaf[start:stop] for start, stop in bounds) for leaf in leaves]


def split_batch(batch: Any, num_replicas_in_sync: int,
                replica_ids: Sequence[int] | None = None) -> list[Any]:
    """Splits one global batch by the rule of SPEC §9.

    Args:
        batch: a tensor or nest of tensors with a shared leading batch dim.
        num_replicas_in_sync: ``N``, the global number of replicas.
        replica_ids: the global ids whose chunks to return, in order; all ``N`` by default.

    Returns:
        One nest per id in ``replica_ids``, of the batch's structure, holding views of
        the batch's rows.

    Raises:
        TypeError: a leaf that is not a tensor, number or array.
        ValueError: a bad batch (see `flatten_batch`) or replica ids outside ``0..N-1``.

    Example:
        >>> import torch
        >>> [c.tolist() for c in split_batch(torch.arange(6), 4)]
        [[0, 1], [2, 3], [4, 5], []]
        >>> split_batch({"x": torch.arange(8)}, 4, replica_ids=[2, 3])
        [{'x': tensor([4, 5])}, {'x': tensor([6, 7])}]
    """
    ids = tuple(range(num_replicas_in_sync)) if replica_ids is None else tuple(replica_ids)
    _check_ids(num_replicas_in_sync, ids)
    leaves, spec, batch_size = flatten_batch(batch)
    per_leaf = split_leaves(leaves, batch_size, num_replicas_in_sync, ids)
    return [pytree.unflatten(spec, [chunks[k] for chunks in per_leaf])
            for k in range(len(ids))]


def tuple_batch_size(batch: Any) -> int | None:
    """The batch size of ``batch`` when it is a tuple of plain tensors that share a
    leading batch dim (the common element: ``(x, y)``; no pytree walk), else ``None``
    (`flatten_batch` takes it, and names what is wrong).

    Example:
        >>> import torch
        >>> tuple_batch_size((torch.zeros(4, 3), torch.zeros(4))), tuple_batch_size([1, 2])
        (4, None)
        >>> tuple_batch_size((torch.zeros(4, 3), torch.zeros(5)))  # flatten_batch raises
    """
    if type(batch) is not tuple or not batch:
        return None
    for leaf in batch:
        if type(leaf) is not torch.Tensor or leaf.layout is not torch.strided:
            return None
    first = batch[0]
    size: int = first.shape[0] if first.dim() else -1
    for leaf in batch:
        if not leaf.dim() or leaf.shape[0] != size:
            return None
    return size


def empty_like(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh tensor shaped like ``tensor`` with batch dim 0, same dtype and device.

    Example:
        >>> import torch
        >>> empty_like(torch.ones(3, 2)).shape
        torch.Size([0, 2])
    """
    return tensor.new_empty((0, *tensor.shape[1:]))
