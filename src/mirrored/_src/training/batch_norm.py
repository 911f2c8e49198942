"""Cross-replica BatchNorm: `MirroredBatchNorm` normalizes with the statistics of the
global batch, across the replicas of a ``strategy.run`` (torch's ``SyncBatchNorm``
works only across processes).

Each replica shifts its ``x`` by its own per-channel mean ``s`` (detached; 0 for
no rows) and sums ``d = x - s`` and ``d * d + 2 s d`` per channel; one all-reduce
(SUM), in float64, of those sums with ``n * s``, ``n * s * s`` and the count ``n``,
packed into one tensor, gives the global mean and biased variance (see `_moments`).
Any constant shift leaves the formulas exact; the replica's mean keeps them well
conditioned, where ``E[x^2] - mean^2`` of raw sums cancels catastrophically when a
channel's mean is large next to its standard deviation (a year, a timestamp). The
all-reduce is differentiable (its backward is the SUM all-reduce of the upstream
gradients), so the backward pass is exact, also for uneven and empty per-replica
batches; it costs one more collective per layer.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .. import context
from ..runtime.random import recomputing_for_a_replica

__all__ = ["MirroredBatchNorm", "MirroredBatchNorm1d", "MirroredBatchNorm2d",
           "MirroredBatchNorm3d", "convert_batch_norm"]


class MirroredBatchNorm(_BatchNorm):
    """BatchNorm over the global batch of all replicas, for inputs ``[N, C, ...]``.

    In training mode inside ``strategy.run`` it normalizes with the global mean and
    biased variance and updates the running statistics as torch's BatchNorm does
    over the whole global batch (unbiased variance with the global count,
    ``momentum``, ``num_batches_tracked``), so every replica's copy stays equal.
    Elsewhere (evaluation mode, or called outside ``run``) it is torch's BatchNorm.
    The parameters, buffers and state dict keys are those of ``BatchNorm1d/2d/3d``.

    Example:
        >>> import torch, mirrored
        >>> from mirrored._src.training.module import mirror
        >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
        >>> bn = mirror(strategy, torch.nn.BatchNorm1d(1, affine=False), sync_batch_norm=True)
        >>> x = mirrored.PerReplica([torch.tensor([[0.0], [2.0]]), torch.tensor([[4.0]])])
        >>> y = strategy.run(bn, args=(x,))
        >>> torch.cat(y.values).squeeze(1)  # normalized by mean 2 and variance 8/3
        tensor([-1.2247,  0.0000,  1.2247])
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"MirroredBatchNorm expects an input [batch, channels, ...] with "
                             f"at least 2 dimensions; got shape {tuple(input.shape)}")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        ctx = context.current_replica_context()
        batch_stats = self.training or (self.running_mean is None and self.running_var is None)
        if ctx is None or ctx.num_replicas_in_sync == 1 or not batch_stats:
            if (ctx is None and batch_stats and torch._C._current_graph_task_id() != -1
                    and recomputing_for_a_replica(False)):
                raise RuntimeError(_RECOMPUTED)
            local: torch.Tensor = super().forward(input)
            return local
        self._check_input_dim(input)
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        accumulate = (torch.float32 if input.dtype in (torch.float16, torch.bfloat16)
                      else input.dtype)
        x = input.to(accumulate)
        rows = input.numel() // max(channels, 1)
        # This replica's mean (0 for no rows), detached: the shift s of the sums.
        shift = x.detach().sum(dims, keepdim=True).div_(max(rows, 1))
        d = x - shift
        s = shift.view(channels).to(torch.float64)
        a = d.sum(dims).to(torch.float64)
        ns = s * rows
        packed = torch.cat([a, (d * d).sum(dims).to(torch.float64).addcmul_(s, a, value=2),
                            ns, ns * s, s.new_full((1,), rows)])
        total = ctx.all_reduce("SUM", packed)
        n = float(total[4 * channels].item())
        if n <= 1:
            raise ValueError("MirroredBatchNorm expects more than 1 value per channel across "
                             f"all replicas when training; got {int(n)} (input shape "
                             f"{tuple(input.shape)} on replica {ctx.replica_id_in_sync_group})")
        mean, var = _moments(total[:4 * channels].view(4, channels), n)
        if self.training and self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), n)
        # y = (x - mean) * scale + bias, as d * scale + (bias - (mean - s) * scale): no
        # large values meet in the input's dtype when the mean is large.
        scale = (var + self.eps).rsqrt()
        if self.weight is not None:
            scale = scale * self.weight.to(torch.float64)
        offset = (s - mean) * scale
        if self.bias is not None:
            offset = offset + self.bias.to(torch.float64)
        y = torch.addcmul(offset.to(accumulate).view_as(shift), d,
                          scale.to(accumulate).view_as(shift))
        return y.to(input.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        factor: float | torch.Tensor = 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                # Compiled, a float read from the count is frozen at its value when the
                # graph was built (Inductor: 1/2 at every later step), so a tensor there.
                factor = (self.num_batches_tracked.to(torch.float64).reciprocal()
                          if torch.compiler.is_compiling()
                          else 1.0 / float(self.num_batches_tracked))
        if self.running_mean is not None:
            _blend(self.running_mean, mean, factor)
        if self.running_var is not None:
            _blend(self.running_var, var * (n / (n - 1)), factor)  # (unbiased)


def _moments(total: torch.Tensor, n: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The global mean and biased variance per channel, in float64, from the all-reduced
    rows ``sum(d)``, ``sum(d * d) + 2 s sum(d)``, ``n_i s`` and ``n_i s^2`` (``[4, C]``,
    each summed over the replicas; ``d = x - s``, ``s`` replica ``i``'s shift, ``n_i``
    its count; ``n`` the global count).

    With ``u = sum(n_i s) / n``, ``m = sum(d) / n`` and ``w = sum(n_i s^2) / n - u^2``
    (the spread of the shifts), the mean is ``u + m`` and the variance
    ``(sum(d * d) + 2 sum(s sum(d))) / n - m (2 u + m) + w``: only float64 per-channel
    terms cancel there (``w``, to about ``eps * (mean / std)^2``). Differentiable in the
    sums of ``d`` (the shifts are constants), so the backward pass is exact.
    """
    u, q = total[2:].detach().div(n).unbind(0)
    a, b = total[:2].div(n).unbind(0)
    mean = a + u
    var = torch.addcmul(b + torch.addcmul(q, u, u, value=-1), a, mean + u, value=-1)
    return mean, var.clamp(min=0)


_RECOMPUTED = (
    "sync BatchNorm (mirror(..., sync_batch_norm=True)) was computed during a backward "
    "pass on a thread that runs no replica, while a strategy.run of several replicas was "
    "in progress: torch.utils.checkpoint(use_reentrant=True) recomputing its segment on "
    "torch's autograd thread of a CUDA device. There it has no replica context, so it "
    "would normalize with this replica's statistics instead of the global batch's, and "
    "the gradients would be silently wrong. Keep sync BatchNorm layers out of "
    "checkpointed segments")


def _blend(running: torch.Tensor, new: torch.Tensor, factor: float | torch.Tensor) -> None:
    """``running = (1 - factor) * running + factor * new``, in place, as torch does."""
    if isinstance(factor, torch.Tensor):
        running.mul_(1 - factor).add_(new.to(running.dtype) * factor)
    else:
        running.mul_(1 - factor).add_(new.to(running.dtype), alpha=factor)


class MirroredBatchNorm1d(MirroredBatchNorm, nn.BatchNorm1d):
    """`MirroredBatchNorm` that is still a ``BatchNorm1d`` (``isinstance`` tests in user
    code, such as freezing every BatchNorm for fine-tuning, keep finding it)."""


class MirroredBatchNorm2d(MirroredBatchNorm, nn.BatchNorm2d):
    """`MirroredBatchNorm` that is still a ``BatchNorm2d`` (see `MirroredBatchNorm1d`)."""


class MirroredBatchNorm3d(MirroredBatchNorm, nn.BatchNorm3d):
    """`MirroredBatchNorm` that is still a ``BatchNorm3d`` (see `MirroredBatchNorm1d`)."""


_KINDS: dict[type, type[MirroredBatchNorm]] = {
    nn.BatchNorm1d: MirroredBatchNorm1d, nn.BatchNorm2d: MirroredBatchNorm2d,
    nn.BatchNorm3d: MirroredBatchNorm3d}


def _converted(bn: _BatchNorm) -> MirroredBatchNorm:
    kind = next((k for base, k in _KINDS.items() if isinstance(bn, base)), MirroredBatchNorm)
    new = kind(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
    # Share the parameter and buffer objects: references the user holds stay valid.
    new.weight, new.bias = bn.weight, bn.bias
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        setattr(new, name, getattr(bn, name))
    new.train(bn.training)
    return new


def convert_batch_norm(module: nn.Module) -> nn.Module:
    """Replaces every torch BatchNorm layer of ``module`` (in place; the root is
    returned replaced) by a `MirroredBatchNorm` sharing its parameters and buffers.

    Example:
        >>> import torch
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        >>> type(convert_batch_norm(net)[1]).__name__, isinstance(net[1], torch.nn.BatchNorm1d)
        ('MirroredBatchNorm1d', True)
    """
    if isinstance(module, _BatchNorm) and not isinstance(module, MirroredBatchNorm):
        return _converted(module)
    for name, child in module.named_children():
        new = convert_batch_norm(child)
        if new is not child:
            setattr(module, name, new)
    return module
