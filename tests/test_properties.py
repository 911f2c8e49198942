"""reduce and gather against NumPy on random inputs: 1-8 replicas, shapes (empty
included), dtypes, ops, axes (negative and tuples) and nests."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mirrored

DTYPES = [np.float32, np.float64, np.int32, np.int64, np.int8, np.uint8, np.int16]
OPS = ["SUM", "MEAN", "MIN", "MAX"]


def mean_dtype(dtype):
    if np.issubdtype(dtype, np.floating):
        return dtype
    return np.float32 if dtype in (np.int8, np.uint8, np.int16) else np.float64


def random_array(rng, shape, dtype, small=False):
    if np.issubdtype(dtype, np.floating):
        return rng.standard_normal(shape).astype(dtype)
    if small:
        low = 0 if dtype == np.uint8 else -5
        return rng.integers(low, 6, size=shape).astype(dtype)
    # The full range of narrow integers, so sums overflow: SUM must wrap like the
    # dtype does, MEAN must not (it sums exactly before dividing).
    info = np.iinfo(dtype)
    low, high = max(info.min, -(10**6)), min(info.max, 10**6)
    return rng.integers(low, high, size=shape, endpoint=True).astype(dtype)


@st.composite
def reduce_cases(draw):
    n = draw(st.integers(1, 8))
    rank = draw(st.integers(0, 3))
    dtype = draw(st.sampled_from(DTYPES))
    op = draw(st.sampled_from(OPS))
    base = draw(st.lists(st.integers(0, 4), min_size=rank, max_size=rank))
    kind = draw(st.sampled_from(["none", "int", "tuple"] if rank else ["none", "empty"]))
    if kind == "none":
        axis = None
    elif kind == "empty":
        axis = ()
    elif kind == "int":
        axis = draw(st.integers(-rank, rank - 1))
    else:
        dims = draw(st.lists(st.integers(0, rank - 1), min_size=0, max_size=rank, unique=True))
        axis = tuple(d - rank if draw(st.booleans()) else d for d in dims)
    dims = () if axis is None else tuple(a % rank for a in ((axis,) if isinstance(axis, int)
                                                              else axis))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    all_empty = draw(st.integers(0, 7)) == 0  # every replica empty along the axis
    components = []
    for _ in range(n):
        shape = [(0 if all_empty else draw(st.integers(0, 4))) if d in dims else s
                 for d, s in enumerate(base)]
        components.append(random_array(rng, shape, dtype))
    return n, op, axis, dims, components


def numpy_reduce(op, axis, dims, components):
    """The reference: returns an array, or the string "ValueError".

    SUM wraps in the input dtype; MEAN is the exact sum (int64 for integers) divided
    in the promoted dtype."""
    n = len(components)
    dtype = components[0].dtype.type
    exact = dtype if np.issubdtype(dtype, np.floating) or op == "SUM" else np.int64
    if axis is None:
        if op in ("SUM", "MEAN"):
            with np.errstate(over="ignore"):
                total = np.asarray(functools.reduce(
                    np.add, [c.astype(exact) for c in components]), dtype=exact)
            if op == "SUM":
                return total
            return np.asarray(total.astype(mean_dtype(dtype)) / n)
        fn = np.minimum if op == "MIN" else np.maximum
        return functools.reduce(fn, components)
    counts = [math.prod(c.shape[d] for d in dims) for c in components]
    if op in ("SUM", "MEAN"):
        with np.errstate(over="ignore"):
            partials = [c.sum(axis=dims, dtype=exact) if dims else c.astype(exact)
                        for c in components]
            total = np.asarray(functools.reduce(np.add, partials), dtype=exact)
        if op == "SUM":
            return total
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.asarray(total.astype(mean_dtype(dtype)) / sum(counts))
    partials = [(c.min(axis=dims) if op == "MIN" else c.max(axis=dims)) if dims else c
                for c, k in zip(components, counts, strict=True) if k > 0]
    if not partials:
        return "ValueError"
    fn = np.minimum if op == "MIN" else np.maximum
    return np.asarray(functools.reduce(fn, partials))


@settings(max_examples=300, deadline=None)
@given(reduce_cases())
def test_reduce_matches_numpy(strategies, case):
    n, op, axis, dims, components = case
    strategy = strategies[n]
    value = mirrored.PerReplica([torch.from_numpy(c) for c in components])
    expected = numpy_reduce(op, axis, dims, components)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match="has no elements to reduce"):
            strategy.reduce(op, value, axis=axis)
        return
    out = strategy.reduce(op, value, axis=axis)
    assert out.dtype == torch.from_numpy(np.asarray(expected)).dtype
    exact = axis is None or op in ("MIN", "MAX") or not np.issubdtype(expected.dtype,
                                                                       np.floating)
    if np.issubdtype(components[0].dtype, np.floating) and op == "MEAN" and axis is not None:
        exact = False
    np.testing.assert_allclose(out.numpy(), expected, rtol=0 if exact else 1e-5,
                               atol=0 if exact else 1e-5, equal_nan=True)


@st.composite
def gather_cases(draw):
    n = draw(st.integers(1, 8))
    rank = draw(st.integers(1, 3))
    axis = draw(st.integers(-rank, rank - 1))
    dtype = draw(st.sampled_from([*DTYPES, np.bool_]))
    base = draw(st.lists(st.integers(0, 3), min_size=rank, max_size=rank))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    components = []
    for _ in range(n):
        shape = list(base)
        shape[axis] = draw(st.integers(0, 4))
        components.append(random_array(rng, shape, np.int8, small=True).astype(dtype))
    return n, axis, components


@settings(max_examples=200, deadline=None)
@given(gather_cases())
def test_gather_matches_numpy(strategies, case):
    n, axis, components = case
    value = mirrored.PerReplica([torch.from_numpy(c) for c in components])
    out = strategies[n].gather(value, axis=axis)
    np.testing.assert_array_equal(out.numpy(), np.concatenate(components, axis=axis))


@settings(max_examples=60, deadline=None)
@given(reduce_cases())
def test_nests_reduce_leaf_by_leaf(strategies, case):
    n, op, axis, dims, components = case
    strategy = strategies[n]
    if isinstance(numpy_reduce(op, axis, dims, components), str):
        return
    leaf = mirrored.PerReplica([torch.from_numpy(c) for c in components])
    doubled = mirrored.PerReplica([torch.from_numpy(c) * 2 for c in components])
    nest = {"a": leaf, "b": [doubled, (leaf,)]}
    out = strategy.reduce(op, nest, axis=axis)
    for got, alone in [(out["a"], leaf), (out["b"][0], doubled), (out["b"][1][0], leaf)]:
        torch.testing.assert_close(got, strategy.reduce(op, alone, axis=axis), equal_nan=True,
                                   rtol=0, atol=0)
