"""`ClusterSpec`: the jobs of a multi-worker cluster and this process's place in it, as
frozen, validated data.

Ids follow SPEC §11: the chief, if the cluster has one, is ``worker_index`` 0 and the
workers follow in order, so with a chief ``("worker", i)`` is ``worker_index`` ``i + 1``;
without one ``("worker", i)`` is ``worker_index`` ``i`` and worker 0 acts as chief.
`split_address` and `format_address` convert ``host:port`` strings (IPv6 in brackets).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

__all__ = ["JOB_NAMES", "ClusterSpec", "format_address", "parse_port", "split_address"]

JOB_NAMES = ("chief", "worker")
"""The jobs a multi-worker cluster may have, in id order."""

_DIGITS = re.compile(r"[0-9]+")

Source = Literal["explicit", "local", "TF_CONFIG", "torchrun"]
_SOURCES = ("explicit", "local", "TF_CONFIG", "torchrun")


def parse_port(text: str, *, where: str) -> int:
    """A TCP port number from its decimal text.

    Raises:
        ValueError: not a decimal integer in ``1..65535``; the message names ``where``.

    Example:
        >>> parse_port("29500", where="MASTER_PORT")
        29500
    """
    if not isinstance(text, str) or not _DIGITS.fullmatch(text.strip()):
        raise ValueError(f"{where} must be a port number (an integer in 1..65535); got {text!r}")
    port = int(text)
    if not 1 <= port <= 65535:
        raise ValueError(f"{where} must be a port number in 1..65535; got {port}")
    return port


def split_address(address: object, *, where: str) -> tuple[str, int]:
    """``"host:port"`` as ``(host, port)``; an IPv6 host is written in brackets.

    Raises:
        ValueError: not a string of the form ``host:port``, or a bad port; the
            message names ``where``.

    Example:
        >>> split_address("10.0.0.2:2222", where="worker 0"), split_address("[::1]:80", where="x")
        (('10.0.0.2', 2222), ('::1', 80))
    """
    if not isinstance(address, str):
        raise ValueError(f"{where} must be a 'host:port' string; got {type(address).__name__} "
                         f"{address!r}")
    host, sep, port_text = address.strip().rpartition(":")
    if not sep or not host:
        raise ValueError(f"{where} must be a 'host:port' string; got {address!r}, which has "
                         "no host or no ':port'")
    if host.startswith("[") and host.endswith("]") and len(host) > 2:
        host = host[1:-1]
    elif ":" in host or "[" in host or "]" in host:
        raise ValueError(f"{where} must be a 'host:port' string, with an IPv6 host in brackets "
                         f"('[::1]:2222'); got {address!r}")
    return host, parse_port(port_text, where=f"the port of {where} ({address!r})")


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets.

    Example:
        >>> format_address("10.0.0.2", 2222), format_address("::1", 80)
        ('10.0.0.2:2222', '[::1]:80')
    """
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (
            high is not None and value > high):
        bound = f"in {low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"ClusterSpec.{name} must be an int {bound}; got "
                         f"{type(value).__name__} {value!r}")
    return value


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """A multi-worker job as this process sees it: how many workers, which one this is,
    and where the rendezvous (master) is.

    Args:
        num_workers: how many worker processes the job has (chief included).
        worker_index: this process's id in the cluster, ``0 .. num_workers - 1``; the
            chief (or worker 0 without one) is 0.
        master_addr: host of the rendezvous: the chief's, else worker 0's.
        master_port: its TCP port, ``1..65535``.
        local_rank: this process's index among the workers on its machine.
        local_world_size: how many workers run on this machine.
        jobs: the cluster's addresses, ``(("chief", ("h:p",)), ("worker", ("h:p", ...)))``,
            in `JOB_NAMES` order; empty when they are unknown (torchrun only gives the
            master's address). When given, they must hold ``num_workers`` addresses.
        source: where the spec came from: ``"TF_CONFIG"``, ``"torchrun"``, ``"local"``
            (nothing configured: one worker) or ``"explicit"``.
        attempt: which (re)start of the job this is (torchrun's
            ``TORCHELASTIC_RESTART_COUNT``): the rendezvous keys of each attempt are
            kept apart, so a restarted job never reads a dead attempt's addresses.
        agent_store: torchrun's agent hosts the rendezvous store
            (``TORCHELASTIC_USE_AGENT_STORE=True``): every worker connects to it as a
            client, worker 0 included (binding its port would fail).

    Attributes:
        task_type: ``"chief"`` or ``"worker"`` (derived from ``worker_index`` and ``jobs``).
        task_id: the index within that job (derived).

    Raises:
        ValueError: a field out of range, or ``jobs`` that disagree with ``num_workers``.

    Example:
        >>> spec = ClusterSpec(num_workers=3, worker_index=2, master_addr="h0",
        ...                    master_port=2222, jobs=(("chief", ("h0:2222",)),
        ...                                            ("worker", ("h1:2222", "h2:2222"))))
        >>> spec.task_type, spec.task_id, spec.is_chief, spec.master_address
        ('worker', 1, False, 'h0:2222')
    """

    num_workers: int = 1
    worker_index: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    local_rank: int = 0
    local_world_size: int = 1
    jobs: tuple[tuple[str, tuple[str, ...]], ...] = ()
    source: Source = "explicit"
    attempt: int = 0
    agent_store: bool = False
    task_type: Literal["chief", "worker"] = dataclasses.field(init=False)
    task_id: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        n = _check_int("num_workers", self.num_workers, 1)
        index = _check_int("worker_index", self.worker_index, 0, n - 1)
        _check_int("master_port", self.master_port, 1, 65535)
        lws = _check_int("local_world_size", self.local_world_size, 1, n)
        _check_int("local_rank", self.local_rank, 0, lws - 1)
        if not isinstance(self.master_addr, str) or not self.master_addr.strip():
            raise ValueError(f"ClusterSpec.master_addr must be a non-empty host name or IP "
                             f"address; got {self.master_addr!r}")
        if self.source not in _SOURCES:
            raise ValueError(f"ClusterSpec.source must be one of {_SOURCES}; got "
                             f"{self.source!r}")
        jobs = self._checked_jobs()
        if jobs:
            total = sum(len(addresses) for _, addresses in jobs)
            if total != n:
                raise ValueError(f"ClusterSpec.jobs list {total} task(s) but num_workers is "
                                 f"{n}; they must agree")
        has_chief = bool(jobs) and jobs[0][0] == "chief"
        set_ = object.__setattr__
        set_(self, "jobs", jobs)
        set_(self, "task_type", "chief" if has_chief and index == 0 else "worker")
        set_(self, "task_id", index - 1 if has_chief and index > 0 else index)

    def _checked_jobs(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        try:
            pairs = [(name, tuple(addresses)) for name, addresses in self.jobs]
        except (TypeError, ValueError):
            raise ValueError(
                "ClusterSpec.jobs must be a tuple of (job name, tuple of 'host:port') pairs; got "
                f"{self.jobs!r}") from None
        names = [name for name, _ in pairs]
        if names != [n for n in JOB_NAMES if n in names]:
            raise ValueError(f"ClusterSpec.jobs must name each of {JOB_NAMES} at most once, in "
                             f"that order; got {names}")
        for name, addresses in pairs:
            if not addresses:
                raise ValueError(f"ClusterSpec.jobs[{name!r}] has no addresses; leave the job "
                                 "out instead")
            if name == "chief" and len(addresses) > 1:
                raise ValueError(f"a cluster has at most one chief; ClusterSpec.jobs['chief'] "
                                 f"has {len(addresses)}: {list(addresses)}")
            for i, address in enumerate(addresses):
                split_address(address, where=f"ClusterSpec.jobs[{name!r}][{i}]")
        return tuple(pairs)

    @property
    def is_chief(self) -> bool:
        """Whether this is worker 0: the chief, or worker 0 of a cluster without one."""
        return self.worker_index == 0

    @property
    def master_address(self) -> str:
        """The rendezvous address, ``host:port``."""
        return format_address(self.master_addr, self.master_port)

    @property
    def init_method(self) -> str:
        """The rendezvous as a `torch.distributed` init method, ``tcp://host:port``."""
        return f"tcp://{self.master_address}"

    def as_dict(self) -> dict[str, list[str]]:
        """The cluster's jobs as TF writes them, ``{"worker": ["host:port", ...]}``
        (empty when the addresses are unknown).

        Example:
            >>> ClusterSpec(num_workers=2, jobs=(("worker", ("a:1", "b:1")),)).as_dict()
            {'worker': ['a:1', 'b:1']}
        """
        return {name: list(addresses) for name, addresses in self.jobs}

    def torch_env(self) -> dict[str, str]:
        """torchrun's variables for this process (what ``init_process_group("env://")``
        reads), whatever the source.

        Example:
            >>> ClusterSpec(num_workers=2, worker_index=1, master_port=1234).torch_env()["RANK"]
            '1'
        """
        return {"RANK": str(self.worker_index), "WORLD_SIZE": str(self.num_workers),
                "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}
