"""`ResultSlot`: the buffers of one cross-worker `reduce_packed` call, kept by its
plan and reused by the next call of the same plan once nothing else holds them.

A training loop makes the same call at every step (a mirrored optimizer's step:
the same gradients' shapes and dtypes). Each call's results are views of one flat
buffer per pack (the call check's trailer at the end of the first). A fresh buffer
per call costs an allocation and its first touches, a new address for the
trailer's cached byte view (`trailer.Codec`), and the views the collectives send;
a slot keeps the buffers and those views, so a repeated call makes only its
results' views (one C++ call per pack), copies its leaves in and launches.

Only buffers are reused, never the result tensors themselves: a result object
carries state an earlier caller may have left on it (``requires_grad_()``, a shape
changed in place by ``t_()``, autograd's history, the grad mode of its creation),
so every call hands out new views. A kept buffer is reused only when nothing
outside the slot holds it: its storage's owners (any view of it still alive, a
result held as a parameter's ``.grad``, a ``detach()``, a numpy array, autograd's
saved tensors, a storage shared with another process), and the Python references,
C++ owners and weak references of the slot's own tensors, must be exactly what they
were when the slot was made, and none of them may have autograd history (a call
copying inputs that require grad, in grad mode, takes new buffers, as every call
did before slots: a kept buffer would chain each call's graph to the last). A
result that is still visible is therefore never overwritten: the call takes the
plan's other kept slot, or new buffers. A mirrored
optimizer's gradients are released by ``zero_grad()`` (``set_to_none``, torch's
default), so its step alternates between at most two slots; with
``set_to_none=False`` they stay the parameters' ``.grad`` until the next step's
results replace them.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence

import torch

from . import packing
from .buffers import OWNERS_KNOWN, default_pool, storage_owners

__all__ = ["CHUNKS", "CHUNK_MIN_BYTES", "KEPT_BYTES", "KEPT_PER_PLAN", "ResultSlot",
           "SlotMaker"]

# A pack of CHUNK_MIN_BYTES or more crosses the workers as CHUNKS collectives of one
# call (measured on 2 workers over loopback Gloo, 16 and 64 MiB: 1.03-1.07x a raw
# in-place all-reduce, against 1.3-1.5x for one copy followed by one collective),
# where that leaves every sum bitwise as one collective makes it (`_plan`'s
# ``exact``).
CHUNKS = 4
CHUNK_MIN_BYTES = 4 << 20
# Slots are kept for calls of at most KEPT_BYTES (larger ones take pooled buffers:
# their Python costs little next to their transfer), KEPT_PER_PLAN per plan.
KEPT_BYTES = 4 << 20
KEPT_PER_PLAN = 2

_Sizes = Sequence[tuple[int, torch.dtype, int, bool]]
# (the part of the buffer a collective sends, the payload range it copies from a flat
# source and that range's view of the buffer; ``None``: the whole payload from leaves)
Part = tuple[torch.Tensor, tuple[int, int], torch.Tensor] | tuple[torch.Tensor, None, None]


class ResultSlot:
    """One call's buffers (see the module's docstring).

    Args:
        sizes: per pack (payload elements, dtype, trailer elements, may be chunked).
        flat: whether each pack's payload is copied from one flat tensor (a local sum,
            or a pack of one leaf) rather than from its leaves.
        device: where the buffers live.
        kept: kept by a plan (its own buffers, compared at each reuse); otherwise
            used once, from the process-wide pool unless ``pooled`` is false (a call
            whose inputs require grad: its buffer takes their autograd history).

    Example:
        >>> slot = ResultSlot([(3, torch.float32, 2, True)], [False], torch.device("cpu"),
        ...                   kept=True)
        >>> payload, shaped = slot.results(0, [torch.zeros(1), torch.zeros(2)])
        >>> [t.shape for t in shaped], slot.free()
        ([torch.Size([1]), torch.Size([2])], False)
        >>> del payload, shaped
        >>> slot.free()
        True
    """

    __slots__ = ("_all", "_baseline", "_sizes", "buffers", "inference", "parts")

    def __init__(self, sizes: _Sizes, flat: Sequence[bool], device: torch.device, *,
                 kept: bool, pooled: bool = True) -> None:
        empty = default_pool().empty if pooled and not kept else torch.empty
        self.inference = torch.is_inference_mode_enabled()
        self._sizes = sizes
        self.buffers = [empty((n + extra,), dtype=dtype, device=device)
                        for n, dtype, extra, _ in sizes]
        # Per pack, its collectives in launch order (the trailer's first, see
        # `CrossWorkerCalls`), each a `Part`. Never handed out.
        self.parts = [_layout(b, s, f) for b, s, f in
                      zip(self.buffers, sizes, flat, strict=True)]
        # Every tensor of the slot, and its baseline owners (see `free`).
        self._all = [*self.buffers, *(t for parts in self.parts for chunk, _, dst in parts
                                      for t in (chunk, dst) if t is not None)]
        self._baseline = self._owners() if kept else None

    def results(self, index: int, like: Sequence[torch.Tensor]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """New views of pack ``index``'s payload: flat, and shaped like ``like``."""
        payload = self.buffers[index][:self._sizes[index][0]]
        return payload, packing.unpack(payload, like)

    def free(self) -> bool:
        """Whether nothing outside the slot holds any of its tensors or their storage,
        and none of them has autograd history (a slot that is not kept: never)."""
        return self._baseline is not None and self._owners() == self._baseline

    def stuck(self) -> bool:
        """Whether the slot can never be free again: a tensor of it has autograd
        history (an in-place op of a result with an input that requires grad), or its
        storage is shared with another process."""
        return any(t.requires_grad for t in self._all) or any(
            b.untyped_storage().is_shared() for b in self.buffers)

    def _owners(self) -> tuple[int, ...]:
        counts: list[int] = []
        for t in self._all:
            counts += (sys.getrefcount(t), t._use_count(),  # type: ignore[attr-defined]
                       weakref.getweakrefcount(t), t.requires_grad)
        for b in self.buffers:
            counts += storage_owners(b)
        return tuple(counts)


class SlotMaker:
    """What a plan's slots are made of: `ResultSlot`'s arguments, the leaves of each
    pack as shapes only (tensors on the meta device: a plan never holds a caller's
    data), the collectives' ``kind``, and whether its slots may be kept (host
    buffers of at most `KEPT_BYTES` in all, on a torch that reports their owners)."""

    __slots__ = ("calls", "device", "flat", "keep", "kind", "leaves", "nbytes", "sizes")

    def __init__(self, sizes: _Sizes, leaves: Sequence[Sequence[torch.Tensor]],
                 flat: Sequence[bool], device: torch.device, kind: str) -> None:
        self.sizes, self.flat, self.device, self.kind = list(sizes), list(flat), device, kind
        self.leaves = [[torch.empty(t.shape, dtype=t.dtype, device="meta") for t in pack]
                       for pack in leaves]
        self.nbytes = sum((n + extra) * dtype.itemsize for n, dtype, extra, _ in sizes)
        self.keep = device.type == "cpu" and self.nbytes <= KEPT_BYTES and OWNERS_KNOWN
        self.calls = 0  # slots asked for without a free kept one (`_slot`)

    def __call__(self, *, kept: bool, pooled: bool = True) -> ResultSlot:
        return ResultSlot(self.sizes, self.flat, self.device, kept=kept, pooled=pooled)


def _layout(buffer: torch.Tensor, size: tuple[int, torch.dtype, int, bool], flat: bool
            ) -> list[Part]:
    """A pack's collectives (see `ResultSlot.parts`): copied from its leaves, one
    collective; from a flat source of `CHUNK_MIN_BYTES` or more that may be
    chunked, `CHUNKS` (copying one part overlaps the transfer of the previous)."""
    n, _, extra, split = size
    if not flat:
        return [(buffer, None, None)]
    parts = CHUNKS if split and n * buffer.element_size() >= CHUNK_MIN_BYTES else 1
    bounds = [n * i // parts for i in range(parts + 1)]
    out: list[Part] = []
    for i in range(parts):
        a, b = bounds[i], bounds[i + 1]
        end = b + extra if i == parts - 1 else b
        out.append((buffer[a:end], (a, b), buffer[a:b]))
    if extra:  # the trailer's part first
        out.insert(0, out.pop())
    return out
