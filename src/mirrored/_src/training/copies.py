"""`CopiesModule`: the ``torch.nn.Module`` members of a module kept as one copy per
replica (the base class of `MirroredModule`).

Two rules cover every member. Members that *read* (``parameters``,
``named_modules``, ``state_dict``, ``training``, any attribute of the wrapped
module) see the copy the calling code sees: a replica's own copy inside
``strategy.run``, replica 0's elsewhere. Members that *change* the module
(``train``, ``apply``, ``to``/``half``, ``requires_grad_``, ``zero_grad``, hooks,
``register_buffer``, attribute assignment) act on every copy outside ``run``, and
on the replica's own copy inside it (every replica runs the same code, so every
copy changes alike).

The shell holds no parameters of its own: the copies are not registered as
submodules, so ``parameters()`` yields one model's parameters, once.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parameter import is_lazy
from torch.utils.hooks import RemovableHandle

from ..context import current_replica_context
from .copying import copy_to
from .structure import CHANGES, LAYOUT

__all__ = ["CopiesModule", "Handles"]

_AVERAGING = "torch.optim.swa_utils"  # AveragedModel (EMA, SWA) reads parameters() from here


def _refuse_averaging(replicas: int) -> None:
    if current_replica_context() is not None:
        times = f"{replicas} updates" if replicas > 1 else "N updates on N replicas"
        raise RuntimeError(
            "AveragedModel.update_parameters(model) (torch.optim.swa_utils: an EMA or SWA "
            "average) was called with the mirrored model inside strategy.run: every replica "
            f"would update the one averaged model, {times} per training step (at once, on "
            "the replicas' threads), where one device updates it once. Call it after "
            "strategy.run returns: outside run the mirrored model reads as replica 0's "
            "copy, which every copy equals after the step (refused on one replica too, so "
            "that the step runs on N)")


class Handles(RemovableHandle):
    """The handles of one hook registered on several copies; ``remove()`` removes all."""

    def __init__(self, handles: Sequence[RemovableHandle]) -> None:
        # RemovableHandle.__init__ is not called: this handle owns no hook dict.
        self.handles = tuple(handles)
        self.id = self.handles[0].id if self.handles else -1

    def remove(self) -> None:
        """Removes the hook from every copy it was registered on."""
        for handle in self.handles:
            handle.remove()


def _replaced() -> None:
    """The copies' parameters may be new objects: the next run walks their layout."""
    LAYOUT[0] += 1
    CHANGES[0] += 1


def _on_device(state_dict: Mapping[str, Any], device: torch.device, *, copy: bool
               ) -> Mapping[str, Any]:
    """``state_dict`` with its tensors on ``device`` (``copy``: always new memory), for
    ``load_state_dict(assign=True)``, which makes the given tensors the copy's own:
    assigned as they are, every copy would hold the same tensors (each replica's
    optimizer stepping them again), or a copy's on another device than its replica's.
    Tensors that share memory (a tied weight) still share it after: each storage is
    copied once and its tensors rebuilt as views of the copy."""
    storages: dict[tuple[int, torch.device], torch.UntypedStorage] = {}

    def moved(v: torch.Tensor) -> torch.Tensor:
        v = v.detach()
        if not copy and v.device == device:
            return v
        if (type(v) is not torch.Tensor or v.layout != torch.strided or v.is_conj()
                or v.is_neg()):  # (subclasses, sparse, lazy views: a copy of their own)
            return v.to(device, copy=True)
        source = v.untyped_storage()
        key = (source.data_ptr(), v.device)
        target = storages.get(key)
        if target is None:
            target = storages[key] = (
                source.clone() if v.device == device  # type: ignore[no-untyped-call]
                else source.to(device=device))
        return torch.empty(0, dtype=v.dtype, device=device).set_(
            target, v.storage_offset(), v.size(), v.stride())

    out: OrderedDict[str, Any] = OrderedDict(
        (k, moved(v) if isinstance(v, torch.Tensor) else v) for k, v in state_dict.items())
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # (torch's per-module versions, read by the loading hooks)
        out._metadata = metadata  # type: ignore[attr-defined]
    return out


class CopiesModule(nn.Module):
    """``torch.nn.Module`` members over copies of one module (see the module docstring).

    Subclasses provide `_current` (the copy the caller sees), `_targets` (the copies
    a change applies to) and ``_copies``/``_devices``.
    """

    _copies: tuple[nn.Module, ...]
    _devices: tuple[torch.device, ...]

    def _current(self) -> nn.Module:
        raise NotImplementedError

    def _exposed(self) -> nn.Module:
        """`_current`, handed to code that may change it (outside ``run``: noted)."""
        raise NotImplementedError

    def _targets(self) -> tuple[nn.Module, ...]:
        raise NotImplementedError

    def _cross_replica(self, what: str) -> None:
        raise NotImplementedError

    def _replicated(self, value: Any, targets: tuple[nn.Module, ...]) -> list[Any]:
        """``value`` for each target copy: modules and tensors copied to each copy's
        device (the first copy gets ``value`` itself), other values shared."""
        if len(targets) == 1 or not isinstance(value, nn.Module | torch.Tensor):
            return [value] * len(targets)
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            raise TypeError("cannot mirror a tensor with a grad_fn onto every copy; assign "
                            "a leaf tensor (detach() it), or assign on each copy through "
                            "model.replicas")
        devices = [self._devices[self._copies.index(t)] for t in targets]
        values = [value.to(devices[0]) if isinstance(value, nn.Module) else value]
        for device in devices[1:]:
            if isinstance(value, nn.Module):  # (with its tensors' hooks: `copy_to`)
                values.append(copy_to(value, device))
                continue
            other = copy.deepcopy(value)
            if other.device != device:
                other = (nn.Parameter(other.detach().to(device), other.requires_grad)
                         if isinstance(other, nn.Parameter) else other.to(device))
            values.append(other)
        return values

    # ----------------------------------------------------------------- reading
    @property
    def training(self) -> bool:
        """Whether the copy the caller sees is in training mode."""
        return self._current().training if "_copies" in self.__dict__ else True

    @training.setter
    def training(self, mode: bool) -> None:
        if "_copies" in self.__dict__:  # nn.Module.__init__ sets it before the copies exist
            for c in self._targets():
                c.training = mode

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """The current copy's parameters (one model's, once). Inside ``run``, read by
        ``torch.optim.swa_utils`` (``AveragedModel.update_parameters``): refused, as
        every replica would update the one averaged model."""
        if sys._getframe(1).f_globals.get("__name__") == _AVERAGING:
            _refuse_averaging(len(self._copies))
        return self._exposed().parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The current copy's named parameters (the plain module's names)."""
        return self._exposed().named_parameters(prefix, recurse, remove_duplicate)

    def buffers(self, recurse: bool = True) -> Iterator[torch.Tensor]:
        """The current copy's buffers."""
        return self._exposed().buffers(recurse)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The current copy's named buffers."""
        return self._exposed().named_buffers(prefix, recurse, remove_duplicate)

    def children(self) -> Iterator[nn.Module]:
        """The current copy's children."""
        return self._exposed().children()

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        """The current copy's named children."""
        return self._exposed().named_children()

    def modules(self, remove_duplicate: bool = True) -> Iterator[nn.Module]:
        """The current copy's modules (the copy itself first)."""
        return self._exposed().modules(remove_duplicate)

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        """The current copy's named modules (the copy itself first, named ``prefix``)."""
        named: Iterator[tuple[str, nn.Module]] = self._exposed().named_modules(
            memo, prefix, remove_duplicate)
        return named

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The current copy's state dict: the same keys as the plain module's."""
        return self._exposed().state_dict(*args, **kwargs)  # (keep_vars=True hands them out)

    # ---------------------------------------------------------------- changing
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Loads ``state_dict`` (a plain module's or a mirrored one's) into every copy.
        With ``assign=True`` replica 0's copy takes the given tensors (moved to its
        device if they are elsewhere), the others copies of them on their devices.

        Returns:
            Replica 0's ``(missing_keys, unexpected_keys)``.

        Raises:
            RuntimeError: called from a replica, or keys do not match (``strict``).
        """
        self._cross_replica("MirroredModule.load_state_dict")
        _replaced()  # (assign=True replaces the parameters)
        own = self.__dict__
        own["_mirrored_loading"] = True  # (every copy written: `structure._Loading` leaves it)
        try:
            results = [c.load_state_dict(
                _on_device(state_dict, device, copy=k > 0) if assign else state_dict, strict,
                assign) for k, (c, device) in enumerate(zip(self._targets(), self._devices,
                                                            strict=True))]
        finally:
            own["_mirrored_loading"] = False
        return results[0]

    def train(self, mode: bool = True) -> CopiesModule:
        """Sets training mode on every copy (the replica's own inside ``run``)."""
        for c in self._targets():
            c.train(mode)
        return self

    def apply(self, fn: Callable[[nn.Module], None]) -> CopiesModule:
        """Calls ``fn`` on every submodule of every copy (the replica's own inside
        ``run``). Outside ``run`` the copies then take replica 0's values, which drew
        exactly what one model's ``apply`` draws (an initializer's random numbers): the
        other copies draw from a forked generator, which the caller's never sees."""
        targets = self._targets()
        targets[0].apply(fn)
        if len(targets) > 1:
            with torch.random.fork_rng(devices=[]):
                for c in targets[1:]:
                    c.apply(fn)
            with torch.no_grad():
                first = [*targets[0].parameters(), *targets[0].buffers()]
                for c in targets[1:]:
                    for t0, t in zip(first, [*c.parameters(), *c.buffers()], strict=True):
                        if not (is_lazy(t0) or is_lazy(t)) and t is not t0:
                            t.copy_(t0)
        return self

    def requires_grad_(self, requires_grad: bool = True) -> CopiesModule:
        """Sets ``requires_grad`` of every copy's parameters (the replica's own inside ``run``)."""
        for c in self._targets():
            c.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets gradients: every copy's outside ``run``, the replica's own inside."""
        carried = list(self.__dict__.get("_carried", ()))  # (a mirrored model's: `carry`)
        for c in self._targets():
            c.zero_grad(set_to_none)
            for one in carried:
                one.forget(self._copies.index(c))

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """DDP's ``no_sync``, so a ported accumulation loop runs as it is: nothing to do.
        A mirrored optimizer all-reduces the gradients at its step only, so backward
        passes between two steps add up on each replica without communication, which
        is what ``no_sync`` asks of DDP.

        Example:
            >>> import torch, mirrored
            >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
            >>> model = strategy.mirror(torch.nn.Linear(2, 1))
            >>> with model.no_sync():
            ...     pass
        """
        return contextlib.nullcontext()

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
               ) -> CopiesModule:
        """Applies a tensor conversion (``half``, ``double``, ``type``...) to every copy;
        each copy stays on its replica's device."""
        _replaced()  # (a conversion may replace the parameters)
        for c in self._targets():
            device = self._devices[self._copies.index(c)]
            c._apply(lambda t, d=device: fn(t).to(d), recurse)  # type: ignore[no-untyped-call]
        return self

    def to(self, *args: Any, **kwargs: Any) -> CopiesModule:
        """``torch.nn.Module.to`` on every copy: dtypes and memory formats change; the
        devices are the replicas' (a device argument must name them).

        Raises:
            ValueError: a device other than the copies' own.
        """
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        _replaced()
        for c in self._targets():
            own = self._devices[self._copies.index(c)]
            if device is not None and (device.type != own.type or device.index not in (
                    None, own.index)):
                raise ValueError(
                    f"MirroredModule.to({device}): each copy lives on its replica's device "
                    f"({', '.join(map(str, self._devices))}); convert dtypes with to(dtype), "
                    "and choose devices when creating the strategy")
            c.to(own, dtype, non_blocking,  # type: ignore[call-overload]
                 memory_format=memory_format)
        return self

    def cuda(self, device: int | torch.device | None = None) -> CopiesModule:
        """Every copy stays on its replica's CUDA device (checked like `to`)."""
        return self.to(torch.device("cuda", device) if isinstance(device, int)
                       else device or "cuda")

    def cpu(self) -> CopiesModule:
        """Allowed when the copies live on the CPU (checked like `to`)."""
        return self.to("cpu")

    def _register(self, name: str, *args: Any, **kwargs: Any) -> Handles:
        return Handles([getattr(c, name)(*args, **kwargs) for c in self._targets()])

    def register_forward_pre_hook(self, *args: Any, **kwargs: Any) -> Handles:
        """Registers the hook on every copy (it receives the copy); one handle removes all."""
        return self._register("register_forward_pre_hook", *args, **kwargs)

    def register_forward_hook(self, *args: Any, **kwargs: Any) -> Handles:
        """Registers the hook on every copy (it receives the copy); one handle removes all."""
        return self._register("register_forward_hook", *args, **kwargs)

    def register_full_backward_pre_hook(self, *args: Any, **kwargs: Any) -> Handles:
        """Registers the hook on every copy; one handle removes all."""
        return self._register("register_full_backward_pre_hook", *args, **kwargs)

    def register_full_backward_hook(self, *args: Any, **kwargs: Any) -> Handles:
        """Registers the hook on every copy; one handle removes all."""
        return self._register("register_full_backward_hook", *args, **kwargs)

    def register_backward_hook(self, *args: Any, **kwargs: Any) -> Handles:
        """Registers the (deprecated) backward hook on every copy; one handle removes all."""
        return self._register("register_backward_hook", *args, **kwargs)

    def register_buffer(self, name: str, tensor: torch.Tensor | None,
                        persistent: bool = True) -> None:
        """Registers a copy of ``tensor`` on every copy, on its device."""
        targets = self._targets()
        for c, t in zip(targets, self._replicated(tensor, targets), strict=True):
            c.register_buffer(name, t, persistent)

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        """Registers a copy of ``param`` on every copy, on its device (the first copy
        gets ``param`` itself). Build optimizers after adding parameters."""
        targets = self._targets()
        for c, p in zip(targets, self._replicated(param, targets), strict=True):
            c.register_parameter(name, p)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        """Adds a copy of ``module`` to every copy, on its device."""
        targets = self._targets()
        for c, m in zip(targets, self._replicated(module, targets), strict=True):
            c.add_module(name, m)

    def register_module(self, name: str, module: nn.Module | None) -> None:
        """Alias of `add_module`."""
        self.add_module(name, module)
