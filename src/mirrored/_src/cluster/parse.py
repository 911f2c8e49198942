"""Pure parsers from an environment mapping to a `ClusterSpec`: ``TF_CONFIG``, torchrun's
variables, and the default rule choosing between them.

Nothing here reads ``os.environ``: each function takes the mapping, so the same input gives
the same spec and tests need no monkeypatching. Errors name the variable or the JSON path
(``TF_CONFIG["cluster"]["worker"][1]``) that is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .spec import JOB_NAMES, ClusterSpec, parse_port, split_address

__all__ = ["TORCHRUN_VARIABLES", "has_tf_config", "has_torchrun", "parse_environ",
           "parse_tf_config", "parse_torchrun"]

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""The variables torchrun sets that a process needs (``LOCAL_WORLD_SIZE`` is optional)."""

# Any of these marks a torchrun-style launch; MASTER_ADDR/PORT alone do not (some
# schedulers export them to every job).
_TORCHRUN_MARKERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def has_torchrun(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` has any of torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``.

    Example:
        >>> has_torchrun({"RANK": "0"}), has_torchrun({"MASTER_ADDR": "h"})
        (True, False)
    """
    return any(name in environ for name in _TORCHRUN_MARKERS)


def has_tf_config(environ: Mapping[str, str]) -> bool:
    """Whether ``environ`` has a non-blank ``TF_CONFIG``.

    Example:
        >>> has_tf_config({"TF_CONFIG": " "}), has_tf_config({"TF_CONFIG": "{}"})
        (False, True)
    """
    return bool(environ.get("TF_CONFIG", "").strip())


def _env_int(environ: Mapping[str, str], name: str, *, low: int) -> int:
    if name not in environ:
        raise ValueError(
            f"{name} is not set; a torchrun-style launch needs all of "
            f"{', '.join(TORCHRUN_VARIABLES)} (got {_present(environ)})")
    text = environ[name]
    if not text.strip().isdigit() or not text.strip().isascii():
        raise ValueError(f"{name} must be an integer >= {low}; got {text!r}")
    value = int(text)
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value}")
    return value


def _present(environ: Mapping[str, str]) -> str:
    names = [n for n in (*TORCHRUN_VARIABLES, "LOCAL_WORLD_SIZE") if n in environ]
    return ", ".join(f"{n}={environ[n]!r}" for n in names) or "none of them"


def parse_torchrun(environ: Mapping[str, str]) -> ClusterSpec:
    """The spec torchrun's variables describe: ``worker_index`` is ``RANK``.

    Args:
        environ: the environment, e.g. ``os.environ``.

    Returns:
        A `ClusterSpec` with ``source="torchrun"`` and no ``jobs`` (torchrun does not tell
        a process its peers' addresses). Without ``LOCAL_WORLD_SIZE``,
        ``local_world_size`` is ``LOCAL_RANK + 1``, the least it can be.

    Raises:
        ValueError: a variable of `TORCHRUN_VARIABLES` missing, not a non-negative
            integer (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) or
            port, ``RANK >= WORLD_SIZE``, ``LOCAL_RANK >= LOCAL_WORLD_SIZE``, or an empty
            ``MASTER_ADDR``; the message names the variable.

    Example:
        >>> spec = parse_torchrun({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        ...                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
        >>> spec.worker_index, spec.num_workers, spec.task_type, spec.is_chief
        (1, 2, 'worker', False)
    """
    world_size = _env_int(environ, "WORLD_SIZE", low=1)
    rank = _env_int(environ, "RANK", low=0)
    if rank >= world_size:
        raise ValueError(f"RANK must be less than WORLD_SIZE ({world_size}); got RANK={rank}")
    local_rank = _env_int(environ, "LOCAL_RANK", low=0)
    if local_rank >= world_size:
        raise ValueError(f"LOCAL_RANK must be less than WORLD_SIZE ({world_size}); got "
                         f"LOCAL_RANK={local_rank}")
    if "LOCAL_WORLD_SIZE" in environ:
        local_world_size = _env_int(environ, "LOCAL_WORLD_SIZE", low=1)
        if local_world_size > world_size:
            raise ValueError(f"LOCAL_WORLD_SIZE must be at most WORLD_SIZE ({world_size}); got "
                             f"LOCAL_WORLD_SIZE={local_world_size}")
        if local_rank >= local_world_size:
            raise ValueError(f"LOCAL_RANK must be less than LOCAL_WORLD_SIZE "
                             f"({local_world_size}); got LOCAL_RANK={local_rank}")
    else:
        local_world_size = local_rank + 1  # unknown: at least this many
    if "MASTER_ADDR" not in environ or "MASTER_PORT" not in environ:
        missing = "MASTER_ADDR" if "MASTER_ADDR" not in environ else "MASTER_PORT"
        raise ValueError(f"{missing} is not set; a torchrun-style launch needs all of "
                         f"{', '.join(TORCHRUN_VARIABLES)} (got {_present(environ)})")
    addr = environ["MASTER_ADDR"].strip()
    if not addr:
        raise ValueError("MASTER_ADDR must be the rendezvous host name or IP address; got "
                         f"{environ['MASTER_ADDR']!r}")
    port = parse_port(environ["MASTER_PORT"], where="MASTER_PORT")
    attempt = (_env_int(environ, "TORCHELASTIC_RESTART_COUNT", low=0)
               if "TORCHELASTIC_RESTART_COUNT" in environ else 0)
    return ClusterSpec(num_workers=world_size, worker_index=rank, master_addr=addr,
                       master_port=port, local_rank=local_rank,
                       local_world_size=local_world_size, source="torchrun", attempt=attempt,
                       agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def _json_type(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


def parse_tf_config(environ: Mapping[str, str]) -> ClusterSpec:
    """The spec ``TF_CONFIG`` describes: the chief, if any, is worker 0, then the workers.

    ``TF_CONFIG`` is ``{"cluster": {"chief": ["host:port"], "worker": ["host:port", ...]},
    "task": {"type": "worker", "index": i}}`` (``chief`` optional, ``index`` defaults to 0);
    other top-level keys (``rpc_layer``, ``environment``) are ignored. The master is the
    chief's address, else worker 0's. Each task is one process: ``local_rank`` 0.

    Args:
        environ: the environment, e.g. ``os.environ``.

    Raises:
        ValueError: ``TF_CONFIG`` unset or not JSON; no ``cluster`` or ``task``; a job
            other than ``chief`` and ``worker``; no tasks at all; more than one chief; an
            address that is not ``host:port`` with a numeric port; a task type not in the
            cluster; an index that is not an integer or is out of range. The message
            names the JSON path.

    Example:
        >>> config = ('{"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222", "h2:2222"]},'
        ...           ' "task": {"type": "worker", "index": 0}}')
        >>> spec = parse_tf_config({"TF_CONFIG": config})
        >>> spec.worker_index, spec.num_workers, spec.master_address, spec.is_chief
        (1, 3, 'h0:2222', False)
    """
    if not has_tf_config(environ):
        raise ValueError("TF_CONFIG is not set (or blank); expected JSON like "
                         '{"cluster": {"worker": ["host:port", ...]}, '
                         '"task": {"type": "worker", "index": 0}}')
    text = environ["TF_CONFIG"]
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"TF_CONFIG is not valid JSON: {e.msg} at line {e.lineno} column "
                         f"{e.colno}; got {text[:200]!r}") from None
    if not isinstance(config, dict):
        raise ValueError(f"TF_CONFIG must be a JSON object; got {_json_type(config)}")
    jobs = _parse_cluster(config)
    task_type, task_id = _parse_task(config, dict(jobs))
    worker_index = task_id + (1 if task_type == "worker" and jobs[0][0] == "chief" else 0)
    master_addr, master_port = split_address(jobs[0][1][0], where="TF_CONFIG master")
    return ClusterSpec(num_workers=sum(len(a) for _, a in jobs), worker_index=worker_index,
                       master_addr=master_addr, master_port=master_port, jobs=jobs,
                       source="TF_CONFIG")


def _parse_cluster(config: dict[str, Any]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    if "cluster" not in config:
        raise ValueError('TF_CONFIG has no "cluster"; expected '
                         '{"cluster": {"worker": ["host:port", ...]}, ...}')
    cluster = config["cluster"]
    if not isinstance(cluster, dict):
        raise ValueError(f'TF_CONFIG["cluster"] must be an object of job name -> addresses; '
                         f"got {_json_type(cluster)}")
    for name in cluster:
        if name not in JOB_NAMES:
            raise ValueError(f'TF_CONFIG["cluster"] has a job {name!r}; MultiWorkerMirrored '
                             f"clusters have only {' and '.join(repr(n) for n in JOB_NAMES)}")
    jobs = []
    for name in JOB_NAMES:
        addresses = cluster.get(name, [])
        where = f'TF_CONFIG["cluster"]["{name}"]'
        if not isinstance(addresses, list):
            raise ValueError(f'{where} must be an array of "host:port" strings; got '
                             f"{_json_type(addresses)}")
        for i, address in enumerate(addresses):
            split_address(address, where=f"{where}[{i}]")
        if name == "chief" and len(addresses) > 1:
            raise ValueError(f"a cluster has at most one chief; {where} has {len(addresses)}")
        if addresses:
            jobs.append((name, tuple(a.strip() for a in addresses)))
    if not jobs:
        raise ValueError('TF_CONFIG["cluster"] has no workers: expected a non-empty "worker" '
                         '(or "chief") array of "host:port" addresses')
    return tuple(jobs)


def _parse_task(config: dict[str, Any], jobs: dict[str, tuple[str, ...]]) -> tuple[str, int]:
    if "task" not in config:
        raise ValueError('TF_CONFIG has no "task"; expected {"task": {"type": "worker", '
                         '"index": i}} naming this process')
    task = config["task"]
    if not isinstance(task, dict):
        raise ValueError(f'TF_CONFIG["task"] must be an object like {{"type": "worker", '
                         f'"index": 0}}; got {_json_type(task)}')
    if "type" not in task:
        raise ValueError('TF_CONFIG["task"] has no "type"; expected "chief" or "worker"')
    task_type = task["type"]
    if task_type not in JOB_NAMES:
        raise ValueError(f'TF_CONFIG["task"]["type"] must be "chief" or "worker"; got '
                         f"{task_type!r}")
    if task_type not in jobs:
        raise ValueError(f'TF_CONFIG["task"]["type"] is {task_type!r} but TF_CONFIG["cluster"] '
                         f"has no {task_type!r} addresses")
    index = task.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValueError(f'TF_CONFIG["task"]["index"] must be an integer; got '
                         f"{_json_type(index)} {index!r}")
    count = len(jobs[task_type])
    if not 0 <= index < count:
        raise ValueError(f'TF_CONFIG["task"]["index"] is {index} but '
                         f'TF_CONFIG["cluster"]["{task_type}"] has {count} address(es), so it '
                         f"must be in 0..{count - 1}")
    return task_type, index


def parse_environ(environ: Mapping[str, str]) -> ClusterSpec:
    """The default rule: torchrun's variables if any is set, else ``TF_CONFIG``, else one
    local worker (``source="local"``).

    Raises:
        ValueError: the chosen configuration is malformed (see `parse_torchrun` and
            `parse_tf_config`).

    Example:
        >>> parse_environ({}).num_workers, parse_environ({}).source
        (1, 'local')
    """
    if has_torchrun(environ):
        return parse_torchrun(environ)
    if has_tf_config(environ):
        return parse_tf_config(environ)
    return ClusterSpec(source="local")
