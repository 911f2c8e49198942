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


def test_the_watch_compares_norms_by_their_bits() -> None:
    """The gradient watch's comparison of the norms at backward's end and at the step
    (a change through ``p.grad.data``): equal values are unchanged, a NaN norm (an inf
    gradient a GradScaler skips) equals itself, any other difference is a change, per
    tensor, also across dtypes (stacked in the widest)."""
    from mirrored._src.training.gradient_watch import _changed, _norms

    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g).double(), None]
    then = _norms(grads)
    assert then is not None and len(then) == 2
    assert _changed(_norms(grads), then) == [False, False]  # type: ignore[arg-type]
    clamped = [grads[0].clamp(-0.1, 0.1), grads[1]]
    assert _changed(_norms(clamped), then) == [True, False]  # type: ignore[arg-type]
    nan = [torch.full((3,), float("nan")), torch.ones(2)]
    assert _changed(_norms(nan), _norms(nan)) == [False, False]  # type: ignore[arg-type]
    assert _changed(_norms(nan), _norms([nan[0], torch.zeros(2)])) == [  # type: ignore[arg-type]
        False, True]


def test_equal_rows_sends_nan_and_differences_to_the_bitwise_compare() -> None:
    """The reducer skips `compare` only when every replica's fingerprint row holds the
    same values; `compare` then raises for a real difference and passes NaN rows."""
    from mirrored._src.errors import ReplicaDivergenceError
    from mirrored._src.training.check import compare, equal_rows

    values = [1.0, 0.0, 2.5, 7.0, 2.5, 7.0, 3.0]  # a flag, 2 rows of 2, a divisor
    assert equal_rows(values, 2, 2, 2)
    assert not equal_rows([1.0, 0.0, 2.5, 7.0, 2.5, 7.5], 2, 2, 2)
    nan = [float("nan"), 1.0, float("nan"), 1.0]
    assert not equal_rows(nan, 0, 2, 2)
    compare(torch.tensor(nan).view(2, 2), ["a", "b"], step=1)  # NaN equals itself: no raise
    with pytest.raises(ReplicaDivergenceError, match="'b' on replica"):
        compare(torch.tensor([2.5, 7.0, 2.5, 7.5]).view(2, 2), ["a", "b"], step=1)
