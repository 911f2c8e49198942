"""Per-replica random streams of logical CPU replicas: every random operator of a
step draws from the replica's stream (checked against eager torch seeded with the
replica's seed on one thread), reproducible from ``torch.manual_seed`` whatever
the thread timing, independent across replicas, free where nothing random runs,
and the same under ``torch.compile`` (no graph break, reproducible, equal to eager
with Inductor's ``fallback_random``)."""

import random
import time

import pytest
import torch
import torch.nn.functional as F

import mirrored
from mirrored._src.runtime.random import RandomStreams, seeded_operators

pytestmark = pytest.mark.timeout(120)


def rid():
    return mirrored.get_replica_context().replica_id_in_sync_group


def replica_seeds(seed, ids):
    """The seeds of the replicas' streams in a run started after manual_seed(seed)."""
    torch.manual_seed(seed)
    streams = RandomStreams(ids)
    streams.start_run()
    return [streams.generator(i).initial_seed() for i in range(len(ids))]


def every_sampler():
    """One call of each kind of random function, composites included (none of them is
    known to the library by name)."""
    x = torch.linspace(-2, 2, 24).reshape(2, 3, 4)
    q = torch.randn(1, 2, 5, 4)
    mha = torch.nn.MultiheadAttention(4, 2, dropout=0.5, batch_first=True)
    lstm = torch.nn.LSTM(4, 4, num_layers=2, dropout=0.5)
    t = torch.empty(6)
    return [
        F.dropout(x, 0.5), F.dropout2d(x[None], 0.5), F.dropout1d(x, 0.5), F.alpha_dropout(x, 0.5,
                                                                                     True),
        F.feature_alpha_dropout(x, 0.5, True), torch.dropout(x, 0.3, True),
        F.rrelu(x, training=True), F.gumbel_softmax(x), torch.rand(3), torch.randn(2, 2),
        torch.randint(0, 100, (4,)), torch.randperm(7), torch.normal(0.0, 1.0, (3,)),
        torch.normal(x, 1.0), torch.bernoulli(torch.full((5,), 0.5)), torch.rand_like(x),
        torch.multinomial(torch.ones(6), 3), torch.poisson(torch.ones(3)),
        t.clone().uniform_(), t.clone().exponential_(), t.clone().geometric_(0.5),
        t.clone().cauchy_(), t.clone().log_normal_(), t.clone().random_(0, 9),
        F.scaled_dot_product_attention(q, q, q, dropout_p=0.5),
        mha(q[0], q[0], q[0])[0], lstm(x.transpose(0, 1))[0],
        F.fractional_max_pool2d(torch.arange(64.0).reshape(1, 1, 8, 8), 2, output_size=4),
    ]


def test_every_random_function_draws_from_the_replica_stream_like_eager_torch():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    torch.manual_seed(1)  # the modules' weights, outside the streams
    reference = []
    for seed in replica_seeds(7, [0, 1, 2]):  # one thread, eager torch
        torch.manual_seed(1)
        torch.manual_seed(seed)
        reference.append(every_sampler())

    def step():
        time.sleep(random.random() * 0.003)  # thread timing must not matter
        return every_sampler()

    for _ in range(2):
        torch.manual_seed(7)
        out = strategy.experimental_local_results(strategy.run(step))
        for replica, expected in zip(out, reference, strict=True):
            for got, want in zip(replica, expected, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
    strategy.close()


def test_streams_are_reproducible_independent_and_fresh_each_run():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    x = torch.ones(4096)

    def step():
        if rid() == random.randrange(2):
            time.sleep(0.002)
        return F.dropout(x, 0.5)

    runs = []
    for _ in range(4):
        torch.manual_seed(0)
        runs.append(strategy.experimental_local_results(strategy.run(step)))
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run,
                                                                     strict=True))
    m0, m1 = (m != 0 for m in runs[0])
    agreement = (m0 == m1).double().mean().item()
    assert 0.45 < agreement < 0.55  # independent masks agree on about half the positions
    assert 0.45 < m0.double().mean().item() < 0.55
    torch.manual_seed(0)
    first = strategy.experimental_local_results(strategy.run(step))
    second = strategy.experimental_local_results(strategy.run(step))
    assert not torch.equal(first[0], second[0])  # successive runs differ
    torch.manual_seed(1)
    assert not torch.equal(strategy.experimental_local_results(strategy.run(step))[0],
                           first[0])  # another seed, other masks
    strategy.close()


def test_the_callers_generator_is_untouched_when_nothing_random_runs():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    torch.manual_seed(3)
    state = torch.get_rng_state()
    strategy.run(lambda: torch.ones(3) * 2 + 1)
    assert torch.equal(torch.get_rng_state(), state)
    strategy.run(lambda: (torch.rand(2), F.dropout(torch.ones(9), 0.5)))
    after = torch.get_rng_state()  # one base seed drawn per run, whatever runs
    torch.set_rng_state(state)
    torch.randint(0, 1 << 62, (1,))
    assert torch.equal(after, torch.get_rng_state())
    strategy.close()


def test_an_explicit_generator_and_the_caller_outside_run_are_left_alone():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    g = torch.Generator().manual_seed(5)
    out = strategy.experimental_local_results(strategy.run(
        lambda: torch.rand(3, generator=torch.Generator().manual_seed(5))))
    want = torch.rand(3, generator=g)
    assert all(torch.equal(o, want) for o in out)
    torch.manual_seed(2)  # outside run, the default generator as always
    a = F.dropout(torch.ones(64), 0.5)
    torch.manual_seed(2)
    assert torch.equal(a, F.dropout(torch.ones(64), 0.5))
    strategy.close()


def test_gradients_through_dropout_use_the_replicas_mask():
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])

    def step():
        w = torch.ones(256, requires_grad=True)
        y = F.dropout(w * 3, 0.25)
        y.sum().backward()
        return y.detach(), w.grad

    for y, grad in strategy.experimental_local_results(strategy.run(step)):
        torch.testing.assert_close(grad, y / 1.0, rtol=0, atol=0)  # 3 * mask / 0.75 = 4 * mask
    strategy.close()


def test_the_routed_operators_come_from_torch_tags():
    names = {str(op) for op in seeded_operators()}
    assert {"aten.bernoulli_.float", "aten.uniform_.default", "aten.random_.from",
            "aten.normal.Tensor_float", "aten.multinomial.default",
            "aten.randint.low_generator_out"} <= names
    assert not any(n.startswith(("aten.add", "aten.mm", "aten.dropout")) for n in names)
    for op in ("aten::add.Tensor", "aten::mm", "aten::addmm", "aten::relu"):
        assert not torch._C._dispatch_has_kernel_for_dispatch_key(op, "BackendSelect")


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_dropout_is_reproducible_without_graph_breaks_and_equals_eager():
    import torch._dynamo
    import torch._inductor.config
    from torch._dynamo.utils import counters

    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    x = torch.linspace(-1, 1, 64).reshape(4, 16)

    def block(x):
        return F.dropout(torch.relu(x * 2 + 1), 0.5).sum(1) + F.dropout(x, 0.2)[:, 0]

    compiled = torch.compile(block)

    def both():
        return compiled(x), block(x)

    torch._dynamo.reset()
    counters.clear()
    strategy.run(both)  # compiles (the replicas' thread count differs from the caller's)
    graphs = counters["stats"]["unique_graphs"]
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(strategy.experimental_local_results(strategy.run(both)))
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == graphs
    (c0, e0), (c1, e1) = runs[0]
    assert torch.equal(c0, runs[1][0][0]) and torch.equal(c1, runs[1][1][0])
    assert torch.equal(e0, runs[1][0][1]) and torch.equal(e1, runs[1][1][1])
    assert not torch.equal(c0, c1)  # the replicas' compiled masks differ
    # With Inductor's fallback_random, compiled random ops are torch's own: the
    # compiled step draws exactly what eager draws, replica by replica. (Torch's
    # config overrides are per thread: the replica sets it for its own compile.)
    torch._dynamo.reset()
    exact = torch.compile(block)

    def fallback():
        with torch._inductor.config.patch(fallback_random=True):
            return exact(x)

    strategy.run(fallback)
    torch.manual_seed(0)
    compiled_out = strategy.experimental_local_results(strategy.run(fallback))
    torch.manual_seed(0)
    eager_out = strategy.experimental_local_results(strategy.run(lambda: block(x)))
    for got, want in zip(compiled_out, eager_out, strict=True):
        torch.testing.assert_close(got, want)
    assert sum(counters["graph_break"].values()) == 0
    torch._dynamo.reset()
    strategy.close()


def test_a_checkpointed_segment_with_dropout_raises_instead_of_recomputing_another_mask():
    from torch.utils.checkpoint import checkpoint

    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])

    def step(forward):
        w = torch.ones(64, requires_grad=True)
        y = forward(w)
        y.sum().backward()
        return y.detach(), w.grad

    with pytest.raises(RuntimeError, match=r"aten.bernoulli_.float drew random numbers on the "
                                           r"CPU during backward.*checkpoint"):
        strategy.run(step, args=(
            lambda w: checkpoint(lambda v: F.dropout(v * 2, 0.5), w, use_reentrant=False),))
    # Dropout outside the checkpointed segment: the gradients use the forward's mask.
    out = strategy.experimental_local_results(strategy.run(step, args=(
        lambda w: F.dropout(checkpoint(torch.sin, w, use_reentrant=False), 0.5),)))
    for y, grad in out:
        torch.testing.assert_close(grad, (y != 0) * 2 * torch.cos(torch.ones(64)))
    strategy.close()


@pytest.mark.timeout(300)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_the_callers_compile_config_applies_on_every_replica():
    import torch._dynamo
    import torch._inductor.config

    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1", "CPU:2"])
    x = torch.linspace(-1, 1, 64).reshape(4, 16)

    def block(x):
        return F.dropout(torch.relu(x * 2 + 1), 0.5).sum(1)

    torch._dynamo.reset()
    saved = torch._inductor.config.fallback_random
    torch._inductor.config.fallback_random = True  # set once by the caller, as users do
    try:
        exact = torch.compile(block)
        torch.manual_seed(0)
        compiled_out = strategy.experimental_local_results(strategy.run(lambda: exact(x)))
    finally:
        torch._inductor.config.fallback_random = saved
        torch._dynamo.reset()
    torch.manual_seed(0)
    eager_out = strategy.experimental_local_results(strategy.run(lambda: block(x)))
    for got, want in zip(compiled_out, eager_out, strict=True):
        torch.testing.assert_close(got, want)
    strategy.close()


class _NoisySGD(torch.optim.SGD):
    """SGD with gradient noise drawn in step (as noisy or perturbed optimizers do)."""

    def step(self, closure=None):  # type: ignore[override]
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad.add_(torch.randn_like(p.grad) * 1e-3)
        return super().step(closure)


def test_draws_inside_the_optimizer_step_come_from_the_replicas_stream():
    # The library's own calls (the step, its all-reduce) run in the replica's stream: a
    # draw there must neither touch the caller's generator from two threads at once nor
    # differ between two runs from the same seed.
    strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])

    def train(seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        torch.manual_seed(seed)
        model = strategy.mirror(torch.nn.Linear(4, 1))
        opt = strategy.mirror_optimizer(model, lambda p: _NoisySGD(p, lr=0.1))
        state = torch.get_rng_state()

        def step() -> None:
            mirrored.compute_average_loss(model(torch.ones(2, 4)).squeeze(1)).backward()
            opt.step()
            opt.zero_grad()

        strategy.run(step)
        after = torch.get_rng_state()
        return [p.detach().clone() for p in model.replicas[1].parameters()], state, after

    first, state, after = train(7)
    torch.set_rng_state(state)
    torch.randint(0, 1 << 62, (1,))  # the run's one base seed, nothing else
    assert torch.equal(after, torch.get_rng_state())
    again, _, _ = train(7)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    strategy.close()
