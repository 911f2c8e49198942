"""Distributed values: `PerReplica` and `Mirrored`, and moving between them and nests.

A distributed value holds one component per local replica, in replica order,
with the canonical name of each component's device. It is a pytree *leaf*: a
list, dict, tuple, namedtuple or dataclass of them is a nest that every strategy
method walks leaf by leaf. There is no attribute forwarding: reach a component
through ``.values`` or ``strategy.experimental_local_results``.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Sequence
from typing import Any, Generic, NamedTuple, TypeVar, final

import torch

from . import pytree
from .devices import canonical_name_of, parse_device

__all__ = [
    "DistributedValues",
    "Mirrored",
    "PerReplica",
    "StepExamples",
    "ValueContext",
    "regroup",
    "select_replica",
    "to_tensor",
]

T = TypeVar("T")

_HOST = torch.device("cpu")


@functools.lru_cache(maxsize=1024)
def _canonical(device: str) -> str:
    """The canonical name of a device spelling (cached: `regroup` runs every step)."""
    return parse_device(device).name


def _device_name(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return canonical_name_of(value.device)
    return canonical_name_of(_HOST)


class DistributedValues(Generic[T]):
    """Base class of values with one component per local replica.

    Args:
        values: one component per replica, in replica order.
        devices: the device of each component (any spelling `parse_device`
            accepts); by default each tensor's own device.

    Raises:
        ValueError: no components, or ``devices`` of the wrong length.
    """

    __slots__ = ("_devices", "_values")

    def __init__(self, values: Sequence[T], devices: Sequence[str] | None = None) -> None:
        if type(self) is DistributedValues:
            raise TypeError("DistributedValues is abstract; construct PerReplica or Mirrored")
        if isinstance(values, str | bytes) or not isinstance(values, Sequence):
            raise TypeError(
                f"{type(self).__name__} takes a sequence with one value per replica; "
                f"got {type(values).__name__}"
            )
        values = tuple(values)
        if not values:
            raise ValueError(f"{type(self).__name__} needs at least one component; got none")
        if devices is None:
            names = tuple(_device_name(v) for v in values)
        else:
            names = tuple(_canonical(d) for d in devices)
            if len(names) != len(values):
                raise ValueError(
                    f"{type(self).__name__} got {len(values)} values but {len(names)} devices"
                )
        self._values: tuple[T, ...] = values
        self._devices: tuple[str, ...] = names

    @classmethod
    def _from_trusted(cls, values: tuple[T, ...], devices: tuple[str, ...]) -> Any:
        """Builds one from already checked components and canonical device names."""
        made = object.__new__(cls)
        made._values = values
        made._devices = devices
        return made

    @property
    def values(self) -> tuple[T, ...]:
        """The components, one per local replica, in replica order."""
        return self._values

    @property
    def devices(self) -> tuple[str, ...]:
        """The canonical device name of each component."""
        return self._devices

    def __repr__(self) -> str:
        body = ", ".join(f"{i}: {v!r}" for i, v in enumerate(self._values))
        return f"{type(self).__name__}:{{{body}}}"


@final
class PerReplica(DistributedValues[T]):
    """One value per local replica; what `run` returns where replicas differ.

    Example:
        >>> import torch
        >>> from mirrored import PerReplica
        >>> v = PerReplica([torch.tensor(0), torch.tensor(1)], devices=["CPU:0", "CPU:1"])
        >>> v
        PerReplica:{0: tensor(0), 1: tensor(1)}
        >>> v.devices[1]
        '/job:localhost/replica:0/task:0/device:CPU:1'
    """

    # A batch of a multi-worker distributed dataset: its `StepExamples` (unset otherwise).
    __slots__ = ("_examples",)
    _examples: StepExamples | None

    def __eq__(self, other: object) -> bool:
        """Numbers on every replica equal the number they all are (``run`` returns
        numbers one per replica: ``strategy.run(lambda: 1) == 1`` holds, as in TF,
        where the same object is returned as is); anything else compares as itself."""
        if isinstance(other, numbers.Number) and all(
                isinstance(v, numbers.Number) for v in self.values):
            return all(v == other for v in self.values)
        return NotImplemented

    __hash__ = DistributedValues.__hash__


class StepExamples(NamedTuple):
    """The example counts of one step of a multi-worker ``experimental_distribute_dataset``
    (every worker splits the same global batch, so each knows them all): ``total``, the
    global batch's rows, and ``sizes``, each local replica's. ``compute_average_loss``
    divides by ``total`` without counting when a replica's per-example loss has its
    batch's rows (see `loss.compute_average_loss`). ``digest``: a hash of a sample of
    the global batch's elements (`data.steps.sample_digest`), equal on workers given
    the same batch.

    Example:
        >>> StepExamples(total=7, sizes=(4,))
        StepExamples(total=7, sizes=(4,), digest=0)
    """

    total: int
    sizes: tuple[int, ...]
    digest: int = 0


@final
class Mirrored(DistributedValues[T]):
    """One value per local replica, known to be equal on every replica.

    Example:
        >>> import torch
        >>> from mirrored import Mirrored
        >>> Mirrored([torch.tensor(2.0), torch.tensor(2.0)], devices=["CPU:0", "CPU:1"])
        Mirrored:{0: tensor(2.), 1: tensor(2.)}
    """

    __slots__ = ()


pytree.register_leaf_type(DistributedValues)


@dataclasses.dataclass(frozen=True, slots=True)
class ValueContext:
    """What `experimental_distribute_values_from_function` tells ``value_fn``.

    Example:
        >>> from mirrored import ValueContext
        >>> ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=2)
        ValueContext(replica_id_in_sync_group=1, num_replicas_in_sync=2)
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1


def to_tensor(value: Any, where: str, what: str, hint: str = "") -> torch.Tensor:
    """``value`` as a tensor (Python numbers and NumPy arrays are converted).

    Raises:
        TypeError: naming ``what`` was called, the type got, and ``where`` it was.
    """
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError):
        raise TypeError(
            f"{what} expects tensors, Python numbers or NumPy arrays; got "
            f"{type(value).__name__} at {where}{hint}"
        ) from None


def select_replica(index: int, leaves: Sequence[Any]) -> list[Any]:
    """Component ``index`` of each distributed leaf; other leaves pass through."""
    return [
        leaf.values[index] if isinstance(leaf, DistributedValues) else leaf for leaf in leaves
    ]


def regroup(results: Sequence[Any], devices: Sequence[str], *,
            collapse_identical: bool = True, always_per_replica: bool = False,
            numbers_per_replica: bool = False, passed_to: str = "") -> Any:
    """Packs what each replica returned into one nest of `PerReplica` leaves
    (``passed_to``: what the replicas passed them to, for messages, e.g. a
    ``merge_call``'s ``(args, kwargs)``; by default they returned them from ``run``).

    Leaves that every replica returned as the same object (``is``) stay as they
    are, unless ``collapse_identical`` is false, or ``numbers_per_replica`` and they
    are ints or floats (what `run` returns: Python caches small ints, so equal counts
    from ``.item()`` or ``len()`` are one object, and still one per replica). With
    one replica the result is returned unchanged, unless ``always_per_replica``.

    Raises:
        ValueError: the replicas returned different structures.
    """
    if len(results) == 1 and not always_per_replica:
        return results[0]
    first = results[0]
    if first is None and collapse_identical and all(r is None for r in results):
        return None  # the common no-result step, without flattening
    if type(first) is torch.Tensor and all(type(r) is torch.Tensor for r in results):
        if collapse_identical and all(r is first for r in results):
            return first
        return PerReplica._from_trusted(tuple(results), tuple(_canonical(d) for d in devices))
    flat = [pytree.flatten(r) for r in results]
    spec0 = flat[0][1]
    for i in range(1, len(flat)):
        if flat[i][1] != spec0:
            root = "(args, kwargs)" if passed_to else "result"
            diff = pytree.first_difference(results[0], results[i], root)
            where, got0, got_i = diff if diff is not None else (root, str(spec0),
                                                                str(flat[i][1]))
            verb, to = ("passed", f" to {passed_to}") if passed_to else ("returned", "")
            raise ValueError(
                f"replicas {verb} different structures{to}: at {where}, replica 0 {verb} "
                f"{got0} but replica {i} {verb} {got_i}; every replica must {verb[:-2]} the "
                "same nest"
            )
    names = tuple(_canonical(d) for d in devices)
    grouped = []
    for components in zip(*(f[0] for f in flat), strict=True):
        first = components[0]
        if collapse_identical and all(c is first for c in components) and not (
                numbers_per_replica and type(first) in (int, float)):
            grouped.append(first)
        else:
            grouped.append(PerReplica._from_trusted(components, names))
    return pytree.unflatten(spec0, grouped)
