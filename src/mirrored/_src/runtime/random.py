"""Per-replica random streams for logical CPU replicas.

Logical CPU replicas share torch's one CPU generator, so concurrent replicas would
draw from it in thread order and a seeded step would not repeat. Instead, inside
``run`` each CPU replica draws from a stream of its own: the first random call of
a run draws one 64-bit base seed from the caller's generator (so
``torch.manual_seed(s)`` before ``run`` fixes every stream, and successive runs
differ), replica ``r``'s stream is seeded with ``mix(base, r)``, and every random
torch function called by the replica swaps its stream into the CPU generator for
the duration of the call, under a lock. A call with an explicit ``generator=`` is
left alone. CUDA replicas have a generator per device and need none of this.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["RandomStreams", "library_call"]

_T = torch.Tensor
RANDOM_FUNCTIONS: frozenset[Callable[..., Any]] = frozenset({
    torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like,
    torch.randint_like, torch.randperm, torch.bernoulli, torch.normal, torch.poisson,
    torch.multinomial, torch.dropout, torch.alpha_dropout, torch.feature_dropout,
    torch.feature_alpha_dropout, torch.rrelu, F.dropout, F.dropout1d, F.dropout2d,
    F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, F.rrelu, F.gumbel_softmax,
    _T.bernoulli, _T.bernoulli_, _T.normal_, _T.uniform_, _T.random_, _T.exponential_,
    _T.geometric_, _T.cauchy_, _T.log_normal_, _T.multinomial,
})
_MASK = (1 << 63) - 1
_lock = threading.Lock()  # process-wide: every swap of the CPU generator's state


class RandomStreams:
    """The random streams of one strategy's local replicas.

    Args:
        replica_ids: the global ids of the local replicas (their streams differ).
    """

    def __init__(self, replica_ids: Sequence[int]) -> None:
        self._ids = tuple(replica_ids)
        self._base: int | None = None
        self._states: list[torch.Tensor | None] = [None] * len(self._ids)
        self._modes = [_ReplicaRandom(self, i) for i in range(len(self._ids))]

    def start_run(self) -> None:
        """A new run: streams are drawn afresh at the first random call."""
        self._base = None
        self._states = [None] * len(self._ids)

    def mode(self, index: int) -> TorchFunctionMode:
        """The mode to enter on replica ``index``'s thread for its function."""
        return self._modes[index]

    def call(self, index: int, func: Callable[..., Any], args: Sequence[Any],
             kwargs: dict[str, Any]) -> Any:
        generator = torch.default_generator
        with _lock:
            state = self._states[index]
            if state is None:
                if self._base is None:
                    self._base = int(torch.randint(0, 1 << 62, (1,)).item())
                seeded = torch.Generator()
                seeded.manual_seed((self._base * 0x9E3779B97F4A7C15 + self._ids[index]) & _MASK)
                state = seeded.get_state()
            saved = generator.get_state()
            generator.set_state(state)
            try:
                return func(*args, **kwargs)
            finally:
                self._states[index] = generator.get_state()
                generator.set_state(saved)


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


class _ReplicaRandom(TorchFunctionMode):
    def __init__(self, streams: RandomStreams, index: int) -> None:
        super().__init__()
        self._streams = streams
        self._index = index

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in RANDOM_FUNCTIONS and kwargs.get("generator") is None:
            return self._streams.call(self._index, func, args, kwargs)
        return func(*args, **kwargs)
