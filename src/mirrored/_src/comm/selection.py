"""Which `CrossDeviceOps` a collective uses: chosen once per implementation from the
strategy's explicit ``cross_device_ops`` and its `CommunicationOptions`, and cached.

Rules: an explicit ``cross_device_ops`` wins over ``AUTO``; ``RING`` or ``NCCL``
(strategy-wide or per call) that contradicts an explicit built-in one is a
`ValueError` naming both; without an explicit one, ``AUTO`` picks NCCL when every
replica has its own GPU, else the host path; ``NCCL`` on CPU replicas is a
`ValueError`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, final

from ..devices import Device
from ..options import CommunicationImplementation, CommunicationOptions
from .communicator import Communicator
from .cross_device_ops import CrossDeviceOps, NcclAllReduce, ReductionToOneDevice
from .local import LocalCommunicator

__all__ = ["CommunicatorSelector"]

_RING = CommunicationImplementation.RING
_NCCL = CommunicationImplementation.NCCL
_AUTO = CommunicationImplementation.AUTO


@final
class CommunicatorSelector:
    """Hands out the communicator for a call's options.

    Args:
        devices: the local replica devices.
        explicit: the strategy's ``cross_device_ops`` argument, if any.
        options: the strategy's communication options.
        wrap: builds a communicator over a `CrossDeviceOps` (local by default; the
            multi-worker strategy wraps it in a two-level one).
        retime: ``retime(communicator, timeout_seconds)``: the communicator for a call
            whose options carry another timeout than the strategy's (multi-worker: the
            cross-worker waits honour a per-call timeout); ``None``: one per implementation.

    Raises:
        TypeError: ``explicit`` is not a `CrossDeviceOps`.
        ValueError: the options contradict ``explicit``, or ask for NCCL on
            replicas that are not all on their own GPUs.
    """

    __slots__ = ("_all_gpus", "_cache", "_devices", "_explicit", "_lock", "_options",
                 "_retime", "_wrap", "default")

    def __init__(self, devices: Sequence[Device], explicit: CrossDeviceOps | None,
                 options: CommunicationOptions,
                 wrap: Callable[[CrossDeviceOps], Communicator] = LocalCommunicator,
                 retime: Callable[[Communicator, float | None], Communicator] | None = None
                 ) -> None:
        if explicit is not None and not isinstance(explicit, CrossDeviceOps):
            raise TypeError("cross_device_ops must be a mirrored.CrossDeviceOps such as "
                            f"ReductionToOneDevice(); got {type(explicit).__name__}")
        self._devices = tuple(devices)
        self._all_gpus = len(self._devices) > 1 and all(d.kind == "GPU" for d in self._devices)
        self._explicit = explicit
        self._options = options
        self._wrap = wrap
        self._retime = retime
        self._lock = threading.Lock()
        self._cache: dict[Any, Communicator] = {}
        self.default: Communicator = self.for_options(options)

    @property
    def cross_device_ops(self) -> CrossDeviceOps:
        """The `CrossDeviceOps` behind the strategy's default options."""
        return self._ops(self._options.implementation)

    def for_options(self, options: CommunicationOptions) -> Communicator:
        """The communicator for a call with ``options`` (already merged with the
        strategy's)."""
        implementation = options.implementation
        found = self._cache.get(implementation)
        if found is None:
            with self._lock:
                found = self._cache.get(implementation)
                if found is None:
                    found = self._cache[implementation] = self._wrap(self._ops(implementation))
        timeout = options.timeout_seconds
        if self._retime is None or timeout == self._options.timeout_seconds:
            return found
        key = (implementation, timeout)
        with self._lock:
            retimed = self._cache.get(key)
            if retimed is None:
                retimed = self._cache[key] = self._retime(found, timeout)
        return retimed

    def _ops(self, implementation: CommunicationImplementation) -> CrossDeviceOps:
        explicit = self._explicit
        if explicit is not None:
            conflict = ((implementation is _RING and isinstance(explicit, NcclAllReduce))
                        or (implementation is _NCCL and isinstance(explicit, ReductionToOneDevice)))
            if conflict:
                raise ValueError(
                    f"cross_device_ops={explicit!r} and communication_options implementation="
                    f"{implementation.name} disagree; pass one of them, or make them agree "
                    "(RING is ReductionToOneDevice, NCCL is NcclAllReduce)")
            return explicit
        if implementation is _NCCL and not self._all_gpus:
            raise ValueError(
                "implementation NCCL needs every replica on its own CUDA device; this "
                f"strategy's replicas are on {', '.join(d.short_name for d in self._devices)}. "
                "Use AUTO or RING")
        if implementation is _NCCL or (implementation is _AUTO and self._all_gpus):
            return NcclAllReduce()
        return ReductionToOneDevice()
