"""The porting guide's examples (docs/porting.md) run and give the one-device
numbers: each ``# example:`` block is executed after the ``setup`` block."""

from __future__ import annotations

import pathlib
import re
import warnings
from typing import Any

import pytest

with warnings.catch_warnings():  # dynamo's first import warns about a torch.jit helper
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch._dynamo  # noqa: F401

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "porting.md"
BLOCK = re.compile(r"```python\n# example: (\w+)\n(.*?)```", re.DOTALL)
EXAMPLES = dict(BLOCK.findall(GUIDE.read_text()))

def test_the_guide_has_its_examples() -> None:
    assert {"setup", "one_device", "clip", "make_optimizer", "tokens", "buffers",
            "grad_scaler", "compile", "evaluation", "checkpoints", "freeze"} <= set(EXAMPLES)


def run_example(name: str) -> None:
    namespace: dict[str, Any] = {"__name__": f"porting_{name}"}
    exec(compile(EXAMPLES["setup"], f"{GUIDE}:setup", "exec"), namespace)
    try:
        exec(compile(EXAMPLES[name], f"{GUIDE}:{name}", "exec"), namespace)
    finally:
        namespace["strategy"].close()


def cases() -> list[str]:
    return [name for name in EXAMPLES if name != "setup"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", cases())
def test_example_matches_one_device(name: str) -> None:
    run_example(name)
