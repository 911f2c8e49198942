"""Shared fixtures: strategies over logical CPU replicas."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

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


DIGITS = Path(__file__).parents[1] / "examples" / "train_digits.py"


@pytest.fixture(scope="session")
def digits_two_replicas(tmp_path_factory: pytest.TempPathFactory
                        ) -> Iterator[Callable[[], tuple[list[str], Path]]]:
    """``examples/train_digits.py --replicas 2 --epochs 2``, run once for the session:
    the uninterrupted reference of the preempted run (test_preemption.py) and of the
    torchrun job (test_train_digits.py). It starts at the first test that asks for it
    and runs while that test runs its own job; calling the fixture's value waits for it
    and returns its stdout lines and the path of its saved final state."""
    pytest.importorskip("sklearn", reason="the example needs the 'examples' extra")
    pytest.importorskip("tqdm", reason="the example needs the 'examples' extra")
    final = tmp_path_factory.mktemp("digits_two_replicas") / "final.pt"
    proc = subprocess.Popen([sys.executable, str(DIGITS), "--replicas", "2", "--epochs", "2",
                             "--save-final", str(final)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    done: list[list[str]] = []

    def wait() -> tuple[list[str], Path]:
        if not done:
            out, err = proc.communicate(timeout=150)
            assert proc.returncode == 0, f"the example failed:\n{err[-3000:]}"
            done.append(out.splitlines())
        return done[0], final

    yield wait
    proc.kill()
    proc.communicate()
