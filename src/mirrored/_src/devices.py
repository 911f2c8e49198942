"""Device names: parsing the short and TF-style spellings, canonical names, torch devices.

A replica's device is a `Device`. ``CPU:k`` names a *logical* CPU device: every
one of them computes on the host CPU (``torch.device("cpu")``), which is how
several replicas share one CPU. ``GPU:k`` (also spelled ``cuda:k``) is CUDA
device ``k``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence

import torch

__all__ = ["Device", "canonical_name_of", "current_device", "parse_device", "parse_devices"]

_DEVICE_RE = re.compile(
    r"""^(?:/job:(?P<job>[\w-]+))?
         (?:/replica:\d+)?
         (?:/task:(?P<task>\d+))?
         (?:/device:|/)?
         (?P<kind>cpu|gpu|cuda)
         (?::(?P<index>\d+))?$""",
    re.IGNORECASE | re.VERBOSE,
)


@dataclasses.dataclass(frozen=True, slots=True)
class Device:
    """One replica device: ``kind`` is ``"CPU"`` or ``"GPU"``."""

    kind: str
    index: int
    job: str = "localhost"
    task: int = 0

    @property
    def name(self) -> str:
        """The canonical TF-style name, ``/job:localhost/replica:0/task:0/device:CPU:0``."""
        return f"/job:{self.job}/replica:0/task:{self.task}/device:{self.kind}:{self.index}"

    @property
    def short_name(self) -> str:
        """``CPU:0`` or ``GPU:1``."""
        return f"{self.kind}:{self.index}"

    @property
    def torch_device(self) -> torch.device:
        """Where this device's tensors live: the host CPU for every logical CPU device."""
        if self.kind == "CPU":
            return torch.device("cpu")
        return torch.device("cuda", self.index)


def parse_device(spec: str | torch.device | Device, *, job: str = "localhost",
                 task: int = 0) -> Device:
    if isinstance(spec, str):
        return _parse_string(spec, job, task)
    return _parse(spec, job, task)


@functools.lru_cache(maxsize=1024)
def _parse_string(spec: str, job: str, task: int) -> Device:
    return _parse(spec, job, task)


def _parse(spec: str | torch.device | Device, job: str, task: int) -> Device:
    """Parses ``"CPU:1"``, ``"cpu"``, ``"GPU:0"``, ``"cuda:0"``, ``torch.device("cuda", 1)``
    or a canonical name (its job and task win over ``job``/``task``).

    Raises:
        ValueError: ``spec`` is not a device name.
        TypeError: ``spec`` is neither a string nor a device.
    """
    if isinstance(spec, Device):
        return spec
    if isinstance(spec, torch.device):
        spec = str(spec)
    if not isinstance(spec, str):
        raise TypeError(
            "a device must be a string such as 'CPU:0', 'GPU:1' or 'cuda:0', or a "
            f"torch.device; got {type(spec).__name__} {spec!r}"
        )
    match = _DEVICE_RE.match(spec.strip())
    if match is None:
        raise ValueError(
            f"{spec!r} is not a device name; expected 'CPU:k', 'GPU:k', 'cuda:k', 'cpu' or a "
            "canonical name such as '/job:localhost/replica:0/task:0/device:CPU:0'"
        )
    kind = "CPU" if match["kind"].lower() == "cpu" else "GPU"
    return Device(
        kind=kind,
        index=int(match["index"] or 0),
        job=match["job"] or job,
        task=int(match["task"]) if match["task"] is not None else task,
    )


def parse_devices(specs: Sequence[str | torch.device | Device], *, job: str = "localhost",
                  task: int = 0) -> tuple[Device, ...]:
    """Parses a list of device names; rejects an empty list, duplicates and missing GPUs."""
    if isinstance(specs, str | torch.device) or not isinstance(specs, Sequence):
        raise TypeError(
            "devices must be a list of device names such as ['CPU:0', 'CPU:1']; "
            f"got {type(specs).__name__} {specs!r}"
        )
    if not specs:
        raise ValueError("devices must name at least one device; got an empty list")
    devices = tuple(parse_device(s, job=job, task=task) for s in specs)
    seen: dict[Device, int] = {}
    for i, device in enumerate(devices):
        if device in seen:
            raise ValueError(
                f"devices must be distinct; {specs[seen[device]]!r} (position {seen[device]}) "
                f"and {specs[i]!r} (position {i}) both name {device.short_name}"
            )
        seen[device] = i
    gpus = [d for d in devices if d.kind == "GPU"]
    if gpus:
        available = torch.cuda.device_count()
        for device in gpus:
            if device.index >= available:
                raise ValueError(
                    f"device {device.short_name} was requested but this process sees "
                    f"{available} CUDA device(s)"
                )
    return devices


def canonical_name_of(device: torch.device, *, job: str = "localhost", task: int = 0) -> str:
    """The canonical name of a torch device (``cpu`` -> ``.../device:CPU:0``)."""
    if device.type == "cpu":
        return Device("CPU", 0, job, task).name
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return Device("GPU", index, job, task).name
    return f"/job:{job}/replica:0/task:{task}/device:{device.type.upper()}:{device.index or 0}"


def current_device() -> torch.device:
    """The device results go to: the one set by ``torch.device(...)`` or
    ``torch.set_default_device``, else the host CPU."""
    if torch._C._len_torch_function_stack() == 0:  # fast path: no device mode is active
        return _HOST
    return torch.get_default_device()


def default_device_set() -> bool:
    """Whether this thread set a default device (``torch.device(...)`` as a context,
    ``torch.set_default_device``): a `DeviceContext` among the torch function modes."""
    if torch._C._len_torch_function_stack() == 0:
        return False
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._device import DeviceContext
    return any(isinstance(m, DeviceContext)
               for m in _get_current_function_mode_stack())  # type: ignore[no-untyped-call]


_HOST = torch.device("cpu")
