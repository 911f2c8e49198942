"""What the input side is told and how it is configured: `InputContext` and `InputOptions`.

`InputContext` is what ``distribute_datasets_from_function`` hands ``dataset_fn``
(which input pipeline this is, of how many, and how many replicas train in sync);
`InputOptions` is the frozen configuration of every distributed dataset.
"""

from __future__ import annotations

import dataclasses
import enum

__all__ = ["InputContext", "InputOptions", "InputReplicationMode"]


class InputReplicationMode(enum.Enum):
    """How many input pipelines ``distribute_datasets_from_function`` builds (TF's
    ``tf.distribute.InputReplicationMode``).

    - ``PER_WORKER``: ``dataset_fn`` is called once per worker; the local replicas
      take its elements in turn.
    - ``PER_REPLICA``: ``dataset_fn`` is called once per replica, with
      ``InputContext(num_input_pipelines=N, input_pipeline_id=replica id)``; each
      replica iterates its own pipeline.

    Example:
        >>> from mirrored import InputReplicationMode
        >>> InputReplicationMode("PER_REPLICA")
        <InputReplicationMode.PER_REPLICA: 'PER_REPLICA'>
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


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
    """How a distributed dataset delivers its batches (TF's ``tf.distribute.InputOptions``).

    Args:
        experimental_fetch_to_device: move each replica's chunk to the replica's device
            (default). When false, chunks stay where the source put them.
        experimental_replication_mode: an `InputReplicationMode` (or its name):
            ``PER_WORKER`` (default) or ``PER_REPLICA`` (one ``dataset_fn`` pipeline per
            replica; ``distribute_datasets_from_function`` only, as in TF).
        experimental_place_dataset_on_device: with ``PER_REPLICA``, build and iterate
            each replica's pipeline with the replica's device as torch's default
            device, so its tensors are made there; needs
            ``experimental_fetch_to_device=False`` (as in TF).
        experimental_per_replica_buffer_size: TF's device prefetch buffer; ``0``
            disables prefetching (as in TF), any other value leaves it to
            ``experimental_prefetch_depth``. Default 1.
        experimental_prefetch_depth: how many steps a background thread prepares (reads,
            splits and moves) ahead of the training loop; 0 prepares each step on the
            caller's thread when it is asked for, with no background thread. Default
            (``None``): 2 when steps are copied to CUDA devices (the copy overlaps the
            step), else 0 (on CPU a prefetch thread only competes for the GIL). Across
            workers whose sources have no ``len()``, an explicit depth ``k`` also
            bounds the steps read ahead for their vote to ``max(1, k)`` (default 8).
        experimental_compare_batches: across workers (with checked calls), a sample of
            each global batch's integer tensors (labels, token ids; not uint8 or bool)
            rides in every later collective's identity, so workers whose sources yield
            other examples (a shuffle seeded differently on each) raise
            ``CollectiveMismatchError`` before any data of that step is used. Set it to
            ``False`` for a source that randomizes integer tensors on each worker by
            design (masking token ids) while every worker iterates the same examples.
            Not in TF. Default ``True``.

    Raises:
        TypeError: a flag that is not a bool, a size or depth that is not an int.
        ValueError: a negative size or depth, an unknown replication mode, or
            ``experimental_place_dataset_on_device`` without ``PER_REPLICA`` or with
            ``experimental_fetch_to_device``.

    Example:
        >>> from mirrored._src.data import InputOptions
        >>> InputOptions(experimental_prefetch_depth=0).experimental_fetch_to_device
        True
        >>> InputOptions(experimental_replication_mode="PER_REPLICA").experimental_replication_mode
        <InputReplicationMode.PER_REPLICA: 'PER_REPLICA'>
    """

    experimental_fetch_to_device: bool = True
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1
    experimental_prefetch_depth: int | None = None
    experimental_compare_batches: bool = True

    def __post_init__(self) -> None:
        for name in ("experimental_fetch_to_device", "experimental_place_dataset_on_device",
                     "experimental_compare_batches"):
            flag = getattr(self, name)
            if not isinstance(flag, bool):
                raise TypeError(f"InputOptions.{name} must be a bool; got "
                                f"{type(flag).__name__} {flag!r}")
        for name, meaning in (("experimental_prefetch_depth", "0: no background thread"),
                              ("experimental_per_replica_buffer_size", "0: no prefetching")):
            size = getattr(self, name)
            if size is None and name == "experimental_prefetch_depth":
                continue
            if not _is_int(size):
                raise TypeError(f"InputOptions.{name} must be an int; got "
                                f"{type(size).__name__} {size!r}")
            if size < 0:
                raise ValueError(f"InputOptions.{name} must be >= 0 ({meaning}); got {size}")
        mode = self.experimental_replication_mode
        try:
            mode = InputReplicationMode(mode.value if isinstance(mode, enum.Enum) else mode)
        except ValueError:
            raise ValueError("InputOptions.experimental_replication_mode must be "
                             "InputReplicationMode.PER_WORKER or PER_REPLICA (or their names); "
                             f"got {mode!r}") from None
        object.__setattr__(self, "experimental_replication_mode", mode)
        if self.experimental_place_dataset_on_device:
            if mode is not InputReplicationMode.PER_REPLICA:
                raise ValueError("InputOptions.experimental_place_dataset_on_device=True needs "
                                 "experimental_replication_mode=PER_REPLICA (as in TF)")
            if self.experimental_fetch_to_device:
                raise ValueError("InputOptions.experimental_place_dataset_on_device=True needs "
                                 "experimental_fetch_to_device=False: the pipeline already "
                                 "makes its tensors on the replica's device (as in TF)")

    @property
    def prefetch_depth(self) -> int | None:
        """The steps prepared ahead: ``experimental_prefetch_depth`` (``None``: chosen
        by the devices), or 0 when ``experimental_per_replica_buffer_size`` is 0."""
        return self.experimental_prefetch_depth if self.experimental_per_replica_buffer_size \
            else 0
