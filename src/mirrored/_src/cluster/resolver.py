"""Cluster resolvers: TF's ``ClusterResolver`` interface over a parsed `ClusterSpec`.

A resolver reads its source once, when it is made, through the pure parsers of
:mod:`.parse`, and then only answers from the frozen spec. ``os.environ`` is the default
only here, at the public entry points; pass ``environ=`` to resolve another mapping.
`default_cluster_resolver` picks torchrun's variables, else ``TF_CONFIG``, else one local
worker.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Mapping, Sequence
from typing import final

import torch

from .parse import has_tf_config, has_torchrun, parse_tf_config, parse_torchrun
from .spec import JOB_NAMES, ClusterSpec, format_address

__all__ = ["ClusterResolver", "SimpleClusterResolver", "TFConfigClusterResolver",
           "TorchrunClusterResolver", "default_cluster_resolver"]


class ClusterResolver(abc.ABC):
    """Where this process sits in a multi-worker job (TF: ``ClusterResolver``).

    Subclasses only provide `spec`; every other member derives from it.
    """

    @property
    @abc.abstractmethod
    def spec(self) -> ClusterSpec:
        """The parsed cluster and this process's place in it."""

    @final
    def cluster_spec(self) -> ClusterSpec:
        """The cluster (TF: ``cluster_spec()``); ``.as_dict()`` gives job -> addresses."""
        return self.spec

    @final
    @property
    def task_type(self) -> str:
        """``"chief"`` or ``"worker"``."""
        return self.spec.task_type

    @final
    @property
    def task_id(self) -> int:
        """This process's index within its job."""
        return self.spec.task_id

    @final
    @property
    def num_workers(self) -> int:
        """How many worker processes the job has, chief included."""
        return self.spec.num_workers

    @final
    @property
    def worker_index(self) -> int:
        """This process's id in the cluster; the chief (or worker 0) is 0."""
        return self.spec.worker_index

    @final
    @property
    def is_chief(self) -> bool:
        """Whether this process is worker 0."""
        return self.spec.is_chief

    @final
    def master(self, task_type: str | None = None, task_id: int | None = None,
               rpc_layer: str | None = None) -> str:
        """The address of the rendezvous, or of task ``(task_type, task_id)``, as
        ``host:port`` or ``rpc_layer://host:port`` (``rpc_layer="tcp"`` gives a
        `torch.distributed` init method).

        Raises:
            ValueError: a task that the cluster does not list (or whose addresses are
                unknown, as with torchrun), or only one of ``task_type`` and ``task_id``.
        """
        if (task_type is None) != (task_id is None):
            raise ValueError(f"master() needs both task_type and task_id, or neither; got "
                             f"task_type={task_type!r}, task_id={task_id!r}")
        if task_type is None or task_id is None:
            address = format_address(self.spec.master_addr, self.spec.master_port)
        else:
            jobs = dict(self.spec.jobs)
            if task_type not in jobs or not 0 <= task_id < len(jobs[task_type]):
                known = (", ".join(f"{name} 0..{len(a) - 1}" for name, a in self.spec.jobs)
                         or f"no addresses (source: {self.spec.source})")
                raise ValueError(f"no task ({task_type!r}, {task_id!r}) in this cluster; it "
                                 f"lists {known}")
            address = jobs[task_type][task_id]
        return f"{rpc_layer}://{address}" if rpc_layer else address

    @final
    def num_accelerators(self) -> dict[str, int]:
        """The accelerators this process sees, TF style: ``{"GPU": n}``, or ``{}``."""
        count = torch.cuda.device_count()
        return {"GPU": count} if count else {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


@final
class TFConfigClusterResolver(ClusterResolver):
    """The cluster described by the ``TF_CONFIG`` variable (TF: ``TFConfigClusterResolver``).

    Args:
        environ: the environment to read; ``os.environ`` when ``None``.

    Raises:
        ValueError: ``TF_CONFIG`` is unset or malformed; the message gives the JSON path.

    Example:
        >>> config = '{"cluster": {"worker": ["h0:2222", "h1:2222"]}, "task": {"type": "worker", "index": 1}}'
        >>> resolver = TFConfigClusterResolver(environ={"TF_CONFIG": config})
        >>> resolver.task_type, resolver.task_id, resolver.worker_index, resolver.master(rpc_layer="tcp")
        ('worker', 1, 1, 'tcp://h0:2222')
        >>> resolver.cluster_spec().as_dict()
        {'worker': ['h0:2222', 'h1:2222']}
    """  # noqa: E501

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._spec = parse_tf_config(os.environ if environ is None else environ)

    @property
    def spec(self) -> ClusterSpec:
        """The parsed ``TF_CONFIG``."""
        return self._spec


@final
class TorchrunClusterResolver(ClusterResolver):
    """The job described by torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT`` (and optionally ``LOCAL_WORLD_SIZE``).

    Args:
        environ: the environment to read; ``os.environ`` when ``None``.

    Raises:
        ValueError: a variable missing or malformed; the message names it.

    Example:
        >>> resolver = TorchrunClusterResolver(environ={
        ...     "RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
        ...     "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
        >>> resolver.num_workers, resolver.is_chief, resolver.spec.local_world_size
        (4, True, 2)
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self._spec = parse_torchrun(os.environ if environ is None else environ)

    @property
    def spec(self) -> ClusterSpec:
        """The parsed variables."""
        return self._spec


@final
class SimpleClusterResolver(ClusterResolver):
    """A cluster given explicitly (TF: ``SimpleClusterResolver``): either a whole
    `ClusterSpec`, or its fields.

    Args:
        spec: the spec; then give no other argument.
        num_workers, worker_index, master_addr, master_port, local_rank,
            local_world_size: as in `ClusterSpec` (defaults: one local worker).
        cluster: optional addresses, ``{"chief": ["h:p"], "worker": ["h:p", ...]}``.

    Raises:
        TypeError: a ``spec`` that is not a `ClusterSpec`, or both a spec and fields.
        ValueError: fields that `ClusterSpec` rejects.

    Example:
        >>> resolver = SimpleClusterResolver(num_workers=2, worker_index=1,
        ...                                  cluster={"worker": ["h0:1", "h1:1"]},
        ...                                  master_addr="h0", master_port=1)
        >>> resolver.task_type, resolver.task_id, resolver.master("worker", 1)
        ('worker', 1, 'h1:1')
    """

    def __init__(self, spec: ClusterSpec | None = None, *, num_workers: int | None = None,
                 worker_index: int | None = None, master_addr: str | None = None,
                 master_port: int | None = None, local_rank: int | None = None,
                 local_world_size: int | None = None,
                 cluster: Mapping[str, Sequence[str]] | None = None) -> None:
        fields = {name: value for name, value in (
            ("num_workers", num_workers), ("worker_index", worker_index),
            ("master_addr", master_addr), ("master_port", master_port),
            ("local_rank", local_rank), ("local_world_size", local_world_size))
            if value is not None}
        if spec is not None:
            if not isinstance(spec, ClusterSpec):
                raise TypeError(f"spec must be a ClusterSpec; got {type(spec).__name__}")
            if fields or cluster is not None:
                raise TypeError("give SimpleClusterResolver either a spec or its fields, not "
                                f"both; got a spec and {sorted(fields) or ['cluster']}")
            self._spec = spec
            return
        if cluster is not None:
            if not isinstance(cluster, Mapping):
                raise TypeError(f"cluster must be a mapping of job name -> addresses; got "
                                f"{type(cluster).__name__}")
            unknown = sorted(set(cluster) - set(JOB_NAMES))
            if unknown:
                raise ValueError(f"cluster may only have the jobs {JOB_NAMES}; got {unknown}")
            jobs = tuple((name, tuple(cluster[name])) for name in JOB_NAMES
                         if cluster.get(name))
            self._spec = ClusterSpec(jobs=jobs, **fields)  # type: ignore[arg-type]
        else:
            self._spec = ClusterSpec(**fields)  # type: ignore[arg-type]

    @property
    def spec(self) -> ClusterSpec:
        """The given spec."""
        return self._spec


def default_cluster_resolver(environ: Mapping[str, str] | None = None) -> ClusterResolver:
    """The resolver for this process's launch: torchrun's variables if any of ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK`` is set, else a non-blank ``TF_CONFIG``, else one local
    worker (``spec.source == "local"``).

    Args:
        environ: the environment to read; ``os.environ`` when ``None``.

    Raises:
        ValueError: the chosen configuration is malformed.

    Example:
        >>> default_cluster_resolver(environ={}).spec.source
        'local'
        >>> type(default_cluster_resolver(environ={"RANK": "0", "WORLD_SIZE": "1",
        ...     "LOCAL_RANK": "0", "MASTER_ADDR": "h", "MASTER_PORT": "1"})).__name__
        'TorchrunClusterResolver'
    """
    env = os.environ if environ is None else environ
    if has_torchrun(env):
        return TorchrunClusterResolver(env)
    if has_tf_config(env):
        return TFConfigClusterResolver(env)
    return SimpleClusterResolver(ClusterSpec(source="local"))
