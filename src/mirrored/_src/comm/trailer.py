"""The call check inside the data: a few elements appended to a pack, combined by the
same all-reduce as the data, that tell whether every worker sent the same numbers.

Each number (the call's 62-bit identity, the predicted next sizes, a "miss" flag) is
cut into chunks of ``c`` bits; a chunk ``v`` travels as two elements whose combined
values show whether every worker's ``v`` was the same, exactly, in the pack's dtype:

- SUM: ``(v, v²)``: every ``v`` is equal iff ``W · Σv² == (Σv)²`` (Cauchy-Schwarz);
- MAX: ``(v, -v)``: equal iff ``max v == -max(-v)`` (that is, ``min v``);
- MIN: ``(v, -v)``: equal iff ``min v == -min(-v)``.

``c`` is chosen so that every sum stays an exactly representable integer in the
dtype (float32: ``W · 2^(2c) <= 2^24``). Packs of other dtypes (half precision,
bool, uint8) or kinds (broadcast) carry no trailer: their call is checked by a
separate header instead.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["FIELDS", "decode", "encode", "length"]

FIELDS = (62, 62, 1)  # identity, predicted next sizes, miss
_EXACT = {torch.float32: 24, torch.float64: 53, torch.int32: 31, torch.int64: 63}


@functools.lru_cache(maxsize=64)
def _bits(kind: str, dtype: torch.dtype, workers: int) -> int:
    exact = _EXACT.get(dtype, 0)
    if kind == "sum":
        return (exact - workers.bit_length()) // 2 - 1
    return exact - 1 if kind in ("min", "max") else 0


def _chunks(bits: int, c: int) -> int:
    return -(-bits // c)


@functools.lru_cache(maxsize=64)
def length(kind: str, dtype: torch.dtype, workers: int) -> int:
    """How many elements the trailer of a pack takes (0: this pack cannot carry one)."""
    c = _bits(kind, dtype, workers)
    if c < 4:
        return 0
    return 2 * sum(_chunks(b, c) for b in FIELDS)


def encode(out: torch.Tensor, kind: str, workers: int, values: tuple[int, ...]) -> None:
    """Writes the trailer of ``values`` (one per field) into ``out`` (its last elements)."""
    c = _bits(kind, out.dtype, workers)
    mask = (1 << c) - 1
    row: list[int] = []
    for bits, value in zip(FIELDS, values, strict=True):
        for k in range(_chunks(bits, c)):
            v = (value >> (k * c)) & mask
            row += (v, v * v) if kind == "sum" else (v, -v)
    if out.device.type == "cpu" and not out.requires_grad:
        out.numpy()[:] = row  # exact small integers; 3x faster than torch.tensor(row)
    else:
        out.copy_(torch.tensor(row, dtype=out.dtype))


def decode(combined: torch.Tensor, kind: str, workers: int
           ) -> tuple[tuple[int | None, ...], bool]:
    """The combined trailer -> (each field's common value, or ``None`` where workers
    differ) and whether every field agreed."""
    c = _bits(kind, combined.dtype, workers)
    flat = [int(x) for x in combined.tolist()]
    out: list[int | None] = []
    at = 0
    for bits in FIELDS:
        value: int | None = 0
        for k in range(_chunks(bits, c)):
            a, b = flat[at], flat[at + 1]
            at += 2
            if kind == "sum":
                equal = workers * b == a * a and a % workers == 0
                v = a // workers
            else:
                equal = a == -b
                v = a
            if not equal:
                value = None
            elif value is not None:
                value |= v << (k * c)
        out.append(value)
    return tuple(out), all(v is not None for v in out)
