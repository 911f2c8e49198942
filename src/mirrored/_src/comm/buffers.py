"""A pool of large host result buffers, so reductions skip the page-fault cost of
fresh allocations.

A fresh 64 MiB host tensor is mapped anew by glibc on each allocation and every
page faults on first touch: on a small machine that costs several times the
reduction itself. The pool keeps the large result tensors it handed out and
reuses one only when nothing outside the pool still references it: no Python
reference to the tensor, none to its storage, no other C++ owner of the tensor
(autograd's saved tensors, DLPack) and no view of its storage (numpy arrays,
slices), and a storage moved to shared memory (``share_memory_``, a tensor sent
through ``torch.multiprocessing``: another process may read it) is dropped from
the pool. Any such owner keeps the buffer out of reuse, so a result is never
overwritten while visible: no weak reference either (a result held only through a
``weakref`` stays untouched). Nor is a buffer with autograd history (an in-place
op wrote an input that requires grad into it): reused, the next result would carry
that graph. Buffers made under ``torch.inference_mode()`` are
inference tensors and are only ever reused under it, and the others only outside
it. The pool holds at most `MAX_BYTES` (256 MiB) of idle buffers, least recently
used first out. Strategies share the process-wide pool and count as its users
(`BufferPool.retain` / `BufferPool.release`): it is emptied when the last open
strategy closes (or is dropped), never under another strategy still using it.
Small tensors and non-CPU devices are left to torch's allocators.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch

__all__ = ["MAX_BYTES", "OWNERS_KNOWN", "BufferPool", "default_pool", "storage_owners"]

_MIN_BYTES = 1 << 20
MAX_BYTES = 256 << 20


def storage_owners(tensor: torch.Tensor) -> tuple[int, int, bool]:
    """The owners of ``tensor``'s storage: (C++ owners: tensors and storage objects
    on it, Python references of its storage object, shared with another process)."""
    # (C++ owners, Python references of the storage object, shared with another
    # process: a tensor sent through torch.multiprocessing or share_memory_()).
    storage = tensor.untyped_storage()
    return (torch._C._storage_Use_Count(storage._cdata), sys.getrefcount(storage),
            storage.is_shared())


def _baseline() -> tuple[int, int, bool] | None:
    # What `storage_owners` reports for a tensor nobody else holds; measured rather
    # than assumed, since torch's storage bookkeeping differs between versions.
    if not (hasattr(torch._C, "_storage_Use_Count") and hasattr(torch.Tensor, "_use_count")):
        return None
    return storage_owners(torch.empty(1))


_BASELINE = _baseline()
# Whether this torch reports the owners that reusing a buffer depends on.
OWNERS_KNOWN = _BASELINE is not None


def _find_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


_malloc_trim = _find_malloc_trim()


def _only_the_pool_holds(tensor: torch.Tensor) -> bool:
    # The caller has checked the Python references to the tensor; here its C++ owners
    # (autograd's saved tensors, DLPack) and the owners of its storage (views, numpy
    # arrays, storage objects).
    impl_owners: int = tensor._use_count()  # type: ignore[attr-defined]
    # (autograd history, from an in-place op with an input that requires grad: reused,
    # the next result would carry it and chain its graph to the last one's)
    return (impl_owners == 1 and not tensor.requires_grad
            and storage_owners(tensor) == _BASELINE)


_Key = tuple[tuple[int, ...], torch.dtype, bool]


class BufferPool:
    """Hands out host tensors for results, reusing large ones that nobody holds.

    Args:
        max_per_key: buffers kept per (shape, dtype, inference mode).
        max_bytes: the most bytes the pool keeps; the least recently used go first.
    """

    def __init__(self, max_per_key: int = 4, max_bytes: int = MAX_BYTES) -> None:
        self._entries: OrderedDict[_Key, list[torch.Tensor]] = OrderedDict()
        self._max_per_key = max_per_key
        self._max_bytes = max_bytes
        self._bytes = 0
        self._lock = threading.Lock()
        self._enabled = OWNERS_KNOWN
        self._users = 0

    @property
    def nbytes(self) -> int:
        """The bytes of the buffers the pool keeps."""
        return self._bytes

    @property
    def users(self) -> int:
        """How many open strategies use the pool."""
        return self._users

    def retain(self) -> None:
        """A strategy starts using the pool."""
        with self._lock:
            self._users += 1

    def release(self) -> None:
        """A strategy stops using the pool; the last one out empties it (`clear`)."""
        with self._lock:
            self._users = max(0, self._users - 1)
            last = self._users == 0
        if last:
            self.clear()

    def clear(self) -> None:
        """Forgets every buffer (those still in use stay with their users) and hands
        freed memory back to the operating system: replica threads allocate from
        glibc arenas of their own, which otherwise keep what they freed."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0
        if _malloc_trim is not None:
            _malloc_trim(0)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype`` on ``device``."""
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        if (not self._enabled or device.type != "cpu" or nbytes < _MIN_BYTES
                or nbytes > self._max_bytes):
            return torch.empty(shape, dtype=dtype, device=device)
        key = (shape, dtype, torch.is_inference_mode_enabled())
        with self._lock:
            entries = self._entries.get(key)
            if entries is None:
                entries = self._entries[key] = []
            else:
                self._entries.move_to_end(key)
            for tensor in entries:
                # Three references are ours: the list entry, `tensor`, getrefcount's argument
                # (no enumerate: its reused result tuple would hold a fourth).
                if sys.getrefcount(tensor) <= 3 and weakref.getweakrefcount(tensor) == 0:
                    if _only_the_pool_holds(tensor):
                        return tensor
                    if tensor.untyped_storage().is_shared():  # another process reads it
                        entries[:] = [t for t in entries if t is not tensor]
                        self._bytes -= nbytes
                        break
            fresh = torch.empty(shape, dtype=dtype, device=device)
            if len(entries) < self._max_per_key:
                entries.append(fresh)
                self._bytes += nbytes
                self._evict(keep=key)
            return fresh

    def _evict(self, keep: _Key) -> None:
        # Caller holds the lock: drop least recently used keys until under the cap.
        while self._bytes > self._max_bytes:
            key = next(iter(self._entries))
            if key == keep and len(self._entries) == 1:
                dropped = self._entries[key].pop(0)
                self._bytes -= dropped.numel() * dropped.element_size()
                continue
            if key == keep:
                self._entries.move_to_end(key)
                continue
            for tensor in self._entries.pop(key):
                self._bytes -= tensor.numel() * tensor.element_size()


_default_pool = BufferPool()


def default_pool() -> BufferPool:
    """The process-wide pool used by reductions."""
    return _default_pool
