"""benchmarks/gpu_check.py skips cleanly where there is no CUDA device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.mark.timeout(120)
def test_skips_cleanly_without_cuda() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no GPU visible, even on a GPU machine
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True,
                          text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device visible" in done.stdout and "skipping" in done.stdout
    assert done.stderr.strip() == "" or "Traceback" not in done.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(600)
def test_runs_on_cuda() -> None:  # pragma: no cover - GPU machines only
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True,
                          text=True, timeout=580)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all equality checks passed" in done.stdout
