"""A step's digest carries its place in a one-shot source, counted across passes: a
pass hands out the steps the last one read ahead, and a worker whose prefetch thread
had read one step more than another's must still give each step the digest the other
gives it (a place counted per pass made equal batches read as "sources differ")."""

from __future__ import annotations

import itertools

import torch

from mirrored._src.data.ahead import ReadAhead
from mirrored._src.data.steps import global_batch_steps
from mirrored._src.devices import parse_devices
from mirrored._src.topology import Topology


def _digests(passes: list[int], keeps: bool = True) -> list[int]:
    """Each step's digest when a one-shot source is read in passes of these lengths."""
    topology = Topology(devices=parse_devices(["CPU:0", "CPU:1"]), worker_index=0,
                        num_workers=2)
    source = iter([(torch.full((4, 2), float(i)), torch.zeros(4)) for i in range(6)])
    ahead = ReadAhead(keeps=keeps)
    out = []
    for length in passes:
        steps = global_batch_steps(source, topology, False, True, False, None, ahead)
        out += [step[0]._examples.digest for step in itertools.islice(steps, length)]
        steps.close()
    return out


def test_a_step_has_the_same_digest_whichever_pass_reads_it():
    whole = _digests([6])
    assert len(set(whole)) == 6  # (places differ: no element is sampled here)
    assert _digests([2, 4]) == whole
    assert _digests([1, 3, 2]) == whole


def test_a_re_iterable_sources_passes_count_from_the_start():
    assert _digests([2, 2], keeps=False)[:2] == _digests([2, 2], keeps=False)[2:]
