"""Shared fixtures: strategies over logical CPU replicas."""

from __future__ import annotations

import pytest

import mirrored


def cpu_strategy(n: int) -> mirrored.MirroredStrategy:
    return mirrored.MirroredStrategy([f"CPU:{i}" for i in range(n)])


@pytest.fixture
def two() -> mirrored.MirroredStrategy:
    strategy = cpu_strategy(2)
    yield strategy
    strategy.close()


@pytest.fixture(scope="session")
def strategies() -> dict[int, mirrored.MirroredStrategy]:
    """One strategy per replica count 1..8, shared by the property tests."""
    made = {n: cpu_strategy(n) for n in range(1, 9)}
    yield made
    for strategy in made.values():
        strategy.close()
