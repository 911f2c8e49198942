"""Values the collectives cannot combine get the library's own error, naming what was
got and where, instead of a torch kernel's (a review found sparse, quantized and meta
tensors, complex32 over an axis and a missing CUDA destination failing deep inside
torch with NotImplementedError, RuntimeError or AssertionError)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import mirrored

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental"),
              pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*deprecated")]


@pytest.fixture(scope="module")
def strategy() -> mirrored.MirroredStrategy:
    return mirrored.MirroredStrategy(["CPU:0", "CPU:1"])


def _two(t: torch.Tensor) -> mirrored.PerReplica:
    return mirrored.PerReplica([t, t.clone()])


CASES = [
    ("sparse reduce", lambda s: s.reduce("SUM", _two(torch.eye(3).to_sparse()), None),
     r"reduce\(SUM, axis=None\) takes dense \(strided\) tensors; got a torch.sparse_coo "
     r"tensor at value"),
    ("sparse all_reduce", lambda s: s.run(lambda: mirrored.get_replica_context().all_reduce(
        "SUM", {"w": torch.eye(3).to_sparse()})), r"dense \(strided\).*at value\['w'\]"),
    ("sparse all_gather", lambda s: s.run(lambda: mirrored.get_replica_context().all_gather(
        torch.eye(3).to_sparse(), 0)), r"all_gather.*dense \(strided\)"),
    ("meta", lambda s: s.reduce("SUM", _two(torch.ones(3, device="meta")), None),
     "got meta tensors"),
    ("quantized", lambda s: s.reduce("SUM", _two(torch.quantize_per_tensor(
        torch.ones(3), 0.1, 0, torch.quint8)), None), r"dtype quint8.*dequantize\(\)"),
    ("complex32 over an axis", lambda s: s.reduce("MEAN", _two(torch.ones(
        3, dtype=torch.complex32)), 0), r"over an axis does not support complex32"),
    ("missing CUDA destination", lambda s: s.extended.reduce_to(
        "SUM", _two(torch.ones(2)), "GPU:7"), r"names GPU:7 .*CUDA device"),
]


@pytest.mark.parametrize(("name", "call", "match"), CASES, ids=[c[0] for c in CASES])
def test_unsupported_values_get_a_clear_error(strategy: mirrored.MirroredStrategy, name: str,
                                              call: Callable[[Any], Any], match: str) -> None:
    if name == "missing CUDA destination" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a GPU:7")
    with pytest.raises((TypeError, ValueError), match=match):
        call(strategy)
    # the strategy stays usable, and complex32 without an axis still combines
    v = mirrored.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    assert strategy.reduce("SUM", v, None).tolist() == [4.0, 6.0]
    c = torch.tensor([1 + 2j], dtype=torch.complex64).to(torch.complex32)
    assert strategy.reduce("SUM", _two(c), None).to(torch.complex64).tolist() == [2 + 4j]
