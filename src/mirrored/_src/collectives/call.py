"""What every replica-context collective shares: the call site, the conversion of a
nest to this replica's tensors, the refusals (inside a ``merge_fn``), and sums whose
element counts ride in the same call."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .. import context, pytree
from ..comm.communicator import Communicator
from ..devices import Device
from ..reduce_op import ReduceOp
from ..reduction import masked_shape
from ..runtime.contract import CallSpec
from ..values import DistributedValues, to_tensor
from .parts import Parts

_STRIDED = torch.strided

__all__ = ["call_site", "call_spec", "check_layout", "counts_ride", "paths_of",
           "refuse_in_merge_fn", "sum_with_counts", "tensors_of", "with_paths"]

T = TypeVar("T")
_HOST = (Device("CPU", 0),)  # where counts read on the host are sent


def counts_ride(parts: Parts, base_op: ReduceOp) -> bool:
    """Whether a reduction whose values combine with ``base_op`` sends its element
    counts in its own call (`sum_with_counts`): a SUM across the workers of a fixed
    job (an elastic job's counts are its step's replicas, `sum_counts`'s)."""
    topology = parts.topology
    return base_op is ReduceOp.SUM and topology.num_workers > 1 and not topology.elastic


def sum_with_counts(communicator: Communicator, values: Sequence[Sequence[torch.Tensor]],
                    counts: Sequence[Sequence[int]], destinations: Sequence[tuple[Device, ...]],
                    bytes_per_pack: int, label: str = ""
                    ) -> tuple[list[list[torch.Tensor]], list[int]]:
    """``communicator.reduce_packed`` SUM of each local replica's ``values`` (one list
    per replica) and their element ``counts`` (one int per value) summed in the same
    call, as an int64 pack beside the values sent to the host that reads it: across
    workers one checked call where `Communicator.sum_counts` first would be a round
    trip of its own. Returns the sums (as ``reduce_packed``) and the global counts.
    ``label``: what the workers compare besides the values' sizes (`reduce_op.op_label`)."""
    reduced = communicator.reduce_packed(ReduceOp.SUM, [
        [*v, torch.tensor(list(c), dtype=torch.int64, device=v[0].device if v else None)]
        for v, c in zip(values, counts, strict=True)], [*destinations, _HOST], bytes_per_pack,
        label)
    totals = reduced.pop()[0]
    return reduced, [int(n) for n in totals.tolist()]


_LIBRARY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_basenames: dict[str, str] = {}  # file name -> its base name (call sites are per step)


def call_site(depth: int) -> str:
    """``file.py:line`` of the frame ``depth`` levels above the caller, or of the first
    frame above it outside this library (so a collective made by the library for the
    user, e.g. in ``compute_average_loss``, names the user's line)."""
    frame = sys._getframe(depth + 1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY):
        frame = frame.f_back
    filename = frame.f_code.co_filename
    base = _basenames.get(filename)
    if base is None:
        base = os.path.basename(filename)
        if len(_basenames) < 4096:
            _basenames[filename] = base
    return f"{base}:{frame.f_lineno}"


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the caller name the first
    frame outside this library (the user's line): `call_site`'s walk, counted (kept
    apart: `call_site` runs at every collective, this only when a warning is due)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_LIBRARY):
        frame, level = frame.f_back, level + 1
    return level


def paths_of(value: Any) -> list[str]:
    """The printable path of every leaf of ``value`` (``value['a'][0]``)."""
    return [pytree.format_path(path) for path in pytree.flatten_with_path(value)[0]]


def with_paths(value: Any, n: int, plan: Callable[[Sequence[str]], T]) -> T:
    """``plan(wheres)`` with placeholder paths, redone with the real paths of ``value``
    if it raises, so that only error messages pay for computing paths."""
    try:
        return plan(["value"] * n)
    except (TypeError, ValueError):
        return plan(paths_of(value))


def check_layout(title: str, tensor: torch.Tensor, where: str) -> None:
    """Refuses tensors the collectives cannot pack: sparse or other non-strided
    layouts (meta tensors pass: one replica's collectives keep them, shapes only).

    Raises:
        TypeError: naming the layout or device and where the tensor is.

    Example:
        >>> check_layout("reduce(SUM)", torch.ones(2), "value")
        >>> check_layout("reduce(SUM)", torch.eye(2).to_sparse(), "value")
        Traceback (most recent call last):
        ...
        TypeError: reduce(SUM) takes dense (strided) tensors; got a torch.sparse_coo tensor ...
    """
    if tensor.layout is not torch.strided:
        raise TypeError(f"{title} takes dense (strided) tensors; got a {tensor.layout} tensor "
                        f"at {where}; convert it first (x.to_dense())")


def tensors_of(value: Any, title: str) -> tuple[list[torch.Tensor], pytree.PyTreeSpec]:
    """This replica's leaves of ``value`` as tensors, and its structure.

    Raises:
        TypeError: a distributed value, or a leaf that is not a tensor, number or array.
    """
    leaves, spec = pytree.flatten(value)
    tensors = []
    for k, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            where = paths_of(value)[k]
            if isinstance(leaf, DistributedValues):
                raise TypeError(
                    f"{title} takes this replica's own tensors; got a {type(leaf).__name__} at "
                    f"{where}. Pass values from inside strategy.run")
            leaf = to_tensor(leaf, where, title)
        elif leaf.layout is not _STRIDED:
            check_layout(title, leaf, paths_of(value)[k])
        tensors.append(leaf)
    return tensors, spec


def refuse_in_merge_fn(parts: Parts, title: str, site: str) -> None:
    """Collectives (and backward passes through them) cannot run inside a merge_fn."""
    if parts.topology.num_replicas_in_sync > 1 and context.in_merge_fn_of_run():
        raise RuntimeError(
            f"{title} at {site} was called inside a merge_fn; collectives, and backward "
            "passes through them, must run in the replicas, not in merge_fn")


def call_spec(title: str, site: str, spec: pytree.PyTreeSpec, tensors: Sequence[torch.Tensor],
              free_dims: Sequence[Sequence[int]], value: Any) -> CallSpec:
    """What the contract compares for one replica's call: title, structure, dtypes and
    shapes with each leaf's ``free_dims`` (reduced or gathered; they may differ
    between replicas) masked."""
    dtypes = tuple(t.dtype for t in tensors)
    shapes = tuple(masked_shape(t.shape, dims) if dims else tuple(t.shape)
                   for t, dims in zip(tensors, free_dims, strict=True))
    return CallSpec(title, site, (title, spec, shapes, dtypes), spec,
                    tuple(zip(dtypes, (tuple(t.shape) for t in tensors), strict=True)), value)
