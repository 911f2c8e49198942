"""The input side of training: the split rule, distributed datasets, `InputContext` and
`InputOptions` (SPEC §9)."""

from __future__ import annotations

from .dataset import (
    DistributedDataset as DistributedDataset,
)
from .dataset import (
    DistributedDatasetsFromFunction as DistributedDatasetsFromFunction,
)
from .input import InputContext as InputContext
from .input import InputOptions as InputOptions
from .input import InputReplicationMode as InputReplicationMode
from .iterator import DistributedIterator as DistributedIterator
from .iterator import DistributedOptional as DistributedOptional
from .split import chunk_bounds as chunk_bounds
from .split import split_batch as split_batch

__all__ = [
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "DistributedOptional",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "chunk_bounds",
    "split_batch",
]
