"""Whether the workers of a multi-worker job built the same model and optimizer:
``strategy.mirror`` and ``mirror_optimizer`` agree once (one header round each, no cost
per step) on a digest of the module's structure and of the optimizer's settings. The
parameters' values need no check (``mirror`` copies the chief's), but workers whose
layers differ where no parameter shows it (Tanh on one, ReLU on another; Dropout's p,
BatchNorm's momentum) or whose optimizers' settings differ (a learning rate, nesterov)
would train bitwise-equal copies of what no one device trains, or copies that drift
apart. A digest is a deterministic hash of text (`identity_hash`: Python's ``hash()`` of a
str differs per process). A ``forward()`` written by hand that differs between workers
cannot be seen.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from ..collectives.parts import Parts
from ..comm.call_identity import identity_hash
from ..comm.watch import short

__all__ = ["agree_on_module", "agree_on_optimizer", "digest", "module_description",
           "optimizer_description"]

_BITS = 31  # per digest: two fit in the header's int64 value (non-negative)
_MASK = (1 << _BITS) - 1
# Worker-specific text that a repr may hold: object addresses, a GPU's index.
_LOCAL = re.compile(r" at 0x[0-9a-fA-F]+|(?<=cuda):\d+")
# Param group entries that change how, not what, an optimizer computes.
_IMPLEMENTATION = frozenset({"params", "foreach", "fused", "capturable", "differentiable"})
_SHOWN = 1500  # characters of this worker's description in a message


def digest(text: str) -> int:
    """A deterministic 31-bit hash of ``text`` (the same in every process: the low bits
    of `identity_hash`, the call identities' hash).

    Example:
        >>> digest("Linear(in_features=2, out_features=1, bias=True)") == digest(
        ...     "Linear(in_features=2, out_features=1, bias=True)")
        True
        >>> 0 <= digest("x") < 2 ** 31
        True
    """
    return identity_hash(text) & _MASK


def module_description(module: torch.nn.Module) -> tuple[str, str]:
    """``module``'s structure as compared across workers: its ``repr`` (the classes of
    its layers and their settings, addresses and GPU indices left out) and its
    parameters' and buffers' names, dtypes, shapes and ``requires_grad``, one a line.

    Example:
        >>> print(module_description(torch.nn.Linear(2, 1))[1])
        parameter weight: torch.float32 [1, 2]
        parameter bias: torch.float32 [1]
    """
    structure = _LOCAL.sub("", repr(module))
    tensors = [f"parameter {name}: {p.dtype} {list(p.shape)}"
               + ("" if p.requires_grad else " (frozen)")
               for name, p in module.named_parameters()]
    tensors += [f"buffer {name}: {b.dtype} {list(b.shape)}" for name, b in module.named_buffers()]
    return structure, "\n".join(tensors)


def optimizer_description(optimizer: torch.optim.Optimizer) -> str:
    """``optimizer``'s class and, per param group, its size and its settings but the
    implementation flags (``foreach``, ``fused``, ``capturable``, ``differentiable``),
    one group a line.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(1))
        >>> text = optimizer_description(torch.optim.SGD([p], lr=0.5, foreach=True))
        >>> text.splitlines()[0], "group 0 (1 parameters): " in text, "lr=0.5," in text
        ('torch.optim.sgd.SGD', True, True)
        >>> "foreach" in text
        False
    """
    kind = type(optimizer)
    lines = [f"{kind.__module__}.{kind.__qualname__}"]
    for k, group in enumerate(optimizer.param_groups):
        settings = ", ".join(f"{key}={_value(group[key])}" for key in sorted(group, key=str)
                             if key not in _IMPLEMENTATION)
        lines.append(f"group {k} ({len(group['params'])} parameters): {settings}")
    return "\n".join(lines)


def _value(value: Any) -> str:
    """A setting's exact text (a tensor's values in full, floats by ``repr``)."""
    if isinstance(value, torch.Tensor):
        return f"tensor({value.tolist()!r}, {value.dtype})"
    if isinstance(value, tuple | list):
        inner = ", ".join(_value(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    return _LOCAL.sub("", repr(value))


def _workers(ranks: list[int]) -> str:
    return (f"worker {ranks[0]} differs" if len(ranks) == 1 else
            f"workers {', '.join(map(str, ranks))} differ")


def agree_on_module(parts: Parts, module: torch.nn.Module) -> None:
    """Multi-worker: every worker's ``module`` has the structure of worker 0's
    (`module_description`; one agreement of the workers, at ``strategy.mirror``).

    Raises:
        ValueError: on every worker, when they differ: naming the workers that differ
            from worker 0 and what differs, with this worker's description.
    """
    agree = None if parts.cluster is None else parts.cluster.agree
    if agree is None:
        return
    structure, tensors = module_description(module)
    values = agree("the mirrored module's structure",
                   digest(structure) << _BITS | digest(tensors))
    if all(v == values[0] for v in values):
        return
    layers = [w for w, v in enumerate(values) if v >> _BITS != values[0] >> _BITS]
    shapes = [w for w, v in enumerate(values) if v & _MASK != values[0] & _MASK]
    found = []
    if layers:
        found.append(f"{_workers(layers)} from worker 0 in the layers (the module's repr: "
                     "their classes and settings, e.g. an activation, Dropout's p, "
                     "BatchNorm's eps or momentum)")
    if shapes:
        found.append(f"{_workers(shapes)} from worker 0 in the parameters or buffers (their "
                     "names, dtypes, shapes or requires_grad)")
    mine = structure if layers else tensors.replace("\n", "; ")
    raise ValueError(
        f"strategy.mirror: the workers' modules differ: {'; '.join(found)}. Every worker "
        "must build the same model (mirror copies the chief's values to every worker, but "
        "layers that differ would train what no one device trains); this is worker "
        f"{parts.topology.worker_index}; its module: {short(mine, _SHOWN)}. (A forward() "
        "written by hand that differs between workers cannot be seen.)")


def agree_on_optimizer(parts: Parts, optimizer: torch.optim.Optimizer) -> None:
    """Multi-worker: every worker's ``optimizer`` (replica 0's: the others copy its
    settings at every step) has the class and settings of worker 0's
    (`optimizer_description`; one agreement of the workers, at ``mirror_optimizer``).

    Raises:
        ValueError: on every worker, when they differ: naming the workers that differ
            from worker 0, with this worker's settings.
    """
    agree = None if parts.cluster is None else parts.cluster.agree
    if agree is None:
        return
    text = optimizer_description(optimizer)
    values = agree("the mirrored optimizer's settings", digest(text))
    differ = [w for w, v in enumerate(values) if v != values[0]]
    if not differ:
        return
    raise ValueError(
        f"mirror_optimizer: the workers' optimizers differ: {_workers(differ)} from worker "
        "0 in the optimizer's class or its param groups' settings or sizes (a learning "
        "rate, momentum, nesterov, weight decay, betas; foreach, fused, capturable and "
        "differentiable are not compared). Every worker must build the same optimizer, "
        "or the copies drift apart (and change its settings alike on every worker later, "
        "a scheduler stepped on every worker); this is worker "
        f"{parts.topology.worker_index}; its optimizer: "
        f"{short(text.replace(chr(10), '; '), _SHOWN)}")
