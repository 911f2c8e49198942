"""The library's own exception classes.

Each subclasses :class:`MirroredError` and the builtin that describes the kind of
failure, so ``except ValueError`` and ``except MirroredError`` both catch them.
"""

from __future__ import annotations

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "GradientHookWarning",
    "LossScalingWarning",
    "MirroredError",
    "ReplicaAbortedError",
    "ReplicaDivergenceError",
    "StartupError",
    "WorkerFailureError",
]


class MirroredError(Exception):
    """Base class of every error that :mod:`mirrored` defines itself."""


class CollectiveMismatchError(MirroredError, ValueError):
    """Replicas broke the collective contract: a different call, op, structure,
    shape or dtype, or one replica returned while others waited in a collective.

    ``workers`` holds the indices of the workers that differ from a majority that
    agrees (three or more workers; empty when no majority tells who is odd).
    """

    def __init__(self, message: str, workers: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.workers = workers


class CollectiveTimeoutError(MirroredError, TimeoutError):
    """Some replicas did not reach a collective within its timeout."""


class ReplicaAbortedError(MirroredError, RuntimeError):
    """A replica was released from a collective because another replica failed.

    ``strategy.run`` raises the other replica's exception, not this one.
    """


class ReplicaDivergenceError(MirroredError, RuntimeError):
    """The replicas would train something other than one device: the copies of a
    mirrored model differ (a parameter or buffer changed outside the optimizer's
    step on some replica), or a replica changed its local gradients between
    ``backward()`` and the optimizer's all-reduce (``clip_grad_norm_`` before
    ``step()``). The message names the parameter, the replicas and the fix."""


class WorkerFailureError(MirroredError, RuntimeError):
    """A peer worker of a multi-worker job died (its process or connection is gone).

    ``workers`` holds the indices of the failed workers (empty when unknown).
    """

    def __init__(self, message: str, workers: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.workers = workers


class StartupError(MirroredError, RuntimeError):
    """A multi-worker job could not start: the rendezvous was unreachable or held by
    another program, the workers disagree on the job (its size, their ranks), or not
    every worker joined within the timeout.

    ``workers`` holds the indices of the workers the error is about (empty when unknown).
    """

    def __init__(self, message: str, workers: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.workers = workers


class LossScalingWarning(UserWarning):
    """No replica called ``compute_average_loss`` since a mirrored optimizer's last
    step on several replicas (seen on the steps the divergence check reads: the
    first and every 8th with ``check="cheap"``). The step sums the replicas'
    gradients, so a loss averaged per replica (``loss.mean()``, a criterion's default
    ``reduction="mean"``, as with DDP) trains with N times the gradients of one
    device. A loss already divided by the global batch size is right: silence this
    with
    ``warnings.filterwarnings("ignore", category=mirrored.LossScalingWarning)``."""


class GradientHookWarning(UserWarning):
    """A module given to ``mirror`` on several replicas has parameters with gradient
    hooks (``Tensor.register_hook``). Each copy's hook runs on its replica's local
    gradient, before the step's all-reduce sums them, where on one device it runs on
    the whole batch's: a hook linear in the gradient (``g * s``) gives one device's
    result, any other (``g.clamp(-c, c)``, ``g.sign()``, a normalisation) trains
    another model. Clip with ``optimizer.step(clip_grad_value=c)`` or
    ``step(clip_grad_norm=c)`` instead; for linear hooks, silence this with
    ``warnings.filterwarnings("ignore", category=mirrored.GradientHookWarning)``."""
