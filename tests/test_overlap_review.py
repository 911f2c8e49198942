"""Review of the gradient overlap across workers (the default of
`MultiWorkerMirroredStrategy`'s `mirror_optimizer`): real training programs ported as
a user would, on 2 workers of 1 and 2 local replicas, with buckets forced small,
compared with one device (plain torch on the global batch, float64) and with
``overlap=False``."""

from __future__ import annotations

import gc
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import mirrored
from mirrored._src.training import overlap as overlap_module
from mirrored.experimental import CommunicationOptions

pytestmark = pytest.mark.multiprocess

G = 8  # the global batch: 8 rows a step
STEPS = 4
D = torch.float64


def global_x(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(G, 6, generator=g, dtype=D)


class Dist:
    """How a case's step divides its loss and steps, on the replicas or on one device."""

    def __init__(self, one_device: bool) -> None:
        self.one_device = one_device

    def avg(self, per_example: torch.Tensor) -> torch.Tensor:
        if self.one_device:
            return per_example.sum() / G
        return mirrored.compute_average_loss(per_example, global_batch_size=G)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3)).to(D)


# ----------------------------------------------------------------- the cases
# Each case: (make the model, the step body(model, opt, x, step, dist), make the optimizer,
# outside-run hook(model, step) or None). The body runs inside `run` on each replica's
# rows, and on one device on the global batch.

def sq(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum(1)


def body_accumulate(model: Any, opt: Any, x: torch.Tensor, step: int, d: Dist) -> None:
    half = (len(x) + 1) // 2
    for part in (x[:half], x[half:]):
        d.avg(sq(model(part))).backward()
    opt.step()
    opt.zero_grad()


def body_accumulate_no_zero(model: Any, opt: Any, x: torch.Tensor, step: int, d: Dist) -> None:
    half = (len(x) + 1) // 2
    for part in (x[:half], x[half:]):
        d.avg(sq(model(part))).backward()
    opt.step()


def body_no_zero(model: Any, opt: Any, x: torch.Tensor, step: int, d: Dist) -> None:
    d.avg(sq(model(x))).backward()
    opt.step()


def body_zero_not_none(model: Any, opt: Any, x: torch.Tensor, step: int, d: Dist) -> None:
    d.avg(sq(model(x))).backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def body_plain(model: Any, opt: Any, x: torch.Tensor, step: int, d: Dist) -> None:
    d.avg(sq(model(x))).backward()
    opt.step()
    opt.zero_grad()


class Branchy(nn.Module):
    """A head used only for rows whose first feature is positive (data-dependent)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8)).to(D)
        self.head = nn.Linear(8, 3).to(D)
        self.rare = nn.Linear(8, 3).to(D)
        self.tail = nn.Linear(3, 3).to(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.trunk(x)
        out = self.head(h)
        mask = x[:, 0] > 1.0
        if bool(mask.any()):
            out = out.clone()
            out[mask] = out[mask] + self.rare(h[mask])
        return self.tail(out)


def global_x_branch(step: int) -> torch.Tensor:
    x = global_x(step)
    x[:, 0] = -2.0
    if step % 2 == 1:
        x[0, 0] = 2.0  # only the first replica's rows use `rare`, on odd steps
    return x


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 6).to(D)
        self.mid = nn.Sequential(nn.Linear(6, 6), nn.Tanh()).to(D)
        self.out = nn.Linear(6, 11, bias=False).to(D)
        self.out.weight = self.emb.weight  # tied

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = (x.abs() * 5).long() % 11
        return self.out(self.mid(self.emb(ids).mean(1)))


def body_gradient_penalty(model: Any, opt: Any, x: torch.Tensor, step: int, d: Dist) -> None:
    x = x.clone().requires_grad_(True)
    out = sq(model(x))
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    penalty = gx.pow(2).sum(1)
    # a read of the parameters' gradients (logging) that accumulates nothing
    torch.autograd.grad(d.avg(out), list(model.parameters()), retain_graph=True)
    d.avg(out + 0.1 * penalty).backward()
    opt.step()
    opt.zero_grad()


def body_retain_twice(model: Any, opt: Any, x: torch.Tensor, step: int, d: Dist) -> None:
    loss = d.avg(sq(model(x)))
    loss.backward(retain_graph=True)
    (0.5 * loss).backward()
    opt.step()
    opt.zero_grad()


def outside_freeze(model: Any, step: int) -> None:
    if step == 1:
        for p in model[2].parameters():
            p.requires_grad = False
    if step == 3:
        for p in model[2].parameters():
            p.requires_grad = True


def outside_freeze_last(model: Any, step: int) -> None:
    if step == 1:
        model[4].requires_grad_(False)
    if step == 3:
        model[4].requires_grad_(True)


def hooked_mlp() -> nn.Module:
    model = mlp()
    model[2].weight.register_hook(lambda g: g * 0.5)
    return model


def body_tensor_hook(model: Any, opt: Any, x: torch.Tensor, step: int, d: Dist) -> None:
    h = model[1](model[0](x))
    h.register_hook(lambda g: g * 3.0)
    out = model[4](model[3](model[2](h)))
    d.avg(sq(out)).backward()
    opt.step()
    opt.zero_grad()


def body_clip(model: Any, opt: Any, x: torch.Tensor, step: int, d: Dist) -> None:
    d.avg(sq(model(x))).backward()
    if d.one_device:
        nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    else:
        opt.step(clip_grad_norm=0.05)
    opt.zero_grad()


def body_clip_after_unscale(model: Any, opt: Any, x: torch.Tensor, step: int, d: Dist) -> None:
    scaler = SCALERS.setdefault(id(opt), torch.amp.GradScaler("cpu", init_scale=4.0))
    scaler.scale(d.avg(sq(model(x)))).backward()
    scaler.unscale_(opt)
    nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


SCALERS: dict[int, torch.amp.GradScaler] = {}


class MixedBf16(nn.Module):
    """float64 layers around a bfloat16 one (its bucket waits for the step)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 8).to(D)
        self.b = nn.Linear(8, 8).to(torch.bfloat16)
        self.c = nn.Linear(8, 8).to(D)
        self.d = nn.Linear(8, 3).to(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h.to(torch.bfloat16))).to(D)
        return self.d(torch.tanh(self.c(h)))


class Checkpointed(nn.Module):
    """A reentrant activation checkpoint (a backward nested in the backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.net[1:4], self.net[0](x),
                                              use_reentrant=True)
        return self.net[4](h)


class Mixed(nn.Module):
    """float64, float32 and float64 layers: buckets of two dtypes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 8).to(D)
        self.b = nn.Linear(8, 8).float()
        self.c = nn.Linear(8, 3).to(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h.float())).to(D)
        return self.c(h)


def sgd(p: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(p, lr=0.1, momentum=0.9)


def adam(p: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(p, lr=0.01)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[..., None],
                       Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                       Callable[[Any, int], None] | None,
                       Callable[[int], torch.Tensor]]] = {
    "plain": (mlp, body_plain, sgd, None, global_x),
    "accumulate": (mlp, body_accumulate, sgd, None, global_x),
    "accumulate_no_zero_grad": (mlp, body_accumulate_no_zero, sgd, None, global_x),
    "no_zero_grad": (mlp, body_no_zero, sgd, None, global_x),
    "zero_grad_not_none": (mlp, body_zero_not_none, sgd, None, global_x),
    "branch": (Branchy, body_plain, sgd, None, global_x_branch),
    "branch_adam": (Branchy, body_plain, adam, None, global_x_branch),
    "tied": (Tied, body_plain, sgd, None, global_x),
    "gradient_penalty": (mlp, body_gradient_penalty, sgd, None, global_x),
    "retain_twice": (mlp, body_retain_twice, sgd, None, global_x),
    "freeze_middle": (mlp, body_plain, sgd, outside_freeze, global_x),
    "freeze_last": (mlp, body_plain, adam, outside_freeze_last, global_x),
    "param_hook": (hooked_mlp, body_plain, sgd, None, global_x),
    "tensor_hook": (mlp, body_tensor_hook, sgd, None, global_x),
    "clip_step": (mlp, body_clip, sgd, None, global_x),
    "clip_after_unscale": (mlp, body_clip_after_unscale, sgd, None, global_x),
    "mixed_dtypes": (Mixed, body_plain, sgd, None, global_x),
    "mixed_bfloat16": (MixedBf16, body_plain, sgd, None, global_x),
    "checkpoint_reentrant": (Checkpointed, body_plain, sgd, None, global_x),
}


def one_device(name: str) -> list[torch.Tensor]:
    make, body, make_opt, outside, data = CASES[name]
    SCALERS.clear()
    model = make()
    opt = make_opt(list(model.parameters()))
    for step in range(STEPS):
        if outside is not None:
            outside(model, step)
        body(model, opt, data(step), step, Dist(True))
    return [p.detach().clone() for p in model.parameters()]


def train(strategy: mirrored.Strategy, name: str, overlap: bool | None
          ) -> tuple[list[torch.Tensor], dict[str, float] | None]:
    make, body, make_opt, outside, data = CASES[name]
    SCALERS.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mirrored.GradientHookWarning)
        model = strategy.mirror(make())
    kwargs = {} if overlap is None else {"overlap": overlap}
    opt = strategy.mirror_optimizer(model, make_opt, **kwargs)
    topology = strategy.extended._parts.topology
    local = topology.num_local_replicas
    per = G // strategy.num_replicas_in_sync
    first = topology.worker_index * local
    for step in range(STEPS):
        if outside is not None:
            outside(model, step)
        x = data(step)
        parts = [x[(first + r) * per:(first + r + 1) * per] for r in range(local)]
        arg = mirrored.PerReplica(parts) if local > 1 else parts[0]
        strategy.run(body, args=(model, opt, arg, step, Dist(False)))
    buckets = opt._reducer.buckets
    stats = None if buckets is None else dict(buckets.stats, buckets=len(buckets.plan))
    return [p.detach().clone() for p in model.replicas[0].parameters()], stats


def small_bucket_strategy(local: int) -> mirrored.MultiWorkerMirroredStrategy:
    overlap_module.DEFAULT_BUCKET_BYTES = 256
    return mirrored.MultiWorkerMirroredStrategy(
        communication_options=CommunicationOptions(timeout_seconds=20),
        devices=[f"CPU:{i}" for i in range(local)], failure_timeout_seconds=4.0)


def _worker_cases(local: int, names: list[str]) -> dict[str, Any]:
    strategy = small_bucket_strategy(local)
    out: dict[str, Any] = {}
    try:
        for name in names:
            try:
                on, stats = train(strategy, name, None)  # the default: overlap across workers
                off, _ = train(strategy, name, False)
                out[name] = ([t.tolist() for t in on], [t.tolist() for t in off], stats)
            except Exception as error:  # reported by the test
                out[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
    finally:
        strategy.close()
    return out


def check_cases(local: int, names: list[str]) -> None:
    results = mirrored.testing.run_multi_process(_worker_cases, 2, args=(local, names),
                                                 timeout=250)
    problems = []
    for name in names:
        reference = one_device(name)
        for worker, result in enumerate(results):
            got = result[name]
            if isinstance(got, str):
                problems.append(f"{name} worker {worker}: raised {got}")
                continue
            on, off, stats = got
            if stats is None or stats["buckets"] < 2:
                problems.append(f"{name}: overlap not on or too few buckets: {stats}")
            for k, (a, b, ref) in enumerate(zip(on, off, reference, strict=True)):
                a_t = torch.tensor(a, dtype=ref.dtype)
                b_t = torch.tensor(b, dtype=ref.dtype)
                if not torch.equal(a_t, b_t):
                    problems.append(f"{name} worker {worker} param {k}: overlap != "
                                    f"overlap=False by {(a_t - b_t).abs().max().item():.3g}")
                # (mixed: float64 gradients pass through a float32 layer)
                tol = (1e-5 if ref.dtype == torch.float32 or "mixed" in name else 1e-10
                       ) if ref.dtype != torch.bfloat16 else 2e-2
                if not torch.allclose(a_t, ref, rtol=tol, atol=tol):
                    problems.append(f"{name} worker {worker} param {k}: != one device by "
                                    f"{(a_t - ref).abs().max().item():.3g}")
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("local", [1, 2])
def test_ported_programs_train_as_one_device(local: int) -> None:
    check_cases(local, list(CASES))


# ------------------------------------------------- two optimizers over one model
class TwoParts(nn.Module):
    """Part A (trunk, head) and part B (pre, rare): ``rare`` is used only for rows whose
    first feature is positive, so only some workers' backward passes reach it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh()).to(D)
        self.head = nn.Linear(8, 3).to(D)
        self.pre = nn.Linear(6, 8).to(D)
        self.rare = nn.Linear(8, 8).to(D)
        self.back = nn.Linear(8, 3).to(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.head(self.trunk(x))
        p = torch.tanh(self.pre(x))
        mask = x[:, 0] > 1.0
        if bool(mask.any()):
            p = p.clone()
            p[mask] = torch.tanh(self.rare(p[mask]))
        return out + self.back(p)


def two_part_optimizers(model: Any, mirror: Callable[..., Any] | None) -> tuple[Any, Any]:
    def part_a(p: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(p[:6], lr=0.1, momentum=0.9)

    def part_b(p: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(p[6:], lr=0.01)

    if mirror is None:
        ps = list(model.parameters())
        return part_a(ps), part_b(ps)
    return mirror(model, part_a), mirror(model, part_b)


def body_two_optimizers(model: Any, opts: Any, x: torch.Tensor, step: int, d: Dist) -> None:
    d.avg(sq(model(x))).backward()
    for opt in opts:
        opt.step()
        opt.zero_grad()


def global_x_rare(step: int) -> torch.Tensor:
    x = global_x(step)
    x[:, 0] = -2.0
    if step >= 1:
        x[0, 0] = 2.0  # only worker 0's (first replica's) rows reach `rare`
    return x


class GanLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gen = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 6)).to(D)
        self.disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                                  nn.Linear(8, 1)).to(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.disc(x)


def gan_optimizers(model: Any, mirror: Callable[..., Any] | None) -> tuple[Any, Any]:
    def gen(p: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(p[:4], lr=0.01)

    def disc(p: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(p[4:], lr=0.01)

    if mirror is None:
        ps = list(model.parameters())
        return gen(ps), disc(ps)
    return mirror(model, gen), mirror(model, disc)


def body_gan(model: Any, opts: Any, x: torch.Tensor, step: int, d: Dist) -> None:
    """The DCGAN tutorial's loop: D on real and (detached) fake, then G through D
    (which accumulates into D's gradients too; D's zero_grad comes next step)."""
    opt_g, opt_d = opts
    module = model
    fake = module.gen(x)
    opt_d.zero_grad()
    d.avg(sq(module(x)) + sq(module(fake.detach()) - 1)).backward()
    opt_d.step()
    opt_g.zero_grad()
    d.avg(sq(module(fake) - 0.5)).backward()
    opt_g.step()


MULTI: dict[str, tuple[Callable[[], nn.Module], Callable[..., None], Callable[..., Any],
                       Callable[[int], torch.Tensor]]] = {
    "two_optimizers_rare": (TwoParts, body_two_optimizers, two_part_optimizers,
                            global_x_rare),
    "two_optimizers": (TwoParts, body_two_optimizers, two_part_optimizers, global_x),
    "gan": (GanLike, body_gan, gan_optimizers, global_x),
}


def one_device_multi(name: str) -> list[torch.Tensor]:
    make, body, make_opts, data = MULTI[name]
    model = make()
    opts = make_opts(model, None)
    for step in range(STEPS):
        body(model, opts, data(step), step, Dist(True))
    return [p.detach().clone() for p in model.parameters()]


def train_multi(strategy: mirrored.Strategy, name: str, overlap: bool | None
                ) -> tuple[list[torch.Tensor], dict[str, float] | None]:
    make, body, make_opts, data = MULTI[name]
    model = strategy.mirror(make())

    def mirror(m: Any, f: Any) -> Any:
        kwargs = {} if overlap is None else {"overlap": overlap}
        return strategy.mirror_optimizer(m, f, **kwargs)

    opts = make_opts(model, mirror)
    topology = strategy.extended._parts.topology
    local = topology.num_local_replicas
    per = G // strategy.num_replicas_in_sync
    first = topology.worker_index * local
    for step in range(STEPS):
        x = data(step)
        parts = [x[(first + r) * per:(first + r + 1) * per] for r in range(local)]
        arg = mirrored.PerReplica(parts) if local > 1 else parts[0]
        strategy.run(body, args=(model, opts, arg, step, Dist(False)))
    plans = [len(o._reducer.buckets.plan) for o in opts if o._reducer.buckets is not None]
    return [p.detach().clone() for p in model.replicas[0].parameters()], {"buckets": min(
        plans, default=0)}


def _worker_multi(local: int, names: list[str]) -> dict[str, Any]:
    strategy = small_bucket_strategy(local)
    out: dict[str, Any] = {}
    try:
        for name in names:
            try:
                on, stats = train_multi(strategy, name, None)
                off, _ = train_multi(strategy, name, False)
                out[name] = ([t.tolist() for t in on], [t.tolist() for t in off], stats)
            except Exception as error:
                out[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
                break  # (the job is broken after a collective failed)
    finally:
        strategy.close()
    return out


# --------------------------------------------- an optimizer replaced mid-training
def _worker_replaced(local: int) -> list[Any] | str:
    """Fine-tuning as usual: train the head, then unfreeze the body and build a new
    optimizer over everything. The old optimizer is garbage, but collected at another
    time on each worker (here: at once on worker 1, not yet on worker 0)."""
    strategy = small_bucket_strategy(local)
    worker = strategy.cluster_resolver.worker_index
    try:
        model = strategy.mirror(mlp())
        model[0].requires_grad_(False)
        opt = strategy.mirror_optimizer(model, sgd)
        topology = strategy.extended._parts.topology
        per = G // strategy.num_replicas_in_sync
        first = topology.worker_index * local
        kept = []
        for step in range(2 * STEPS):
            if step == STEPS:
                model[0].requires_grad_(True)
                if worker == 0:  # (as if its collection came later here)
                    kept.append(opt)
                opt = strategy.mirror_optimizer(model, sgd)
                if worker == 1:
                    gc.collect()
            x = global_x(step)
            parts = [x[(first + r) * per:(first + r + 1) * per] for r in range(local)]
            arg = mirrored.PerReplica(parts) if local > 1 else parts[0]
            strategy.run(body_plain, args=(model, opt, arg, step, Dist(False)))
        return [p.detach().clone().tolist() for p in model.replicas[0].parameters()]
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    finally:
        strategy.close()


def one_device_replaced() -> list[torch.Tensor]:
    model = mlp()
    model[0].requires_grad_(False)
    opt = sgd(list(model.parameters()))
    for step in range(2 * STEPS):
        if step == STEPS:
            model[0].requires_grad_(True)
            opt = sgd(list(model.parameters()))
        body_plain(model, opt, global_x(step), step, Dist(True))
    return [p.detach().clone() for p in model.parameters()]


def check_multi(local: int, name: str) -> None:
    results = mirrored.testing.run_multi_process(_worker_multi, 2, args=(local, [name]),
                                                 timeout=150)
    reference = one_device_multi(name)
    for worker, result in enumerate(results):
        got = result[name]
        assert not isinstance(got, str), f"worker {worker}: {got}"
        on, off, stats = got
        assert stats["buckets"] >= 2, stats
        for k, (a, b, ref) in enumerate(zip(on, off, reference, strict=True)):
            assert torch.equal(torch.tensor(a, dtype=D), torch.tensor(b, dtype=D)), k
            torch.testing.assert_close(torch.tensor(a, dtype=D), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("local", [1, 2])
@pytest.mark.parametrize("name", list(MULTI))
def test_two_optimizers_over_one_model_train_as_one_device(local: int, name: str) -> None:
    # Two mirrored optimizers (parts A and B of one model, Muon/AdamW-style; a GAN's G
    # and D) launched their buckets during backward independently: when `rare` (B) was
    # used on worker 0's rows only, worker 0 launched B's bucket mid-backward and worker
    # 1 at the end of its backward, after A's, so the workers' calls crossed:
    # CollectiveMismatchError at step 2 (with 2 local replicas also without `rare`,
    # from thread timing), where overlap=False trains. Now only the newest optimizer's
    # buckets launch during backward.
    check_multi(local, name)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("local", [1, 2])
def test_an_optimizer_replaced_mid_training_launches_no_more(local: int) -> None:
    # The old optimizer, still alive on worker 0 (kept, or not yet collected: a
    # MirroredOptimizer is in a reference cycle), went on launching its buckets during
    # backward there: CollectiveMismatchError at the first step of the new one.
    results = mirrored.testing.run_multi_process(_worker_replaced, 2, args=(local,),
                                                 timeout=100)
    reference = one_device_replaced()
    for result in results:
        assert not isinstance(result, str), result
        for a, ref in zip(result, reference, strict=True):
            torch.testing.assert_close(torch.tensor(a, dtype=D), ref, rtol=1e-10, atol=1e-10)


# ------------------------------------------ one worker's backward fails or is skipped
def _worker_fault(mode: str, overlap: bool | None) -> tuple[str, float, list[Any]]:
    strategy = small_bucket_strategy(1)
    worker = strategy.cluster_resolver.worker_index
    model = strategy.mirror(mlp())
    kwargs = {} if overlap is None else {"overlap": overlap}
    opt = strategy.mirror_optimizer(model, sgd, **kwargs)

    def step(x: torch.Tensor, index: int) -> None:
        loss = mirrored.compute_average_loss(sq(model(x)), global_batch_size=G)
        odd = worker == 1 and index == 2
        if odd and mode == "raise":  # e.g. a NaN check or a hook that raises in backward
            loss.register_hook(lambda g: (_ for _ in ()).throw(ValueError("bad gradient")))
        if odd and mode in ("skip_backward", "skip_all", "skip_then_log"):
            pass
        else:
            loss.backward()
        if odd and mode == "skip_all":
            return
        if mode == "skip_then_log":  # a metric all-reduced between backward and step
            mirrored.get_replica_context().all_reduce("SUM", loss.detach())
        opt.step()
        opt.zero_grad()

    outcome, start = "no error", time.monotonic()
    try:
        for index in range(STEPS):
            x = global_x(index)[worker * 4:(worker + 1) * 4]
            start = time.monotonic()
            strategy.run(step, args=(x, index))
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    seconds = time.monotonic() - start
    params = [p.detach().clone().tolist() for p in model.replicas[0].parameters()]
    strategy.close()
    return outcome, seconds, params


@pytest.mark.timeout(150)
def test_a_worker_whose_backward_fails_or_skips_raises_on_every_worker() -> None:
    outcomes = {}
    for mode in ("raise", "skip_all", "skip_backward", "skip_then_log"):
        for overlap in (None, False):
            outcomes[mode, overlap] = mirrored.testing.run_multi_process(
                _worker_fault, 2, args=(mode, overlap), timeout=60, grace=30)
    (zero, zero_s, _), (one, _, _) = outcomes["raise", None]
    assert one == "ValueError: bad gradient", one
    assert zero.startswith("CollectiveMismatchError: worker 1 left after"), zero
    assert "gradient bucket 1 of 3" in zero and zero_s < 10, (zero, zero_s)
    for outcome, seconds, _ in outcomes["skip_all", None]:
        assert outcome.startswith("CollectiveMismatchError: workers made different calls"), \
            outcome
        assert seconds < 10
    # A worker without backward (a skipped non-finite loss) adds zeros, as without overlap.
    for (on, _, p_on), (off, _, p_off) in zip(outcomes["skip_backward", None],
                                              outcomes["skip_backward", False], strict=True):
        assert on == off == "no error"
        assert all(torch.equal(torch.tensor(a), torch.tensor(b))
                   for a, b in zip(p_on, p_off, strict=True))
    # ... but with a collective before step() its peers' buckets, launched in backward,
    # meet that call (overlap=False trains): raised on both, saying why and what to do.
    for outcome, seconds, _ in outcomes["skip_then_log", None]:
        assert outcome.startswith("CollectiveMismatchError: workers made different calls"), \
            outcome
        assert "a worker skipped backward()" in outcome and "overlap=False" in outcome, outcome
        assert seconds < 10
    assert [o for o, _, _ in outcomes["skip_then_log", False]] == ["no error"] * 2


# --------------------- a collective inside backward and a parameter unused on one worker
class SyncBnRare(nn.Module):
    """Sync BatchNorm (a collective in backward too) under a head that only some rows
    reach (`global_x_rare`: worker 0's)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 8).to(D)
        self.bn = nn.BatchNorm1d(8).to(D)
        self.b = nn.Linear(8, 8).to(D)
        self.rare = nn.Linear(8, 8).to(D)
        self.c = nn.Linear(8, 3).to(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.b(self.bn(self.a(x))))
        mask = x[:, 0] > 1.0
        if bool(mask.any()):
            h = h.clone()
            h[mask] = torch.tanh(self.rare(h[mask]))
        return self.c(h)


def _worker_sync_bn(local: int, overlap: bool | None, checkpointed: bool
                    ) -> tuple[str, list[Any], dict[str, float] | None]:
    strategy = small_bucket_strategy(local)
    model = strategy.mirror(SyncBnRare(), sync_batch_norm=True)
    kwargs = {} if overlap is None else {"overlap": overlap}
    opt = strategy.mirror_optimizer(model, sgd, **kwargs)
    topology = strategy.extended._parts.topology
    per = G // strategy.num_replicas_in_sync
    first = topology.worker_index * local

    def step(x: torch.Tensor) -> None:
        if checkpointed:  # `b` in a reentrant checkpoint: reached in a nested backward
            h = torch.tanh(model.bn(model.a(x)))
            h = torch.utils.checkpoint.checkpoint(model.b, h, use_reentrant=True)
            out = model.c(torch.tanh(h))
        else:
            out = model(x)
        mirrored.compute_average_loss(sq(out), global_batch_size=G).backward()
        opt.step()
        opt.zero_grad()

    outcome = "no error"
    try:
        for index in range(2 * STEPS):
            x = global_x_rare(index)
            parts = [x[(first + r) * per:(first + r + 1) * per] for r in range(local)]
            strategy.run(step, args=(mirrored.PerReplica(parts) if local > 1 else parts[0],))
    except Exception as error:
        outcome = f"{type(error).__name__}: {error}"
    buckets = opt._reducer.buckets
    stats = None if buckets is None else dict(buckets.stats)
    params = [p.detach().clone().tolist() for p in model.replicas[0].parameters()]
    strategy.close()
    return outcome, params, stats


@pytest.mark.timeout(120)
@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("local", [1, 2])
def test_sync_batch_norm_with_a_head_unused_on_one_worker_trains(local: int,
                                                                 checkpointed: bool) -> None:
    # Worker 1's rows never reach `rare`: its bucket was completed (as zeros) at the end
    # of worker 1's backward, after sync BatchNorm's backward all-reduce, where worker 0
    # launched it mid-backward, before that all-reduce: CollectiveMismatchError at step
    # 2 ("gradient bucket 1 of 4 ... (asynchronous)" against "the backward pass of
    # ReplicaContext.all_reduce"), where overlap=False trained. Parameters a backward
    # will not reach are now counted in when it starts (DDP's find_unused_parameters).
    # `checkpointed`: `b`, reached in a nested backward, was counted in at the start of
    # the outer one: its bucket is redone once (exact), then that rule is off.
    on = mirrored.testing.run_multi_process(_worker_sync_bn, 2,
                                            args=(local, None, checkpointed), timeout=100)
    off = mirrored.testing.run_multi_process(_worker_sync_bn, 2,
                                             args=(local, False, checkpointed), timeout=100)
    for (outcome, params, stats), (outcome_off, params_off, _) in zip(on, off, strict=True):
        assert outcome == outcome_off == "no error", outcome
        assert stats is not None and stats["early"] > 0, stats
        assert stats["redone"] == (1 if checkpointed else 0), stats
        assert all(torch.equal(torch.tensor(a), torch.tensor(b))
                   for a, b in zip(params, params_off, strict=True))
