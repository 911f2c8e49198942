"""The seams of the architecture: every reduction goes through the strategy's one
communication path, global topology drives ids, counts and divisors, explicit
cross_device_ops versus options, and imports point down the layers."""

import ast
import pathlib

import pytest
import torch

import mirrored
from mirrored._src.comm.local import LocalCommunicator
from mirrored._src.comm.selection import CommunicatorSelector
from mirrored._src.devices import parse_devices
from mirrored._src.options import CommunicationOptions
from mirrored._src.runtime.runtime import ThreadRuntime
from mirrored._src.topology import Topology
from mirrored.experimental import CommunicationImplementation

pytestmark = pytest.mark.timeout(60)

SRC = pathlib.Path(mirrored.__file__).parent / "_src"


class RecordingOps(mirrored.CrossDeviceOps):
    """A transport that records which primitive each call used."""

    def __init__(self):
        self.calls = []
        self.inner = mirrored.ReductionToOneDevice()

    def reduce_to_devices(self, reduce_op, components, devices):
        self.calls.append("reduce")
        return self.inner.reduce_to_devices(reduce_op, components, devices)

    def broadcast_to_devices(self, tensor, devices):
        self.calls.append("broadcast")
        return self.inner.broadcast_to_devices(tensor, devices)

    def gather_to_devices(self, components, dim, devices):
        self.calls.append("gather")
        return self.inner.gather_to_devices(components, dim, devices)


def test_every_reduction_goes_through_the_strategy_cross_device_ops():
    ops = RecordingOps()
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=ops)
    v = mirrored.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0])])
    w = mirrored.PerReplica([torch.tensor(1.0), torch.tensor(2.0)])

    def seen(fn):
        ops.calls.clear()
        result = fn()
        return result, list(ops.calls)

    out, calls = seen(lambda: strategy.reduce("MEAN", v, axis=0))
    assert out.item() == 2.0 and calls == ["reduce"]
    out, calls = seen(lambda: strategy.reduce("SUM", w))
    assert out.item() == 3.0 and calls == ["reduce"]
    out, calls = seen(lambda: strategy.gather(v, axis=0))
    assert out.tolist() == [1.0, 2.0, 3.0] and calls == ["gather"]
    out, calls = seen(lambda: strategy.extended.reduce_to("MAX", w, "CPU:0"))
    assert out.item() == 2.0 and calls == ["reduce"]
    out, calls = seen(lambda: strategy.extended.batch_reduce_to("SUM", [(w, "CPU:0"),
                                                                        (w, "CPU:1")]))
    assert [t.item() for t in out] == [3.0, 3.0] and calls == ["reduce", "reduce"]
    out, calls = seen(lambda: strategy.extended.broadcast_to(torch.tensor(5.0), w))
    assert [t.item() for t in out.values] == [5.0, 5.0] and calls == ["broadcast"]

    def step():
        ctx = mirrored.get_replica_context()
        i = ctx.replica_id_in_sync_group
        return (ctx.all_reduce("SUM", torch.tensor(float(i))),
                ctx.all_gather(torch.ones(i + 1), axis=0))

    out, calls = seen(lambda: strategy.experimental_local_results(strategy.run(step)))
    assert [(s.item(), g.tolist()) for s, g in out] == [(1.0, [1.0] * 3)] * 2
    assert calls == ["reduce", "gather"]


class MirrorWorker:
    """A fake communicator for worker 1 of 2: the other worker holds exactly what this
    one holds, so every global SUM is twice the local one."""

    def __init__(self, ops):
        self.local = LocalCommunicator(ops)

    def reduce_packed(self, reduce_op, per_replica, destinations, bytes_per_pack, label=""):
        out = self.local.reduce_packed(reduce_op, per_replica, destinations, bytes_per_pack)
        if reduce_op is mirrored.ReduceOp.SUM:
            out = [[t * 2 for t in per_value] for per_value in out]
        return out

    def gather(self, per_replica, dim, destinations):
        copies, sizes = self.local.gather(per_replica, dim, destinations)
        return [torch.cat([c, c], dim=dim) for c in copies], sizes + sizes

    def broadcast(self, tensor, destinations):
        return self.local.broadcast(tensor, destinations)

    def sum_counts(self, per_replica, what=""):
        return [2 * c for c in self.local.sum_counts(per_replica)]


@pytest.fixture
def worker_one():
    topology = Topology(devices=parse_devices(["CPU:0", "CPU:1"]), worker_index=1,
                        num_workers=2)
    options = CommunicationOptions()
    strategy = mirrored.Strategy(
        topology=topology, runtime=ThreadRuntime(topology, "FakeWorker"),
        communicators=CommunicatorSelector(topology.devices, None, options, wrap=MirrorWorker),
        options=options)
    yield strategy
    strategy.close()


def test_a_two_worker_topology_uses_global_ids_counts_and_divisors(worker_one):
    strategy = worker_one
    assert strategy.num_replicas_in_sync == 4
    ids = strategy.run(lambda: mirrored.get_replica_context().replica_id_in_sync_group)
    assert strategy.experimental_local_results(ids) == (2, 3)
    counts = strategy.run(lambda: mirrored.get_replica_context().num_replicas_in_sync)
    assert counts.values == (4, 4)  # (a number: one per replica)
    ids, counts = strategy.experimental_distribute_values_from_function(
        lambda ctx: (ctx.replica_id_in_sync_group, ctx.num_replicas_in_sync))
    assert ids.values == (2, 3) and counts.values == (4, 4)

    def step():
        ctx = mirrored.get_replica_context()
        x = torch.tensor([1.0, 3.0]) if ctx.replica_id_in_sync_group == 2 else torch.tensor([5.0])
        return (ctx.all_reduce("MEAN", x.sum()), ctx.all_reduce("MEAN", x, axis=0),
                ctx.all_gather(x, axis=0))

    for mean, exact, gathered in strategy.experimental_local_results(strategy.run(step)):
        # Global replicas hold 4, 5, 4, 5: MEAN over 4 replicas is 4.5; over the 6
        # examples [1, 3, 5, 1, 3, 5] it is 3.
        assert mean.item() == 4.5 and exact.item() == 3.0
        assert gathered.tolist() == [1.0, 3.0, 5.0, 1.0, 3.0, 5.0]
    v = mirrored.PerReplica([torch.tensor(4.0), torch.tensor(5.0)])
    assert strategy.reduce("MEAN", v).item() == 4.5
    assert strategy.reduce("MEAN", mirrored.PerReplica([torch.ones(2), torch.ones(0)]),
                           axis=0).item() == 1.0
    assert strategy.extended.reduce_to("MEAN", v, "CPU:0").item() == 4.5
    losses = mirrored.PerReplica([torch.tensor([1.0, 2.0, 3.0]), torch.tensor([6.0])])
    average = strategy.run(mirrored.compute_average_loss, args=(losses,))
    # 8 global examples: each replica divides its own sum (6) by 8
    assert [t.item() for t in average.values] == [6.0 / 8, 6.0 / 8]


def test_messages_name_global_replicas_and_workers(worker_one):
    def step():
        ctx = mirrored.get_replica_context()
        return ctx.all_reduce("SUM", torch.ones(ctx.replica_id_in_sync_group))

    with pytest.raises(mirrored.CollectiveMismatchError,
                       match=r"replica 2 \(worker 1, CPU:0\): .*float32\[2\].*\n.*"
                             r"replica 3 \(worker 1, CPU:1\): .*float32\[3\]"):
        worker_one.run(step)


def test_explicit_cross_device_ops_wins_or_conflicts_loudly():
    ops = RecordingOps()
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"], cross_device_ops=ops,
                                         communication_options=CommunicationOptions(
                                             implementation="RING"))
    strategy.reduce("SUM", mirrored.PerReplica([torch.ones(1), torch.ones(1)]))
    assert ops.calls == ["reduce"]  # a custom transport wins over RING
    with pytest.raises(ValueError, match=r"cross_device_ops=ReductionToOneDevice\(\) and "
                                         r"communication_options implementation=NCCL disagree"):
        mirrored.MirroredStrategy(["CPU:0", "CPU:1"],
                                  cross_device_ops=mirrored.ReductionToOneDevice(),
                                  communication_options=CommunicationOptions(
                                      implementation=CommunicationImplementation.NCCL))
    plain = mirrored.MirroredStrategy(["CPU:0", "CPU:1"],
                                      cross_device_ops=mirrored.ReductionToOneDevice())

    def step():
        return mirrored.get_replica_context().all_reduce(
            "SUM", torch.ones(1), options=CommunicationOptions(implementation="NCCL"))

    with pytest.raises(ValueError, match=r"implementation=NCCL disagree"):
        plain.run(step)


def test_subclasses_may_only_assemble():
    with pytest.raises(TypeError, match=r"may only assemble a Strategy .* it overrides reduce"):
        class Sneaky(mirrored.Strategy):
            def reduce(self, *args):
                return None


def _imports(path):
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = path.parent
            for _ in range(node.level - 1):
                base = base.parent
            target = base.joinpath(*(node.module or "").split(".")) if node.module else base
            found.add(target.relative_to(SRC).as_posix())
    return found


# The layers, bottom to top: a module may import only from its own layer or below.
LAYERS = [
    {"errors", "reduce_op", "options", "devices", "pytree", "values", "reduction", "topology",
     "lazy_torch"},
    {"comm", "cluster"},
    {"runtime"},
    {"context"},
    {"collectives", "loss", "data", "training"},
    {"strategies", "testing", "processes", "elastic"},
]


def _layer(name):
    head = name.split("/")[0].removesuffix(".py")
    for level, members in enumerate(LAYERS):
        if head in members:
            return level
    raise AssertionError(f"{name} is in no layer")


def test_imports_point_down_the_layers():
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        name = path.relative_to(SRC).as_posix().removesuffix(".py")
        if name.endswith("__init__"):
            continue
        for target in _imports(path):
            if target.split("/")[0] in {"", "."}:
                continue
            if _layer(target) > _layer(name):
                offenders.append(f"{name} imports {target}")
    assert not offenders


def test_module_sizes():
    sizes = {p.relative_to(SRC).as_posix(): len(p.read_text().splitlines())
             for p in SRC.rglob("*.py")}
    assert max(sizes.values()) <= 400, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]


def test_strategy_class_size():
    tree = ast.parse((SRC / "strategies" / "strategy.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Strategy"]
    assert cls.end_lineno - cls.lineno + 1 < 250
