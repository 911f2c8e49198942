"""The call check's arithmetic, against plain Python: trailers combined the way the
all-reduce combines them tell equal numbers from different ones exactly."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mirrored
from mirrored._src.comm import trailer
from mirrored._src.comm.call_identity import (
    CallLedger,
    UserCall,
    call_identity,
    identity_hash,
    user_call,
)
from mirrored._src.comm.cross_call import _CallText

_COMBINE = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}
_HASH = st.integers(min_value=0, max_value=2**62 - 1)


def _combined(kind: str, dtype: torch.dtype, rows: list[tuple[int, int, int]]) -> torch.Tensor:
    n = trailer.length(kind, dtype, len(rows))
    assert n > 0
    parts = []
    for values in rows:
        out = torch.zeros(n, dtype=dtype)
        trailer.write(out, kind, len(rows), values)
        parts.append(out)
    return functools.reduce(_COMBINE[kind], parts)


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["sum", "max", "min"]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.int32, torch.int64]),
       workers=st.integers(min_value=2, max_value=16), ident=_HASH, other=_HASH,
       odd=st.integers(min_value=0, max_value=15), predicted=_HASH)
def test_equal_identities_decode_and_any_difference_is_seen(kind, dtype, workers, ident,
                                                            other, odd, predicted):
    rows = [(ident, predicted, 0)] * workers
    (same, guess, miss), ok = trailer.decode(_combined(kind, dtype, rows), kind, workers)
    assert ok and (same, guess, miss) == (ident, predicted, 0)
    if other != ident:
        rows = list(rows)
        rows[odd % workers] = (other, predicted, 0)
        (same, guess, miss), ok = trailer.decode(_combined(kind, dtype, rows), kind, workers)
        assert same is None and not ok and guess == predicted and miss == 0
    rows = list(rows)
    rows[odd % workers] = (ident, predicted, 1)  # one worker sent zeros of other sizes
    (_, _, miss), _ = trailer.decode(_combined(kind, dtype, rows), kind, workers)
    assert miss != 0


def test_packs_that_cannot_carry_a_trailer_say_so():
    assert trailer.length("sum", torch.float16, 2) == 0
    assert trailer.length("sum", torch.bool, 2) == 0
    assert trailer.length("broadcast", torch.float32, 2) == 0
    assert trailer.length("sum", torch.float32, 2) == 30  # 15 pairs: 1 of 120 bytes


def test_the_ledger_counts_runs_and_predicts_the_next_call():
    ledger = CallLedger()
    wire_a = (("sum", "torch.float32", 33),)
    wire_b = (("max", "torch.int64", 31),)
    for _ in range(2):  # a loop: a then b, again and again
        ledger.next_phase()
        ledger.enter("a", wire_a)
        ledger.next_phase()
        ledger.enter("b", wire_b)
    assert ledger.run == 2 and ledger.phase_text() == "after run 2"
    assert ledger.enter("a", wire_a) == (5, wire_b)
    assert identity_hash("x") != identity_hash("y") and identity_hash("x") > 0


@pytest.mark.parametrize("reduces", [False, True])
def test_a_pass_end_predicts_nothing_until_the_next_pass_and_keeps_the_loops(reduces):
    # A loop of steps over passes of a distributed dataset: its agreement on the steps
    # (no data), then each step's gradient all-reduce, with reduces a loss reduced after
    # each step and an epoch's metric at the pass's end (the example's loop).
    ledger = CallLedger()
    grads, loss, metric = ((("sum", "torch.float32", n),) for n in (33, 31, 30))
    predicted = []

    def call(key: str, wire: tuple) -> None:
        predicted.append((key, ledger.enter(key, wire)[1]))

    def step() -> None:
        ledger.next_phase()
        call("grads", grads)
        ledger.next_phase()
        if reduces:
            call("loss", loss)

    for _ in range(3):
        ledger.pass_starts()
        call("agree", ())
        for last in (False, False, True):
            if last:
                ledger.pass_ends()  # the next run takes the pass's last step
            step()
        if reduces:
            call("metric", metric)
    per_pass = len(predicted) // 3
    steady = predicted[-per_pass:]
    after = {"agree": grads, "grads": loss if reduces else grads, "loss": grads}
    # Every call of the last pass predicts the loop's successor, but from the start of
    # the pass's last run, where nothing is predicted: the loop's predictions are kept.
    quiet = 3 if reduces else 1  # the last step's calls and the metric
    assert steady[:-quiet] == [(key, after[key]) for key, _ in steady[:-quiet]]
    assert [guess for _, guess in steady[-quiet:]] == [None] * quiet
    # Another run ends the quiet calls too: a pass that is not followed by another.
    ledger.next_phase()
    assert ledger.enter("grads", grads)[1] == (loss if reduces else grads)
    ledger.next_phase()
    # A pass whose last step is taken but never run (a break), then a new pass: its
    # first run predicts as usual.
    ledger.pass_ends()
    ledger.pass_starts()
    ledger.enter("agree", ())
    ledger.next_phase()
    assert ledger.enter("grads", grads)[1] == (loss if reduces else grads)


@pytest.mark.parametrize("workers", [2, 3, 64])
def test_sum_chunks_stay_exact_in_float32(workers):
    rows = [(2**62 - 1, 2**61 + 12345, 0)] * workers
    (same, guess, _), ok = trailer.decode(_combined("sum", torch.float32, rows), "sum",
                                             workers)
    assert ok and same == 2**62 - 1 and guess == 2**61 + 12345


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["sum", "max", "min"]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.int32, torch.int64]),
       workers=st.integers(min_value=2, max_value=16), ident=_HASH, other=_HASH,
       odd=st.integers(min_value=0, max_value=15), predicted=_HASH,
       field=st.sampled_from([0, 1, 2]))
def test_the_combined_trailer_holds_the_expected_bytes_only_when_every_worker_agrees(
        kind, dtype, workers, ident, other, odd, predicted, field):
    n = trailer.length(kind, dtype, workers)
    rows = [(ident, predicted, 0)] * workers
    odd_row = list(rows[0])
    odd_row[field] = 1 if field == 2 else other  # one worker's identity, prediction or miss
    rows[odd % workers] = tuple(odd_row)
    differs = rows[odd % workers] != rows[0] or rows[-1] != rows[0]
    parts, expected = [], b""
    for values in rows:
        buffer = torch.full((5 + n,), 7, dtype=dtype)  # data, then the trailer at its end
        expected = trailer.write(buffer, kind, workers, values)
        assert bool((buffer[:5] == 7).all())  # the data is untouched
        assert torch.equal(buffer[5:], _reference(kind, dtype, workers, values))
        parts.append(buffer)
    combined = functools.reduce(_COMBINE[kind], parts)
    # each worker's expectation is met exactly when every worker sent the same values
    assert trailer.holds(combined, expected) == (not differs)
    fields, ok = trailer.decode(combined[5:], kind, workers)
    assert ok == (not differs)
    assert not ok or fields == rows[0]


def _reference(kind: str, dtype: torch.dtype, workers: int, values: tuple[int, int, int]
               ) -> torch.Tensor:
    """The trailer as the format defines it, written independently of `trailer.write`:
    each field cut into chunks of ``c`` bits, each chunk ``v`` as ``(v, v*v)`` (SUM) or
    ``(v, -v)`` (MIN, MAX)."""
    c = trailer._bits(kind, dtype, workers)
    row: list[int] = []
    for bits, value in zip(trailer.FIELDS, values, strict=True):
        for k in range(-(-bits // c)):
            v = (value >> (k * c)) & ((1 << c) - 1)
            row += (v, v * v) if kind == "sum" else (v, -v)
    return torch.tensor(row, dtype=dtype)


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(["sum", "max", "min"]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.int32, torch.int64]),
       workers=st.integers(min_value=2, max_value=16), ident=_HASH, other=_HASH,
       predicted=_HASH, miss=st.integers(min_value=0, max_value=1))
def test_the_codec_writes_and_checks_what_write_and_holds_do(kind, dtype, workers, ident,
                                                                   other, predicted, miss):
    codec = trailer.codec_of(kind, dtype, workers)
    n = codec.length
    assert (n, codec.nbytes, codec.kind) == (trailer.length(kind, dtype, workers),
                                             n * dtype.itemsize, kind)
    pool = [torch.full((7 + n,), 3, dtype=dtype) for _ in range(2)]  # two pooled buffers
    for values in ((ident, predicted, miss), (other, predicted, 0), (ident, predicted, miss)):
        for buffer in pool:  # each address written more than once: its view is kept
            buffer.fill_(3)
            reference = torch.full((7 + n,), 3, dtype=dtype)
            expected = trailer.write(reference, kind, workers, values)
            end = buffer.data_ptr() + buffer.numel() * dtype.itemsize
            assert codec.write_at(end, *values) == expected
            assert torch.equal(buffer, reference)  # the same bytes, the data untouched
            combined = functools.reduce(_COMBINE[kind], [reference.clone()] * workers)
            buffer.copy_(combined)  # what the collective leaves when every worker agrees
            assert codec.holds_at(end, expected) and trailer.holds(combined, expected)


def test_the_codec_sees_one_worker_that_differs():
    workers, dtype = 3, torch.float32
    codec = trailer.codec_of("sum", dtype, workers)
    rows = [(12345, 678, 0), (12345, 678, 0), (12346, 678, 0)]
    buffers = [torch.zeros(4 + codec.length) for _ in rows]
    ends = [b.data_ptr() + b.numel() * 4 for b in buffers]
    expected = [codec.write_at(end, *row) for end, row in zip(ends, rows, strict=True)]
    total = functools.reduce(torch.add, buffers)
    for buffer in buffers:
        buffer.copy_(total)
    assert not any(codec.holds_at(end, e) for end, e in zip(ends, expected, strict=True))
    (same, guess, miss), ok = trailer.decode(total[4:], "sum", workers)
    assert not ok and same is None and (guess, miss) == (678, 0)
    with pytest.raises(ValueError, match="float16 over 2 workers carries no trailer"):
        trailer.codec_of("sum", torch.float16, 2)


@settings(max_examples=100, deadline=None)
@given(fields=st.tuples(*[st.integers(min_value=0, max_value=2**61) for _ in range(5)]),
       which=st.integers(min_value=0, max_value=4), delta=st.integers(min_value=1, max_value=9))
def test_a_calls_identity_changes_with_each_of_its_fields(fields, which, delta):
    ident = call_identity(*fields)
    assert 0 < ident < 2**62 and ident == call_identity(*fields)
    changed = list(fields)
    changed[which] += delta
    assert call_identity(*changed) != ident


def test_a_calls_identity_is_the_same_in_every_process_and_version():
    # blake2b of the five fields as little-endian uint64: fixed by the format, not by
    # this interpreter (workers compare it)
    import hashlib
    import struct
    digest = hashlib.blake2b(struct.pack("<5Q", 1, 2, 3, 4, 5), digest_size=8).digest()
    assert call_identity(1, 2, 3, 4, 5) == int.from_bytes(digest, "little") >> 2
    assert call_identity(1, 2, 3, 4, 5) == 0x56296dcf44ef469


def test_a_trailer_on_a_view_that_is_not_contiguous_is_written_and_read():
    base = torch.zeros(2, 40)
    column = base.t()[:, 0]  # stride 40: written through torch, not raw bytes
    n = trailer.length("sum", torch.float32, 2)
    expected = trailer.write(column, "sum", 2, (12345, 678, 0))
    assert torch.equal(column[-n:], _reference("sum", torch.float32, 2, (12345, 678, 0)))
    assert trailer.holds(column * 2, expected) and not trailer.holds(column, expected)


def _site_of(line_a: bool) -> UserCall:
    # Two call lines in one function: each must be its own site.
    if line_a:
        return user_call()
    return user_call()


def test_the_user_call_names_each_line_of_the_users_code_and_is_kept_per_line():
    a, again, b = _site_of(True), _site_of(True), _site_of(False)
    line = _site_of.__code__.co_firstlineno
    assert a.site == f"test_call_check.py:{line + 3}" and b.site == f"test_call_check.py:{line + 4}"
    assert again is a  # kept: a loop repeats its calls
    assert a.entry == "?"  # called from the user's code directly, no library entry


def test_the_user_call_skips_this_librarys_frames_and_names_its_entry():
    strategy = mirrored.MirroredStrategy(["CPU:0"])  # (its one replica: on this thread)
    seen = []
    for _ in range(2):  # the second time from what is kept
        site = f"test_call_check.py:{sys._getframe().f_lineno + 1}"
        seen.append(strategy.run(user_call))  # the library calls it: its frames are skipped
        assert str(seen[-1]) == f"Strategy.run at {site}"
    assert seen[1] is seen[0]


def test_equal_functions_in_two_files_are_two_sites(tmp_path):
    # Code objects compare equal by value, whatever their file: each keeps its own site.
    source = "def step(call):\n    return call()\n"
    steps = []
    for name in ("train_a.py", "train_b.py"):
        scope: dict[str, object] = {}
        exec(compile(source, str(tmp_path / name), "exec"), scope)
        steps.append(scope["step"])
    assert steps[0].__code__ == steps[1].__code__  # (what a cache keyed by value would merge)
    for _ in range(2):
        assert [str(step(user_call)) for step in steps] == ["? at train_a.py:2",
                                                            "? at train_b.py:2"]


def test_a_calls_text_is_formatted_when_a_message_needs_it():
    ledger = CallLedger()
    ledger.next_phase()
    text = _CallText(UserCall("all_reduce", "train.py:7"), "SUM of float32[4]", 2, ledger.in_run,
                     ledger.run)
    ledger.next_phase()  # the ledger moves on: the text keeps the call's phase
    expected = "all_reduce(SUM of float32[4]) at train.py:7 (collective 2 in run 1)"
    assert str(text) == expected and f"in {text}!" == f"in {expected}!"
    assert CallLedger.describe_phase(False, 0) == "before the first run"
    assert CallLedger.describe_phase(False, 3) == "after run 3"
