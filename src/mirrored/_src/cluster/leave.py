"""`leave`: a job's departure when its owner drops it without ``Job.close()`` (the job
was collected, or the program is exiting, e.g. on an uncaught exception)."""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.distributed as dist

from .monitor import PeerMonitor

__all__ = ["leave"]


def leave(monitor: PeerMonitor, *, host: bool) -> None:
    """Tells the peers this worker left (`PeerMonitor.depart`); at interpreter exit
    (the main thread has ended) also releases the process group, as ``Job.close()``
    does, while Python is still whole.

    Left to the interpreter's finalization, the group's Gloo threads may free the
    tensors of their last operations after Python is gone, which aborts the process
    (exit code -6 instead of the program's own, seen under load; torch does not
    destroy groups at exit). A collective still in flight (the program ended inside a
    wait, e.g. on Ctrl-C) would make that destruction wait for the peers, up to the
    group's timeout: the backend is aborted first, which ends it at once (the peers
    then fail in it and read this worker's departure).

    Example:
        >>> import torch.distributed as dist
        >>> monitor = PeerMonitor(dist.HashStore(), rank=0, world_size=1, failure_timeout=5.0)
        >>> leave(monitor, host=False)
        >>> dist.is_initialized()
        False
    """
    monitor.depart(host=host)
    if threading.main_thread().is_alive() or not dist.is_initialized():
        return  # (a job collected while the program runs keeps the group, as before)
    with contextlib.suppress(Exception):
        group = dist.distributed_c10d._get_default_group()
        for device in ("cpu", "cuda"):
            with contextlib.suppress(Exception):  # (a backend of the other device only)
                group._get_backend(torch.device(device)).abort()
        dist.destroy_process_group()
