"""A step's gradients left in ``.grad`` (no ``zero_grad()`` before the next backward,
or ``step()`` twice) count once, as on one device, and not once per replica
(`carry`): every way of clearing them between steps is still seen as clearing, and a
backward whose start the mirrored model did not see onto left gradients raises."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import mirrored
from mirrored._src.training import host_sum as host_sum_module
from mirrored._src.training import overlap as overlap_module
from mirrored.experimental import CommunicationOptions

pytestmark = pytest.mark.timeout(120)

STEPS = 6
criterion = nn.CrossEntropyLoss(reduction="none")


class Net(nn.Module):
    def __init__(self, output: str = "tensor") -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)
        self.output = output

    def forward(self, x: torch.Tensor) -> Any:
        y = self.b(torch.tanh(self.a(x)))
        if self.output == "dict":
            return {"logits": y, "hidden": x.sum()}
        return (x.sum(), y) if self.output == "tuple" else y


def logits(out: Any) -> torch.Tensor:
    return out["logits"] if isinstance(out, dict) else out[1] if isinstance(out, tuple) else out


Program = Callable[[int, Any, Any, torch.Tensor, torch.Tensor, Callable[..., Any]], None]


def never_zero(i: int, m: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, avg: Any) -> None:
    avg(criterion(logits(m(x)), y)).backward()
    opt.step()


def zero_every_third(i: int, m: Any, opt: Any, x: torch.Tensor, y: torch.Tensor,
                     avg: Any) -> None:
    with torch.no_grad():  # an evaluation forward between steps: no backward starts
        m(x)
    avg(criterion(logits(m(x)), y)).backward()
    opt.step()
    if i % 3 == 2:
        opt.zero_grad()


def zero_in_place_after_forward(i: int, m: Any, opt: Any, x: torch.Tensor,
                                y: torch.Tensor, avg: Any) -> None:
    loss = avg(criterion(logits(m(x)), y))
    opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()


def none_by_hand_after_forward(i: int, m: Any, opt: Any, x: torch.Tensor, y: torch.Tensor,
                               avg: Any) -> None:
    loss = avg(criterion(logits(m(x)), y))
    for p in m.parameters():
        p.grad = None
    loss.backward()
    opt.step()


def zero_by_hand_before_forward(i: int, m: Any, opt: Any, x: torch.Tensor,
                                y: torch.Tensor, avg: Any) -> None:
    for p in m.parameters():
        if p.grad is not None:
            p.grad.zero_()
    avg(criterion(logits(m(x)), y)).backward()
    opt.step()


def model_zero_grad_after_forward(i: int, m: Any, opt: Any, x: torch.Tensor,
                                  y: torch.Tensor, avg: Any) -> None:
    loss = avg(criterion(logits(m(x)), y))
    m.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()


def step_twice(i: int, m: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, avg: Any) -> None:
    if i % 2 == 0:
        opt.zero_grad()
        avg(criterion(logits(m(x)), y)).backward()
    opt.step()


def two_forwards(i: int, m: Any, opt: Any, x: torch.Tensor, y: torch.Tensor,
                 avg: Any) -> None:
    first, second = logits(m(x)), logits(m(x * 0.5))
    (avg(criterion(first, y)) + avg(criterion(second, y))).backward()
    opt.step()


def accumulate_then_skip(i: int, m: Any, opt: Any, x: torch.Tensor, y: torch.Tensor,
                         avg: Any) -> None:
    avg(criterion(logits(m(x)), y)).backward()  # two micro-batches onto the left ones
    avg(criterion(logits(m(-x)), y)).backward()
    opt.step()


def zero_by_hand_between_backwards(i: int, m: Any, opt: Any, x: torch.Tensor,
                                   y: torch.Tensor, avg: Any) -> None:
    out = logits(m(x))
    avg(out.pow(2).mean(1)).backward(retain_graph=True)  # a diagnostic's gradients
    for p in m.parameters():  # cleared by hand (with the last step's): only the loss steps
        p.grad.zero_()
    avg(criterion(out, y)).backward()
    opt.step()


PROGRAMS: dict[str, Program] = {f.__name__: f for f in (
    zero_by_hand_between_backwards,
    never_zero, zero_every_third, zero_in_place_after_forward, none_by_hand_after_forward,
    zero_by_hand_before_forward, model_zero_grad_after_forward, step_twice, two_forwards,
    accumulate_then_skip)}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(STEPS, 12, 4, generator=g), torch.randint(0, 3, (STEPS, 12), generator=g)


def one_device(program: Program, output: str = "tensor") -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Net(output)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    xs, ys = data()
    for i in range(STEPS):
        program(i, model, opt, xs[i], ys[i], lambda loss: loss.mean())
    return [p.detach().clone() for p in model.parameters()]


def train(strategy: mirrored.Strategy, program: Program, output: str = "tensor",
          **options: Any) -> tuple[list[torch.Tensor], Any]:
    torch.manual_seed(0)
    model = strategy.mirror(Net(output))
    opt = strategy.mirror_optimizer(
        model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), **options)
    n = strategy.num_replicas_in_sync
    xs, ys = data()

    def avg(loss: torch.Tensor) -> torch.Tensor:
        return mirrored.compute_average_loss(loss, global_batch_size=12)

    for i in range(STEPS):
        def part(t: torch.Tensor) -> Any:
            return strategy.experimental_distribute_values_from_function(
                lambda c: t.chunk(n)[c.replica_id_in_sync_group])
        strategy.run(lambda x, y: program(i, model, opt, x, y, avg),  # noqa: B023
                     args=(part(xs[i]), part(ys[i])))
    return [p.detach().clone() for p in model.parameters()], model


def assert_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for u, v in zip(a, b, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


@pytest.fixture
def two() -> Iterator[mirrored.MirroredStrategy]:
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    yield strategy
    strategy.close()


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_gradients_left_in_grad_count_once(two: mirrored.MirroredStrategy, name: str) -> None:
    program = PROGRAMS[name]
    assert_close(train(two, program)[0], one_device(program))


@pytest.mark.parametrize("output", ["tuple", "dict"])
def test_outputs_in_a_structure_are_seen(two: mirrored.MirroredStrategy, output: str) -> None:
    assert_close(train(two, never_zero, output)[0], one_device(never_zero, output))


def test_three_replicas_with_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(overlap_module, "DEFAULT_BUCKET_BYTES", 64)  # several buckets
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    try:
        got, _ = train(strategy, never_zero, overlap=True)
    finally:
        strategy.close()
    assert_close(got, one_device(never_zero))


def test_a_loop_that_zeroes_first_registers_no_hook(two: mirrored.MirroredStrategy) -> None:
    hooked: list[int] = []
    original = torch.Tensor.register_hook

    def spy(self: torch.Tensor, hook: Any) -> Any:
        hooked.append(1)
        return original(self, hook)

    def zero_first(i: int, m: Any, opt: Any, x: torch.Tensor, y: torch.Tensor,
                   avg: Any) -> None:
        opt.zero_grad()
        avg(criterion(m(x), y)).backward()
        opt.step()

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "register_hook", spy)
        train(two, zero_first)
    assert hooked == []
    # ... and forward-then-zero_grad registers one per forward, which then finds nothing
    hooked.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "register_hook", spy)
        got, _ = train(two, zero_in_place_after_forward)
    assert len(hooked) == 2 * (STEPS - 1)
    assert_close(got, one_device(zero_in_place_after_forward))


def test_an_unseen_backward_onto_left_gradients_raises(two: mirrored.MirroredStrategy
                                                      ) -> None:
    def through_submodules(i: int, m: Any, opt: Any, x: torch.Tensor, y: torch.Tensor,
                           avg: Any) -> None:
        avg(criterion(m.b(torch.tanh(m.a(x))), y)).backward()
        opt.step()

    with pytest.raises(RuntimeError, match=r"gradient of 'a\.weight' \(and 3 more\) that the "
                                           r"last step left in \.grad.*replica 0.*zero_grad"):
        train(two, through_submodules)

    def zeroed(i: int, m: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, avg: Any) -> None:
        opt.zero_grad(set_to_none=False)
        through_submodules(i, m, opt, x, y, avg)

    assert_close(train(two, zeroed)[0], one_device(zeroed))


def _worker(program_name: str, local: int) -> list[torch.Tensor]:
    overlap_module.DEFAULT_BUCKET_BYTES = 64
    strategy = mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=60),
        devices=[f"CPU:{i}" for i in range(local)])
    try:
        return train(strategy, PROGRAMS[program_name])[0]
    finally:
        strategy.close()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize(("name", "local"), [("never_zero", 1), ("step_twice", 2)])
def test_across_workers_with_buckets(name: str, local: int) -> None:
    results = mirrored.testing.run_multi_process(_worker, 2, args=(name, local), timeout=150)
    expected = one_device(PROGRAMS[name])
    for params in results:
        assert_close(params, expected)


def skip_by_hand(i: int, m: Any, opt: Any, x: torch.Tensor, y: torch.Tensor,
                 avg: Any) -> None:
    # A step skipped on purpose after backward; the gradients are dropped by hand.
    avg(criterion(logits(m(x)), y)).backward()
    if i == 2:
        m.zero_grad()
        return
    if i == 4:
        for p in m.parameters():
            p.grad = None
        return
    opt.step()


def test_kept_gradients_cleared_by_the_model_or_by_hand_are_gone(
        two: mirrored.MirroredStrategy) -> None:
    # What a backward kept aside survived model.zero_grad() and p.grad = None, and was
    # added back at the next step (the DCGAN example's netD.zero_grad()).
    assert_close(train(two, skip_by_hand)[0], one_device(skip_by_hand))


class Scaled(Net):
    """A learned temperature used in the loss outside forward (CLIP's logit_scale)."""

    def __init__(self, output: str = "tensor") -> None:
        super().__init__(output)
        self.scale = nn.Parameter(torch.tensor(1.5))


def test_a_parameter_used_outside_forward_onto_left_gradients_raises(
        two: mirrored.MirroredStrategy) -> None:
    # torch accumulates its gradient before the outputs' hook fires: it was summed once
    # per replica, silently. With zero_grad() the same loop trains as one device.
    def step(m: Any, opt: Any, x: torch.Tensor, zero: bool) -> None:
        if zero:
            opt.zero_grad()
        mirrored.compute_average_loss((m(x) * m.scale).pow(2).sum(1)).backward()
        opt.step()

    x = torch.randn(4, 4)
    for zero in (True, False):
        torch.manual_seed(0)
        model = two.mirror(Scaled())
        opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.01))
        two.run(step, args=(model, opt, x, zero))
        if zero:
            two.run(step, args=(model, opt, x, zero))
            continue
        with pytest.raises(RuntimeError, match=r"gradient of 'scale'.*outside the forward"):
            two.run(step, args=(model, opt, x, zero))


class Box(dict):
    pass


@dataclasses.dataclass
class Output:
    logits: torch.Tensor


class Wrapped(Net):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        y = super().forward(x)
        return Box(logits=y) if self.kind == "box" else Output(y)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
@pytest.mark.parametrize("kind", ["box", "dataclass"])
@pytest.mark.parametrize("create_graph", [False, True])
def test_outputs_of_any_container_class_are_seen(two: mirrored.MirroredStrategy, kind: str,
                                                  create_graph: bool) -> None:
    def run(model: Any, opt: Any, parts: list[torch.Tensor], average: Any) -> None:
        out = model(parts[0])
        y = out["logits"] if isinstance(out, dict) else out.logits
        average(criterion(y, parts[1])).backward(create_graph=create_graph)
        opt.step()

    xs, ys = data()
    torch.manual_seed(0)
    plain = Wrapped(kind)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for i in range(STEPS):
        run(plain, opt, [xs[i], ys[i]], lambda loss: loss.mean())
    torch.manual_seed(0)
    model = two.mirror(Wrapped(kind))
    mopt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    for i in range(STEPS):
        two.run(lambda x, y: run(model, mopt, [x, y], lambda loss: mirrored.compute_average_loss(
            loss, global_batch_size=12)), args=(mirrored.PerReplica(list(xs[i].chunk(2))),
                                                mirrored.PerReplica(list(ys[i].chunk(2)))))
    assert_close([p.detach() for p in model.parameters()],
                 [p.detach() for p in plain.parameters()])


def test_a_parameter_returned_by_forward_gets_no_hooks_and_grads_are_not_held(
        two: mirrored.MirroredStrategy) -> None:
    class Returns(Net):
        def forward(self, x: torch.Tensor) -> Any:
            return super().forward(x), self.b.bias  # a leaf: its own hook would stay

    torch.manual_seed(0)
    model = two.mirror(Returns())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    x = mirrored.PerReplica([torch.randn(3, 4), torch.randn(3, 4)])

    def step(x: torch.Tensor) -> None:
        out, bias = model(x)
        mirrored.compute_average_loss(out.sum(1) + 0 * bias.sum()).backward()
        opt.step()

    for _ in range(5):
        two.run(step, args=(x,))
    assert not model.replicas[0].b.bias._backward_hooks
    grads = [weakref.ref(p.grad) for copy in model.replicas for p in copy.parameters()]
    for copy in model.replicas:
        for p in copy.parameters():
            p.grad = None
    gc.collect()
    assert all(g() is None for g in grads)  # (the step's records are weak)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_left_gradients_in_half_precision_and_an_inference_forward_between(
        two: mirrored.MirroredStrategy, dtype: torch.dtype) -> None:
    # The zeros that stand in for the old gradient take its dtype; a forward under
    # torch.inference_mode (or no_grad) between steps hooks nothing and keeps them.
    def program(i: int, m: Any, opt: Any, x: torch.Tensor, y: torch.Tensor,
                avg: Any) -> None:
        with torch.inference_mode():
            m(x.to(dtype))
        avg(criterion(m(x.to(dtype)).float(), y)).backward()
        opt.step()

    def half_device() -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = Net().to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        xs, ys = data()
        for i in range(STEPS):
            program(i, model, opt, xs[i], ys[i], lambda loss: loss.mean())
        return [p.detach().float() for p in model.parameters()]

    torch.manual_seed(0)
    model = two.mirror(Net().to(dtype))
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    xs, ys = data()
    def average(loss: torch.Tensor) -> torch.Tensor:
        return mirrored.compute_average_loss(loss, global_batch_size=12)

    for i in range(STEPS):
        two.run(lambda x, y: program(i, model, opt, x, y, average),  # noqa: B023
                args=(mirrored.PerReplica(list(xs[i].chunk(2))),
                      mirrored.PerReplica(list(ys[i].chunk(2)))))
    assert all(p.grad.dtype == dtype for p in model.parameters())
    for a, b in zip((p.detach().float() for p in model.parameters()), half_device(),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=0.05, atol=0.02)


def _between_steps(change: Callable[[Any], None]) -> Program:
    """A loop without zero_grad() that changes the left gradients of ``b`` before the
    forward of its second step (the first step's gradients are the all-reduce's; later
    ones are sums with the kept gradients)."""
    def program(i: int, m: Any, opt: Any, x: torch.Tensor, y: torch.Tensor,
                avg: Any) -> None:
        if i == 1:
            change(m)
        never_zero(i, m, opt, x, y, avg)
    return program


def _zero_b_weight(m: Any) -> None:
    m.b.weight.grad.zero_()


def _none_b_weight(m: Any) -> None:
    m.b.weight.grad = None


def _new_zeros_b_weight(m: Any) -> None:
    m.b.weight.grad = torch.zeros_like(m.b.weight)


def _halve_b_weight(m: Any) -> None:
    m.b.weight.grad.mul_(0.5)


def _add_to_b_bias(m: Any) -> None:
    m.b.bias.grad = m.b.bias.grad + 1.0


@pytest.mark.parametrize("change", [_zero_b_weight, _none_b_weight, _new_zeros_b_weight])
def test_one_left_gradient_cleared_by_hand_counts_as_cleared(
        two: mirrored.MirroredStrategy, change: Callable[[Any], None]) -> None:
    program = _between_steps(change)
    assert_close(train(two, program)[0], one_device(program))


@pytest.mark.parametrize(("change", "name"), [(_halve_b_weight, "b.weight"),
                                              (_add_to_b_bias, "b.bias")])
def test_a_left_gradient_changed_by_hand_raises(two: mirrored.MirroredStrategy,
                                                change: Callable[[Any], None],
                                                name: str) -> None:
    # Half the old gradient on one device; it was taken as cleared and summed once per
    # replica (2 x 0.5 = the whole old gradient), silently.
    with pytest.raises(RuntimeError, match=rf"gradient of {name!r} that the last step left "
                                           r"in \.grad.*changed on local replica 0 when "
                                           r"backward\(\) started.*expected: untouched, or "
                                           r"cleared.*by hand \(p\.grad\.mul_\(\)"):
        train(two, _between_steps(change))


@pytest.fixture
def packed(monkeypatch: pytest.MonkeyPatch) -> Iterator[mirrored.MirroredStrategy]:
    # Three replicas whose gradients take the packed all-reduce (as across workers):
    # the step's gradients are views of one buffer, sharing one version counter.
    monkeypatch.setattr(host_sum_module, "HOST_SUM_BYTES", 0)
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    yield strategy
    strategy.close()


def test_left_gradients_that_share_a_version_counter(packed: mirrored.MirroredStrategy
                                                     ) -> None:
    def views(i: int, m: Any, opt: Any, x: torch.Tensor, y: torch.Tensor, avg: Any) -> None:
        if i == 1:  # (what this test is about)
            assert all(p.grad._base is not None for p in m.parameters())
        never_zero(i, m, opt, x, y, avg)

    train(packed, views)
    for change in (_none_b_weight, _new_zeros_b_weight):
        program = _between_steps(change)
        assert_close(train(packed, program)[0], one_device(program))
    # Zeroing one in place bumps the shared counter: the others, untouched, looked
    # cleared, and were summed once per replica, silently (0.06 off). Now it raises and
    # says how to clear one alone.
    with pytest.raises(RuntimeError, match=r"gradient of 'a\.weight' \(and 2 more\).*views of "
                                           r"one buffer.*p\.grad = None"):
        train(packed, _between_steps(_zero_b_weight))
