"""The digits training example (what `make demo` runs): it learns, it resumes from its
checkpoint exactly, and 4 replicas train the same model as 1 (global-batch semantics).

The example runs as a subprocess, as a user would run it. Three independent runs go
concurrently (one fixture), the resume run after them; the file takes ~20-30 s.
"""

import pathlib
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("sklearn", reason="the example needs the 'examples' extra")
pytest.importorskip("tqdm", reason="the example needs the 'examples' extra")

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "train_digits.py"
EPOCH_LINE = re.compile(r"^epoch (\d+)/(\d+) loss (\d+\.\d{4}) accuracy (\d\.\d{4})$")
TEST_LINE = re.compile(r"^test accuracy: (\d\.\d{4})$")


def start(*args):
    return subprocess.Popen([sys.executable, str(EXAMPLE), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc):
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, f"the example failed:\n{err[-3000:]}"
    return out.splitlines()


def epochs_of(lines):
    return [(int(m[1]), int(m[2]), float(m[3]), float(m[4]))
            for m in map(EPOCH_LINE.match, lines) if m]


def printed_test_accuracy(lines):
    (accuracy,) = [float(m[1]) for m in map(TEST_LINE.match, lines) if m]
    return accuracy


def max_difference(a, b):
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("digits")
    procs = {
        "straight": start("--epochs", 3, "--save-final", tmp / "straight.pt"),
        "first_two": start("--epochs", 2, "--checkpoint-dir", tmp / "ckpt",
                           "--save-final", tmp / "four.pt"),
        "one_replica": start("--epochs", 2, "--replicas", 1, "--save-final", tmp / "one.pt"),
    }
    try:
        lines = {name: finish(proc) for name, proc in procs.items()}
        procs["resumed"] = start("--epochs", 3, "--checkpoint-dir", tmp / "ckpt",
                                 "--save-final", tmp / "resumed.pt")
        lines["resumed"] = finish(procs["resumed"])
    finally:  # on a failure, no process or pipe outlives the fixture
        for proc in procs.values():
            proc.kill()
            proc.communicate()
    return lines, tmp


@pytest.mark.timeout(120)
def test_learns_and_prints_one_parseable_line_per_epoch(runs):
    lines, _ = runs
    out = lines["straight"]
    assert out[0].startswith("4 replicas, global batch 100, 1437 training examples (37 in the")
    epochs = epochs_of(out)
    assert [(e, n) for e, n, _, _ in epochs] == [(1, 3), (2, 3), (3, 3)]
    losses = [loss for _, _, loss, _ in epochs]
    assert losses[0] > losses[1] > losses[2]
    assert epochs[-1][3] > 0.85  # training accuracy of epoch 3
    assert printed_test_accuracy(out) > 0.85
    assert out[-1].startswith("test accuracy: ")


@pytest.mark.timeout(120)
def test_resumes_from_its_checkpoint_and_matches_a_straight_run(runs):
    lines, tmp = runs
    # The newest two checkpoints are kept; no temporary file is left behind.
    assert sorted(p.name for p in (tmp / "ckpt").iterdir()) == ["ckpt-000000002.pt",
                                                                  "ckpt-000000003.pt"]
    resumed = lines["resumed"]
    assert f"resumed from epoch 2 ({tmp / 'ckpt' / 'ckpt-000000002.pt'})" in resumed
    assert [e for e, _, _, _ in epochs_of(resumed)] == [3]
    # Epochs 1-2 of the checkpointed run and epoch 3 of the resumed one are the
    # straight run's epochs, to the printed digit.
    assert epochs_of(lines["first_two"])[:2] == [(e, 2, loss, acc) for e, _, loss, acc
                                                 in epochs_of(lines["straight"])[:2]]
    assert epochs_of(resumed) == epochs_of(lines["straight"])[2:]
    assert printed_test_accuracy(resumed) == printed_test_accuracy(lines["straight"])
    straight = torch.load(tmp / "straight.pt", weights_only=True)
    again = torch.load(tmp / "resumed.pt", weights_only=True)
    # Same seed, same deterministic CPU ops: bitwise equal.
    assert all(torch.equal(straight[k], again[k]) for k in straight)
    assert straight["1.num_batches_tracked"].item() == 3 * 15


@pytest.mark.timeout(120)
def test_four_replicas_train_the_same_model_as_one(runs):
    lines, tmp = runs
    four = torch.load(tmp / "four.pt", weights_only=True)
    one = torch.load(tmp / "one.pt", weights_only=True)
    # Float32 sums in another order: equal to rounding, after 30 steps (partial batches
    # split 10 + 10 + 10 + 7), BatchNorm running statistics included.
    assert max_difference(four, one) < 1e-5
    assert lines["one_replica"][0].startswith("1 replica, global batch 100")
    assert four["4.num_batches_tracked"].item() == one["4.num_batches_tracked"].item() == 30


@pytest.mark.timeout(180)
def test_multi_worker_job_crashes_restarts_under_torchrun_and_resumes(tmp_path,
                                                                      digits_two_replicas):
    """torchrun --max-restarts=1 restarts a job that died after epoch 1; it resumes from
    the chief's checkpoint and ends with the model of a single process training the same
    global batches on as many replicas (2 workers x 1 replica == 1 process x 2)."""
    torchrun = pathlib.Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this Python")
    job = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node=2", "--max-restarts=1", str(EXAMPLE),
         "--multi-worker", "--replicas", "1", "--epochs", "2", "--crash-after-epoch", "1",
         "--checkpoint-dir", str(tmp_path / "ckpt"), "--save-final", str(tmp_path / "mw.pt")],
        capture_output=True, text=True, timeout=150)
    assert job.returncode == 0, job.stderr[-3000:]
    lines = job.stdout.splitlines()
    assert "crashing after epoch 1" in job.stderr
    assert any(line.startswith("resumed from epoch 1") for line in lines)
    assert [e[0] for e in epochs_of(lines)] == [1, 2]  # epoch 1, then 2 after the restart
    assert printed_test_accuracy(lines) > 0.85
    single, single_final = digits_two_replicas()  # --replicas 2 --epochs 2
    assert printed_test_accuracy(single) > 0.85
    assert max_difference(torch.load(tmp_path / "mw.pt"), torch.load(single_final)) < 1e-5
