"""strategy.reduce: SPEC section 5, row by row, plus errors and dtypes."""

import math

import numpy as np
import pytest
import torch

import mirrored


def pr(*values):
    return mirrored.PerReplica([torch.as_tensor(v) for v in values])


@pytest.mark.parametrize(
    ("components", "op", "axis", "expected"),
    [
        ((0, 1), "SUM", None, torch.tensor(1)),
        ((0.0, 1.0), "MEAN", None, torch.tensor(0.5)),
        (([0, 1, 2, 3], [4, 5, 6, 7]), "SUM", None, torch.tensor([4, 6, 8, 10])),
        (([0, 1, 2, 3], [4, 5, 6, 7]), "SUM", 0, torch.tensor(28)),
        (([0.0, 1, 2, 3], [4.0, 5]), "MEAN", 0, torch.tensor(2.5)),
        (([[1.0, 2], [3, 4]], [[5.0, 6]]), "MEAN", 0, torch.tensor([3.0, 4.0])),
        (([[1.0, 2], [3, 4]], [[5.0, 6]]), "MEAN", (0, 1), torch.tensor(3.5)),
        (([[1.0, 2], [3, 4]], [[5.0, 6]]), "MEAN", [0, -1], torch.tensor(3.5)),
        (([1.0, 2, 3], []), "MEAN", 0, torch.tensor(2.0)),
        (([[1.0, 2], [3, 4]], [[5.0, 6]]), "MIN", 0, torch.tensor([1.0, 2.0])),
        (([[1.0, 2], [3, 4]], [[5.0, 6]]), "MAX", -2, torch.tensor([5.0, 6.0])),
        (([1, 7], [3, 2]), "MIN", None, torch.tensor([1, 2])),
        (([1, 7], [3, 2]), "max", None, torch.tensor([3, 7])),
        (([1.0, 2], [3.0, 4]), "SUM", (), torch.tensor([4.0, 6.0])),
        (([1.0, 2], [3.0, 4]), "MEAN", (), torch.tensor([2.0, 3.0])),
        (([[1.0, 2]], [[3.0, 4]]), "SUM", -1, torch.tensor([10.0])),
    ],
)
def test_spec_examples(two, components, op, axis, expected):
    out = two.reduce(op, pr(*components), axis=axis)
    assert out.dtype == expected.dtype
    assert out.device == torch.device("cpu")
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_all_empty_mean_is_nan(two):
    out = two.reduce("MEAN", pr(torch.zeros(0), torch.zeros(0)), axis=0)
    assert out.shape == () and math.isnan(out.item())


@pytest.mark.parametrize("op", ["MIN", "MAX"])
def test_min_max_skip_empty_components_and_reject_all_empty(two, op):
    out = two.reduce(op, pr([3.0, -1.0], torch.zeros(0)), axis=0)
    assert out.item() == (-1.0 if op == "MIN" else 3.0)
    with pytest.raises(ValueError, match=rf"reduce\({op}, axis=0\) has no elements to reduce at "
                                         r"value: every replica's value is empty"):
        two.reduce(op, pr(torch.zeros(0), torch.zeros(0)), axis=0)


def test_uneven_shapes_without_axis(two):
    with pytest.raises(ValueError, match=r"reduce\(MEAN, axis=None\) needs components of one "
                                         r"shape at value; got replica 0 \(CPU:0\): float32\[4\]; "
                                         r"replica 1 \(CPU:1\): float32\[2\]\. .*axis=0"):
        two.reduce("MEAN", pr([0.0, 1, 2, 3], [4.0, 5]), axis=None)


def test_mismatched_dtypes_and_ranks(two):
    with pytest.raises(ValueError, match=r"needs components of one dtype at value; got replica 0 "
                                         r"\(CPU:0\): float32\[2\]; replica 1 \(CPU:1\): "
                                         r"int64\[2\]"):
        two.reduce("SUM", pr([1.0, 2.0], [1, 2]))
    with pytest.raises(ValueError, match=r"needs components of one rank"):
        two.reduce("SUM", pr([[1.0]], [1.0]), axis=0)
    with pytest.raises(ValueError, match=r"differ only along axis 0 at value; got replica 0 "
                                         r"\(CPU:0\): float32\[1, 2\]; replica 1 \(CPU:1\): "
                                         r"float32\[1, 3\]"):
        two.reduce("SUM", pr([[1.0, 2]], [[1.0, 2, 3]]), axis=0)


def test_axis_errors(two):
    v = pr([[1.0, 2]], [[3.0, 4]])
    with pytest.raises(ValueError, match=r"axis 2 is out of range for rank-2 values at value "
                                         r"\(valid axes are -2\.\.1\)"):
        two.reduce("SUM", v, axis=2)
    with pytest.raises(ValueError, match=r"axis -3 is out of range for rank-2"):
        two.reduce("SUM", v, axis=(0, -3))
    with pytest.raises(ValueError, match=r"names the same dimension twice"):
        two.reduce("SUM", v, axis=(1, -1))
    with pytest.raises(ValueError, match=r"rank-0 values at value have no axis "
                                         r"0; use axis=None"):
        two.reduce("SUM", pr(1.0, 2.0), axis=0)
    with pytest.raises(TypeError, match=r"axis must be None, an int or a tuple of ints; got str"):
        two.reduce("SUM", v, axis="0")
    with pytest.raises(TypeError, match=r"axis must be None, an int .*got bool"):
        two.reduce("SUM", v, axis=True)
    with pytest.raises(TypeError, match=r"axis must be None, an int or a tuple of ints; "
                                        r"got float 0.0"):
        two.reduce("SUM", v, axis=(0.0,))


def test_rank0_with_empty_axis_counts_one(two):
    assert two.reduce("MEAN", pr(1.0, 2.0), axis=()).item() == 1.5


def test_reduce_op_spellings_and_errors(two):
    v = pr(1.0, 3.0)
    for op in ["sum", "Sum", "SUM", mirrored.ReduceOp.SUM]:
        assert two.reduce(op, v).item() == 4.0
    with pytest.raises(ValueError, match=r"^'MAXX' is not a valid ReduceOp; use one of SUM, "
                                         r"MEAN, MIN, MAX$"):
        two.reduce("MAXX", v)
    with pytest.raises(TypeError, match=r"reduce_op must be a mirrored.ReduceOp .*got int 1"):
        two.reduce(1, v)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(torch.int32, torch.float64), (torch.int64, torch.float64), (torch.int8, torch.float32),
     (torch.uint8, torch.float32), (torch.int16, torch.float32), (torch.float16, torch.float16),
     (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
     (torch.float64, torch.float64)],
)
def test_mean_promotion(two, dtype, expected):
    v = pr(torch.tensor([1, 2], dtype=dtype), torch.tensor([2, 4], dtype=dtype))
    out = two.reduce("MEAN", v)
    assert out.dtype == expected
    torch.testing.assert_close(out, torch.tensor([1.5, 3.0], dtype=expected))
    with_axis = two.reduce("MEAN", v, axis=0)
    assert with_axis.dtype == expected
    assert with_axis.item() == 2.25
    for op in ["SUM", "MIN", "MAX"]:
        assert two.reduce(op, v).dtype == dtype
        assert two.reduce(op, v, axis=0).dtype == dtype


def test_single_replica_mean_of_integers_promotes():
    # SPEC section 13: MEAN of a per-replica integer value promotes whatever the
    # replica count. With one replica, run and experimental_distribute_values_from_function
    # return plain values, and they are that replica's values.
    one = mirrored.MirroredStrategy(["CPU:0"])
    from_run = one.run(lambda: torch.tensor([3, 4], dtype=torch.int32))
    from_fn = one.experimental_distribute_values_from_function(lambda ctx: torch.tensor(3))
    cases = [(from_run, [3.0, 4.0]), (from_fn, 3.0), (mirrored.PerReplica([from_run]), [3.0, 4.0]),
             (mirrored.Mirrored([from_run]), [3.0, 4.0])]
    for value, expected in cases:
        out = one.reduce("MEAN", value)
        assert out.dtype == torch.float64
        assert out.tolist() == expected
    assert one.reduce("SUM", from_run) is not from_run  # a copy, never an alias
    # The default strategy returns a plain value as it is (SPEC section 2).
    plain = torch.tensor([3, 4], dtype=torch.int32)
    assert mirrored.get_strategy().reduce("MEAN", plain) is plain


def test_bool_rejected(two):
    v = pr(torch.tensor([True]), torch.tensor([False]))
    for op in ["SUM", "MEAN", "MIN", "MAX"]:
        with pytest.raises(TypeError, match=r"cannot reduce bool tensors \(at value\); cast"):
            two.reduce(op, v)
    with pytest.raises(TypeError, match="cannot reduce bool"):
        two.reduce("MEAN", torch.tensor([True]))


def test_complex_min_rejected_sum_ok(two):
    v = pr(torch.tensor([1 + 1j]), torch.tensor([2 - 1j]))
    assert two.reduce("SUM", v).item() == 3 + 0j
    with pytest.raises(TypeError, match="is not defined for complex dtype"):
        two.reduce("MIN", v)


def test_non_distributed_values(two):
    x = torch.tensor([3.0, 4.0])
    for op in ["MEAN", "MIN", "MAX"]:
        assert two.reduce(op, x) is x
    assert torch.equal(two.reduce("MEAN", np.array([1, 2])), torch.tensor([1, 2]))
    assert two.reduce("MAX", 5).item() == 5
    with pytest.raises(ValueError, match=r"reduce\(SUM, axis=None\) got a value that is not "
                                         r"per-replica at "
                                         r"value \(Tensor\); a value that is not per-replica "
                                         r"cannot be summed across 2 replicas; wrap it with "
                                         r"experimental_distribute_values_from_function or run"):
        two.reduce("SUM", x)
    # with an axis a plain value counts as given to every replica
    assert two.reduce("SUM", x, axis=0).item() == 14.0
    assert two.reduce("MEAN", x, axis=0).item() == 3.5
    assert two.reduce("MIN", x, axis=0).item() == 3.0


def test_mirrored_values(two):
    m = mirrored.Mirrored([torch.tensor([3.0, 4.0]), torch.tensor([3.0, 4.0])])
    assert torch.equal(two.reduce("MEAN", m), torch.tensor([3.0, 4.0]))
    assert torch.equal(two.reduce("MAX", m), torch.tensor([3.0, 4.0]))
    assert two.reduce("SUM", m, axis=0).item() == 14.0
    with pytest.raises(ValueError, match="not per-replica cannot be summed across 2 replicas"):
        two.reduce("SUM", m)


def test_nests_with_and_without_axis(two):
    a = pr([1.0, 2.0], [3.0])
    b = pr(torch.tensor([[1, 2]]), torch.tensor([[3, 4], [5, 6]]))
    nest = {"loss": a, "more": [b, torch.tensor([7.0])]}
    out = two.reduce("MEAN", nest, axis=0)
    assert out["loss"].item() == 2.0
    torch.testing.assert_close(out["more"][0], torch.tensor([3.0, 4.0], dtype=torch.float64))
    assert out["more"][1].item() == 7.0
    same = two.reduce("SUM", {"x": pr(1, 2), "y": (pr(3.0, 4.0),)})
    assert same["x"].item() == 3 and same["y"][0].item() == 7.0
    with pytest.raises(ValueError, match=r"one shape at value\['loss'\]"):
        two.reduce("MEAN", nest)


def test_bad_leaf_type(two):
    with pytest.raises(TypeError, match=r"reduce expects tensors, Python numbers or NumPy arrays; "
                                        r"got str at value\[0\]"):
        two.reduce("MEAN", ["text"])


def test_result_goes_to_the_current_device(two):
    v = pr([1.0, 2.0], [3.0, 4.0])
    with torch.device("meta"):
        out = two.reduce("SUM", v)
    assert out.device == torch.device("meta")
    assert two.reduce("SUM", v).device == torch.device("cpu")


def test_result_never_aliases_an_input(two):
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    one = mirrored.MirroredStrategy(["CPU:0"])
    out = one.reduce("SUM", mirrored.PerReplica([a]))
    out += 100
    assert a.tolist() == [1.0, 2.0]
    out = two.reduce("MEAN", mirrored.PerReplica([a, b]), axis=())
    out += 100
    assert a.tolist() == [1.0, 2.0] and b.tolist() == [3.0, 4.0]


def test_large_sums_match_sequential_reference():
    # Large (pooled) results on 3 replicas: bitwise equal to adding in replica order.
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(700_001, generator=gen) for _ in range(3)]
    expected = (parts[0] + parts[1]) + parts[2]
    out = strategy.reduce("SUM", mirrored.PerReplica(parts))
    assert torch.equal(out, expected)
    mean = strategy.reduce("MEAN", mirrored.PerReplica(parts))
    assert torch.equal(mean, expected / 3)
    two_mean = mirrored.MirroredStrategy(["CPU:0", "CPU:1"]).reduce(
        "MEAN", mirrored.PerReplica(parts[:2]))
    assert torch.equal(two_mean, (parts[0] + parts[1]) / 2)
