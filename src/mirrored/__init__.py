"""mirrored: TF's MirroredStrategy model of synchronous data parallelism, for PyTorch.

Example:
    >>> import torch, mirrored
    >>> strategy = mirrored.MirroredStrategy(["CPU:0", "CPU:1"])
    >>> def step_fn():
    ...     return torch.tensor(mirrored.get_replica_context().replica_id_in_sync_group)
    >>> strategy.reduce("SUM", strategy.run(step_fn), axis=None)
    tensor(1)
"""

from . import cluster_resolver as cluster_resolver
from . import elastic as elastic
from . import experimental as experimental
from . import testing as testing
from ._src.comm.cross_device_ops import CrossDeviceOps as CrossDeviceOps
from ._src.comm.cross_device_ops import ReductionToOneDevice as ReductionToOneDevice
from ._src.context import experimental_set_strategy as experimental_set_strategy
from ._src.context import get_cross_replica_context as get_cross_replica_context
from ._src.context import get_replica_context as get_replica_context
from ._src.context import get_strategy as get_strategy
from ._src.context import has_strategy as has_strategy
from ._src.context import in_cross_replica_context as in_cross_replica_context
from ._src.data import DistributedDataset as DistributedDataset
from ._src.data import DistributedDatasetsFromFunction as DistributedDatasetsFromFunction
from ._src.data import DistributedIterator as DistributedIterator
from ._src.data import InputContext as InputContext
from ._src.data import InputOptions as InputOptions
from ._src.data import InputReplicationMode as InputReplicationMode
from ._src.errors import CollectiveMismatchError as CollectiveMismatchError
from ._src.errors import CollectiveTimeoutError as CollectiveTimeoutError
from ._src.errors import GradientHookWarning as GradientHookWarning
from ._src.errors import LossScalingWarning as LossScalingWarning
from ._src.errors import MirroredError as MirroredError
from ._src.errors import ReplicaDivergenceError as ReplicaDivergenceError
from ._src.errors import StartupError as StartupError
from ._src.errors import WorkerFailureError as WorkerFailureError
from ._src.loss import compute_average_loss as compute_average_loss
from ._src.loss import scale_regularization_loss as scale_regularization_loss
from ._src.reduce_op import ReduceOp as ReduceOp
from ._src.strategies.extended import StrategyExtended as StrategyExtended
from ._src.strategies.mirrored import MirroredStrategy as MirroredStrategy
from ._src.strategies.mirrored import OneDeviceStrategy as OneDeviceStrategy
from ._src.strategies.multi_worker import (
    MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from ._src.strategies.replica_context import ReplicaContext as ReplicaContext
from ._src.strategies.strategy import Strategy as Strategy
from ._src.training.checkpoint import CheckpointManager as CheckpointManager
from ._src.training.module import MirroredModule as MirroredModule
from ._src.training.optimizer import MirroredOptimizer as MirroredOptimizer
from ._src.training.preemption import PreemptionCheckpointHandler as PreemptionCheckpointHandler
from ._src.training.preemption import TerminationConfig as TerminationConfig
from ._src.values import DistributedValues as DistributedValues
from ._src.values import Mirrored as Mirrored
from ._src.values import PerReplica as PerReplica
from ._src.values import ValueContext as ValueContext

__version__ = "0.1.0"

__all__ = [
    "CheckpointManager",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CrossDeviceOps",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "MirroredModule",
    "MirroredOptimizer",
    "ReplicaDivergenceError",
    "GradientHookWarning",
    "LossScalingWarning",
    "PreemptionCheckpointHandler",
    "TerminationConfig",
    "StartupError",
    "WorkerFailureError",
    "cluster_resolver",
    "elastic",
    "testing",
    "ReductionToOneDevice",
    "compute_average_loss",
    "scale_regularization_loss",
    "experimental",
    "DistributedValues",
    "MirroredError",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "PerReplica",
    "Mirrored",
    "ReduceOp",
    "ReplicaContext",
    "Strategy",
    "StrategyExtended",
    "ValueContext",
    "experimental_set_strategy",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]
