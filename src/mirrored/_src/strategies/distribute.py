"""How a strategy moves between plain values and per-replica ones: splitting `run`'s
arguments by replica, a value's local results, and building per-replica values from
a function. Pure functions over the strategy's `Parts`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from .. import context, pytree
from ..collectives.cross_replica import check_components
from ..collectives.parts import Parts
from ..runtime.replica_call import on_device
from ..training.agreement import agree_on_module
from ..training.buffers import batch_weight
from ..training.structure import CHANGES, check_copies
from ..values import (
    DistributedValues,
    PerReplica,
    StepExamples,
    ValueContext,
    regroup,
    select_replica,
)

__all__ = ["check_run", "distribute_values", "local_results", "nested_in_merge_fn",
           "require_cross_replica", "run", "run_finished", "run_in_merge_fn", "run_started",
           "split_args", "steps_input", "sync_from_chief", "track", "vote"]

_T = TypeVar("_T")
ReplicaArgs = context.ReplicaArgs


def require_cross_replica(parts: Parts, method: str) -> None:
    """Refuses a cross-replica method inside ``run`` or while another strategy is
    current (the default strategy never refuses).

    Raises:
        RuntimeError: naming the method and what to use instead.
    """
    if parts.topology.follows_caller or context.may_run_directly(parts.strategy):
        return  # (outside every scope and run, or in this strategy's own scope)
    context.refuse_other_strategy(parts.strategy, f"{parts.name}.{method}")
    if context.current_replica_context():
        raise RuntimeError(
            f"{parts.name}.{method} requires cross-replica context; use "
            "get_replica_context().merge_call() or call it outside strategy.run")


def run(strategy: Any, parts: Parts, contexts: Sequence[Any], fn: Callable[..., Any],
        args: Any, kwargs: Any) -> Any:
    """`Strategy.run` (but the one-replica fast path): checks, the replicas' calls, the
    runtime's run, the results regrouped."""
    if not _GUARDED:
        _refuse_forward_ad_in_replicas()
    idle = context.idle()  # outside every scope and run: nothing to refuse or nest
    if idle and kwargs is None and type(args) is tuple and not args:
        replica_args = None  # (what check_run returns for no arguments)
    else:
        replica_args = check_run(parts, args, kwargs, idle)
        if not idle and nested_in_merge_fn(parts):
            parts.step_examples[0] = None  # (the outer run's replicas count from here on)
            return run_in_merge_fn(parts, contexts, fn, replica_args)
    if parts.copies_checked[0] != CHANGES[0]:  # (one copy changed alone?)
        check_copies(strategy, parts.copies_checked)
    if parts.topology.num_workers > 1:
        examples = parts.step_examples[0] = step_examples(args, kwargs)
        if examples is not None and parts.cluster is not None:  # (later calls carry it)
            parts.cluster.took_examples(examples.total, examples.digest)
        if any(counted := parts.count_calls):
            counted[:] = [0] * len(counted)
    call = context.replica_calls(strategy, contexts, fn, replica_args)
    parts.run_args[0] = replica_args
    if any(divisors := parts.loss_divisors):  # (an evaluation's: no all-reduce used them)
        divisors[:] = [0] * len(divisors)
    cluster = parts.cluster
    key = context.run_started(strategy) if cluster is None else run_started(parts)
    try:
        results = parts.runtime.run(call, fn)
    except Exception as error:
        _note_empty_batches(error, replica_args, parts.topology.labels)
        raise
    finally:
        parts.run_args[0] = None  # (the batch is not kept alive until the next run)
        if cluster is None:
            context.run_finished(key)
        else:
            run_finished(parts, key)
    return _regroup(results, parts.topology.device_names)


def _note_empty_batches(error: Exception, replica_args: Any, labels: Sequence[str]) -> None:
    """Adds to a replica's error which replicas had an empty batch in this step (the
    global batch had fewer rows than replicas): many torch layers raise on 0 rows
    (packing, reshapes of -1, BatchNorm), where one device never sees an empty batch."""
    if replica_args is None or len(labels) < 2:
        return
    empty = [label for r, label in enumerate(labels) if not batch_weight(replica_args, r)]
    if empty:
        error.__notes__ = [*getattr(error, "__notes__", []), (
            f"in this step the batch of {', '.join(empty)} was empty (0 rows: the global "
            "batch had fewer examples than there are replicas), which torch layers may "
            "refuse; make every global batch hold at least one example per replica (drop "
            "or pad a short last batch), or have the step handle 0 rows")]


def _regroup(results: Sequence[Any], names: tuple[str, ...]) -> Any:
    """`regroup` of ``run``'s results (``names``: canonical already), without flattening
    in the common cases: every replica returned ``None``, the same object or a plain
    tensor of its own."""
    first = results[0]
    if first is None:
        for r in results:
            if r is not None:
                return regroup(results, names, numbers_per_replica=True)
        return None
    kind = type(first)
    if kind is torch.Tensor:
        same = True
        for r in results:
            if type(r) is not kind:
                return regroup(results, names, numbers_per_replica=True)
            if r is not first:
                same = False
        return first if same else PerReplica._from_trusted(tuple(results), names)
    return regroup(results, names, numbers_per_replica=True)


def step_examples(args: Any, kwargs: Any) -> StepExamples | None:
    """The `StepExamples` of the first batch of a multi-worker distributed dataset among
    ``run``'s arguments (at the top level or one tuple, list or dict down), if any."""
    for arg in (*args, *kwargs.values()) if kwargs else args:
        if type(arg) is PerReplica:
            found = getattr(arg, "_examples", None)
        elif isinstance(arg, tuple | list | dict):  # (namedtuples too)
            found = next((e for a in (arg.values() if isinstance(arg, dict) else arg)
                          if type(a) is PerReplica and (e := getattr(a, "_examples", None))
                          is not None), None)
        else:
            continue
        if found is not None:
            return found  # type: ignore[no-any-return]
    return None


def check_run(parts: Parts, args: Any, kwargs: Any, idle: bool = False) -> ReplicaArgs | None:
    """Checks where and how ``run`` was called (``idle``: outside every scope and run, see
    `context.idle`); returns `split_args` of its arguments.

    Raises:
        RuntimeError: inside a replica, or while another strategy is current.
        ValueError: ``args`` is not a tuple or list.
        TypeError: ``kwargs`` is not a dict.
    """
    if not idle and not parts.topology.follows_caller:
        context.refuse_other_strategy(parts.strategy, f"{parts.name}.run")
        if context.in_run() and not nested_in_merge_fn(parts):
            raise RuntimeError(
                f"{parts.name}.run cannot be called inside a replica (from the fn of "
                "another run); call the inner function directly")
    if not isinstance(args, tuple | list):
        raise ValueError(f"run(fn, args=...) takes a tuple or list of positional arguments; "
                         f"got {type(args).__name__}. Write args=(x,) for a single argument")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise TypeError(f"run(fn, kwargs=...) takes a dict; got {type(kwargs).__name__}")
    return split_args(parts, args, kwargs)


def nested_in_merge_fn(parts: Parts) -> bool:
    """Whether this thread runs a ``merge_fn`` of this strategy (outside any replica of
    a nested ``run``)."""
    return (not parts.topology.follows_caller and context.current_replica_context() is None
            and context.merging_strategy() is parts.strategy)


def run_in_merge_fn(parts: Parts, contexts: Sequence[Any], fn: Callable[..., Any],
                    replica_args: ReplicaArgs | None) -> Any:
    """``run`` called inside a ``merge_fn``: every replica is paused in ``merge_call``,
    so the replicas of this nested run go one after another on this thread, each in
    its replica context and on its device (TF runs them on new threads). Collectives
    inside are refused (``merge_fn`` rules), since the replicas do not run together."""
    topology = parts.topology
    call = context.replica_calls(parts.strategy, contexts, fn, replica_args)
    results = []
    for i, device in enumerate(topology.torch_devices):
        try:
            with on_device(device, as_default=parts.runtime.caller_default):
                results.append(call(i))
        except Exception as error:
            note = f"raised in {topology.labels[i]} of {parts.name}.run inside a merge_fn"
            error.__notes__ = [*getattr(error, "__notes__", []), note]  # add_note, 3.10 too
            raise
    return regroup(results, topology.device_names, numbers_per_replica=True)


def run_started(parts: Parts) -> int:
    """A run of the strategy starts (an elastic step begins, if none is open): marked in
    flight; a new phase for the workers."""
    if parts.cluster is not None and parts.cluster.steps is not None:
        parts.cluster.steps.begin()
    key = context.run_started(parts.strategy)
    if parts.cluster is not None:
        parts.cluster.next_phase()
    return key


def run_finished(parts: Parts, key: int) -> None:
    """The run marked by `run_started` ended."""
    context.run_finished(key)
    if parts.cluster is not None:
        parts.cluster.next_phase()


def vote(parts: Parts) -> Callable[[bool], bool] | None:
    """How a distributed dataset asks whether any worker still has data (multi-worker)."""
    return None if parts.cluster is None else parts.cluster.vote


def track(parts: Parts, obj: _T) -> _T:
    """``obj`` (a mirrored module or optimizer), tracked by an elastic strategy: a
    rejoining worker receives its state from a healthy peer."""
    if parts.cluster is not None and parts.cluster.steps is not None:
        parts.cluster.steps.track(obj)
    return obj


def steps_input(parts: Parts, source: Any, options: Any, kind: str) -> tuple[Any, Any]:
    """A distributed dataset's source and options, aligned with the steps of an elastic
    strategy (unchanged otherwise)."""
    if parts.cluster is not None and parts.cluster.steps is not None:
        return parts.cluster.steps.feed(source, options, kind)
    return source, options


def sync_from_chief(parts: Parts, module: torch.nn.Module) -> None:
    """Multi-worker: every worker starts from the chief's parameters and buffers (as DDP),
    once the workers agreed that their modules have the same structure
    (`agreement.agree_on_module`: the repr, the parameters' and buffers' names, dtypes,
    shapes and requires_grad; a forward() written by hand cannot be seen).

    Raises:
        ValueError: on every worker, when some worker's module differs from worker 0's.
    """
    if parts.cluster is not None:
        agree_on_module(parts, module)
        parts.cluster.sync([*module.parameters(), *module.buffers()])


def split_args(parts: Parts, args: Any, kwargs: dict[str, Any]) -> ReplicaArgs | None:
    """``(args_i, kwargs_i)`` for local replica ``i``: every distributed leaf replaced by
    its component ``i``, other leaves shared; ``None`` when there are no arguments.

    Raises:
        ValueError: a distributed leaf with the wrong number of components (named by
            its path, ``args[0]['x']``).
    """
    if not args and not kwargs:
        return None
    if not kwargs and type(args) is tuple:  # (x, y) of a distributed dataset: no pytree
        n = parts.topology.num_local_replicas
        kinds = [type(a) for a in args]
        if all(k is PerReplica or k is torch.Tensor for k in kinds) and all(
                k is not PerReplica or len(a._values) == n
                for a, k in zip(args, kinds, strict=True)):
            if PerReplica not in kinds:
                return lambda i: (args, kwargs)
            return lambda i: (tuple(a._values[i] if k is PerReplica else a
                                    for a, k in zip(args, kinds, strict=True)), {})
    tree = (tuple(args), kwargs)
    leaves, spec = pytree.flatten(tree)
    distributed = False
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, DistributedValues):
            distributed = True
            if len(leaf.values) != parts.topology.num_local_replicas:
                path = pytree.flatten_with_path(tree)[0][index]
                root = "args" if path[0] == 0 else "kwargs"
                check_components(parts, leaf, pytree.format_path(path[1:], root))
    if not distributed:
        return lambda i: (args, kwargs)
    return lambda i: pytree.unflatten(spec, select_replica(i, leaves))


def local_results(parts: Parts, value: Any) -> tuple[Any, ...]:
    """`Strategy.experimental_local_results`."""
    if isinstance(value, DistributedValues):
        check_components(parts, value, "value")
        return value.values
    leaves, spec = pytree.flatten(value)
    for k, leaf in enumerate(leaves):
        if isinstance(leaf, DistributedValues):
            check_components(parts, leaf,
                             pytree.format_path(pytree.flatten_with_path(value)[0][k]))
    return tuple(pytree.unflatten(spec, select_replica(i, leaves))
                 for i in range(parts.topology.num_local_replicas))


def _mover(target: torch.device) -> Callable[[Any], Any]:
    return lambda x: x.to(target) if isinstance(x, torch.Tensor) else x


def distribute_values(parts: Parts, value_fn: Callable[[ValueContext], Any], *,
                      raw_single_values: bool) -> Any:
    """`Strategy.experimental_distribute_values_from_function`."""
    topology = parts.topology
    values = []
    for i, device in enumerate(topology.devices):
        value = value_fn(ValueContext(topology.replica_ids[i], topology.num_replicas_in_sync))
        if device.kind != "CPU":
            value = pytree.tree_map(_mover(topology.torch_devices[i]), value)
        values.append(value)
    if raw_single_values:
        return values[0]
    if all(v is None for v in values):
        return PerReplica._from_trusted(tuple(values), topology.device_names)
    return regroup(values, topology.device_names, collapse_identical=False,
                   always_per_replica=True)


_GUARDED: list[bool] = []


def _refuse_forward_ad_in_replicas() -> None:
    """Wraps ``torch.autograd.forward_ad.enter_dual_level`` (once per process) to refuse
    forward-mode AD in a replica of a process with several: torch keeps one
    process-wide dual level, and replicas entering it at once broke each other's
    (torch's "invalid index" error, or tangents mixed silently)."""
    from torch.autograd import forward_ad

    original = forward_ad.enter_dual_level

    def enter_dual_level() -> int:
        parts = getattr(context.current_replica_context(), "_parts", None)
        if parts is not None and parts.topology.num_local_replicas > 1 and context.in_run():
            raise RuntimeError(
                "forward-mode AD (torch.func.jvp, torch.autograd.forward_ad.dual_level) "
                "inside strategy.run with several replicas in one process: torch keeps "
                "one dual level for the whole process, and the replicas' threads would "
                "enter and leave it over each other (torch raises 'invalid index', or the "
                "tangents mix silently). Compute it outside strategy.run, or run one "
                "replica per process (MultiWorkerMirroredStrategy)")
        return original()  # type: ignore[no-untyped-call,no-any-return]

    forward_ad.enter_dual_level = enter_dual_level
    _GUARDED.append(True)
