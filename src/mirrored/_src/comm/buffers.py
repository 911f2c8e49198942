"""A pool of large host result buffers, so reductions skip the page-fault cost of
fresh allocations.

A fresh 64 MiB host tensor is mapped anew by glibc on each allocation and every
page faults on first touch: on a small machine that costs several times the
reduction itself. The pool keeps the large result tensors it handed out and
reuses one only when nothing outside the pool still references it: no Python
reference to the tensor, none to its storage, no other C++ owner of the tensor
(autograd's saved tensors, DLPack) and no view of its storage (numpy arrays,
slices). Any such owner keeps the buffer out of reuse, so a result is never
overwritten while visible. Small tensors and non-CPU devices are left to torch's
allocators.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict

import torch

__all__ = ["BufferPool", "default_pool"]

_MIN_BYTES = 1 << 20


def _storage_owners(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata), sys.getrefcount(storage)


def _baseline() -> tuple[int, int] | None:
    # What `_storage_owners` reports for a tensor nobody else holds; measured rather
    # than assumed, since torch's storage bookkeeping differs between versions.
    if not (hasattr(torch._C, "_storage_Use_Count") and hasattr(torch.Tensor, "_use_count")):
        return None
    return _storage_owners(torch.empty(1))


_BASELINE = _baseline()


def _only_the_pool_holds(tensor: torch.Tensor) -> bool:
    # The caller has checked the Python references to the tensor; here its C++ owners
    # (autograd's saved tensors, DLPack) and the owners of its storage (views, numpy
    # arrays, storage objects).
    impl_owners: int = tensor._use_count()  # type: ignore[attr-defined]
    return impl_owners == 1 and _storage_owners(tensor) == _BASELINE


class BufferPool:
    """Hands out host tensors for results, reusing large ones that nobody holds.

    Args:
        max_per_key: buffers kept per (shape, dtype).
        max_keys: (shape, dtype) keys kept; the least recently used is dropped.
    """

    def __init__(self, max_per_key: int = 4, max_keys: int = 16) -> None:
        self._entries: OrderedDict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = (
            OrderedDict())
        self._max_per_key = max_per_key
        self._max_keys = max_keys
        self._lock = threading.Lock()
        self._enabled = _BASELINE is not None

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype`` on ``device``."""
        numel = 1
        for d in shape:
            numel *= d
        if (not self._enabled or device.type != "cpu"
                or numel * dtype.itemsize < _MIN_BYTES):
            return torch.empty(shape, dtype=dtype, device=device)
        key = (shape, dtype)
        with self._lock:
            entries = self._entries.get(key)
            if entries is None:
                entries = self._entries[key] = []
                while len(self._entries) > self._max_keys:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
            for tensor in entries:
                # Three references are ours: the list entry, `tensor`, getrefcount's argument.
                if sys.getrefcount(tensor) <= 3 and _only_the_pool_holds(tensor):
                    return tensor
            fresh = torch.empty(shape, dtype=dtype, device=device)
            if len(entries) < self._max_per_key:
                entries.append(fresh)
            return fresh


_default_pool = BufferPool()


def default_pool() -> BufferPool:
    """The process-wide pool used by reductions."""
    return _default_pool
