"""Review of a mirrored model used as a torch model (3 replicas against one device in
plain PyTorch, float64 unless about dtypes): dtype conversions after mirror,
``zero_grad``, ``torch.func``, conv-BN fusion, names and identities, buffers,
parameters and submodules registered through a submodule, parametrizations."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils import parametrizations
from torch.nn.utils.fusion import fuse_conv_bn_eval

import mirrored

pytestmark = pytest.mark.timeout(120)
DEVICES = ["CPU:0", "CPU:1", "CPU:2"]


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


def _data(shape: tuple[int, ...] = (6, 4), classes: int = 3
          ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(*shape, generator=g, dtype=torch.float64),
             torch.randint(0, classes, (shape[0],), generator=g)) for _ in range(3)]


def _train(make: Callable[[], nn.Module], edit: Callable[[nn.Module], object] | None = None,
           *, optimizer_first: bool = False, data: list[tuple[torch.Tensor, torch.Tensor]]
           | None = None) -> tuple[nn.Module, nn.Module]:
    """Trains ``make()`` on one device and mirrored on 3 replicas, ``edit`` applied after
    mirror (before or after the optimizer is built); returns both."""
    data = _data() if data is None else data

    def sgd(p: object) -> torch.optim.Optimizer:
        return torch.optim.SGD(p, lr=0.1, momentum=0.9)  # type: ignore[arg-type]

    net = make()
    opt = sgd(net.parameters()) if optimizer_first else None
    if edit is not None:
        edit(net)
    opt = opt or sgd(net.parameters())
    for x, y in data:
        out = net(x.to(next(net.parameters()).dtype))
        opt.zero_grad()
        F.cross_entropy(out.double(), y).backward()
        opt.step()
    strategy = mirrored.MirroredStrategy(DEVICES)
    try:
        model = strategy.mirror(make())
        mopt = strategy.mirror_optimizer(model, sgd) if optimizer_first else None
        if edit is not None:
            edit(model)
        mopt = mopt or strategy.mirror_optimizer(model, sgd)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            out = model(x.to(next(model.parameters()).dtype))
            mopt.zero_grad()
            mirrored.compute_average_loss(
                F.cross_entropy(out.double(), y, reduction="none")).backward()
            mopt.step()

        for batch in strategy.experimental_distribute_dataset(data):
            strategy.run(step, args=batch)
    finally:
        strategy.close()
    return net, model


def _same(net: nn.Module, model: nn.Module, atol: float = 1e-12) -> None:
    for k, c in enumerate(model.replicas):  # type: ignore[arg-type]
        assert list(c.state_dict()) == list(net.state_dict())
        for name, v in net.state_dict().items():
            got = c.state_dict()[name]
            assert got.dtype == v.dtype, (k, name)
            torch.testing.assert_close(got.double(), v.double(), rtol=0, atol=atol,
                                       msg=lambda m, k=k, name=name: f"{k} {name}: {m}")


# 1. dtype conversions after mirror ------------------------------------------------------
@pytest.mark.parametrize("optimizer_first", [False, True])
@pytest.mark.parametrize(("convert", "atol"), [
    (lambda m: m.float().double(), 1e-12), (lambda m: m.float(), 1e-6),
    (lambda m: m.half(), 2e-3), (lambda m: m.to(torch.bfloat16), 1e-2)],
    ids=["double", "float", "half", "bfloat16"])
def test_a_dtype_conversion_after_mirror_converts_every_copy(
        convert: Callable[[nn.Module], object], atol: float, optimizer_first: bool) -> None:
    # (low precision: the replicas' gradients are summed in another order than one device's)
    net, model = _train(_mlp, convert, optimizer_first=optimizer_first)
    _same(net, model, atol)


def test_a_dtype_conversion_through_a_submodule_is_refused() -> None:
    strategy = mirrored.MirroredStrategy(DEVICES)
    try:
        model = strategy.mirror(_mlp())
        model[2].float()  # (replica 0's copy alone)
        with pytest.raises(RuntimeError, match=r"parameter '2.weight' is float32\[8, 8\] on "
                           r"replica 0's copy and float64\[8, 8\] on replica 1's"):
            strategy.run(lambda: None)
    finally:
        strategy.close()


# 2. zero_grad ------------------------------------------------------------------------------
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_on_the_mirrored_model_inside_and_outside_run(set_to_none: bool) -> None:
    data = _data()
    net = _mlp()
    F.cross_entropy(net(data[0][0]), data[0][1]).backward()
    net.zero_grad(set_to_none)  # (a first backward discarded, a second one kept)
    F.cross_entropy(net(data[1][0]), data[1][1]).backward()
    strategy = mirrored.MirroredStrategy(DEVICES)
    try:
        model = strategy.mirror(_mlp())
        batches = list(strategy.experimental_distribute_dataset(data[:2]))

        def backward(x: torch.Tensor, y: torch.Tensor) -> None:
            mirrored.compute_average_loss(
                F.cross_entropy(model(x), y, reduction="none")).backward()

        strategy.run(backward, args=batches[0])
        model.zero_grad(set_to_none)  # outside run: every copy
        for c in model.replicas:
            assert all((p.grad is None) if set_to_none else not p.grad.any()
                       for p in c.parameters())
        strategy.run(backward, args=batches[0])
        strategy.run(lambda: model.zero_grad(set_to_none))  # inside: each its own
        for c in model.replicas:
            assert all((p.grad is None) if set_to_none else not p.grad.any()
                       for p in c.parameters())
        strategy.run(backward, args=batches[1])
        for name, p in net.named_parameters():  # the replicas' gradients sum to one device's
            got = sum(c.get_parameter(name).grad for c in model.replicas)
            torch.testing.assert_close(got, p.grad, rtol=0, atol=1e-12)
    finally:
        strategy.close()


# 3. torch.func ------------------------------------------------------------------------------
def _example_loss(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                  m: nn.Module) -> torch.Tensor:
    return F.cross_entropy(functional_call(m, params, (x[None],)), y[None])


def test_torch_func_over_the_mirrored_model_inside_and_outside_run() -> None:
    (x, y), net = _data()[0], _mlp()
    doubled = {k: v * 2 for k, v in net.named_parameters()}
    per_example = vmap(grad(_example_loss), in_dims=(None, 0, 0, None))(
        {k: v.detach() for k, v in net.named_parameters()}, x, y, net)
    strategy = mirrored.MirroredStrategy(DEVICES)
    try:
        model = strategy.mirror(_mlp())
        batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))

        def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, object]:
            params = {k: v.detach() for k, v in model.named_parameters()}
            return (functional_call(model, dict(model.named_parameters()), (x,)),
                    vmap(grad(_example_loss), in_dims=(None, 0, 0, None))(params, x, y, model))

        out, grads = strategy.run(step, args=batch)
        torch.testing.assert_close(torch.cat(list(out.values)), net(x), rtol=0, atol=0)
        for name, g in per_example.items():
            torch.testing.assert_close(torch.cat(list(grads[name].values)), g, rtol=0, atol=0)
        outside = {k: v * 2 for k, v in model.named_parameters()}
        torch.testing.assert_close(functional_call(model, outside, (x,)),
                                   functional_call(net, doubled, (x,)), rtol=0, atol=0)
    finally:
        strategy.close()


# 4. conv-BN fusion outside run --------------------------------------------------------------
class _ConvBn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.bn(self.conv(x)).mean((2, 3)))


def _conv_bn() -> nn.Module:
    torch.manual_seed(0)
    net = _ConvBn().double()
    with torch.no_grad():
        net.bn.running_mean.uniform_()
        net.bn.running_var.uniform_(0.5, 2)
    return net


def test_fuse_conv_bn_eval_assigned_back_reaches_every_copy() -> None:
    def fuse(m: nn.Module) -> None:
        m.eval()
        m.conv = fuse_conv_bn_eval(m.conv, m.bn)  # type: ignore[arg-type]
        m.bn = nn.Identity()
    net, model = _train(_conv_bn, fuse, data=_data((6, 2, 5, 5), 2))
    _same(net, model)
    ptrs = {c.conv.weight.data_ptr() for c in model.replicas}
    assert len(ptrs) == 3


# 5. names and identities ------------------------------------------------------------------
class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(5, 4), nn.Linear(4, 5, bias=False)
        self.head.weight = self.emb.weight
        self.bn = nn.BatchNorm1d(4)
        self.again = self.bn
        self.register_buffer("c", torch.ones(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.again(self.emb(x)))


def _layout(m: nn.Module) -> list[object]:
    ids: dict[int, int] = {}

    def canon(t: object) -> int:
        return ids.setdefault(id(t), len(ids))
    return [[(n, canon(p)) for n, p in m.named_parameters(remove_duplicate=False)],
            [(n, canon(b)) for n, b in m.named_buffers(remove_duplicate=False)],
            [(n, canon(b)) for n, b in m.named_buffers()],
            [(n, canon(v), type(v)) for n, v in m.state_dict(keep_vars=True).items()]]


def test_names_and_identities_are_one_devices_layout() -> None:
    torch.manual_seed(0)
    expected = _layout(_Tied().double())
    strategy = mirrored.MirroredStrategy(DEVICES)
    try:
        torch.manual_seed(0)
        model = strategy.mirror(_Tied().double())
        assert _layout(model) == expected

        def inside() -> bool:
            ctx = mirrored.get_replica_context()
            own = model.replicas[ctx.replica_id_in_sync_group]
            mine = model.state_dict(keep_vars=True)
            return _layout(model) == expected and all(
                v is own.state_dict(keep_vars=True)[n] for n, v in mine.items())

        assert all(getattr(strategy.run(inside), "values", [True]))
        first = model.replicas[0].state_dict(keep_vars=True)
        assert all(v is first[n] for n, v in model.state_dict(keep_vars=True).items())
    finally:
        strategy.close()


# 6. registrations through a submodule -------------------------------------------------------
class _Scaled(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (uses the buffer if registered)
        for m in self:
            x = m(x) * getattr(m, "scale", 1.0)
        return x


def _scaled() -> nn.Module:
    torch.manual_seed(0)
    return _Scaled(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                   nn.Linear(8, 3)).double()


@pytest.mark.parametrize("persistent", [True, False])
def test_a_buffer_registered_through_a_submodule_reaches_every_copy(persistent: bool) -> None:
    # replica 0's copy alone took it: the step raised "a tensor present on some replicas
    # only" (CollectiveMismatchError, not naming the cause or the fix)
    def add(m: nn.Module) -> None:
        m[3].register_buffer("scale", torch.full((8,), 0.5, dtype=torch.float64),
                             persistent=persistent)
    net, model = _train(_scaled, add)
    _same(net, model)
    for c in model.replicas:
        assert ("3.scale" in c.state_dict()) is persistent
        assert "3.scale" in dict(c.named_buffers())


def test_a_buffer_registered_through_an_old_reference_is_refused_naming_the_fix() -> None:
    strategy = mirrored.MirroredStrategy(DEVICES)
    try:
        model = strategy.mirror(_scaled())
        sub = model[3]
        strategy.run(lambda: None)  # (the run takes what happened to replica 0's copy so far)
        sub.register_buffer("scale", torch.ones(8, dtype=torch.float64))
        with pytest.raises(RuntimeError, match=r"submodule '3' has buffer 'scale' on replica "
                           r"0's copy and replica 1's lacks it(.|\n)*copy.get_submodule\('3'\)"
                           r".register_buffer"):
            strategy.run(lambda: None)
    finally:
        strategy.close()


@pytest.mark.parametrize("what", ["parameter", "submodule"])
def test_a_parameter_or_module_registered_through_a_submodule_is_refused(what: str) -> None:
    def add(m: nn.Module) -> None:
        if what == "parameter":
            m[3].register_parameter("x", nn.Parameter(torch.ones(3, dtype=torch.float64)))
        else:
            m[3].add_module("x", nn.Linear(2, 2).double())
    with pytest.raises(RuntimeError, match=rf"replica 0's copy has {what} '3.x'(.|\n)*every "
                       "copy"):
        _train(_scaled, add)


# 7. a parametrization through a submodule ---------------------------------------------------
def test_spectral_norm_through_a_submodule_is_refused_pointing_at_apply() -> None:
    with pytest.raises(RuntimeError, match=r"subs = \[c.get_submodule\('2'\) for c in "
                       r"model.replicas\]; model.apply\("):
        _train(_mlp, lambda m: parametrizations.spectral_norm(m[2]))


def test_spectral_norm_through_apply_as_the_message_says_is_one_devices() -> None:
    def on_one(m: nn.Module) -> None:
        if isinstance(m, mirrored.MirroredModule):
            subs = [c.get_submodule("2") for c in m.replicas]
            m.apply(lambda x: parametrizations.spectral_norm(x) if x in subs else None)
        else:
            parametrizations.spectral_norm(m[2])  # type: ignore[index]
    net, model = _train(_mlp, on_one)
    _same(net, model)
    for c in model.replicas:
        torch.testing.assert_close(c[2].parametrizations.weight[0]._u,
                                   net[2].parametrizations.weight[0]._u, rtol=0, atol=1e-12)
