"""Per-replica random streams for the CPU draws of a strategy's replicas.

Replicas share torch's one CPU generator, so concurrent replicas would draw from it
in thread order and a seeded step would not repeat. Instead, inside ``run`` each
replica (of a strategy with several) draws on the CPU from a generator of its own:
the first random draw of a run takes one 64-bit base seed from (a copy of) the caller's
generator as the run started, which the run's end advances by that draw (so
``torch.manual_seed(s)`` before ``run`` fixes every stream, successive runs differ, and
a step that reseeds torch or restores it with ``fork_rng`` changes neither), and replica
``r``'s generator is seeded with ``mix(base, r)``.

The routing happens in torch's dispatcher, not in Python around every call: every
ATen operator that torch tags ``nondeterministic_seeded`` and that takes a
``generator`` argument gets a small kernel at the ``BackendSelect`` key (which
every call passes, right above the CPU kernels, below autograd and below dispatch
modes such as fake tensors). The kernel passes the replica's generator when the
call has none and runs on CPU tensors on a thread that is running a replica;
otherwise it hands the call on unchanged. Composites need no entry of their own:
dropout, attention, ``rrelu``, ``gumbel_softmax``, ``torch.rand`` and the rest end in
one of these operators (``bernoulli_``, ``uniform_``, ``random_``, ...), which is
intercepted there. So:

- operators that are not random cost nothing (they never reach a kernel of ours); a
  run copies the caller's generator state at its start (about 0.5 µs);
- each random operator costs one Python call (about 3.5 µs), in or out of ``run``
  once a strategy with per-replica streams exists;
- the masks are torch's own: replica ``r`` draws exactly what eager torch would
  draw after ``torch.manual_seed(seed_r)``;
- ``torch.compile`` sees nothing of it (no graph break; Dynamo's frame hook skips
  the kernel where an eager draw meets it); Inductor's random ops
  take their seeds from ``aten.randint`` when the compiled graph runs, which is
  routed like any other draw, so compiled dropout is per-replica and reproducible
  from ``torch.manual_seed`` too.

A call with an explicit ``generator=`` is left alone. A GPU replica's draws on
its device use the device's generator (one per device); its CPU draws (a factory
without a ``device``: the replica's device is not torch's default) are routed to
its stream like a CPU replica's. A draw during backward (what
``torch.utils.checkpoint`` does when it recomputes a segment with dropout) raises:
checkpoint restores the CPU generator, not the replica's stream, so the
recomputed mask would silently differ from the forward's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..lazy_torch import skip_in_dynamo

__all__ = ["RandomStreams", "drop_stale_modes", "library_call", "recomputing_for_a_replica",
           "state"]

_MASK = (1 << 63) - 1
_lock = threading.Lock()  # process-wide: installing the kernels, drawing base seeds
_local = threading.local()  # .stream: (RandomStreams, index) while running a replica
state = _local  # (for the runtime's hot path, which sets .stream itself)
_installed: list[torch.library.Library] = []
_KEY = torch._C.DispatchKey.BackendSelect
_CPU = torch._C.DispatchKey.CPU
_CUDA = torch._C.DispatchKey.CUDA  # (a CUDA op with a CPU scalar argument keeps its own)


def seeded_operators() -> list[torch._ops.OpOverload]:
    """The ATen operators that draw from a generator: tagged ``nondeterministic_seeded``
    by torch, with a ``generator`` argument (read from torch's registry, never listed)."""
    operators = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        base, _, overload = name[6:].partition(".")
        schema = torch._C._get_schema(f"aten::{base}", overload)
        if not any(a.name == "generator" for a in schema.arguments):
            continue
        op = getattr(getattr(torch.ops.aten, base), overload or "default")
        if torch.Tag.nondeterministic_seeded in op.tags:
            operators.append(op)
    return operators


def _kernel(op: torch._ops.OpOverload) -> Callable[..., Any]:
    arguments = op._schema.arguments
    index = next(i for i, a in enumerate(arguments) if a.name == "generator")
    keyword = arguments[index].kwarg_only
    redispatch = op._handle.redispatch_boxed

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        keyset = keyset.remove(_KEY)
        if keyset.has(_CPU) and not keyset.has(_CUDA):
            stream = getattr(_local, "stream", None)
            if stream is not None:
                if keyword or len(args) <= index:
                    if kwargs.get("generator") is None:
                        kwargs["generator"] = _replica_generator(stream, op)
                elif args[index] is None:
                    args = (*args[:index], _replica_generator(stream, op), *args[index + 1:])
            elif torch._C._current_graph_task_id() != -1 and (
                    kwargs.get("generator") if keyword or len(args) <= index
                    else args[index]) is None and recomputing_for_a_replica(True):
                raise RuntimeError(_recompute_message(op))
        return redispatch(keyset, *args, **kwargs)

    # The dispatcher calls the kernel as a Python frame of its own; Dynamo's frame hook,
    # when active around an eager draw (a mirrored model compiled in place), would try to
    # compile it: graph breaks in the counters, and an error under fullgraph=True.
    skip_in_dynamo(kernel, inside=True)
    return kernel


def _replica_generator(stream: tuple[RandomStreams, int], op: torch._ops.OpOverload
                       ) -> torch.Generator:
    if torch._C._current_graph_task_id() != -1:
        # A draw while autograd runs backward: torch.utils.checkpoint recomputing its
        # segment. It restores the CPU generator's state, not the replica's, so the
        # recomputed dropout mask would silently differ from the forward's.
        raise RuntimeError(_recompute_message(op))
    return stream[0].generator(stream[1])


def _recompute_message(op: torch._ops.OpOverload) -> str:
    return (
        f"{op} drew random numbers on the CPU during backward, while a strategy.run of "
        "several replicas was in progress; every random draw during backward is refused "
        "there. The draw may be torch.utils.checkpoint recomputing a segment with dropout "
        "(or another CPU draw): it restores torch's CPU generator, not the replica's "
        "random stream, so the recomputed mask would differ from the forward's and the "
        "gradients would be wrong; or a gradient hook that adds noise (which the library "
        "cannot tell apart from a recomputation). Keep random ops out of checkpointed "
        "segments (e.g. dropout outside the checkpoint, or p=0 there), draw a hook's noise "
        "in the forward pass and use it in the hook, or pass an explicit generator= (one "
        "per replica) to the random call")


def install() -> None:
    """Registers the routing kernels (once per process)."""
    with _lock:
        if _installed:
            return
        library = torch.library.Library("aten", "IMPL")  # type: ignore[no-untyped-call]
        for op in seeded_operators():
            name = op._schema.name
            qualified = f"{name}.{op._overloadname}" if op._overloadname != "default" else name
            # Factory overloads (rand.generator, ...) already select their backend
            # there; they end in an in-place sampler, which is routed.
            if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "BackendSelect"):
                continue
            library.impl(qualified.removeprefix("aten::"), _kernel(op), "BackendSelect",
                         with_keyset=True)  # type: ignore[no-untyped-call]
        _installed.append(library)


_DEFAULT = torch.default_generator


class RandomStreams:
    """The random streams of one strategy's local replicas.

    Args:
        replica_ids: the global ids of the local replicas (their streams differ).
    """

    def __init__(self, replica_ids: Sequence[int]) -> None:
        install()
        self._ids = tuple(replica_ids)
        self._base: int | None = None
        # The caller's generator as the run started (`start_run`): the base seed is drawn
        # from this copy, so a step that reseeds torch (manual_seed, fork_rng) before its
        # first draw cannot change it; `finish_run` then advances the caller's own.
        self._start: torch.Tensor | None = None
        self._drew = False
        self._generators: list[torch.Generator | None] = [None] * len(self._ids)
        self._modes = [ReplicaStream(self, i) for i in range(len(self._ids))]
        # What `call` puts in the thread's stream slot for each replica (the runtime's
        # hot path puts it there itself: `state`, `keys`).
        self.keys = tuple((self, i) for i in range(len(self._ids)))
        self._keys = self.keys

    def start_run(self) -> None:
        """A new run: streams are drawn afresh at the first random call, from the
        caller's generator as it is now."""
        self._start = _DEFAULT.get_state()  # (about 0.5 µs)
        if self._base is not None:  # (else no stream was drawn since the last reset)
            self._base = None
            self._generators = [None] * len(self._ids)

    def finish_run(self) -> None:
        """The run is over: if it drew a base seed, the caller's generator advances by
        one draw, whatever the step did to it meanwhile (a ``fork_rng`` block restores
        it: without this, every run would draw the same base and repeat its masks). A
        run that drew nothing leaves it as one device would (a ``DataLoader``'s shuffle
        stays one device's). Across workers, one whose replicas all had empty shards in
        a run where the others drew falls one draw behind (docs/multi_worker.md)."""
        self._start = None
        if self._drew:
            self._drew = False
            torch.randint(0, 1 << 62, (1,), generator=_DEFAULT)

    def seed(self, base: int) -> None:
        """Seeds this run's streams from ``base`` instead of a draw from torch's CPU
        generator (a draw there would shift what the caller's code draws next)."""
        self._base = base & _MASK
        self._generators = [None] * len(self._ids)

    def mode(self, index: int) -> ReplicaStream:
        """The context to enter on replica ``index``'s thread for its function."""
        return self._modes[index]

    def call(self, index: int, fn: Callable[[int], Any]) -> Any:
        """``fn(index)`` in replica ``index``'s stream (`mode` without a context
        manager: the runtime's hot path)."""
        saved = getattr(_local, "stream", None)
        _local.stream = self._keys[index]
        try:
            return fn(index)
        finally:
            _local.stream = saved

    def generator(self, index: int) -> torch.Generator:
        """Replica ``index``'s generator for this run (seeded at its first use)."""
        generator = self._generators[index]
        if generator is None:
            with _lock:
                if self._base is None:
                    source = _DEFAULT
                    if self._start is not None:  # (a run: the state it started from)
                        source = torch.Generator()
                        source.set_state(self._start)
                        self._drew = True
                    drawn = int(torch.randint(0, 1 << 62, (1,), generator=source).item())
                    self._base = drawn & _MASK
                base = self._base
            generator = torch.Generator()
            generator.manual_seed((base * 0x9E3779B97F4A7C15 + self._ids[index]) & _MASK)
            self._generators[index] = generator
        return generator


class ReplicaStream:
    """While entered, random draws of this thread come from one replica's stream."""

    __slots__ = ("_index", "_saved", "_streams")

    def __init__(self, streams: RandomStreams, index: int) -> None:
        self._streams = streams
        self._index = index
        self._saved: list[Any] = []

    def __enter__(self) -> None:
        self._saved.append(getattr(_local, "stream", None))
        _local.stream = (self._streams, self._index)

    def __exit__(self, *exc: object) -> None:
        _local.stream = self._saved.pop() if self._saved else None


def recomputing_for_a_replica(with_streams: bool) -> bool:
    """Whether this backward pass (``torch._C._current_graph_task_id()`` set) may be
    recomputing a replica's checkpointed segment without its context: it runs on a
    thread Python did not start (torch's autograd thread of a CUDA device) while a run
    of several replicas in all is in progress (``with_streams``: with random streams).
    Threads of the user's own, and the main thread, are never taken for one."""
    if not isinstance(threading.current_thread(), threading._DummyThread):
        return False
    from .runtime import runs_in_flight  # (a cycle at import: read on this rare path)
    return runs_in_flight(with_streams)


def library_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Calls ``fn`` with this thread's replica stream lifted: what it draws comes
    from the caller's generator (``merge_fn``, run while every replica waits)."""
    stream = getattr(_local, "stream", None)
    if stream is None:
        return fn(*args, **kwargs)
    _local.stream = None
    try:
        return fn(*args, **kwargs)
    finally:
        _local.stream = stream


def drop_stale_modes() -> None:
    """Clears a replica stream left on this (a caller's) thread by an interrupt that
    landed between entering it and registering its exit."""
    if getattr(_local, "stream", None) is not None:
        _local.stream = None
