"""Fusion: many tensors of one dtype and device travel as few flat buffers.

`plan` groups leaf indices into packs of at most ``bytes_per_pack`` bytes (a
larger leaf is a pack of its own; ``0`` means one pack per dtype and device),
keeping the leaves' order inside each pack. `pack` flattens a pack into one 1-D
buffer (a one-leaf pack is a view, no copy); `unpack` splits a reduced buffer
back into views shaped like the leaves.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

__all__ = ["pack", "plan", "unpack"]


def plan(nbytes: Sequence[int], keys: Sequence[Hashable], bytes_per_pack: int
         ) -> list[list[int]]:
    """Groups leaf indices into packs.

    Args:
        nbytes: the size of each leaf in bytes.
        keys: leaves with different keys (dtype, device) never share a pack.
        bytes_per_pack: the most bytes a pack of several leaves may hold; 0 = no limit.

    Returns:
        Lists of leaf indices, in the order their first leaf appears.

    Example:
        >>> plan([4, 4, 8, 4], ["f", "f", "f", "i"], bytes_per_pack=8)
        [[0, 1], [2], [3]]
    """
    if len(set(keys)) <= 1 and (bytes_per_pack == 0 or sum(nbytes) <= bytes_per_pack):
        return [list(range(len(nbytes)))] if nbytes else []  # the common case: one pack
    open_packs: dict[Hashable, list[int]] = {}
    open_bytes: dict[Hashable, int] = {}
    packs: list[list[int]] = []
    for index, (size, key) in enumerate(zip(nbytes, keys, strict=True)):
        current = open_packs.get(key)
        if current is not None and (bytes_per_pack == 0
                                    or open_bytes[key] + size <= bytes_per_pack):
            current.append(index)
            open_bytes[key] += size
            continue
        current = [index]
        packs.append(current)
        open_packs[key] = current
        open_bytes[key] = size
    return packs


# torch's C++ helpers (what DistributedDataParallel buckets with) are 3x faster than
# cat/split from Python on many small tensors; plain ops are the fallback.
_flatten = getattr(torch._C._nn, "flatten_dense_tensors", None)
_unflatten = getattr(torch._C._nn, "unflatten_dense_tensors", None)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1-D buffer holding ``tensors`` one after another (a view for one tensor)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    if _flatten is not None:
        return _flatten(list(tensors))  # type: ignore[no-any-return]
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like the tensors of ``like``, in order."""
    if len(like) == 1:
        return [flat.view(like[0].shape)]
    if _unflatten is not None:
        return list(_unflatten(flat, list(like)))
    sizes = [t.numel() for t in like]
    return [part.view(t.shape) for part, t in zip(torch.split(flat, sizes), like, strict=True)]
