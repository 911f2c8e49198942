"""`Lighthouse`: torchft's quorum server (a Rust server in the torchft wheel), started
in this process. One per job; every worker's `ElasticTrainer` asks it, before each
step, which workers take part in the step.
"""

from __future__ import annotations

import importlib
import logging
import socket
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["Lighthouse", "new_manager", "require_torchft"]

_TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]

_log = logging.getLogger("mirrored")


def require_torchft(what: str) -> Any:
    """Imports torchft's native module, or raises an ImportError that says how to
    install it."""
    try:
        return importlib.import_module("torchft._torchft")
    except ImportError as e:
        raise ImportError(f"{what} runs on torchft, which is not installed: "
                          "pip install 'mirrored[elastic]' (or pip install torchft)") from e



def new_manager(*, worker_id: str, lighthouse_address: str, min_workers: int,
                timeout_seconds: float, quorum_timeout_seconds: float,
                state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]
                ) -> tuple[Any, Any]:
    """One worker's torchft ``Manager`` (a replica group of one worker, synchronous
    quorum, Gloo) and the store it runs on: ``(store, manager)``; keep both."""
    # torchft 0.2.0 logs with the deprecated Logger.warn in every reconfiguration on a
    # build without NCCL's flight recorder (Manager._async_quorum); where warnings are
    # errors (-W error, pytest) that exception makes every quorum fail.
    warnings.filterwarnings("ignore", message="The 'warn' method is deprecated",
                            category=DeprecationWarning)
    manager_module = importlib.import_module("torchft.manager")  # untyped package
    process_groups = importlib.import_module("torchft.process_group")
    timeout = timedelta(seconds=timeout_seconds)
    # One store per worker (torchft: per replica group); the store of the quorum's
    # first worker carries the process group.
    store = _TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    host = lighthouse_address.split("://", 1)[-1].rsplit(":", 1)[0]
    manager = manager_module.Manager(
        pg=process_groups.ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
        state_dict=state_dict, min_replica_size=min_workers, use_async_quorum=False,
        timeout=timeout, quorum_timeout=timedelta(seconds=quorum_timeout_seconds),
        connect_timeout=timeout, rank=0, world_size=1, store_addr="127.0.0.1",
        store_port=store.port, lighthouse_addr=lighthouse_address, replica_id=worker_id,
        # the host this worker advertises: loopback for a loopback lighthouse
        hostname="127.0.0.1" if host in ("127.0.0.1", "localhost") else socket.gethostname())
    return store, manager


class Lighthouse:
    """Starts torchft's lighthouse (the quorum server) on ``bind``.

    Equivalent command line (from the torchft wheel):
    ``torchft_lighthouse --min_replicas 2 --bind 127.0.0.1:29510 --join_timeout_ms 1000``.

    Args:
        min_workers: a step needs at least this many live workers (fewer: the quorum
            waits, up to the trainers' ``quorum_timeout_seconds``).
        bind: ``host:port`` to listen on (port 0: a free one).
        join_timeout_seconds: how long a quorum waits for workers that are alive
            (heartbeating) but not yet asking, before going on without them.
        heartbeat_timeout_seconds: a worker whose heartbeats (every 0.1 s) stop for
            this long is dead, and the next quorum goes on without it.

    Raises:
        ImportError: torchft is not installed.
        ValueError: ``min_workers`` below 1, non-positive timeouts.

    Example:
        >>> lighthouse = Lighthouse(min_workers=2)
        >>> lighthouse.address.startswith("http://127.0.0.1:")
        True
        >>> lighthouse.close()
    """

    def __init__(self, min_workers: int, *, bind: str = "127.0.0.1:0",
                 join_timeout_seconds: float = 1.0,
                 heartbeat_timeout_seconds: float = 2.0) -> None:
        if isinstance(min_workers, bool) or not isinstance(min_workers, int) or min_workers < 1:
            raise ValueError(f"min_workers must be an int >= 1; got {min_workers!r}")
        for name, value in (("join_timeout_seconds", join_timeout_seconds),
                            ("heartbeat_timeout_seconds", heartbeat_timeout_seconds)):
            if not value > 0:
                raise ValueError(f"{name} must be > 0; got {value!r}")
        native = require_torchft("Lighthouse")
        self._server = native.LighthouseServer(
            bind=bind, min_replicas=min_workers,
            join_timeout_ms=int(join_timeout_seconds * 1000),
            heartbeat_timeout_ms=int(heartbeat_timeout_seconds * 1000))
        host = bind.rsplit(":", 1)[0]
        port = self._server.address().rsplit(":", 1)[1]
        # torchft reports the machine's host name; a specific address asked for is the
        # one to use (for all interfaces, the host name).
        if host in ("", "0.0.0.0", "[::]"):
            host = socket.gethostname()
        self.address = f"http://{host}:{port}"
        _log.info("elastic: lighthouse at %s (min %d workers)", self.address, min_workers)

    def close(self) -> None:
        """Stops the server."""
        self._server.shutdown()

    def __repr__(self) -> str:
        return f"Lighthouse({self.address})"
