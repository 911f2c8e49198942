"""`CheckpointManager.restore` loads with ``weights_only=True``, so `save` refuses a
state it could not load back (a NumPy array, ``np.random.get_state()``, an instance
of a plain class), naming it, before the checkpoint counts as written: it saved such
a state before, and the job could not resume from it (a review found it: after a
``torchrun`` restart the job failed at ``restore``)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import mirrored

pytestmark = pytest.mark.timeout(60)


class _Progress:
    """A tracked object whose state holds what ``state`` gives."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.loaded: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": 3, "extra": self.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


class _Plain:
    pass


def _manager(tmp_path: Path) -> tuple[mirrored.MirroredStrategy, mirrored.CheckpointManager]:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    return strategy, mirrored.CheckpointManager(strategy, tmp_path)


@pytest.mark.parametrize(("state", "named"), [
    (lambda: np.random.get_state(), "numpy"),
    (lambda: np.arange(3), "numpy"),
    (lambda: _Plain(), "_Plain"),
])
def test_save_refuses_what_restore_cannot_load(tmp_path: Path, state: Any, named: str) -> None:
    strategy, manager = _manager(tmp_path)
    model = strategy.mirror(nn.Linear(2, 1).double())
    manager.save(1, {"model": model, "progress": _Progress(0)})
    with pytest.raises(ValueError, match=rf"(?s)weights_only=True.*{named}.*'progress'"
                                         r".*torch\.tensor"):
        manager.save(2, {"model": model, "progress": _Progress(state())})
    assert manager.steps() == [1]  # (not written: restore still finds step 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [manager.path(1).name]
    progress = _Progress(None)
    assert manager.restore({"model": model, "progress": progress}) == 1
    assert progress.loaded == {"epoch": 3, "extra": 0}
    strategy.close()


def test_save_keeps_what_restore_loads(tmp_path: Path) -> None:
    """Tensors, plain Python values (``random.getstate()`` is tuples of ints), a
    model's, an optimizer's and a scheduler's states, and a NumPy state converted to
    tensors and plain types, round-trip."""
    strategy, manager = _manager(tmp_path)
    model = strategy.mirror(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)).double())
    optimizer = strategy.mirror_optimizer(
        model, lambda p: torch.optim.Adam(p, lr=0.1))  # type: ignore[arg-type]
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)  # type: ignore[arg-type]
    name, keys, pos, has_gauss, cached = np.random.get_state()
    converted = {"name": name, "keys": torch.tensor(keys), "pos": int(pos),
                 "has_gauss": int(has_gauss), "cached": float(cached),
                 "py": random.getstate(), "torch": torch.get_rng_state(),
                 "many": [1, 2.5, "x", None, True, (3, 4), {"k": [torch.zeros(2)]}]}
    progress = _Progress(converted)
    objects = {"model": model, "optimizer": optimizer, "scheduler": scheduler,
               "progress": progress}
    manager.save(4, objects)
    back = _Progress(None)
    assert manager.restore({**objects, "progress": back}) == 4
    assert back.loaded["extra"]["py"] == random.getstate()
    assert torch.equal(back.loaded["extra"]["keys"], torch.tensor(keys))
    strategy.close()
