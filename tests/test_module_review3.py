"""Review of a mirrored model used as a torch model: parametrizations, RNNs, shared
submodules, non-persistent buffers, hooks and ``vector_to_parameters``, each trained on
2 and 3 replicas and compared with one device in float64 (parameters, buffers, outputs)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parameters_to_vector, parametrizations, vector_to_parameters

import mirrored

Edit = Callable[[nn.Module], object]


def _batches(seq: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (6, seq, 4) if seq else (6, 4)
    return [(torch.randn(*shape, generator=g, dtype=torch.float64),
             torch.randint(0, 3, (6,), generator=g)) for _ in range(3)]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[:, -1] if out.dim() == 3 else out, y, reduction="none")


def _compare(make: Callable[[], nn.Module], n: int, *, seq: int | None = None,
             before: Edit | None = None, after: Edit | None = None) -> None:
    """Trains ``make()`` on one device (``before`` applied) and mirrored on ``n``
    replicas (``after`` applied to the mirrored model), and compares them."""
    data = _batches(seq)
    net = make()
    if before is not None:
        before(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    expected = []
    for x, y in data:
        out = net(x)
        expected.append(out.detach())
        opt.zero_grad()
        _loss(out, y).mean().backward()
        opt.step()
    strategy = mirrored.MirroredStrategy([f"CPU:{i}" for i in range(n)])
    try:
        model = strategy.mirror(make())
        if after is not None:
            after(model)
        mopt = strategy.mirror_optimizer(
            model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = model(x)
            mopt.zero_grad()
            mirrored.compute_average_loss(_loss(out, y)).backward()
            mopt.step()
            return out.detach()

        outs = [torch.cat(list(strategy.run(step, args=batch).values))
                for batch in strategy.experimental_distribute_dataset(data)]
        for a, b in zip(outs, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        for k, c in enumerate(model.replicas):
            mine = dict(c.named_buffers())
            for name, value in [*net.state_dict().items(), *net.named_buffers()]:
                got = c.state_dict()[name] if name in c.state_dict() else mine[name]
                torch.testing.assert_close(got, value, rtol=0, atol=1e-12,
                                           msg=lambda m, k=k, name=name: f"{k} {name}: {m}")
    finally:
        strategy.close()


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


class _Rnn(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(4, 5, num_layers=2, batch_first=True,
                                     bidirectional=True, dropout=0.0)
        self.fc = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rnn.flatten_parameters()
        return self.fc(self.rnn(x)[0])


class _Buffers(nn.Module):
    """Non-persistent buffers (an EMA, a counter, a constant) and a shared submodule."""

    def __init__(self) -> None:
        super().__init__()
        core = nn.Linear(4, 4)
        self.a, self.b = nn.Sequential(core, nn.Tanh()), nn.Sequential(core, nn.Sigmoid())
        self.fc = nn.Linear(4, 3)
        self.register_buffer("ema", torch.zeros(4), persistent=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long), persistent=False)
        self.register_buffer("scale", torch.full((3,), 0.5), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * x.mean(0))
            self.steps += 1
        return self.fc(self.a(x) + self.b(x)) * self.scale


def _spectral(m: nn.Module) -> None:
    if isinstance(m, nn.Linear) and m.in_features == m.out_features:
        parametrizations.spectral_norm(m)


def _make(kind: str) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        if kind in ("LSTM", "GRU"):
            torch.manual_seed(0)
            return _Rnn(kind).double()
        if kind == "buffers":
            torch.manual_seed(0)
            return _Buffers().double()
        net = _mlp()
        if kind == "weight_norm":
            parametrizations.weight_norm(net[2])
        elif kind == "spectral_norm":  # (its u, v buffers iterate in every train forward)
            parametrizations.spectral_norm(net[2])
        return net
    return make


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "LSTM", "GRU", "buffers"])
def test_torch_features_train_as_one_device(kind: str, n: int) -> None:
    _compare(_make(kind), n, seq=5 if kind in ("LSTM", "GRU") else None)


@pytest.mark.timeout(60)
def test_a_parametrization_applied_through_the_mirrored_model_is_one_devices() -> None:
    # model.apply(spectral_norm) after mirror: replica 0's random u, v on every copy
    _compare(_mlp, 3, before=lambda m: m.apply(_spectral), after=lambda m: m.apply(_spectral))


@pytest.mark.timeout(60)
def test_hooks_on_the_mirrored_model_run_on_every_copy_as_on_one_device() -> None:
    def hooks(m: nn.Module) -> None:
        m.register_forward_pre_hook(lambda mod, a: (a[0] * 2,))
        m.register_forward_hook(lambda mod, a, o: o + 1)
    _compare(_mlp, 3, before=hooks, after=hooks)


_HOOKS: dict[str, Edit] = {
    "forward_pre": lambda m: m.register_forward_pre_hook(lambda mod, a: (a[0] * 2,)),
    "forward": lambda m: m.register_forward_hook(lambda mod, a, o: o * 2),
    "backward": lambda m: m.register_full_backward_hook(lambda mod, gi, go: (gi[0] * 0.5,)),
    "backward_pre": lambda m: m.register_full_backward_pre_hook(lambda mod, g: (g[0] * 3,)),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", sorted(_HOOKS))
def test_a_hook_registered_through_a_submodule_is_refused(kind: str) -> None:
    # model[2].register_...: replica 0's copy alone ran the hook, the copies stayed equal
    # and trained another model than one device (silently)
    with pytest.raises(RuntimeError, match=r"submodule '2' has 1 .*hook.* on replica 0's copy "
                       r"and 0 on replica 1's(.|\n)*get_submodule\('2'\)"):
        _compare(_mlp, 2, before=lambda m: _HOOKS[kind](m[2]),
                 after=lambda m: _HOOKS[kind](m[2]))


@pytest.mark.timeout(60)
def test_a_hook_registered_on_every_copy_is_one_devices() -> None:
    def each(model: nn.Module) -> None:
        for c in model.replicas:
            _HOOKS["backward_pre"](c[2])
    _compare(_mlp, 3, before=lambda m: _HOOKS["backward_pre"](m[2]), after=each)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_vector_to_parameters_outside_run_reaches_every_copy(n: int) -> None:
    # it replaces each parameter's .data (no version counter moves): replica 0 alone took
    # the values, and the divergence check raised at its next checked step
    def halve(m: nn.Module) -> None:
        vector_to_parameters(parameters_to_vector(m.parameters()) * 0.5, m.parameters())
    _compare(_mlp, n, before=halve, after=halve)
