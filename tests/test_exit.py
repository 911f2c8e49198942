"""No abort at interpreter exit after iterating a distributed dataset part way.

torch aborts the process (``terminate called without an active exception``, exit
status 134) when a thread that ran torch ops is still alive while the interpreter
finalizes. Each script below stops iterating early and then lets the interpreter
exit normally; every run, in a fresh interpreter, must exit with status 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(400)

SETUP = """
import torch, mirrored
s = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
batches = [torch.arange(i, i + 2) for i in range(0, 100, 2)]
"""

VARIANTS = {
    # The script: break out of the loop, the iterator is dropped.
    "dropped": """
for x in s.experimental_distribute_dataset(batches, OPTIONS):
    break
""",
    # The iterator is still referenced at exit.
    "referenced": """
it = iter(s.experimental_distribute_dataset(batches, OPTIONS))
x = next(it)
""",
    # The iterator was closed, its producer may still be busy.
    "closed": """
it = iter(s.experimental_distribute_dataset(batches, OPTIONS))
x = next(it)
it.close()
""",
    # The producer is inside torch ops (a GIL-released matmul) when the script ends:
    # before the exit hook, most such runs aborted.
    "busy producer": """
def source():
    while True:
        yield torch.randn(64, 128) @ torch.randn(128, 128)
it = iter(s.experimental_distribute_dataset(
    source(), mirrored.InputOptions(experimental_prefetch_depth=100000)))
x = next(it)
""",
}

RUNS = int(os.environ.get("MIRRORED_EXIT_RUNS", "2"))  # more for a soak
PARALLEL = 4
OPTIONS = {"default": "None", "prefetch 2": "mirrored.InputOptions(experimental_prefetch_depth=2)"}

def bodies() -> dict[str, str]:
    return {f"{variant} ({option})": body.replace("OPTIONS", value)
            for variant, body in VARIANTS.items() for option, value in OPTIONS.items()
            if "OPTIONS" in body or option == "default"}


def test_scripts_that_stop_iterating_early_always_exit_cleanly() -> None:
    # 7 scripts x RUNS runs in fresh interpreters, 4 at a time. Before the exit hook the
    # busy producer aborted in most runs (exit status 134 / -6).
    scripts = [textwrap.dedent(SETUP) + body for body in bodies().values()] * RUNS
    failures = []
    for start in range(0, len(scripts), PARALLEL):
        batch = scripts[start:start + PARALLEL]
        procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for script in batch]
        for proc, script in zip(procs, batch, strict=True):
            _, err = proc.communicate(timeout=120)
            if proc.returncode != 0:
                failures.append(f"exit status {proc.returncode} for:{script}{err[-500:]}")
    assert failures == [], "\n".join(failures)
