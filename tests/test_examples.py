"""The quick-start example (what `make quickstart` runs) runs and prints the seed results."""

import pathlib
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "quickstart.py"


@pytest.mark.timeout(120)
def test_quickstart_prints_the_seed_results():
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True,
                          timeout=100, check=True)
    out = done.stdout
    assert "reduce(SUM, axis=None) = tensor(1) on cpu" in out
    assert "tensor(1) on /job:localhost/replica:0/task:0/device:CPU:1" in out
    assert "reduce(MEAN, axis=0) = 2.5" in out
    assert "raises ValueError" in out and "float32[4]" in out and "float32[2]" in out
    assert "PerReplica:{0: tensor(2.5000), 1: tensor(2.5000)}" in out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("script", ["bench_core.py", "bench_collectives.py",
                                    "bench_training.py"])
def test_benchmarks_run_in_quick_mode(script):
    # Only that they run and print their verdicts: timings are never asserted.
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / script
    done = subprocess.run([sys.executable, str(path), "--quick"], capture_output=True,
                          text=True, timeout=100, check=True)
    assert "target" in done.stdout
