"""`StepHyperParameters`: the hyper-parameters and state every local replica steps with.

Each replica steps its own torch optimizer; the learning rate and the other entries
of the parameter groups are replica 0's (a scheduler sets them on replica 0's, see
`MirroredOptimizer.param_groups`). Replica 0 publishes them as its ``step()`` finds
them, before the step's all-reduce, and every other local replica takes them after
that all-reduce: the meeting orders the two. Read from replica 0's optimizer after
the meeting instead, a step function that changes the learning rate after
``optimizer.step()`` raced with the replicas still stepping (some took the next
step's rate). A value another replica set itself since it last took replica 0's
(inside ``run``) must equal replica 0's: one computed from the replica's own share
of the batch (its loss) differs, and was silently replaced by replica 0's (TF
refuses a per-replica assignment to a mirrored variable); `take` raises.

Outside ``run`` the mirrored optimizer's ``state`` is replica 0's optimizer's. What
code changes there (``optimizer.state.clear()`` to reset Adam's moments, one
parameter's entry, a moment zeroed in place) reaches the other local replicas at
the next step: replica 0 compares its state with a signature taken when it was
handed out (each entry's keys, value objects and tensor versions) and, before the
step's all-reduce, copies the entries that changed into the others' optimizers.

Each replica's groups keep the parameters ``make_optimizer`` gave them (only their
values are replica 0's): once the groups were handed out outside ``run``, replica 0's
next step compares every replica's with those it was built with, before the all-reduce,
and a group appended or a parameter taken out or moved raises before any copy steps
(replica 0 would otherwise train other parameters than the others, silently).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["StepHyperParameters"]


class StepHyperParameters:
    """Replica 0's parameter groups (without their parameters) by step number.

    Example:
        >>> import torch
        >>> ps = [torch.zeros(1, requires_grad=True) for _ in range(2)]
        >>> opts = [torch.optim.SGD([p], lr=0.1) for p in ps]
        >>> hyper = StepHyperParameters(opts, [[p] for p in ps])
        >>> hyper.publish(0, 7)
        >>> opts[0].param_groups[0]["lr"] = 0.5  # replica 0 moved on
        >>> hyper.take(1, 7)
        >>> opts[1].param_groups[0]["lr"]
        0.1
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer],
                 params: Sequence[Sequence[torch.Tensor]]) -> None:
        self._optimizers, self._params = optimizers, params
        self._by_step: dict[int, list[dict[str, Any]]] = {}
        self._handed_out: list[Any] | None = None  # replica 0's state's signature
        # what each replica's groups held when `take` last wrote them (at first: their own)
        self._written: list[list[Written]] = [
            [_written(group) for group in o.param_groups] for o in optimizers]
        # each replica's groups' parameters as built; checked after handed out (`layout`)
        self._layouts = [_layout(o) for o in optimizers]
        self._groups_out = False

    def groups_handed_out(self) -> None:
        """The parameter groups were handed out (outside ``run``): `publish` checks
        that they still hold the parameters they were built with."""
        self._groups_out = True

    def _check_layouts(self) -> None:
        """Raises if a replica's groups hold other parameters than built with.

        Raises:
            RuntimeError: a group added, a parameter taken out of or moved between groups.
        """
        self._groups_out = False
        for r, (optimizer, built) in enumerate(zip(self._optimizers, self._layouts,
                                                   strict=True)):
            now = _layout(optimizer)
            if now != built:
                raise RuntimeError(_relaid(r, built, now))

    def state_handed_out(self) -> None:
        """Replica 0's state was handed out (outside ``run``): notes its signature."""
        if len(self._optimizers) > 1 and self._handed_out is None:
            self._handed_out = self._signature()

    def _signature(self) -> list[Any]:
        state = self._optimizers[0].state
        return [None if (entry := state.get(p)) is None else (id(entry), [
            (key, id(v), v._version if isinstance(v, torch.Tensor) else v)
            for key, v in entry.items()]) for p in self._params[0]]

    def _spread_state(self) -> None:
        """Replica 0's state entries changed since handed out, into the others'."""
        was, self._handed_out = self._handed_out, None
        if was is None:
            return
        source = self._optimizers[0].state
        for k, (before, now) in enumerate(zip(was, self._signature(), strict=True)):
            if before == now:
                continue
            entry = source.get(home := self._params[0][k])
            for r in range(1, len(self._optimizers)):
                p, state = self._params[r][k], self._optimizers[r].state
                if entry is None:
                    state.pop(p, None)
                else:  # (on the copy's device what is on the parameter's: a CPU step
                    # count of Adam stays on the CPU, as torch's load_state_dict keeps it)
                    state[p] = {key: v.detach().to(
                        p.device if v.device == home.device else v.device, copy=True)
                        if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                        for key, v in entry.items()}

    def publish(self, r: int, step: int) -> None:
        """Replica ``r``'s call before the all-reduce of ``step``: replica 0 records."""
        if r == 0 and len(self._optimizers) > 1:
            if self._groups_out:  # (before the all-reduce: refused before any copy steps)
                self._check_layouts()
            self._spread_state()
            self._by_step[step] = [
                {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                 for k, v in group.items() if k != "params"}
                for group in self._optimizers[0].param_groups]
            self._by_step.pop(step - 2, None)

    def check(self, step: int) -> None:
        """Replica 0, at ``step()`` after a ``GradScaler.unscale_`` published them:
        raises if its hyper-parameters changed since (the others step with those).

        Raises:
            RuntimeError: a hyper-parameter was set between ``unscale_`` and ``step``.
        """
        published = self._by_step.get(step)
        if published is None:
            return
        for group, then in zip(self._optimizers[0].param_groups, published, strict=True):
            for key, value in then.items():
                now = group.get(key)
                same = (torch.equal(now, value) if isinstance(value, torch.Tensor)
                        and isinstance(now, torch.Tensor) else now == value)
                if not same:
                    raise RuntimeError(
                        f"MirroredOptimizer.step: {key!r} of a parameter group changed between "
                        f"scaler.unscale_(optimizer) and scaler.step(optimizer) ({value!r} -> "
                        f"{now!r}); the other replicas step with the values unscale_ found, as "
                        "its all-reduce published them. Set it before unscale_ (or step the "
                        "scheduler after scaler.step)")

    def take(self, r: int, step: int) -> None:
        """Replica ``r`` (not 0), after the all-reduce of ``step``: sets replica 0's.

        Raises:
            RuntimeError: replica ``r`` set a value since it last took replica 0's (in
                ``run``: from its own share of the batch) that differs from replica 0's.
        """
        groups, written = self._optimizers[r].param_groups, self._written[r]
        if len(groups) != len(self._by_step[step]):  # (changed without being handed out)
            changed = next((k for k, (o, built) in enumerate(zip(
                self._optimizers, self._layouts, strict=True)) if _layout(o) != built), r)
            raise RuntimeError(_relaid(changed, self._layouts[changed],
                                       _layout(self._optimizers[changed])))
        if len(written) == len(groups):  # (a group added since: not compared)
            for g, (source, target, (group, was, versions)) in enumerate(
                    zip(self._by_step[step], groups, written, strict=True)):
                if target is not group:  # (replaced: load_state_dict, outside run)
                    continue
                for key, value in source.items():
                    now = target.get(key, _GONE)
                    if ((now is not was.get(key, _GONE) or (key in versions and isinstance(
                            now, torch.Tensor) and now._version != versions[key]))
                            and not _equal(now, value) and not _equal(now, was.get(key))):
                        raise RuntimeError(_differs(key, g, r, now, value))
        for source, target in zip(self._by_step[step], groups, strict=True):
            target.update(source)
        self._written[r] = [_written(group) for group in groups]


_GONE = object()


def _layout(optimizer: torch.optim.Optimizer) -> list[list[int]]:
    """The ids of each parameter group's parameters (held by the optimizer: stable)."""
    return [list(map(id, group["params"])) for group in optimizer.param_groups]


def _relaid(r: int, built: list[list[int]], now: list[list[int]]) -> str:
    if len(now) != len(built):
        what = f"{len(now)} groups, built with {len(built)}"
    else:
        g = next((g for g, (a, b) in enumerate(zip(built, now, strict=True)) if a != b), 0)
        what = (f"group {g} holds {len(now[g])} parameters, built with {len(built[g])}"
                if len(now[g]) != len(built[g]) else f"group {g} holds other parameters")
    return (f"MirroredOptimizer.step: the parameter groups of local replica {r}'s optimizer "
            f"changed since make_optimizer built them ({what}; through "
            "optimizer.param_groups or optimizer.optimizers outside strategy.run). Every "
            "replica's optimizer steps the parameters make_optimizer gave its groups, and "
            "only values such as 'lr' are taken from replica 0's: the copies would train "
            "different parameters. Nothing was stepped. Build every group in make_optimizer "
            "(a parameter to leave alone: requires_grad=False, or a group with lr=0), or "
            "build a new mirrored optimizer")
Written = tuple[dict[str, Any], dict[str, Any], dict[str, int]]


def _written(group: dict[str, Any]) -> Written:
    """A parameter group, its entries (their objects) and its tensors' versions."""
    entries = {k: v for k, v in group.items() if k != "params"}
    return group, entries, {k: v._version for k, v in entries.items()
                            if isinstance(v, torch.Tensor)}


def _equal(a: Any, b: Any) -> bool:
    """Whether two entries of a parameter group hold the same value (a tensor's: its
    elements, a number's against a one-element tensor's too)."""
    if a is b:
        return True
    try:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            ta, tb = (torch.as_tensor(v).detach().cpu() for v in (a, b))
            return ta.shape == tb.shape and bool((ta == tb).all())
        return bool(a == b)
    except Exception:  # (no truth value, no tensor of it: taken as different)
        return False


def _differs(key: str, group: int, r: int, mine: Any, first: Any) -> str:
    return (f"MirroredOptimizer.step: local replica {r} set {key!r} of parameter group "
            f"{group} to {mine!r} since its last step (inside strategy.run, or through "
            f"optimizer.optimizers[{r}] outside it), and replica 0's is {first!r}: every "
            "replica steps with replica 0's value, so a value set from a replica's own share "
            "of the batch (its loss) would be dropped, where one device computes it from the "
            "whole batch. Every replica must set the same value: compute it from a value "
            "reduced across the replicas (mirrored.get_replica_context().all_reduce(...) in "
            "the step, or strategy.reduce of run's result), from the step number, or set it "
            "outside strategy.run (as a scheduler does: replica 0's optimizer's values reach "
            "every replica)")
