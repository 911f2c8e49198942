"""Cluster resolvers: where this process sits in a multi-worker job (TF:
``tf.distribute.cluster_resolver``)."""

from ._src.cluster.resolver import ClusterResolver as ClusterResolver
from ._src.cluster.resolver import SimpleClusterResolver as SimpleClusterResolver
from ._src.cluster.resolver import TFConfigClusterResolver as TFConfigClusterResolver
from ._src.cluster.resolver import TorchrunClusterResolver as TorchrunClusterResolver
from ._src.cluster.resolver import default_cluster_resolver as default_cluster_resolver
from ._src.cluster.spec import ClusterSpec as ClusterSpec

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "default_cluster_resolver",
]
