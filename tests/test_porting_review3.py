"""Review 3 of porting real training programs to `MirroredStrategy` (2 and 3 logical CPU
replicas), each against the same program on one device in plain torch, float64: a tiny
GPT (tied embedding, causal mask, AdamW with two groups, warmup + cosine LambdaLR,
clipping, gradient accumulation), a BatchNorm CNN with an EMA, a GAN, a checkpoint
resumed mid-training, and mixed precision with a GradScaler (enabled and disabled)."""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import mirrored

pytestmark = pytest.mark.timeout(180)
F64 = torch.float64


@pytest.fixture(params=[2, 3], ids=["2rep", "3rep"])
def strategy(request: pytest.FixtureRequest) -> Iterator[mirrored.MirroredStrategy]:
    made = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(request.param)])
    yield made
    made.close()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


def state_diff(a: Any, b: Any) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    return max((sa["state"][k][n].double() - v.double()).abs().max().item()
               for k in sb["state"] for n, v in sb["state"][k].items())


def shards(n: int, replicas: int) -> list[int]:
    """The rows each replica's shard gets from a global batch of ``n`` (chunks of
    ``ceil(n / replicas)``, the last ones shorter or empty)."""
    chunk = -(-n // replicas)
    return [max(0, min(chunk, n - i * chunk)) for i in range(replicas)]


# ----------------------------------------------------------------- 1. a tiny GPT
V, T, D, ACC = 13, 8, 16, 2


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Parameter(torch.randn(T, D) * 0.02)
        layer = nn.TransformerEncoderLayer(D, 2, 32, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.enc(self.tok(x) + self.pos[:t], mask=self.mask[:t, :t], is_causal=True)
        out: torch.Tensor = self.head(self.ln(h))
        return out


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT().double()


def make_adamw(params: Any) -> torch.optim.Optimizer:
    params = list(params)
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2],
                               "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2],
                               "weight_decay": 0.0}], lr=3e-3)


def warmup_cosine(step: int, warm: int = 3, total: int = 12) -> float:
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * (step - warm) / (total - warm)))


def lm_batches(steps: int, rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, V, (rows, T + 1), generator=g) for _ in range(steps * ACC)]
    return [(s[:, :-1], s[:, 1:]) for s in seqs]


def gpt_one_device(data: list[Any], clip: float, scaler: bool = False
                   ) -> tuple[GPT, Any, list[float], list[float]]:
    net = make_gpt()
    opt = make_adamw(net.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    losses, norms = [], []
    for i in range(0, len(data), ACC):
        total = 0.0
        for x, y in data[i:i + ACC]:
            loss = F.cross_entropy(net(x).reshape(-1, V), y.reshape(-1)) / ACC
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return net, opt, losses, norms


@pytest.mark.parametrize("rows", [6, 7, 2])
def test_gpt_with_accumulation_clipping_and_schedule_equals_one_device(
        strategy: mirrored.MirroredStrategy, rows: int) -> None:
    data = lm_batches(5, rows)  # 7 rows: uneven shards; 2 rows on 3 replicas: one empty
    model = strategy.mirror(make_gpt())
    optimizer = strategy.mirror_optimizer(model, make_adamw)
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)

    def train_step(x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor:
        per_token = F.cross_entropy(model(x).transpose(1, 2), y, reduction="none")
        loss = mirrored.compute_average_loss(per_token.mean(1)) / ACC
        loss.backward()
        if last:
            optimizer.step(clip_grad_norm=0.05)
            optimizer.zero_grad()
        return loss.detach()

    batches = list(strategy.experimental_distribute_dataset(data))
    losses = []
    for i in range(0, len(batches), ACC):
        total = 0.0
        for k in range(ACC):
            loss = strategy.run(train_step, args=(*batches[i + k], k == ACC - 1))
            total += float(strategy.reduce("SUM", loss, axis=None))
        sched.step()
        losses.append(total)
    net, opt, ref_losses, norms = gpt_one_device(data, 0.05)
    assert min(norms) > 0.05  # every step clipped
    for c in model.replicas:
        assert c.head.weight is c.tok.weight
        assert max_diff(c.state_dict(), net.state_dict()) < 1e-10
    assert state_diff(optimizer, opt) < 1e-10
    assert max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)) < 1e-12
    assert sched.get_last_lr() == [g["lr"] for g in opt.param_groups]


def test_gpt_clip_grad_norm_before_step_is_refused_naming_the_fix(
        strategy: mirrored.MirroredStrategy) -> None:
    model = strategy.mirror(make_gpt())
    optimizer = strategy.mirror_optimizer(model, make_adamw)
    before = copy.deepcopy(model.state_dict())

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        per_token = F.cross_entropy(model(x).transpose(1, 2), y, reduction="none")
        mirrored.compute_average_loss(per_token.mean(1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        optimizer.step()

    x, y = next(iter(strategy.experimental_distribute_dataset(lm_batches(1, 6))))
    with pytest.raises(mirrored.ReplicaDivergenceError,
                       match=r"clip_grad_norm_.*optimizer\.step\(clip_grad_norm=c\)"):
        strategy.run(train_step, args=(x, y))
    assert max_diff(model.state_dict(), before) == 0.0  # nothing stepped


class NanoGPTStyle(nn.Module):
    """A model whose own method builds its optimizer, as nanoGPT's does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.ln, self.b = nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(torch.tanh(self.ln(self.a(x))))
        return out

    def configure_optimizers(self) -> torch.optim.Optimizer:
        named = dict(self.named_parameters())
        return groups_by_name(list(named), list(named.values()))


def groups_by_name(names: list[str], params: list[nn.Parameter]) -> torch.optim.Optimizer:
    decay = [p for n, p in zip(names, params, strict=True) if not n.startswith("ln.")
             and p.dim() >= 2]
    rest = [p for n, p in zip(names, params, strict=True) if n.startswith("ln.")
            or p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                              {"params": rest, "weight_decay": 0.0}], lr=1e-2)


def test_optimizer_built_by_a_model_method_is_refused_and_names_work(
        strategy: mirrored.MirroredStrategy) -> None:
    model = strategy.mirror(NanoGPTStyle().double())
    with pytest.raises(ValueError, match=r"parameters it is given.*another module"):
        strategy.mirror_optimizer(model, lambda params: model.configure_optimizers())
    names = [n for n, _ in model.named_parameters()]  # the documented pairing
    optimizer = strategy.mirror_optimizer(model, lambda params: groups_by_name(names, params))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(7, 4, generator=g, dtype=F64), torch.randint(0, 3, (7,), generator=g))
            for _ in range(3)]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad()
        mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
        optimizer.step()

    for x, y in strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=(x, y))
    net = NanoGPTStyle().double()
    opt = net.configure_optimizers()
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
    assert max_diff(model.state_dict(), net.state_dict()) < 1e-12
    assert state_diff(optimizer, opt) < 1e-12


# ------------------------------------------------- 2. a BatchNorm CNN with an EMA
def make_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU(),
                         nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3),
                         nn.BatchNorm1d(3)).double()


def make_sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def make_ema(model: nn.Module) -> AveragedModel:
    return AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True)


def cnn_one_device(data: list[Any], test: Any, replicas: int, sync: bool, epochs: int
                   ) -> tuple[nn.Module, Any, AveragedModel, list[int], torch.Tensor]:
    """With ``sync=False`` each shard is normalized alone (a copy per shard) and the
    running statistics are the shards' mean: what the default documents."""
    net = make_cnn()
    opt = make_sgd(net.parameters())
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, [3, 6], 0.5)
    ema = make_ema(net)
    correct = []
    for _ in range(epochs):
        net.train()
        for x, y in data:
            opt.zero_grad()
            if sync:
                F.cross_entropy(net(x), y).backward()
            else:
                rows = shards(len(x), replicas)
                copies = [copy.deepcopy(net) for _ in rows]
                for c, xs, ys in zip(copies, x.split(rows), y.split(rows), strict=True):
                    (F.cross_entropy(c(xs), ys, reduction="sum") / len(x)).backward()
                for p, *ps in zip(net.parameters(), *[c.parameters() for c in copies],
                                  strict=True):
                    p.grad = sum(q.grad for q in ps)
                for name, b in net.named_buffers():
                    values = [dict(c.named_buffers())[name] for c in copies]
                    b.copy_(sum(values) / len(values) if b.is_floating_point() else values[0])
            opt.step()
            sched.step()
            ema.update_parameters(net)
        net.eval()
        ema.eval()
        with torch.no_grad():
            correct.append(int((net(test[0]).argmax(1) == test[1]).sum()))
            ema_out = ema(test[0])
    return net, opt, ema, correct, ema_out


@pytest.mark.parametrize("sync", [True, False], ids=["sync_bn", "default_bn"])
def test_cnn_batchnorm_ema_multisteplr_equals_one_device(
        strategy: mirrored.MirroredStrategy, sync: bool) -> None:
    n = strategy.num_replicas_in_sync
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(k, 1, 6, 6, generator=g, dtype=F64),
             torch.randint(0, 3, (k,), generator=g)) for k in (12, 12, 12, 7 if n == 2 else 8)]
    test = (torch.randn(9, 1, 6, 6, generator=g, dtype=F64), torch.randint(0, 3, (9,), generator=g))
    model = strategy.mirror(make_cnn(), sync_batch_norm=sync)
    optimizer = strategy.mirror_optimizer(model, make_sgd)
    sched = torch.optim.lr_scheduler.MultiStepLR(optimizer, [3, 6], 0.5)
    ema = make_ema(model)

    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per = F.cross_entropy(model(x), y, reduction="none")
        optimizer.zero_grad()
        mirrored.compute_average_loss(per).backward()
        optimizer.step()
        return per.detach()

    def eval_step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return (model(x).argmax(1) == y).sum(), ema(x)

    correct_in, correct_out = [], []
    for _ in range(3):
        model.train()
        for x, y in strategy.experimental_distribute_dataset(data):
            strategy.run(train_step, args=(x, y))
            sched.step()
            ema.update_parameters(model)
        model.eval()
        ema.eval()
        x, y = next(iter(strategy.experimental_distribute_dataset([test])))
        count, ema_part = strategy.run(eval_step, args=(x, y))
        correct_in.append(int(strategy.reduce("SUM", count)))
        ema_in = torch.cat(strategy.experimental_local_results(ema_part))
        with torch.no_grad():
            correct_out.append(int((model(test[0]).argmax(1) == test[1]).sum()))
            ema_out = ema(test[0])
    net, opt, ref_ema, correct, ref_ema_out = cnn_one_device(data, test, n, sync, 3)
    for c in model.replicas:
        assert max_diff(c.state_dict(), net.state_dict()) < 1e-12
    assert state_diff(optimizer, opt) < 1e-12
    assert max_diff(ema.state_dict(), ref_ema.state_dict()) < 1e-12
    assert correct_in == correct_out == correct
    assert (ema_in - ref_ema_out).abs().max() < 1e-12
    assert (ema_out - ref_ema_out).abs().max() < 1e-12
    assert sched.get_last_lr() == [g["lr"] for g in opt.param_groups]


# --------------------------------------------------------------------- 3. a GAN
Z = 3


def make_gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    return (nn.Sequential(nn.Linear(Z, 8), nn.Tanh(), nn.Linear(8, 2)).double(),
            nn.Sequential(nn.Linear(2, 8), nn.Tanh(), nn.Linear(8, 1)).double())


def make_adam_g(p: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(p, lr=1e-2, betas=(0.5, 0.999))


def make_adam_d(p: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(p, lr=2e-2, betas=(0.5, 0.999))


def gan_losses(gen: Callable[..., torch.Tensor], disc: Callable[..., torch.Tensor],
               real: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
    fake = gen(z)
    ones = torch.ones(len(real), 1, dtype=F64)
    per_d = (F.binary_cross_entropy_with_logits(disc(real), ones, reduction="none")
             + F.binary_cross_entropy_with_logits(disc(fake.detach()), 1 - ones,
                                                  reduction="none"))[:, 0]
    return per_d, ones, fake


@pytest.mark.parametrize("variant", ["plain", "no_zero_grad_d", "freeze_d"])
def test_gan_two_optimizers_equals_one_device(strategy: mirrored.MirroredStrategy,
                                              variant: str) -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(k, 2, generator=g, dtype=F64) + 1, torch.randn(k, Z, generator=g,
                                                                        dtype=F64))
            for k in (8, 8, 8, 5)]
    gen, disc = (strategy.mirror(m) for m in make_gan())
    opt_g, opt_d = strategy.mirror_optimizer(gen, make_adam_g), strategy.mirror_optimizer(
        disc, make_adam_d)

    def step(real: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        per_d, ones, fake = gan_losses(gen, disc, real, z)
        d_loss = mirrored.compute_average_loss(per_d)
        if variant != "no_zero_grad_d":  # else D's step also takes G's step's leftovers
            opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        if variant == "freeze_d":
            disc.requires_grad_(False)
        per_g = F.binary_cross_entropy_with_logits(disc(fake), ones, reduction="none")[:, 0]
        g_loss = mirrored.compute_average_loss(per_g)
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        if variant == "freeze_d":
            disc.requires_grad_(True)
        return d_loss.detach(), g_loss.detach()

    logs = []
    for real, z in strategy.experimental_distribute_dataset(data):
        d_l, g_l = strategy.run(step, args=(real, z))
        logs.append((float(strategy.reduce("SUM", d_l, axis=None)),
                     float(strategy.reduce("SUM", g_l, axis=None))))
    ref_g, ref_d = make_gan()
    ref_og, ref_od = make_adam_g(ref_g.parameters()), make_adam_d(ref_d.parameters())
    ref_logs = []
    for real, z in data:
        per_d, ones, fake = gan_losses(ref_g, ref_d, real, z)
        d_loss = per_d.mean()
        if variant != "no_zero_grad_d":
            ref_od.zero_grad()
        d_loss.backward()
        ref_od.step()
        ref_d.requires_grad_(variant != "freeze_d")
        g_loss = F.binary_cross_entropy_with_logits(ref_d(fake), ones)
        ref_og.zero_grad()
        g_loss.backward()
        ref_og.step()
        ref_d.requires_grad_(True)
        ref_logs.append((d_loss.item(), g_loss.item()))
    for mine, ref in ((gen, ref_g), (disc, ref_d)):
        for c in mine.replicas:
            assert max_diff(c.state_dict(), ref.state_dict()) < 1e-13
    assert state_diff(opt_g, ref_og) < 1e-13 and state_diff(opt_d, ref_od) < 1e-13
    assert max(abs(a - b) for x, y in zip(logs, ref_logs, strict=True)
               for a, b in zip(x, y, strict=True)) < 1e-13


def wgan_gp_critic_terms(gen: Callable[..., torch.Tensor], disc: Callable[..., torch.Tensor],
                         real: torch.Tensor, z: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The critic's per-example WGAN-GP loss: a double backward through the critic."""
    fake = gen(z).detach()
    mixed = (eps * real + (1 - eps) * fake).requires_grad_(True)
    (grad,) = torch.autograd.grad(disc(mixed).sum(), mixed, create_graph=True)
    out: torch.Tensor = disc(fake)[:, 0] - disc(real)[:, 0] + 10 * (grad.norm(dim=1) - 1) ** 2
    return out


def test_wgan_gp_gradient_penalty_equals_one_device(strategy: mirrored.MirroredStrategy) -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(k, 2, generator=g, dtype=F64) + 1,
             torch.randn(k, Z, generator=g, dtype=F64), torch.rand(k, 1, generator=g, dtype=F64))
            for k in (8, 8, 8, 5)]

    def make_opt(p: Any) -> torch.optim.Optimizer:
        return torch.optim.Adam(p, lr=1e-2, betas=(0.0, 0.9))

    gen, disc = (strategy.mirror(m) for m in make_gan())
    opt_g, opt_d = strategy.mirror_optimizer(gen, make_opt), strategy.mirror_optimizer(
        disc, make_opt)

    def step(real: torch.Tensor, z: torch.Tensor, eps: torch.Tensor) -> None:
        opt_d.zero_grad()
        mirrored.compute_average_loss(wgan_gp_critic_terms(gen, disc, real, z, eps)).backward()
        opt_d.step()
        opt_g.zero_grad()
        mirrored.compute_average_loss(-disc(gen(z))[:, 0]).backward()
        opt_g.step()

    for batch in strategy.experimental_distribute_dataset(data):
        strategy.run(step, args=batch)
    ref_g, ref_d = make_gan()
    ref_og, ref_od = make_opt(ref_g.parameters()), make_opt(ref_d.parameters())
    for real, z, eps in data:
        ref_od.zero_grad()
        wgan_gp_critic_terms(ref_g, ref_d, real, z, eps).mean().backward()
        ref_od.step()
        ref_og.zero_grad()
        (-ref_d(ref_g(z))).mean().backward()
        ref_og.step()
    for mine, ref in ((gen, ref_g), (disc, ref_d)):
        for c in mine.replicas:
            assert max_diff(c.state_dict(), ref.state_dict()) < 1e-13
    assert state_diff(opt_g, ref_og) < 1e-13 and state_diff(opt_d, ref_od) < 1e-13


# ------------------------------------------------------- 4. checkpoint and resume
class Run:
    """The GPT program with a GradScaler (scale 2**k: exact) and an EMA, on n replicas."""

    def __init__(self, replicas: int, data: list[Any]) -> None:
        self.strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
        self.model = strategy_model = self.strategy.mirror(make_gpt())
        self.optimizer = optimizer = self.strategy.mirror_optimizer(strategy_model, make_adamw)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6, growth_interval=2)
        self.ema = AveragedModel(strategy_model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        self.batches = list(self.strategy.experimental_distribute_dataset(data))

        def train_step(x: torch.Tensor, y: torch.Tensor, last: bool) -> None:
            per_token = F.cross_entropy(strategy_model(x).transpose(1, 2), y, reduction="none")
            self.scaler.scale(mirrored.compute_average_loss(per_token.mean(1)) / ACC).backward()
            if last:
                self.scaler.step(optimizer, clip_grad_norm=0.05)
                self.scaler.update()
                optimizer.zero_grad()

        self.train_step = train_step

    def objects(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler,
                "scaler": self.scaler, "ema": self.ema}

    def train(self, steps: range) -> None:
        for s in steps:
            for k in range(ACC):
                self.strategy.run(self.train_step, args=(*self.batches[s * ACC + k],
                                                         k == ACC - 1))
            self.scheduler.step()
            self.ema.update_parameters(self.model)


@pytest.mark.parametrize(("before", "after", "how"), [(2, 2, "manager"), (3, 3, "torch.save"),
                                                      (2, 3, "manager"), (3, 2, "torch.save")])
def test_checkpoint_mid_training_then_resume_equals_uninterrupted(
        tmp_path: Path, before: int, after: int, how: str) -> None:
    data = lm_batches(6, 6)
    full = Run(before, data)
    full.train(range(6))
    first = Run(before, data)
    first.train(range(3))
    if how == "manager":
        mirrored.CheckpointManager(first.strategy, tmp_path).save(3, first.objects())
    else:
        torch.save({k: v.state_dict() for k, v in first.objects().items()}, tmp_path / "c.pt")
    first.strategy.close()
    second = Run(after, data)
    if how == "manager":
        step = mirrored.CheckpointManager(second.strategy, tmp_path).restore(second.objects())
    else:
        saved = torch.load(tmp_path / "c.pt", weights_only=True)
        for name, obj in second.objects().items():
            obj.load_state_dict(saved[name])
        step = 3
    assert step == 3
    second.train(range(3, 6))
    tol = 0.0 if before == after else 1e-12  # another replica count: rounding only
    for c in second.model.replicas:
        assert c.head.weight is c.tok.weight
        assert max_diff(c.state_dict(), full.model.state_dict()) <= tol
    assert state_diff(second.optimizer, full.optimizer) <= tol
    assert max_diff(second.ema.state_dict(), full.ema.state_dict()) <= tol
    assert second.scheduler.state_dict() == full.scheduler.state_dict()
    assert second.scaler.state_dict() == full.scaler.state_dict()
    assert full.scaler.get_scale() > 2.0 ** 6  # the scale grew: its state mattered
    net, _, _, _ = gpt_one_device(data, 0.05)  # and both are one device's
    assert max_diff(full.model.state_dict(), net.state_dict()) < 1e-10
    second.strategy.close()
    full.strategy.close()


@pytest.mark.parametrize("replicas", [2, 3])
def test_one_device_checkpoint_resumed_on_replicas_equals_one_device(replicas: int) -> None:
    """A port picks up a checkpoint of the one-device run (plain state dicts) mid-way."""
    data = lm_batches(6, 6)
    net = make_gpt()
    opt = make_adamw(net.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    saved: dict[str, Any] = {}
    for s in range(6):
        if s == 3:
            saved = copy.deepcopy({"model": net.state_dict(), "optimizer": opt.state_dict(),
                                   "scheduler": sched.state_dict()})
        for x, y in data[s * ACC:(s + 1) * ACC]:
            (F.cross_entropy(net(x).reshape(-1, V), y.reshape(-1)) / ACC).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)
        opt.step()
        sched.step()
        opt.zero_grad()
    run = Run(replicas, data)
    try:
        run.scaler = torch.amp.GradScaler("cpu", enabled=False)  # (the plain run had none)
        for name in ("model", "optimizer", "scheduler"):
            run.objects()[name].load_state_dict(saved[name])
        run.train(range(3, 6))
        for c in run.model.replicas:
            assert max_diff(c.state_dict(), net.state_dict()) < 1e-10
        assert state_diff(run.optimizer, opt) < 1e-10
        assert run.scheduler.state_dict() == sched.state_dict()
    finally:
        run.strategy.close()


# -------------------------------------------------------- 5. autocast + GradScaler
def make_mlp(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.LayerNorm(16), nn.GELU(),
                         nn.Linear(16, 3)).to(dtype)


@pytest.mark.parametrize("where", ["inside", "around_run"])
def test_bfloat16_autocast_with_scaler_trains_as_one_device(
        strategy: mirrored.MirroredStrategy, where: str) -> None:
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(k, 5, generator=g), torch.randint(0, 3, (k,), generator=g))
            for k in (12, 12, 12, 7)]
    model = strategy.mirror(make_mlp())
    optimizer = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.dtype:
        optimizer.zero_grad()
        inner = (torch.autocast("cpu", dtype=torch.bfloat16) if where == "inside"
                 else contextlib.nullcontext())  # around_run: entered around strategy.run
        with inner:
            out = model(x)
            loss = mirrored.compute_average_loss(F.cross_entropy(out, y, reduction="none"))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return out.dtype

    for x, y in strategy.experimental_distribute_dataset(data):
        if where == "inside":
            dtypes = strategy.run(step, args=(x, y))
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                dtypes = strategy.run(step, args=(x, y))
        assert set(strategy.experimental_local_results(dtypes)) == {torch.bfloat16}
    net = make_mlp()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for x, y in data:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(x), y)
        ref_scaler.scale(loss).backward()
        ref_scaler.step(opt)
        ref_scaler.update()
    assert scaler.get_scale() == ref_scaler.get_scale()
    assert max_diff(model.state_dict(), net.state_dict()) < 2e-3  # bfloat16's rounding


@pytest.mark.parametrize("clip", ["unscale_then_clip", "step_clip"])
def test_scaler_overflow_on_one_replica_and_logged_norm_equal_one_device(
        strategy: mirrored.MirroredStrategy, clip: str) -> None:
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(k, 5, generator=g, dtype=F64), torch.randint(0, 3, (k,), generator=g))
            for k in (12, 12, 12, 12, 7)]
    data[1][0][-1, 0] = float("inf")  # in the last replica's shard only
    model = strategy.mirror(make_mlp(F64))
    optimizer = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.1,
                                                                             momentum=0.9))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    sched = torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        scaler.scale(loss).backward()
        norm = torch.zeros((), dtype=F64)
        if clip == "unscale_then_clip":
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3)
            scaler.step(optimizer)
        else:
            scaler.step(optimizer, clip_grad_norm=0.3)
        scaler.update()
        return norm

    scales, norms = [], []
    for x, y in strategy.experimental_distribute_dataset(data):
        norm = strategy.experimental_local_results(strategy.run(step, args=(x, y)))
        assert len({float(v) for v in norm if not v.isnan()}) <= 1  # alike
        norms.append(float(norm[0]))
        sched.step()
        scales.append(scaler.get_scale())
    net = make_mlp(F64)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    ref_sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    ref_scales, ref_norms = [], []
    for x, y in data:
        opt.zero_grad()
        ref_scaler.scale(F.cross_entropy(net(x), y)).backward()
        ref_scaler.unscale_(opt)
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.3)))
        ref_scaler.step(opt)
        ref_scaler.update()
        ref_sched.step()
        ref_scales.append(ref_scaler.get_scale())
    assert scales == ref_scales and ref_scales[1] == 2.0 ** 7  # one skip, one back-off
    if clip == "unscale_then_clip":
        assert math.isnan(norms[1]) and math.isnan(ref_norms[1])
        pairs = zip(norms, ref_norms, strict=True)
        assert max(abs(a - b) for i, (a, b) in enumerate(pairs) if i != 1) < 1e-13
    assert max_diff(model.state_dict(), net.state_dict()) < 1e-13
    assert state_diff(optimizer, opt) < 1e-13


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_disabled_scaler_unscale_then_clip_is_the_global_clip(replicas: int) -> None:
    """nanoGPT's loop keeps ``GradScaler(enabled=(dtype == 'float16'))``: in bfloat16 or
    float32 the scaler is disabled, and ``scaler.unscale_(optimizer);
    clip_grad_norm_(model.parameters(), c)`` runs as written. Its ``unscale_`` all-reduces
    as an enabled one's does, so the clipping is one device's (it was refused as a local
    clip, with a message telling to call ``unscale_`` first: what the loop did)."""
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(replicas)])
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(k, 5, generator=g, dtype=F64), torch.randint(0, 3, (k,), generator=g))
            for k in (9, 9, 5)]
    model = strategy.mirror(make_mlp(F64))
    optimizer = strategy.mirror_optimizer(model, lambda p: torch.optim.SGD(p, lr=0.5,
                                                                             momentum=0.9))
    scaler = torch.amp.GradScaler("cpu", enabled=False)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad()
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.unscale_(optimizer)  # a second call: nothing more (torch's disabled scaler)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)
        scaler.step(optimizer)
        scaler.update()
        return norm

    try:
        norms = [strategy.experimental_local_results(strategy.run(step, args=b))
                 for b in strategy.experimental_distribute_dataset(data)]
    finally:
        strategy.close()
    net = make_mlp(F64)
    opt = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    ref_norms = []
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.2)))
        opt.step()
    assert min(ref_norms) > 0.2  # every step clipped
    for mine, ref in zip(norms, ref_norms, strict=True):
        assert all(abs(float(v) - ref) < 1e-13 for v in mine)
    for c in model.replicas:
        assert max_diff(c.state_dict(), net.state_dict()) < 1e-13
    assert state_diff(optimizer, opt) < 1e-13


@pytest.mark.parametrize("call", ["save", "restore"])
def test_checkpoint_manager_inside_run_is_refused_naming_it(
        strategy: mirrored.MirroredStrategy, tmp_path: Path, call: str) -> None:
    """It said "MirroredStrategy.reduce requires cross-replica context", an internal call."""
    model = strategy.mirror(make_mlp(F64))
    manager = mirrored.CheckpointManager(strategy, tmp_path)

    def step() -> None:
        if call == "save":
            manager.save(1, {"model": model})
        else:
            manager.restore({"model": model})

    with pytest.raises(RuntimeError, match=rf"CheckpointManager\.{call} was called inside "
                                           r"strategy\.run.*after strategy\.run returns"):
        strategy.run(step)
    assert manager.steps() == []
    manager.save(1, {"model": model})  # in the loop it works
    assert manager.restore({"model": model}) == 1
