"""The exact fingerprints `mirror_optimizer`'s check uses where replicas sit on
different kinds of device (a GPU and the CPU): a GPU's 2-norm of a tensor may differ
in the last bit from the CPU's (another summation order: seen on an H200 with a GPU
and a CPU replica, 1.2255288422471455 against ...453, which stopped training as a
divergence), so there the copies are compared by sums of their bit patterns, which
no order changes, and which any flipped bit moves."""

from __future__ import annotations

import pytest
import torch

from mirrored._src.training.check import bit_patterns, fingerprint

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("check", ["cheap", "full"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_exact_fingerprints_ignore_order_and_see_every_bit(check: str, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(5, 7, generator=g).to(dtype), torch.randn(11, generator=g).to(dtype)]
    slots = 1 if check == "cheap" else 2

    def of(ts: list[torch.Tensor]) -> list[float]:
        out = torch.zeros(len(ts) * slots)
        fingerprint(ts, check, out, exact=True)  # type: ignore[arg-type]
        return out.tolist()

    base = of(tensors)
    perm = torch.randperm(35, generator=g)
    shuffled = [tensors[0].reshape(-1)[perm].reshape(5, 7), tensors[1].flip(0)]
    assert of(shuffled) == base  # any summation order: the same integers
    assert all(v == int(v) and 0 <= v < 2 ** 24 for v in base)  # exact in float32
    bits = tensors[0].element_size() * 8
    for bit in range(bits):  # one flipped bit, anywhere in the element, shows
        flipped = tensors[0].clone()
        view = bit_patterns(flipped).view(-1)
        view[3] ^= (1 << bit) if bit < bits - 1 else -(1 << bit)
        assert of([flipped, tensors[1]])[0] != base[0], bit
