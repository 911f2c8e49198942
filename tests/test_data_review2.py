"""Review of the default data path as a new user ports real input pipelines: a
``DataLoader`` (worker processes, seeded shuffle, ``drop_last``), generators, lists of
``(x, y)``, dicts and nests, partial and tiny batches, integer and bool tensors, every
way of iterating (epochs, ``iter``/``next``, ``get_next_as_optional``, a pass broken
off), with and without the prefetch thread, on 2 and 3 logical CPU replicas: each
replica's values against the split rule of docs/semantics.md, and the trained
parameters against one device. Then docs/profiling.md's recipe on a training step."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as torch_pytree
from torch.utils.data import DataLoader, TensorDataset

import mirrored

pytestmark = pytest.mark.timeout(120)

DEPTHS = [None, 0, 2]  # the default (no thread on CPU), inline, a prefetch thread


def _options(depth: int | None) -> mirrored.InputOptions:
    return mirrored.InputOptions(experimental_prefetch_depth=depth)


@pytest.fixture(scope="module", params=[2, 3], ids=["2 replicas", "3 replicas"])
def strategy(request: pytest.FixtureRequest) -> Iterable[mirrored.MirroredStrategy]:
    made = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(request.param)])
    yield made
    made.close()


def _rows(batch_size: int, n: int) -> list[tuple[int, int]]:
    """docs/semantics.md: chunks of ceil(b / N) rows, in replica order."""
    c = -(-batch_size // n)
    return [(min(i * c, batch_size), min((i + 1) * c, batch_size)) for i in range(n)]


def _assert_split(strategy: mirrored.MirroredStrategy, steps: list[Any],
                  batches: list[Any]) -> None:
    """Every step is its global batch split by the rule: same structure, dtypes, rows."""
    n = strategy.num_replicas_in_sync
    assert len(steps) == len(batches)
    for k, (step, batch) in enumerate(zip(steps, batches, strict=True)):
        got, got_spec = torch_pytree.tree_flatten(step)
        want, want_spec = torch_pytree.tree_flatten(batch)
        assert got_spec == want_spec, (k, got_spec, want_spec)
        for value, whole in zip(got, want, strict=True):
            assert isinstance(value, mirrored.PerReplica)
            bounds = _rows(len(whole), n)
            assert len(value.values) == n
            for i, (a, b) in enumerate(bounds):
                assert value.values[i].dtype == whole.dtype
                assert torch.equal(value.values[i], whole[a:b]), (k, i)


X = torch.arange(23 * 3, dtype=torch.float32).reshape(23, 3)
Y = torch.arange(23)


def _loader(num_workers: int, drop_last: bool) -> DataLoader[Any]:
    return DataLoader(TensorDataset(X, Y), batch_size=5, shuffle=True, drop_last=drop_last,
                      generator=torch.Generator().manual_seed(5), num_workers=num_workers)


SOURCES: dict[str, Callable[[], Iterable[Any]]] = {
    "generator": lambda: ((X[i:i + 5], Y[i:i + 5]) for i in range(0, 23, 5)),
    "list of (x, y)": lambda: [(X[i:i + 5], Y[i:i + 5]) for i in range(0, 23, 5)],
    "dicts, bool mask": lambda: [{"x": X[i:i + 5], "y": Y[i:i + 5], "mask": Y[i:i + 5] % 2 == 0}
                                 for i in range(0, 23, 5)],
    "nested, int8": lambda: [{"a": (X[i:i + 5], [Y[i:i + 5]]), "b": {"c": Y[i:i + 5].to(
        torch.int8)}} for i in range(0, 23, 5)],
    "varying shapes": lambda: [torch.ones(b, 2 + b) * b for b in (4, 1, 7, 2, 3, 0)],
    "one tensor repeated": lambda: itertools.repeat((X[:6], Y[:6]), 4),
}


@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("name", list(SOURCES))
def test_every_replica_sees_its_rows_of_each_global_batch(
        strategy: mirrored.MirroredStrategy, name: str, depth: int | None) -> None:
    make = SOURCES[name]
    steps = list(strategy.experimental_distribute_dataset(make(), options=_options(depth)))
    _assert_split(strategy, steps, list(make()))


@pytest.mark.parametrize("depth", [None, 2])
@pytest.mark.parametrize(("num_workers", "drop_last"), [(0, False), (0, True), (2, False)])
def test_a_seeded_shuffled_loader_is_split_batch_by_batch(
        strategy: mirrored.MirroredStrategy, num_workers: int, drop_last: bool,
        depth: int | None) -> None:
    ds = strategy.experimental_distribute_dataset(_loader(num_workers, drop_last),
                                                  options=_options(depth))
    steps = list(ds)
    assert len(steps) == len(ds) == (4 if drop_last else 5)
    _assert_split(strategy, steps, list(_loader(0, drop_last)))


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 4)).double()


def _data(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(rows, 3, generator=g, dtype=torch.float64),
            torch.randint(0, 4, (rows,), generator=g))


@pytest.mark.parametrize("depth", [None, 2])
@pytest.mark.parametrize(("rows", "batch", "drop_last"), [(23, 5, False), (22, 4, False),
                                                         (22, 4, True)])
def test_training_on_a_shuffled_loader_for_two_epochs_is_one_devices(
        strategy: mirrored.MirroredStrategy, rows: int, batch: int, drop_last: bool,
        depth: int | None) -> None:
    """The loader shuffles from torch's generator (seeded by ``manual_seed``) at each
    epoch; partial last batches (23 % 5, 22 % 4) and replicas with no rows (4 rows on 3
    replicas: 2, 2, 0) included. The reduced loss of every step is one device's mean."""
    x, y = _data(rows)

    def loader() -> DataLoader[Any]:
        return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True,
                          drop_last=drop_last)

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    torch.manual_seed(7)
    source = loader()
    want = []
    for _ in range(2):
        for xb, yb in source:
            loss = F.cross_entropy(net(xb), yb)
            want.append((loss.item(), len(yb)))
            opt.zero_grad()
            loss.backward()
            opt.step()

    model = strategy.mirror(_net())
    optimizer = strategy.mirror_optimizer(
        model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))

    def step(xb: torch.Tensor, yb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per_example = F.cross_entropy(model(xb), yb, reduction="none")
        loss = mirrored.compute_average_loss(per_example)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return per_example.detach(), loss.detach()

    torch.manual_seed(7)
    ds = strategy.experimental_distribute_dataset(loader(), options=_options(depth))
    got = []
    for _ in range(2):
        for xb, yb in ds:
            per_example, loss = strategy.run(step, args=(xb, yb))
            mean = strategy.reduce("MEAN", per_example, axis=0).item()
            assert mean == pytest.approx(strategy.reduce("SUM", loss, axis=None).item(),
                                         rel=1e-13, abs=1e-15)
            got.append((mean, sum(len(v) for v in yb.values)))
    assert [r for _, r in got] == [r for _, r in want]
    for (a, _), (b, _) in zip(got, want, strict=True):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-14)
    for name, value in net.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=1e-12)


@pytest.mark.parametrize("depth", DEPTHS)
def test_training_from_a_function_of_per_replica_loaders_is_one_devices(
        strategy: mirrored.MirroredStrategy, depth: int | None) -> None:
    """``distribute_datasets_from_function`` with a loader of the per-replica batch size
    (23 rows, global batch 12): replica 0, 1, ... take the next batch in turn, which is
    one device's batch of 12 (and of the 11 left), two epochs."""
    x, y = _data(23)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(2):
        for xb, yb in DataLoader(TensorDataset(x, y), batch_size=12):
            loss = F.cross_entropy(net(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
    model = strategy.mirror(_net())
    optimizer = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss(F.cross_entropy(model(xb), yb, reduction="none"))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    ds = strategy.distribute_datasets_from_function(
        lambda ctx: DataLoader(TensorDataset(x, y),
                               batch_size=ctx.get_per_replica_batch_size(12)),
        options=_options(depth))
    steps = 0
    for _ in range(2):
        for xb, yb in ds:
            strategy.run(step, args=(xb, yb))
            steps += 1
    assert steps == 2 * len(ds) == 4
    for name, value in net.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=1e-12)


def _flat_rows(step: mirrored.PerReplica) -> list[int]:
    return [int(r) for v in step.values for r in v.tolist()]


BATCHES = [torch.arange(4 * i, 4 * i + 4) for i in range(5)]


@pytest.mark.parametrize("depth", [None, 0, 1, 3])
def test_ways_of_iterating_neither_skip_nor_repeat_a_step(
        strategy: mirrored.MirroredStrategy, depth: int | None) -> None:
    options = _options(depth)
    want = [b.tolist() for b in BATCHES]
    # A re-iterable source: each `for` is an epoch; iter() again while the last is live.
    ds = strategy.experimental_distribute_dataset(BATCHES, options=options)
    assert [[_flat_rows(s) for s in ds] for _ in range(2)] == [want, want]
    old = iter(ds)
    next(old)
    new = iter(ds)
    assert [_flat_rows(s) for s in new] == want
    # iter() + get_next until StopIteration, which then stays; optional after the end.
    it = iter(ds)
    got = []
    while True:
        try:
            got.append(_flat_rows(it.get_next()))
        except StopIteration:
            break
    assert got == want
    with pytest.raises(StopIteration):
        next(it)
    assert not it.get_next_as_optional().has_value()
    # get_next_as_optional, then a `for` over the same iterator goes on from step 2.
    it = iter(ds)
    first = it.get_next_as_optional()
    assert first.has_value() and _flat_rows(first.get_value()) == want[0]
    assert [_flat_rows(s) for s in it] == want[1:]
    # A one-shot source: a pass broken off is continued by the next, including the
    # steps a prefetch thread read ahead; a superseded iterator refuses to go on.
    ds = strategy.experimental_distribute_dataset(iter(BATCHES), options=options)
    got = []
    for k, s in enumerate(ds):
        got.append(_flat_rows(s))
        if k == 1:
            break
    old = iter(ds)
    got.append(_flat_rows(next(old)))
    new = iter(ds)
    with pytest.raises(RuntimeError, match="superseded"):
        next(old)
    got += [_flat_rows(s) for s in new]
    assert got == want
    assert list(ds) == []  # (the source is spent, as a loop over it would find)


@pytest.mark.parametrize("depth", [None, 2])
def test_a_source_error_comes_after_the_steps_read_before_it(
        strategy: mirrored.MirroredStrategy, depth: int | None) -> None:
    def source() -> Iterable[torch.Tensor]:
        yield from BATCHES[:3]
        raise KeyError("bad record 3")

    it = iter(strategy.experimental_distribute_dataset(source(), options=_options(depth)))
    got = [_flat_rows(next(it)) for _ in range(3)]
    with pytest.raises(KeyError, match="bad record 3"):
        next(it)
    assert got == [b.tolist() for b in BATCHES[:3]]
    with pytest.raises(StopIteration):
        next(it)


def test_partial_integer_and_bool_batches_reduce_as_one_device(
        strategy: mirrored.MirroredStrategy) -> None:
    labels = torch.tensor([3, 1, 4, 1, 5])
    mask = labels > 2
    (y, m), = strategy.experimental_distribute_dataset([(labels, mask)])
    assert strategy.reduce("MEAN", y, axis=0).item() == labels.double().mean().item()
    assert strategy.reduce("SUM", y, axis=0).item() == 14
    assert strategy.reduce("SUM", y, axis=0).dtype == torch.int64
    with pytest.raises(TypeError, match="bool"):
        strategy.reduce("SUM", m, axis=0)
    as_float = strategy.run(lambda v: v.float(), args=(m,))
    assert strategy.reduce("MEAN", as_float, axis=0).item() == pytest.approx(0.6)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr"])
def test_a_sparse_batch_is_refused_naming_its_layout_and_path(
        strategy: mirrored.MirroredStrategy, layout: str) -> None:
    """Slicing rows of a sparse tensor fails inside torch (``aten::as_strided`` has no
    sparse kernel; CSR has no strides): the split names the leaf and what to do."""
    dense = torch.eye(5)
    sparse = dense.to_sparse() if layout == "sparse_coo" else dense.to_sparse_csr()
    for batch in ((sparse, torch.arange(5)), {"features": sparse}):
        with pytest.raises(TypeError, match=f"torch.{layout}.*to_dense"):
            list(strategy.experimental_distribute_dataset([batch]))
    # Whole per-replica elements are not split: they pass as they are.
    steps = list(strategy.distribute_datasets_from_function(lambda ctx: [sparse]))
    assert torch.equal(steps[0].values[0].to_dense(), dense)


@pytest.mark.timeout(60)
def test_the_profiling_recipe_on_a_training_step(two: mirrored.MirroredStrategy,
                                                 tmp_path: Path) -> None:
    """docs/profiling.md's recipe, as written, on two replicas training from a
    distributed dataset: the ranges it promises are in the Chrome trace, each on the
    thread of its replica."""
    from torch.profiler import ProfilerActivity, profile

    strategy = two
    torch.manual_seed(0)
    model = strategy.mirror(torch.nn.Linear(4, 3))
    optimizer = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    data = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(3)]
    iterator = iter(strategy.experimental_distribute_dataset(data))

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example_loss = F.cross_entropy(model(x), y, reduction="none")
        loss = mirrored.compute_average_loss(per_example_loss)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ctx = mirrored.get_replica_context()
        assert ctx is not None
        return ctx.all_reduce("SUM", loss.detach())  # (a collective with a call site)

    trace = tmp_path / "trace.json"
    # -- the recipe, verbatim (the file name aside) --
    config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
        for _ in range(3):
            strategy.run(train_step, args=next(iterator))
    prof.export_chrome_trace(str(trace))
    # --
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
    threads: dict[str, set[Any]] = {}
    for e in events:
        threads.setdefault(e["name"], set()).add(e["tid"])
    fn = train_step.__qualname__  # (the doc: "...<locals>.train_step" for a nested one)
    assert fn.endswith(".<locals>.train_step")
    replica_tid = [threads[f"mirrored.replica {i}: {fn}"] for i in range(2)]
    assert all(len(t) == 1 for t in replica_tid) and replica_tid[0] != replica_tid[1]
    assert threads[f"mirrored.run: {fn}"] == replica_tid[0]  # (the caller's)
    line = train_step.__code__.co_firstlineno + 8  # the all_reduce's line
    for title, site in (("all_reduce(SUM)", f"test_data_review2.py:{line}"),
                        ("compute_average_loss", f"test_data_review2.py:{line - 6}")):
        for i in range(2):  # every replica waited or combined at every such call
            mine = [n for n in threads if n.startswith(f"mirrored.{title} ")
                    and f"[replica {i}] at {site}" in n]
            assert mine and all(threads[n] == replica_tid[i] for n in mine), (title, i)
    # The optimizer's gradient all-reduce names the optimizer and the gradients.
    step_ranges = [n for n in threads if n.startswith(
        "mirrored.MirroredOptimizer.step (the optimizer of mirrored model #")]
    assert {r.split("[replica ")[1][0] for r in step_ranges} == {"0", "1"}
    assert all(" at the gradients of weight" in r for r in step_ranges), step_ranges
    for i in range(2):  # torch's own optimizer ranges, per replica
        assert replica_tid[i] <= threads["Optimizer.step#SGD.step"]


class _Cursor:
    """A re-iterable source over shared state: each pass rewinds one cursor (a file
    handle seeked to 0 by ``__iter__``), and a read advances it. A plain loop that breaks
    off a pass leaves its generator suspended; the next pass reads every batch."""

    def __init__(self, batches: int) -> None:
        self.batches = batches
        self.pos = 0

    def __iter__(self) -> Iterable[torch.Tensor]:
        self.pos = 0
        while self.pos < self.batches:
            time.sleep(0.02)  # a slow read, which a prefetch thread is inside of...
            i = self.pos
            self.pos += 1  # ... that advances the cursor the next pass rewound
            yield torch.full((3,), float(i))


@pytest.mark.parametrize("function", [False, True], ids=["dataset", "from_function"])
def test_a_pass_broken_off_does_not_read_into_the_next_pass(
        strategy: mirrored.MirroredStrategy, function: bool) -> None:
    """With a prefetch thread (explicit here; the default on CUDA replicas), the pass
    that a ``break`` left had its thread inside a read of the source: the next pass
    rewound the source's cursor and that read advanced it, so the new epoch silently
    skipped its first batch. A new pass waits for that read first."""
    n = strategy.num_replicas_in_sync
    source = _Cursor(2 * n)
    for k, _ in enumerate(source):
        if k == 0:
            break
    want = [float(i) for i in range(2 * n)]
    assert [float(x[0]) for x in source] == want  # one device
    options = mirrored.InputOptions(experimental_prefetch_depth=1)
    ds = (strategy.distribute_datasets_from_function(lambda ctx: source, options=options)
          if function else strategy.experimental_distribute_dataset(source, options=options))
    for _ in range(3):
        for k, _ in enumerate(ds):
            if k == 0:
                break
        got = [float(v[0]) for step in ds for v in step.values]
        assert got == (want if function else [i for i in want for _ in range(n)]), got
