"""What a failed job leaves behind: its process group, kept for the process's life."""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["keep_failed_group"]


def keep_failed_group(group: Any) -> None:
    """Keeps ``group`` (a failed job's process group) for the process's life, its exit
    included: a collective of the failure may wait for peers that never join it (a
    gradient bucket launched ahead), and freeing the group waits for that collective
    up to the group's timeout (Gloo joins its threads; ``abort()`` does not end them):
    a failed job lingered that long wherever its strategy was freed, and at its exit.
    Its store stays with it (on worker 0, the listening socket: peers may still read
    the failure's messages).

    Example:
        >>> import sys
        >>> kept = object()
        >>> before = sys.getrefcount(kept)
        >>> keep_failed_group(kept)
        >>> sys.getrefcount(kept) - before
        1
    """
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
