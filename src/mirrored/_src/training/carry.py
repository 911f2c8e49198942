"""`CarriedGradients`: a step's gradients left in ``.grad`` count once, as on one device.

On one device, a ``backward()`` after ``optimizer.step()`` without ``zero_grad()``
adds to the gradient the step used: the next step sees that old gradient once plus
the new one. On N replicas every copy holds the old (all-reduced) gradient, and a
plain all-reduce would sum it N times. So when the next backward starts, the old
gradient is taken out of every replica's ``.grad`` (a zero tensor of ours takes its
place, which the backward adds into), kept aside (each replica keeps its own copy,
and they are equal), and added back once to the all-reduced sum: one device's
``old + new``, also for a parameter the new backward does not reach.

What is "left": at the end of each step a replica's gradients are recorded (weakly)
with their version counters. A gradient still the same tensor at the same version
was not touched since. One that is ``None`` or all zeros was cleared:
``zero_grad()`` (the mirrored optimizer's and model's also forget what was kept),
``p.grad = None``, ``p.grad.zero_()``. Backward starts are seen by a hook on the
mirrored model's outputs, registered only while some replica holds records (a loop
that calls ``zero_grad()`` before the forward pass registers none). A step reached
with no backward since the last one (``step()`` twice) finds its gradients untouched
and counts them once too. Kept gradients later set to ``None`` or replaced by hand
count as cleared.

Any other change is one the step cannot count rightly, so it raises rather than
guess: a left gradient scaled by hand (``p.grad.mul_(0.5)``: one device holds half
the old gradient, which the replicas would sum N times) cannot be told from one
added to by a backward whose start was not seen (the forward ran a submodule or
``model.module`` directly, or a parameter is used in the loss outside the forward,
which torch accumulates before the outputs' gradient), whose part differs from
replica to replica. Where a step's gradients are views of one buffer (the packed
all-reduce across workers, or of more than two replicas), they share one version
counter: zeroing one by hand then shows on all, and the untouched others raise
too, with the advice to clear one by ``p.grad = None``.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..lazy_torch import skip_in_dynamo

__all__ = ["CarriedGradients", "add_kept", "hook_outputs"]

_Left = list[tuple[Any, int] | None]  # per parameter: (weakref to .grad, its version)


class CarriedGradients:
    """The gradients each local replica's last step left in ``.grad``.

    Args:
        params: each local replica's parameters (one optimizer's).
        pending: the mirrored module's per-replica lists of the `CarriedGradients`
            whose replica holds records (its forward hooks the outputs).
    """

    def __init__(self, params: Sequence[Sequence[nn.Parameter]],
                 pending: Sequence[list[CarriedGradients]], ends: list[int] | None = None,
                 names: Sequence[str] = ()) -> None:
        self._params = params
        self._names = names  # (the parameters', for messages)
        self._pending = pending
        self._ends = ends  # per replica: backward passes ended (`GradientWatch.ends`)
        self._since = [0] * len(params)  # ... when the zeros went in
        self._left: list[_Left | None] = [None] * len(params)
        # per replica: per parameter, (the old gradient, the zeros put in its place)
        self._kept: list[list[tuple[torch.Tensor, torch.Tensor | None] | None] | None] = (
            [None] * len(params))

    def record(self, r: int) -> None:
        """At the end of replica ``r``'s step: its gradients, as the step leaves them."""
        self._left[r] = [None if (g := p.grad) is None else (weakref.ref(g), g._version)
                         for p in self._params[r]]
        self._kept[r] = None
        if self not in self._pending[r]:
            self._pending[r].append(self)

    def forget(self, r: int) -> None:
        """Replica ``r``'s gradients were reset (``zero_grad``)."""
        self._left[r] = self._kept[r] = None
        if self in self._pending[r]:
            self._pending[r].remove(self)

    def forward_seen(self, r: int) -> bool:
        """At a forward pass of replica ``r`` while it holds records: forgets those
        touched since the step (cleared); whether any are left (then hook the outputs)."""
        left = self._left[r]
        if left is not None:
            for k, (p, was) in enumerate(zip(self._params[r], left, strict=True)):
                if was is not None and _judge(p.grad, was) is _CLEARED:
                    left[k] = None
            if any(left):  # (changed ones stay: the backward or the step raises)
                return True
        self.forget(r)
        return False

    def backward_starts(self, r: int) -> None:
        """Keeps aside replica ``r``'s gradients untouched since its step, putting zeros
        in their place, so that the backward now starting writes only the new ones.

        Raises:
            RuntimeError: a left gradient changed in place since the forward pass.
        """
        left = self._left[r]
        if left is None:
            return
        self.forget(r)
        if self._ends is not None:
            self._since[r] = self._ends[r]
        params = self._params[r]
        judged = [_CLEARED if was is None else _judge(p.grad, was)
                  for p, was in zip(params, left, strict=True)]
        if _CHANGED in judged:
            raise RuntimeError(self._changed([k for k, j in enumerate(judged) if j is _CHANGED],
                                             r, "when backward() started"))
        kept: list[tuple[torch.Tensor, torch.Tensor | None] | None] = [None] * len(left)
        for k, p in enumerate(params):
            if judged[k] is _LEFT and (g := p.grad) is not None:
                kept[k] = (g, zeros := torch.zeros_like(g))
                p.grad = zeros
        self._kept[r] = kept if any(kept) else None

    def take(self, r: int) -> list[torch.Tensor | None] | None:
        """At replica ``r``'s all-reduce: the old gradients to add to the sum (``None``:
        none). Untouched ones still in ``.grad`` (no backward since the last step) are
        taken now; kept ones whose zeros were since set to ``None`` or replaced by
        hand count as cleared.

        Raises:
            RuntimeError: a left gradient was changed by a backward whose start was not
                seen (see the module's docstring).
        """
        left, kept = self._left[r], self._kept[r]
        self._kept[r] = None
        if left is not None:
            self.forget(r)
            kept = [None] * len(left)
            changed: list[int] = []
            for k, (p, was) in enumerate(zip(self._params[r], left, strict=True)):
                g = p.grad
                if was is None or g is None or (judged := _judge(g, was)) is _CLEARED:
                    continue
                if judged is _CHANGED:
                    changed.append(k)
                    continue
                kept[k] = (g, None)
                p.grad = None
            if changed:
                raise RuntimeError(self._changed(changed, r, "at its optimizer.step()"))
        if kept is None:
            return None
        # Each backward adds into the zeros once: more changes than backward passes
        # since mean they were also changed by hand (p.grad.zero_() between two
        # backward passes clears what one device holds, the old gradient included).
        passes = None if self._ends is None else self._ends[r] - self._since[r]
        out: list[torch.Tensor | None] = []
        for p, entry in zip(self._params[r], kept, strict=True):
            g = p.grad
            zeros = None if entry is None else entry[1]
            out.append(None if entry is None or not (
                (zeros is None and g is None)  # (`step()` twice: taken just now)
                or (g is not None and g is zeros and (passes is None or g._version <= passes))
                or (g is not None and g is not zeros and g.grad_fn is not None)) else entry[0])
        return out if any(t is not None for t in out) else None


    def _changed(self, changed: list[int], r: int, when: str) -> str:
        names = [self._names[k] if k < len(self._names) else f"#{k}" for k in changed]
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        grads = [self._params[r][k].grad for k in changed]
        views = any(g is not None and g._base is not None for g in grads)
        return _CHANGED_MESSAGE.format(name=names[0], more=more, r=r, when=when,
                                       views=_VIEWS if views else "")


_LEFT, _CLEARED, _CHANGED = "left", "cleared", "changed"


def _judge(g: torch.Tensor | None, was: tuple[Any, int]) -> str:
    """What became of a gradient a step left (``was``: its record): still there
    untouched (`_LEFT`), cleared (``None``, or zeros: ``p.grad.zero_()``, a new zero
    tensor), or changed otherwise (`_CHANGED`: scaled or added to in place, by hand or
    by a backward not seen, or replaced by another non-zero tensor). Only a touched
    gradient is read, once per forward pass while records exist: a loop that calls
    ``zero_grad()`` never gets here."""
    if g is None:
        return _CLEARED
    if g is was[0]() and g._version == was[1]:
        return _LEFT
    if g.grad_fn is None and not bool(g.any()):
        return _CLEARED
    return _CHANGED


def add_kept(params: Sequence[nn.Parameter], kept: list[torch.Tensor | None]) -> None:
    """Adds the gradients kept aside to the all-reduced ones (one device's
    ``old + new``; an old gradient alone where no replica had a new one)."""
    for p, old in zip(params, kept, strict=True):
        if old is not None:
            p.grad = old if p.grad is None else p.grad + old


def hook_outputs(output: Any, pending: list[CarriedGradients], r: int) -> None:
    """Registers, on the tensors of a mirrored model's ``output`` that require a
    gradient (not leaves: a parameter returned as is), a hook that tells ``pending``'s
    `CarriedGradients` when a backward through them starts (before it reaches any
    parameter used in the forward). Gradients touched since the step are forgotten
    first, and nothing is registered if none is left."""
    if not any([carried.forward_seen(r) for carried in list(pending)]):
        return
    starts = _Starts(pending, r)
    for t in _tensors(output, 0):
        if t.requires_grad and t.grad_fn is not None:
            t.register_hook(starts)  # type: ignore[no-untyped-call]


def _tensors(x: Any, depth: int) -> Iterator[torch.Tensor]:
    """The tensors in ``x``: nested mappings (a dict, an ``OrderedDict`` or a
    ``ModelOutput``), lists, tuples and dataclasses, of any class."""
    if isinstance(x, torch.Tensor):
        yield x
        return
    if depth > 8:
        return
    if isinstance(x, Mapping):
        items: Any = x.values()
    elif isinstance(x, list | tuple):
        items = x
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        items = [getattr(x, f.name) for f in dataclasses.fields(x)]
    else:
        return
    for item in items:
        yield from _tensors(item, depth + 1)


class _Starts:
    """The outputs' hook: tells ``pending`` that replica ``r``'s backward starts."""

    def __init__(self, pending: list[CarriedGradients], r: int) -> None:
        self.pending, self.r = pending, r

    def __call__(self, _: torch.Tensor) -> None:
        for carried in list(self.pending):
            carried.backward_starts(self.r)


_CHANGED_MESSAGE = (
    "MirroredOptimizer: the gradient of {name!r}{more} that the last step left in .grad "
    "(no zero_grad() since) was found changed on local replica {r} {when} (expected: "
    "untouched, or cleared: None or zeros): by a backward() whose start the mirrored "
    "model did not see (the forward ran a submodule or model.module directly, or a "
    "parameter is used in the loss outside the forward, e.g. a learned temperature), "
    "or by hand (p.grad.mul_(), a non-zero tensor assigned to p.grad).{views} Each "
    "replica holds the last step's all-reduced gradient, so summing it again would count "
    "it once per replica where one device counts it once, and the two cases cannot be "
    "told apart. Call optimizer.zero_grad() (or model.zero_grad()) between steps")
_VIEWS = (" Here a step's gradients are views of one buffer, which share one version "
          "counter, so an in-place change of one (p.grad.zero_()) shows on all of them: "
          "clear one parameter's gradient with p.grad = None.")


# (eager code between compiled frames: nothing here is traced)
skip_in_dynamo(hook_outputs, inside=True)
skip_in_dynamo(_tensors, inside=True)
skip_in_dynamo(_Starts.__call__, inside=True)
