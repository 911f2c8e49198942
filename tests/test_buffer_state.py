"""Buffers and plain attributes in the ways real modules hold them: buffers that are
``None`` (InstanceNorm without running statistics, a mask set later), updated
through ``.data`` or by assignment, reset outside ``run`` by a method of the module,
per-copy attributes set through ``model.replicas`` or inside a ``merge_fn``; each
against a one-device reference or the value the copy set itself."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

import mirrored
from mirrored._src.training.buffers import BufferSync, other_buffers, weighted_statistics

pytestmark = pytest.mark.timeout(60)


def halves(two: mirrored.MirroredStrategy, t: torch.Tensor) -> object:
    return two.experimental_distribute_values_from_function(
        lambda c: t.chunk(2)[c.replica_id_in_sync_group])


def step_of(model: mirrored.MirroredModule, opt: object) -> Callable[[torch.Tensor], None]:
    """The step every test here trains with (a sum of squares, averaged as one device)."""
    def step(x: torch.Tensor) -> None:
        opt.zero_grad()  # type: ignore[attr-defined]
        mirrored.compute_average_loss(model(x).pow(2).flatten(1).sum(1)).backward()
        opt.step()  # type: ignore[attr-defined]
    return step


def train(two: mirrored.MirroredStrategy, make: type[nn.Module], steps: int = 3,
          between: str = "", splits: Sequence[list[int]] = ()
          ) -> tuple[mirrored.MirroredModule, nn.Module]:
    """Trains ``make()`` mirrored on two replicas (sync BatchNorm) and on one device
    (SGD; ``steps`` batches of 8 rows in equal halves, or rows split as each of
    ``splits`` says), calling method ``between`` of both outside ``run`` after each
    step."""
    torch.manual_seed(0)
    model = two.mirror(make(), sync_batch_norm=True)
    torch.manual_seed(0)
    reference = make()
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    step = step_of(model, opt)

    g = torch.Generator().manual_seed(1)
    for rows in splits or [[4, 4]] * steps:
        x = torch.randn(sum(rows), 2, 6, generator=g, dtype=torch.float64)
        two.run(step, args=(mirrored.PerReplica(list(x.split(rows))),))
        ref_opt.zero_grad()
        reference(x).pow(2).flatten(1).sum(1).mean().backward()
        ref_opt.step()
        if between:
            getattr(model, between)()
            getattr(reference, between)()
    return model, reference


def assert_as_reference(model: mirrored.MirroredModule, reference: nn.Module) -> None:
    want = reference.state_dict()
    for copy_ in model.replicas:
        got = copy_.state_dict()
        assert got.keys() == want.keys()
        for name, t in want.items():
            torch.testing.assert_close(got[name], t, rtol=1e-12, atol=1e-12, msg=name)


class Instance(nn.Module):
    """InstanceNorm by default: its three buffers are registered as None."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 3, 3)
        self.norm = nn.InstanceNorm1d(3, affine=True)
        self.double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))  # type: ignore[no-any-return]


def test_instance_norm_without_running_statistics_trains_as_one_device(two) -> None:
    # With no other buffer, every step raised IndexError: the buffer rule found only
    # None buffers and indexed the first.
    model, reference = train(two, Instance)
    assert_as_reference(model, reference)


class LaterMask(nn.Module):
    """A buffer registered as None and set from the second forward on, beside an EMA."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 1, 3).double()
        self.register_buffer("mask", None)
        self.register_buffer("ema", torch.zeros(6, dtype=torch.float64))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            self.mask = torch.full((4,), 0.5, dtype=torch.float64)
        with torch.no_grad():
            self.ema.mul_(0.5).add_(x.mean((0, 1)), alpha=0.5)
        out = self.conv(x)
        return out * self.mask if self.mask is not None else out


def test_a_buffer_set_after_the_first_step_keeps_the_rule_aligned(two) -> None:
    # The rule kept one entry per buffer at the start, one per non-None buffer after a
    # step: the buffer set later put them out of line, and the step raised.
    model, reference = train(two, LaterMask, steps=4)
    assert_as_reference(model, reference)


class DataEma(nn.Module):
    """An EMA buffer updated as EMA codebooks do: through ``.data`` (torch's version
    counter does not move), in place, or by assignment."""

    style = "data"

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 1, 3).double()
        self.register_buffer("ema", torch.zeros(6, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = x.mean((0, 1)).detach()
        if self.style == "data":
            self.ema.data.mul_(0.5).add_(update, alpha=0.5)
        elif self.style == "in place":
            with torch.no_grad():
                self.ema.mul_(0.5).add_(update, alpha=0.5)
        else:
            self.ema = 0.5 * self.ema + 0.5 * update
        return self.conv(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("style", ["data", "in place", "assigned"])
def test_an_ema_updated_through_data_is_averaged_as_one_device(two, style: str,
                                                               monkeypatch) -> None:
    # Through .data the version counter stayed, the buffer read as unchanged and was
    # never averaged: each copy kept its own half's EMA, silently.
    monkeypatch.setattr(DataEma, "style", style)
    model, reference = train(two, DataEma)
    assert_as_reference(model, reference)
    assert torch.equal(model.replicas[0].ema, model.replicas[1].ema)


class Resettable(nn.Module):
    """An EMA buffer, a BatchNorm and a counter, all reset by `reset_state`."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 3)
        self.bn = nn.BatchNorm1d(2)
        self.register_buffer("ema", torch.zeros(6))
        self.seen = 0
        self.double()

    def reset_state(self) -> None:
        self.ema.zero_()
        self.bn.reset_running_stats()
        self.seen = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        with torch.no_grad():
            self.ema.mul_(0.5).add_(x.mean((0, 1)), alpha=0.5)
        return self.bn(self.conv(x))  # type: ignore[no-any-return]


def test_buffers_a_method_resets_outside_run_are_reset_on_every_copy(two) -> None:
    # The method runs on replica 0's copy alone; its zeros were averaged with the
    # other copies' old values at the next step (an EMA and BatchNorm statistics at
    # half their reset), silently.
    model, reference = train(two, Resettable, between="reset_state")
    two.run(lambda: None)  # (the last reset reaches the copies here)
    assert_as_reference(model, reference)
    assert [c.seen for c in model.replicas] == [0, 0]


class Sharded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 1)
        self.shard: int | None = None
        self.rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows += x.shape[0]
        return self.linear(x)  # type: ignore[no-any-return]


def test_a_value_set_per_copy_through_replicas_is_kept(two) -> None:
    # A record of replica 0's attributes taken before (any use of the model outside
    # run) made the next run give every copy replica 0's value.
    model = two.mirror(Sharded())
    assert sum(p.numel() for p in model.parameters()) == 3  # (replica 0's copy: a record)
    for k, copy_ in enumerate(model.replicas):
        copy_.shard = k
    got = two.run(lambda: model.shard)
    assert two.experimental_local_results(got) == (0, 1)
    assert [c.shard for c in model.replicas] == [0, 1]


def test_a_merge_fn_reading_the_model_takes_no_record_mid_run(two) -> None:
    # The merge_fn sees replica 0's copy, as code outside run does; the record it took
    # made the next run copy replica 0's count (set after the merge) to the others.
    model = two.mirror(Sharded())

    def step(x: torch.Tensor) -> None:
        mirrored.get_replica_context().merge_call(
            lambda strategy: sum(p.numel() for p in model.parameters()))
        model(x)

    x = torch.randn(5, 2)
    two.run(step, args=(mirrored.PerReplica([x[:3], x[3:]]),))
    two.run(lambda: None)
    assert [c.rows for c in model.replicas] == [3, 2]
    model.shard = 7  # (assigned on the mirrored model: every copy)
    model.replicas[1].rows = 9  # (this copy's own, set after a record is taken)
    two.run(lambda: None)
    assert [(c.shard, c.rows) for c in model.replicas] == [(7, 3), (7, 9)]


def test_flags_and_weights_count_in_float32_whatever_the_buffers_dtype() -> None:
    # They took the first float buffer's dtype: in bfloat16 a sum of ones stops at 256,
    # so on 260 replicas the average divided by 256.
    module = nn.Module()
    module.register_buffer("tag", torch.zeros(1, dtype=torch.bfloat16))
    module.register_buffer("ema", torch.zeros(2))
    flags = BufferSync("average", other_buffers(module), 260).send(0)[-1]
    assert flags.dtype == torch.float32
    weight = weighted_statistics([torch.zeros(2, dtype=torch.bfloat16)], 1)[-1]
    assert weight.dtype == torch.float32
    assert float(sum(weight for _ in range(260))) == 260.0


class NanTable(nn.Module):
    """A constant lookup table in which NaN marks "no value"."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 1, 3)
        table = torch.randn(600)
        table[::7] = float("nan")
        self.register_buffer("table", table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.float()) * self.table[:4].nan_to_num()  # type: ignore[no-any-return]


def test_a_constant_buffer_holding_nan_stays_bitwise_constant() -> None:
    # Compared as floats, NaN != NaN read as a change at every step: the buffer was
    # averaged, and (x + x + x) / 3 moved 139 of its other values by an ulp in 20 steps.
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    try:
        torch.manual_seed(0)
        model = strategy.mirror(NanTable())
        initial = model.replicas[0].table.clone()
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

        step = step_of(model, opt)

        x = torch.randn(6, 2, 6)
        parts = strategy.experimental_distribute_values_from_function(
            lambda c: x.chunk(3)[c.replica_id_in_sync_group])
        for _ in range(10):
            strategy.run(step, args=(parts,))
        for copy_ in model.replicas:
            assert torch.equal(copy_.table.view(torch.int32), initial.view(torch.int32))
    finally:
        strategy.close()


@pytest.mark.parametrize("change", ["load_state_dict", "apply", "setattr"])
def test_a_reset_after_a_change_of_every_copy_reaches_every_copy(two, change: str) -> None:
    # A record taken before (the parameters counted) saw every copy's buffer and
    # attribute move with the whole-model change, took them for each copy's own, and
    # left the reset on replica 0's copy: its zeros averaged with the others' old EMA.
    torch.manual_seed(0)
    model = two.mirror(Resettable(), sync_batch_norm=True)
    torch.manual_seed(0)
    reference = Resettable()
    sd = {k: v + 1 if v.is_floating_point() else v for k, v in reference.state_dict().items()}
    for m in (model, reference):
        for _ in range(2):
            m(torch.randn(4, 2, 6, dtype=torch.float64))  # (some state to roll back)
    assert sum(p.numel() for p in model.parameters()) > 0  # (replica 0's copy: a record)
    for m in (model, reference):
        if change == "load_state_dict":
            m.load_state_dict(sd)
        elif change == "apply":
            m.apply(lambda mod: mod.ema.fill_(3.0) if isinstance(mod, Resettable) else None)
        else:
            m.seen = 5
        m.reset_state()
    two.run(lambda: None)
    for copy_ in model.replicas:
        torch.testing.assert_close(copy_.ema, reference.ema, rtol=0, atol=0)
        torch.testing.assert_close(copy_.bn.running_mean, reference.bn.running_mean,
                                   rtol=0, atol=0)
        assert copy_.seen == reference.seen == 0


def watch_buffer_traffic(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """The sizes of the buffers' leaves sent in the steps' all-reduces, and per step and
    replica the number of leaves of a second all-reduce (0: none)."""
    sizes: list[int] = []
    calls: list[int] = []
    send, late = BufferSync.send, BufferSync.late

    def sending(self: BufferSync, *args: object) -> list[torch.Tensor]:
        out = send(self, *args)  # type: ignore[arg-type]
        sizes.extend(t.numel() for t in out[:-1])
        return out

    def later(self: BufferSync) -> list[torch.Tensor]:
        out = late(self)
        sizes.extend(t.numel() for t in out)
        calls.append(len(out))
        return out

    monkeypatch.setattr(BufferSync, "send", sending)
    monkeypatch.setattr(BufferSync, "late", later)
    return sizes, calls


class Large(nn.Module):
    """A large EMA (over `LATE_BYTES`: sent after the flags) updated through ``.data``,
    beside a large constant mask and a small counter."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 1, 3).double()
        self.register_buffer("ema", torch.zeros(12000, 6, dtype=torch.float64))
        self.register_buffer("mask", torch.ones(300, 300))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0]:
            self.ema.data.mul_(0.5).add_(x.mean((0, 1)), alpha=0.5)
        self.calls += 1
        return self.conv(x) * self.mask[0, :4]  # type: ignore[no-any-return]


def test_large_buffers_travel_only_when_changed_and_average_as_one_device(
        two, monkeypatch) -> None:
    # Every buffer travelled in the step's all-reduce: 15 MiB of constant masks and
    # rotary tables made a 1.3 ms step 17 ms. Large ones now send a flag, and their
    # values at a step that changed them, with the same average (empty shards left out).
    from mirrored._src.training import buffers

    assert min(Large().ema.nbytes, Large().mask.nbytes) > buffers.LATE_BYTES
    sizes, calls = watch_buffer_traffic(monkeypatch)
    model, reference = train(two, Large, splits=[[4, 4], [3, 0], [0, 2], [4, 4]] * 3)
    for copy_ in model.replicas:
        torch.testing.assert_close(copy_.ema, reference.ema, rtol=1e-12, atol=1e-12)
        assert int(copy_.calls) == 12  # (taken from replica 0: its own count of calls)
        for a, b in zip(copy_.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert sizes.count(12000 * 6) == 2 * 12  # (each replica, each step: it changed)
    # (sent with the flags until no replica changed it for QUIET_STEPS steps, never after)
    assert sizes.count(300 * 300) == 2 * buffers.QUIET_STEPS
    assert calls == [0] * 2 * 12  # (no second all-reduce: nothing deferred changed)


class Alike(nn.Module):
    """Buffers every replica updates alike (not from the data): one over `LATE_BYTES`
    changed every third step, one small changed every step."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 1, 3).double()
        g = torch.Generator().manual_seed(5)
        self.register_buffer("large", torch.rand(20000, generator=g))
        self.register_buffer("small", torch.rand(100, generator=g, dtype=torch.bfloat16))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls % 3 == 0:
            self.large.data.mul_(0.9).add_(0.1)
        self.small.data.mul_(0.9).add_(0.1)
        return self.conv(x)  # type: ignore[no-any-return]


def test_buffers_every_replica_updates_alike_stay_one_devices_on_three(monkeypatch) -> None:
    # Averaged in float32, (y + y + y) / 3 is not always y: 10770 of 20000 elements
    # moved off one device's in 10 steps. Averaged in float64 now. A buffer changed
    # every few steps keeps riding with the flags (no second all-reduce per change).
    _, calls = watch_buffer_traffic(monkeypatch)
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    try:
        model = strategy.mirror(Alike())
        reference = Alike()
        opt = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

        step = step_of(model, opt)

        x = torch.randn(6, 2, 6, dtype=torch.float64)
        parts = strategy.experimental_distribute_values_from_function(
            lambda c: x.chunk(3)[c.replica_id_in_sync_group])
        for _ in range(30):
            strategy.run(step, args=(parts,))
            reference(x)
        for copy_ in model.replicas:
            assert torch.equal(copy_.large, reference.large)
            assert torch.equal(copy_.small, reference.small)
    finally:
        strategy.close()
    assert calls == [0] * 3 * 30  # (no second all-reduce)


class Quiet(nn.Module):
    """A large table left alone for 10 steps, then changed by one replica."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 1, 3).double()
        self.register_buffer("table", torch.ones(30000))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 11 and mirrored.get_replica_context().replica_id_in_sync_group == 0:
            self.table.data[:10] = 4.0
        return self.conv(x)  # type: ignore[no-any-return]


def test_a_quiet_large_buffer_changed_again_follows_in_a_second_all_reduce(
        two, monkeypatch) -> None:
    from mirrored._src.training import buffers

    sizes, calls = watch_buffer_traffic(monkeypatch)
    model = two.mirror(Quiet())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

    step = step_of(model, opt)

    x = halves(two, torch.randn(4, 2, 6, dtype=torch.float64))
    for _ in range(12):
        two.run(step, args=(x,))
    assert buffers.QUIET_STEPS < 10
    assert calls == [0] * 2 * 10 + [1] * 2 + [0] * 2  # (step 11: the second all-reduce)
    # (with the flags for QUIET_STEPS steps, then at step 11 after them; changed, it
    # rides with the flags again at step 12)
    assert sizes.count(30000) == 2 * (buffers.QUIET_STEPS + 2)
    want = torch.ones(30000)
    want[:10] = 2.5  # (4 + 1) / 2
    for copy_ in model.replicas:
        assert torch.equal(copy_.table, want)


class SomeCache(nn.Module):
    """A buffer registered as None and set in forward on some replicas only."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 1, 3).double()
        self.register_buffer("cache", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.max() > 2.0:
            self.cache = x.amax(0).detach()
        return self.conv(x)  # type: ignore[no-any-return]


def test_a_buffer_set_on_some_replicas_only_is_a_clear_mismatch(two) -> None:
    # The mismatch message indexed replica 0's leaves with the other's count: a bare
    # IndexError from inside the library.
    model = two.mirror(SomeCache())
    opt = two.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

    step = step_of(model, opt)

    x = torch.zeros(4, 2, 6, dtype=torch.float64)
    x[0, 0, 0] = 5.0  # (in replica 0's half only)
    with pytest.raises(mirrored.CollectiveMismatchError,
                       match=r"different numbers of tensors \(replica 0 \(CPU:0\): \d+, "
                             r"replica 1 \(CPU:1\): \d+; .*buffer that is None on some"):
        two.run(step, args=(halves(two, x),))
