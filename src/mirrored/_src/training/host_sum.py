"""`HostSum`: a mirrored optimizer's gradient SUM among the host replicas of one
process, each replica adding on its own thread.

The general all-reduce has the last replica to arrive combine for everyone: it packs
every replica's gradients, adds the packs and copies the total once per further
replica while the others wait (on the 2-core machine, 0.8 ms of a 3.9 ms step of the
64-256-256-10 MLP on 2 replicas, all on one thread). Here the replicas only meet to
hand each other their tensors; each then adds every replica's tensors, in replica
order, into new tensors of its own, on its own thread: at the same time as the
others in a step's usual run, one after another in a baton run (short steps, see
docs/design.md). The additions are the ones the packed path makes, in the same
order, so the totals are bitwise the same; no pack and no copy is made.

A replica reads the others' tensors after the meeting, while they may already be
past it (in a baton run the last to arrive adds first and goes on to its next
collective, maybe the next step's): what a replica changes in place after its sum
is handed over as copies (the step's meta vector of flags, fingerprints and divisor
slots, written again at the next step; its BatchNorm statistics and other buffers,
copied into when averaged). Gradients are handed over as they are: ``.grad`` then
holds the new totals, and the library writes only those (a program that keeps the
old ``.grad`` tensors and writes them itself within the run is not covered).
Gradients with autograd history (``backward(create_graph=True)``) keep the packed
path, whose all-reduce is differentiable: added here, one replica's gradients would
hold the others' graphs.

Each replica makes N - 1 additions instead of one replica making N - 1 additions,
N packs and N - 1 copies. Measured on the 2-core machine (MLPs, SGD, batch 64 and
256, the whole step against the packed path in alternation): 1.15-1.25x faster with
340 KiB of gradients on 2, 3, 4 and 8 replicas, and 1.11-1.18x with 1.1 MiB on 4 and
8; with 12.6 MiB 1.16x on 2 replicas, even on 4, 0.82x on 8, where the N - 1
additions per replica outgrow the cores. Hence 2 replicas always, and up to
`HOST_SUM_REPLICAS` while the gradients stay within `HOST_SUM_BYTES`.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import torch

from ..collectives.parts import Parts
from ..comm.cross_device_ops import sums_directly
from ..reduce_op import ReduceOp
from ..reduction import check_dtype, describe
from ..runtime.contract import Arrival, CallSpec, CollectiveFailure

__all__ = ["HOST_SUM_BYTES", "HOST_SUM_REPLICAS", "HostSum"]


# Beyond 2 replicas, the most replicas and the most bytes of parameters per replica
# summed this way (every replica adds N - 1 times: see the module docstring).
HOST_SUM_REPLICAS = 8
HOST_SUM_BYTES = 1 << 20


class HostSum:
    """Sums one replica's leaves with every other local replica's (see the module
    docstring); use `applies` to decide whether a strategy's replicas can.

    Args:
        parts: the strategy's parts (runtime, options).
        site: how messages name the step's gradients.
        label: the mirrored optimizer's step (``"MirroredOptimizer.step (the optimizer
            of mirrored model #1)"``), the meeting's title and key: two models' steps
            met by different replicas are a `CollectiveMismatchError` naming both.
        names: how messages name the leaves, in order (`buffers.leaf_names`).

    Example:
        >>> import torch, mirrored
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> HostSum.applies(strategy._parts, [torch.zeros(1 << 20)])  # (2: any size)
        True
    """

    __slots__ = ("_hand_over", "_key", "_leaves", "_parts", "_site")

    def __init__(self, parts: Parts, site: str, label: str, names: Sequence[str] = ()
                 ) -> None:
        self._parts = parts
        self._key = label
        self._site = site
        self._hand_over = functools.partial(_hand_over, self._site, tuple(names))
        self._leaves: dict[int, tuple[tuple[torch.dtype, tuple[int, ...]], ...]] = {}

    @staticmethod
    def applies(parts: Parts, params: Sequence[torch.Tensor]) -> bool:
        """Whether ``parts``' replicas are host replicas of one process whose
        communicator sums as the packed path does (the default `ReductionToOneDevice`,
        no ``accumulation_fn``), 2 of them, or up to `HOST_SUM_REPLICAS` while
        ``params`` (a replica's) hold at most `HOST_SUM_BYTES`."""
        topology = parts.topology
        n = topology.num_local_replicas
        return (topology.num_workers == 1 and not topology.elastic
                and (n == 2 or (2 < n <= HOST_SUM_REPLICAS and sum(
                    p.numel() * p.element_size() for p in params) <= HOST_SUM_BYTES))
                and all(d.type == "cpu" for d in topology.torch_devices)
                and sums_directly(parts.communicators.for_options(parts.options)))

    def __call__(self, index: int, leaves: list[Any], mutable: int) -> list[torch.Tensor]:
        """Local replica ``index``'s ``leaves`` summed over every local replica, in
        replica order, in new tensors. The last ``mutable`` leaves are ones the replica
        changes in place after its sum: the others read copies of them."""
        if mutable:
            leaves = [*leaves[:-mutable], *(t.clone() for t in leaves[-mutable:])]
        described = self._leaves.get(len(leaves))  # (for messages; a step's are alike)
        if described is None:
            described = self._leaves[len(leaves)] = tuple(
                (t.dtype, tuple(t.shape)) for t in leaves)
        call = CallSpec(self._key, self._site, (self._key, len(leaves)),
                        leaves=described)
        parts = self._parts
        every: Sequence[list[torch.Tensor]] = parts.runtime.exchange(
            index, Arrival(call, leaves, self._hand_over), parts.options.timeout_seconds)
        total = list(torch._foreach_add(every[0], every[1]))
        for other in every[2:]:
            torch._foreach_add_(total, other)
        return total


def _hand_over(site: str, names: tuple[str, ...], payloads: Sequence[list[torch.Tensor]]
               ) -> list[Sequence[list[torch.Tensor]]]:
    """Every replica gets every replica's leaves, once their shapes and dtypes agree
    and torch can add them (a step's Python: compared by C-level maps, each dtype
    checked once; ``site``: the step's name in messages)."""
    first = payloads[0]
    shapes, dtypes = list(map(_SHAPE, first)), list(map(_DTYPE, first))
    for r, leaves in enumerate(payloads):
        if r and (list(map(_SHAPE, leaves)) != shapes or list(map(_DTYPE, leaves)) != dtypes):
            raise CollectiveFailure(RuntimeError, _differ_message(site, r, leaves, first, names))
    for dtype in set(dtypes):
        try:
            check_dtype("MirroredOptimizer.step", ReduceOp.SUM, dtype,
                        f"{site}, gradient or buffer {dtypes.index(dtype)}")
        except TypeError as error:
            raise CollectiveFailure(TypeError, str(error)) from None
    shared = tuple(payloads)
    return [shared] * len(payloads)


def _differ_message(site: str, r: int, leaves: Sequence[torch.Tensor],
                    first: Sequence[torch.Tensor], names: Sequence[str] = ()) -> str:
    where = f"MirroredOptimizer.step at {site}: replica {r}"
    if len(leaves) != len(first):
        got = f"hands over {len(leaves)} gradients and buffers, replica 0 {len(first)}"
        return (f"{where} {got}; expected the same on every replica (the copies of the "
                "model must stay alike: was one copy changed alone, model.replicas[i]?)")
    k = next(k for k, (a, b) in enumerate(zip(leaves, first, strict=True))
             if a.shape != b.shape or a.dtype != b.dtype)
    name = names[k] if k < len(names) and len(leaves) == len(names) else (
        f"gradient or buffer {k}")
    got = f"hands over {describe(leaves[k])} as {name}, where replica 0 has {describe(first[k])}"
    if name.startswith("buffer "):
        return (f"{where} {got}; the buffers of the copies are averaged at each step, so "
                "they must have the same shape on every replica. A buffer whose shape "
                "follows the replica's batch holds per-example state (a stateful RNN's "
                "hidden state), which averaging would mix across replicas even when the "
                "shapes agree: keep such state as a plain attribute (not register_buffer), "
                "one per copy")
    return (f"{where} {got}; expected the same on every replica (the copies of the model "
            "must stay alike: was one copy changed alone, model.replicas[i]?)")


_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")
