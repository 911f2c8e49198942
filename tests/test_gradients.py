"""Gradients through all_reduce and all_gather, against single-device references."""

import pytest
import torch

import mirrored

pytestmark = pytest.mark.timeout(60)


def rid():
    return mirrored.get_replica_context().replica_id_in_sync_group


@pytest.mark.parametrize(("op", "expected"), [("SUM", [4.0, 4.0]), ("MEAN", [2.0, 2.0])])
def test_spec_example(two, op, expected):
    inputs = [1.0, 3.0]
    scales = [1.0, 3.0]

    def step():
        x = torch.tensor(inputs[rid()], requires_grad=True)
        y = mirrored.get_replica_context().all_reduce(op, x) * scales[rid()]
        y.backward()
        return x.grad

    grads = two.run(step)
    assert [g.item() for g in grads.values] == expected


def reference_grads(make_loss, inputs):
    """The same computation on one device: gradients of the sum of every replica's loss."""
    leaves = [x.clone().requires_grad_(True) for x in inputs]
    make_loss(leaves).backward()
    return [x.grad for x in leaves]


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("n", [2, 3])
def test_all_reduce_with_axis_gradients_match_reference(strategies, op, n):
    strategy = strategies[n]
    gen = torch.Generator().manual_seed(n)
    inputs = [torch.randn(i + 1, 3, generator=gen) for i in range(n)]
    weights = [torch.randn(3, generator=gen) for _ in range(n)]

    def step():
        x = inputs[rid()].clone().requires_grad_(True)
        y = mirrored.get_replica_context().all_reduce(op, x, axis=0)
        (y * weights[rid()]).sum().backward()
        return x.grad

    grads = strategy.experimental_local_results(strategy.run(step))

    def loss(xs):
        cat = torch.cat(xs)
        reduced = cat.sum(0) if op == "SUM" else cat.mean(0)
        return sum((reduced * w).sum() for w in weights)

    for got, expected in zip(grads, reference_grads(loss, inputs), strict=True):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("op", ["MIN", "MAX"])
def test_min_max_gradients_route_to_the_extreme_and_split_ties(two, op):
    inputs = [torch.tensor([1.0, 5.0, 2.0]), torch.tensor([3.0, 5.0, 0.0])]

    def step():
        x = inputs[rid()].clone().requires_grad_(True)
        y = mirrored.get_replica_context().all_reduce(op, x)
        y.sum().backward()
        return x.grad

    grads = two.experimental_local_results(two.run(step))

    def loss(xs):
        stacked = torch.stack(xs)
        reduced = stacked.amin(0) if op == "MIN" else stacked.amax(0)
        return reduced.sum() * 2  # each of the 2 replicas backpropagates its copy

    for got, expected in zip(grads, reference_grads(loss, inputs), strict=True):
        torch.testing.assert_close(got, expected)


def test_all_gather_gradients_slice_back(strategies):
    strategy = strategies[3]
    inputs = [torch.arange(float(i + 1)) for i in range(3)]
    weights = [torch.arange(6.0) * (i + 1) for i in range(3)]

    def step():
        x = inputs[rid()].clone().requires_grad_(True)
        gathered = mirrored.get_replica_context().all_gather(x, axis=0)
        (gathered * weights[rid()]).sum().backward()
        return x.grad

    grads = strategy.experimental_local_results(strategy.run(step))
    summed = sum(weights)
    assert [g.tolist() for g in grads] == [summed[0:1].tolist(), summed[1:3].tolist(),
                                           summed[3:6].tolist()]


@pytest.mark.parametrize("other", [torch.bool, torch.int32, torch.int64])
def test_all_gather_beside_a_mask_gradients_only_the_floats(strategies, other):
    # A mask or an index gathered in the same call has no gradient: the floats' is the
    # one of the same step with the mask gathered as floats (it was refused in backward).
    strategy = strategies[3]
    inputs = [torch.arange(1.0, i + 2.0) for i in range(3)]
    masks = [torch.tensor(m) for m in ([True], [False, True], [True, False, True])]
    weights = [torch.arange(6.0) * (i + 1) for i in range(3)]

    def step(as_float):
        x = inputs[rid()].clone().requires_grad_(True)
        mask = masks[rid()].to(torch.float32 if as_float else other)
        out = mirrored.get_replica_context().all_gather({"x": x, "mask": mask}, axis=0)
        gathered, gathered_mask = out["x"], out["mask"]
        assert gathered_mask.dtype == mask.dtype
        (gathered * gathered_mask * weights[rid()]).sum().backward()
        return x.grad

    got = strategy.experimental_local_results(strategy.run(step, args=(False,)))
    expected = strategy.experimental_local_results(strategy.run(step, args=(True,)))
    reference = (sum(weights) * torch.cat(masks).float()).split([1, 2, 3])
    for g, e, r in zip(got, expected, reference, strict=True):
        assert g.tolist() == e.tolist() == r.tolist()


def test_unused_outputs_get_zero_gradients(two):
    def step():
        a = torch.tensor([1.0, 2.0], requires_grad=True)
        b = torch.tensor(3.0, requires_grad=True)
        out = mirrored.get_replica_context().all_reduce("SUM", {"a": a, "b": b})
        out["a"].sum().backward()
        return a.grad, b.grad

    for grad_a, grad_b in two.experimental_local_results(two.run(step)):
        assert grad_a.tolist() == [2.0, 2.0]
        assert grad_b.item() == 0.0


def test_backward_outside_run_raises_instead_of_hanging(two):
    def step():
        x = torch.tensor(1.0, requires_grad=True)
        return mirrored.get_replica_context().all_reduce("SUM", x)

    out = two.run(step)
    with pytest.raises(RuntimeError, match=r"gradient of all_reduce\(SUM\) at "
                                           r"test_gradients.py:\d+ was called outside "
                                           r"strategy.run"):
        out.values[0].backward()


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_forward_mode_ad_in_several_replicas_of_a_process_is_refused(two):
    # torch keeps one forward-AD level per process: two replica threads in jvp at once
    # raised "invalid index" or mixed their tangents silently.
    from torch.func import jvp

    w = torch.randn(3, 3)

    def step():
        _, tangent = jvp(lambda x: x @ w, (torch.ones(3),), (torch.ones(3),))
        return tangent

    with pytest.raises(RuntimeError, match=r"forward-mode AD .* outside strategy\.run"):
        two.run(step)
    _, tangent = jvp(lambda x: x @ w, (torch.ones(3),), (torch.ones(3),))  # outside: fine
    torch.testing.assert_close(tangent, torch.ones(3) @ w)
    one = mirrored.MirroredStrategy(["CPU:0"])  # one replica: torch's own
    torch.testing.assert_close(one.run(step), torch.ones(3) @ w)


def on_foreign_thread(fn):
    """Runs ``fn()`` on a thread Python did not start (``_thread``), as torch runs a
    CUDA replica's backward pass on its device's own autograd thread; re-raises."""
    import _thread
    import threading
    done, errors = threading.Event(), []

    def body():
        try:
            fn()
        except BaseException as error:
            errors.append(error)
        finally:
            done.set()

    _thread.start_new_thread(body, ())
    assert done.wait(30)
    if errors:
        raise errors[0]


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather"])
def test_backward_on_another_thread_meets_the_other_replicas(strategies, collective):
    # torch runs a CUDA replica's backward pass on its device's autograd thread, not on
    # the replica's: the gradient's all-reduce was refused there as "outside
    # strategy.run" (seen on a GPU and a CPU replica with sync BatchNorm). A thread of
    # our own, joined by the replica, is the same situation on the CPU.
    import threading
    strategy = strategies[3]
    weights = [torch.arange(3.0) * (i + 1) for i in range(3)]

    def step():
        x = torch.arange(3.0, requires_grad=True)
        ctx = mirrored.get_replica_context()
        y = (ctx.all_reduce("MEAN", x) if collective == "all_reduce"
             else ctx.all_gather(x, axis=0).view(3, 3).mean(0))
        loss = (y * weights[rid()]).sum()
        errors = []

        def backward():
            try:
                loss.backward()
            except BaseException as error:  # (raised on this thread, checked on the replica's)
                errors.append(error)

        thread = threading.Thread(target=backward)
        thread.start()
        thread.join(30)
        if errors:
            raise errors[0]
        return x.grad

    grads = strategy.experimental_local_results(strategy.run(step))
    for g in grads:  # d/dx of sum_r w_r . mean(x): the mean of the weights, each replica
        assert g.tolist() == (sum(weights) / 3).tolist()


def test_a_backward_pass_in_a_later_run_meets_that_runs_replicas(two):
    # The forward (through an all_reduce) in one run, its backward in the next: the
    # backward's all-reduce belongs to the run that calls it (the forward's run is
    # only a fallback, for torch's autograd thread of a CUDA device).
    w = [torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)]

    def forward():
        y = mirrored.get_replica_context().all_reduce("SUM", w[rid()] * (rid() + 1))
        return (y * y).sum()

    def backward(loss):
        loss.backward()
        return w[rid()].grad

    losses = two.run(forward)
    grads = two.experimental_local_results(two.run(backward, args=(losses,)))
    # y = w0 + 2 w1 = 3 on every replica; loss_r = sum(y^2); d/dw_r of sum_r loss_r
    assert [g.tolist() for g in grads] == [[12.0] * 3, [24.0] * 3]


@pytest.mark.parametrize("on_thread", [False, True])
def test_a_cpu_draw_recomputed_by_checkpoint_raises_on_any_thread(two, on_thread):
    # torch.utils.checkpoint recomputes a segment in backward after restoring torch's
    # CPU generator, not the replica's stream: the recomputed draw would differ from
    # the forward's. On the replica's thread this raised; on torch's autograd thread of
    # a CUDA device (here: a thread Python did not start) it drew from the CPU
    # generator, and the gradient was silently 0.45 off.
    from torch.utils.checkpoint import checkpoint

    def step():
        x = torch.ones(4, requires_grad=True)
        y = checkpoint(lambda t: t * torch.rand(t.shape), x, use_reentrant=False)
        if on_thread:
            on_foreign_thread(y.sum().backward)
        else:
            y.sum().backward()
        return x.grad

    with pytest.raises(RuntimeError, match="drew random numbers on the CPU during backward"):
        two.run(step)


def test_checkpointed_draws_of_a_plain_loop_beside_a_run_are_left_alone(two):
    # Only a thread Python did not start, in a run, is taken for a replica's
    # recomputation: the main thread's own checkpointed dropout (plain torch) while
    # another thread's run is in progress keeps working (it raised for a while).
    import threading

    from torch.utils.checkpoint import checkpoint
    inside, release = threading.Event(), threading.Event()

    def blocked():
        inside.set()
        release.wait(30)

    runner = threading.Thread(target=lambda: two.run(blocked))
    runner.start()
    try:
        assert inside.wait(30)
        x = torch.ones(4, requires_grad=True)
        torch.manual_seed(0)
        y = checkpoint(lambda t: torch.nn.functional.dropout(t, 0.5), x, use_reentrant=False)
        mask = y.detach() != 0
        y.sum().backward()  # the recomputed mask is the forward's (checkpoint restores)
        assert torch.equal(x.grad, mask.float() * 2)
    finally:
        release.set()
        runner.join(30)


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("on_thread", [False, True])
def test_sync_batch_norm_recomputed_by_a_reentrant_checkpoint(two, on_thread):
    # On the replica's thread the recomputation meets the other replicas again (the
    # global statistics, the gradients of no checkpoint). On torch's autograd thread of
    # a CUDA device (here: a thread Python did not start) it had no replica context and
    # used the
    # replica's own statistics: gradients silently 1e-4 off (10x their size). It raises.
    from torch.utils.checkpoint import checkpoint

    class Net(torch.nn.Module):  # a block checkpointed in forward, as models do
        def __init__(self):
            super().__init__()
            self.block = torch.nn.Sequential(torch.nn.BatchNorm1d(3))

        def forward(self, x, ckpt):
            return checkpoint(self.block, x, use_reentrant=True) if ckpt else self.block(x)

    torch.manual_seed(0)
    model = two.mirror(Net().double(), sync_batch_norm=True)
    xs = [torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64) * 5 + 2]
    weights = torch.arange(1.0, 4.0, dtype=torch.float64)

    def step(x, ckpt):
        x = x.clone().requires_grad_(True)
        y = model(x, ckpt)
        loss = (y * weights).pow(2).sum()
        if on_thread and ckpt:
            on_foreign_thread(loss.backward)
        else:
            loss.backward()
        return x.grad

    want = two.experimental_local_results(two.run(step, args=(mirrored.PerReplica(xs), False)))
    if on_thread:
        with pytest.raises(RuntimeError, match=r"sync BatchNorm .* checkpointed segments"):
            two.run(step, args=(mirrored.PerReplica(xs), True))
        return
    got = two.experimental_local_results(two.run(step, args=(mirrored.PerReplica(xs), True)))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-15)


def test_a_backward_on_a_foreign_thread_in_a_later_run_says_why_it_cannot(two):
    # On a GPU replica, torch runs the backward pass on its autograd thread, where only
    # the forward's run is known: a backward in a later run is refused, and says so
    # (it read "called by a replica of an earlier strategy.run that was abandoned").
    w = [torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)]

    def forward():
        return mirrored.get_replica_context().all_reduce("SUM", w[rid()]).sum()

    losses = two.run(forward)
    with pytest.raises(RuntimeError, match=r"backward pass for replica 0 \(CPU:0\) on a "
                                           r"thread that runs no replica .*earlier "
                                           r"MirroredStrategy.run \(run 1; run 2 is in "):
        two.run(lambda loss: on_foreign_thread(loss.backward), args=(losses,))
