"""The public constructors: `MirroredStrategy`, `OneDeviceStrategy` and the default
strategy, each one configuration of `Strategy` (a topology, a runtime, communicators
and options), registered with the context module for `get_strategy()`."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import final

import torch

from .. import context
from ..comm.cross_device_ops import CrossDeviceOps
from ..comm.selection import CommunicatorSelector
from ..devices import Device, parse_device, parse_devices
from ..options import CommunicationOptions
from ..runtime.runtime import InlineRuntime, ThreadRuntime
from ..topology import Topology
from .strategy import Strategy

__all__ = ["MirroredStrategy", "OneDeviceStrategy", "default_strategy"]


def _options(options: CommunicationOptions | None) -> CommunicationOptions:
    if options is None:
        return CommunicationOptions()
    if not isinstance(options, CommunicationOptions):
        raise TypeError("communication_options must be a mirrored.experimental."
                        f"CommunicationOptions; got {type(options).__name__}")
    return options


def _local_parts(cls_name: str, devices: Sequence[Device], cross_device_ops: CrossDeviceOps |
                 None, options: CommunicationOptions, per_replica_random: bool = True
                 ) -> tuple[Topology, ThreadRuntime, CommunicatorSelector]:
    topology = Topology(devices=tuple(devices))
    selector = CommunicatorSelector(topology.devices, cross_device_ops, options)
    runtime = ThreadRuntime(topology, cls_name, timeout_seconds=options.timeout_seconds,
                            per_replica_random=per_replica_random)
    return topology, runtime, selector


@final
class MirroredStrategy(Strategy):
    """Synchronous data parallelism over the replicas of one process.

    Args:
        devices: replica devices (``"CPU:0"``, ``"GPU:1"``, ``"cuda:0"``, canonical
            names). ``CPU:k`` are logical CPU devices: several replicas on the host.
            Default: every visible CUDA device, else one CPU replica.
        cross_device_ops: a `CrossDeviceOps`; default: NCCL when every replica has
            its own GPU, else `ReductionToOneDevice`. It wins over an ``AUTO``
            implementation; a contradicting ``RING``/``NCCL`` is a ``ValueError``.
        communication_options: default `CommunicationOptions` for collectives
            (beyond TF, where only the multi-worker strategy takes them). With a
            ``timeout_seconds``, replica 0 runs on a thread of its own too, so ``run``
            returns within the timeout even if a replica is stuck in user code.
        per_replica_random: with several replicas, each draws its CPU random numbers
            from a stream of its own, seeded from the caller's generator (reproducible
            under ``torch.manual_seed``); ``False`` shares the CPU generator (draws then
            depend on thread timing). A GPU replica's draws on its device use the
            device's generator.

    Raises:
        ValueError: an empty list, duplicates, a malformed name, a GPU that is not
            visible, or options that contradict ``cross_device_ops``.

    Example:
        >>> import torch, mirrored
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> def step_fn():
        ...     i = mirrored.get_replica_context().replica_id_in_sync_group
        ...     return torch.tensor(i)
        >>> per_replica_result = strategy.run(step_fn)
        >>> strategy.reduce("SUM", per_replica_result, axis=None)
        tensor(1)
    """

    def __init__(self, devices: Sequence[str | torch.device] | None = None,
                 cross_device_ops: CrossDeviceOps | None = None, *,
                 communication_options: CommunicationOptions | None = None,
                 per_replica_random: bool = True) -> None:
        if devices is None:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            devices = [f"GPU:{i}" for i in range(count)] or ["CPU:0"]
        options = _options(communication_options)
        topology, runtime, selector = _local_parts(type(self).__name__, parse_devices(devices),
                                                   cross_device_ops, options, per_replica_random)
        super().__init__(topology=topology, runtime=runtime, communicators=selector,
                         options=options)


@final
class OneDeviceStrategy(Strategy):
    """One replica on one device: ``run`` calls ``fn`` there directly.

    Example:
        >>> import torch, mirrored
        >>> strategy = mirrored.OneDeviceStrategy("CPU:0")
        >>> strategy.run(lambda: torch.tensor(3.0))
        tensor(3.)
    """

    def __init__(self, device: str | torch.device) -> None:
        options = CommunicationOptions()
        topology, runtime, selector = _local_parts(type(self).__name__, parse_devices([device]),
                                                   None, options)
        super().__init__(topology=topology, runtime=runtime, communicators=selector,
                         options=options, raw_single_values=True)


@final
class _DefaultStrategy(Strategy):
    """What `get_strategy` returns outside any scope: one replica that is the caller.

    ``run`` calls ``fn`` directly, on the caller's thread and device; ``reduce`` of a
    plain value returns it (MEAN, MIN, MAX and SUM alike, since there is one
    replica); its methods work in its scope and in its replica context, as in TF.
    Its nominal device name is the host CPU's."""

    def __init__(self) -> None:
        topology = Topology(devices=(parse_device("CPU:0"),), follows_caller=True)
        options = CommunicationOptions()
        super().__init__(topology=topology, runtime=InlineRuntime(),
                         communicators=CommunicatorSelector(topology.devices, None, options),
                         options=options, raw_single_values=True)

    def __repr__(self) -> str:
        return "<default strategy>"


_default: _DefaultStrategy | None = None
_default_lock = threading.Lock()


def default_strategy() -> Strategy:
    """The process-wide default strategy."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = _DefaultStrategy()
    return _default


context.register_default_strategy(default_strategy)
