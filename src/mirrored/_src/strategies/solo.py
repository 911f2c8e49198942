"""`SoloRun`: ``strategy.run`` of a strategy with one replica in all (one process), for
the common call, with nothing that is identity on one replica.

One replica in one process has nothing to split, meet or regroup: ``run`` is ``fn``
called on the caller's thread in the replica's context. The general path still
flattens the arguments, builds the replica's arguments back, asks the runtime
(profiler, device, thread state) and regroups one result; about 10 µs a call on a
quiet core, against 2-3 µs here. `SoloRun` takes a call only when the general path
would do exactly that:

- the strategy has one local replica, no cluster, and its device is the host CPU (or
  it is the default strategy, whose replica is the caller);
- the caller is outside any scope and ``run``, or in this strategy's own scope (so no
  refusal and no ``merge_fn`` nesting applies);
- ``args`` is a tuple of plain leaves (tensors, numbers, strings, ``None``: nothing a
  replica would take a component of) and ``kwargs`` is empty;
- no torch function mode (a ``torch.device`` context) and no profiler is active.

Anything else goes the general way, so its checks and errors are unchanged. The run
is marked in flight as the general path marks it (other threads are refused while it
lasts), and an exception gets the same note.

``reduce`` likewise: the README loop's ``strategy.reduce("MEAN", per_example_loss,
axis=0)`` of a CPU float32/64 tensor is torch's ``mean`` over the axis (what the
general path computes for one replica, bit for bit), once the general path has
planned (checked) that op, dtype, rank and axis; anything else goes the general way.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Final

import torch

from .. import context
from ..collectives.parts import Parts
from ..reduce_op import ReduceOp
from ..reduction import SUM_IS_MEAN, cached_plan
from ..runtime.runtime import InlineRuntime, ThreadRuntime

__all__ = ["NOT_TAKEN", "SoloRun", "solo_run"]

NOT_TAKEN: Final = object()  # the call goes the general way

_PLAIN_LEAVES = frozenset({torch.Tensor, int, float, bool, str, type(None)})
_is_plain = _PLAIN_LEAVES.__contains__
_function_modes = torch._C._len_torch_function_stack
_thread_profiled = torch._C._autograd._profiler_enabled
_profiler = torch.autograd.profiler


class SoloRun:
    """``run`` of a one-replica strategy on the caller's thread; see the module docstring.

    Args:
        strategy: the strategy (held weakly: a dropped strategy is collected at once).
        replica_context: its one `ReplicaContext`.
        note: the note an exception of ``fn`` gets (the runtime's), or ``None``.
    """

    __slots__ = ("_context", "_means", "_note", "_strategy_ref")

    def __init__(self, strategy: Any, replica_context: Any, note: str | None) -> None:
        self._strategy_ref = weakref.ref(strategy)
        self._context = replica_context
        self._note = note
        # (op as given, axis, dtype, rank) -> the dims of a MEAN the general path planned
        self._means: dict[tuple[Any, int, torch.dtype, int], tuple[int, ...]] = {}

    def run(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """``fn(*args)`` in the replica's context, or `NOT_TAKEN`."""
        if (kwargs or type(args) is not tuple or _function_modes() or _thread_profiled()
                or getattr(_profiler, "_is_profiler_enabled", False)):
            return NOT_TAKEN
        if not all(map(_is_plain, map(type, args))):  # (no bytecode per argument)
            return NOT_TAKEN
        try:  # (`may_run_directly` checked in call_in_run: one frame fewer)
            return context.call_in_run(self._strategy_ref(), self._context, fn, args,
                                       NOT_TAKEN)
        except Exception as error:
            if self._note is not None:
                error.__notes__ = [*getattr(error, "__notes__", []), self._note]  # add_note
            raise

    def reduce(self, reduce_op: Any, value: Any, axis: Any) -> Any:
        """``strategy.reduce(reduce_op, value, axis)`` as ``value.mean(axis)``, or
        `NOT_TAKEN`."""
        if (type(value) is not torch.Tensor or type(axis) is not int
                or type(reduce_op) not in (str, ReduceOp) or _function_modes()):
            return NOT_TAKEN  # (an unhashable op gets the general path's TypeError)
        key = (reduce_op, axis, value.dtype, value.dim())
        dims = self._means.get(key)
        if dims is None:
            dims = self._planned_mean(key)
            if dims is None:
                return NOT_TAKEN
        if not value.is_cpu or (  # (`context.may_run_directly`, inlined)
                (s := context._state.stack) and (s[-1].strategy is not self._strategy_ref()
                                                 or s[-1].in_run)):
            return NOT_TAKEN
        return (value.detach() if value.requires_grad else value).mean(dims)

    def _planned_mean(self, key: tuple[Any, int, torch.dtype, int]) -> tuple[int, ...] | None:
        """The dims of a MEAN of float32/64 that the general path planned already (its
        checks passed), remembered for ``key``; else ``None``."""
        reduce_op, axis, dtype, rank = key
        if dtype not in SUM_IS_MEAN:
            return None
        try:
            op = ReduceOp.from_value(reduce_op)
        except ValueError:
            return None
        plan = cached_plan(op, torch.empty((0,) * rank, dtype=dtype), (axis,))
        if plan is None or plan.op is not ReduceOp.MEAN or plan.dims is None:
            return None
        if len(self._means) < 64:
            self._means[key] = plan.dims
        return plan.dims


def solo_run(strategy: Any, parts: Parts, replica_context: Any) -> SoloRun | None:
    """The `SoloRun` of ``strategy`` if it has one replica in all and runs it on the
    caller's thread (``MirroredStrategy(["CPU:0"])``, ``OneDeviceStrategy("CPU:0")``,
    the default strategy), else ``None``."""
    topology, runtime = parts.topology, parts.runtime
    if topology.num_replicas_in_sync != 1 or parts.cluster is not None:
        return None
    if isinstance(runtime, InlineRuntime):
        return SoloRun(strategy, replica_context, None)
    if isinstance(runtime, ThreadRuntime) and topology.torch_devices[0].type == "cpu":
        return SoloRun(strategy, replica_context, runtime._note(0))
    return None
