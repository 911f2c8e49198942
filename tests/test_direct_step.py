"""The per-replica optimizers are stepped and zeroed without torch's per-call wrapper
(`training/direct.py`) only where nothing observes it: the updates bitwise those of
one device, torch's ranges under a profiler, and every hook, instance patch and
subclass override still honoured."""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.optim.optimizer as torch_optimizer
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

import mirrored
from mirrored._src.training import direct

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=[1, 2])
def strategy(request: pytest.FixtureRequest) -> Iterator[mirrored.MirroredStrategy]:
    s = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(request.param)])
    yield s
    s.close()


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(6, 3, generator=g).double(), torch.randn(6, generator=g).double())
            for _ in range(3)]


def one_device(make: Callable[[Any], torch.optim.Optimizer]) -> list[torch.Tensor]:
    model = net()
    opt = make(model.parameters())
    for x, y in batches():
        ((model(x).squeeze(1) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def train(strategy: mirrored.MirroredStrategy, make: Callable[[Any], torch.optim.Optimizer],
          set_to_none: bool = True) -> tuple[mirrored.MirroredModule, mirrored.MirroredOptimizer]:
    model = strategy.mirror(net())
    opt = strategy.mirror_optimizer(model, make)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2).backward()
        opt.step()
        opt.zero_grad(set_to_none)

    for x, y in batches():
        strategy.run(step, args=(x, y))
    return model, opt


def assert_trained_as_one_device(model: mirrored.MirroredModule,
                                 make: Callable[[Any], torch.optim.Optimizer]) -> None:
    for copy in model.replicas:
        for p, q in zip(copy.parameters(), one_device(make), strict=True):
            torch.testing.assert_close(p.detach(), q, rtol=1e-12, atol=1e-12)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


@pytest.mark.parametrize("make", [sgd, adam])
def test_no_torch_range_is_entered_without_a_profiler_and_training_is_one_devices(
        strategy: mirrored.MirroredStrategy, make: Callable[[Any], torch.optim.Optimizer],
        monkeypatch: pytest.MonkeyPatch) -> None:
    entered: list[str] = []
    original = torch.autograd.profiler.record_function.__enter__

    def spy(self: torch.autograd.profiler.record_function) -> object:
        entered.append(self.name)
        return original(self)

    monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__", spy)
    model, _ = train(strategy, make)
    assert [n for n in entered if n.startswith("Optimizer.")] == []
    assert_trained_as_one_device(model, make)


def test_a_trace_shows_each_replicas_optimizer_step_and_zero_grad(tmp_path: Path) -> None:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    try:
        config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # pragma: no cover - older torch
        pytest.skip("this torch's profiler records the profiling thread only")
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        model, _ = train(strategy, sgd)
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    names = [e["name"] for e in json.loads(trace.read_text())["traceEvents"]
             if e.get("ph") == "X"]
    # 3 steps on each of 2 replicas, as 2 plain optimizers would record them
    assert names.count("Optimizer.step#SGD.step") == 6
    assert names.count("Optimizer.zero_grad#SGD.zero_grad") == 6
    assert_trained_as_one_device(model, sgd)
    strategy.close()


def test_hooks_on_a_replicas_optimizer_and_global_ones_still_run(
        strategy: mirrored.MirroredStrategy) -> None:
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()

    def note(kind: str) -> Callable[..., None]:
        def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            with lock:
                seen.append((kind, id(optimizer)))
        return hook

    model = strategy.mirror(net())
    opt = strategy.mirror_optimizer(model, sgd)
    inner = opt.optimizers[-1]
    inner.register_step_pre_hook(note("pre"))
    inner.register_step_post_hook(note("post"))
    handle = torch_optimizer.register_optimizer_step_post_hook(note("global"))
    try:
        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2).backward()
            opt.step()
            opt.zero_grad()

        for x, y in batches():
            strategy.run(step, args=(x, y))
    finally:
        handle.remove()
    assert seen.count(("pre", id(inner))) == 3
    assert seen.count(("post", id(inner))) == 3
    # the global hook runs for the mirrored optimizer and, through torch's wrapper, for
    # every replica's optimizer, as before
    assert seen.count(("global", id(opt))) == 3 * strategy.num_replicas_in_sync
    assert all(seen.count(("global", id(o))) == 3 for o in opt.optimizers)
    assert_trained_as_one_device(model, sgd)


def test_a_scheduler_built_on_a_replicas_optimizer_sees_its_steps(
        strategy: mirrored.MirroredStrategy) -> None:
    model = strategy.mirror(net())
    opt = strategy.mirror_optimizer(model, sgd)
    inner = opt.optimizers[0]
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=1.0)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2).backward()
        opt.step()
        opt.zero_grad()

    x, y = batches()[0]
    strategy.run(step, args=(x, y))
    # the scheduler's patch of the instance's step ran (else torch warns at its step)
    assert getattr(inner, "_opt_called", False)
    scheduler.step()


class CountingSGD(torch.optim.SGD):
    zeroed = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        type(self).zeroed += 1
        super().zero_grad(set_to_none)


def test_a_subclasss_zero_grad_and_set_to_zero_go_through_torch(
        strategy: mirrored.MirroredStrategy) -> None:
    CountingSGD.zeroed = 0
    model, _ = train(strategy, lambda p: CountingSGD(p, lr=0.1))
    assert CountingSGD.zeroed == 3 * strategy.num_replicas_in_sync
    model, _ = train(strategy, sgd, set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for copy in model.replicas
               for p in copy.parameters())
    assert_trained_as_one_device(model, sgd)


def test_another_librarys_wrapper_around_torchs_is_not_skipped(
        strategy: mirrored.MirroredStrategy, monkeypatch: pytest.MonkeyPatch) -> None:
    class WrappedSGD(torch.optim.SGD):
        pass

    WrappedSGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # torch's wrapper on the class
    calls = [0]
    torchs = WrappedSGD.step

    @functools.wraps(torchs)  # (copies torch's `hooked` mark and `__wrapped__`)
    def outer(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return torchs(*args, **kwargs)

    monkeypatch.setattr(WrappedSGD, "step", outer)
    model, _ = train(strategy, lambda p: WrappedSGD(p, lr=0.1, momentum=0.9))
    assert calls[0] == 3 * strategy.num_replicas_in_sync
    assert_trained_as_one_device(model, sgd)
    assert direct._raw_step(torch.optim.SGD) is not None  # torch's own: unwrapped


def test_a_class_step_wrapped_after_the_first_step_is_not_skipped(
        strategy: mirrored.MirroredStrategy, monkeypatch: pytest.MonkeyPatch) -> None:
    class LaterSGD(torch.optim.SGD):
        pass

    model = strategy.mirror(net())
    opt = strategy.mirror_optimizer(model, lambda p: LaterSGD(p, lr=0.1, momentum=0.9))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2).backward()
        opt.step()
        opt.zero_grad()

    first, *rest = batches()
    strategy.run(step, args=first)  # (the class's unwrapped step found and kept)
    calls = [0]
    torchs = LaterSGD.step

    @functools.wraps(torchs)
    def outer(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return torchs(*args, **kwargs)

    monkeypatch.setattr(LaterSGD, "step", outer)
    for x, y in rest:
        strategy.run(step, args=(x, y))
    assert calls[0] == 2 * strategy.num_replicas_in_sync
    assert_trained_as_one_device(model, sgd)


def test_torchs_zero_grad_patched_by_another_library_is_not_skipped(
        strategy: mirrored.MirroredStrategy, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = [0]
    torchs = torch.optim.Optimizer.zero_grad

    def patched(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        calls[0] += 1
        torchs(self, set_to_none)

    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", patched)
    model, _ = train(strategy, sgd)
    assert calls[0] == 3 * strategy.num_replicas_in_sync
    assert_trained_as_one_device(model, sgd)


def test_a_step_tracer_or_a_mode_in_the_step_sees_torchs_wrapper(
        strategy: mirrored.MirroredStrategy, monkeypatch: pytest.MonkeyPatch) -> None:
    traced: list[str] = []
    torchs = torch.optim.Optimizer._optimizer_step_code

    def trace(self: torch.optim.Optimizer) -> None:  # torch's entry point for step tracing
        traced.append(type(self).__name__)
        torchs(self)

    monkeypatch.setattr(torch.optim.Optimizer, "_optimizer_step_code", trace)
    model, _ = train(strategy, sgd)
    assert traced == ["SGD"] * (3 * strategy.num_replicas_in_sync)
    monkeypatch.undo()

    class Ops(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_function__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            self.names.append(str(getattr(func, "__name__", func)))
            return func(*args, **(kwargs or {}))

    model = strategy.mirror(net())
    opt = strategy.mirror_optimizer(model, sgd)
    modes: list[Ops] = []

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2).backward()
        with Ops() as mode:  # a mode entered inside the step function sees every op
            opt.step()
            opt.zero_grad()
        modes.append(mode)

    x, y = batches()[0]
    strategy.run(step, args=(x, y))
    for mode in modes:  # as with a plain optimizer: torch's ranges' ops among them
        assert sum(n.startswith("_record_function_enter") for n in mode.names) == 2


def test_only_torchs_own_functions_count_as_torchs() -> None:
    def patched(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        """A library's zero_grad, patched on torch's class before mirrored's import."""

    wrapped = functools.wraps(torch.optim.Optimizer.zero_grad)(patched)
    assert direct._torchs(torch.optim.Optimizer.zero_grad, "zero_grad") is not None
    assert direct._torchs(patched, "zero_grad") is None
    assert direct._torchs(wrapped, "zero_grad") is None  # (its own code outside torch)
    assert direct._torchs(torch.optim.Optimizer.step, "zero_grad") is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_steps_under_no_grad_and_zero_grad_outside_run_are_one_devices(
        strategy: mirrored.MirroredStrategy, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    reference = nn.Linear(3, 1).to(dtype)
    model = strategy.mirror(nn.Linear(3, 1).to(dtype))
    model.load_state_dict(reference.state_dict())
    opt = strategy.mirror_optimizer(model, sgd)
    plain = sgd(reference.parameters())
    x, y = (t.to(dtype) for t in batches()[0])

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        mirrored.compute_average_loss((model(x).squeeze(1) - y) ** 2).backward()
        with torch.no_grad():  # (the raw step sets its own grad mode, as torch's wrapper)
            opt.step()

    strategy.run(step, args=(x, y))
    opt.zero_grad()  # outside run: every replica's gradients
    assert all(p.grad is None for copy in model.replicas for p in copy.parameters())
    ((reference(x).squeeze(1) - y) ** 2).mean().backward()
    plain.step()
    for copy in model.replicas:
        for p, q in zip(copy.parameters(), reference.parameters(), strict=True):
            assert p.dtype == dtype
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-2, atol=1e-2)
