"""Strategies: `MirroredStrategy`, `OneDeviceStrategy` and the default strategy.

A strategy is a list of local replica devices plus the objects that act on
them: an `Executor` (the replica threads), one `ReplicaContext` per replica and
the `StrategyExtended` facade. The three strategies differ only in how they
choose their devices; every behaviour lives in `Strategy`, and the
cross-replica math lives in `reduction`.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, final

import torch

from . import context, pytree
from .cross_device_ops import CrossDeviceOps, NcclAllReduce, ReductionToOneDevice
from .devices import Device, current_device, parse_device, parse_devices
from .errors import ReplicaAbortedError
from .executor import Executor, ReplicaFailure
from .options import CommunicationImplementation, CommunicationOptions
from .reduce_op import ReduceOp
from .reduction import gather_components, normalize_axis, reduce_components
from .rendezvous import Rendezvous
from .replica_context import ReplicaContext
from .values import (
    DistributedValues,
    Mirrored,
    PerReplica,
    ValueContext,
    regroup,
    select_replica,
    to_tensor,
)

__all__ = [
    "MirroredStrategy",
    "OneDeviceStrategy",
    "Strategy",
    "StrategyExtended",
    "default_strategy",
]


class StrategyExtended:
    """Lower-level members of a strategy, reached as ``strategy.extended``.

    Example:
        >>> import mirrored
        >>> mirrored.MirroredStrategy(["CPU:0", "CPU:1"]).extended.worker_devices[1]
        '/job:localhost/replica:0/task:0/device:CPU:1'
    """

    __slots__ = ("_strategy",)

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy

    @property
    def worker_devices(self) -> tuple[str, ...]:
        """The canonical names of this worker's replica devices, in replica order."""
        return self._strategy._device_names

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """Where mirrored parameters live: every replica device."""
        return self._strategy._device_names

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any,
                  options: CommunicationOptions | None = None) -> Any:
        """Reduces ``value`` across replicas to ``destinations`` (cross-replica context).

        ``destinations`` is a device string (``"CPU:1"``, ``"cuda:0"``), a tensor (its
        device) or a distributed value (its components' devices);
        ``reduce_to(op, v, destinations=v)`` is the all-reduce of ``v``.

        Returns:
            A tensor on the destination for one device; a `Mirrored` with one
            component per destination device for several.

        Raises:
            ValueError: SUM of a value that is not per-replica (a `Mirrored` included),
                an empty or list ``destinations``, a wrong number of components.
            TypeError: ``destinations`` of another type.
            RuntimeError: called in replica context.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> v = mirrored.PerReplica([torch.tensor(1.0), torch.tensor(2.0)],
            ...                         devices=["CPU:0", "CPU:1"])
            >>> strategy.extended.reduce_to("SUM", v, destinations="CPU:1")
            tensor(3.)
            >>> strategy.extended.reduce_to("SUM", v, destinations=v)
            Mirrored:{0: tensor(3.), 1: tensor(3.)}
        """
        return self.batch_reduce_to(reduce_op, [(value, destinations)], options)[0]

    def batch_reduce_to(self, reduce_op: ReduceOp | str,
                        value_destination_pairs: Sequence[tuple[Any, Any]],
                        options: CommunicationOptions | None = None) -> list[Any]:
        """`reduce_to` of several ``(value, destinations)`` pairs, packing values of one
        dtype and destinations into buffers of at most ``bytes_per_pack`` bytes.

        Returns:
            A list with one result per pair.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> a = mirrored.PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
            >>> b = mirrored.PerReplica([torch.tensor([3]), torch.tensor([5])])
            >>> strategy.extended.batch_reduce_to("MEAN", [(a, "CPU:0"), (b, "CPU:0")])
            [tensor(1.5000), tensor([4.], dtype=torch.float64)]
        """
        strategy = self._strategy
        strategy._require_cross_replica("extended.batch_reduce_to")
        if not isinstance(value_destination_pairs, tuple | list):
            raise TypeError("value_destination_pairs must be a list of (value, destinations) "
                            f"pairs; got {type(value_destination_pairs).__name__}")
        pairs = list(value_destination_pairs)
        for index, pair in enumerate(pairs):
            if not (isinstance(pair, tuple | list) and len(pair) == 2):
                continue  # batch_reduce reports it
            value = pair[0]
            if isinstance(value, DistributedValues):
                strategy._check_components(value, f"value_destination_pairs[{index}]")
            if strategy.num_replicas_in_sync == 1 and not isinstance(value, PerReplica):
                # With one replica every value is that replica's value.
                first = value.values[0] if isinstance(value, Mirrored) else value
                pairs[index] = (PerReplica([first], strategy._device_names), pair[1])
        merged = strategy._communication_options.merge(options)
        return strategy._cross_device_ops_for(merged).batch_reduce(reduce_op, pairs, merged)

    def broadcast_to(self, tensor: Any, destinations: Any) -> Any:
        """Copies ``tensor`` to each destination device (cross-replica context).

        Returns:
            A tensor for one destination device, a `Mirrored` for several.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> like = mirrored.PerReplica([torch.tensor(0), torch.tensor(0)],
            ...                            devices=["CPU:0", "CPU:1"])
            >>> strategy.extended.broadcast_to(torch.tensor(7), like)
            Mirrored:{0: tensor(7), 1: tensor(7)}
        """
        self._strategy._require_cross_replica("extended.broadcast_to")
        return self._strategy._cross_device_ops.broadcast(tensor, destinations)


class Strategy:
    """What every strategy does; construct `MirroredStrategy` or `OneDeviceStrategy`.

    Args:
        devices: the local replica devices, in replica order.
        cross_device_ops: how components are combined across devices; default:
            chosen from ``communication_options.implementation``.
        communication_options: defaults for every collective of this strategy.
    """

    def __init__(self, devices: Sequence[Device], cross_device_ops: CrossDeviceOps | None = None,
                 communication_options: CommunicationOptions | None = None) -> None:
        if type(self) is Strategy:
            raise TypeError("Strategy is abstract; use MirroredStrategy or OneDeviceStrategy")
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError("cross_device_ops must be a mirrored.CrossDeviceOps such as "
                            f"ReductionToOneDevice(); got {type(cross_device_ops).__name__}")
        if communication_options is None:
            communication_options = CommunicationOptions()
        elif not isinstance(communication_options, CommunicationOptions):
            raise TypeError("communication_options must be a "
                            "mirrored.experimental.CommunicationOptions; got "
                            f"{type(communication_options).__name__}")
        self._devices = tuple(devices)
        self._device_names = tuple(d.name for d in self._devices)
        self._torch_devices = tuple(d.torch_device for d in self._devices)
        self._labels = tuple(f"replica {i} ({d.short_name})" for i, d in enumerate(self._devices))
        self._replica_contexts = tuple(
            ReplicaContext(self, i, d.name) for i, d in enumerate(self._devices))
        self._extended = StrategyExtended(self)
        self._follows_current_device = False
        self._communication_options = communication_options
        self._reference_ops = ReductionToOneDevice()
        self._cross_device_ops = cross_device_ops or self._cross_device_ops_for(
            communication_options, default=True)
        self._rendezvous = Rendezvous(self._labels)
        self._run_lock = threading.Lock()
        self._caller_device = torch.device("cpu")  # the device of the run in progress
        self._executor = Executor(len(self._devices), name=type(self).__name__)
        weakref.finalize(self, self._executor.close)

    # ----------------------------------------------------------------- basics
    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas run each step."""
        return len(self._devices)

    @property
    def extended(self) -> StrategyExtended:
        """Lower-level members (`StrategyExtended`)."""
        return self._extended

    @property
    def cluster_resolver(self) -> None:
        """``None``: single-process strategies have no cluster."""
        return None

    @property
    def default_replica_context(self) -> ReplicaContext:
        """The context of replica 0 (what the default strategy is always in)."""
        return self._replica_contexts[0]

    def scope(self) -> contextlib.AbstractContextManager[Strategy]:
        """Makes this strategy current for the enclosed code (cross-replica context).

        Raises:
            RuntimeError: entered inside the scope of a different strategy.
        """
        return context.enter_scope(self)

    def close(self) -> None:
        """Stops the replica threads; also done when the strategy is garbage collected.

        Raises:
            RuntimeError: called inside ``run`` (a replica or a merge_fn).
        """
        if context.current_replica_context() is not None or context.in_merge_fn_of_run():
            raise RuntimeError(f"{type(self).__name__}.close cannot be called inside run (a "
                               "replica or a merge_fn); call it after run returns")
        self._executor.close()

    def __repr__(self) -> str:
        names = ", ".join(repr(d.short_name) for d in self._devices)
        return f"{type(self).__name__}(devices=[{names}])"

    def _cross_device_ops_for(self, options: CommunicationOptions, default: bool = False
                              ) -> CrossDeviceOps:
        """The `CrossDeviceOps` that ``options.implementation`` asks for."""
        implementation = options.implementation
        all_gpus = (len(self._devices) > 1 and all(d.kind == "GPU" for d in self._devices))
        if implementation is CommunicationImplementation.NCCL:
            if not all_gpus:
                raise ValueError(
                    "implementation NCCL needs every replica on its own CUDA device; this "
                    "strategy's replicas are on "
                    f"{', '.join(d.short_name for d in self._devices)}. Use AUTO or RING"
                )
            return NcclAllReduce()
        if implementation is CommunicationImplementation.RING:
            return self._reference_ops
        if default:
            return NcclAllReduce() if all_gpus else self._reference_ops
        return self._cross_device_ops

    # ------------------------------------------------------------ checks
    def _require_cross_replica(self, method: str) -> None:
        if context.current_replica_context() is not None:
            raise RuntimeError(
                f"{type(self).__name__}.{method} requires cross-replica context; use "
                "get_replica_context().merge_call() or call it outside strategy.run"
            )

    def _check_components(self, value: DistributedValues[Any], where: str) -> None:
        if len(value.values) != len(self._devices):
            raise ValueError(
                f"{where} is a {type(value).__name__} with {len(value.values)} components "
                f"but this strategy has {len(self._devices)} replicas "
                f"({', '.join(d.short_name for d in self._devices)}); build it with "
                "strategy.run or experimental_distribute_values_from_function"
            )

    def _check_all(self, tree: Any, root: str | None
                   ) -> tuple[list[Any], pytree.PyTreeSpec, bool]:
        """Flattens ``tree`` and checks its distributed leaves. ``root=None`` means
        ``tree`` is ``(args, kwargs)`` of `run`."""
        leaves, spec = pytree.flatten(tree)
        distributed = False
        for index, leaf in enumerate(leaves):
            if isinstance(leaf, DistributedValues):
                distributed = True
                if len(leaf.values) != len(self._devices):
                    path = pytree.flatten_with_path(tree)[0][index]
                    if root is None:
                        root, path = ("args", path[1:]) if path[0] == 0 else ("kwargs",
                                                                                path[1:])
                    self._check_components(leaf, pytree.format_path(path, root))
        return leaves, spec, distributed

    # ------------------------------------------------------------------ run
    def run(self, fn: Callable[..., Any], args: Sequence[Any] = (),
            kwargs: dict[str, Any] | None = None, options: Any = None) -> Any:
        """Runs ``fn(*args, **kwargs)`` once per replica, concurrently, in replica context.

        Each `PerReplica`/`Mirrored` leaf of ``args``/``kwargs`` is replaced by the
        replica's own component; other leaves are passed to every replica. Results
        are regrouped: leaves that differ become `PerReplica`.

        Args:
            fn: the step function.
            args: positional arguments (a tuple or list).
            kwargs: keyword arguments.
            options: accepted for TF compatibility; unused.

        Returns:
            ``fn``'s result, with `PerReplica` leaves where replicas differ (the plain
            result for one replica).

        Raises:
            ValueError: ``args`` is not a tuple or list; a distributed argument has
                the wrong number of components; replicas returned different structures.
            RuntimeError: called inside another ``run``.
            Exception: whatever a replica raised, with the replica named in a note.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> x = strategy.experimental_distribute_values_from_function(
            ...     lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group)))
            >>> strategy.run(lambda v: v * 10, args=(x,))
            PerReplica:{0: tensor(0.), 1: tensor(10.)}
        """
        if context.current_replica_context() is not None or context.in_merge_fn_of_run():
            raise RuntimeError(
                f"{type(self).__name__}.run cannot be called inside a replica (from the fn of "
                "another run, or from a merge_fn); call the inner function directly"
            )
        if not isinstance(args, tuple | list):
            raise ValueError(
                f"run(fn, args=...) takes a tuple or list of positional arguments; got "
                f"{type(args).__name__}. Write args=(x,) for a single argument"
            )
        if kwargs is None:
            kwargs = {}
        elif not isinstance(kwargs, dict):
            raise TypeError(f"run(fn, kwargs=...) takes a dict; got {type(kwargs).__name__}")
        if args or kwargs:
            leaves, spec, distributed = self._check_all((tuple(args), kwargs), None)
        else:
            distributed = False
        contexts = self._replica_contexts
        if self._follows_current_device:  # the default strategy: fn runs right here
            with context.in_replica(self, contexts[0]):
                return fn(*args, **kwargs)
        caller_state = _thread_state()
        caller_thread = threading.get_ident()
        caller_device = current_device()
        torch_devices = self._torch_devices

        def call(i: int) -> Any:
            if distributed:
                a, k = pytree.unflatten(spec, select_replica(i, leaves))
            else:
                a, k = args, kwargs
            with context.in_replica(self, contexts[i]):
                device = torch_devices[i]
                if device == caller_device and device.type == "cpu" and (
                        threading.get_ident() == caller_thread
                        or _thread_state() == caller_state):
                    return fn(*a, **k)  # the common case: nothing to set up
                with contextlib.ExitStack() as stack:
                    if device != caller_device or device.type != "cpu":
                        stack.enter_context(torch.device(device))
                        stack.enter_context(_cuda_device(device))
                    _enter_thread_state(stack, caller_state)
                    return fn(*a, **k)

        if len(self._devices) == 1:
            try:
                return call(0)
            except Exception as error:
                self._failure_error([ReplicaFailure(0, error)])  # adds the replica note
                raise
        rendezvous = self._rendezvous
        with self._run_lock:  # one run at a time; concurrent callers queue here
            self._caller_device = caller_device
            rendezvous.start()
            try:
                results, failures = self._executor.run(
                    call, rendezvous.replica_exited,
                    lambda: rendezvous.abort("released because strategy.run was interrupted"))
            finally:
                rendezvous.finish()
        if failures:
            raise self._failure_error(failures)
        return regroup(results, self._device_names)

    def _failure_error(self, failures: Sequence[ReplicaFailure]) -> BaseException:
        # An interrupt first; then the root cause, not a replica released because of
        # it; ties by replica id.
        interrupts = [f for f in failures if not isinstance(f.error, Exception)]
        causes = interrupts or [f for f in failures
                                if not isinstance(f.error, ReplicaAbortedError)]
        failure = min(causes or failures, key=lambda f: f.replica_id)
        error = failure.error
        note = (f"raised in replica {failure.replica_id} "
                f"({self._devices[failure.replica_id].short_name}) of {type(self).__name__}.run")
        if hasattr(error, "add_note"):
            error.add_note(note)
        else:  # Python 3.10
            error.__notes__ = [*getattr(error, "__notes__", []), note]
        return error

    # --------------------------------------------------------- cross-replica
    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: Any = None) -> Any:
        """Reduces ``value`` across replicas (and over ``axis``) onto the current device.

        ``axis=None`` combines replicas element-wise (shapes must match). With an
        ``axis`` (int, negative, or tuple), each replica's component is first reduced
        over it; MEAN is then the global sum over the global number of elements, so
        uneven per-replica batches give the exact mean. Nests are reduced leaf by leaf.
        A value that is not per-replica is returned as is by MEAN, MIN and MAX.

        Args:
            reduce_op: a `ReduceOp` or its name (``"SUM"``, ``"mean"``, ...).
            value: a `PerReplica`, `Mirrored`, tensor, or a nest of them.
            axis: ``None``, an int, or a tuple/list of ints.

        Returns:
            A tensor (or nest of tensors) on the current device.

        Raises:
            ValueError: unknown op name, mismatched components, bad axis, SUM of a
                value that is not per-replica, MIN/MAX of no elements.
            TypeError: ``reduce_op`` or ``axis`` of the wrong type; bool tensors.
            RuntimeError: called in replica context.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> v = mirrored.PerReplica([torch.tensor([0., 1, 2, 3]), torch.tensor([4., 5])])
            >>> strategy.reduce("MEAN", v, axis=0)
            tensor(2.5000)
        """
        self._require_cross_replica("reduce")
        op = ReduceOp.from_value(reduce_op)
        axes = normalize_axis(axis)
        device = current_device()
        paths, leaves, spec = pytree.flatten_with_path(value)
        out = [self._reduce_leaf(op, leaf, axes, device, pytree.format_path(path))
               for path, leaf in zip(paths, leaves, strict=True)]
        return pytree.unflatten(spec, out)

    def _reduce_leaf(self, op: ReduceOp, leaf: Any, axes: tuple[int, ...] | None,
                     device: torch.device, where: str) -> torch.Tensor:
        n = len(self._devices)
        if isinstance(leaf, PerReplica):
            self._check_components(leaf, where)
            components = [to_tensor(v, where, "reduce") for v in leaf.values]
            return reduce_components(op, components, axes, device, labels=self._labels,
                                     where=where)
        kind = type(leaf).__name__
        if isinstance(leaf, Mirrored):
            self._check_components(leaf, where)
            leaf = leaf.values[0]
        tensor = to_tensor(leaf, where, "reduce")
        if axes is not None or (n == 1 and not self._follows_current_device):
            # With an axis the value counts as given to every replica; with one
            # replica it *is* that replica's value (so MEAN promotes, as for PerReplica).
            return reduce_components(op, [tensor] * n, axes, device, labels=self._labels,
                                     where=where)
        if tensor.dtype == torch.bool:
            raise TypeError(f"reduce({op.name}) cannot reduce bool tensors (at {where}); cast "
                            "them first, e.g. x.to(torch.int32)")
        if op is ReduceOp.SUM and n > 1:
            raise ValueError(
                f"reduce(SUM) got a value that is not per-replica at {where} "
                f"({kind}); a value that is not per-replica cannot be summed "
                f"across {n} replicas; wrap it with "
                "experimental_distribute_values_from_function or run"
            )
        return tensor.to(device)

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenates each replica's component along ``axis``, in replica order, onto the
        current device. Components may differ in size along ``axis`` only. Nests are
        gathered leaf by leaf; a value that is not distributed is returned as is.

        Raises:
            ValueError: mismatched components, rank-0 components, or a bad axis.
            TypeError: ``axis`` is not an int.
            RuntimeError: called in replica context.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> v = mirrored.PerReplica([torch.tensor([[1, 2]]), torch.tensor([[3, 4], [5, 6]])])
            >>> strategy.gather(v, axis=0)
            tensor([[1, 2],
                    [3, 4],
                    [5, 6]])
        """
        self._require_cross_replica("gather")
        if isinstance(axis, bool) or not isinstance(axis, int):
            raise TypeError(f"gather: axis must be an int; got {type(axis).__name__} {axis!r}")
        device = current_device()
        paths, leaves, spec = pytree.flatten_with_path(value)
        out = []
        for path, leaf in zip(paths, leaves, strict=True):
            where = pytree.format_path(path)
            if isinstance(leaf, DistributedValues):
                self._check_components(leaf, where)
                components = [to_tensor(v, where, "gather") for v in leaf.values]
                out.append(gather_components(components, axis, device, labels=self._labels,
                                             where=where))
            else:
                out.append(leaf)
        return pytree.unflatten(spec, out)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """This worker's components of ``value``, one per local replica.

        A nest holding distributed leaves gives one nest per replica; anything else
        gives ``(value,)``.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> v = mirrored.PerReplica([torch.tensor(0), torch.tensor(1)])
            >>> strategy.experimental_local_results({"x": v, "y": 2})
            ({'x': tensor(0), 'y': 2}, {'x': tensor(1), 'y': 2})
        """
        if isinstance(value, DistributedValues):
            self._check_components(value, "value")
            return value.values
        leaves, spec, distributed = self._check_all(value, "value")
        if not distributed:
            return (value,)
        return tuple(pytree.unflatten(spec, select_replica(i, leaves))
                     for i in range(len(self._devices)))

    def experimental_distribute_values_from_function(
            self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Builds a per-replica value by calling ``value_fn(ValueContext)`` once per replica,
        in replica order. Tensors are moved to each replica's device.

        Returns:
            A `PerReplica` (a nest of them if ``value_fn`` returns a nest); the raw
            value for a single-replica strategy.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> strategy.experimental_distribute_values_from_function(
            ...     lambda ctx: torch.tensor(ctx.replica_id_in_sync_group * 2))
            PerReplica:{0: tensor(0), 1: tensor(2)}
        """
        n = len(self._devices)
        values = []
        for i, device in enumerate(self._devices):
            value = value_fn(ValueContext(i, n))
            if device.kind != "CPU":
                target = device.torch_device
                value = pytree.tree_map(
                    lambda x, t=target: x.to(t) if isinstance(x, torch.Tensor) else x, value)
            values.append(value)
        if n == 1:
            return values[0]
        return regroup(values, self._device_names, collapse_identical=False)


_ThreadState = tuple[bool, bool, bool, torch.dtype, bool, torch.dtype]


def _thread_state() -> _ThreadState:
    """Torch's thread-local modes that a replica thread must share with the caller:
    grad mode, inference mode, and CPU and CUDA autocast."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
            torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))


def _enter_thread_state(stack: contextlib.ExitStack, state: _ThreadState) -> None:
    grad, inference, cpu_autocast, cpu_dtype, cuda_autocast, cuda_dtype = state
    if torch.is_inference_mode_enabled() != inference:
        stack.enter_context(torch.inference_mode(inference))
    if torch.is_grad_enabled() != grad:
        stack.enter_context(torch.set_grad_enabled(grad))
    if (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")) != (
            cpu_autocast, cpu_dtype):
        stack.enter_context(torch.autocast("cpu", dtype=cpu_dtype, enabled=cpu_autocast))
    if (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")) != (
            cuda_autocast, cuda_dtype):
        stack.enter_context(torch.autocast("cuda", dtype=cuda_dtype, enabled=cuda_autocast))


@contextlib.contextmanager
def _cuda_device(device: torch.device) -> Iterator[None]:
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


@final
class MirroredStrategy(Strategy):
    """Synchronous data parallelism over the replicas of one process.

    Args:
        devices: replica devices (``"CPU:0"``, ``"GPU:1"``, ``"cuda:0"``, canonical
            names). ``CPU:k`` are logical CPU devices: several replicas on the host.
            Default: every visible CUDA device, else one CPU replica.
        cross_device_ops: a `CrossDeviceOps`; default: NCCL when every replica has
            its own GPU, else `ReductionToOneDevice`.
        communication_options: default `CommunicationOptions` for collectives
            (beyond TF, where only the multi-worker strategy takes them).

    Raises:
        ValueError: an empty list, duplicates, a malformed name, or a GPU that is
            not visible.

    Example:
        >>> import torch, mirrored
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> def step_fn():
        ...     i = mirrored.get_replica_context().replica_id_in_sync_group
        ...     return torch.tensor(i)
        >>> per_replica_result = strategy.run(step_fn)
        >>> strategy.reduce("SUM", per_replica_result, axis=None)
        tensor(1)
    """

    def __init__(self, devices: Sequence[str | torch.device] | None = None,
                 cross_device_ops: CrossDeviceOps | None = None, *,
                 communication_options: CommunicationOptions | None = None) -> None:
        if devices is None:
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            devices = [f"GPU:{i}" for i in range(count)] or ["CPU:0"]
        super().__init__(parse_devices(devices), cross_device_ops, communication_options)


@final
class OneDeviceStrategy(Strategy):
    """One replica on one device: ``run`` calls ``fn`` there directly.

    Example:
        >>> import torch, mirrored
        >>> strategy = mirrored.OneDeviceStrategy("CPU:0")
        >>> strategy.run(lambda: torch.tensor(3.0))
        tensor(3.)
    """

    def __init__(self, device: str | torch.device) -> None:
        super().__init__(parse_devices([device]))


@final
class _DefaultStrategy(Strategy):
    """What `get_strategy` returns outside any scope: one replica on the current device.

    ``run`` calls ``fn`` directly, on the caller's thread and device; ``reduce`` of a
    plain value returns it (MEAN, MIN, MAX and SUM alike, since there is one replica).
    Its nominal device name is the host CPU's."""

    def __init__(self) -> None:
        super().__init__((parse_device("CPU:0"),))
        self._follows_current_device = True

    def __repr__(self) -> str:
        return "<default strategy>"


_default: _DefaultStrategy | None = None
_default_lock = threading.Lock()


def default_strategy() -> Strategy:
    """The process-wide default strategy."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = _DefaultStrategy()
    return _default
