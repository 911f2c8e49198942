"""strategy.gather: uneven along the axis, nests leaf by leaf, errors."""

import pytest
import torch

import mirrored


def test_uneven_along_axis_and_negative_axis(two):
    v = mirrored.PerReplica([torch.arange(6).reshape(2, 3), torch.arange(3).reshape(1, 3)])
    assert torch.equal(two.gather(v, axis=0), torch.cat(v.values, dim=0))
    w = mirrored.PerReplica([torch.ones(2, 1), torch.zeros(2, 3)])
    out = two.gather(w, axis=-1)
    assert out.shape == (2, 4)
    assert torch.equal(out, torch.cat(w.values, dim=1))


def test_empty_component(two):
    v = mirrored.PerReplica([torch.tensor([1.0, 2.0]), torch.zeros(0)])
    assert two.gather(v, axis=0).tolist() == [1.0, 2.0]


def test_nest_gathered_leaf_by_leaf_and_plain_values_unchanged(two):
    plain = torch.tensor([9])
    nest = {"x": mirrored.PerReplica([torch.tensor([0]), torch.tensor([1, 2])]),
            "y": [mirrored.PerReplica([torch.tensor([[1.0]]), torch.tensor([[2.0]])]), plain]}
    out = two.gather(nest, axis=0)
    assert out["x"].tolist() == [0, 1, 2]
    assert out["y"][0].tolist() == [[1.0], [2.0]]
    assert out["y"][1] is plain


def test_mirrored_concatenates_each_copy(two):
    m = mirrored.Mirrored([torch.tensor([5]), torch.tensor([5])])
    assert two.gather(m, axis=0).tolist() == [5, 5]


def test_errors(two):
    with pytest.raises(ValueError, match=r"gather\(axis=0\) needs components that differ only "
                                         r"along axis 0 at value; got replica 0 \(CPU:0\): "
                                         r"float32\[1, 2\]; replica 1 \(CPU:1\): float32\[1, 3\]"):
        two.gather(mirrored.PerReplica([torch.zeros(1, 2), torch.zeros(1, 3)]), axis=0)
    with pytest.raises(ValueError, match=r"gather\(axis=0\) cannot concatenate rank-0 values at "
                                         r"value; give each a dimension first, e.g. x\[None\]"):
        two.gather(mirrored.PerReplica([torch.tensor(1.0), torch.tensor(2.0)]), axis=0)
    with pytest.raises(ValueError, match=r"axis 1 is out of range for rank-1 values"):
        two.gather(mirrored.PerReplica([torch.zeros(1), torch.zeros(2)]), axis=1)
    with pytest.raises(TypeError, match=r"gather: axis must be an int; got NoneType"):
        two.gather(mirrored.PerReplica([torch.zeros(1), torch.zeros(2)]), axis=None)
    with pytest.raises(ValueError, match=r"one dtype at value\[0\]"):
        two.gather([mirrored.PerReplica([torch.zeros(1), torch.zeros(1, dtype=torch.int64)])],
                   axis=0)
    with pytest.raises(ValueError, match="one rank"):
        two.gather(mirrored.PerReplica([torch.zeros(1), torch.zeros(1, 1)]), axis=0)


def test_result_on_current_device(two):
    v = mirrored.PerReplica([torch.zeros(1), torch.zeros(2)])
    with torch.device("meta"):
        assert two.gather(v, axis=0).device == torch.device("meta")
