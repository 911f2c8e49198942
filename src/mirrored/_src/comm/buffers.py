"""A pool of large host result buffers, so reductions skip the page-fault cost of
fresh allocations.

A fresh 64 MiB host tensor is mapped anew by glibc on each allocation and every
page faults on first touch: on a small machine that costs several times the
reduction itself. The pool keeps the large result tensors it handed out and
reuses one only when nothing outside the pool still references it: no Python
reference to the tensor, none to its storage, no other C++ owner of the tensor
(autograd's saved tensors, DLPack) and no view of its storage (numpy arrays,
slices). Any such owner keeps the buffer out of reuse, so a result is never
overwritten while visible: no weak reference either (a result held only through a
``weakref`` stays untouched). Buffers made under ``torch.inference_mode()`` are
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

__all__ = ["KEEP_BYTES", "MAX_BYTES", "BufferPool", "Kept", "default_pool"]

_MIN_BYTES = 1 << 20
MAX_BYTES = 256 << 20
KEEP_BYTES = 16 << 20  # the most bytes of results a communicator keeps (`Kept`)


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
    return impl_owners == 1 and _storage_owners(tensor) == _BASELINE


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
        self._enabled = _BASELINE is not None
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
                # Three references are ours: the list entry, `tensor`, getrefcount's argument.
                if (sys.getrefcount(tensor) <= 3 and weakref.getweakrefcount(tensor) == 0
                        and _only_the_pool_holds(tensor)):
                    return tensor
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


class Kept:
    """A small result buffer and the views the results are, kept by a repeated call
    (a training loop's gradient all-reduce), to be handed out again instead of a
    fresh buffer and fresh views (what a small buffer costs: the allocation, first
    touches, one view per result, about a tenth of a small model's step).

    `free` says whether nothing outside still holds the buffer or any view: no Python
    reference but the `Kept`'s own, no weak reference, no other C++ owner (autograd's
    saved tensors, DLPack) and no further view or storage user (numpy arrays, slices)
    than when it was made. A result that the user kept (``p.grad`` not reset, a list
    of last step's results) makes the call take a fresh buffer, so no result is ever
    overwritten while visible.

    Example:
        >>> import torch
        >>> buffer = torch.zeros(6)
        >>> kept = Kept(buffer, buffer[:4].view(2, 2))
        >>> del buffer
        >>> kept.free()
        True
        >>> result = kept.tensors[1]
        >>> kept.free()
        False
    """

    __slots__ = ("inference", "owners", "refs", "tensors", "uses")

    def __init__(self, buffer: torch.Tensor, *views: torch.Tensor) -> None:
        self.tensors = (buffer, *views)
        # What `free` compares with: measured now, while only these tensors exist
        # (a view holds its base, so the buffer's C++ owners count the views).
        self.uses = tuple(t._use_count() for t in self.tensors)  # type: ignore[attr-defined]
        self.owners = _storage_owners(buffer)
        self.inference = torch.is_inference_mode_enabled()
        probe = _KEPT_REFS[self.inference]
        self.refs = None if probe is None else [probe[0], *[probe[1]] * len(views)]

    def free(self) -> bool:
        """Whether the buffer and its views may be handed out again (see the class)."""
        if self.refs is None or self.inference != torch.is_inference_mode_enabled():
            return False
        tensors = self.tensors
        return (_python_refs(tensors) == self.refs
                and not any(weakref.getweakrefcount(t) for t in tensors)
                and tuple(t._use_count() for t in tensors) == self.uses  # type: ignore[attr-defined]
                and _storage_owners(tensors[0]) == self.owners)


def _python_refs(tensors: tuple[torch.Tensor, ...]) -> list[int]:
    return [sys.getrefcount(t) for t in tensors]


def _kept_refs(inference: bool) -> list[int] | None:
    # The Python references `_python_refs` sees for a buffer and a view of it held by
    # a tuple alone: measured, since torch's bookkeeping differs between versions and
    # modes (a tensor that a view holds in C++ also holds its Python object, except
    # under inference mode, whose views do not hold their base).
    if _BASELINE is None:
        return None
    with torch.inference_mode(inference):
        buffer = torch.empty(2)
        held = (buffer, buffer[:1])
    del buffer
    return _python_refs(held)


_KEPT_REFS = {mode: _kept_refs(mode) for mode in (False, True)}
