"""Per-replica random streams for logical CPU replicas.

Logical CPU replicas share torch's one CPU generator, so concurrent replicas would
draw from it in thread order and a seeded step would not repeat. Instead, inside
``run`` each CPU replica draws from a generator of its own: the first random call
of a run draws one 64-bit base seed from the caller's generator (so
``torch.manual_seed(s)`` before ``run`` fixes every stream, and successive runs
differ), and replica ``r``'s generator is seeded with ``mix(base, r)``. A torch
function mode on the replica's thread routes the random functions to it:

- functions that take ``generator=`` (``rand*``, ``randint``, ``randperm``,
  ``bernoulli``, ``normal``, ``multinomial``, ``poisson``, ``Tensor.uniform_`` and the
  other in-place samplers) get the replica's generator passed in;
- dropout (``F.dropout``, ``dropout1d/2d/3d``, ``torch.dropout``,
  ``torch.feature_dropout``) is computed with a Bernoulli mask drawn from it;
- composites that draw internally without a ``generator`` parameter
  (``F.multi_head_attention_forward``, ``F.scaled_dot_product_attention`` with
  dropout, ``alpha_dropout``, ``rrelu``, ``gumbel_softmax``, fractional max pooling)
  run with the replica's state swapped into the CPU generator under a lock. A
  thread outside ``run`` drawing from the CPU generator at that very moment can
  interleave with them: that case alone is not isolated.

A call with an explicit ``generator=`` is left alone. CUDA replicas have a
generator per device and need none of this.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["RandomStreams", "drop_stale_modes", "library_call"]

_T = torch.Tensor
# Random functions that accept ``generator=``: the replica's generator is passed in.
WITH_GENERATOR: frozenset[Callable[..., Any]] = frozenset({
    torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.randperm, torch.bernoulli, torch.normal, torch.poisson,
    torch.multinomial, _T.bernoulli, _T.bernoulli_, _T.normal_, _T.uniform_, _T.random_,
    _T.exponential_, _T.geometric_, _T.cauchy_, _T.log_normal_, _T.multinomial,
})
# Composites that draw internally and take no generator: run with the CPU generator's
# state swapped for the replica's, under a lock.
SWAPPED: frozenset[Callable[..., Any]] = frozenset({
    torch.alpha_dropout, torch.feature_alpha_dropout, torch.rrelu, F.alpha_dropout,
    F.feature_alpha_dropout, F.rrelu, F.gumbel_softmax, F.multi_head_attention_forward,
    F.scaled_dot_product_attention, F.fractional_max_pool2d, F.fractional_max_pool3d,
})
_MASK = (1 << 63) - 1
_lock = threading.Lock()  # process-wide: every swap of the CPU generator's state


def _dropout(generator: torch.Generator, x: torch.Tensor, p: float, training: bool,
             inplace: bool, channels: bool) -> torch.Tensor:
    """Dropout (element-wise, or of whole channels) with a mask from ``generator``."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return x
    if channels:  # one draw per (batch, channel): the mask broadcasts over the rest
        batched = x.dim() >= 3
        shape = (*x.shape[:2], *[1] * (x.dim() - 2)) if batched else (x.shape[0], *[1] * (
            x.dim() - 1))
    else:
        shape = tuple(x.shape)
    keep = 1.0 - p
    mask = torch.empty(shape, dtype=x.dtype, device=x.device)
    mask = mask.bernoulli_(keep, generator=generator) if keep > 0 else mask.zero_()
    scale = mask.div_(keep) if keep > 0 else mask
    return x.mul_(scale) if inplace else x * scale


def _bind_dropout(func: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]
                  ) -> tuple[torch.Tensor, float, bool, bool, bool]:
    names: tuple[str, ...] = ("input", "p", "training", "inplace")
    if func in (torch.dropout, torch.feature_dropout):  # (input, p, train)
        names = ("input", "p", "train")
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    training = bool(bound.get("training", bound.get("train", True)))
    channels = func in (F.dropout1d, F.dropout2d, F.dropout3d, torch.feature_dropout)
    return (bound["input"], float(bound.get("p", 0.5)), training,
            bool(bound.get("inplace", False)), channels)


DROPOUT: frozenset[Callable[..., Any]] = frozenset({
    F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, torch.dropout, torch.feature_dropout})


class RandomStreams:
    """The random streams of one strategy's local replicas.

    Args:
        replica_ids: the global ids of the local replicas (their streams differ).
    """

    def __init__(self, replica_ids: Sequence[int]) -> None:
        self._ids = tuple(replica_ids)
        self._base: int | None = None
        self._generators: list[torch.Generator | None] = [None] * len(self._ids)
        self._modes = [_ReplicaRandom(self, i) for i in range(len(self._ids))]

    def start_run(self) -> None:
        """A new run: streams are drawn afresh at the first random call."""
        self._base = None
        self._generators = [None] * len(self._ids)

    def mode(self, index: int) -> TorchFunctionMode:
        """The mode to enter on replica ``index``'s thread for its function."""
        return self._modes[index]

    def generator(self, index: int) -> torch.Generator:
        """Replica ``index``'s generator for this run (seeded at its first use)."""
        generator = self._generators[index]
        if generator is None:
            with _lock:
                if self._base is None:
                    self._base = int(torch.randint(0, 1 << 62, (1,)).item())
                base = self._base
            generator = torch.Generator()
            generator.manual_seed((base * 0x9E3779B97F4A7C15 + self._ids[index]) & _MASK)
            self._generators[index] = generator
        return generator

    def call(self, index: int, func: Callable[..., Any], args: Sequence[Any],
             kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)`` drawing from replica ``index``'s stream."""
        generator = self.generator(index)
        if func in WITH_GENERATOR:
            return func(*args, **kwargs, generator=generator)
        if func in DROPOUT:
            return _dropout(generator, *_bind_dropout(func, args, kwargs))
        cpu = torch.default_generator
        with _lock:
            saved = cpu.get_state()
            cpu.set_state(generator.get_state())
            try:
                return func(*args, **kwargs)
            finally:
                generator.set_state(cpu.get_state())
                cpu.set_state(saved)


def library_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Calls ``fn`` with the replica's random-stream mode lifted, if it is on top.

    The mode sees every torch function *and* tensor attribute access (``t.shape``,
    ``p.grad``); the library's own code (collectives, the optimizer step) draws no
    random numbers, so it runs without that dispatch cost."""
    if torch._C._len_torch_function_stack() == 0:
        return fn(*args, **kwargs)
    top = torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1)
    if not isinstance(top, _ReplicaRandom):
        return fn(*args, **kwargs)
    mode = torch._C._pop_torch_function_stack()
    try:
        return fn(*args, **kwargs)
    finally:
        torch._C._push_on_torch_function_stack(mode)


def drop_stale_modes() -> None:
    """Pops random-stream modes left on this (a caller's) thread by an interrupt that
    landed between entering a mode and registering its exit."""
    while torch._C._len_torch_function_stack() > 0 and isinstance(
            torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1),
            _ReplicaRandom):
        torch._C._pop_torch_function_stack()


class _ReplicaRandom(TorchFunctionMode):
    def __init__(self, streams: RandomStreams, index: int) -> None:
        super().__init__()
        self._streams = streams
        self._index = index

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if (func in WITH_GENERATOR or func in DROPOUT or func in SWAPPED) and kwargs.get(
                "generator") is None:
            if "generator" in kwargs:
                kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
            return self._streams.call(self._index, func, args, kwargs)
        return func(*args, **kwargs)
