"""What the input side is told and how it is configured: `InputContext` and `InputOptions`.

`InputContext` is what ``distribute_datasets_from_function`` hands ``dataset_fn``
(which input pipeline this is, of how many, and how many replicas train in sync);
`InputOptions` is the frozen configuration of every distributed dataset.
"""

from __future__ import annotations

import dataclasses

__all__ = ["InputContext", "InputOptions"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True, slots=True)
class InputContext:
    """Where one input pipeline stands in the job, as TF's ``tf.distribute.InputContext``.

    One pipeline runs per worker: ``num_input_pipelines`` is the number of workers and
    ``input_pipeline_id`` this worker's index. Arguments may be given by position, as in TF.

    Args:
        num_input_pipelines: how many input pipelines the job has (>= 1).
        input_pipeline_id: this pipeline's index, ``0 .. num_input_pipelines - 1``.
        num_replicas_in_sync: the global number of replicas (>= 1).

    Raises:
        TypeError: an argument that is not an int.
        ValueError: a count below 1 or an id out of range.

    Example:
        >>> from mirrored._src.data import InputContext
        >>> ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
        >>> ctx.get_per_replica_batch_size(64)
        16
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        for name in ("num_input_pipelines", "input_pipeline_id", "num_replicas_in_sync"):
            value = getattr(self, name)
            if not _is_int(value):
                raise TypeError(f"InputContext.{name} must be an int; got "
                                f"{type(value).__name__} {value!r}")
        if self.num_input_pipelines < 1:
            raise ValueError(f"InputContext.num_input_pipelines must be >= 1; got "
                             f"{self.num_input_pipelines}")
        if self.num_replicas_in_sync < 1:
            raise ValueError(f"InputContext.num_replicas_in_sync must be >= 1; got "
                             f"{self.num_replicas_in_sync}")
        if not 0 <= self.input_pipeline_id < self.num_input_pipelines:
            raise ValueError(
                f"InputContext.input_pipeline_id must be in 0..{self.num_input_pipelines - 1} "
                f"(num_input_pipelines={self.num_input_pipelines}); got {self.input_pipeline_id}"
            )

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size / num_replicas_in_sync``, which must divide evenly.

        Raises:
            TypeError: ``global_batch_size`` is not an int.
            ValueError: it is negative or not divisible by ``num_replicas_in_sync``.

        Example:
            >>> from mirrored._src.data import InputContext
            >>> InputContext(num_replicas_in_sync=2).get_per_replica_batch_size(8)
            4
        """
        if not _is_int(global_batch_size):
            raise TypeError(f"global_batch_size must be an int; got "
                            f"{type(global_batch_size).__name__} {global_batch_size!r}")
        if global_batch_size < 0:
            raise ValueError(f"global_batch_size must be >= 0; got {global_batch_size}")
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"global_batch_size {global_batch_size} is not divisible by "
                f"num_replicas_in_sync {self.num_replicas_in_sync}; pick a multiple of "
                f"{self.num_replicas_in_sync}"
            )
        return global_batch_size // self.num_replicas_in_sync


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class InputOptions:
    """How a distributed dataset delivers its batches.

    Args:
        experimental_fetch_to_device: move each replica's chunk to the replica's device
            (default). When false, chunks stay where the source put them.
        experimental_prefetch_depth: how many steps a background thread prepares (reads,
            splits and moves) ahead of the training loop; 0 prepares each step on the
            caller's thread when it is asked for, with no background thread. Default
            (``None``): 2 when steps are copied to CUDA devices (the copy overlaps the
            step), else 0 (on CPU a prefetch thread only competes for the GIL).

    Raises:
        TypeError: a flag that is not a bool or a depth that is not an int.
        ValueError: a negative depth.

    Example:
        >>> from mirrored._src.data import InputOptions
        >>> InputOptions(experimental_prefetch_depth=0).experimental_fetch_to_device
        True
    """

    experimental_fetch_to_device: bool = True
    experimental_prefetch_depth: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.experimental_fetch_to_device, bool):
            raise TypeError(
                "InputOptions.experimental_fetch_to_device must be a bool; got "
                f"{type(self.experimental_fetch_to_device).__name__} "
                f"{self.experimental_fetch_to_device!r}"
            )
        depth = self.experimental_prefetch_depth
        if depth is None:
            return
        if not _is_int(depth):
            raise TypeError(f"InputOptions.experimental_prefetch_depth must be an int; got "
                            f"{type(depth).__name__} {depth!r}")
        if depth < 0:
            raise ValueError(f"InputOptions.experimental_prefetch_depth must be >= 0 (0: no "
                             f"background thread); got {depth}")
