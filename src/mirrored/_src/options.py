"""Communication options: how collectives pack their data, how long they wait, and
which implementation moves it."""

from __future__ import annotations

import dataclasses
import enum
import math
import threading

__all__ = ["DEFAULT_BYTES_PER_PACK", "CommunicationImplementation", "CommunicationOptions"]

DEFAULT_BYTES_PER_PACK = 25 * (1 << 20)


class CommunicationImplementation(enum.Enum):
    """Which collective implementation to use.

    ``AUTO`` picks NCCL when every replica is on its own CUDA device and the host
    path otherwise; ``RING`` is the host (Gloo-style) path; ``NCCL`` requires CUDA
    replicas.

    Example:
        >>> from mirrored.experimental import CommunicationImplementation
        >>> CommunicationImplementation.from_value("nccl")
        <CommunicationImplementation.NCCL: 'NCCL'>
    """

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"

    @classmethod
    def from_value(cls, value: CommunicationImplementation | str) -> CommunicationImplementation:
        """Accepts a member or its name in any case.

        Raises:
            ValueError: an unknown name or another type.
        """
        if isinstance(value, CommunicationImplementation):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        raise ValueError(
            f"implementation must be one of CommunicationImplementation.AUTO, RING, NCCL (or "
            f"their names); got {type(value).__name__} {value!r}"
        )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CommunicationOptions:
    """Options for collectives, set per strategy and overridable per call.

    Args:
        bytes_per_pack: leaves of one dtype are packed into buffers of at most
            this many bytes, each reduced once (0: one pack per dtype). Default 25 MiB.
        timeout_seconds: how long a replica waits for the others in a collective
            before `CollectiveTimeoutError`; ``None`` waits without limit.
        implementation: a `CommunicationImplementation` (or its name).

    Raises:
        ValueError: a negative or non-integer ``bytes_per_pack``, a
            non-positive ``timeout_seconds``, or an unknown implementation.

    Example:
        >>> from mirrored.experimental import CommunicationOptions
        >>> CommunicationOptions(bytes_per_pack=1024, timeout_seconds=5).timeout_seconds
        5.0
    """

    bytes_per_pack: int = DEFAULT_BYTES_PER_PACK
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO

    def __post_init__(self) -> None:
        if (isinstance(self.bytes_per_pack, bool) or not isinstance(self.bytes_per_pack, int)
                or self.bytes_per_pack < 0):
            raise ValueError(
                "bytes_per_pack must be an int >= 0 (0 packs each dtype into one buffer); got "
                f"{type(self.bytes_per_pack).__name__} {self.bytes_per_pack!r}"
            )
        timeout = self.timeout_seconds
        if timeout is not None:
            if (isinstance(timeout, bool) or not isinstance(timeout, int | float)
                    or not math.isfinite(timeout) or not 0 < timeout <= threading.TIMEOUT_MAX):
                raise ValueError(
                    "timeout_seconds must be None (no limit) or a finite number of seconds "
                    f"> 0 and <= {threading.TIMEOUT_MAX:g}; got {type(timeout).__name__} "
                    f"{timeout!r}"
                )
            object.__setattr__(self, "timeout_seconds", float(timeout))
        object.__setattr__(self, "implementation",
                           CommunicationImplementation.from_value(self.implementation))

    def merge(self, other: CommunicationOptions | None) -> CommunicationOptions:
        """These options, overridden by each field of ``other`` that is not a default.

        Raises:
            TypeError: ``other`` is neither ``None`` nor `CommunicationOptions`.
        """
        if other is None:
            return self
        if not isinstance(other, CommunicationOptions):
            raise TypeError(
                f"options must be a mirrored.experimental.CommunicationOptions or None; got "
                f"{type(other).__name__}"
            )
        defaults = CommunicationOptions()
        changes = {f.name: getattr(other, f.name) for f in dataclasses.fields(other)
                   if getattr(other, f.name) != getattr(defaults, f.name)}
        return dataclasses.replace(self, **changes) if changes else self
