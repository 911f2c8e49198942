"""Distributed datasets, `InputContext` and `InputOptions` (`mirrored._src.data`)."""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

import mirrored
from mirrored._src.data import (
    DistributedDataset,
    DistributedDatasetsFromFunction,
    InputContext,
    InputOptions,
    split_batch,
)
from mirrored._src.data import iterator as iterator_module
from mirrored._src.data.input import InputReplicationMode
from mirrored._src.data.prefetch import THREAD_NAME
from mirrored._src.data.vote import WorkerVote
from mirrored._src.devices import parse_devices
from mirrored._src.topology import Topology

DEPTHS = [0, 1, 2]


def topology(n: int = 2, worker_index: int = 0, num_workers: int = 1) -> Topology:
    return Topology(devices=parse_devices([f"CPU:{i}" for i in range(n)]),
                    worker_index=worker_index, num_workers=num_workers)


def options(depth: int) -> InputOptions:
    return InputOptions(experimental_prefetch_depth=depth)


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


def wait_no_prefetch_threads() -> None:
    for thread in prefetch_threads():
        thread.join(timeout=10)
    assert prefetch_threads() == []


def as_lists(step: Any) -> list[list[Any]]:
    return [v.tolist() for v in step.values]


def reference(batch: torch.Tensor, n: int) -> list[list[Any]]:
    return [c.tolist() for c in split_batch(batch, n)]


# --- sources ---------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("depth", DEPTHS)
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_list_source_matches_split_rule_and_reiterates(depth: int, n: int) -> None:
    topo = topology(n)
    batches = [torch.arange(s, min(s + 6, 15)) for s in range(0, 15, 6)]  # 6, 6, 3 rows
    ds = DistributedDataset(batches, topo, options(depth))
    assert len(ds) == 3
    for _ in range(2):  # a list is re-iterable
        steps = list(ds)
        assert len(steps) == 3
        for step, batch in zip(steps, batches, strict=True):
            if n == 1:  # one replica in one process: plain batches, as TF
                assert isinstance(step, torch.Tensor) and torch.equal(step, batch)
                continue
            assert isinstance(step, mirrored.PerReplica)
            assert step.devices == topo.device_names
            assert as_lists(step) == reference(batch, n)
    wait_no_prefetch_threads()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("depth", DEPTHS)
def test_dataloader_source_with_partial_last_batch(depth: int) -> None:
    x = torch.arange(13 * 2, dtype=torch.float32).reshape(13, 2)
    y = torch.arange(13)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)
    ds = DistributedDataset(loader, topology(3), options(depth))
    assert len(ds) == len(loader) == 4
    seen_x, seen_y = [], []
    for step, (bx, by) in zip(ds, loader, strict=True):
        sx, sy = step  # a list nest of PerReplica, like the loader's batch
        assert [v.shape[0] for v in sy.values] == [len(c) for c in reference(by, 3)]
        assert as_lists(sx) == reference(bx, 3)
        for vx, vy in zip(sx.values, sy.values, strict=True):
            seen_x.append(vx)
            seen_y.append(vy)
    assert torch.equal(torch.cat(seen_x), x) and torch.equal(torch.cat(seen_y), y)
    assert [v.shape for v in step[0].values] == [(1, 2), (0, 2), (0, 2)]  # last batch: 1 row


@pytest.mark.timeout(30)
@pytest.mark.parametrize("depth", DEPTHS)
def test_dict_batches_and_numpy_leaves(depth: int) -> None:
    def gen() -> Iterator[dict[str, Any]]:
        for s in (0, 5):
            yield {"image": np.arange(s, s + 5, dtype=np.float32)[:, None] * [1.0, -1.0],
                   "label": torch.arange(s, s + 5)}

    ds = DistributedDataset(gen(), topology(2), options(depth))
    with pytest.raises(TypeError, match=r"source \(generator\) has no len\(\)"):
        len(ds)
    steps = list(ds)
    assert len(steps) == 2
    for step, s in zip(steps, (0, 5), strict=True):
        assert set(step) == {"image", "label"}
        assert as_lists(step["label"]) == [list(range(s, s + 3)), list(range(s + 3, s + 5))]
        np.testing.assert_array_equal(step["image"].values[1].numpy(),
                                      np.arange(s + 3, s + 5)[:, None] * [1.0, -1.0])
        assert step["image"].values[0].dtype == torch.float64
    assert list(ds) == []  # a generator is one pass: its dataset is too


@pytest.mark.timeout(30)
def test_fetch_to_device_false_keeps_source_tensors() -> None:
    batch = torch.arange(8.0)
    ds = DistributedDataset([batch], topology(2), InputOptions(experimental_fetch_to_device=False))
    (step,) = list(ds)
    assert step.values[1].data_ptr() == batch.data_ptr() + 4 * batch.element_size()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(30)
@pytest.mark.parametrize("cpu", [False, True])
def test_chunks_move_to_cuda_replicas(cpu: bool) -> None:
    # Two replicas: two GPUs, or the one GPU and the CPU.
    gpus = [f"GPU:{i}" for i in range(min(torch.cuda.device_count(), 2))]
    topo = Topology(devices=parse_devices([*gpus[:1], "CPU:0"] if cpu else gpus))
    n = topo.num_replicas_in_sync
    if n == 1:
        pytest.skip("needs 2 CUDA devices")
    (step,) = list(DistributedDataset([torch.arange(8)], topo))
    assert [v.device for v in step.values] == list(topo.torch_devices)
    assert step.devices == topo.device_names
    assert as_lists(step) == reference(torch.arange(8), n)
    (kept,) = list(DistributedDataset([torch.arange(8)], topo,
                                      InputOptions(experimental_fetch_to_device=False)))
    assert all(v.device.type == "cpu" for v in kept.values)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.timeout(30)
@pytest.mark.parametrize("depth", DEPTHS)
def test_one_cuda_replica_gets_its_batch_on_the_gpu(depth: int) -> None:
    topo = Topology(devices=parse_devices(["GPU:0"]))
    steps = list(DistributedDataset([torch.arange(8), torch.arange(3)], topo, options(depth)))
    assert [s.device.type for s in steps] == ["cuda", "cuda"]  # one replica: plain tensors
    assert [s.tolist() for s in steps] == [list(range(8)), [0, 1, 2]]


def test_default_strategy_topology_yields_plain_batches() -> None:
    topo = Topology(devices=parse_devices(["CPU:0"]), follows_caller=True)
    steps = list(DistributedDataset([{"x": np.arange(3)}], topo, options(0)))
    assert len(steps) == 1 and isinstance(steps[0]["x"], torch.Tensor)
    assert steps[0]["x"].tolist() == [0, 1, 2]


# --- errors and the prefetch thread -----------------------------------------------------


class Boom(KeyError):
    pass


def failing_source(after: int) -> Iterator[torch.Tensor]:
    for i in range(after):
        yield torch.full((2,), i)
    raise Boom("disk gone")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("depth", DEPTHS)
def test_source_raising_mid_iteration_propagates(depth: int) -> None:
    it = iter(DistributedDataset(failing_source(2), topology(2), options(depth)))
    assert as_lists(next(it)) == [[0], [0]]
    assert as_lists(next(it)) == [[1], [1]]
    with pytest.raises(Boom, match="disk gone") as info:
        next(it)
    assert any(entry.name == "failing_source" for entry in info.traceback)  # the source's frame
    with pytest.raises(StopIteration):
        next(it)
    wait_no_prefetch_threads()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("depth", DEPTHS)
def test_bad_batch_raises_in_consumer(depth: int) -> None:
    batches = [torch.zeros(2), {"a": torch.zeros(3)}, (torch.zeros(2), torch.zeros(3, 1))]
    it = iter(DistributedDataset(batches[2:], topology(2), options(depth)))
    with pytest.raises(ValueError, match=r"batch 0 of the dataset needs one leading batch dim.*"
                                         r"batch\[1\] has batch dim 3, not 2 \(shapes: "
                                         r"batch\[0\]: \[2\]; batch\[1\]: \[3, 1\]\)"):
        next(it)
    it = iter(DistributedDataset([torch.zeros(2), torch.tensor(1.0)], topology(2),
                                 options(depth)))
    next(it)
    with pytest.raises(ValueError, match=r"batch 1 of the dataset .* batch has a scalar"):
        next(it)
    wait_no_prefetch_threads()


@pytest.mark.timeout(30)
def test_thread_ends_when_exhausted_closed_or_dropped() -> None:
    gc.collect()  # threads of strategies dropped by earlier tests end here, not below
    baseline = threading.active_count()
    # CPU replicas: no prefetch thread by default.
    assert next(iter(DistributedDataset(torch.arange(4).reshape(2, 2), topology(2)))) is not None
    assert prefetch_threads() == []
    ds = DistributedDataset(torch.arange(100).reshape(50, 2), topology(2),  # 50 batches of 2
                            InputOptions(experimental_prefetch_depth=2))
    # Exhausted.
    assert len(list(ds)) == 50
    assert prefetch_threads() == [] and threading.active_count() == baseline
    # Closed early: the producer stops at its next hand-off.
    it = iter(ds)
    next(it)
    assert len(prefetch_threads()) == 1
    it.close()
    wait_no_prefetch_threads()
    assert threading.active_count() == baseline
    with pytest.raises(StopIteration):
        next(it)
    # Dropped.
    it = iter(ds)
    next(it)
    ref = weakref.ref(it)
    del it
    gc.collect()
    assert ref() is None
    wait_no_prefetch_threads()
    assert threading.active_count() == baseline


@pytest.mark.timeout(30)
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_prefetch_prepares_at_most_depth_steps_ahead(depth: int) -> None:
    pulled: list[int] = []
    reached = threading.Event()

    def source() -> Iterator[torch.Tensor]:
        for i in range(10):
            pulled.append(i)
            if len(pulled) == depth + 2:  # step 0 taken, depth queued, one in the producer's hand
                reached.set()
            yield torch.full((2,), i)

    it = iter(DistributedDataset(source(), topology(2), options(depth)))
    assert as_lists(next(it)) == [[0], [0]]
    if depth == 0:
        assert pulled == [0]  # nothing is read ahead without a thread
    else:
        assert reached.wait(timeout=10)  # read ahead while "the step runs"
        time.sleep(0.05)
        assert pulled == list(range(depth + 2))  # and no further
    assert [as_lists(s)[0][0] for s in it] == list(range(1, 10))


@pytest.mark.timeout(30)
def test_close_while_source_blocks_does_not_hang() -> None:
    release = threading.Event()
    closed = []

    def slow() -> Iterator[torch.Tensor]:
        try:
            yield torch.zeros(2)
            release.wait(timeout=20)
            yield torch.ones(2)
        finally:
            closed.append(True)

    dataset = DistributedDataset(slow(), topology(2), options(2))
    it = iter(dataset)
    assert as_lists(next(it)) == [[0.0], [0.0]]
    started = time.monotonic()
    it.close()  # the producer is inside the source: close must not wait for it
    assert time.monotonic() - started < 5.0
    assert len(prefetch_threads()) == 1
    release.set()
    # The next pass waits for that read and starts with its step (a new loop over the
    # generator would go on there), then the generator ends.
    assert [as_lists(s) for s in dataset] == [[[1.0], [1.0]]]
    wait_no_prefetch_threads()
    assert closed == [True]


# --- distribute_datasets_from_function ---------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("depth", DEPTHS)
def test_whole_element_rule_runs_out_mid_step(depth: int) -> None:
    elements = [torch.full((i + 1, 2), float(i)) for i in range(5)]  # sizes 1..5
    calls: list[InputContext] = []

    def dataset_fn(ctx: InputContext) -> list[torch.Tensor]:
        calls.append(ctx)
        return elements

    topo = topology(2)
    ds = DistributedDatasetsFromFunction(dataset_fn, topo, options(depth))
    assert calls == [InputContext(1, 0, 2)]
    assert len(ds) == 3
    for _ in range(2):  # re-iterable, dataset_fn still called once
        steps = list(ds)
        assert len(steps) == 3
        for k, step in enumerate(steps[:2]):
            assert step.devices == topo.device_names
            for r in range(2):
                assert torch.equal(step.values[r], elements[2 * k + r])
        assert torch.equal(steps[2].values[0], elements[4])
        assert steps[2].values[1].shape == (0, 2) and steps[2].values[1].dtype == torch.float32
    assert len(calls) == 1


@pytest.mark.timeout(30)
def test_whole_element_rule_exact_fit_and_nests() -> None:
    elements = [{"x": torch.full((2,), i), "y": (torch.ones(2, 3) * i,)} for i in range(6)]
    steps = list(DistributedDatasetsFromFunction(lambda ctx: iter(elements), topology(3)))
    assert len(steps) == 2  # 6 elements on 3 replicas: no empty step
    for k, step in enumerate(steps):
        assert as_lists(step["x"]) == [[3 * k + r] * 2 for r in range(3)]
        assert [v[0, 0].item() for v in step["y"][0].values] == [3 * k + r for r in range(3)]


def test_whole_element_rule_rejects_mixed_structures_and_bad_fns() -> None:
    elements = [{"x": torch.zeros(2)}, {"z": torch.zeros(2)}]
    with pytest.raises(ValueError, match=r"share a structure: at element\['x'\], element 0 "
                                         r"has a leaf \(Tensor\) but element 1 has nothing"):
        list(DistributedDatasetsFromFunction(lambda ctx: elements, topology(2), options(0)))
    with pytest.raises(TypeError, match="dataset_fn must be callable"):
        DistributedDatasetsFromFunction([torch.zeros(2)], topology(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dataset_fn's result must be an iterable of batches"):
        DistributedDatasetsFromFunction(lambda ctx: 3, topology(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="the dataset must be an iterable of batches"):
        DistributedDataset(3, topology(2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="options must be an InputOptions or None; got dict"):
        DistributedDataset([], topology(2), {"experimental_prefetch_depth": 0})  # type: ignore[arg-type]


# --- several workers -----------------------------------------------------------------------


class FakeVote:
    """A communicator's "does any worker have data" all-reduce, for workers on threads."""

    def __init__(self, num_workers: int, counted: bool = False, each: bool = False) -> None:
        self.each = each  # also every worker's value (the window's vote)
        self.windows: list[list[int]] = [[] for _ in range(num_workers)]
        self._values = [0] * num_workers
        self._barrier = threading.Barrier(num_workers, timeout=10)
        self._votes = [False] * num_workers
        self.calls = [0] * num_workers
        self._result = False
        self.counted = counted  # also a WorkerVote's agreement on the steps
        self._counts = [0] * num_workers
        self.agreed = [0] * num_workers

    def _agree(self, index: int, value: int, slots: list[int]) -> list[int]:
        """Every worker's ``value`` (``comm.agree``), through ``slots``."""
        slots[index] = value
        self._barrier.wait()
        values = list(slots)
        self._barrier.wait()
        return values

    def steps_for(self, index: int) -> Callable[[int], list[int]]:
        def steps(count: int) -> list[int]:
            self.agreed[index] += 1
            return self._agree(index, count, self._counts)

        return steps

    def every_for(self, index: int) -> Callable[[int], list[int]]:
        def every(value: int) -> list[int]:
            self.windows[index].append(value)
            return self._agree(index, value, self._values)

        return every

    def for_worker(self, index: int) -> Callable[[bool], bool]:
        def any_worker(has_data: bool) -> bool:
            self.calls[index] += 1
            self._votes[index] = has_data
            if self._barrier.wait() == 0:
                self._result = any(self._votes)
            self._barrier.wait()
            return self._result

        if self.each:
            return WorkerVote(any_worker, self.steps_for(index), self.every_for(index))
        return WorkerVote(any_worker, self.steps_for(index)) if self.counted else any_worker


def run_workers(make: Callable[[int, Callable[[bool], bool]], Any],
                num_workers: int = 2, counted: bool = False, each: bool = False
                ) -> tuple[list[list[Any]], FakeVote]:
    vote = FakeVote(num_workers, counted, each)
    results: list[list[Any]] = [[] for _ in range(num_workers)]
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        try:
            results[index] = list(make(index, vote.for_worker(index)))
        except BaseException as error:
            errors.append(error)
            vote._barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(num_workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    if errors:
        raise errors[0]
    return results, vote


@pytest.mark.timeout(30)
@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("depth", DEPTHS)
def test_two_workers_split_the_same_global_batches(depth: int, counted: bool) -> None:
    batches = [torch.arange(0, 8), torch.arange(8, 14)]  # range(14) in batches of 8

    def make(index: int, any_worker: Callable[[bool], bool]) -> DistributedDataset:
        topo = Topology(devices=parse_devices(["CPU:0"]), worker_index=index, num_workers=2)
        return DistributedDataset(batches, topo, options(depth), any_worker=any_worker)

    (w0, w1), vote = run_workers(make, counted=counted)
    assert [as_lists(s) for s in w0] == [[[0, 1, 2, 3]], [[8, 9, 10]]]
    assert [as_lists(s) for s in w1] == [[[4, 5, 6, 7]], [[11, 12, 13]]]
    if counted:  # every len() known: the steps agreed once, no vote at each step
        assert (vote.agreed, vote.calls) == ([1, 1], [0, 0])
    else:
        assert vote.calls == [3, 3]  # one vote per step, and the final "nobody has data"


@pytest.mark.timeout(30)
def test_a_source_without_len_on_any_worker_makes_every_worker_vote_at_each_step() -> None:
    batches = [torch.arange(0, 8), torch.arange(8, 14)]

    def make(index: int, any_worker: Callable[[bool], bool]) -> DistributedDataset:
        topo = Topology(devices=parse_devices(["CPU:0"]), worker_index=index, num_workers=2)
        source = batches if index == 0 else (b for b in batches)  # worker 1: a generator
        return DistributedDataset(source, topo, options(0), any_worker=any_worker)

    (w0, w1), vote = run_workers(make, counted=True)
    assert [as_lists(s) for s in w0] == [[[0, 1, 2, 3]], [[8, 9, 10]]]
    assert [as_lists(s) for s in w1] == [[[4, 5, 6, 7]], [[11, 12, 13]]]
    assert (vote.agreed, vote.calls) == ([1, 1], [3, 3])


@pytest.mark.timeout(60)
@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=2, max_size=3),
       ahead=st.integers(1, 4), depth=st.sampled_from([None, *DEPTHS]))
def test_workers_without_len_vote_once_per_window_and_step_as_with_a_vote_per_step(
        lengths: list[int], ahead: int, depth: int | None) -> None:
    # Worker k's source (no len()) has lengths[k] global batches of one row per worker;
    # every worker steps until the longest source ends, on empty batches after its own.
    default, iterator_module.VOTE_AHEAD = iterator_module.VOTE_AHEAD, ahead
    try:
        _window_case(lengths, ahead, depth)
    finally:
        iterator_module.VOTE_AHEAD = default


def _window_case(lengths: list[int], ahead: int, depth: int | None) -> None:
    workers = len(lengths)
    pulled = [0] * workers

    def make(index: int, any_worker: Callable[[bool], bool]) -> DistributedDataset:
        def source() -> Iterator[torch.Tensor]:
            for b in range(lengths[index]):
                pulled[index] += 1
                yield torch.arange(b * workers, (b + 1) * workers)
        topo = Topology(devices=parse_devices(["CPU:0"]), worker_index=index,
                        num_workers=workers)
        return DistributedDataset(source(), topo, InputOptions(
            experimental_prefetch_depth=depth), any_worker=any_worker)

    results, vote = run_workers(make, workers, counted=True, each=True)
    longest = max(lengths)
    ahead = ahead if depth is None else max(1, depth)  # (an explicit depth bounds it)
    for k, steps in enumerate(results):
        assert [as_lists(s) for s in steps] == [
            [[b * workers + k]] if b < lengths[k] else [[]] for b in range(longest)]
        assert pulled[k] == lengths[k]
    # one vote per window of up to `ahead` steps (none after the window in which every
    # source had ended), alike on every worker, never one per step where ahead > 1
    assert vote.calls == [0] * workers and len({len(w) for w in vote.windows}) == 1
    assert len(vote.windows[0]) <= -(-longest // ahead) + 1
    # the last window's vote says every worker's source ended
    assert all(w[-1] % 2 == 1 for w in vote.windows)


@pytest.mark.timeout(30)
def test_read_ahead_is_bounded_by_bytes_and_a_worker_without_batches_raises(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Steps of 4 KiB each against a 1-byte budget: one step read ahead at a time, so
    # one vote per step (as before windows); a worker whose source is empty while
    # another has data cannot make empty batches and says so.
    monkeypatch.setattr(iterator_module, "VOTE_AHEAD_BYTES", 1)
    pulled = [0, 0]

    def make(index: int, any_worker: Callable[[bool], bool]) -> list[Any]:
        def source() -> Iterator[torch.Tensor]:
            for _ in range(3):
                pulled[index] += 1
                yield torch.zeros(2, 512, dtype=torch.float64)
        topo = Topology(devices=parse_devices(["CPU:0"]), worker_index=index, num_workers=2)
        it = iter(DistributedDataset(source(), topo, options(0), any_worker=any_worker))
        seen = []
        for _ in it:
            seen.append(pulled[index])
        return seen

    results, vote = run_workers(make, 2, counted=True, each=True)
    assert results == [[1, 2, 3], [1, 2, 3]]  # the source read one step ahead at most
    assert [len(w) for w in vote.windows] == [4, 4]

    def empty_one(index: int, any_worker: Callable[[bool], bool]) -> list[str]:
        topo = Topology(devices=parse_devices(["CPU:0"]), worker_index=index, num_workers=2)
        source = (b for b in [torch.arange(2)] * (2 * index))  # worker 0: none
        try:
            list(DistributedDataset(source, topo, InputOptions(), any_worker=any_worker))
        except RuntimeError as error:
            return [str(error)]
        return []

    results, _ = run_workers(empty_one, 2, counted=True, each=True)
    for messages in results:  # every worker raises, at the same step
        assert len(messages) == 1 and "has no batches on worker(s) [0] while others" in (
            messages[0]), messages


@pytest.mark.timeout(30)
def test_a_source_error_comes_after_the_steps_read_before_it_and_depth_zero_reads_none_ahead(
        ) -> None:
    pulled = [0, 0]

    def failing(index: int, any_worker: Callable[[bool], bool]) -> list[Any]:
        def source() -> Iterator[torch.Tensor]:
            for b in range(5):
                pulled[index] += 1
                yield torch.arange(2 * b, 2 * b + 2)
            raise OSError(f"worker {index}'s file is gone")
        topo = Topology(devices=parse_devices(["CPU:0"]), worker_index=index, num_workers=2)
        got: list[Any] = []
        try:
            for step in DistributedDataset(source(), topo, InputOptions(),
                                           any_worker=any_worker):
                got.append(as_lists(step))
        except OSError as error:
            got.append(str(error))
        return got

    results, _ = run_workers(failing, 2, counted=True, each=True)
    for k, got in enumerate(results):  # the 5 steps read before the error, then it
        assert got == [[[2 * b + k]] for b in range(5)] + [f"worker {k}'s file is gone"]

    def depth_zero(index: int, any_worker: Callable[[bool], bool]) -> list[int]:
        def source() -> Iterator[torch.Tensor]:
            for b in range(3):
                pulled[index] += 1
                yield torch.arange(2 * b, 2 * b + 2)
        pulled[index] = 0
        topo = Topology(devices=parse_devices(["CPU:0"]), worker_index=index, num_workers=2)
        return [pulled[index] for _ in DistributedDataset(source(), topo, options(0),
                                                          any_worker=any_worker)]

    results, vote = run_workers(depth_zero, 2, counted=True, each=True)
    assert results == [[1, 2, 3], [1, 2, 3]] and [len(w) for w in vote.windows] == [4, 4]


@pytest.mark.timeout(30)
def test_a_held_error_waits_for_its_steps_when_another_workers_window_is_shorter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Worker 1's steps are wide: the byte bound lets it read one at a time, so every
    # window lasts one step while worker 0 holds three steps and its source's error:
    # the error must wait until those three are handed out, on every window after.
    monkeypatch.setattr(iterator_module, "VOTE_AHEAD_BYTES", 100)

    got: list[list[int]] = [[], []]

    def make(index: int, any_worker: Callable[[bool], bool]) -> list[Any]:
        width = 16 if index else 1

        def source() -> Iterator[torch.Tensor]:
            for b in range(3 if index == 0 else 6):
                yield torch.full((2, width), b)
            if index == 0:
                raise OSError("worker 0's record is corrupt")
        topo = Topology(devices=parse_devices(["CPU:0"]), worker_index=index, num_workers=2)
        try:
            for step in DistributedDataset(source(), topo, InputOptions(),
                                           any_worker=any_worker):
                got[index].append(int(step.values[0][0, 0]))
        except OSError:
            time.sleep(0.5)  # (worker 1 finishes the vote both made before the fake aborts)
            raise
        return got[index]

    with pytest.raises(OSError, match="worker 0's record is corrupt"):
        run_workers(make, 2, counted=True, each=True)  # (worker 1 then meets no vote)
    assert got == [[0, 1, 2], [0, 1, 2]]


@pytest.mark.timeout(30)
def test_a_slow_source_reads_one_step_per_window(monkeypatch: pytest.MonkeyPatch) -> None:
    # Reads that take longer than VOTE_AHEAD_SECONDS: a window of one step at a time,
    # so a peer never waits in one vote for many slow reads (the collective timeout).
    monkeypatch.setattr(iterator_module, "VOTE_AHEAD_SECONDS", 0.01)

    def make(index: int, any_worker: Callable[[bool], bool]) -> list[int]:
        def source() -> Iterator[torch.Tensor]:
            for b in range(4):
                if index == 1:
                    time.sleep(0.02)
                yield torch.arange(2 * b, 2 * b + 2)
        topo = Topology(devices=parse_devices(["CPU:0"]), worker_index=index, num_workers=2)
        return [int(step.values[0][0]) for step in DistributedDataset(
            source(), topo, InputOptions(), any_worker=any_worker)]

    results, vote = run_workers(make, 2, counted=True, each=True)
    assert results == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert [len(w) for w in vote.windows] == [5, 5]  # one vote per step, and the end's


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["iterator", "generator", "list"])
def test_a_new_pass_over_a_one_shot_source_starts_with_the_steps_read_ahead(
        kind: str) -> None:
    # One process: a second pass over iter(batches) or a generator goes on where the
    # first stopped, as a new for loop over it would (a generator was closed when its
    # pass ended: the next pass had nothing, silently); a list starts again.
    # Several workers read ahead for their vote, and must hand out the same steps.
    def make_source() -> Any:
        batches = [torch.arange(2 * b, 2 * b + 2) for b in range(6)]
        return {"iterator": iter(batches), "generator": (b for b in batches),
                "list": batches}[kind]

    def passes(dataset: Any) -> list[list[int]]:
        first = []
        for step in dataset:
            first.append(int(step.values[0][0]) if hasattr(step, "values") else int(step[0]))
            if len(first) == 2:
                break
        return [first, [int(s.values[0][0]) if hasattr(s, "values") else int(s[0])
                        for s in dataset]]

    alone = passes(DistributedDataset(make_source(), topology(2)))

    def make(index: int, any_worker: Callable[[bool], bool]) -> list[list[int]]:
        topo = Topology(devices=parse_devices(["CPU:0"]), worker_index=index, num_workers=2)
        return passes(DistributedDataset(make_source(), topo, InputOptions(),
                                         any_worker=any_worker))

    results, _ = run_workers(make, 2, counted=True, each=True)
    second = {"iterator": [4, 6, 8, 10], "generator": [4, 6, 8, 10],
              "list": [0, 2, 4, 6, 8, 10]}[kind]
    assert alone == [[0, 2], second]  # (replica 0's rows; replica 1's are one more)
    assert results == [[[0, 2], second], [[1, 3], [b + 1 for b in second]]]


@pytest.mark.timeout(30)
def test_a_new_pass_supersedes_a_live_one_over_a_one_shot_source() -> None:
    # TF's custom loop takes `iterator = iter(dataset)` at each epoch while the variable
    # still holds the last epoch's: the new pass read the source alone, so the steps
    # the old one had read ahead (for the vote, or prefetched) were lost or came back
    # epochs later. The new pass now goes on where the old one stopped, and the old
    # one is refused if used again (interleaved, they counted each other's steps).
    def make(index: int, any_worker: Callable[[bool], bool]) -> list[Any]:
        batches = [torch.arange(2 * b, 2 * b + 2) for b in range(7)]
        topo = Topology(devices=parse_devices(["CPU:0"]), worker_index=index, num_workers=2)
        dataset = DistributedDataset(iter(batches), topo, InputOptions(),
                                     any_worker=any_worker)
        epochs: list[Any] = []
        iterator = iter(dataset)
        for _ in range(3):
            old, iterator = iterator, iter(dataset)  # (the variable still holds `old`)
            epochs.append([int(next(iterator).values[0][0]) // 2 for _ in range(2)])
        with pytest.raises(RuntimeError, match="superseded by a new pass"):
            next(old)
        epochs.append([int(s.values[0][0]) // 2 for s in iter(dataset)])
        return epochs

    (w0, w1), _ = run_workers(make, 2, counted=True, each=True)
    assert w0 == w1 == [[0, 1], [2, 3], [4, 5], [6]]


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_an_iterator_per_epoch_goes_on_with_prefetching(
        two: mirrored.MirroredStrategy, depth: int) -> None:
    def batches() -> Iterator[torch.Tensor]:
        for k in range(6):
            yield torch.arange(4 * k, 4 * k + 4)

    dataset = two.experimental_distribute_dataset(batches(), options(depth))
    seen = []
    for _ in range(3):
        iterator = iter(dataset)
        seen.append([int(torch.cat(two.experimental_local_results(next(iterator)))[0]) // 4
                     for _ in range(2)])
    assert seen == [[0, 1], [2, 3], [4, 5]]
    del iterator
    wait_no_prefetch_threads()


@pytest.mark.timeout(30)
def test_ctrl_c_in_a_source_read_ahead_is_raised_at_once_and_ends_the_pass() -> None:
    # Unlike an error of the source (held until the steps read before it are handed
    # out), an interrupt is raised where it happens, and the pass is over.
    def make(index: int, any_worker: Callable[[bool], bool]) -> list[Any]:
        def source() -> Iterator[torch.Tensor]:
            yield torch.arange(2)
            yield torch.arange(2, 4)
            raise KeyboardInterrupt
        topo = Topology(devices=parse_devices(["CPU:0"]), worker_index=index, num_workers=1)
        it = iter(DistributedDataset(source(), topo, InputOptions(), any_worker=any_worker))
        try:
            next(it)
        except KeyboardInterrupt:
            return ["interrupted", next(it, "ended")]
        return ["no interrupt"]

    results, vote = run_workers(make, 1, counted=True, each=True)
    assert results == [["interrupted", "ended"]] and vote.windows == [[]]


@pytest.mark.timeout(30)
def test_an_iterable_datasets_len_is_a_hint_so_its_workers_vote() -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([torch.arange(4), torch.arange(4, 8), torch.arange(8, 10)])

        def __len__(self) -> int:  # a hint: too small
            return 1

    def make(index: int, any_worker: Callable[[bool], bool]) -> Any:
        topo = Topology(devices=parse_devices(["CPU:0"]), worker_index=index, num_workers=2)
        loader = torch.utils.data.DataLoader(Stream(), batch_size=None)
        # (the iterator: list() would ask the dataset's len(), and torch warn)
        return iter(DistributedDataset(loader, topo, options(0), any_worker=any_worker))

    (w0, w1), vote = run_workers(make, counted=True)
    assert [as_lists(s) for s in w0] == [[[0, 1]], [[4, 5]], [[8]]]
    assert [as_lists(s) for s in w1] == [[[2, 3]], [[6, 7]], [[9]]]
    assert (vote.agreed, vote.calls) == ([1, 1], [4, 4])


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("said", "has", "message"), [
    (3, 2, r"yielded 2 batches, fewer than the 3 its len\(\) promised"),  # empty steps
    (2, 3, r"yielded more than the 2 batches its len\(\) promised; the workers agreed on 2 "
           r"steps"),  # dropped batches
])
def test_a_source_whose_len_is_wrong_raises(said: int, has: int, message: str) -> None:
    class Lying(list):
        def __len__(self) -> int:
            return said

    def make(index: int, any_worker: Callable[[bool], bool]) -> DistributedDataset:
        topo = Topology(devices=parse_devices(["CPU:0"]), worker_index=index, num_workers=2)
        source = Lying([torch.ones(2)] * has) if index == 1 else [torch.ones(2)] * min(said, has)
        return DistributedDataset(source, topo, options(0), any_worker=any_worker)

    with pytest.raises(RuntimeError, match=message):
        run_workers(make, counted=True)


@pytest.mark.timeout(30)
def test_two_workers_with_two_replicas_each_match_one_worker_with_four() -> None:
    batches = [torch.arange(0, 10), torch.arange(10, 13)]

    def make(index: int, any_worker: Callable[[bool], bool]) -> DistributedDataset:
        return DistributedDataset(batches, topology(2, index, 2), any_worker=any_worker)

    (w0, w1), _ = run_workers(make)
    single = [as_lists(s) for s in DistributedDataset(batches, topology(4))]
    assert [as_lists(a) + as_lists(b) for a, b in zip(w0, w1, strict=True)] == single
    assert w1[1].devices == topology(2, 1, 2).device_names


@pytest.mark.timeout(30)
@pytest.mark.parametrize("counted", [False, True])
@pytest.mark.parametrize("depth", DEPTHS)
def test_worker_that_runs_out_steps_on_empty_batches(depth: int, counted: bool) -> None:
    per_worker = {0: [torch.ones(4, 3)] * 3, 1: [torch.zeros(2, 3)]}

    def make(index: int, any_worker: Callable[[bool], bool]) -> DistributedDatasetsFromFunction:
        def dataset_fn(ctx: InputContext) -> list[torch.Tensor]:
            assert ctx == InputContext(num_input_pipelines=2, input_pipeline_id=index,
                                       num_replicas_in_sync=2)
            return per_worker[ctx.input_pipeline_id]

        topo = Topology(devices=parse_devices(["CPU:0"]), worker_index=index, num_workers=2)
        return DistributedDatasetsFromFunction(dataset_fn, topo, options(depth),
                                               any_worker=any_worker)

    (w0, w1), vote = run_workers(make, counted=counted)
    assert len(w0) == len(w1) == 3
    assert [s.values[0].shape for s in w0] == [(4, 3)] * 3
    assert [s.values[0].shape for s in w1] == [(2, 3), (0, 3), (0, 3)]
    assert w1[2].devices == (Topology(devices=parse_devices(["CPU:0"]), worker_index=1,
                                      num_workers=2).device_names)
    if counted:  # one local replica: a list's len() is the worker's steps, agreed once
        assert (vote.calls, vote.agreed) == ([0, 0], [1, 1])
    else:
        assert vote.calls == [4, 4]


# (local replicas, per-replica pipelines, worker 0's elements, worker 1's): whether the
# pipelines' len() fixes the steps whatever the elements hold
FROM_FUNCTION = {
    "shared, divided by the local replicas": (2, False, 4, 2, True),
    "shared, an incomplete last step": (2, False, 3, 2, False),
    "per replica, one length": (2, True, 3, 1, True),
    "per replica, lengths differ": (2, True, None, 1, False),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("scalars", [False, True])
@pytest.mark.parametrize("case", list(FROM_FUNCTION))
def test_pipelines_whose_len_fixes_the_steps_agree_once_else_vote(case: str,
                                                                  scalars: bool) -> None:
    local, per_replica, first, second, agreed = FROM_FUNCTION[case]
    mode = (InputReplicationMode.PER_REPLICA if per_replica else
            InputReplicationMode.PER_WORKER)

    def make(index: int, any_worker: Callable[[bool], bool]) -> DistributedDatasetsFromFunction:
        def dataset_fn(ctx: InputContext) -> list[torch.Tensor]:
            # (scalar elements: as many steps on each worker, which no empty batch evens)
            count = first if index == 0 or scalars else second
            if count is None:  # per replica, lengths differ: replica 0's longer
                count = 3 - ctx.input_pipeline_id % 2
            value = float(10 * index + ctx.input_pipeline_id)
            return [torch.tensor(value) if scalars else torch.full((2,), value)] * count

        topo = topology(local, index, 2)
        return DistributedDatasetsFromFunction(dataset_fn, topo, InputOptions(
            experimental_prefetch_depth=0, experimental_replication_mode=mode),
            any_worker=any_worker)

    voted, _ = run_workers(make, counted=False)
    counted, vote = run_workers(make, counted=True)
    # the same steps either way: a step a scalar element could not fill is dropped
    assert [[as_lists(s) for s in w] for w in counted] == [[as_lists(s) for s in w]
                                                          for w in voted]
    assert vote.agreed == [1, 1]
    assert (vote.calls == [0, 0]) is agreed


@pytest.mark.timeout(30)
@pytest.mark.parametrize("counted", [False, True])
def test_worker_without_any_batch_cannot_shape_empties(counted: bool) -> None:
    def make(index: int, any_worker: Callable[[bool], bool]) -> DistributedDataset:
        topo = Topology(devices=parse_devices(["CPU:0"]), worker_index=index, num_workers=2)
        source = [torch.zeros(2)] if index == 0 else []
        return DistributedDataset(source, topo, options(0), any_worker=any_worker)

    # Worker 1 raises (and breaks the fake vote, so worker 0 does not wait for it).
    # counted: every worker raises at the first step, knowing every worker's len()
    with pytest.raises(RuntimeError, match=r"has no batches on worker\(s\) \[1\] while "
                       if counted else "yielded no batches while other workers still have"):
        run_workers(make, counted=counted)


# --- InputContext and InputOptions --------------------------------------------------------


def test_input_context() -> None:
    assert InputContext() == InputContext(1, 0, 1)
    ctx = InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)
    assert ctx.get_per_replica_batch_size(64) == 16
    assert ctx.get_per_replica_batch_size(0) == 0
    with pytest.raises(ValueError, match="global_batch_size 10 is not divisible by "
                                         "num_replicas_in_sync 4"):
        ctx.get_per_replica_batch_size(10)
    with pytest.raises(TypeError, match=r"global_batch_size must be an int; got float 8\.0"):
        ctx.get_per_replica_batch_size(8.0)  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.input_pipeline_id = 0  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"input_pipeline_id must be in 0..1 .*got 2"):
        InputContext(num_input_pipelines=2, input_pipeline_id=2)
    with pytest.raises(ValueError, match="num_replicas_in_sync must be >= 1; got 0"):
        InputContext(num_replicas_in_sync=0)
    with pytest.raises(ValueError, match="num_input_pipelines must be >= 1; got 0"):
        InputContext(num_input_pipelines=0)
    with pytest.raises(TypeError, match="num_input_pipelines must be an int; got bool True"):
        InputContext(num_input_pipelines=True)


def test_input_options() -> None:
    default = InputOptions()
    assert default.experimental_fetch_to_device is True
    assert default.experimental_prefetch_depth is None  # 2 for CUDA replicas, else 0
    with pytest.raises(ValueError, match=r"experimental_prefetch_depth must be >= 0 .*got -1"):
        InputOptions(experimental_prefetch_depth=-1)
    with pytest.raises(TypeError, match="experimental_prefetch_depth must be an int; got str"):
        InputOptions(experimental_prefetch_depth="2")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="experimental_fetch_to_device must be a bool; got int 1"):
        InputOptions(experimental_fetch_to_device=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        InputOptions(False)  # type: ignore[misc]  # keyword-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        default.experimental_prefetch_depth = 0  # type: ignore[misc]


@pytest.mark.parametrize("where", ["sampler", "batch_sampler"])
def test_a_loader_sharded_by_a_distributed_sampler_is_refused(where):
    # DDP's habit: each process its own shard. Split as global batches, each worker would
    # keep its replicas' rows of its own shard's batches: a fraction of the data.
    data = torch.utils.data.TensorDataset(torch.arange(12.0))
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=1, shuffle=False)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler) if (
        where == "sampler") else torch.utils.data.DataLoader(
        data, batch_sampler=torch.utils.data.BatchSampler(sampler, 4, drop_last=False))
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    with pytest.raises(ValueError, match=r"got a DataLoader whose sampler is a "
                       r"DistributedSampler\(num_replicas=2, rank=1\).*keep 1/2 of the rows.*"
                       r"distribute_datasets_from_function"):
        strategy.experimental_distribute_dataset(loader)
    # One process's sampler (num_replicas=1) shards nothing: the whole data, as global
    # batches split over the replicas.
    whole = torch.utils.data.DataLoader(data, batch_size=4, sampler=(
        torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=False)))
    steps = [torch.cat(b[0].values).tolist()
             for b in strategy.experimental_distribute_dataset(whole)]
    assert steps == [[0.0, 1, 2, 3], [4.0, 5, 6, 7], [8.0, 9, 10, 11]]


class _Numbers:
    """A one-shot iterator without ``close`` (a sampler, a stream): a new pass goes on."""

    def __init__(self, n: int) -> None:
        self._it = iter(range(n))

    def __iter__(self) -> _Numbers:
        return self

    def __next__(self) -> torch.Tensor:
        i = next(self._it)
        return torch.tensor([2.0 * i, 2.0 * i + 1])


@pytest.mark.parametrize("depth", [1, 3])
@pytest.mark.parametrize("source", ["iter_list", "custom"])
def test_a_break_keeps_the_steps_prefetched_from_a_one_shot_source(
        two: mirrored.MirroredStrategy, depth: int, source: str) -> None:
    # The prefetch thread had read ahead of a loop that broke out; a one-shot source's
    # next pass goes on after what the thread had read: those steps were lost.
    def make() -> Any:
        if source == "custom":
            return _Numbers(10)
        return iter([torch.tensor([2.0 * i, 2.0 * i + 1]) for i in range(10)])

    dataset = two.experimental_distribute_dataset(make(), options(depth))
    seen = []
    for taken, step in enumerate(dataset):
        seen.append(torch.cat(two.experimental_local_results(step)))
        if taken == 2:
            break
    time.sleep(0.05)  # (the thread has filled its channel and waits)
    for step in dataset:
        seen.append(torch.cat(two.experimental_local_results(step)))
        break
    seen += [torch.cat(two.experimental_local_results(step)) for step in dataset]
    assert torch.cat(seen).tolist() == [float(i) for i in range(20)]
    wait_no_prefetch_threads()


@pytest.mark.parametrize("depth", [1, 2])
def test_prefetching_keeps_a_seeded_shuffle_and_the_callers_draws(
        two: mirrored.MirroredStrategy, depth: int) -> None:
    # A DataLoader seeded by torch.manual_seed draws its shuffle from torch's generator
    # at its first batch: the prefetch thread drew it from its own stream (another
    # order than one device's), and seeding that stream took a draw from the caller's.
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(12))

    def one_device() -> tuple[list[list[int]], float]:
        torch.manual_seed(0)
        loader = DataLoader(data, batch_size=4, shuffle=True)
        order = [y.tolist() for _ in range(2) for (y,) in loader]
        return order, torch.rand(1).item()

    torch.manual_seed(0)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    dataset = two.experimental_distribute_dataset(loader, options(depth))
    order = [torch.cat(two.experimental_local_results(y)).tolist()
             for _ in range(2) for (y,) in dataset]
    assert (order, torch.rand(1).item()) == one_device()
    wait_no_prefetch_threads()
