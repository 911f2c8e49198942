"""`PreemptionCheckpointHandler`: on a preemption notice to any worker, every worker
saves one checkpoint at the same step and exits (TF:
``tf.distribute.experimental.PreemptionCheckpointHandler``).

A notice (SIGTERM, or a `TerminationConfig.termination_watcher_fn` returning ``True``)
only sets a flag. Before each step, `run` folds the flag into one small all-reduce
(MAX over the workers of ``[flag, run count, -run count]``), so every worker learns of
a notice at the same step, and a worker that ran a different number of steps is
caught instead of saving a checkpoint under the wrong step. When the flag is set,
every worker saves through a `CheckpointManager` at step = completed `run` calls,
then calls ``exit_fn`` (default ``sys.exit(42)``, TF's default outside Google Cloud).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import types
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ..errors import MirroredError
from .checkpoint import CheckpointManager

__all__ = ["PreemptionCheckpointHandler", "TerminationConfig"]

_log = logging.getLogger("mirrored")
_T = TypeVar("_T")
RESTART_EXIT_CODE = 42  # TF's default exit code (BorgTerminationConfig) off Google Cloud


class RunCountMismatchError(MirroredError, RuntimeError):
    """Workers reached a preemption check after different numbers of steps."""


def _default_exit() -> None:
    sys.exit(RESTART_EXIT_CODE)


@dataclass(frozen=True, kw_only=True, slots=True)
class TerminationConfig:
    """How a `PreemptionCheckpointHandler` learns of a termination, saves and exits
    (TF: ``tf.distribute.experimental.TerminationConfig``).

    Args:
        termination_watcher_fn: polled every ``poll_interval_seconds`` on a thread;
            ``True`` means this worker will be terminated soon. ``None`` (default):
            SIGTERM is the notice (a handler is installed; the handler must be
            installed from the main thread).
        exit_fn: called on every worker after the checkpoint is saved (default:
            ``sys.exit(42)``, TF's default; a launcher that restarts on non-zero exit,
            such as ``torchrun --max-restarts``, then restarts the job).
        save_fn: replaces ``CheckpointManager.save``: called on every worker with the
            step to save (the number of completed `run` calls).
        poll_interval_seconds: how often ``termination_watcher_fn`` is polled (TF: 1 s).

    Raises:
        TypeError: a field that is not callable (or a number for the interval).
        ValueError: a non-positive interval.

    Example:
        >>> TerminationConfig(exit_fn=lambda: None).poll_interval_seconds
        1.0
    """

    termination_watcher_fn: Callable[[], bool] | None = None
    exit_fn: Callable[[], object] = _default_exit
    save_fn: Callable[[int], object] | None = None
    poll_interval_seconds: float = 1.0

    def __post_init__(self) -> None:
        for name in ("termination_watcher_fn", "exit_fn", "save_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"TerminationConfig.{name} must be callable; got "
                                f"{type(value).__name__}")
        interval = self.poll_interval_seconds
        if isinstance(interval, bool) or not isinstance(interval, int | float):
            raise TypeError(f"poll_interval_seconds must be a number; got {interval!r}")
        if not interval > 0:
            raise ValueError(f"poll_interval_seconds must be > 0; got {interval}")


class PreemptionCheckpointHandler:
    """Saves one agreed checkpoint on every worker when any worker gets a preemption
    notice, then exits; restores the newest checkpoint when created.

    TF takes a cluster resolver and a ``tf.train.Checkpoint``; here the strategy (it
    carries the job) and the named objects that `CheckpointManager` saves. The step of
    a checkpoint is the number of completed `run` calls (`total_run_calls`), so a
    `CheckpointManager` passed in must only hold checkpoints numbered that way.

    Args:
        strategy: the training's strategy (`MultiWorkerMirroredStrategy`, or a
            single-process one).
        checkpoint: name -> object with ``state_dict``/``load_state_dict`` (model,
            optimizer, ...), restored now if a checkpoint exists.
        checkpoint_dir: where checkpoints go (a `CheckpointManager` with
            ``max_to_keep=1`` is made); or pass ``checkpoint_manager``.
        termination_config: notice, exit and save behaviour (default: SIGTERM,
            ``sys.exit(42)``, ``CheckpointManager.save``).
        checkpoint_manager: an existing `CheckpointManager` instead of a directory.

    Raises:
        TypeError: not a strategy, a bad ``checkpoint`` mapping or config type.
        ValueError: neither or both of ``checkpoint_dir`` and ``checkpoint_manager``.
        RuntimeError: SIGTERM watching asked for off the main thread.

    Example:
        >>> import tempfile, torch, mirrored
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> model = strategy.mirror(torch.nn.Linear(2, 1))
        >>> handler = mirrored.PreemptionCheckpointHandler(
        ...     strategy, {"model": model}, tempfile.mkdtemp())
        >>> handler.run(lambda: "one step")
        'one step'
        >>> handler.total_run_calls
        1
        >>> handler.close()  # the previous SIGTERM handler is back
    """

    def __init__(self, strategy: Any, checkpoint: Mapping[str, Any],
                 checkpoint_dir: str | os.PathLike[str] | None = None,
                 termination_config: TerminationConfig | None = None, *,
                 checkpoint_manager: CheckpointManager | None = None) -> None:
        if not callable(getattr(strategy, "reduce", None)) or not hasattr(strategy, "extended"):
            raise TypeError("PreemptionCheckpointHandler takes the training's strategy (TF "
                            "takes a cluster resolver; here the strategy carries the job); "
                            f"got {type(strategy).__name__}")
        config = TerminationConfig() if termination_config is None else termination_config
        if not isinstance(config, TerminationConfig):
            raise TypeError("termination_config must be a mirrored.TerminationConfig; got "
                            f"{type(config).__name__}")
        if (checkpoint_dir is None) == (checkpoint_manager is None):
            raise ValueError("pass exactly one of checkpoint_dir (a CheckpointManager is "
                             "made there) and checkpoint_manager; got "
                             f"checkpoint_dir={checkpoint_dir!r}, "
                             f"checkpoint_manager={checkpoint_manager!r}")
        if checkpoint_manager is None:
            assert checkpoint_dir is not None  # checked above
            checkpoint_manager = CheckpointManager(strategy, checkpoint_dir, max_to_keep=1)
        elif not isinstance(checkpoint_manager, CheckpointManager):
            raise TypeError("checkpoint_manager must be a mirrored.CheckpointManager; got "
                            f"{type(checkpoint_manager).__name__}")
        self._strategy = strategy
        self._objects = dict(checkpoint)
        self._config = config
        self._manager = checkpoint_manager
        self._notice = threading.Event()
        self._stop = threading.Event()
        self._previous: Any = None
        self._watcher: threading.Thread | None = None
        self._runs = checkpoint_manager.restore(self._objects) or 0
        if self._runs:
            _log.info("preemption handler: restored step %d from %s", self._runs,
                      checkpoint_manager.path(self._runs))
        self._start_watching()

    @property
    def total_run_calls(self) -> int:
        """Completed `run` (and `save_checkpoint_if_preempted`) calls, counting those
        before a restore: the step to resume from."""
        return self._runs

    @property
    def checkpoint_manager(self) -> CheckpointManager:
        """The `CheckpointManager` that saves and restores."""
        return self._manager

    def notify(self) -> None:
        """Marks a termination notice on this worker, as SIGTERM does (from any thread)."""
        self._notice.set()

    def run(self, distributed_train_function: Callable[..., _T], *args: Any,
            **kwargs: Any) -> _T:
        """Checks for a notice on any worker (saving and exiting if there is one), then
        runs one training step, ``distributed_train_function(*args, **kwargs)``.

        Every worker calls it once per step, as it calls ``strategy.run``.

        Returns:
            What ``distributed_train_function`` returns.

        Raises:
            RunCountMismatchError: workers that called it different numbers of times.
        """
        self._check_and_maybe_save()
        result = distributed_train_function(*args, **kwargs)
        self._runs += 1
        return result

    def save_checkpoint_if_preempted(self) -> None:
        """For a loop that does not use `run`: call it once per step, after the step.
        Saves and exits if any worker got a notice; counts the step.

        Raises:
            RunCountMismatchError: workers that called it different numbers of times.
        """
        self._runs += 1
        self._check_and_maybe_save()

    @contextlib.contextmanager
    def watch_preemption_scope(self) -> Iterator[PreemptionCheckpointHandler]:
        """The scope of the training loop: leaving it (normally or by an exception)
        stops watching (`close`). TF needs this scope for TPUStrategy only; here it
        bounds the SIGTERM handler to the loop.

        Yields:
            This handler.
        """
        try:
            yield self
        finally:
            self.close()

    def close(self) -> None:
        """Stops watching: the previous SIGTERM handler is back, the poller stops."""
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()
        self._watcher = None
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _start_watching(self) -> None:
        watcher_fn = self._config.termination_watcher_fn
        if watcher_fn is not None:
            self._watcher = threading.Thread(target=self._poll, args=(watcher_fn,),
                                             name="mirrored-preemption-watcher", daemon=True)
            self._watcher.start()
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionCheckpointHandler watches SIGTERM, and Python "
                               "installs signal handlers from the main thread only; create "
                               "it on the main thread, or pass TerminationConfig("
                               "termination_watcher_fn=...)")
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: types.FrameType | None) -> None:
        self._notice.set()

    def _poll(self, watcher_fn: Callable[[], bool]) -> None:
        while not self._stop.is_set():
            if watcher_fn():
                self._notice.set()
                return
            self._stop.wait(self._config.poll_interval_seconds)

    def _check_and_maybe_save(self) -> None:
        mine = torch.tensor([int(self._notice.is_set()), self._runs, -self._runs],
                            dtype=torch.int64)
        agreed = self._strategy.reduce("MAX", mine).tolist()
        low, high = -agreed[2], agreed[1]
        if low != high:
            raise RunCountMismatchError(
                f"PreemptionCheckpointHandler: the workers have run between {low} and {high} "
                f"steps (this worker: {self._runs}); every worker must call run() (or "
                "save_checkpoint_if_preempted()) once per step, or the agreed checkpoint "
                "would hold different steps")
        if not agreed[0]:
            return
        _log.info("preemption notice: saving step %d on every worker, then exiting",
                  self._runs)
        try:  # a second SIGTERM during the save still lands in our handler
            if self._config.save_fn is not None:
                self._config.save_fn(self._runs)
            else:
                self._manager.save(self._runs, self._objects)
        finally:
            self.close()
        self._notice.clear()
        self._config.exit_fn()  # if it returns, training goes on, no longer watched
