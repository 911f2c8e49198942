"""`GradientWatch`: each replica's gradients as its last ``backward()`` left them, so
that the step sees a gradient changed before the all-reduce.

A post-accumulate-grad hook records each gradient's identity and version counter when
a backward pass ends; an in-place change afterwards (``clip_grad_norm_``,
``clip_grad_value_``, ``p.grad.mul_``) bumps the version, so ``step()`` sees it. A
change through ``p.grad.data`` (the DQN tutorial's ``p.grad.data.clamp_(-1, 1)``)
bumps no version: ``.data`` is a tensor with a counter of its own. So on the steps
the divergence check reads (the first and every 8th with ``check="cheap"``, every
step with ``"full"``), the watch also takes the gradients' 2-norms when backward
ends (one multi-tensor kernel) and again at the step, and a difference is the same
refusal. A program that clamps does so at every step, so it is refused at the first.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable

from ..context import current_replica_context
from ..errors import ReplicaDivergenceError
from .check import CHEAP_EVERY, STEPS, Check, bit_patterns, crossed_message, modified_message

__all__ = ["GradientWatch"]


def _dense(g: torch.Tensor | None) -> bool:
    return g is not None and g.layout == torch.strided  # (sparse: refused by the step)


def _norms(grads: Sequence[torch.Tensor | None]) -> Sequence[torch.Tensor] | None:
    """The 2-norms of the present ``grads``' values: one multi-tensor kernel, nothing
    stacked or viewed (each op of a replica thread may wait for the GIL behind another
    replica's: the op count is what this costs on N replicas); `_changed` compares."""
    with torch.no_grad():
        present = [g for g in grads if g is not None and g.layout == torch.strided]
        return torch._foreach_norm(present) if present else None


def _changed(now: Sequence[torch.Tensor], then: Sequence[torch.Tensor]) -> list[bool]:
    """Which of the norms ``now`` differ from ``then`` in their bits (a NaN norm, from an
    inf a GradScaler will skip, equals itself; norms of several dtypes are stacked in the
    widest, which holds each exactly): one stack and one read; the bit patterns only
    when the values differ (a NaN, or a change)."""
    both = torch.stack([*now, *then])
    m = len(now)
    values = both.tolist()
    if values[:m] == values[m:]:  # (a norm is never -0.0: equal values, equal bits)
        return [False] * m
    bits = bit_patterns(both).tolist()
    return [a != b for a, b in zip(bits[:m], bits[m:], strict=True)]


class GradientWatch:
    """Each replica's gradient (tensor, version) per parameter as the last
    ``backward()`` left it. A post-accumulate-grad hook on the replica's first and
    last parameter queues one callback per backward pass, which records every
    gradient when the pass ends (the reduced gradients of a step are views of one
    buffer and share its version counter, so a version is final only then; two
    hooks instead of one per parameter keep the cost at a few microseconds).

    ``check``: with one replica in all (`settle`) and ``"cheap"``, only every
    `CHEAP_EVERY`-th step is watched, the first included; the hooks are
    removed in between. There the gradients are the global ones, so a change between
    ``backward()`` and ``step()`` is not wrong, only wrong on N replicas: a step
    that makes it every time is refused at the first, at about an eighth of the
    hooks' cost (1.8 % of the README loop's step at batch 64 when always on).

    ``measure_every``: the norms (see the module docstring) are taken at the first
    backward of a replica's every ``measure_every``-th all-reduce, the first included
    (the hooks of a one-replica watch exist only on watched steps: 1 there).

    ``known`` (the mirrored module's replica contexts -> local index): the hooks also
    note a replica whose backward reaches another replica's copy (``crossed[0]``:
    ``(running replica, copy)``, local indices; ``ids``: their replica ids, for
    messages), i.e. a step that ran the original module or ``model.replicas[i]``
    instead of the mirrored model."""

    def __init__(self, params: Sequence[Sequence[nn.Parameter]], check: Check = "full",
                 known: dict[Any, int] | None = None, ids: Sequence[int] = (),
                 measure_every: int = 1) -> None:
        self._params = params
        self._known = known
        self._ids = tuple(ids) or tuple(range(len(params)))  # local index -> replica id
        self.crossed: list[tuple[int, int] | None] = [None]
        self._none: list[list[tuple[torch.Tensor, int] | None]] = [[None] * len(p)
                                                                   for p in params]
        self.seen = list(self._none)  # per replica: a backward's records, or all None
        # Per replica: seen holds a backward's gradients (public: a hot path reads it).
        self.fresh = [False] * len(params)
        self._queued = [False] * len(params)
        # per replica: `STEPS` and the parameters' versions when its last backward ended
        self.at: list[tuple[int, list[int]]] = [(0, [])] * len(params)
        self.ends = [0] * len(params)  # per replica: the backward passes it saw end
        self._every, self._settled = CHEAP_EVERY if check == "cheap" else 1, 0
        # per replica: the gradients' norms when its last backward ended (measured steps)
        self.norms: list[Sequence[torch.Tensor] | None] = [None] * len(params)
        self._measure_every, self._cleared = measure_every, [0] * len(params)
        self._measure = [True] * len(params)
        self.handles = self._register()  # (changed in place: the finalizer holds it)
        # A watch dropped with its optimizer takes its hooks along (their closures do
        # not hold it): left, each rebuilt optimizer added two, and kept its records.
        weakref.finalize(self, _remove, self.handles)

    def _register(self) -> list[Any]:
        # On the first and last parameter that requires a gradient (torch refuses a hook
        # on a frozen one; a replica with none frozen in all is not watched).
        handles = []
        for r, ps in enumerate(self._params):
            live = [p for p in ps if p.requires_grad]
            for p in {id(q): q for q in live[:1] + live[-1:]}.values():
                handles.append(p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    self._hook(r)))
        return handles

    def _hook(self, r: int) -> Callable[[torch.Tensor], None]:
        # Closures over locals: these run between the kernels of every backward.
        params, seen_all, pending, queued = self._params[r], self.seen, self.fresh, self._queued
        at, ends, norms, measure = self.at, self.ends, self.norms, self._measure
        none, known, crossed = self._none[r], self._known, self.crossed
        # torch's engine runs queued callbacks when this backward pass ends (a private
        # entry point, stable since torch 1.x; DDP's reducer uses it).
        queue = Variable._execution_engine.queue_callback

        def snapshot() -> None:
            queued[r] = False
            ends[r] += 1
            at[r] = (STEPS[0], [p._version for p in params])
            seen: list[tuple[torch.Tensor, int] | None] = []
            for p in params:
                g = p.grad
                seen.append(None if g is None else (g, g._version))
            seen_all[r] = seen
            pending[r] = seen != none
            if measure[r]:
                norms[r] = _norms([p.grad for p in params])

        def hook(_: torch.Tensor) -> None:
            # (on a replica's thread; an autograd device thread has no context: r)
            if known is not None and (i := known.get(current_replica_context(), r)) != r:
                crossed[0] = (i, r)
            if not queued[r]:
                queued[r] = True
                queue(snapshot)
        return hook

    def pending(self, r: int) -> bool:
        """Whether replica ``r`` accumulated gradients since its last all-reduce."""
        return self.fresh[r]

    def discards(self, r: int) -> bool:
        """Whether ``zero_grad()`` on replica ``r`` now drops the gradients of its last
        backward, pending, when no mirrored optimizer has stepped since, or when the
        parameters changed in place since: the marks of a manual update. Gradients
        another optimizer's backward left (a GAN's generator loss reaches the
        discriminator), followed by that optimizer's step, drop as on one device."""
        steps, versions = self.at[r]
        return self.fresh[r] and (steps == STEPS[0] or any(
            p._version != v for p, v in zip(self._params[r], versions, strict=True)))

    def modified(self, r: int, params: Sequence[nn.Parameter]) -> list[int]:
        """The parameters whose gradient changed since backward put it there.

        Raises:
            ReplicaDivergenceError: a replica's backward reached another's copy (once
                raised, forgotten: the next step is judged on its own).
        """
        if self.crossed[0] is not None:
            (running, copy), self.crossed[0] = self.crossed[0], None
            self.clear_all()  # (another replica's backward may have noted records on a
            # copy whose own step already ended)
            raise ReplicaDivergenceError(crossed_message(self._ids[running], self._ids[copy]))
        if not self.fresh[r]:
            return []
        out = []
        for k, (p, s) in enumerate(zip(params, self.seen[r], strict=True)):
            g = p.grad
            if s is not None and g is not None and (g is not s[0] or g._version != s[1]):
                out.append(k)
        if out or (then := self.norms[r]) is None:
            return out
        # (a change through p.grad.data: the same tensors at the same versions)
        present = [k for k, p in enumerate(params) if _dense(p.grad)]
        now = _norms([params[k].grad for k in present])
        if now is None or len(now) != len(then):
            return out
        return [k for k, d in zip(present, _changed(now, then), strict=True) if d]

    def clear(self, r: int) -> None:
        """Forgets replica ``r``'s records (its gradients were all-reduced). The records
        hold the gradients: kept, they would outlive ``zero_grad()`` and keep a step's
        gradients alive into the next."""
        self.fresh[r] = False
        self.seen[r] = self._none[r]
        self.norms[r] = None
        self._cleared[r] += 1
        self._measure[r] = self._cleared[r] % self._measure_every == 0

    def clear_all(self) -> None:
        """Forgets every replica's records (a step that failed as a whole)."""
        for r in range(len(self.fresh)):
            self.clear(r)

    def settle(self, r: int, names: Sequence[str], replica: Callable[[], int],
               replicas: int) -> None:
        """What the all-reduce does with the records of replica ``r``, when there is
        none to make (one replica in all): raises if a gradient changed in place
        since ``backward()`` (``names``: the parameters'; ``replica()``: the replica id
        for the message), else forgets them.

        Raises:
            ReplicaDivergenceError: a gradient changed in place since ``backward()``.
        """
        if self._every > 1:  # (the next step watched or not: see the class docstring)
            self._settled += 1
            watched = self._settled % self._every == 0
            if watched and not self.handles:
                self.handles[:] = self._register()
            elif not watched and self.handles:
                self.remove()
        if not self.fresh[r]:
            return
        changed = self.modified(r, self._params[r])
        self.clear(r)  # (refused once: not again at a later, unwatched step)
        if not changed:
            return
        raise ReplicaDivergenceError(modified_message([names[k] for k in changed], replica(),
                                                      replicas))

    def remove(self) -> None:
        """Removes every hook."""
        _remove(self.handles)
        self.handles.clear()


def _remove(handles: Sequence[Any]) -> None:
    for h in handles:
        h.remove()
