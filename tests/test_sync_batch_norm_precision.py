"""Sync BatchNorm's statistics stay exact when a channel's mean is large next to its
standard deviation (raw features such as a year or a timestamp fed to an
input-normalizing BatchNorm): float32 replicas match torch's BatchNorm over the
global batch, as float64 ones do to rounding. The variance is not taken as
``E[x^2] - mean^2`` in the input's dtype, which cancelled catastrophically there."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import mirrored

pytestmark = pytest.mark.timeout(60)

CENTERS = [1e2, 2e3, 1e4]
STD = 0.5  # of each channel
SPLITS = [pytest.param([5, 3], id="5/3"), pytest.param([5, 0, 3], id="5/0/3"),
          pytest.param([2, 3, 3], id="2/3/3")]
KINDS = [pytest.param((nn.BatchNorm1d, ()), id="1d-NC"),
         pytest.param((nn.BatchNorm1d, (4,)), id="1d-NCL"),
         pytest.param((nn.BatchNorm2d, (3, 2)), id="2d")]


@pytest.fixture(scope="module")
def strategies() -> Iterator[dict[int, mirrored.MirroredStrategy]]:
    made = {n: mirrored.MirroredStrategy([f"CPU:{i}" for i in range(n)]) for n in (2, 3)}
    yield made
    for strategy in made.values():
        strategy.close()


def _run(strategies: dict[int, mirrored.MirroredStrategy], kind: type[nn.Module],
         spatial: tuple[int, ...], center: float, split: list[int], dtype: torch.dtype,
         **options: object) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One training step of a sync BatchNorm on replicas holding ``split`` rows of a batch
    whose channels have means near ``center`` and a standard deviation of 0.5; returns
    what it computed and what torch's BatchNorm computes over the global batch in
    float64 (the exact answer for these inputs): outputs, gradients, state."""
    g = torch.Generator().manual_seed(int(center) + len(split))
    channels = 3
    shape = (sum(split), channels, *spatial)
    offsets = torch.tensor([0.0, 1.0, -3.0]).view(1, channels, *[1] * len(spatial))
    x = (center + offsets + STD * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)
    upstream = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    norm = kind(channels, **options).to(dtype)
    if norm.weight is not None:
        with torch.no_grad():
            norm.weight.uniform_(0.5, 2.0, generator=g)
            norm.bias.uniform_(-1.0, 1.0, generator=g)
    reference = copy.deepcopy(norm).double()
    strategy = strategies[len(split)]
    model = strategy.mirror(norm, sync_batch_norm=True)

    xr = x.clone().double().requires_grad_()  # (not x itself when x is float64)
    out = reference(xr)
    (out * upstream.double()).sum().backward()
    want = {"out": out.detach()}
    want["grad_x"] = xr.grad
    for name, p in reference.named_parameters():
        want[f"grad_{name}"] = p.grad
    want.update(reference.state_dict())

    def step(xi: torch.Tensor, ui: torch.Tensor) -> tuple[torch.Tensor, ...]:
        xi = xi.clone().requires_grad_()
        out = model(xi)
        (out * ui).sum().backward()
        grads = [p.grad for p in model.module.parameters()]
        return (out.detach(), xi.grad, *grads)

    results = strategy.run(step, args=(mirrored.PerReplica(list(x.split(split))),
                                       mirrored.PerReplica(list(upstream.split(split)))))
    per_replica = [strategy.experimental_local_results(r) for r in results]  # (by quantity)
    got = {"out": torch.cat(per_replica[0]), "grad_x": torch.cat(per_replica[1])}
    for i, (name, _) in enumerate(reference.named_parameters()):
        got[f"grad_{name}"] = torch.stack(per_replica[2 + i]).sum(0)  # (the local parts)
    for i, copy_ in enumerate(model.replicas):
        for name, value in copy_.state_dict().items():
            if i == 0:
                got[name] = value
            else:  # every copy holds the same statistics
                assert torch.equal(value, got[name]), (i, name)
    assert got.keys() == want.keys()
    for value in got.values():
        assert value.dtype in (dtype, torch.int64)
    return got, want


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                  rtol: float) -> None:
    """Each quantity within ``rtol`` of the largest magnitude of its exact value
    (``num_batches_tracked`` equal)."""
    for name, value in want.items():
        if not value.is_floating_point():
            assert torch.equal(got[name], value), name
            continue
        error = float((got[name].double() - value).abs().max())
        scale = float(value.abs().max())
        assert error <= rtol * scale, f"{name}: off by {error:.3g} (magnitude {scale:.3g})"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("center", CENTERS)
def test_float32_large_mean_matches_torch_over_the_global_batch(
        strategies: dict[int, mirrored.MirroredStrategy], kind: tuple[type[nn.Module],
        tuple[int, ...]], split: list[int], center: float) -> None:
    got, want = _run(strategies, *kind, center, split, torch.float32)
    _assert_close(got, want, rtol=1e-4)


def _float64_rtol(center: float) -> float:
    """1e-12, or float64's own limit where a channel's mean is large: the statistics
    combine the replicas' per-channel sums of ``n * s * s`` (``s`` near the mean) in
    float64, so they cancel to about ``eps * (mean / std) ** 2`` (as the sums of squares
    did before, in float64); torch's BatchNorm is closer there (one device, one pass)."""
    return max(1e-12, 8 * torch.finfo(torch.float64).eps * (abs(center) / STD) ** 2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("center", [1.0, *CENTERS])
def test_float64_large_mean_matches_torch_to_rounding(
        strategies: dict[int, mirrored.MirroredStrategy], kind: tuple[type[nn.Module],
        tuple[int, ...]], split: list[int], center: float) -> None:
    got, want = _run(strategies, *kind, center, split, torch.float64)
    _assert_close(got, want, rtol=_float64_rtol(center))


@pytest.mark.parametrize("options", [
    pytest.param({"momentum": None}, id="cumulative"),
    pytest.param({"affine": False}, id="no-affine"),
    pytest.param({"track_running_stats": False}, id="no-running-stats")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_options_with_a_large_mean(strategies: dict[int, mirrored.MirroredStrategy],
                                   options: dict[str, object], dtype: torch.dtype) -> None:
    got, want = _run(strategies, nn.BatchNorm2d, (2, 2), 2e3, [5, 0, 3], dtype, **options)
    _assert_close(got, want, rtol=1e-4 if dtype == torch.float32 else _float64_rtol(2e3))


def test_float32_large_mean_running_statistics_over_steps(
        strategies: dict[int, mirrored.MirroredStrategy]) -> None:
    g = torch.Generator().manual_seed(0)
    reference = nn.BatchNorm1d(2).double()
    model = strategies[2].mirror(nn.BatchNorm1d(2), sync_batch_norm=True)
    for step in range(4):
        x = 1e4 + step + 0.25 * torch.randn(8, 2, generator=g)
        reference(x.double())
        strategies[2].run(model, args=(mirrored.PerReplica([x[:5], x[5:]]),))
    assert int(model.num_batches_tracked) == 4
    torch.testing.assert_close(model.running_mean.double(), reference.running_mean,
                               rtol=1e-6, atol=0)
    torch.testing.assert_close(model.running_var.double(), reference.running_var,
                               rtol=1e-4, atol=0)


def test_a_global_batch_of_one_row_is_refused(
        strategies: dict[int, mirrored.MirroredStrategy]) -> None:
    model = strategies[2].mirror(nn.BatchNorm1d(2), sync_batch_norm=True)
    rows = mirrored.PerReplica([torch.full((1, 2), 2e3), torch.zeros(0, 2)])
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        strategies[2].run(model, args=(rows,))
