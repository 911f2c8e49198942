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
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Final

import torch

from .. import context
from ..collectives.parts import Parts
from ..runtime.runtime import InlineRuntime, ThreadRuntime

__all__ = ["NOT_TAKEN", "SoloRun", "solo_run"]

NOT_TAKEN: Final = object()  # the call goes the general way

_PLAIN_LEAVES = frozenset({torch.Tensor, int, float, bool, str, type(None)})
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

    __slots__ = ("_context", "_note", "_strategy_ref")

    def __init__(self, strategy: Any, replica_context: Any, note: str | None) -> None:
        self._strategy_ref = weakref.ref(strategy)
        self._context = replica_context
        self._note = note

    def run(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """``fn(*args)`` in the replica's context, or `NOT_TAKEN`."""
        if (kwargs or type(args) is not tuple or _function_modes() or _thread_profiled()
                or getattr(_profiler, "_is_profiler_enabled", False)):
            return NOT_TAKEN
        for leaf in args:
            if type(leaf) not in _PLAIN_LEAVES:
                return NOT_TAKEN
        strategy = self._strategy_ref()
        if not context.may_run_directly(strategy):
            return NOT_TAKEN
        try:
            return context.call_in_run(strategy, self._context, fn, args)
        except Exception as error:
            if self._note is not None:
                error.__notes__ = [*getattr(error, "__notes__", []), self._note]  # add_note
            raise


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
