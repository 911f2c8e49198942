"""reduce_to / batch_reduce_to / broadcast_to, destinations, pluggable CrossDeviceOps,
fusion into packs."""

import pytest
import torch

import mirrored
from mirrored.experimental import CommunicationImplementation, CommunicationOptions

pytestmark = pytest.mark.timeout(60)

DEVICES = ("/job:localhost/replica:0/task:0/device:CPU:0",
           "/job:localhost/replica:0/task:0/device:CPU:1")


def pr(*values):
    return mirrored.PerReplica([torch.as_tensor(v) for v in values], devices=["CPU:0", "CPU:1"])


def test_reduce_to_one_destination_is_a_tensor(two):
    v = pr([1.0, 2.0], [3.0, 4.0])
    out = two.extended.reduce_to("SUM", v, destinations="CPU:1")
    assert isinstance(out, torch.Tensor)
    assert out.tolist() == [4.0, 6.0]
    assert two.extended.reduce_to("mean", v, destinations="cpu").tolist() == [2.0, 3.0]
    assert two.extended.reduce_to("MAX", v, destinations=torch.zeros(1)).tolist() == [3.0, 4.0]


def test_reduce_to_distributed_destinations_is_the_all_reduce(two):
    v = pr([1.0, 2.0], [3.0, 4.0])
    out = two.extended.reduce_to("SUM", v, destinations=v)
    assert isinstance(out, mirrored.Mirrored)
    assert out.devices == DEVICES
    assert [t.tolist() for t in out.values] == [[4.0, 6.0]] * 2
    out.values[0].add_(1)  # components are separate copies
    assert out.values[1].tolist() == [4.0, 6.0]
    assert v.values[0].tolist() == [1.0, 2.0]


def test_mirrored_and_plain_values(two):
    m = mirrored.Mirrored([torch.tensor(2.0), torch.tensor(2.0)])
    assert two.extended.reduce_to("MEAN", m, destinations="CPU:0").item() == 2.0
    with pytest.raises(ValueError, match=r"reduce_to\(SUM\) got a value that is not per-replica "
                                         r"at value_destination_pairs\[0\] \(Mirrored\)"):
        two.extended.reduce_to("SUM", m, destinations="CPU:0")
    with pytest.raises(ValueError, match=r"not per-replica at value_destination_pairs\[1\] "
                                         r"\(Tensor\)"):
        two.extended.batch_reduce_to("SUM", [(pr(1.0, 2.0), "CPU:0"),
                                             (torch.tensor(1.0), "CPU:0")])
    plain = two.extended.reduce_to("MIN", torch.tensor(5.0), destinations=pr(0.0, 0.0))
    assert isinstance(plain, mirrored.Mirrored)
    assert [t.item() for t in plain.values] == [5.0, 5.0]


def test_batch_reduce_to_returns_a_list_in_order(two):
    pairs = [(pr([1.0], [2.0]), "CPU:0"), (pr([1, 2], [3, 4]), pr(0, 0)),
             (pr(1.0, 5.0), "CPU:1")]
    out = two.extended.batch_reduce_to("SUM", pairs)
    assert isinstance(out, list) and len(out) == 3
    assert out[0].tolist() == [3.0]
    assert isinstance(out[1], mirrored.Mirrored)
    assert [t.tolist() for t in out[1].values] == [[4, 6], [4, 6]]
    assert out[2].item() == 6.0
    means = two.extended.batch_reduce_to("MEAN", pairs)
    assert means[1].values[0].dtype == torch.float64
    assert means[1].values[0].tolist() == [2.0, 3.0]


def test_destination_errors(two):
    v = pr(1.0, 2.0)
    with pytest.raises(ValueError, match=r"destinations must not be empty; pass a device string"):
        two.extended.reduce_to("SUM", v, destinations="")
    with pytest.raises(ValueError, match=r"destinations must be one device string, a tensor or "
                                         r"a distributed value; got a list"):
        two.extended.reduce_to("SUM", v, destinations=["CPU:0", "CPU:1"])
    with pytest.raises(TypeError, match=r"destinations must be a device string, a torch.device, "
                                        r"a tensor or a distributed value; got int"):
        two.extended.reduce_to("SUM", v, destinations=0)
    with pytest.raises(ValueError, match=r"'TPU:0' is not a device name"):
        two.extended.broadcast_to(torch.ones(1), "TPU:0")
    with pytest.raises(ValueError, match=r"is a PerReplica with 3 components but this strategy "
                                         r"has 2 replicas"):
        two.extended.reduce_to("SUM", mirrored.PerReplica([1.0, 2.0, 3.0]), "CPU:0")
    with pytest.raises(ValueError, match=r"must be a \(value, destinations\) pair; got int"):
        two.extended.batch_reduce_to("SUM", [3])
    with pytest.raises(ValueError, match=r"one shape at value_destination_pairs\[0\]"):
        two.extended.reduce_to("SUM", pr([1.0], [1.0, 2.0]), "CPU:0")


def test_broadcast_to(two):
    t = torch.tensor([1, 2])
    one = two.extended.broadcast_to(t, "CPU:1")
    assert torch.equal(one, t) and one is not t
    many = two.extended.broadcast_to(t, pr(0, 0))
    assert isinstance(many, mirrored.Mirrored) and many.devices == DEVICES
    assert many.values[0] is not many.values[1]


def test_cross_replica_only(two):
    def step():
        return two.extended.reduce_to("SUM", torch.ones(1), "CPU:0")

    with pytest.raises(RuntimeError, match=r"extended.batch_reduce_to requires cross-replica "
                                           r"context"):
        two.run(step)

    def merged():
        return mirrored.get_replica_context().merge_call(
            lambda s, v: s.extended.reduce_to("SUM", v, destinations=v),
            args=(torch.tensor(float(mirrored.get_replica_context().replica_id_in_sync_group)),))

    assert [t.item() for t in two.run(merged).values] == [1.0, 1.0]


class RecordingOps(mirrored.CrossDeviceOps):
    """Delegates to the reference and records every pack it is asked to reduce."""

    def __init__(self):
        self.inner = mirrored.ReductionToOneDevice()
        self.packs = []

    def reduce_to_devices(self, reduce_op, components, devices):
        self.packs.append((components[0].dtype, components[0].numel()
                           * components[0].element_size()))
        return self.inner.reduce_to_devices(reduce_op, components, devices)

    def broadcast_to_devices(self, tensor, devices):
        return self.inner.broadcast_to_devices(tensor, devices)


def test_all_reduce_packs_leaves_per_dtype_within_bytes_per_pack():
    ops = RecordingOps()
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=ops)
    options = CommunicationOptions(bytes_per_pack=400)
    floats = [torch.full((25,), float(k)) for k in range(10)]  # 100 bytes each
    ints = [torch.arange(5) for _ in range(3)]  # 40 bytes each

    def step():
        ctx = mirrored.get_replica_context()
        return ctx.all_reduce("SUM", {"f": floats, "i": ints}, options=options)

    out = strategy.experimental_local_results(strategy.run(step))[1]
    assert sorted(ops.packs, key=str) == sorted(
        [(torch.float32, 400), (torch.float32, 400), (torch.float32, 200), (torch.int64, 120)],
        key=str)
    assert all(nbytes <= 400 for _, nbytes in ops.packs)
    for k in range(10):
        assert out["f"][k].tolist() == [2.0 * k] * 25
    assert out["i"][2].tolist() == [0, 2, 4, 6, 8]


def test_bytes_per_pack_zero_is_one_pack_per_dtype_and_large_leaves_go_alone():
    ops = RecordingOps()
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=ops)
    leaves = [torch.ones(10) for _ in range(50)]
    strategy.run(lambda: mirrored.get_replica_context().all_reduce(
        "SUM", leaves, options=CommunicationOptions(bytes_per_pack=0)))
    assert ops.packs == [(torch.float32, 2000)]
    ops.packs.clear()
    strategy.run(lambda: mirrored.get_replica_context().all_reduce(
        "SUM", [torch.ones(100), torch.ones(1)], options=CommunicationOptions(bytes_per_pack=64)))
    assert ops.packs == [(torch.float32, 400), (torch.float32, 4)]


def test_batch_reduce_to_packs_too():
    ops = RecordingOps()
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=ops)
    pairs = [(pr([float(k)] * 4, [1.0] * 4), "CPU:0") for k in range(6)]
    out = strategy.extended.batch_reduce_to("SUM", pairs,
                                            options=CommunicationOptions(bytes_per_pack=48))
    assert ops.packs == [(torch.float32, 48), (torch.float32, 48)]
    assert [t.tolist() for t in out] == [[k + 1.0] * 4 for k in range(6)]


def test_cross_device_ops_must_be_a_cross_device_ops():
    with pytest.raises(TypeError, match=r"cross_device_ops must be a mirrored.CrossDeviceOps"):
        mirrored.MirroredStrategy(["CPU:0"], cross_device_ops="nccl")


def test_default_cross_device_ops_and_implementations():
    cpu = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    with pytest.raises(ValueError, match=r"implementation NCCL needs every replica on its own "
                                         r"CUDA device; this strategy's replicas are on CPU:0, "
                                         r"CPU:1"):
        mirrored.MirroredStrategy(["CPU:0", "CPU:1"], communication_options=CommunicationOptions(
            implementation=CommunicationImplementation.NCCL))
    ring = CommunicationOptions(implementation="ring")

    def step():
        return mirrored.get_replica_context().all_reduce("SUM", torch.ones(1), options=ring)

    assert [t.item() for t in cpu.run(step).values] == [2.0, 2.0]


def test_reduction_to_one_device_repr_and_target():
    ops = mirrored.ReductionToOneDevice(reduce_to_device="CPU:1")
    assert repr(ops) == "ReductionToOneDevice('CPU:1')"
    v = pr([1.0], [2.0])
    assert ops.reduce("SUM", v, destinations="CPU:0").tolist() == [3.0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices for NCCL")
def test_nccl_path_on_two_gpus():
    strategy = mirrored.MirroredStrategy(["GPU:0", "GPU:1"])

    def step():
        ctx = mirrored.get_replica_context()
        x = torch.arange(4.0, device=f"cuda:{ctx.replica_id_in_sync_group}") * (
            ctx.replica_id_in_sync_group + 1)
        return ctx.all_reduce("SUM", x), ctx.all_reduce("MAX", x)

    results = strategy.experimental_local_results(strategy.run(step))
    for i, (total, maximum) in enumerate(results):
        assert total.device == torch.device("cuda", i)
        assert total.cpu().tolist() == [0.0, 3.0, 6.0, 9.0]
        assert maximum.cpu().tolist() == [0.0, 2.0, 4.0, 6.0]


def test_strategy_options_apply_and_calls_override_them():
    ops = RecordingOps()
    strategy = mirrored.MirroredStrategy(
        ["CPU:0", "CPU:1"], cross_device_ops=ops,
        communication_options=CommunicationOptions(bytes_per_pack=400))
    leaves = [torch.ones(25) for _ in range(8)]  # 100 bytes each
    strategy.run(lambda: mirrored.get_replica_context().all_reduce("SUM", leaves))
    assert ops.packs == [(torch.float32, 400), (torch.float32, 400)]
    ops.packs.clear()
    strategy.run(lambda: mirrored.get_replica_context().all_reduce(
        "SUM", leaves, options=CommunicationOptions(bytes_per_pack=200)))
    assert ops.packs == [(torch.float32, 200)] * 4
    ops.packs.clear()
    strategy.extended.batch_reduce_to("SUM", [(pr([1.0] * 25, [1.0] * 25), "CPU:0")] * 8)
    assert ops.packs == [(torch.float32, 400), (torch.float32, 400)]
