"""Device names: short and canonical spellings, duplicates, missing GPUs."""

import pytest
import torch

import mirrored
from mirrored._src.devices import canonical_name_of, parse_device, parse_devices

CPU1 = "/job:localhost/replica:0/task:0/device:CPU:1"


@pytest.mark.parametrize("spec", ["CPU:1", "cpu:1", "Cpu:1", "/device:CPU:1", "/cpu:1", CPU1,
                                  " CPU:1 "])
def test_spellings_of_cpu1(spec):
    device = parse_device(spec)
    assert device.name == CPU1
    assert device.short_name == "CPU:1"
    assert device.torch_device == torch.device("cpu")


@pytest.mark.parametrize(("spec", "index"), [("GPU:0", 0), ("gpu:2", 2), ("cuda:1", 1),
                                             ("cuda", 0), (torch.device("cuda", 3), 3)])
def test_gpu_spellings(spec, index):
    device = parse_device(spec)
    assert device.short_name == f"GPU:{index}"
    assert device.torch_device == torch.device("cuda", index)


def test_cpu_without_index_is_cpu0():
    assert parse_device("cpu").short_name == "CPU:0"
    assert parse_device(torch.device("cpu")).short_name == "CPU:0"


def test_canonical_names_keep_job_and_task():
    device = parse_device("/job:worker/replica:0/task:3/device:GPU:1")
    assert (device.job, device.task, device.index) == ("worker", 3, 1)
    assert device.name == "/job:worker/replica:0/task:3/device:GPU:1"


@pytest.mark.parametrize("spec", ["TPU:0", "CPU:x", "", "CPU:0:1", "/job:a/device:XLA:0"])
def test_malformed_names(spec):
    with pytest.raises(ValueError, match="is not a device name; expected 'CPU:k'"):
        parse_device(spec)


def test_non_string_device():
    with pytest.raises(TypeError, match=r"a device must be a string.*got int 3"):
        parse_device(3)  # type: ignore[arg-type]


def test_duplicates_rejected():
    with pytest.raises(ValueError, match=r"devices must be distinct; 'CPU:0' \(position 0\) and "
                                         r"'cpu:0' \(position 1\) both name CPU:0"):
        mirrored.MirroredStrategy(["CPU:0", "cpu:0"])


def test_empty_and_string_device_lists():
    with pytest.raises(ValueError, match="at least one device"):
        mirrored.MirroredStrategy([])
    with pytest.raises(TypeError, match="devices must be a list of device names"):
        mirrored.MirroredStrategy("CPU:0")  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.device_count() > 8, reason="needs fewer than 9 GPUs")
def test_missing_gpu_rejected():
    with pytest.raises(ValueError, match=r"device GPU:8 was requested but this process sees "
                                         r"\d+ CUDA device"):
        parse_devices(["GPU:8"])


def test_worker_devices_and_default_devices():
    strategy = mirrored.MirroredStrategy(["cpu:0", "CPU:1", "/device:CPU:2"])
    assert strategy.extended.worker_devices == tuple(
        f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(3))
    assert strategy.extended.parameter_devices == strategy.extended.worker_devices
    default = mirrored.MirroredStrategy()
    expected = max(torch.cuda.device_count(), 1)
    assert default.num_replicas_in_sync == expected


def test_canonical_name_of_torch_devices():
    assert canonical_name_of(torch.device("cpu")) == (
        "/job:localhost/replica:0/task:0/device:CPU:0")
    assert canonical_name_of(torch.device("cuda", 1)).endswith("device:GPU:1")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_gpu_replicas_run_on_their_devices():
    strategy = mirrored.MirroredStrategy(["GPU:0", "GPU:1"])
    result = strategy.run(lambda: torch.ones(2))
    assert [t.device for t in strategy.experimental_local_results(result)] == [
        torch.device("cuda", 0), torch.device("cuda", 1)]
    total = strategy.reduce("SUM", result, axis=None)
    assert total.device == torch.device("cpu")
    assert torch.equal(total, torch.full((2,), 2.0))
