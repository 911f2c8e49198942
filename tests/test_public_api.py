"""Snapshot of the public surface: a change here is a deliberate API change."""

import mirrored

EXPECTED = {
    "CheckpointManager",
    "MultiWorkerMirroredStrategy",
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
    "LossScalingWarning",
    "GradientHookWarning",
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
    "Mirrored",
    "MirroredError",
    "MirroredStrategy",
    "OneDeviceStrategy",
    "PerReplica",
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
}


def test_public_names_snapshot():
    assert set(mirrored.__all__) == EXPECTED
    for name in set(mirrored.__all__) - {"experimental", "cluster_resolver", "elastic", "testing"}:
        assert getattr(mirrored, name).__module__.startswith("mirrored")
    assert set(mirrored.experimental.__all__) == {"CommunicationImplementation",
                                                  "CommunicationOptions"}
    assert set(mirrored.elastic.__all__) == {"ElasticMirroredStrategy", "ElasticTrainer",
                                             "Lighthouse", "StepInfo"}


def test_public_modules_only_reexport():
    public = {n for n in vars(mirrored) if not n.startswith("_")}
    assert public - set(mirrored.__all__) == set()


def test_error_hierarchy():
    assert issubclass(mirrored.CollectiveMismatchError, mirrored.MirroredError)
    assert issubclass(mirrored.CollectiveMismatchError, ValueError)
    assert issubclass(mirrored.CollectiveTimeoutError, mirrored.MirroredError)
    assert issubclass(mirrored.CollectiveTimeoutError, TimeoutError)
    assert issubclass(mirrored.ReplicaDivergenceError, mirrored.MirroredError)
    assert issubclass(mirrored.ReplicaDivergenceError, RuntimeError)
