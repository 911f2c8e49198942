"""`CheckpointManager`: checkpoints of a (multi-worker) training job.

Every worker first agrees on the step (one checked collective: a worker that is out
of step, or that made a call the others did not, makes every worker raise before
anything is written). Then the chief (worker 0, ``strategy.extended.should_checkpoint``)
writes the checkpoint atomically (a temporary file in the same directory, flushed
and fsynced, then renamed; temporary files that a killed chief left behind are
removed), and every worker waits for it and learns whether it succeeded, so a
checkpoint that exists is complete and every worker sees it. The chief writes on a
thread of its own while every worker meets it in short rounds (one small collective
every `POLL_SECONDS` while it writes): a write may take longer than a collective's
timeout, which bounds each round, not the write; a chief that dies meanwhile is named
by the job's heartbeat as in any collective. `restore` loads the
newest one on every worker, after the workers agree on which one it is, so a job
that ``torchrun --max-restarts`` restarts resumes from it.
"""

from __future__ import annotations

import os
import pathlib
import re
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from .. import context
from ..errors import CollectiveMismatchError

__all__ = ["CheckpointManager"]

_NAME = re.compile(r"^ckpt-(\d+)\.pt$")
_TMP = ".tmp-ckpt-"
POLL_SECONDS = 0.5  # how often the workers meet while the chief writes (see the module)


def _spread_and_first(strategy: Any, value: int, index: int) -> tuple[int, int, int]:
    """The lowest and highest ``value`` over the workers, and the lowest ``index`` (a
    worker's), in one collective: the workers in the call are an elastic job's live
    ones, whose lowest writes when worker 0 is gone.

    A plain value is this worker's value in a multi-worker strategy, so reducing one
    is a collective every worker must reach; single-process strategies return it.
    """
    both = strategy.reduce("MAX", torch.tensor([value, -value, -index], dtype=torch.int64))
    return -int(both[1]), int(both[0]), -int(both[2])


def _outside_run(what: str) -> None:
    """Refuses a call from a replica: every replica would save (or restore) once per
    step, and the workers' agreement on the step is a cross-replica reduce."""
    if context.current_replica_context() is not None:
        raise RuntimeError(f"CheckpointManager.{what} was called inside strategy.run, where "
                           "every replica would call it; call it in the training loop, "
                           "after strategy.run returns (outside run the mirrored model and "
                           "optimizer read as replica 0's, which every copy equals)")


def _check_objects(objects: Mapping[str, Any]) -> None:
    if not isinstance(objects, Mapping):
        raise TypeError(f"objects must be a mapping of name -> object with state_dict(); got "
                        f"{type(objects).__name__}")
    for name, obj in objects.items():
        if not (callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"objects[{name!r}] ({type(obj).__name__}) has no state_dict() "
                            "and load_state_dict(); pass modules, optimizers, schedulers")


_PLAIN = (torch.Tensor, bool, int, float, complex, str, bytes, type(None), torch.dtype,
          torch.device, torch.Size, torch.layout, torch.memory_format)


def _check_loadable(path: str, state: dict[str, Any]) -> None:
    """Raises unless ``torch.load(path, weights_only=True)`` (`restore`'s) can load the
    checkpoint just written: the classes and functions its pickle names are checked
    (its tensor data is not read back); one that the check names, or a pickle it cannot
    read, is tried with a weights-only load of the file memory-mapped.

    Raises:
        ValueError: it cannot be loaded weights-only, naming what it holds that a
            weights-only load refuses, and where (an object's state dict).
    """
    try:
        unsafe: list[str] | None = sorted(
            torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # (an opcode the static reader does not know: the load decides)
        unsafe = None
    if unsafe == []:
        return
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return  # (named, yet allowed by the weights-only unpickler)
    except Exception as error:
        failure = error
    found = [where for name, value in state["objects"].items()
             for where in _refused(value, f"objects[{name!r}]", unsafe)][:3]
    lines = str(failure).splitlines()
    named = (", ".join(unsafe) if unsafe else
             next((ln.strip() for ln in lines if "WeightsUnpickler error" in ln),
                  lines[-1].strip() if lines else type(failure).__name__)[:300])
    raise ValueError(
        "CheckpointManager.save: CheckpointManager.restore loads with "
        f"torch.load(weights_only=True), which refuses what this checkpoint holds: {named} "
        f"(found at {', '.join(found) or 'a state dict'}); nothing was written. Keep "
        "tensors and plain Python values in the state dicts: convert NumPy arrays and RNG "
        "states to tensors or lists and ints (torch.tensor(a), a.tolist(), int(x)), and an "
        "object of your own to a dict of such values, or register its class with "
        "torch.serialization.add_safe_globals([...]) on every worker") from failure


def _refused(value: Any, where: str, unsafe: list[str] | None) -> list[str]:
    """Where in ``value`` a weights-only load may refuse a value (first few): one of a
    class ``unsafe`` names, or (when it is ``None``) one not tensors and plain values."""
    if type(value) in (dict, OrderedDict, list, tuple, set, frozenset):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        return [w for k, v in items for w in _refused(v, f"{where}[{k!r}]", unsafe)][:3]
    kind = type(value)
    name = f"{kind.__module__}.{kind.__qualname__}"
    plain = isinstance(value, _PLAIN)
    if (unsafe is None and not plain) or (unsafe and name in unsafe):
        return [f"{where} ({name})"]
    return []


class CheckpointManager:
    """Saves and restores named objects (``state_dict``/``load_state_dict``) with a step.

    Args:
        strategy: the training's strategy (any; across workers, a
            `MultiWorkerMirroredStrategy`).
        directory: where checkpoints go (shared by every worker: one machine, or a
            shared file system); created by the chief.
        max_to_keep: how many of the newest checkpoints the chief keeps (>= 1).

    Raises:
        ValueError: ``max_to_keep`` below 1.

    Example:
        >>> import tempfile, torch, mirrored
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> model = strategy.mirror(torch.nn.Linear(2, 1))
        >>> manager = CheckpointManager(strategy, tempfile.mkdtemp())
        >>> manager.restore({"model": model}) is None  # nothing saved yet
        True
        >>> _ = manager.save(5, {"model": model})
        >>> manager.restore({"model": model})
        5
    """

    def __init__(self, strategy: Any, directory: str | os.PathLike[str], *,
                 max_to_keep: int = 2) -> None:
        if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"max_to_keep must be an int >= 1; got {max_to_keep!r}")
        self._strategy = strategy
        self.directory = pathlib.Path(directory)
        self.max_to_keep = max_to_keep

    @property
    def is_chief(self) -> bool:
        """Whether this worker writes the checkpoints (worker 0; in an elastic job
        without it, `save` has the lowest live worker write)."""
        return bool(self._strategy.extended.should_checkpoint)

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints in the directory, oldest first."""
        if not self.directory.is_dir():
            return []
        found = (_NAME.match(p.name) for p in self.directory.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, step: int) -> pathlib.Path:
        """Where the checkpoint of ``step`` is."""
        return self.directory / f"ckpt-{step:09d}.pt"

    def save(self, step: int, objects: Mapping[str, Any]) -> pathlib.Path:
        """Every worker calls it; once every worker agrees on ``step``, the chief writes
        ``objects``' state dicts as the checkpoint of ``step`` (atomically) and drops
        the oldest beyond ``max_to_keep``; returns when the checkpoint exists for every
        worker. Checkpoints of *later* steps are dropped too: they belong to an earlier
        run that got further (a reused directory), and ``restore`` must not prefer them
        to this one.

        Raises:
            TypeError: an object without ``state_dict``/``load_state_dict``, a bad step.
            ValueError: (on the chief) a state that `restore`, which loads with
                ``torch.load(weights_only=True)``, could not load back (a NumPy array, an
                object of your own); nothing is written.
            CollectiveMismatchError: the workers passed different steps, or one made a
                collective the others did not (on every worker; nothing is written).
            RuntimeError: the chief failed to write (on the other workers; the chief
                raises its own error); called inside ``strategy.run``.
        """
        _outside_run("save")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError(f"step must be an int >= 0; got {step!r}")
        _check_objects(objects)
        me = self._strategy.extended._parts.topology.worker_index
        low, high, first = _spread_and_first(self._strategy, step, me)
        if low != high:
            raise CollectiveMismatchError(
                f"CheckpointManager.save: the workers are at different steps ({low} to "
                f"{high}); nothing was written. Every worker must save the same step")
        target = self.path(step)
        failures: list[BaseException] = []
        writer = None
        if me == first:  # (this thread waits below: nothing changes the objects meanwhile)
            writer = threading.Thread(target=self._write_into, name="mirrored-checkpoint",
                                      args=(step, objects, target, failures), daemon=True)
            writer.start()
        while True:  # 1: still writing, 2: failed, 0: written (the chief's; others 0)
            if writer is not None:
                writer.join(POLL_SECONDS)
            status = 1 if writer is not None and writer.is_alive() else 2 if failures else 0
            _, status, _ = _spread_and_first(self._strategy, status, me)
            if status != 1:
                break
        if failures:
            raise failures[0]
        if status == 2:
            raise RuntimeError(f"the chief failed to write the checkpoint of step {step} to "
                               f"{target}; see the chief's error")
        return target

    def _write_into(self, step: int, objects: Mapping[str, Any], target: pathlib.Path,
                    failures: list[BaseException]) -> None:
        try:
            state = {"step": step, "objects": {k: v.state_dict() for k, v in objects.items()}}
            self._write(step, state, target)
        except BaseException as error:  # (on the writer's thread: the caller raises it)
            failures.append(error)

    def _write(self, step: int, state: dict[str, Any], target: pathlib.Path) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._remove_partial()
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=_TMP)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            _check_loadable(tmp, state)  # (before it counts: restore must load it)
            os.replace(tmp, target)
        except BaseException:
            pathlib.Path(tmp).unlink(missing_ok=True)
            raise
        for later in [s for s in self.steps() if s > step]:
            self.path(later).unlink(missing_ok=True)
        for old in self.steps()[:-self.max_to_keep]:
            self.path(old).unlink(missing_ok=True)

    def _remove_partial(self) -> None:
        """Temporary files of writes that never finished (a chief killed mid-write)."""
        if self.directory.is_dir():
            for leftover in self.directory.glob(_TMP + "*"):
                leftover.unlink(missing_ok=True)

    def restore(self, objects: Mapping[str, Any]) -> int | None:
        """Every worker calls it: loads the newest checkpoint into ``objects`` and
        returns its step, or returns ``None`` (and loads nothing) when there is none.

        Raises:
            RuntimeError: the workers see different newest checkpoints (a directory
                that is not shared); called inside ``strategy.run``.
            KeyError: the checkpoint lacks one of ``objects``' names.
        """
        _outside_run("restore")
        _check_objects(objects)
        steps = self.steps()
        newest = steps[-1] if steps else -1
        me = self._strategy.extended._parts.topology.worker_index
        low, high, first = _spread_and_first(self._strategy, newest, me)  # every worker's
        if me == first:  # (the worker that writes: see `save`)
            self._remove_partial()
        if low != high:
            raise RuntimeError(
                f"workers see different newest checkpoints in {self.directory} (steps "
                f"{low} to {high}; -1 means none); every worker must see the same "
                "directory (one machine or a shared file system)")
        if newest < 0:
            return None
        state = torch.load(self.path(newest), map_location="cpu", weights_only=True)
        missing = sorted(set(objects) - set(state["objects"]))
        if missing:
            raise KeyError(f"checkpoint {self.path(newest)} has no {missing}; it holds "
                           f"{sorted(state['objects'])}")
        for name, obj in objects.items():
            obj.load_state_dict(state["objects"][name])
        return int(state["step"])
