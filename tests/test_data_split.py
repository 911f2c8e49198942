"""The split rule of SPEC §9 (`mirrored._src.data.split`), against a NumPy reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mirrored._src.data.split import chunk_bounds, empty_like, flatten_batch, split_batch


def reference_split(rows: np.ndarray, n: int) -> list[np.ndarray]:
    """Row ``r`` of a ``b``-row batch belongs to replica ``r // ceil(b / n)``."""
    b = rows.shape[0]
    if b == 0:
        return [rows[:0] for _ in range(n)]
    owner = np.arange(b) // int(np.ceil(b / n))
    return [rows[owner == i] for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("b", list(range(0, 11)))
def test_split_matches_reference(n: int, b: int) -> None:
    rows = np.arange(b * 3, dtype=np.float32).reshape(b, 3)
    got = split_batch(torch.from_numpy(rows), n)
    want = reference_split(rows, n)
    assert len(got) == n
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == (w.shape[0], 3), f"replica {i}"
        np.testing.assert_array_equal(g.numpy(), w)
        start, stop = chunk_bounds(b, n, i)
        np.testing.assert_array_equal(rows[start:stop], w)


@pytest.mark.parametrize(("b", "n", "sizes"), [
    (8, 2, [4, 4]), (5, 2, [3, 2]), (6, 4, [2, 2, 2, 0]), (1, 3, [1, 0, 0]), (7, 3, [3, 3, 1]),
])
def test_spec_examples(b: int, n: int, sizes: list[int]) -> None:
    chunks = split_batch(torch.arange(b), n)
    assert [c.shape[0] for c in chunks] == sizes
    assert torch.equal(torch.cat(chunks), torch.arange(b))
    assert [chunk_bounds(b, n, i)[1] - chunk_bounds(b, n, i)[0] for i in range(n)] == sizes


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("global_batch", [1, 3, 4, 8])
@pytest.mark.parametrize("size", [1, 7, 13, 16])
def test_data_set_ending_in_partial_batch(n: int, global_batch: int, size: int) -> None:
    data = np.arange(size, dtype=np.int64) * 10
    batches = [data[s:s + global_batch] for s in range(0, size, global_batch)]
    seen = []
    for batch in batches:
        got = split_batch(batch, n)  # NumPy batches are converted
        for g, w in zip(got, reference_split(batch, n), strict=True):
            assert isinstance(g, torch.Tensor)
            np.testing.assert_array_equal(g.numpy(), w)
            seen.extend(g.tolist())
    assert seen == data.tolist()


def test_replica_ids_pick_global_chunks() -> None:
    batch = torch.arange(14).reshape(7, 2)
    full = split_batch(batch, 4)
    picked = split_batch(batch, 4, replica_ids=[2, 3])
    assert len(picked) == 2
    assert torch.equal(picked[0], full[2]) and torch.equal(picked[1], full[3])
    assert picked[1].shape == (1, 2)


@settings(max_examples=60, deadline=None)
@given(b=st.integers(0, 40), n=st.integers(1, 9), trailing=st.lists(st.integers(0, 3), max_size=2),
       dtype=st.sampled_from([torch.float32, torch.int64, torch.bool, torch.float16]))
def test_split_properties(b: int, n: int, trailing: list[int], dtype: torch.dtype) -> None:
    batch = (torch.arange(b * int(np.prod(trailing, dtype=np.int64))) % 3).to(dtype)
    batch = batch.reshape(b, *trailing)
    chunks = split_batch(batch, n)
    c = -(-b // n)
    sizes = [chunk.shape[0] for chunk in chunks]
    assert sizes == [max(0, min(c, b - i * c)) for i in range(n)]
    assert all(chunk.shape[1:] == batch.shape[1:] and chunk.dtype == dtype for chunk in chunks)
    assert torch.equal(torch.cat(chunks), batch)
    for i, chunk in enumerate(chunks):
        np.testing.assert_array_equal(chunk.numpy(), reference_split(batch.numpy(), n)[i])


def test_dict_and_nested_batches() -> None:
    batch = {"x": torch.arange(10).reshape(5, 2), "y": (np.arange(5), torch.ones(5, 1, 3))}
    got = split_batch(batch, 2)
    for i, part in enumerate(got):
        assert set(part) == {"x", "y"} and isinstance(part["y"], tuple)
        rows = reference_split(np.arange(5), 2)[i]
        np.testing.assert_array_equal(part["x"].numpy(), np.arange(10).reshape(5, 2)[rows])
        np.testing.assert_array_equal(part["y"][0].numpy(), rows)
        assert part["y"][1].shape == (len(rows), 1, 3)


def test_chunks_are_views() -> None:
    batch = torch.arange(8.0)
    chunks = split_batch(batch, 2)
    assert chunks[1].data_ptr() == batch.data_ptr() + 4 * batch.element_size()


def test_empty_like_keeps_dtype_device_and_trailing_shape() -> None:
    e = empty_like(torch.ones(3, 4, 5, dtype=torch.float64))
    assert e.shape == (0, 4, 5) and e.dtype == torch.float64 and e.device.type == "cpu"


def test_scalar_leaf_raises_naming_path_and_shape() -> None:
    with pytest.raises(ValueError, match=r"batch has a scalar \(shape \[\]\) "
                                         r"\(shapes: batch: \[\]\)\. Batch the dataset"):
        split_batch(torch.tensor(3.0), 2)
    with pytest.raises(ValueError, match=r"batch\['label'\] has a scalar \(shape \[\]\).*"
                                         r"batch\['label'\]: \[\]; batch\['x'\]: \[4, 2\]"):
        split_batch({"x": torch.zeros(4, 2), "label": 7}, 2)


def test_leaves_disagreeing_on_batch_dim_raise_naming_path_and_shapes() -> None:
    batch = {"a": [torch.zeros(4, 2), torch.zeros(5)], "b": torch.zeros(4)}
    with pytest.raises(ValueError, match=r"batch\['a'\]\[1\] has batch dim 5, not 4 "
                                         r"\(shapes: batch\['a'\]\[0\]: \[4, 2\]; "
                                         r"batch\['a'\]\[1\]: \[5\]; batch\['b'\]: \[4\]\)"):
        split_batch(batch, 2)
    with pytest.raises(ValueError, match="dataset element 3 needs one leading batch dim"):
        flatten_batch((torch.zeros(2), torch.zeros(3)), "dataset element 3")


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="has no tensors; expected a tensor or a nest"):
        split_batch({}, 2)
    with pytest.raises(TypeError, match=r"got str at batch\['name'\]"):
        split_batch({"name": "abc", "x": torch.zeros(2)}, 2)
    with pytest.raises(ValueError, match=r"replica ids must be ints in 0..1; got 2 in \[0, 2\]"):
        split_batch(torch.zeros(4), 2, replica_ids=[0, 2])
    with pytest.raises(ValueError, match="num_replicas_in_sync must be an int >= 1; got 0"):
        split_batch(torch.zeros(4), 0)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), workers=st.integers(1, 3), local=st.integers(1, 2),
       worker=st.integers(0, 2))
def test_tuple_steps_equal_the_pytree_path(rows: int, workers: int, local: int,
                                           worker: int) -> None:
    # (x, y) takes the tuple path; the same leaves as a list take the pytree path:
    # the same chunks, devices and example counts.
    from mirrored._src.data.steps import global_batch_steps
    from mirrored._src.devices import parse_devices
    from mirrored._src.topology import Topology

    worker %= workers
    topology = Topology(devices=parse_devices([f"CPU:{i}" for i in range(local)]),
                        worker_index=worker, num_workers=workers)
    g = torch.Generator().manual_seed(rows)
    batch = (torch.randn(rows, 3, generator=g), torch.randint(0, 5, (rows,), generator=g))
    [as_tuple] = global_batch_steps([batch], topology, fetch=False, tag=workers > 1)
    [as_list] = global_batch_steps([list(batch)], topology, fetch=False, tag=workers > 1)
    assert type(as_tuple) is tuple and type(as_list) is list
    if topology.num_replicas_in_sync == 1:
        assert as_tuple is batch
        return
    for ours, theirs in zip(as_tuple, as_list, strict=True):
        assert ours.devices == theirs.devices
        assert all(torch.equal(a, b) for a, b in zip(ours.values, theirs.values, strict=True))
        assert getattr(ours, "_examples", None) == getattr(theirs, "_examples", None)
    with pytest.raises(ValueError, match=r"batch\[1\] has batch dim 2, not"):
        list(global_batch_steps([(torch.zeros(rows + 2), torch.zeros(2))], topology,
                                fetch=False))
