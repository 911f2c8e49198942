"""The end of a job's process group, which a failed job's collectives may still wait
in: such a group is kept for the process's life, never freed."""

from __future__ import annotations

import ctypes

import torch.distributed as dist

__all__ = ["end_default_group", "keep_default_group"]


def keep_default_group() -> None:
    """Keeps the default process group (the job's) for the process's life, its exit
    included: a collective of a failure may wait for peers that never join it (a
    gradient bucket launched ahead), and freeing the group waits for that collective
    up to the group's timeout (``~ProcessGroupGloo`` joins its threads;
    ``ProcessGroup.abort()`` does not end them), wherever its last reference goes:
    23 s in a test, 135 s with the defaults. It keeps its Gloo threads and
    connections and a client of the job's store (worker 0's store server and its
    port are freed with the job as before). Called once a job's communication
    failed, and at its close with a collective still in flight.

    Example:
        >>> keep_default_group()  # no process group here: nothing to keep
    """
    if dist.is_initialized():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(dist.distributed_c10d._get_default_group()))


def end_default_group(*, keep: bool) -> None:
    """Destroys the default process group, first kept (`keep_default_group`) if
    ``keep``.

    Example:
        >>> end_default_group(keep=False)  # no process group here: nothing to end
    """
    if dist.is_initialized():
        if keep:
            keep_default_group()
        dist.destroy_process_group()
